package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

// cmdRun is `proxyd run`: SIGINT/SIGTERM (ctx) drain and stop, SIGHUP
// reloads the config file.
func cmdRun(ctx context.Context, args []string, io stdio) int {
	fs := flag.NewFlagSet("run", flag.ContinueOnError)
	fs.SetOutput(io.err)
	path := fs.String("config", defaultConfigPath, "config file")
	if code, ok := parseFlags(fs, args, io); !ok {
		return code
	}
	cfg, err := loadConfig(*path)
	if err != nil {
		fmt.Fprintf(io.err, "proxyd: %s:\n%v\n", *path, err)
		return 1
	}
	logger, logs := newLogger(cfg.Log, io.err)
	d, err := newDaemon(cfg, daemonOptions{getenv: io.getenv, logger: logger, logs: logs})
	if err != nil {
		fmt.Fprintf(io.err, "proxyd: %v\n", err)
		return 1
	}

	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	reloads := make(chan struct{})
	go func() {
		defer close(reloads)
		for {
			select {
			case <-runCtx.Done():
				return
			case <-hup:
			}
			if runCtx.Err() != nil { // SIGTERM and SIGHUP together: stopping wins
				return
			}
			if err := d.ReloadFile(*path); err != nil {
				logger.Error("reload refused; keeping the running config", "config", *path, "err", err)
			}
		}
	}()
	err = d.Run(runCtx)
	stop()
	<-reloads
	if err != nil {
		fmt.Fprintf(io.err, "proxyd: %v\n", err)
		return 1
	}
	return 0
}
