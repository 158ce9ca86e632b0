package main

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"time"

	"github.com/BurntSushi/toml"

	"github.com/proxyd/proxyd/agent"
	"github.com/proxyd/proxyd/forward"
)

// config is the file format of DESIGN.md §4. Each section maps onto the
// Config of the package that owns those options; see wire.go.
type config struct {
	API      apiConfig        `toml:"api"`
	Poll     pollSection      `toml:"poll"`
	State    stateConfig      `toml:"state"`
	Pool     poolSection      `toml:"pool"`
	Listener []listenerConfig `toml:"listener"`
	Admin    adminConfig      `toml:"admin"`
	Log      logConfig        `toml:"log"`
	Shutdown shutdownConfig   `toml:"shutdown"`
}

type apiConfig struct {
	BaseURL      string   `toml:"base_url"`
	Token        string   `toml:"token"`
	TokenFile    string   `toml:"token_file"`
	Login        string   `toml:"login"`
	Password     string   `toml:"password"`
	PasswordFile string   `toml:"password_file"`
	Services     []int    `toml:"services"`
	Timeout      duration `toml:"timeout"`
}

type pollSection struct {
	IPList        duration `toml:"ip_list"`
	NetworkStatus duration `toml:"network_status"`
	Usage         duration `toml:"usage"`
	Account       duration `toml:"account"`
	Jitter        float64  `toml:"jitter"`      // share of the interval, 0–0.5
	MaxBackoff    duration `toml:"max_backoff"` // cap of the backoff after failures
}

type stateConfig struct {
	Dir string `toml:"dir"`
}

type poolSection struct {
	Strategy          string   `toml:"strategy"`
	FailureThreshold  int      `toml:"failure_threshold"`
	EjectBase         duration `toml:"eject_base"`
	EjectMax          duration `toml:"eject_max"`
	MaxEjectedPercent int      `toml:"max_ejected_percent"`
	LatencyTolerance  float64  `toml:"latency_tolerance"`
	StickyIdle        duration `toml:"sticky_idle"`
	StickyMax         int      `toml:"sticky_max"`
	RotateInterval    duration `toml:"rotate_interval"`
	RotateWait        duration `toml:"rotate_wait"`
	ProbeInterval     duration `toml:"probe_interval"`
	ProbeBudget       int      `toml:"probe_budget"`
}

type userConfig struct {
	Name     string `toml:"name"`
	Password string `toml:"password"`
}

type listenerConfig struct {
	Name              string       `toml:"name"`
	Protocol          string       `toml:"protocol"`
	Address           string       `toml:"address"`
	Services          []int        `toml:"services"`
	Kind              string       `toml:"kind"`
	Upstream          string       `toml:"upstream"`
	User              []userConfig `toml:"user"`
	Allow             []string     `toml:"allow"`
	AllowDestinations []string     `toml:"allow_destinations"`
	HeaderTimeout     duration     `toml:"header_timeout"`
	DialTimeout       duration     `toml:"dial_timeout"`
	HandshakeTimeout  duration     `toml:"handshake_timeout"`
	IdleTimeout       duration     `toml:"idle_timeout"`
	Retries           int          `toml:"retries"`
	RetryTimeout      duration     `toml:"retry_timeout"`
	MaxConnections    int          `toml:"max_connections"`
	SourceAddress     string       `toml:"source_address"`
}

type adminConfig struct {
	Address   string `toml:"address"`
	Token     string `toml:"token"`
	TokenFile string `toml:"token_file"`
}

type logConfig struct {
	Level  string `toml:"level"`  // debug | info | warn | error
	Format string `toml:"format"` // text | json
}

type shutdownConfig struct {
	DrainTimeout duration `toml:"drain_timeout"`
}

const defaultConfigPath = "/etc/proxyd/config.toml"

func defaultConfig() config {
	return config{
		API: apiConfig{
			BaseURL: "https://api.example-provider.net",
			Timeout: duration(15 * time.Second),
		},
		Poll: pollSection{
			IPList:        duration(10 * time.Minute),
			NetworkStatus: duration(30 * time.Second),
			Usage:         duration(time.Minute),
			Account:       duration(15 * time.Minute),
			Jitter:        0.1,
			MaxBackoff:    duration(10 * time.Minute),
		},
		State: stateConfig{Dir: "/var/lib/proxyd"},
		Pool: poolSection{
			Strategy:          "round-robin",
			FailureThreshold:  3,
			EjectBase:         duration(30 * time.Second),
			EjectMax:          duration(5 * time.Minute),
			MaxEjectedPercent: 50,
			LatencyTolerance:  0.2,
			StickyIdle:        duration(30 * time.Minute),
			StickyMax:         100000,
			RotateInterval:    duration(30 * time.Second),
			RotateWait:        duration(5 * time.Second),
			ProbeBudget:       10,
		},
		Admin:    adminConfig{Address: "127.0.0.1:9900"},
		Log:      logConfig{Level: "info", Format: "text"},
		Shutdown: shutdownConfig{DrainTimeout: duration(30 * time.Second)},
	}
}

// defaultListener is the starting value of every [[listener]] element, so
// that defaults apply to each element and are not merged by position.
func defaultListener() listenerConfig {
	return listenerConfig{
		HeaderTimeout:    duration(10 * time.Second),
		DialTimeout:      duration(5 * time.Second),
		HandshakeTimeout: duration(10 * time.Second),
		IdleTimeout:      duration(5 * time.Minute),
		Retries:          2,
		RetryTimeout:     duration(15 * time.Second),
		MaxConnections:   4096,
	}
}

// defaultListeners are used when the file has no [[listener]] at all.
func defaultListeners() []listenerConfig {
	h := defaultListener()
	h.Name, h.Protocol, h.Address = "http", "http", "127.0.0.1:8080"
	s := defaultListener()
	s.Name, s.Protocol, s.Address = "socks", "socks5", "127.0.0.1:1080"
	return []listenerConfig{h, s}
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

// parseConfig decodes and validates a config file's text. On problems the
// error is a configErrors listing all of them.
func parseConfig(text string) (config, error) {
	var tree map[string]any
	if _, err := toml.Decode(text, &tree); err != nil {
		var perr toml.ParseError
		if errors.As(err, &perr) {
			return config{}, configErrors{{Msg: fmt.Sprintf("syntax error at line %d: %s", perr.Position.Line, perr.Message)}}
		}
		return config{}, configErrors{{Msg: "syntax error: " + err.Error()}}
	}
	cfg := defaultConfig()
	d := decoder{newElem: func(t reflect.Type) reflect.Value {
		if t == reflect.TypeOf(listenerConfig{}) {
			return reflect.ValueOf(defaultListener())
		}
		return reflect.New(t).Elem()
	}}
	d.decodeStruct("", tree, reflect.ValueOf(&cfg).Elem())
	if _, ok := tree["listener"]; !ok {
		cfg.Listener = defaultListeners()
	}
	errs := configErrors(d.errs)
	// A key that could not be decoded holds its default; saying it is
	// also invalid would only repeat the problem.
	bad := make(map[string]bool, len(d.errs))
	for _, e := range d.errs {
		bad[e.Key] = true
	}
	for _, e := range cfg.validate() {
		if !bad[e.Key] {
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

// loadValidConfig is loadConfig followed by each package's own checks
// (wireProblems): the config `run` and `check` accept.
func loadValidConfig(path string) (config, error) {
	cfg, err := loadConfig(path)
	if err != nil {
		return cfg, err
	}
	if errs := wireProblems(&cfg); len(errs) > 0 {
		return cfg, errs
	}
	return cfg, nil
}

func (c *config) validate() configErrors {
	var errs configErrors
	fail := func(key, format string, args ...any) {
		errs = append(errs, keyError{Key: key, Msg: fmt.Sprintf(format, args...)})
	}
	if c.API.BaseURL == "" {
		fail("api.base_url", "required")
	} else if !strings.HasPrefix(c.API.BaseURL, "https://") && !strings.HasPrefix(c.API.BaseURL, "http://") {
		fail("api.base_url", "must start with https:// or http://")
	}
	if c.API.Timeout.D() <= 0 {
		fail("api.timeout", "must be positive")
	}
	for i, id := range c.API.Services {
		if id <= 0 {
			fail(fmt.Sprintf("api.services[%d]", i), "service IDs are positive numbers, got %d", id)
		}
	}
	if c.API.Password != "" && c.API.PasswordFile != "" {
		fail("api.password_file", "set either password or password_file, not both")
	}
	// Slices, not maps, so that `check` lists problems in a fixed order.
	for _, p := range []struct {
		key string
		d   duration
	}{
		{"poll.ip_list", c.Poll.IPList}, {"poll.network_status", c.Poll.NetworkStatus},
		{"poll.usage", c.Poll.Usage}, {"poll.account", c.Poll.Account},
	} {
		if p.d.D() < time.Second {
			fail(p.key, "must be at least 1s, got %s", p.d)
		}
	}
	if c.Poll.Jitter < 0 || c.Poll.Jitter > 0.5 {
		fail("poll.jitter", "must be between 0 and 0.5, got %g", c.Poll.Jitter)
	}
	if c.Poll.MaxBackoff.D() < time.Second {
		fail("poll.max_backoff", "must be at least 1s, got %s", c.Poll.MaxBackoff)
	}
	switch c.Pool.Strategy {
	case "round-robin", "random", "least-conn", "latency":
	default:
		fail("pool.strategy", "must be round-robin, random, least-conn or latency, got %q", c.Pool.Strategy)
	}
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
	if c.Shutdown.DrainTimeout.D() < 0 {
		fail("shutdown.drain_timeout", "must not be negative")
	}
	if c.Admin.Address != "" {
		host, _, err := net.SplitHostPort(c.Admin.Address)
		if err != nil {
			fail("admin.address", "must be host:port: %v", err)
		} else if !forward.IsLoopbackHost(host) && c.Admin.Token == "" && c.Admin.TokenFile == "" {
			fail("admin.address", "%s is not a loopback address: set admin.token or admin.token_file", c.Admin.Address)
		}
	}
	errs = append(errs, c.validateListeners()...)
	return errs
}

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
		if l.Name == "" {
			fail(p+".name", "required")
		} else if j, dup := names[l.Name]; dup {
			fail(p+".name", "%q is already the name of listener[%d]", l.Name, j)
		} else {
			names[l.Name] = i
		}
		switch l.Protocol {
		case "http", "socks5":
		case "":
			fail(p+".protocol", "required: http or socks5")
		default:
			fail(p+".protocol", "must be http or socks5, got %q", l.Protocol)
		}
		if l.Upstream == "" {
			l.Upstream = l.Protocol
		}
		switch l.Upstream {
		case "http", "socks5", "":
		default:
			fail(p+".upstream", "must be http or socks5, got %q", l.Upstream)
		}
		switch l.Kind {
		case "", "fpr", "ppr":
		default:
			fail(p+".kind", "must be \"fpr\", \"ppr\" or \"\", got %q", l.Kind)
		}
		host, _, err := net.SplitHostPort(l.Address)
		switch {
		case l.Address == "":
			fail(p+".address", "required, e.g. \"127.0.0.1:8080\"")
		case err != nil:
			fail(p+".address", "must be host:port: %v", err)
		default:
			if j, dup := addrs[l.Address]; dup && !strings.HasSuffix(l.Address, ":0") {
				fail(p+".address", "%s is already the address of listener[%d]", l.Address, j)
			}
			addrs[l.Address] = i
			if !forward.IsLoopbackHost(host) && len(l.User) == 0 && len(l.Allow) == 0 {
				fail(p+".address", "%s is not a loopback address: configure [[listener.user]] or allow", l.Address)
			}
		}
		for j, u := range l.User {
			up := fmt.Sprintf("%s.user[%d]", p, j)
			if u.Name == "" {
				fail(up+".name", "required")
			} else if strings.Contains(u.Name, "-session-") || strings.HasPrefix(u.Name, "session-") || strings.Contains(u.Name, ":") {
				fail(up+".name", "must not contain \"-session-\" or \":\" nor start with \"session-\"")
			}
			if u.Password == "" {
				fail(up+".password", "required")
			}
		}
		for j, a := range l.Allow {
			if _, err := parsePrefix(a); err != nil {
				fail(fmt.Sprintf("%s.allow[%d]", p, j), "%v", err)
			}
		}
		for j, a := range l.AllowDestinations {
			if _, err := parsePrefix(a); err != nil {
				fail(fmt.Sprintf("%s.allow_destinations[%d]", p, j), "%v", err)
			}
		}
		for _, t := range []struct {
			key string
			d   duration
		}{
			{"header_timeout", l.HeaderTimeout}, {"dial_timeout", l.DialTimeout},
			{"handshake_timeout", l.HandshakeTimeout}, {"idle_timeout", l.IdleTimeout},
			{"retry_timeout", l.RetryTimeout},
		} {
			if t.d.D() <= 0 {
				fail(p+"."+t.key, "must be positive, got %s", t.d)
			}
		}
		if l.Retries < 0 || l.Retries > 10 {
			fail(p+".retries", "must be between 0 and 10, got %d", l.Retries)
		}
		if l.MaxConnections <= 0 {
			fail(p+".max_connections", "must be positive, got %d", l.MaxConnections)
		}
		if l.SourceAddress != "" {
			if _, err := netip.ParseAddr(l.SourceAddress); err != nil {
				fail(p+".source_address", "must be an IP address, got %q", l.SourceAddress)
			}
		}
		for j, id := range l.Services {
			if id <= 0 {
				fail(fmt.Sprintf("%s.services[%d]", p, j), "service IDs are positive numbers, got %d", id)
			}
		}
	}
	return errs
}

// parsePrefix accepts a CIDR prefix or a single address.
func parsePrefix(s string) (netip.Prefix, error) {
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return netip.Prefix{}, fmt.Errorf("invalid network %q", s)
		}
		return p.Masked(), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("invalid address or network %q", s)
	}
	return netip.PrefixFrom(a, a.BitLen()), nil
}

// apiCredential resolves the API credential by the precedence of DESIGN.md
// §4: PROXYD_API_TOKEN, token_file, token, $CREDENTIALS_DIRECTORY/token, then
// login with password or password_file. It returns the token, or login and
// password; source names where it came from (for logs, never the value).
func (c *apiConfig) credential(getenv func(string) string) (token, login, password, source string, err error) {
	if t := strings.TrimSpace(getenv(agent.TokenEnv)); t != "" {
		return t, "", "", agent.TokenEnv, nil
	}
	if c.TokenFile != "" {
		t, err := readSecretFile(c.TokenFile)
		if err != nil {
			return "", "", "", "", keyError{Key: "api.token_file", Msg: err.Error()}
		}
		return t, "", "", "api.token_file", nil
	}
	if c.Token != "" {
		return c.Token, "", "", "api.token", nil
	}
	if dir := getenv("CREDENTIALS_DIRECTORY"); dir != "" {
		path := filepath.Join(dir, "token")
		if _, statErr := os.Stat(path); statErr == nil {
			t, err := readSecretFile(path)
			if err != nil {
				return "", "", "", "", keyError{Key: "api", Msg: err.Error()}
			}
			return t, "", "", "$CREDENTIALS_DIRECTORY/token", nil
		}
	}
	if c.Login != "" {
		pw := c.Password
		if c.PasswordFile != "" {
			p, err := readSecretFile(c.PasswordFile)
			if err != nil {
				return "", "", "", "", keyError{Key: "api.password_file", Msg: err.Error()}
			}
			pw = p
		}
		if pw == "" {
			return "", "", "", "", keyError{Key: "api.password", Msg: "login is set but neither password nor password_file"}
		}
		return "", c.Login, pw, "api.login", nil
	}
	return "", "", "", "", keyError{Key: "api.token", Msg: "no API credential: set PROXYD_API_TOKEN, api.token_file, api.token, a systemd credential \"token\", or api.login with a password"}
}

// readSecretFile reads a one-line secret. Errors name the path, never the content.
func readSecretFile(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		var pe *fs.PathError
		if errors.As(err, &pe) {
			err = pe.Err
		}
		return "", fmt.Errorf("reading %s: %w", path, err)
	}
	s := strings.TrimSpace(string(b))
	if s == "" {
		return "", fmt.Errorf("%s is empty", path)
	}
	return s, nil
}
