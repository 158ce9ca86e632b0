package main

import (
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"reflect"

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
	var problems configErrors
	switch {
	case errors.As(err, &problems) && reflect.ValueOf(cfg).IsZero():
		return printProblems(io, *path, problems) // a syntax error: nothing was decoded
	case errors.As(err, &problems):
		// Decoded with problems: the secrets are read too, so that every
		// problem is said in one run.
	case err != nil:
		fmt.Fprintf(io.err, "proxyd check: %v\n", err)
		return 1
	}
	// The secrets are read as run reads them. What may differ where check
	// runs (a file only the service's user can read, or that exists only
	// under systemd; a credential only the unit's environment gives) is a
	// warning; a secret that was read and is unusable fails run too, so it
	// is a problem here. A problem already said (the same key and words,
	// as when validation and reading both find a login without password)
	// is not said again.
	said := map[string]bool{}
	for _, e := range problems {
		said[e.Error()] = true
	}
	report := func(e keyError) {
		switch {
		case said[e.Error()]:
		case environmental(e):
			fmt.Fprintf(io.err, "%s: warning: %v\n", *path, e)
		default:
			problems = append(problems, e)
		}
	}
	_, src, err := cfg.API.ResolveCredential(io.getenv)
	if err != nil {
		for _, e := range sectionProblems("api", err) { // the key with its section, as the file writes it
			report(keyError{Key: e.Key, Msg: e.Msg, err: err})
		}
	}
	if src == agent.SourceEnv {
		// Here the environment's token wins; where run has none (a unit
		// without the variable) it reads the file's credential, and
		// refuses an unusable one. Said as a warning: with the
		// variable, run uses it as check did.
		without := func(k string) string {
			if k == agent.TokenEnv {
				return ""
			}
			return io.getenv(k)
		}
		if _, _, err := cfg.API.ResolveCredential(without); err != nil && !errors.Is(err, agent.ErrNoCredential) {
			for _, e := range sectionProblems("api", err) {
				fmt.Fprintf(io.err, "%s: warning: %v (the environment's %s hides this here; run refuses it where the variable is not set)\n",
					*path, keyError{Key: e.Key, Msg: e.Msg}, agent.TokenEnv)
			}
		}
	}
	if f := cfg.Admin.TokenFile; f != "" {
		if _, err := agent.ReadTokenFile(f); err != nil {
			report(keyError{Key: "admin.token_file", Msg: err.Error(), err: err})
		}
	}
	var unread configErrors
	if errors.As(cfg.readPasswordFiles(), &unread) {
		for _, e := range unread {
			report(e)
		}
	}
	if len(problems) > 0 {
		return printProblems(io, *path, problems)
	}
	if *printCfg {
		fmt.Fprint(io.out, printConfig(cfg))
		return 0
	}
	fmt.Fprintf(io.out, "%s: ok (%d listeners)\n", *path, len(cfg.Listener))
	return 0
}

// printProblems says every problem with its key and returns check's exit
// code for them.
func printProblems(io stdio, path string, errs configErrors) int {
	for _, e := range errs {
		fmt.Fprintf(io.err, "%s: %v\n", path, e)
	}
	fmt.Fprintf(io.err, "%d problem(s)\n", len(errs))
	return 1
}

// environmental reports whether a secret's error may come from where check
// runs rather than from the config: a file this user cannot read or that
// does not exist here, or no credential in this environment.
func environmental(err error) bool {
	return errors.Is(err, fs.ErrPermission) || errors.Is(err, fs.ErrNotExist) || errors.Is(err, agent.ErrNoCredential)
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
