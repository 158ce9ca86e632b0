package agent

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

const testToken = "tok-Zq9XvB7rLm2Kp4Ws8Yt1"

func newTestClient(t *testing.T, baseURL string) *Client {
	t.Helper()
	c, err := New(apiConfig(func(c *Config) { c.BaseURL, c.Token, c.Version, c.Timeout = baseURL, testToken, "1.2.3", 5*time.Second }))
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return c
}

// serve answers every request with status, content type and body, recording
// the requests it saw.
type recorded struct {
	mu   sync.Mutex
	reqs []*http.Request
	body [][]byte
}

func (r *recorded) last() (*http.Request, []byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.reqs) == 0 {
		return nil, nil
	}
	return r.reqs[len(r.reqs)-1], r.body[len(r.body)-1]
}

func serve(t *testing.T, status int, body string) (*httptest.Server, *recorded) {
	t.Helper()
	rec := &recorded{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		rec.mu.Lock()
		rec.reqs = append(rec.reqs, r)
		rec.body = append(rec.body, b)
		rec.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		io.WriteString(w, body)
	}))
	t.Cleanup(srv.Close)
	return srv, rec
}

// apiConfig is DefaultConfig changed by set.
func apiConfig(set func(c *Config)) Config {
	c := DefaultConfig()
	set(&c)
	return c
}

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		set  func(c *Config) // applied to DefaultConfig
		want string          // substring of the error; "" = valid
	}{
		{"token", func(c *Config) { c.Token = "abc" }, ""},
		{"login", func(c *Config) { c.Login = "a@b.c"; c.Password = "pw" }, ""},
		{"token wins", func(c *Config) { c.Token = "abc"; c.Login = "x" }, ""},
		{"no credential", func(c *Config) {}, "no API credential"},
		{"login without password", func(c *Config) { c.Login = "a" }, "without a password"},
		{"token with space", func(c *Config) { c.Token = "abc def" }, "whitespace"},
		{"token with newline", func(c *Config) { c.Token = "abc\r\n" }, "whitespace"},
		{"login with colon", func(c *Config) { c.Login = "a:b"; c.Password = "p" }, "colon"},
		{"bad scheme", func(c *Config) { c.Token = "t"; c.BaseURL = "ftp://x" }, "must start with https:// or http://"},
		{"no host", func(c *Config) { c.Token = "t"; c.BaseURL = "http://" }, "no host"},
		{"creds in url", func(c *Config) { c.Token = "t"; c.BaseURL = "https://u:pw@api.example" }, "not in the URL"},
		{"query", func(c *Config) { c.Token = "t"; c.BaseURL = "https://api.example/?a=1" }, "query"},
		{"negative timeout", func(c *Config) { c.Token = "t"; c.Timeout = -1 }, "negative"},
		{"negative max body", func(c *Config) { c.Token = "t"; c.MaxBody = -1 }, "negative"},
		{"bad version", func(c *Config) { c.Token = "t"; c.Version = "1 2" }, "version"},
	} {
		// The section's problems come from Validate, a missing credential
		// from New: a credential may come from the environment.
		cfg := apiConfig(tc.set)
		_, err := New(cfg)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: unexpected error %v", tc.name, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: error %v, want one containing %q", tc.name, err, tc.want)
		}
		if err != nil && cfg.Token != "" && strings.Contains(err.Error(), cfg.Token) && len(cfg.Token) > 1 {
			t.Errorf("%s: error %q quotes the token", tc.name, err)
		}
		if err != nil && strings.Contains(err.Error(), "pw@") {
			t.Errorf("%s: error %q quotes URL credentials", tc.name, err)
		}
	}
	if _, err := New(Config{}); err == nil {
		t.Error("New(Config{}) succeeded")
	}
}

func TestRequestHeaders(t *testing.T) {
	srv, rec := serve(t, 200, `[]`)
	c := newTestClient(t, srv.URL+"/")
	if _, err := c.Clients(context.Background()); err != nil {
		t.Fatal(err)
	}
	r, _ := rec.last()
	for k, want := range map[string]string{
		"Authorization": "Basic " + testToken,
		"User-Agent":    "proxyd/1.2.3",
		"Accept":        "application/json",
		"Content-Type":  "application/json",
	} {
		if got := r.Header.Get(k); got != want {
			t.Errorf("%s = %q, want %q", k, got, want)
		}
	}
	if r.URL.Path != "/api/clients" || r.Method != http.MethodGet {
		t.Errorf("request %s %s", r.Method, r.URL.Path)
	}

	// Login + password: base64(login:password); default version.
	c2, err := New(apiConfig(func(c *Config) {
		c.BaseURL, c.Login, c.Password, c.Version = srv.URL, "demo@example.com", "demo-password", ""
	}))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c2.Clients(context.Background()); err != nil {
		t.Fatal(err)
	}
	r, _ = rec.last()
	want := "Basic " + base64.StdEncoding.EncodeToString([]byte("demo@example.com:demo-password"))
	if got := r.Header.Get("Authorization"); got != want {
		t.Errorf("Authorization = %q, want %q", got, want)
	}
	if got := r.Header.Get("User-Agent"); got != "proxyd/dev" {
		t.Errorf("User-Agent = %q", got)
	}
}

func TestCallRouteFilling(t *testing.T) {
	srv, rec := serve(t, 200, `{"ok":true}`)
	c := newTestClient(t, srv.URL+"/prefix")
	ctx := context.Background()
	if _, err := c.Call(ctx, http.MethodGet, RouteStickyRotate, []string{"102", "gw1.sim.example", "a/b c?d"}, nil); err != nil {
		t.Fatal(err)
	}
	r, _ := rec.last()
	if got, want := r.URL.EscapedPath(), "/prefix/api/sticky/rotate/102/gw1.sim.example/a%2Fb%20c%3Fd"; got != want {
		t.Errorf("path = %q, want %q", got, want)
	}
	for _, bad := range []struct {
		route string
		args  []string
	}{
		{RouteService, nil},
		{RouteService, []string{"1", "2"}},
		{RouteService, []string{""}},
		{"api/x", nil},
		{"/api/{x", []string{"1"}},
	} {
		if _, err := c.Call(ctx, http.MethodGet, bad.route, bad.args, nil); err == nil {
			t.Errorf("Call(%q, %q) succeeded", bad.route, bad.args)
		}
	}
	// Bodies: a value is JSON-encoded, []byte sent verbatim.
	if _, err := c.Call(ctx, http.MethodPost, RouteProduct, []string{"11"}, OrderRequest{ClientID: 7}); err != nil {
		t.Fatal(err)
	}
	if _, b := rec.last(); string(b) != `{"clientid":7}` {
		t.Errorf("body = %s", b)
	}
	if _, err := c.Call(ctx, http.MethodPut, RouteService, []string{"1"}, []byte(`{"x":"y"}`)); err != nil {
		t.Fatal(err)
	}
	if _, b := rec.last(); string(b) != `{"x":"y"}` {
		t.Errorf("body = %s", b)
	}
	if _, err := c.Call(ctx, http.MethodPut, RouteService, []string{"1"}, func() {}); err == nil {
		t.Error("unencodable body accepted")
	}
}

func TestTimeoutAndCancel(t *testing.T) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer srv.Close()
	defer close(release)
	var codes []string
	var mu sync.Mutex
	c, err := New(apiConfig(func(c *Config) {
		c.BaseURL, c.Token, c.Timeout = srv.URL, testToken, 100*time.Millisecond
		c.Observe = func(route, code string, took time.Duration) {
			mu.Lock()
			codes = append(codes, route+" "+code)
			mu.Unlock()
		}
	}))
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err = c.Credit(context.Background())
	if err == nil || time.Since(start) > 3*time.Second {
		t.Fatalf("err %v after %v, want a timeout", err, time.Since(start))
	}
	if !strings.Contains(err.Error(), RouteCredit) {
		t.Errorf("error %q does not name the route", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := c.Credit(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("canceled ctx: err = %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(codes) != 2 || codes[0] != RouteCredit+" error" || codes[1] != RouteCredit+" error" {
		t.Errorf("observed %q", codes)
	}
}

func TestBodyCap(t *testing.T) {
	srv, _ := serve(t, 200, `[`+strings.Repeat(`{"id":1},`, 200)+`{"id":2}]`)
	c, err := New(apiConfig(func(c *Config) { c.BaseURL, c.Token, c.MaxBody = srv.URL, testToken, 1000 }))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Clients(context.Background()); !errors.Is(err, ErrBodyTooLarge) {
		t.Errorf("err = %v, want ErrBodyTooLarge", err)
	}
	c, _ = New(apiConfig(func(c *Config) { c.BaseURL, c.Token, c.MaxBody = srv.URL, testToken, 0 }))
	if got, err := c.Clients(context.Background()); err != nil || len(got) != 201 {
		t.Errorf("default cap: %d clients, err %v", len(got), err)
	}
}

func TestNoEnvironmentProxy(t *testing.T) {
	// A proxy that would answer 599 to anything sent through it.
	proxy, _ := serve(t, 599, "via proxy")
	srv, _ := serve(t, 200, `{"credit":"1.5"}`)
	t.Setenv("HTTP_PROXY", proxy.URL)
	t.Setenv("http_proxy", proxy.URL)
	t.Setenv("NO_PROXY", "")
	t.Setenv("no_proxy", "")
	// httptest's 127.0.0.1 is exempt from env proxies in net/http, so use
	// the "localhost" spelling that is not.
	base := strings.Replace(srv.URL, "127.0.0.1", "localhost", 1)
	c := newTestClient(t, base)
	got, err := c.Credit(context.Background())
	if err != nil || got != 1.5 {
		t.Fatalf("Credit = %v, %v; want 1.5 straight from the server", got, err)
	}
}

func TestObserveCodes(t *testing.T) {
	srv, _ := serve(t, 422, `{"error":"Unprocessable Entity "}`)
	var got []string
	c, err := New(apiConfig(func(c *Config) {
		c.BaseURL, c.Token = srv.URL, testToken
		c.Observe = func(route, code string, took time.Duration) { got = append(got, route+" "+code) }
	}))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = c.IPList(context.Background(), 101, "http-auth", "txt")
	if len(got) != 1 || got[0] != RouteIPList+" 422" {
		t.Errorf("observed %q", got)
	}
}

func TestReadTokenFile(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "token")
	if err := os.WriteFile(p, []byte("  "+testToken+"\r\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	got, err := ReadTokenFile(p)
	if err != nil || got != testToken {
		t.Fatalf("ReadTokenFile = %q, %v", got, err)
	}
	for name, content := range map[string]string{"empty": " \n", "two lines": testToken + "\n" + testToken + "\n"} {
		p := filepath.Join(dir, strings.ReplaceAll(name, " ", "_"))
		os.WriteFile(p, []byte(content), 0o600)
		_, err := ReadTokenFile(p)
		if err == nil || !strings.Contains(err.Error(), p) || strings.Contains(err.Error(), testToken) {
			t.Errorf("%s: err %v, want one naming the path and not the content", name, err)
		}
	}
	missing := filepath.Join(dir, "missing")
	if _, err := ReadTokenFile(missing); err == nil || !strings.Contains(err.Error(), missing) || !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing: err %v", err)
	}
}

// TestTokenNeverLeaks drives 401, 400, 500 (echoing the Authorization
// header, as a broken proxy might), a decode failure and a transport error,
// and greps every error string and a debug log for the credential.
func TestTokenNeverLeaks(t *testing.T) {
	const password = "Pw-8sJ2kQ0xZ"
	loginEnc := base64.StdEncoding.EncodeToString([]byte("demo@example.com:" + password))
	answers := []struct {
		status int
		body   func(r *http.Request) string
	}{
		{401, func(*http.Request) string { return "Unauthenticated" }},
		{400, func(*http.Request) string { return "Invalid Authorization header" }},
		{400, func(*http.Request) string { return "Invalid credentials format" }},
		{500, func(r *http.Request) string { return "<pre>" + r.Header.Get("Authorization") + "</pre>\nstack" }},
		{500, func(r *http.Request) string { return `{"error":"bad auth ` + r.Header.Get("Authorization") + `"}` }},
		{422, func(r *http.Request) string { return `{"error":"` + r.Header.Get("Authorization") + `"}` }},
		{200, func(r *http.Request) string { return `{"credit":"` + r.Header.Get("Authorization") + `"}` }},
	}
	var mu sync.Mutex
	next := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		a := answers[next%len(answers)]
		next++
		mu.Unlock()
		w.WriteHeader(a.status)
		io.WriteString(w, a.body(r))
	}))
	defer srv.Close()

	for _, cfg := range []Config{
		apiConfig(func(c *Config) { c.Token = testToken }),
		apiConfig(func(c *Config) { c.Login, c.Password = "demo@example.com", password }),
		apiConfig(func(c *Config) { c.Token = loginEnc }),
	} {
		var logBuf bytes.Buffer
		cfg.BaseURL = srv.URL
		cfg.Logger = slog.New(slog.NewTextHandler(&logBuf, &slog.HandlerOptions{Level: slog.LevelDebug}))
		c, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		var errs []string
		mu.Lock()
		next = 0
		mu.Unlock()
		for range answers {
			_, err := c.Credit(context.Background())
			if err == nil {
				t.Fatal("want an error")
			}
			errs = append(errs, err.Error())
		}
		// A transport error: a closed port.
		dead := httptest.NewServer(http.NotFoundHandler())
		dead.Close()
		cfg.BaseURL = dead.URL
		c2, _ := New(cfg)
		_, err = c2.Services(context.Background())
		if err == nil {
			t.Fatal("a closed port answered")
		}
		errs = append(errs, err.Error())
		all := strings.Join(errs, "\n") + "\n" + logBuf.String()
		for _, secret := range []string{testToken, password, loginEnc} {
			if strings.Contains(all, secret) {
				t.Errorf("credential %q leaked into:\n%s", secret, all)
			}
		}
		if !strings.Contains(logBuf.String(), RouteCredit) || !strings.Contains(logBuf.String(), "code=401") {
			t.Errorf("log lacks the requests:\n%s", logBuf.String())
		}
	}
}

// TestTransportErrorScrubbed: a transport whose error quotes the request's
// Authorization header (as a debugging proxy might) loses the credential
// but keeps the error chain.
func TestTransportErrorScrubbed(t *testing.T) {
	c, err := New(apiConfig(func(c *Config) {
		c.BaseURL, c.Token = "http://127.0.0.1:1", testToken
		c.Transport = roundTripFunc(func(r *http.Request) (*http.Response, error) {
			return nil, fmt.Errorf("proxy refused %q: %w", r.Header.Get("Authorization"), context.DeadlineExceeded)
		})
	}))
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Clients(context.Background())
	if err == nil || strings.Contains(err.Error(), testToken) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("err = %v", err)
	}
	// A decode failure unwraps to its cause.
	srv, _ := serve(t, 200, `{"credit":"x"}`)
	_, err = newTestClient(t, srv.URL).Credit(context.Background())
	var de *DecodeError
	if !errors.As(err, &de) || de.Route != RouteCredit || errors.Unwrap(de) == nil {
		t.Errorf("decode err = %v", err)
	}
}

// ProviderURL spells one address one way: scheme and host in lower case,
// no trailing slash; the path keeps its case (servers may tell it apart).
func TestProviderURL(t *testing.T) {
	for in, want := range map[string]string{
		"https://api.example-provider.net":       "https://api.example-provider.net",
		"HTTPS://API.Example-Provider.NET/":      "https://api.example-provider.net",
		"https://api.example-provider.net//":     "https://api.example-provider.net",
		"http://127.0.0.1:8080/Prefix/":          "http://127.0.0.1:8080/Prefix",
		"http://[::1]:8080":                      "http://[::1]:8080",
		"https://api.example-provider.net/a%2Fb": "https://api.example-provider.net/a%2Fb",
	} {
		if got := ProviderURL(in); got != want {
			t.Errorf("ProviderURL(%q) = %q, want %q", in, got, want)
		}
	}
}
