package providersim

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// testStart is the fixed time of simulators built by newTestSim.
var testStart = time.Date(2026, 11, 21, 10, 0, 0, 0, time.UTC)

// clock is a settable Config.Now.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

type testSim struct {
	*Sim
	srv   *httptest.Server
	clock *clock
}

// newTestSim serves a simulator with a fixed clock on a loopback port.
func newTestSim(t *testing.T, cfg Config) *testSim {
	t.Helper()
	c := &clock{t: testStart}
	if cfg.Now == nil {
		cfg.Now = c.Now
	}
	s := New(cfg)
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	return &testSim{Sim: s, srv: srv, clock: c}
}

type answer struct {
	status      int
	contentType string
	body        string
}

// do sends one request with the default token.
func (ts *testSim) do(t *testing.T, method, path, body string) answer {
	t.Helper()
	return ts.doAuth(t, method, path, body, "Basic "+DefaultToken)
}

// doAuth sends one request with the given Authorization header ("" for
// none).
func (ts *testSim) doAuth(t *testing.T, method, path, body, auth string) answer {
	t.Helper()
	a, err := ts.send(method, path, body, auth)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// send is doAuth for goroutines other than the test's.
func (ts *testSim) send(method, path, body, auth string) (answer, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, ts.srv.URL+path, rd)
	if err != nil {
		return answer{}, fmt.Errorf("building %s %s: %w", method, path, err)
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	req.Header.Set("Accept", "application/json")
	req.Header.Set("Content-Type", "application/json")
	resp, err := ts.srv.Client().Do(req)
	if err != nil {
		return answer{}, fmt.Errorf("%s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return answer{}, fmt.Errorf("reading %s %s: %w", method, path, err)
	}
	return answer{status: resp.StatusCode, contentType: resp.Header.Get("Content-Type"), body: string(b)}, nil
}

// want checks status and exact body.
func (a answer) want(t *testing.T, what string, status int, body string) {
	t.Helper()
	if a.status != status || a.body != body {
		t.Errorf("%s: got %d %q, want %d %q", what, a.status, a.body, status, body)
	}
}

// wantError checks a JSON application error byte-exact.
func (a answer) wantError(t *testing.T, what string, status int, msg string) {
	t.Helper()
	b, _ := json.Marshal(map[string]string{"error": msg})
	a.want(t, what, status, string(b))
	if a.contentType != "application/json" {
		t.Errorf("%s: content type %q, want application/json", what, a.contentType)
	}
}

// decode decodes a 200 JSON answer into v.
func (a answer) decode(t *testing.T, what string, v any) {
	t.Helper()
	if a.status != http.StatusOK {
		t.Fatalf("%s: status %d %q, want 200", what, a.status, a.body)
	}
	if err := json.Unmarshal([]byte(a.body), v); err != nil {
		t.Fatalf("%s: decoding %q: %v", what, a.body, err)
	}
}

func b64(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }
