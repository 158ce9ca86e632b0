package agent

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/BurntSushi/toml"
)

// splitJoined returns the messages errors.Join joined, in order.
func splitJoined(err error) []string {
	if err == nil {
		return nil
	}
	var j interface{ Unwrap() []error }
	if !errors.As(err, &j) {
		return []string{err.Error()}
	}
	var out []string
	for _, e := range j.Unwrap() {
		out = append(out, e.Error())
	}
	return out
}

func TestDefaultConfigsAreValid(t *testing.T) {
	if err := DefaultConfig().Validate(); err != nil {
		t.Errorf("DefaultConfig: %v", err)
	}
	if err := DefaultPollConfig().Validate(); err != nil {
		t.Errorf("DefaultPollConfig: %v", err)
	}
	if err := DefaultManageConfig().Validate(); err != nil {
		t.Errorf("DefaultManageConfig: %v", err)
	}
	c := DefaultConfig()
	if c.BaseURL != "https://api.example-provider.net" || c.Timeout != 15*time.Second {
		t.Errorf("DefaultConfig = %+v", c)
	}
	p := DefaultPollConfig()
	if p.IPList != 10*time.Minute || p.NetworkStatus != 30*time.Second || p.Usage != time.Minute ||
		p.Account != 15*time.Minute || p.Jitter != 0.1 || p.MaxBackoff != 10*time.Minute ||
		p.Draws != nil {
		t.Errorf("DefaultPollConfig = %+v", p)
	}
	if m := DefaultManageConfig(); m.UpdateListShare != 0 || m.UpdateListAfter != 10*time.Minute {
		t.Errorf("DefaultManageConfig = %+v", m)
	}
}

// Every problem comes at once, each message starting with its key as
// written in the file; an explicit zero is kept (and refused where it has no
// meaning) rather than replaced by the default.
func TestValidateReportsEveryProblemByKey(t *testing.T) {
	c := DefaultConfig()
	c.BaseURL, c.Timeout, c.Services, c.Token = "", 0, []int{5, -1}, "a b"
	if got, want := splitJoined(c.Validate()), []string{
		"base_url: must be set",
		"token: holds whitespace or control characters",
		"services[1]: service IDs are positive numbers, got -1",
		"timeout: must be more than 0s",
	}; !slices.Equal(got, want) {
		t.Errorf("Config.Validate:\n got %q\nwant %q", got, want)
	}

	p := DefaultPollConfig()
	p.IPList, p.NetworkStatus, p.Usage, p.Account, p.MaxBackoff, p.Jitter = 0, 500*time.Millisecond, time.Second, -time.Second, 0, 0.6
	if got, want := splitJoined(p.Validate()), []string{
		"ip_list: must be at least 1s, got 0s",
		"network_status: must be at least 1s, got 500ms",
		"account: must be at least 1s, got -1s",
		"max_backoff: must be at least 1s, got 0s",
		"jitter: must be within 0–0.5, got 0.6",
	}; !slices.Equal(got, want) {
		t.Errorf("PollConfig.Validate:\n got %q\nwant %q", got, want)
	}
	p = DefaultPollConfig()
	p.Jitter = 0 // 0 = no jitter: kept, valid
	if err := p.Validate(); err != nil {
		t.Errorf("jitter 0: %v", err)
	}
	p.Jitter = math.NaN()
	if err := p.Validate(); err == nil || !strings.HasPrefix(err.Error(), "jitter: ") {
		t.Errorf("jitter NaN: %v", err)
	}

	for _, tc := range []struct {
		m    ManageConfig
		want []string
	}{
		{ManageConfig{UpdateListShare: 0, UpdateListAfter: 0}, nil}, // off: after does not matter
		{ManageConfig{UpdateListShare: 0.5, UpdateListAfter: time.Minute}, nil},
		{ManageConfig{UpdateListShare: 1, UpdateListAfter: time.Second}, nil},
		{ManageConfig{UpdateListShare: 1.5, UpdateListAfter: 0}, []string{
			"update_list_share: must be within 0–1, got 1.5",
			"update_list_after: must be more than 0s while update_list_share is set"}},
		{ManageConfig{UpdateListShare: -0.1, UpdateListAfter: -time.Second}, []string{
			"update_list_share: must be within 0–1, got -0.1",
			"update_list_after: must not be negative, got -1s"}},
		{ManageConfig{UpdateListShare: math.NaN(), UpdateListAfter: time.Second}, []string{
			"update_list_share: must be within 0–1, got NaN"}},
	} {
		if got := splitJoined(tc.m.Validate()); !slices.Equal(got, tc.want) {
			t.Errorf("%+v: got %q, want %q", tc.m, got, tc.want)
		}
	}
}

func TestResolveCredential(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	tokenFile := write("tok", "file-token\n")
	pwFile := write("pw", "file-password\r\n")
	credDir := filepath.Join(dir, "creds")
	os.Mkdir(credDir, 0o700)
	os.WriteFile(filepath.Join(credDir, "token"), []byte("systemd-token\n"), 0o600)
	emptyCredDir := t.TempDir()

	env := func(vars map[string]string) func(string) string {
		return func(k string) string { return vars[k] }
	}
	for _, tc := range []struct {
		name             string
		set              func(c *Config)
		env              map[string]string
		token, login, pw string
		source           string
		wantErr          string // prefix
	}{
		{"env wins over everything", func(c *Config) { c.TokenFile, c.Token, c.Login, c.Password = tokenFile, "t", "l", "p" },
			map[string]string{TokenEnv: " env-token\n", "CREDENTIALS_DIRECTORY": credDir}, "env-token", "", "", SourceEnv, ""},
		{"token_file over token", func(c *Config) { c.TokenFile, c.Token = tokenFile, "t" },
			map[string]string{"CREDENTIALS_DIRECTORY": credDir}, "file-token", "", "", SourceTokenFile, ""},
		{"token over systemd credential", func(c *Config) { c.Token, c.Login, c.Password = "t", "l", "p" },
			map[string]string{"CREDENTIALS_DIRECTORY": credDir}, "t", "", "", SourceToken, ""},
		{"systemd credential over login", func(c *Config) { c.Login, c.Password = "l", "p" },
			map[string]string{"CREDENTIALS_DIRECTORY": credDir}, "systemd-token", "", "", SourceCredentialsDir, ""},
		{"credentials directory without token file", func(c *Config) { c.Login, c.Password = "l", "p" },
			map[string]string{"CREDENTIALS_DIRECTORY": emptyCredDir}, "", "l", "p", SourceLogin, ""},
		{"password_file over password", func(c *Config) { c.Login, c.Password, c.PasswordFile = "l", "p", pwFile },
			nil, "", "l", "file-password", SourceLogin, ""},
		{"login without password", func(c *Config) { c.Login = "l" }, nil, "", "", "", "", "login: "},
		{"missing token_file", func(c *Config) { c.TokenFile = filepath.Join(dir, "nope") }, nil, "", "", "", "", "token_file: "},
		{"missing password_file", func(c *Config) { c.Login, c.PasswordFile = "l", filepath.Join(dir, "nope") }, nil, "", "", "", "", "password_file: "},
		{"nothing", func(c *Config) {}, nil, "", "", "", "", "token: no API credential"},
	} {
		c := apiConfig(tc.set)
		got, source, err := c.ResolveCredential(env(tc.env))
		if tc.wantErr != "" {
			if err == nil || !strings.HasPrefix(err.Error(), tc.wantErr) {
				t.Errorf("%s: err %v, want prefix %q", tc.name, err, tc.wantErr)
			}
			if err != nil && strings.Contains(err.Error(), "file-") {
				t.Errorf("%s: error quotes a file's content: %v", tc.name, err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if got.Token != tc.token || got.Login != tc.login || got.Password != tc.pw || source != tc.source {
			t.Errorf("%s: token %q login %q password %q source %q; want %q %q %q %q", tc.name,
				got.Token, got.Login, got.Password, source, tc.token, tc.login, tc.pw, tc.source)
		}
		if got.TokenFile != "" || got.PasswordFile != "" {
			t.Errorf("%s: file keys kept after resolving: %+v", tc.name, got)
		}
		if _, err := New(got); err != nil {
			t.Errorf("%s: New on the resolved config: %v", tc.name, err)
		}
	}

	// token_file is read again on each call: a rotated token is picked up.
	c := apiConfig(func(c *Config) { c.TokenFile = tokenFile })
	write("tok", "rotated-token\n")
	if got, _, err := c.ResolveCredential(env(nil)); err != nil || got.Token != "rotated-token" {
		t.Errorf("after rotation: %q, %v", got.Token, err)
	}
	if !FixedSource(SourceEnv) || !FixedSource(SourceCredentialsDir) || FixedSource(SourceTokenFile) ||
		FixedSource(SourceToken) || FixedSource(SourceLogin) {
		t.Error("FixedSource: only the environment and systemd credentials are fixed")
	}
}

// The sections decode from TOML onto their defaults: a present key keeps
// its value (an explicit zero included), an absent one its default, and
// the fields without a key are never touched by the file.
func TestSectionsDecodeFromTOML(t *testing.T) {
	var file struct {
		API    Config       `toml:"api"`
		Poll   PollConfig   `toml:"poll"`
		Manage ManageConfig `toml:"manage"`
	}
	file.API, file.Poll, file.Manage = DefaultConfig(), DefaultPollConfig(), DefaultManageConfig()
	md, err := toml.Decode(`
[api]
token_file = "/run/token"
services = [101, 104]
timeout = "30s"
[poll]
ip_list = "5m"
jitter = 0.0
[manage]
update_list_share = 0.5
`, &file)
	if err != nil {
		t.Fatal(err)
	}
	if u := md.Undecoded(); len(u) != 0 {
		t.Fatalf("undecoded keys %v", u)
	}
	a := file.API
	if a.BaseURL != DefaultConfig().BaseURL || a.TokenFile != "/run/token" || !slices.Equal(a.Services, []int{101, 104}) ||
		a.Timeout != 30*time.Second || a.Version != DefaultVersion {
		t.Errorf("[api] = %+v", a)
	}
	p := file.Poll
	if p.IPList != 5*time.Minute || p.Jitter != 0 || p.Account != 15*time.Minute || p.Draws != nil {
		t.Errorf("[poll] = %+v", p)
	}
	if m := file.Manage; m.UpdateListShare != 0.5 || m.UpdateListAfter != 10*time.Minute {
		t.Errorf("[manage] = %+v", m)
	}
	if err := errors.Join(a.Validate(), p.Validate(), file.Manage.Validate()); err != nil {
		t.Error(err)
	}
	// Keys that are not in a section are unknown to the file.
	md, _ = toml.Decode("[poll]\nprotocols = [\"http\"]\n[api]\nversion = \"x\"\n", &file)
	if len(md.Undecoded()) != 2 || file.API.Version != DefaultVersion {
		t.Errorf("fields without a key decoded from the file: undecoded %v, version %q", md.Undecoded(), file.API.Version)
	}
}
