package main

import (
	"errors"
	"fmt"
	"net"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/BurntSushi/toml"

	"github.com/proxyd/proxyd/agent"
	"github.com/proxyd/proxyd/forward"
	"github.com/proxyd/proxyd/forward/socks5"
	"github.com/proxyd/proxyd/pool"
)

// config is the file format: each section is the Config of the package that
// owns those options, declared there once with its TOML keys, defaults
// (DefaultConfig) and checks (Validate, naming the keys as written). The
// daemon adds only what spans sections: [state], [admin], [log], [shutdown],
// and a listener's services, kind and upstream.
type config struct {
	API      agent.Config       `toml:"api"`
	Poll     agent.PollConfig   `toml:"poll"`
	State    stateConfig        `toml:"state"`
	Pool     pool.Config        `toml:"pool"`
	Manage   agent.ManageConfig `toml:"manage"`
	Listener []listenerConfig   `toml:"listener"`
	Admin    adminConfig        `toml:"admin"`
	Log      logConfig          `toml:"log"`
	Shutdown shutdownConfig     `toml:"shutdown"`
}

type stateConfig struct {
	Dir string `toml:"dir"`
}

// listenerConfig is one [[listener]]: the forwarding options of
// forward.Config, and which upstreams of the pool feed it.
type listenerConfig struct {
	forward.Config
	Services []int  `toml:"services"` // service IDs; empty = all
	Kind     string `toml:"kind"`     // "fpr", "ppr" or "" for both
	Upstream string `toml:"upstream"` // how upstreams are dialed: http | socks5; default: the protocol

	// users is Users with every password_file read (readPasswordFiles),
	// what the listener checks; nil until read. Comparing two configs
	// compares it too, so a reload restarts a listener whose password file
	// changed, as it does one whose config did.
	users []forward.User
}

// served is the listener's forward config as the listener is built from it:
// users with their password files read.
func (lc listenerConfig) served() forward.Config {
	fc := lc.Config
	if lc.users != nil {
		fc.Users = lc.users
	}
	return fc
}

// readPasswordFiles reads the password_file of every local user, as the
// daemon does at start and at every reload (as with the other secret
// files); check reads them to warn early.
func (c *config) readPasswordFiles() error {
	var errs configErrors
	c.Listener = slices.Clone(c.Listener) // the caller's (or the running config's) array stays as it was
	for i := range c.Listener {
		lc := &c.Listener[i]
		lc.users = nil
		if !slices.ContainsFunc(lc.Users, func(u forward.User) bool { return u.PasswordFile != "" }) {
			continue
		}
		users := slices.Clone(lc.Users)
		for j := range users {
			u := &users[j]
			if u.PasswordFile == "" {
				continue
			}
			key := fmt.Sprintf("listener[%d].user[%d].password_file", i, j)
			pw, err := agent.ReadSecretFile(u.PasswordFile)
			switch {
			case err != nil:
				errs = append(errs, keyError{Key: key, Msg: err.Error(), err: err})
			case len(pw) > socks5.MaxCredentialBytes:
				errs = append(errs, keyError{Key: key, Msg: fmt.Sprintf("reading %s: the password must be at most %d bytes (RFC 1929)", u.PasswordFile, socks5.MaxCredentialBytes)})
			}
			u.Password, u.PasswordFile = pw, ""
		}
		lc.users = users
	}
	if len(errs) > 0 {
		return errs
	}
	return nil
}

type adminConfig struct {
	Address   string `toml:"address"`
	Token     string `toml:"token,secret"`
	TokenFile string `toml:"token_file"`
}

type logConfig struct {
	Level  string `toml:"level"`  // debug | info | warn | error
	Format string `toml:"format"` // text | json
}

type shutdownConfig struct {
	DrainTimeout time.Duration `toml:"drain_timeout"`
}

const defaultConfigPath = "/etc/proxyd/config.toml"

// defaultConfig is what an empty file means. Listeners are added after
// decoding: each [[listener]] element starts from defaultListener, and a
// file with none gets defaultListeners.
func defaultConfig() config {
	return config{
		API:      agent.DefaultConfig(),
		Poll:     agent.DefaultPollConfig(),
		State:    stateConfig{Dir: "/var/lib/proxyd"},
		Pool:     pool.DefaultConfig(),
		Manage:   agent.DefaultManageConfig(),
		Admin:    adminConfig{Address: "127.0.0.1:9900"},
		Log:      logConfig{Level: "info", Format: "text"},
		Shutdown: shutdownConfig{DrainTimeout: 30 * time.Second},
	}
}

// defaultListener is the starting value of every [[listener]] element, so
// that defaults apply to each element and are not merged by position.
func defaultListener() listenerConfig {
	return listenerConfig{Config: forward.DefaultConfig()}
}

// defaultListeners are used when the file has no [[listener]] at all.
func defaultListeners() []listenerConfig {
	h := defaultListener()
	h.Name, h.Protocol, h.Address, h.Upstream = "http", "http", "127.0.0.1:8080", "http"
	s := defaultListener()
	s.Name, s.Protocol, s.Address, s.Upstream = "socks", "socks5", "127.0.0.1:1080", "socks5"
	return []listenerConfig{h, s}
}

// listenerKey names key of the listener called name as the file writes
// it (listener[0].address), for errors found after the file was read.
func listenerKey(ls []listenerConfig, name, key string) string {
	for i := range ls {
		if ls[i].Name == name {
			return fmt.Sprintf("listener[%d].%s", i, key)
		}
	}
	return "listener " + name + " " + key
}

// configErrors is every problem of a config file.
type configErrors []keyError

func (e configErrors) Error() string {
	lines := make([]string, len(e))
	for i, k := range e {
		lines[i] = k.Error()
	}
	return strings.Join(lines, "\n")
}

// parseConfig decodes and validates a config file's text: the file is
// decoded onto the defaults, then each package checks its section and the
// daemon what spans sections. On problems the error is a configErrors
// listing all of them.
func parseConfig(text string) (config, error) {
	var tree map[string]any
	if _, err := toml.Decode(text, &tree); err != nil {
		// The parser quotes the text it could not read, which may be a
		// secret written without quotes (token = s3cret): messages reach the
		// journal and GET /events, so quoted text is left out.
		var perr toml.ParseError
		if errors.As(err, &perr) {
			return config{}, configErrors{{Msg: fmt.Sprintf("syntax error at line %d: %s", perr.Position.Line, redactQuoted(perr.Message))}}
		}
		return config{}, configErrors{{Msg: "syntax error: " + redactQuoted(err.Error())}}
	}
	cfg := defaultConfig()
	d := decoder{newElem: func(t reflect.Type) reflect.Value {
		if t == reflect.TypeFor[listenerConfig]() {
			return reflect.ValueOf(defaultListener())
		}
		return reflect.New(t).Elem()
	}}
	d.decodeStruct("", tree, reflect.ValueOf(&cfg).Elem())
	if _, ok := tree["listener"]; !ok {
		cfg.Listener = defaultListeners()
	} else if len(cfg.Listener) == 0 && !slices.ContainsFunc(d.errs, func(e keyError) bool { return e.Key == "listener" }) {
		// (A listener key that is not an array was said so already.)
		d.fail("listener", "no listener: remove the key for the two default listeners, or add a [[listener]]")
	}
	errs := configErrors(d.errs)
	// The keys whose validation is not said: one that could not be
	// decoded holds its default, and saying it is also invalid would only
	// repeat the problem; an upstream the file does not write takes the
	// protocol's value, whose own check speaks for it.
	quiet := make(map[string]bool, len(d.errs))
	for _, e := range d.errs {
		quiet[e.Key] = true
	}
	for i := range cfg.Listener {
		if key := fmt.Sprintf("listener[%d].upstream", i); !d.written[key] {
			cfg.Listener[i].Upstream = cfg.Listener[i].Protocol // a listener dials its own protocol unless told
			quiet[key] = true
		}
	}
	for _, e := range cfg.validate() {
		if !quiet[e.Key] {
			errs = append(errs, e)
		}
	}
	if len(errs) > 0 {
		return cfg, errs
	}
	return cfg, nil
}

func loadConfig(path string) (config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return config{}, fmt.Errorf("reading config: %w", err)
	}
	return parseConfig(string(b))
}

// redactQuoted replaces every double-quoted part of a parser message.
func redactQuoted(msg string) string {
	return quotedText.ReplaceAllString(msg, `"…"`)
}

var quotedText = regexp.MustCompile(`"[^"]*"`)

// validate asks each package to check its section, then checks what the
// daemon itself declares and what spans sections. Every problem names its
// key as the file writes it.
func (c *config) validate() configErrors {
	var errs configErrors
	fail := func(key, format string, args ...any) {
		errs = append(errs, keyError{Key: key, Msg: fmt.Sprintf(format, args...)})
	}
	errs = append(errs, sectionProblems("api", c.API.Validate())...)
	errs = append(errs, sectionProblems("poll", c.Poll.Validate())...)
	errs = append(errs, sectionProblems("pool", c.Pool.Validate())...)
	errs = append(errs, sectionProblems("manage", c.Manage.Validate())...)
	if c.State.Dir == "" {
		fail("state.dir", "required")
	}
	switch c.Log.Level {
	case "debug", "info", "warn", "error":
	default:
		fail("log.level", "must be debug, info, warn or error, got %q", c.Log.Level)
	}
	switch c.Log.Format {
	case "text", "json":
	default:
		fail("log.format", "must be text or json, got %q", c.Log.Format)
	}
	if c.Shutdown.DrainTimeout < 0 {
		fail("shutdown.drain_timeout", "must not be negative, got %s", c.Shutdown.DrainTimeout)
	}
	if c.Admin.Address != "" {
		host, _, err := net.SplitHostPort(c.Admin.Address)
		if err != nil {
			fail("admin.address", "must be host:port: %v", err)
		} else if !forward.IsLoopbackHost(host) && c.Admin.Token == "" && c.Admin.TokenFile == "" {
			fail("admin.address", "%s is not a loopback address: set admin.token or admin.token_file", c.Admin.Address)
		}
	}
	if c.Admin.Token != "" && !agent.HeaderSafe(c.Admin.Token) {
		fail("admin.token", "holds whitespace or control characters")
	}
	if c.Admin.Token != "" && c.Admin.TokenFile != "" {
		fail("admin.token_file", "set either token or token_file, not both")
	}
	errs = append(errs, c.validateListeners()...)
	return errs
}

// sectionProblems turns a package's Validate error into keyErrors under
// prefix. Packages join one error per problem, each starting with its key
// as written in the file ("retry_timeout: must be positive").
func sectionProblems(prefix string, err error) configErrors {
	if err == nil {
		return nil
	}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		var out configErrors
		for _, e := range j.Unwrap() {
			out = append(out, sectionProblems(prefix, e)...)
		}
		return out
	}
	key, msg, ok := strings.Cut(err.Error(), ": ")
	if !ok || strings.ContainsAny(key, " \t") {
		return configErrors{{Key: prefix, Msg: err.Error()}}
	}
	return configErrors{{Key: prefix + "." + key, Msg: msg}}
}

// validateListeners checks the keys the daemon adds to a listener, what
// spans listeners (names, addresses, the admin server's address among
// theirs) and each listener's forward.Config.
func (c *config) validateListeners() configErrors {
	var errs configErrors
	fail := func(key, format string, args ...any) {
		errs = append(errs, keyError{Key: key, Msg: fmt.Sprintf(format, args...)})
	}
	names := map[string]int{}
	addrs := map[string]int{}
	for i := range c.Listener {
		l := &c.Listener[i]
		p := fmt.Sprintf("listener[%d]", i)
		errs = append(errs, sectionProblems(p, l.Config.Validate())...)
		if j, dup := names[l.Name]; dup && l.Name != "" {
			fail(p+".name", "%q is already the name of listener[%d]", l.Name, j)
		} else {
			names[l.Name] = i
		}
		switch l.Upstream {
		case "http", "socks5":
		default:
			fail(p+".upstream", "must be http or socks5, got %q", l.Upstream)
		}
		switch l.Kind {
		case "", "fpr", "ppr":
		default:
			fail(p+".kind", "must be \"fpr\", \"ppr\" or \"\", got %q", l.Kind)
		}
		if _, _, err := net.SplitHostPort(l.Address); err == nil {
			if j, dup := addrs[l.Address]; dup && !strings.HasSuffix(l.Address, ":0") {
				fail(p+".address", "%s is already the address of listener[%d]", l.Address, j)
			}
			addrs[l.Address] = i
		}
		for j, id := range l.Services {
			switch {
			case id <= 0:
				fail(fmt.Sprintf("%s.services[%d]", p, j), "service IDs are positive numbers, got %d", id)
			case len(c.API.Services) > 0 && !slices.Contains(c.API.Services, id):
				fail(p+".services", "service %d is not in api.services", id)
			}
		}
	}
	if a := c.Admin.Address; !strings.HasSuffix(a, ":0") {
		if i, dup := addrs[a]; dup {
			fail("admin.address", "%s is already the address of listener[%d]", a, i)
		}
	}
	return errs
}
