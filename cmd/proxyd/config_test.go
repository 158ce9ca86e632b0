package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/proxyd/proxyd/agent"
	"github.com/proxyd/proxyd/forward"
)

// TestConfigFiles walks testdata/config/*.toml: each bad file must give
// exactly the listed problems, each naming its key.
func TestConfigFiles(t *testing.T) {
	want := map[string][]string{
		"good_minimal.toml": nil,
		"good_full.toml":    nil,
		"syntax.toml":       {`syntax error at line 2: expected '.' or ']' to end table name, but got '\n' instead`},
		"unknown_keys.toml": {
			"api.tokn: unknown key",
			"listener[1].adress: unknown key",
			"listener[1].user[0].nam: unknown key",
			"metrics: unknown key",
			"listener[1].address: required, e.g. \"127.0.0.1:8080\"",
			"listener[1].user[0].name: required",
		},
		"bare_durations.toml": {
			`api.timeout: a duration must be a string such as "30s", got a number`,
			"listener[0].idle_timeout: a duration must be a string such as \"30s\", got a number",
			`poll.ip_list: invalid duration "10" (use a number with a unit: "500ms", "30s", "10m")`,
			"poll.network_status: must be at least 1s, got 500ms",
		},
		"bad_values.toml": {
			"api.base_url: must start with https:// or http://",
			"api.services[0]: service IDs are positive numbers, got 0",
			`pool.strategy: must be round-robin, random, least-conn or latency, got "fastest"`,
			`log.format: must be text or json, got "xml"`,
			"admin.address: 0.0.0.0:9900 is not a loopback address: set admin.token or admin.token_file",
			// A listener's forwarding keys (forward.Config) first, then the keys
			// and cross-listener rules the daemon adds.
			// (upstream is not written: it takes the protocol, whose
			// problem is said once, under the key the file wrote.)
			`listener[0].protocol: must be http or socks5, got "https"`,
			"listener[0].address: must be host:port: address 127.0.0.1: missing port in address",
			`listener[0].kind: must be "fpr", "ppr" or "", got "static"`,
			"listener[1].address: 0.0.0.0:1080 is not a loopback address: configure [[listener.user]] or allow",
			`listener[1].name: "a" is already the name of listener[0]`,
		},
		"explicit_zeros.toml": {
			"api.timeout: must be more than 0s",
			"poll.ip_list: must be at least 1s, got 0s",
			"pool.failure_threshold: must be at least 1, got 0",
			"pool.sticky_idle: must be positive (sticky_max = 0 turns stickiness off), got 0s",
			"pool.quota_headroom: must be a positive number, got 0",
			"listener[0].dial_timeout: must be positive, got 0s",
			"listener[0].response_timeout: must be positive, got 0s",
			"listener[0].max_connections: must be positive, got 0",
			`listener[0].upstream: must be http or socks5, got ""`,
		},
		"zeros_kept.toml": nil,
		"admin_on_listener.toml": {
			"admin.address: 127.0.0.1:8080 is already the address of listener[0]",
		},
		"print_full.toml":    nil,
		"print_minimal.toml": nil,
		"out_of_range.toml": {
			"api.services[0]: service IDs are positive numbers, got -1",
			"poll.max_backoff: must be at least 1s, got 10ms",
			"poll.jitter: must be within 0–0.5, got 0.9",
			"pool.eject_max: must not be less than eject_base (10m0s), got 1m0s",
			"pool.max_ejected_percent: must be within 0–100, got 150",
			"pool.latency_tolerance: must not be negative, got -0.5",
			"pool.quota_headroom: must be a positive number, got -1",
			"manage.update_list_share: must be within 0–1, got 1.5",
			"manage.update_list_after: must not be negative, got -1s",
			`listener[0].hedge_delay: must not be negative ("0s" turns hedging off), got -2s`,
			"listener[0].retries: must not be negative (0 turns retries off), got -1",
			"listener[0].services: service 7 is not in api.services",
		},
		"wrong_types.toml": {
			"api: must be a table, got a string",
			"listener[0].name: must be a string, got a number",
			"listener[0].services[0]: must be a whole number, got a string",
			"pool.failure_threshold: must be a whole number, got a string",
		},
	}
	files, err := filepath.Glob("testdata/config/*.toml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no testdata: %v", err)
	}
	for name := range want {
		if !slices.Contains(files, filepath.Join("testdata", "config", name)) {
			t.Errorf("testdata/config/%s is missing: its expectation is not checked", name)
		}
	}
	for _, f := range files {
		name := filepath.Base(f)
		t.Run(name, func(t *testing.T) {
			exp, ok := want[name]
			if !ok {
				t.Fatalf("no expectation for %s", name)
			}
			_, err := loadConfig(f)
			var got []string
			if err != nil {
				var errs configErrors
				if !errors.As(err, &errs) {
					t.Fatalf("error is %T, want configErrors: %v", err, err)
				}
				for _, e := range errs {
					got = append(got, e.Error())
				}
			}
			if strings.Join(got, "\n") != strings.Join(exp, "\n") {
				t.Errorf("problems:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(exp, "\n"))
			}
		})
	}
}

// TestConfigProblemOrder: problems come in the order of the keys, the same
// on every run, so that `check` output can be compared.
func TestConfigProblemOrder(t *testing.T) {
	text := `
[poll]
ip_list = "500ms"
network_status = "500ms"
usage = "500ms"
account = "500ms"
[[listener]]
name = "a"
protocol = "http"
address = "127.0.0.1:1"
header_timeout = "0s"
dial_timeout = "0s"
handshake_timeout = "0s"
idle_timeout = "0s"
retry_timeout = "0s"
`
	want := strings.Join([]string{
		"poll.ip_list: must be at least 1s, got 500ms",
		"poll.network_status: must be at least 1s, got 500ms",
		"poll.usage: must be at least 1s, got 500ms",
		"poll.account: must be at least 1s, got 500ms",
		"listener[0].header_timeout: must be positive, got 0s",
		"listener[0].dial_timeout: must be positive, got 0s",
		"listener[0].handshake_timeout: must be positive, got 0s",
		"listener[0].idle_timeout: must be positive, got 0s",
		"listener[0].retry_timeout: must be positive, got 0s",
	}, "\n")
	for i := 0; i < 20; i++ { // map iteration would shuffle them
		_, err := parseConfig(text)
		if err == nil || err.Error() != want {
			t.Fatalf("run %d: problems:\n%v\nwant:\n%s", i, err, want)
		}
	}
}

// TestExplicitZerosKept: a key written as zero keeps zero where zero has a
// meaning; defaults fill only what is absent.
func TestExplicitZerosKept(t *testing.T) {
	cfg, err := loadConfig(filepath.Join("testdata", "config", "zeros_kept.toml"))
	if err != nil {
		t.Fatal(err)
	}
	l := cfg.Listener[0]
	for _, c := range []struct {
		key string
		got any
	}{
		{"poll.jitter", cfg.Poll.Jitter},
		{"pool.max_ejected_percent", cfg.Pool.MaxEjectedPercent},
		{"pool.latency_tolerance", cfg.Pool.LatencyTolerance},
		{"pool.sticky_max", cfg.Pool.StickyMax},
		{"pool.probe_interval", cfg.Pool.ProbeInterval},
		{"pool.probe_budget", cfg.Pool.ProbeBudget},
		{"pool.rotate_wait", cfg.Pool.RotateWait},
		{"manage.update_list_share", cfg.Manage.UpdateListShare},
		{"listener[0].retries", l.Retries},
		{"listener[0].hedge_delay", l.HedgeDelay},
		{"shutdown.drain_timeout", cfg.Shutdown.DrainTimeout},
	} {
		if !reflect.ValueOf(c.got).IsZero() {
			t.Errorf("%s = %v, want the 0 written in the file", c.key, c.got)
		}
	}
	// Absent keys of the same sections still get their defaults.
	def := defaultConfig()
	if cfg.Pool.FailureThreshold != def.Pool.FailureThreshold || l.RetryTimeout != forward.DefaultConfig().RetryTimeout ||
		cfg.Manage.UpdateListAfter != def.Manage.UpdateListAfter {
		t.Errorf("absent keys lost their defaults: %+v %+v", cfg.Pool, l)
	}
}

// TestPrintRoundTrip: check -print prints every key with the value in
// force; parsing the output and printing again gives the same text; no
// secret is printed.
func TestPrintRoundTrip(t *testing.T) {
	// Secrets written inline are the one value the output leaves out (see
	// below), so the files here take theirs from files.
	for _, name := range []string{"print_full.toml", "print_minimal.toml", "zeros_kept.toml"} {
		t.Run(name, func(t *testing.T) {
			cfg, err := loadConfig(filepath.Join("testdata", "config", name))
			if err != nil {
				t.Fatal(err)
			}
			first := printConfig(cfg)
			again, err := parseConfig(first)
			if err != nil {
				t.Fatalf("the printed config does not parse: %v\n%s", err, first)
			}
			if second := printConfig(again); second != first {
				t.Errorf("printing again differs:\n%s\n---\n%s", first, second)
			}
			if fmt.Sprint(scrubSecrets(cfg)) != fmt.Sprint(again) {
				t.Errorf("the printed config reads back differently:\n%+v\n%+v", scrubSecrets(cfg), again)
			}
			for _, key := range []string{"[api]", "base_url = ", "[poll]", "ip_list = ", "[pool]", "quota_headroom = ",
				"[manage]", "update_list_after = ", "[[listener]]", "hedge_delay = ", "response_timeout = ",
				"[admin]", "[log]", "[shutdown]", "drain_timeout = "} {
				if !strings.Contains(first, key) {
					t.Errorf("%q missing from:\n%s", key, first)
				}
			}
		})
	}
	// Secrets that are set are comments, never values.
	cfg, err := parseConfig(secretsText)
	if err != nil {
		t.Fatal(err)
	}
	out := printConfig(cfg)
	if strings.Contains(out, "canary") {
		t.Errorf("a secret is printed:\n%s", out)
	}
	for _, want := range []string{"# token = (set, hidden)\n", "[[listener.user]]\nname = \"alice\"\n# password = (set, hidden)\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("%q missing from:\n%s", want, out)
		}
	}
	// The check command prints it too, from the file with the secrets.
	path := filepath.Join(t.TempDir(), "c.toml")
	os.WriteFile(path, []byte(secretsText), 0o600)
	var stdout, stderr strings.Builder
	if code := runMain(context.Background(), []string{"check", "-config", path, "-print"},
		stdio{out: &stdout, err: &stderr, getenv: func(string) string { return "" }}); code != 0 {
		t.Fatalf("check -print: exit %d: %s", code, stderr.String())
	}
	if stdout.String() != out || strings.Contains(stdout.String()+stderr.String(), "canary") {
		t.Errorf("check -print output:\n%s\n%s", stdout.String(), stderr.String())
	}
}

// secretsText is a config with every kind of secret written inline.
const secretsText = `
[api]
token = "canary-api-token"
[admin]
token = "canary-admin-token"
[[listener]]
name = "a"
protocol = "http"
address = "127.0.0.1:1"
[[listener.user]]
name = "alice"
password = "canary-user-password"
`

// scrubSecrets is cfg as -print shows it: secrets written inline are the
// one thing the output leaves out.
func scrubSecrets(cfg config) config {
	cfg.API.Token, cfg.API.Password, cfg.Admin.Token = "", "", ""
	cfg.Listener = slices.Clone(cfg.Listener)
	for i := range cfg.Listener {
		users := slices.Clone(cfg.Listener[i].Users)
		for j := range users {
			users[j].Password = ""
		}
		cfg.Listener[i].Users = users
	}
	return cfg
}

// TestSyntaxErrorHidesSecrets: the parser quotes what it could not read,
// which may be a secret written without quotes; problems reach the journal
// and /events, so the quoted text is left out.
func TestSyntaxErrorHidesSecrets(t *testing.T) {
	for _, text := range []string{"[api]\ntoken = canarySECRET123\n", "[[listener]]\n[[listener.user]]\npassword=hunter2canary\n"} {
		_, err := parseConfig(text)
		if err == nil || !strings.HasPrefix(err.Error(), "syntax error at line") || strings.Contains(err.Error(), "canary") {
			t.Errorf("%q: %v", text, err)
		}
	}
	if _, err := parseConfig("listener = []\n"); err == nil || !strings.Contains(err.Error(), "listener: no listener") {
		t.Errorf("an empty listener array: %v", err)
	}
}

// One mistake is one problem, not a second one that follows from it.
func TestOneMistakeOneProblem(t *testing.T) {
	for text, want := range map[string]string{
		"listener = 5\n": "listener: must be an array, got a number",
		// upstream, not written, takes the protocol: its problem is the protocol's.
		"[[listener]]\nname = \"h\"\nprotocol = \"sock5\"\naddress = \"127.0.0.1:8080\"\n": `listener[0].protocol: must be http or socks5, got "sock5"`,
		// A token with a space at an end never matches the trimmed header.
		"[admin]\ntoken = \" tok\"\n": "admin.token: holds whitespace or control characters",
		"[api]\nservices = [1]\n[[listener]]\nname = \"h\"\nprotocol = \"http\"\naddress = \"127.0.0.1:8080\"\nservices = [-1]\n": "listener[0].services[0]: service IDs are positive numbers, got -1",
	} {
		_, err := parseConfig(text)
		var errs configErrors
		if !errors.As(err, &errs) || len(errs) != 1 || errs[0].Error() != want {
			t.Errorf("%q: %v, want the one problem %q", text, err, want)
		}
	}
}

func TestConfigDefaults(t *testing.T) {
	cfg, err := parseConfig("[api]\ntoken = \"x\"\n")
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.Listener) != 2 || cfg.Listener[0].Address != "127.0.0.1:8080" || cfg.Listener[1].Protocol != "socks5" {
		t.Fatalf("default listeners: %+v", cfg.Listener)
	}
	if cfg.Listener[1].Upstream != "socks5" || cfg.Listener[0].Upstream != "http" {
		t.Errorf("upstream defaults to the listener's protocol: %q %q", cfg.Listener[0].Upstream, cfg.Listener[1].Upstream)
	}
	if cfg.Poll.IPList != 10*time.Minute || cfg.Admin.Address != "127.0.0.1:9900" {
		t.Errorf("defaults: %+v %+v", cfg.Poll, cfg.Admin)
	}
	// Defaults apply to every listener element, not by position.
	cfg, err = parseConfig(`
[[listener]]
name = "a"
protocol = "http"
address = "127.0.0.1:1"
idle_timeout = "1m"
[[listener]]
name = "b"
protocol = "socks5"
address = "127.0.0.1:2"
`)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Listener[0].IdleTimeout != time.Minute || cfg.Listener[1].IdleTimeout != 5*time.Minute || cfg.Listener[1].MaxConnections != 4096 {
		t.Errorf("per-element defaults: %+v", cfg.Listener)
	}
}

func TestAPICredentialPrecedence(t *testing.T) {
	dir := t.TempDir()
	write := func(name, s string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	tokFile := write("tokfile", "from-file\n")
	credDir := filepath.Join(dir, "creds")
	os.Mkdir(credDir, 0o700)
	os.WriteFile(filepath.Join(credDir, "token"), []byte("from-credentials\n"), 0o600)
	pwFile := write("pw", "pw-from-file\n")

	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	full := agent.Config{TokenFile: tokFile, Token: "from-config", Login: "me", Password: "pw"}
	cases := []struct {
		name       string
		api        agent.Config
		env        map[string]string
		tok, login string
		pw         string
	}{
		{"env wins", full, map[string]string{"PROXYD_API_TOKEN": "from-env", "CREDENTIALS_DIRECTORY": credDir}, "from-env", "", ""},
		{"token_file next", full, map[string]string{"CREDENTIALS_DIRECTORY": credDir}, "from-file", "", ""},
		{"token next", agent.Config{Token: "from-config", Login: "me", Password: "pw"}, map[string]string{"CREDENTIALS_DIRECTORY": credDir}, "from-config", "", ""},
		{"systemd credential", agent.Config{Login: "me", Password: "pw"}, map[string]string{"CREDENTIALS_DIRECTORY": credDir}, "from-credentials", "", ""},
		{"login password", agent.Config{Login: "me", Password: "pw"}, nil, "", "me", "pw"},
		{"login password_file", agent.Config{Login: "me", PasswordFile: pwFile}, nil, "", "me", "pw-from-file"},
	}
	for _, c := range cases {
		got, _, err := c.api.ResolveCredential(env(c.env))
		if err != nil || got.Token != c.tok || got.Login != c.login || got.Password != c.pw {
			t.Errorf("%s: got %q %q %q %v", c.name, got.Token, got.Login, got.Password, err)
		}
	}
	if _, _, err := (agent.Config{}).ResolveCredential(env(nil)); err == nil {
		t.Error("no credential at all must be an error")
	}
	// The daemon names the key with its section, as check does.
	_, _, err := (agent.Config{TokenFile: filepath.Join(dir, "missing")}).ResolveCredential(env(nil))
	if err == nil || !strings.Contains(sectionProblems("api", err).Error(), "api.token_file: reading") {
		t.Errorf("missing token file: %v", err)
	}
}

// config.example.toml documents every key with its default: it must parse,
// and its values must be the defaults.
func TestExampleConfig(t *testing.T) {
	cfg, err := loadConfig(filepath.Join("..", "..", "config.example.toml"))
	if err != nil {
		t.Fatal(err)
	}
	def := defaultConfig()
	def.Listener = defaultListeners()
	for i := range def.Listener {
		def.Listener[i].Upstream = def.Listener[i].Protocol
	}
	if fmt.Sprintf("%+v", cfg) != fmt.Sprintf("%+v", def) {
		t.Errorf("example differs from the defaults:\n%+v\n%+v", cfg, def)
	}
}

func TestCheckCommand(t *testing.T) {
	run := func(path string) (int, string) {
		var out, errb strings.Builder
		code := runMain(context.Background(), []string{"check", "-config", path}, stdio{out: &out, err: &errb, getenv: func(string) string { return "" }})
		return code, out.String() + errb.String()
	}
	code, out := run(filepath.Join("testdata", "config", "bad_values.toml"))
	// Ten problems, each with its key; the secrets are read too, and
	// the missing credential is a warning (this environment has none).
	if code != 1 || !strings.Contains(out, "10 problem(s)") ||
		strings.Count(out, "bad_values.toml: ")-strings.Count(out, "bad_values.toml: warning: ") != 10 ||
		!strings.Contains(out, "bad_values.toml: warning: api.token: no API credential") {
		t.Errorf("bad config: exit %d\n%s", code, out)
	}
	code, out = run(filepath.Join("testdata", "config", "good_full.toml"))
	if code != 0 || !strings.Contains(out, "ok (2 listeners)") {
		t.Errorf("good config: exit %d\n%s", code, out)
	}
	if code, _ := run(filepath.Join("testdata", "config", "missing.toml")); code != 1 {
		t.Errorf("missing file: exit %d", code)
	}
	// An argument after the flags is refused, not ignored: `check bad.toml`
	// would check the default file and say ok.
	for _, cmd := range []string{"check", "run", "demo", "pool"} {
		var out, errb strings.Builder
		code := runMain(context.Background(), []string{cmd, "bad.toml"}, stdio{out: &out, err: &errb, getenv: func(string) string { return "" }})
		if code != 2 || !strings.Contains(errb.String(), `proxyd `+cmd+`: unexpected argument "bad.toml"`) {
			t.Errorf("%s bad.toml: exit %d, %q %q", cmd, code, out.String(), errb.String())
		}
	}
	// -h asks for the usage: it is printed, and that is no failure.
	for _, cmd := range []string{"check", "run", "demo", "pool", "api"} {
		var out, errb strings.Builder
		code := runMain(context.Background(), []string{cmd, "-h"}, stdio{out: &out, err: &errb, getenv: func(string) string { return "" }})
		if code != 0 || !strings.Contains(errb.String(), "sage") {
			t.Errorf("%s -h: exit %d, %q %q", cmd, code, out.String(), errb.String())
		}
	}
	// A token file check cannot read is named (a warning: the file may be
	// readable by the service's user only).
	path := filepath.Join(t.TempDir(), "c.toml")
	missing := filepath.Join(t.TempDir(), "no-such-token")
	os.WriteFile(path, []byte("[api]\ntoken = \"t\"\n[admin]\ntoken_file = \""+missing+"\"\n"), 0o600)
	if code, out := run(path); code != 0 || !strings.Contains(out, "warning: admin.token_file: ") || !strings.Contains(out, missing) {
		t.Errorf("unreadable admin.token_file: exit %d\n%s", code, out)
	}
	// So is a local user's password file, by its key.
	os.WriteFile(path, []byte("[api]\ntoken = \"t\"\n[[listener]]\nname = \"h\"\nprotocol = \"http\"\naddress = \"127.0.0.1:8080\"\n"+
		"[[listener.user]]\nname = \"a\"\npassword = \"pa\"\n[[listener.user]]\nname = \"b\"\npassword_file = \""+missing+"\"\n"), 0o600)
	if code, out := run(path); code != 0 || !strings.Contains(out, "warning: listener[0].user[1].password_file: reading "+missing) {
		t.Errorf("unreadable listener[0].user[1].password_file: exit %d\n%s", code, out)
	}
	// No credential where check runs: a warning too (the unit's
	// environment or a systemd credential may give it).
	os.WriteFile(path, []byte("[admin]\naddress = \"127.0.0.1:9900\"\n"), 0o600)
	if code, out := run(path); code != 0 || !strings.Contains(out, "warning: api.token: no API credential") {
		t.Errorf("no credential: exit %d\n%s", code, out)
	}
	// A secret that was read and cannot be used fails run, so it fails
	// check: each by its key.
	twoLines := filepath.Join(t.TempDir(), "two-lines")
	os.WriteFile(twoLines, []byte("one\ntwo\n"), 0o600)
	long := filepath.Join(t.TempDir(), "long")
	os.WriteFile(long, []byte(strings.Repeat("p", 256)), 0o600)
	// Two problems of one key are both said; one found twice is said once.
	pwFile := filepath.Join(t.TempDir(), "pw")
	os.WriteFile(pwFile, []byte("one\ntwo\n"), 0o600)
	os.WriteFile(path, []byte("[api]\nlogin = \"u\"\npassword = \"p\"\npassword_file = \""+pwFile+"\"\n"), 0o600)
	if code, out := run(path); code != 1 || !strings.Contains(out, "c.toml: api.password_file: set either password or password_file") ||
		!strings.Contains(out, "c.toml: api.password_file: reading "+pwFile+": more than one line") || !strings.Contains(out, "2 problem(s)") {
		t.Errorf("two problems of api.password_file: exit %d\n%s", code, out)
	}
	os.WriteFile(path, []byte("[api]\nlogin = \"u\"\n"), 0o600)
	if code, out := run(path); code != 1 || strings.Count(out, "api.login: is set without a password") != 1 || !strings.Contains(out, "1 problem(s)") {
		t.Errorf("login without password: exit %d\n%s", code, out)
	}
	// With another problem in the file, both are said in one run.
	os.WriteFile(path, []byte("[api]\ntoken_file = \""+twoLines+"\"\n[poll]\nip_list = \"1ms\"\n"), 0o600)
	if code, out := run(path); code != 1 || !strings.Contains(out, "c.toml: poll.ip_list: ") ||
		!strings.Contains(out, "c.toml: api.token_file: reading "+twoLines+": more than one line") || !strings.Contains(out, "2 problem(s)") {
		t.Errorf("config and secret problems: exit %d\n%s", code, out)
	}
	for _, tt := range []struct{ name, file, want string }{
		{"api.token_file", "[api]\ntoken_file = \"" + twoLines + "\"\n", "api.token_file: reading " + twoLines + ": more than one line"},
		{"admin.token_file", "[api]\ntoken = \"t\"\n[admin]\ntoken_file = \"" + twoLines + "\"\n", "admin.token_file: reading " + twoLines + ": more than one line"},
		{"password_file", "[api]\ntoken = \"t\"\n[[listener]]\nname = \"h\"\nprotocol = \"http\"\naddress = \"127.0.0.1:8080\"\n" +
			"[[listener.user]]\nname = \"b\"\npassword_file = \"" + long + "\"\n", "listener[0].user[0].password_file: reading " + long + ": the password must be at most 255 bytes"},
	} {
		os.WriteFile(path, []byte(tt.file), 0o600)
		if code, out := run(path); code != 1 || !strings.Contains(out, "c.toml: "+tt.want) || !strings.Contains(out, "1 problem(s)") || strings.Contains(out, "warning") {
			t.Errorf("%s unusable: exit %d\n%s", tt.name, code, out)
		}
	}
	// PROXYD_API_TOKEN in check's environment wins as it does for run; a
	// token_file that run would refuse without the variable (a unit that
	// does not set it) is still said, as a warning.
	os.WriteFile(path, []byte("[api]\ntoken_file = \""+twoLines+"\"\n"), 0o600)
	{
		var out, errb strings.Builder
		env := map[string]string{"PROXYD_API_TOKEN": "from-env"}
		code := runMain(context.Background(), []string{"check", "-config", path}, stdio{out: &out, err: &errb, getenv: func(k string) string { return env[k] }})
		if code != 0 || !strings.Contains(errb.String(), "c.toml: warning: api.token_file: reading "+twoLines+": more than one line") ||
			!strings.Contains(errb.String(), "PROXYD_API_TOKEN hides this here") {
			t.Errorf("token_file hidden by PROXYD_API_TOKEN: exit %d\n%s%s", code, out.String(), errb.String())
		}
	}
	// A credential from the environment or systemd is named as such, not
	// as a key of [api] the file does not have.
	credDir := t.TempDir()
	os.WriteFile(filepath.Join(credDir, "token"), []byte("one\ntwo\n"), 0o600)
	os.WriteFile(path, []byte("[admin]\naddress = \"127.0.0.1:9900\"\n"), 0o600)
	for _, tt := range []struct {
		env  map[string]string
		want string
	}{
		{map[string]string{"PROXYD_API_TOKEN": "a b"}, "c.toml: api: the environment's PROXYD_API_TOKEN holds whitespace"},
		{map[string]string{"CREDENTIALS_DIRECTORY": credDir}, "c.toml: api: systemd credential \"token\" (" + filepath.Join(credDir, "token") + "): reading"},
	} {
		var out, errb strings.Builder
		code := runMain(context.Background(), []string{"check", "-config", path}, stdio{out: &out, err: &errb, getenv: func(k string) string { return tt.env[k] }})
		if code != 1 || !strings.Contains(errb.String(), tt.want) {
			t.Errorf("env %v: exit %d\n%s%s", tt.env, code, out.String(), errb.String())
		}
	}
}
