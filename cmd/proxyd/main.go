// Command proxyd is a local forwarding proxy daemon for customers of a proxy
// reseller: it keeps a healthy pool of the provider's upstream proxies and
// serves HTTP and SOCKS5 listeners through it. See README.md.
//
// This file holds flags, signals and the subcommand switch; the daemon itself
// is wired in daemon.go.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"syscall"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

const usage = `proxyd — a local proxy daemon over a proxy provider's pool

Usage:
  proxyd run     [-config FILE]   run the daemon (default config /etc/proxyd/config.toml)
  proxyd check   [-config FILE] [-print]
                                  validate the config; print every problem; exit 1 if any;
                                  -print: the effective configuration as TOML (secrets hidden)
  proxyd demo    [-http ADDR] [-socks ADDR] [-admin ADDR]
                                  everything on this machine, simulated provider included
  proxyd api     [-config FILE | -base-url URL] [-json] COMMAND ...
                                  every provider API endpoint (proxyd api -h lists them)
  proxyd pool    [-admin ADDR] [-json] [-events]
                                  the live pool of a running daemon, or its event log
  proxyd version
`

// stdio is what a subcommand reads and writes, so that tests can drive main.
type stdio struct {
	in       io.Reader
	out, err io.Writer
	getenv   func(string) string
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// The first signal asks for the drain; a second one, as the default
	// action of the signal again, ends the process at once.
	context.AfterFunc(ctx, stop)
	os.Exit(runMain(ctx, os.Args[1:], stdio{in: os.Stdin, out: os.Stdout, err: os.Stderr, getenv: os.Getenv}))
}

// runMain runs one subcommand and returns the exit code.
func runMain(ctx context.Context, args []string, io stdio) int {
	if len(args) == 0 {
		fmt.Fprint(io.err, usage)
		return 2
	}
	cmd, rest := args[0], args[1:]
	switch cmd {
	case "run":
		return cmdRun(ctx, rest, io)
	case "check":
		return cmdCheck(rest, io)
	case "demo":
		return cmdDemo(ctx, rest, io)
	case "api":
		return cmdAPI(ctx, rest, io)
	case "pool":
		return cmdPool(ctx, rest, io)
	case "version", "-version", "--version":
		fmt.Fprintf(io.out, "proxyd %s %s %s/%s\n", version, runtime.Version(), runtime.GOOS, runtime.GOARCH)
		return 0
	case "help", "-h", "-help", "--help":
		fmt.Fprint(io.out, usage)
		return 0
	}
	fmt.Fprintf(io.err, "proxyd: unknown command %q\n\n%s", cmd, usage)
	return 2
}
