package main

import (
	"errors"
	"flag"
	"fmt"
)

func cmdCheck(args []string, io stdio) int {
	fs := flag.NewFlagSet("check", flag.ContinueOnError)
	fs.SetOutput(io.err)
	path := fs.String("config", defaultConfigPath, "config file")
	printCfg := fs.Bool("print", false, "print the effective configuration as TOML (secrets hidden)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	cfg, err := loadConfig(*path)
	var errs configErrors
	switch {
	case errors.As(err, &errs):
		for _, e := range errs {
			fmt.Fprintf(io.err, "%s: %v\n", *path, e)
		}
		fmt.Fprintf(io.err, "%d problem(s)\n", len(errs))
		return 1
	case err != nil:
		fmt.Fprintf(io.err, "proxyd check: %v\n", err)
		return 1
	}
	if _, _, err := cfg.API.ResolveCredential(io.getenv); err != nil {
		err = sectionProblems("api", err) // the key with its section, as the file writes it
		// Not fatal here: under systemd the credential may come from
		// $CREDENTIALS_DIRECTORY or the unit's environment only.
		fmt.Fprintf(io.err, "%s: warning: %v\n", *path, err)
	}
	if *printCfg {
		fmt.Fprint(io.out, printConfig(cfg))
		return 0
	}
	fmt.Fprintf(io.out, "%s: ok (%d listeners)\n", *path, len(cfg.Listener))
	return 0
}
