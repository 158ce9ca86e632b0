package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/proxy"

	"github.com/proxyd/proxyd/agent"
	"github.com/proxyd/proxyd/agent/providersim"
	"github.com/proxyd/proxyd/forward"
	"github.com/proxyd/proxyd/internal/freeport"
	"github.com/proxyd/proxyd/internal/syncbuf"
	"github.com/proxyd/proxyd/pool"
)

// e2e is a running daemon against the demo world: providersim, its proxy
// servers on 127.0.x.y and an origin.
type e2e struct {
	t        *testing.T
	w        *demoWorld
	d        *daemon
	cfg      config
	stateDir string
	logs     *syncbuf.Buffer
	done     chan error
}

// quietPolls makes the background loops poll once at start and then wait
// an hour, so that tests drive the polls with PollOnce.
func quietPolls(cfg *config) {
	cfg.Poll.IPList = time.Hour
	cfg.Poll.NetworkStatus = time.Hour
	cfg.Poll.Usage = time.Hour
	cfg.Poll.Account = time.Hour
}

func newWorld(t *testing.T) *demoWorld {
	t.Helper()
	w, err := startDemoWorld(!loopbackAliases())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.close)
	return w
}

func startDaemon(t *testing.T, w *demoWorld, stateDir string, mutate func(*config)) *e2e {
	t.Helper()
	cfg := demoConfig(w, "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0", stateDir)
	quietPolls(&cfg)
	if mutate != nil {
		mutate(&cfg)
	}
	logs := &syncbuf.Buffer{}
	logger, logCtl := newLogger(cfg.Log, logs)
	env := map[string]string{"PROXYD_API_TOKEN": providersim.DefaultToken}
	d, err := newDaemon(cfg, daemonOptions{getenv: func(k string) string { return env[k] }, logger: logger, logs: logCtl})
	if err != nil {
		t.Fatal(err)
	}
	e := &e2e{t: t, w: w, d: d, cfg: cfg, stateDir: stateDir, logs: logs, done: make(chan error, 1)}
	go func() { e.done <- d.Run(context.Background()) }()
	select {
	case <-d.ready:
	case err := <-e.done:
		t.Fatalf("daemon did not start: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("daemon not ready after 10s")
	}
	t.Cleanup(e.stop)
	return e
}

func (e *e2e) stop() {
	e.d.Close()
	// Run has returned; its error is on its way.
	if err := <-e.done; err != nil {
		e.t.Errorf("Run: %v", err)
	}
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (e *e2e) admin(path string) (int, string) {
	resp, err := http.Get("http://" + e.d.adminAddr() + path)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// startWithUsage starts a daemon on a new world whose ppr service is at
// 700 of its 1024 limit, read once: its state file holds the usage.
func startWithUsage(t *testing.T, mutate func(*config)) (*demoWorld, string, *e2e) {
	t.Helper()
	w, state := newWorld(t), t.TempDir()
	w.sim.SetUsage(demoPPR, 700, 1024)
	e := startDaemon(t, w, state, mutate)
	e.waitReady()
	e.pollOnce(agent.LoopUsage)
	return w, state, e
}

// upstreamsOf counts the upstreams of service in /pool, draining ones
// included.
func (e *e2e) upstreamsOf(service int) int {
	n := 0
	for _, u := range e.poolState().Upstreams {
		if u.Service == service {
			n++
		}
	}
	return n
}

func (e *e2e) poolState() pool.Explanation {
	_, body := e.admin("/pool")
	var ex pool.Explanation
	if err := json.Unmarshal([]byte(body), &ex); err != nil {
		e.t.Fatalf("decoding /pool: %v: %s", err, body)
	}
	return ex
}

func (e *e2e) waitReady() {
	e.t.Helper()
	// The loops' first rounds must be over, so that a test's own PollOnce
	// is not overtaken by an older answer.
	waitFor(e.t, "the first poll of every loop", 10*time.Second, func() bool {
		for l := agent.LoopAccount; l <= agent.LoopUsage; l++ {
			if e.d.poller.Rounds(l) == 0 {
				return false
			}
		}
		return true
	})
	waitFor(e.t, "/readyz 200", 10*time.Second, func() bool { code, _ := e.admin("/readyz"); return code == 200 })
}

// get fetches the origin through a listener ("http" or "socks"), with an
// optional sticky key, and returns the body and the upstream that carried it.
func (e *e2e) get(listener, key string) (string, string, error) {
	var tr *http.Transport
	addr := e.d.listenerAddr(listener)
	lc, _ := e.cfg.listenerNamed(listener)
	switch lc.Protocol {
	case "http":
		u := &url.URL{Scheme: "http", Host: addr}
		if key != "" {
			u.User = url.UserPassword("session-"+key, "x")
		}
		tr = &http.Transport{Proxy: http.ProxyURL(u), DisableKeepAlives: true}
	default:
		var auth *proxy.Auth
		if key != "" {
			auth = &proxy.Auth{User: "session-" + key, Password: "x"}
		}
		dialer, err := proxy.SOCKS5("tcp", addr, auth, proxy.Direct)
		if err != nil {
			return "", "", err
		}
		tr = &http.Transport{DialContext: dialer.(proxy.ContextDialer).DialContext, DisableKeepAlives: true}
	}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: 15 * time.Second}
	resp, err := c.Get("http://" + e.w.origin + "/hello")
	if err != nil {
		return "", "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		return string(b), "", fmt.Errorf("status %d: %s", resp.StatusCode, b)
	}
	return string(b), resp.Header.Get("X-Sim-Upstream"), err
}

func (e *e2e) mustGet(listener, key string) string {
	e.t.Helper()
	body, via, err := e.get(listener, key)
	if err != nil || !strings.HasPrefix(body, "hello from the demo origin") {
		e.t.Fatalf("GET through %s: %q %v", listener, body, err)
	}
	return via
}

func (e *e2e) pollOnce(l agent.Loop) {
	e.t.Helper()
	if err := e.d.poller.PollOnce(context.Background(), l); err != nil {
		e.t.Fatalf("poll %s: %v", l, err)
	}
}

func hostOf(addr string) string {
	h, _, _ := net.SplitHostPort(addr)
	return h
}

func TestDaemonTrafficOnBothListeners(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), nil)
	e.waitReady()
	for i := 0; i < 6; i++ {
		e.mustGet("http", "")
		e.mustGet("socks", "")
	}
	var socksUsed int64
	for _, p := range w.fprSOCKS {
		socksUsed += p.Accepted()
	}
	if socksUsed == 0 {
		t.Error("no SOCKS5 upstream carried a connection")
	}
	// A connection is counted when it ends, which the server sees just
	// after the client read its answer.
	waitFor(t, "6 ok connections of each listener in /metrics", 5*time.Second, func() bool {
		code, body := e.admin("/metrics")
		return code == 200 && strings.Contains(body, `proxyd_connections_total{listener="http",result="ok"} 6`) &&
			strings.Contains(body, `proxyd_connections_total{listener="socks",result="ok"} 6`)
	})
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestDaemonErroredListWhileInactiveFails: the provider's errored list is
// applied as soon as it is fetched, even while its inactive list fails.
func TestDaemonErroredListWhileInactiveFails(t *testing.T) {
	w := newWorld(t)
	front := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.URL.Path, "/networkstatus/inactive/") {
			http.Error(rw, `{"message":"down"}`, http.StatusServiceUnavailable)
			return
		}
		w.sim.ServeHTTP(rw, r)
	}))
	defer front.Close()
	bad := w.fprHTTP[0]
	w.sim.MarkErrored(demoFPR, hostOf(bad.Addr()))
	e := startDaemon(t, w, t.TempDir(), func(c *config) { c.API.BaseURL = front.URL })
	e.waitReady()
	if err := e.d.poller.PollOnce(context.Background(), agent.LoopStatus); err == nil || !strings.Contains(err.Error(), "inactive") {
		t.Fatalf("a status poll with the inactive list failing: %v", err)
	}
	waitFor(t, "the errored upstream out of the pool", 5*time.Second, func() bool {
		for _, u := range e.poolState().Upstreams {
			if u.Address == bad.Addr() && u.Protocol == pool.HTTP {
				return u.State == pool.ProviderError
			}
		}
		return false
	})
}

func TestDaemonErroredIPGetsNoConnections(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), nil)
	e.waitReady()
	bad := w.fprHTTP[0]
	w.sim.MarkErrored(demoFPR, hostOf(bad.Addr()))
	e.pollOnce(agent.LoopStatus)
	before := bad.Accepted()
	for i := 0; i < 12; i++ {
		e.mustGet("http", "")
	}
	if n := bad.Accepted() - before; n != 0 {
		t.Errorf("the errored upstream took %d connections after the poll", n)
	}
	found := false
	for _, u := range e.poolState().Upstreams {
		if u.Address == bad.Addr() && u.Protocol == pool.HTTP {
			found = true
			if u.State != pool.ProviderError {
				t.Errorf("state %s, want provider_error", u.State)
			}
		}
	}
	if !found {
		t.Error("the errored upstream is missing from /pool")
	}
}

func TestDaemonAPIDownKeepsServingAndBacksOff(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), func(c *config) {
		c.Poll.NetworkStatus = time.Second
		c.Poll.MaxBackoff = 8 * time.Second
		c.Poll.Jitter = 0.01
	})
	e.waitReady()
	w.sim.FailNext(1<<30, 500, "<html>internal error</html>")
	route := "/api/networkstatus/errors/{id}"
	start := w.sim.Requests(route)
	began := time.Now()
	// Healthy, the 1s loop would poll each of the 2 services about 5 times
	// in 4.5s (10 requests); failing, it backs off 1s, 2s, 4s: at most 3
	// rounds of 2 requests.
	for time.Since(began) < 4500*time.Millisecond {
		e.mustGet("http", "")
		e.mustGet("socks", "")
		time.Sleep(150 * time.Millisecond)
	}
	if n := w.sim.Requests(route) - start; n > 6 || n < 2 {
		t.Errorf("%d network status requests in 4.5s while the API fails: want 2–6 (still polling, backed off)", n)
	}
	if code, _ := e.admin("/readyz"); code != 200 {
		t.Errorf("readyz %d while the API is down", code)
	}
	if !strings.Contains(e.logs.String(), "provider API poll failed") {
		t.Error("API failures are not logged")
	}
}

func TestDaemonRestartServesFromState(t *testing.T) {
	w := newWorld(t)
	state := t.TempDir()
	e := startDaemon(t, w, state, nil)
	e.waitReady()
	w.sim.MarkErrored(demoFPR, hostOf(w.fprHTTP[0].Addr()))
	e.pollOnce(agent.LoopStatus)
	e.d.Close()
	saved, err := readState(state)
	if err != nil || saved == nil || len(saved.Upstreams) == 0 || len(saved.Status[demoFPR].Errored) != 1 {
		t.Fatalf("saved state: %+v %v", saved, err)
	}
	fi, err := os.Stat(filepath.Join(state, stateFileName))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("state file mode %v, want 0600", fi.Mode().Perm())
	}
	if data, _ := os.ReadFile(filepath.Join(state, stateFileName)); !strings.Contains(string(data), "pw-101-sim") {
		t.Error("the state file must hold the upstream credentials it serves with")
	}

	// Make the saved state an hour old, as after a long outage: the lists
	// were last fetched then.
	if saved.Fetched.IsZero() {
		t.Fatal("the state file does not say when its lists were fetched")
	}
	saved.Saved, saved.Fetched = saved.Saved.Add(-time.Hour), saved.Fetched.Add(-time.Hour)
	if err := writeState(state, saved); err != nil {
		t.Fatal(err)
	}
	w.sim.FailNext(1<<30, 500, "down")
	e2 := startDaemon(t, w, state, nil)
	e2.waitReady()
	e2.mustGet("http", "")
	e2.mustGet("socks", "")
	// The provider's last word survives the restart: the errored upstream
	// stays out, and the file keeps it.
	found := false
	for _, u := range e2.poolState().Upstreams {
		if u.Address == w.fprHTTP[0].Addr() {
			found = true
			if u.State != pool.ProviderError {
				t.Errorf("%s after restart: %s, want provider_error", u.ID, u.State)
			}
		}
	}
	if !found {
		t.Error("the errored upstream is missing from /pool after the restart")
	}
	if again, _ := readState(state); again == nil || len(again.Status[demoFPR].Errored) != 1 {
		t.Errorf("the restart with the API down lost the saved status: %+v", again)
	}
	// The age is that of the data, not of the restart.
	_, body := e2.admin("/metrics")
	m := regexp.MustCompile(`(?m)^proxyd_state_age_seconds ([0-9.e+]+)$`).FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("no proxyd_state_age_seconds:\n%s", grepLines(body, "state_age"))
	}
	if age, _ := strconv.ParseFloat(m[1], 64); age < 3600 || age > 3700 {
		t.Errorf("state age %.0fs, want the hour since it was saved", age)
	}
	// So does the status page, while its pool was updated just now.
	if _, page := e2.admin("/"); !strings.Contains(page, "IP lists fetched "+saved.Fetched.UTC().Format(time.RFC3339)) {
		t.Errorf("the status page does not say the lists are from %s:\n%s", saved.Fetched.UTC().Format(time.RFC3339), grepLines(page, "fetched"))
	}
}

// A reload that moves [state] dir saves there at once, changed pool or
// not. When that save fails (here the file's name is taken by a
// directory; a full disk does the same), the next save still writes,
// changed pool or not, instead of waiting for the pool to change.
func TestDaemonStateSaveRetriedAfterFailure(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), nil)
	e.waitReady()
	moved := t.TempDir()
	blocker := filepath.Join(moved, stateFileName)
	if err := os.Mkdir(blocker, 0o700); err != nil {
		t.Fatal(err)
	}
	next := e.cfg
	next.State.Dir = moved
	if err := e.d.Reload(next); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(e.logs.String(), "saving pool state") {
		t.Fatalf("the save into the moved dir did not fail:\n%s", e.logs.String())
	}
	if err := os.Remove(blocker); err != nil {
		t.Fatal(err)
	}
	e.d.applyMu.Lock()
	e.d.saveState() // the same pool as before the reload
	e.d.applyMu.Unlock()
	if saved, err := readState(moved); err != nil || saved == nil || len(saved.Upstreams) == 0 {
		t.Fatalf("no state in the moved dir after it took writes again: %+v, %v", saved, err)
	}
}

// After a restart, a first IP list that comes back empty is not swapped in
// before a regular poll, an ip_list interval later, confirms it: the saved
// upstreams keep serving.
func TestDaemonRestartWithEmptyFirstList(t *testing.T) {
	w := newWorld(t)
	state := t.TempDir()
	e := startDaemon(t, w, state, nil)
	e.waitReady()
	e.d.Close()

	w.sim.SetEntries(demoFPR, "http-auth", nil)
	var (
		mu  sync.Mutex
		off time.Duration // how far the poller's clock is ahead
	)
	e2 := startDaemon(t, w, state, func(c *config) {
		c.Poll.Now = func() time.Time {
			mu.Lock()
			defer mu.Unlock()
			return time.Now().Add(off)
		}
	})
	e2.waitReady()
	count := func() int {
		n := 0
		for _, u := range e2.poolState().Upstreams {
			if u.Service == demoFPR && u.Protocol == pool.HTTP && u.State == pool.Healthy {
				n++
			}
		}
		return n
	}
	if n := count(); n != 3 {
		t.Fatalf("%d fpr http upstreams after the first (empty) poll, want the 3 saved ones", n)
	}
	e2.pollOnce(agent.LoopLists) // asked again at once: not yet a confirmation
	if n := count(); n != 3 {
		t.Fatalf("%d fpr http upstreams after an immediate second poll, want the 3 saved ones", n)
	}
	mu.Lock()
	off = e2.cfg.Poll.IPList // the next regular poll
	mu.Unlock()
	e2.pollOnce(agent.LoopLists) // the provider says it again: now it counts
	waitFor(t, "the confirmed empty list", 5*time.Second, func() bool { return count() == 0 })
}

func TestDaemonReadyzFollowsUsableUpstreams(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), nil)
	e.waitReady()
	var all []string
	for _, ps := range [][]*providersim.Proxy{w.fprHTTP, w.fprSOCKS} {
		for _, p := range ps {
			all = append(all, hostOf(p.Addr()))
		}
	}
	w.sim.MarkErrored(demoFPR, all...)
	var gateways []string // each sticky session has a gateway host of its own
	for _, p := range w.sessions {
		gateways = append(gateways, hostOf(p.Addr()))
	}
	w.sim.MarkInactive(demoPPR, gateways...)
	e.pollOnce(agent.LoopStatus)
	code, body := e.admin("/readyz")
	if code != 503 || !strings.Contains(body, "no usable upstream") {
		t.Fatalf("readyz with every upstream excluded: %d %q", code, body)
	}
	w.sim.ClearStatus(demoFPR)
	w.sim.ClearStatus(demoPPR)
	e.pollOnce(agent.LoopStatus)
	if code, body := e.admin("/readyz"); code != 200 {
		t.Fatalf("readyz after the provider cleared them: %d %q", code, body)
	}
}

func TestDaemonStickySessionRotated(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), func(c *config) {
		c.Listener = append(c.Listener, defaultListener())
		l := &c.Listener[2]
		l.Name, l.Protocol, l.Upstream, l.Address, l.Kind = "ppr", "http", "http", "127.0.0.1:0", "ppr"
		l.AllowDestinations = []forward.Network{forward.MustParseNetwork("127.0.0.0/8")}
		c.Pool.RotateWait = 2 * time.Second
	})
	e.waitReady()
	via := e.mustGet("ppr", "k1")
	if !strings.HasPrefix(via, "ppr-session-") {
		t.Fatalf("sticky ppr request went via %q", via)
	}
	for i := 0; i < 3; i++ {
		if again := e.mustGet("ppr", "k1"); again != via {
			t.Fatalf("sticky key moved from %s to %s", via, again)
		}
	}
	idx := 0
	if via == "ppr-session-s2" {
		idx = 1
	}
	sess := w.sim.Sessions(demoPPR)[idx]
	w.sessions[idx].Down()
	// The client still gets an answer (another session for this one
	// connection), and the pool asks the provider to rotate the session.
	e.mustGet("ppr", "k1")
	waitFor(t, "a rotation through the provider", 10*time.Second, func() bool {
		return w.sim.Requests("/api/sticky/rotate/{id}/{server}/{session}") > 0
	})
	waitFor(t, "the new exit IP in /pool", 10*time.Second, func() bool {
		now := w.sim.Sessions(demoPPR)[idx].ExitIP
		if now == sess.ExitIP {
			return false
		}
		for _, u := range e.poolState().Upstreams {
			if u.Session == sess.Session && u.ExitIP == now {
				return true
			}
		}
		return false
	})
	_, body := e.admin("/metrics")
	if !strings.Contains(body, `proxyd_sticky_rotations_total{result="ok",service="102"} 1`) {
		t.Errorf("rotation metric:\n%s", grepLines(body, "sticky_rotations"))
	}
}

// A sticky session whose port no IP list vouches for gets no upstream,
// yet proxyd has the provider rotate it when its exit IP is errored, as it
// does the sessions it dials.
func TestDaemonUnservedSessionRotated(t *testing.T) {
	w := newWorld(t)
	lost := providersim.Session{Server: "127.0.3.250", Session: "lost", Port: 4999, ExitIP: "198.51.100.99", TTL: 5}
	w.sim.SetStickySessions(demoPPR, append(w.sim.Sessions(demoPPR), lost))
	e := startDaemon(t, w, t.TempDir(), nil)
	e.waitReady()
	e.pollOnce(agent.LoopLists)
	for _, u := range e.poolState().Upstreams {
		if u.Session == lost.Session {
			t.Fatalf("the unlisted session has an upstream: %+v", u)
		}
	}
	// /pool lists it apart; a filter by its service keeps it, one by state
	// or listener (it has neither) leaves it out.
	unserved := func(query string) []pool.UnservedExplanation {
		t.Helper()
		code, body := e.admin("/pool" + query)
		var ex pool.Explanation
		if err := json.Unmarshal([]byte(body), &ex); code != 200 || err != nil || ex.Unserved == nil {
			t.Fatalf("/pool%s: %d %v %s", query, code, err, body)
		}
		return ex.Unserved
	}
	listed := []pool.UnservedExplanation{{Service: demoPPR, Server: lost.Server, Session: lost.Session, ExitIP: lost.ExitIP}}
	for _, q := range []string{"", "?service=102"} {
		if got := unserved(q); !slices.Equal(got, listed) {
			t.Errorf("/pool%s unserved sessions %+v, want %+v", q, got, listed)
		}
	}
	for _, q := range []string{"?service=101", "?state=healthy", "?listener=http"} {
		if got := unserved(q); len(got) != 0 {
			t.Errorf("/pool%s unserved sessions %+v, want none", q, got)
		}
	}
	w.sim.MarkErrored(demoPPR, lost.ExitIP)
	e.pollOnce(agent.LoopStatus)
	// The pool counts a rotation once it has recorded its event.
	waitFor(t, "the rotation counted", 10*time.Second, func() bool {
		_, body := e.admin("/metrics")
		return strings.Contains(body, `proxyd_sticky_rotations_total{result="ok",service="102"} 1`)
	})
	for _, s := range w.sim.Sessions(demoPPR) {
		if s.Session == lost.Session && s.ExitIP == lost.ExitIP {
			t.Errorf("the unlisted session kept its errored exit IP %s", s.ExitIP)
		}
	}
	if n := w.sim.Requests("/api/sticky/rotate/{id}/{server}/{session}"); n != 1 {
		t.Errorf("%d sticky/rotate calls, want 1", n)
	}
	_, body := e.admin("/events?kind=rotated")
	var got struct{ Events []pool.Event }
	if err := json.Unmarshal([]byte(body), &got); err != nil {
		t.Fatalf("/events: %v\n%s", err, body)
	}
	want := "ok: session lost on 127.0.3.250, which no upstream stands for"
	if len(got.Events) != 1 || got.Events[0].Upstream != "" || got.Events[0].Service != demoPPR || got.Events[0].Reason != want {
		t.Errorf("rotated events %+v, want one of service %d with reason %q", got.Events, demoPPR, want)
	}
}

// A listener address that cannot be bound stops the start, and the error
// names the key as the file writes it.
func TestDaemonStartNamesTheBusyAddress(t *testing.T) {
	w := newWorld(t)
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	cfg := demoConfig(w, "127.0.0.1:0", busy.Addr().String(), "127.0.0.1:0", t.TempDir())
	quietPolls(&cfg)
	env := map[string]string{"PROXYD_API_TOKEN": providersim.DefaultToken}
	d, err := newDaemon(cfg, daemonOptions{getenv: func(k string) string { return env[k] }, logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- d.Run(context.Background()) }()
	select {
	case err := <-done:
		key := "listener[1].address: listen tcp " + busy.Addr().String()
		if err == nil || !strings.HasPrefix(err.Error(), key) {
			t.Errorf("Run: %v, want an error that starts with %q", err, key)
		}
	case <-time.After(10 * time.Second):
		d.Close()
		<-done
		t.Fatal("the daemon runs with its SOCKS5 address taken")
	}
}

func TestDaemonQuotaMovesTrafficElsewhere(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), nil)
	e.waitReady()
	w.sim.SetUsage(demoPPR, 1024, 1024)
	e.pollOnce(agent.LoopUsage)
	before := int64(0)
	for _, p := range w.sessions {
		before += p.Accepted()
	}
	for i := 0; i < 10; i++ {
		if via := e.mustGet("http", ""); !strings.HasPrefix(via, "fpr-") {
			t.Fatalf("request went via %s while service %d is at its limit", via, demoPPR)
		}
	}
	after := int64(0)
	for _, p := range w.sessions {
		after += p.Accepted()
	}
	if after != before {
		t.Errorf("the ppr gateway took %d connections at its usage limit", after-before)
	}
	ppr := 0
	for _, u := range e.poolState().Upstreams {
		if u.Service == demoPPR {
			ppr++
			if u.State != pool.Quota {
				t.Errorf("%s: state %s, want quota", u.ID, u.State)
			}
		}
	}
	if ppr == 0 {
		t.Errorf("no upstream of service %d in /pool", demoPPR)
	}
	_, body := e.admin("/metrics")
	if !strings.Contains(body, `proxyd_usage_limit{service="102"} 1024`) {
		t.Errorf("usage metrics:\n%s", grepLines(body, "proxyd_usage"))
	}
	// An empty rate answer (the provider has no figures) lifts the quota:
	// nothing is left to weigh, and no gauge shows stale figures.
	w.sim.ClearUsage(demoPPR)
	e.pollOnce(agent.LoopUsage)
	waitFor(t, "the quota to lift after an empty rate answer", 5*time.Second, func() bool {
		for _, u := range e.poolState().Upstreams {
			if u.Service == demoPPR && u.State == pool.Quota {
				return false
			}
		}
		return true
	})
	if _, body := e.admin("/metrics"); strings.Contains(body, `proxyd_usage_limit{service="102"}`) {
		t.Errorf("usage gauges after an empty rate answer:\n%s", grepLines(body, "proxyd_usage"))
	}
}

func TestDaemonPoolEndpointAndCommand(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), nil)
	e.waitReady()
	code, body := e.admin("/pool?service=101&state=healthy&listener=http")
	if code != 200 {
		t.Fatalf("/pool: %d %s", code, body)
	}
	var ex pool.Explanation
	if err := json.Unmarshal([]byte(body), &ex); err != nil {
		t.Fatalf("decoding /pool: %v: %s", err, body)
	}
	if len(ex.Upstreams) != 3 || len(ex.Listeners) != 1 || ex.Listeners[0].Name != "http" {
		t.Errorf("filtered /pool: %d upstreams, listeners %+v", len(ex.Upstreams), ex.Listeners)
	}
	if strings.Contains(body, "pw-101-sim") || strings.Contains(body, "password") {
		t.Error("/pool shows a password")
	}
	if code, _ := e.admin("/pool?state=bogus"); code != 400 {
		t.Errorf("unknown state: %d", code)
	}
	poolCmd := func(args ...string) (int, string, string) {
		var out, errb bytes.Buffer
		rc := runMain(context.Background(), append([]string{"pool", "-admin", e.d.adminAddr()}, args...),
			stdio{out: &out, err: &errb, getenv: func(string) string { return "" }})
		return rc, out.String(), errb.String()
	}
	rc, out, errOut := poolCmd()
	if rc != 0 || !strings.Contains(out, "LISTENER") || !strings.Contains(out, "101/http/") {
		t.Errorf("proxyd pool: %d %s %s", rc, out, errOut)
	}
	// The account's standing closes the table: the simulated account has
	// one unpaid invoice.
	if want := "account: credit 100.00 USD; 1 unpaid invoice (20.50 USD): pay before the provider suspends services\n"; !strings.HasSuffix(out, want) {
		t.Errorf("proxyd pool does not end with %q:\n%s", want, out)
	}
	// The filters reach /pool.
	rc, out, errOut = poolCmd("-service", "102", "-listener", "http")
	if rc != 0 || !strings.Contains(out, "102/http/") || strings.Contains(out, "101/") || strings.Contains(out, "socks") {
		t.Errorf("proxyd pool -service 102 -listener http: %d %s %s", rc, out, errOut)
	}
}

// TestRenderPoolGolden pins the table of `proxyd pool`.
func TestRenderPoolGolden(t *testing.T) {
	until := time.Date(2026, 11, 21, 10, 0, 30, 0, time.UTC)
	ex := pool.Explanation{
		Updated:   time.Date(2026, 11, 21, 10, 0, 0, 0, time.UTC),
		Listeners: []pool.ListenerExplanation{{Name: "http", Usable: 1, Total: 2, Panic: false}, {Name: "socks", Usable: 0, Total: 1, Panic: true}},
		Upstreams: []pool.UpstreamExplanation{
			{ID: "101/http/192.0.2.1:8080", Service: 101, State: pool.Healthy},
			{ID: "101/http/192.0.2.2:8080", Service: 101, State: pool.Ejected, Reason: "dial_refused", Failures: 7, ConsecutiveFailures: 3, Ejections: 1, EjectedUntil: &until},
			{ID: "102/socks5/gw.example:9000/s1", Service: 102, State: pool.Rotating, ExitIP: "198.51.100.7", InFlight: 2},
		},
		Unserved: []pool.UnservedExplanation{{Service: 102, Server: "gw.example", Session: "s9", ExitIP: "198.51.100.9", ExitErrored: true, Rotating: true}},
	}
	var b bytes.Buffer
	if err := renderPool(&b, ex, until.Add(-10*time.Second)); err != nil {
		t.Fatal(err)
	}
	golden(t, "pool_table", b.String())
}

func TestTCPProber(t *testing.T) {
	w := newWorld(t)
	var p tcpProber
	// The pool bounds every probe (pool.Config.ProbeTimeout).
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if r := p.Probe(ctx, &pool.Upstream{Protocol: pool.HTTP, Address: w.fprHTTP[0].Addr()}); r != pool.Success {
		t.Errorf("live http upstream: %s", r)
	}
	if r := p.Probe(ctx, &pool.Upstream{Protocol: pool.SOCKS5, Address: w.fprSOCKS[0].Addr()}); r != pool.Success {
		t.Errorf("live socks upstream: %s", r)
	}
	w.fprSOCKS[1].Down()
	if r := p.Probe(ctx, &pool.Upstream{Protocol: pool.SOCKS5, Address: w.fprSOCKS[1].Addr()}); r != pool.DialRefused {
		t.Errorf("dead upstream: %s", r)
	}
	// A silent SOCKS5 upstream: the probe ends when its context is
	// cancelled (proxyd stopping), not at the deadline.
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	go func() {
		for {
			c, err := silent.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	long, stop := context.WithTimeout(context.Background(), 10*time.Second)
	time.AfterFunc(100*time.Millisecond, stop)
	start := time.Now()
	if r := p.Probe(long, &pool.Upstream{Protocol: pool.SOCKS5, Address: silent.Addr().String()}); r != pool.HandshakeTimeout || time.Since(start) > 2*time.Second {
		t.Errorf("silent upstream, probe cancelled after 100ms: %s after %s", r, time.Since(start))
	}
}

// The probe dials an upstream from the source_address of the first
// listener that dials it, as that listener's connections do; a reload
// that changes the listeners changes it.
func TestTCPProberSourceAddress(t *testing.T) {
	if !loopbackAliases() {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI runs on Linux, where all of 127.0.0.0/8 is on the loopback interface")
		}
		t.Skip("needs all of 127.0.0.0/8 on the loopback interface (Linux); CI=true makes this a failure")
	}
	from := make(chan string, 1)
	up, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer up.Close()
	go func() {
		for {
			c, err := up.Accept()
			if err != nil {
				return
			}
			from <- hostOf(c.RemoteAddr().String())
			c.Close()
		}
	}()
	listener := func(kind, source string) listenerConfig {
		l := defaultListener()
		l.Protocol, l.Upstream, l.Kind = "http", "http", kind
		if source != "" {
			l.SourceAddress = netip.MustParseAddr(source)
		}
		return l
	}
	e := startDaemon(t, newWorld(t), t.TempDir(), func(c *config) {
		c.Listener = []listenerConfig{listener("ppr", "127.0.0.3"), listener("fpr", "127.0.0.2"), listener("", "127.0.0.4")}
		for i := range c.Listener {
			c.Listener[i].Name, c.Listener[i].Address = fmt.Sprint("l", i), "127.0.0.1:0"
		}
	})
	probeFrom := func(kind pool.Kind) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if r := e.d.prober.Probe(ctx, &pool.Upstream{Service: 101, Kind: kind, Protocol: pool.HTTP, Address: up.Addr().String()}); r != pool.Success {
			t.Fatalf("probe: %s", r)
		}
		return <-from
	}
	if got := probeFrom(pool.FPR); got != "127.0.0.2" {
		t.Errorf("fpr upstream probed from %s, want the fpr listener's 127.0.0.2", got)
	}
	if got := probeFrom(pool.PPR); got != "127.0.0.3" {
		t.Errorf("ppr upstream probed from %s, want the ppr listener's 127.0.0.3", got)
	}
	next := e.cfg
	next.Listener = slices.Clone(next.Listener[2:])
	if err := e.d.Reload(next); err != nil {
		t.Fatal(err)
	}
	if got := probeFrom(pool.FPR); got != "127.0.0.4" {
		t.Errorf("after the reload, fpr upstream probed from %s, want the one listener's 127.0.0.4", got)
	}
	next.Listener = slices.Clone(next.Listener) // the running config holds the other
	next.Listener[0].SourceAddress = netip.Addr{}
	if err := e.d.Reload(next); err != nil {
		t.Fatal(err)
	}
	if got := probeFrom(pool.FPR); got != "127.0.0.1" {
		t.Errorf("without a source_address, probed from %s, want the system's choice 127.0.0.1", got)
	}
}

func TestAdminBearerToken(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), func(c *config) { c.Admin.Token = "adm-7c1" })
	get := func(path, auth string) int {
		req, _ := http.NewRequest(http.MethodGet, "http://"+e.d.adminAddr()+path, nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, p := range []string{"/metrics", "/pool", "/readyz"} {
		if code := get(p, ""); code != 401 {
			t.Errorf("%s without token: %d", p, code)
		}
		if code := get(p, "Bearer wrong"); code != 401 {
			t.Errorf("%s with a wrong token: %d", p, code)
		}
	}
	if code := get("/metrics", "Bearer adm-7c1"); code != 200 {
		t.Errorf("/metrics with the token: %d", code)
	}
	if code := get("/healthz", ""); code != 200 {
		t.Errorf("/healthz stays open for liveness checks: %d", code)
	}
}

// TestDaemonReloadListeners moves one listener and removes another: the
// tunnel open on the removed one carries on until it is done, the moved one
// answers on its new address only, and the one that did not change keeps its
// connections.
func TestDaemonReloadListeners(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), func(c *config) {
		extra := defaultListener()
		extra.Name, extra.Protocol, extra.Upstream, extra.Address = "extra", "http", "http", "127.0.0.1:0"
		extra.AllowDestinations = []forward.Network{forward.MustParseNetwork("127.0.0.0/8")}
		c.Listener = append(c.Listener, extra)
	})
	e.waitReady()
	oldHTTP, socksAddr, extraAddr := e.d.listenerAddr("http"), e.d.listenerAddr("socks"), e.d.listenerAddr("extra")

	// Tunnels that stay open across the reload: one on the unchanged
	// listener (socks), one on the listener that goes away (extra).
	echo := echoServer(t)
	d, _ := proxy.SOCKS5("tcp", socksAddr, nil, proxy.Direct)
	socksTunnel, err := d.Dial("tcp", echo)
	if err != nil {
		t.Fatal(err)
	}
	defer socksTunnel.Close()
	extraTunnel := connectTunnel(t, extraAddr, echo)
	defer extraTunnel.Close()
	roundTrip(t, socksTunnel, "before")
	roundTrip(t, extraTunnel, "before")

	next := e.cfg
	next.Listener = []listenerConfig{e.cfg.Listener[0], e.cfg.Listener[1]}
	next.Listener[0].Address = freeport.Addr(t) // http moves
	if err := e.d.Reload(next); err != nil {
		t.Fatal(err)
	}
	e.cfg = next
	if got := e.d.listenerAddr("socks"); got != socksAddr {
		t.Errorf("the unchanged listener moved: %s → %s", socksAddr, got)
	}
	if e.d.listenerAddr("extra") != "" {
		t.Error("the removed listener is still served")
	}
	roundTrip(t, socksTunnel, "after")
	roundTrip(t, extraTunnel, "after") // draining, not cut
	e.mustGet("http", "")
	e.mustGet("socks", "")
	waitFor(t, "the old addresses to stop accepting", 5*time.Second, func() bool {
		for _, a := range []string{oldHTTP, extraAddr} {
			if c, err := net.DialTimeout("tcp", a, time.Second); err == nil {
				c.Close()
				return false
			}
		}
		return true
	})
	// A reload that cannot bind keeps the running config.
	busy := e.cfg
	busy.Listener = append([]listenerConfig{}, e.cfg.Listener...)
	busy.Listener[1].Address = e.w.simURL[len("http://"):] // taken
	if err := e.d.Reload(busy); err == nil {
		t.Fatal("a reload onto a taken address must fail")
	}
	e.mustGet("socks", "")
	_, body := e.admin("/metrics")
	if !strings.Contains(body, "proxyd_config_last_reload_successful 0") {
		t.Errorf("reload metric:\n%s", grepLines(body, "reload"))
	}
}

func echoServer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() { defer wg.Done(); defer c.Close(); io.Copy(c, c) }()
		}
	}()
	return ln.Addr().String()
}

func connectTunnel(t *testing.T, proxyAddr, dest string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", proxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", dest, dest)
	// Read the answer head byte by byte so nothing of the tunnel is consumed.
	var head []byte
	b := make([]byte, 1)
	for !bytes.HasSuffix(head, []byte("\r\n\r\n")) {
		if _, err := c.Read(b); err != nil {
			t.Fatalf("CONNECT answer: %v (%q)", err, head)
		}
		head = append(head, b[0])
	}
	if !bytes.HasPrefix(head, []byte("HTTP/1.1 200")) {
		t.Fatalf("CONNECT answer %q", head)
	}
	return c
}

func roundTrip(t *testing.T, c net.Conn, msg string) {
	t.Helper()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := io.WriteString(c, msg); err != nil {
		t.Fatalf("writing %q: %v", msg, err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil || string(got) != msg {
		t.Fatalf("echo of %q: %q %v", msg, got, err)
	}
}

func TestReloadLogLevel(t *testing.T) {
	e := startDaemon(t, newWorld(t), t.TempDir(), nil)
	logger := e.d.log
	if logger.Enabled(context.Background(), slog.LevelDebug) {
		t.Fatal("debug logging before the reload")
	}
	next := e.cfg
	next.Log.Level = "debug"
	if err := e.d.Reload(next); err != nil {
		t.Fatal(err)
	}
	if !logger.Enabled(context.Background(), slog.LevelDebug) {
		t.Error("the reload did not turn on debug logging")
	}
}

func TestDaemonSuspendedServiceLeaves(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), nil)
	e.waitReady()
	w.sim.SetServiceStatus(demoFPR, "Suspended")
	e.pollOnce(agent.LoopAccount)
	waitFor(t, "service 101 to leave the pool", 5*time.Second, func() bool {
		for _, u := range e.poolState().Upstreams {
			if u.Service == demoFPR && u.State != pool.Draining {
				return false
			}
		}
		return true
	})
	// The ppr service still serves the http listener.
	for i := 0; i < 4; i++ {
		if via := e.mustGet("http", ""); !strings.HasPrefix(via, "ppr-") {
			t.Fatalf("request went via %s after service %d was suspended", via, demoFPR)
		}
	}
	// Its metrics say it is suspended (each service of the account is
	// described, served or not) rather than leave.
	info := regexp.MustCompile(fmt.Sprintf(`(?m)^proxyd_service_info\{kind="",product="[^"]+",service="%d",status="Suspended"\} 1$`, demoFPR))
	due := fmt.Sprintf("\nproxyd_service_due_timestamp_seconds{service=\"%d\"} ", demoFPR)
	waitFor(t, "the suspended service in /metrics", 5*time.Second, func() bool {
		_, body := e.admin("/metrics")
		return info.MatchString(body) && strings.Contains(body, due)
	})
}

// Lists no listener draws are not fetched: with fpr listeners only, the
// rotating service's sticky sessions are never asked for and none of its
// upstreams is in the pool; a reload whose listeners draw it fetches them.
func TestDaemonFetchesOnlyDrawnLists(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), func(c *config) {
		for i := range c.Listener {
			c.Listener[i].Kind = "fpr"
		}
	})
	e.waitReady()
	e.pollOnce(agent.LoopLists)
	pprUpstreams := func() int { return e.upstreamsOf(demoPPR) + len(e.poolState().Unserved) }
	if n := w.sim.Requests("/api/sticky/list/{id}"); n != 0 {
		t.Errorf("%d sticky-session requests with no listener drawing ppr", n)
	}
	if n := pprUpstreams(); n != 0 {
		t.Errorf("%d upstreams or sessions of service %d in the pool, which no listener draws", n, demoPPR)
	}
	next := e.cfg
	next.Listener = slices.Clone(e.cfg.Listener)
	next.Listener[0].Kind = ""
	if err := e.d.Reload(next); err != nil {
		t.Fatal(err)
	}
	e.cfg = next
	waitFor(t, "the ppr service's upstreams after the reload", 5*time.Second, func() bool {
		return w.sim.Requests("/api/sticky/list/{id}") > 0 && pprUpstreams() > 0
	})
}

// A restart while the API is down serves the saved pool as the file says,
// within what the config now serves: a service left out of [api] services
// is not restored, the saved usage shows in the metrics as it drives the
// quota, and the state's age is that of the last successful refresh, not
// of the last change of the file.
func TestDaemonRestartFromStateFollowsConfig(t *testing.T) {
	w, state, e := startWithUsage(t, nil)
	e.d.Close()
	// The pool was saved an hour ago; since then refreshes found the same.
	old, err := readState(state)
	if err != nil || old == nil {
		t.Fatalf("no state file: %v", err)
	}
	old.Saved, old.Fetched = old.Saved.Add(-time.Hour), old.Fetched.Add(-time.Hour)
	if err := writeState(state, old); err != nil {
		t.Fatal(err)
	}
	refreshed := time.Now()
	e1 := startDaemon(t, w, state, nil)
	e1.waitReady()
	e1.pollOnce(agent.LoopLists)
	e1.d.Close()
	saved, err := readState(state)
	if err != nil || saved == nil || saved.Fetched.Before(refreshed) {
		t.Fatalf("the state file says its lists were fetched at %v, before the refresh at %v: %v", saved.Fetched, refreshed, err)
	}
	if saved.Usage[demoPPR].Limit != 1024 || !slices.ContainsFunc(saved.Upstreams, func(u savedUpstream) bool { return u.Service == demoPPR }) {
		t.Fatalf("saved state without service %d's upstreams or usage: %+v", demoPPR, saved)
	}
	if saved.BaseURL != w.simURL {
		t.Fatalf("the state file says its lists came from %q, want %q", saved.BaseURL, w.simURL)
	}

	w.sim.FailNext(1<<30, 500, "down")
	e2 := startDaemon(t, w, state, nil)
	_, body := e2.admin("/metrics")
	if !strings.Contains(body, `proxyd_usage_limit{service="102"} 1024`) {
		t.Errorf("the restored usage is not in the metrics:\n%s", grepLines(body, "proxyd_usage"))
	}
	m := regexp.MustCompile(`(?m)^proxyd_state_age_seconds ([0-9.e+-]+)$`).FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("no proxyd_state_age_seconds:\n%s", grepLines(body, "state_age"))
	}
	if age, _ := strconv.ParseFloat(m[1], 64); age > time.Since(refreshed).Seconds()+1 {
		t.Errorf("state age %.1fs after a restart, but the lists were refreshed %.1fs ago", age, time.Since(refreshed).Seconds())
	}
	e2.d.Close()

	file, err := os.ReadFile(filepath.Join(state, stateFileName))
	if err != nil {
		t.Fatal(err)
	}
	for _, narrow := range []struct {
		why    string
		mutate func(*config)
	}{
		{"no longer in api.services", func(c *config) { c.API.Services = []int{demoFPR} }},
		{"drawn by no listener", func(c *config) {
			for i := range c.Listener {
				c.Listener[i].Kind = "fpr"
			}
		}},
	} {
		// Each from the same file (a daemon saves what it serves).
		if err := os.WriteFile(filepath.Join(state, stateFileName), file, 0o600); err != nil {
			t.Fatal(err)
		}
		e3 := startDaemon(t, w, state, narrow.mutate)
		e3.waitReady()
		for _, u := range e3.poolState().Upstreams {
			if u.Service == demoPPR {
				t.Errorf("%s restored, though service %d is %s", u.ID, demoPPR, narrow.why)
			}
		}
		e3.d.Close()
	}

	// The same provider spelled otherwise (scheme in capitals, a trailing
	// slash) is not another one.
	if err := os.WriteFile(filepath.Join(state, stateFileName), file, 0o600); err != nil {
		t.Fatal(err)
	}
	respelled := "HTTP" + strings.TrimPrefix(w.simURL, "http") + "/"
	e5 := startDaemon(t, w, state, func(c *config) { c.API.BaseURL = respelled })
	if len(e5.poolState().Upstreams) == 0 || strings.Contains(e5.logs.String(), "another provider") {
		t.Errorf("the saved pool was not restored under base_url %q:\n%s", respelled, e5.logs.String())
	}
	e5.d.Close()

	// Another provider's pool is not served while the new one is silent.
	e4 := startDaemon(t, w, state, func(c *config) { c.API.BaseURL = "http://" + freeport.Addr(t) })
	if n := len(e4.poolState().Upstreams); n != 0 {
		t.Errorf("%d upstreams of the old provider restored after the base URL changed", n)
	}
	if !strings.Contains(e4.logs.String(), "ignoring saved pool state of another provider") {
		t.Error("the ignored state is not logged")
	}
}

// A reload that leaves a service out of [api] services takes its
// upstreams and usage gauges out at once while the API is down: after the
// API had answered, and after a restart during the outage, when the pool
// came from the state file and the poller never knew the service.
func TestDaemonReloadNarrowsServicesAPIDown(t *testing.T) {
	for _, restart := range []bool{false, true} {
		t.Run(fmt.Sprintf("restart=%v", restart), func(t *testing.T) {
			w, state, e := startWithUsage(t, nil)
			w.sim.FailNext(1<<30, 500, "down")
			if restart {
				e.d.Close()
				e = startDaemon(t, w, state, nil)
				e.waitReady()
			}
			if e.upstreamsOf(demoPPR) == 0 {
				t.Fatalf("no upstream of service %d before the reload", demoPPR)
			}
			next := e.nextConfig()
			next.API.Services = []int{demoFPR}
			if err := e.d.Reload(next); err != nil {
				t.Fatal(err)
			}
			e.cfg = next
			if n := e.upstreamsOf(demoPPR); n != 0 {
				t.Errorf("%d upstreams of service %d in the pool after a reload left it out of api.services", n, demoPPR)
			}
			for range 4 {
				if via := e.mustGet("http", ""); !strings.HasPrefix(via, "fpr-") {
					t.Errorf("request went via %s after service %d left api.services", via, demoPPR)
				}
			}
			if _, body := e.admin("/metrics"); strings.Contains(body, `proxyd_usage_limit{service="102"}`) {
				t.Errorf("the dropped service's usage gauges remain:\n%s", grepLines(body, "proxyd_usage"))
			}
			// The reload comes before what it caused in the event log
			// (which lists the newest first).
			evs := e.d.events.Events(pool.EventFilter{})
			reload := slices.IndexFunc(evs, func(ev pool.Event) bool { return ev.Kind == pool.EventReload })
			removed := slices.IndexFunc(evs, func(ev pool.Event) bool { return ev.Kind == pool.EventRemoved && ev.Service == demoPPR })
			if reload < 0 || removed < 0 || removed > reload {
				t.Errorf("events newest first: reload at %d, the first removal it caused at %d; want the reload older", reload, removed)
			}
		})
	}
}

// A restored ppr service that the account now has suspended leaves the
// pool at the first account round, and its restored usage gauges leave
// with it (they were never in the metrics' set of services).
func TestDaemonRestoredServiceSuspendedLeavesMetrics(t *testing.T) {
	every := func(c *config) { c.API.Services = nil } // every Active service
	w, state, e := startWithUsage(t, every)
	e.d.Close()
	if st, _ := readState(state); st == nil || st.Usage[demoPPR].Limit != 1024 {
		t.Fatalf("no usage saved: %+v", st)
	}

	w.sim.SetServiceStatus(demoPPR, "Suspended")
	e2 := startDaemon(t, w, state, every)
	e2.waitReady()
	e2.pollOnce(agent.LoopAccount)
	for _, u := range e2.poolState().Upstreams {
		if u.Service == demoPPR && u.State != pool.Draining {
			t.Errorf("suspended service still in the pool: %s", u.ID)
		}
	}
	if _, body := e2.admin("/metrics"); strings.Contains(body, `proxyd_usage_limit{service="102"}`) {
		t.Errorf("the usage gauges of a service no longer served remain:\n%s", grepLines(body, "proxyd_usage"))
	}
}

// TestDaemonReloadChangedListenerUnderLoad reloads a listener whose settings
// change on the same address while clients keep connecting: the socket is
// handed over, so no connection is refused or reset. A failing reload that
// had already taken the socket gives it back.
func TestDaemonReloadChangedListenerUnderLoad(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), nil)
	e.waitReady()
	addr := e.d.listenerAddr("http")
	ld := startLoad(t, 8, 0, func() error { return plainGet(addr, w.origin) })
	fails, oks, lastErr, stopLoad := &ld.fails, &ld.oks, &ld.lastErr, ld.stop
	cfg := e.cfg
	for i := 0; i < 20; i++ {
		next := cfg
		next.Listener = append([]listenerConfig{}, cfg.Listener...)
		next.Listener[0].Address = addr
		next.Listener[0].IdleTimeout = time.Duration(60+i) * time.Second
		if i%5 == 4 {
			// A reload that fails after taking the socket: socks onto a taken address.
			next.Listener[1].Address = w.simURL[len("http://"):]
			if err := e.d.Reload(next); err == nil {
				t.Fatal("a reload onto a taken address must fail")
			}
		} else if err := e.d.Reload(next); err != nil {
			t.Fatal(err)
		} else {
			cfg = next
		}
		// Requests go on succeeding before the next reload.
		served := oks.Load()
		waitFor(t, "a request through the reloaded listener", 5*time.Second, func() bool { return oks.Load() > served })
	}
	stopLoad()
	if fails.Load() > 0 || oks.Load() == 0 {
		t.Errorf("%d requests failed across reloads (%d ok); last: %v", fails.Load(), oks.Load(), lastErr.Load())
	}
	if got := e.d.listenerAddr("http"); got != addr {
		t.Errorf("http listener on %s, want %s", got, addr)
	}
}

// A listener renamed by reload on the same address, back and forth under
// load: the new name is in the pool before its incarnation accepts, and
// the old one stays while its connections finish, so no request fails
// (a pick under an unknown name was a 502).
func TestDaemonReloadRenamedListenerUnderLoad(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), nil)
	e.waitReady()
	addr := e.d.listenerAddr("http")
	ld := startLoad(t, 16, 0, func() error { return plainGet(addr, w.origin) })
	cfg := e.cfg
	for i := range 60 {
		next := cfg
		next.Listener = append([]listenerConfig{}, cfg.Listener...)
		next.Listener[0].Address = addr
		next.Listener[0].Name = []string{"web", "http"}[i%2]
		if err := e.d.Reload(next); err != nil {
			t.Fatal(err)
		}
		cfg = next
		served := ld.oks.Load()
		waitFor(t, "a request through the renamed listener", 5*time.Second, func() bool { return ld.oks.Load() > served })
	}
	ld.stop()
	if ld.fails.Load() > 0 || ld.oks.Load() == 0 {
		t.Errorf("%d requests failed across renames (%d ok); last: %v", ld.fails.Load(), ld.oks.Load(), ld.lastErr.Load())
	}
	// Once the old incarnations are gone, so are their retiring slices.
	waitFor(t, "the retired incarnations to end", 10*time.Second, func() bool {
		e.d.mu.Lock()
		defer e.d.mu.Unlock()
		return len(e.d.winding) == 0
	})
	var names []string
	for _, l := range e.d.pool.Listeners() {
		names = append(names, l.Name)
	}
	if slices.Sort(names); !slices.Equal(names, []string{"http", "socks"}) {
		t.Errorf("pool listeners %v, want the configured http and socks", names)
	}
}

// plainGet makes one plain-HTTP request through an HTTP proxy on a new connection.
// load runs requests in goroutines until stop (also called when the test
// ends), counting what succeeded and what failed.
type load struct {
	fails, oks atomic.Int64
	lastErr    atomic.Value
	stop       func()
}

// startLoad runs do in n goroutines, each pausing between its calls.
func startLoad(t *testing.T, n int, pause time.Duration, do func() error) *load {
	ld := &load{}
	done := make(chan struct{})
	var wg sync.WaitGroup
	ld.stop = sync.OnceFunc(func() { close(done); wg.Wait() })
	t.Cleanup(ld.stop)
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-done:
					return
				case <-time.After(pause):
				}
				if err := do(); err != nil {
					ld.fails.Add(1)
					ld.lastErr.Store(err.Error())
				} else {
					ld.oks.Add(1)
				}
			}
		}()
	}
	return ld
}

func plainGet(proxyAddr, origin string) error {
	c, err := net.DialTimeout("tcp", proxyAddr, time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	fmt.Fprintf(c, "GET http://%s/hello HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", origin, origin)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return err
	}
	if resp.StatusCode != 200 {
		return fmt.Errorf("status %d", resp.StatusCode)
	}
	return nil
}

// The account's two parts come from two endpoints: a part not read yet is
// left out of /pool and said so under the table, never shown as 0 (no
// unpaid invoice while the invoices endpoint fails would hide one).
func TestAccountSummaryParts(t *testing.T) {
	for _, tt := range []struct {
		name string
		snap agent.Snapshot
		want string // the line under the table; "" when /pool has no account
	}{
		{"nothing read", agent.Snapshot{Credit: 5, UnpaidInvoices: 1}, ""},
		{"credit only", agent.Snapshot{CreditKnown: true, Credit: 12.5}, "account: credit 12.50 USD; invoices not read yet\n"},
		{"invoices only", agent.Snapshot{InvoicesKnown: true, UnpaidInvoices: 2, UnpaidUSD: 30},
			"account: credit not read yet; 2 unpaid invoices (30.00 USD): pay before the provider suspends services\n"},
		{"both, paid", agent.Snapshot{CreditKnown: true, Credit: 3, InvoicesKnown: true}, "account: credit 3.00 USD; no unpaid invoice\n"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			b, err := json.Marshal(poolAnswer{Account: summarizeAccount(tt.snap)})
			if err != nil {
				t.Fatal(err)
			}
			var ans poolAnswer // as proxyd pool reads it
			if err := json.Unmarshal(b, &ans); err != nil {
				t.Fatal(err)
			}
			if ans.Account == nil {
				if tt.want != "" {
					t.Fatalf("no account in %s", b)
				}
				return
			}
			if !tt.snap.InvoicesKnown && strings.Contains(string(b), "unpaid") {
				t.Errorf("invoices not read, but /pool says %s", b)
			}
			var out bytes.Buffer
			if err := renderAccount(&out, *ans.Account); err != nil {
				t.Fatal(err)
			}
			if out.String() != tt.want {
				t.Errorf("got %q, want %q", out.String(), tt.want)
			}
		})
	}
}
