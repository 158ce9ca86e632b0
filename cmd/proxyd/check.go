package main

import (
	"errors"
	"flag"
	"fmt"

	"github.com/proxyd/proxyd/agent"
)

func cmdCheck(args []string, io stdio) int {
	fs := flag.NewFlagSet("check", flag.ContinueOnError)
	fs.SetOutput(io.err)
	path := fs.String("config", defaultConfigPath, "config file")
	printCfg := fs.Bool("print", false, "print the effective configuration as TOML (secrets hidden)")
	if code, ok := parseFlags(fs, args, io); !ok {
		return code
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
	if f := cfg.Admin.TokenFile; f != "" {
		if _, err := agent.ReadTokenFile(f); err != nil {
			// A warning for the same reason: the file may be readable only
			// by the service's own user.
			fmt.Fprintf(io.err, "%s: warning: admin.token_file: %v\n", *path, err)
		}
	}
	var unread configErrors
	if errors.As(cfg.readPasswordFiles(), &unread) {
		for _, e := range unread { // warnings for the reason above
			fmt.Fprintf(io.err, "%s: warning: %v\n", *path, e)
		}
	}
	if *printCfg {
		fmt.Fprint(io.out, printConfig(cfg))
		return 0
	}
	fmt.Fprintf(io.out, "%s: ok (%d listeners)\n", *path, len(cfg.Listener))
	return 0
}

// parseFlags parses a command's flags and refuses arguments after them
// (`proxyd check other.toml` would otherwise check the default config and
// say ok). When it is not ok the command exits with code: 0 after -h (the
// usage was asked for), 2 for a mistake, said on stderr.
func parseFlags(fs *flag.FlagSet, args []string, io stdio) (code int, ok bool) {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0, false
		}
		return 2, false
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(io.err, "proxyd %s: unexpected argument %q\n", fs.Name(), fs.Arg(0))
		return 2, false
	}
	return 0, true
}
