package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/proxyd/proxyd/agent"
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
			`listener[0].protocol: must be http or socks5, got "https"`,
			`listener[0].upstream: must be http or socks5, got "https"`,
			`listener[0].kind: must be "fpr", "ppr" or "", got "static"`,
			"listener[0].address: must be host:port: address 127.0.0.1: missing port in address",
			`listener[1].name: "a" is already the name of listener[0]`,
			"listener[1].address: 0.0.0.0:1080 is not a loopback address: configure [[listener.user]] or allow",
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
	if code != 1 || !strings.Contains(out, "11 problem(s)") || strings.Count(out, "bad_values.toml: ") != 11 {
		t.Errorf("bad config: exit %d\n%s", code, out)
	}
	code, out = run(filepath.Join("testdata", "config", "good_full.toml"))
	if code != 0 || !strings.Contains(out, "ok (2 listeners)") {
		t.Errorf("good config: exit %d\n%s", code, out)
	}
	if code, _ := run(filepath.Join("testdata", "config", "missing.toml")); code != 1 {
		t.Errorf("missing file: exit %d", code)
	}
}
