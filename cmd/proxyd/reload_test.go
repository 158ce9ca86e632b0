package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/proxyd/proxyd/agent/providersim"
	"github.com/proxyd/proxyd/forward"
	"github.com/proxyd/proxyd/internal/freeport"
	"github.com/proxyd/proxyd/pool"
)

// TestPlanReload: the plan of a reload names exactly the sections that
// changed.
func TestPlanReload(t *testing.T) {
	base := defaultConfig()
	base.Listener = defaultListeners()
	cases := []struct {
		name   string
		change func(*config)
		want   reloadPlan
	}{
		{"nothing", func(*config) {}, reloadPlan{}},
		{"base url", func(c *config) { c.API.BaseURL = "http://other.test" },
			reloadPlan{API: true, Provider: true}},
		{"base url respelled", func(c *config) { c.API.BaseURL = strings.ToUpper(c.API.BaseURL) + "/" }, reloadPlan{}},
		{"token", func(c *config) { c.API.Token = "new" }, reloadPlan{API: true, Provider: true}},
		{"api timeout", func(c *config) { c.API.Timeout = time.Minute }, reloadPlan{API: true}},
		{"services", func(c *config) { c.API.Services = []int{7} }, reloadPlan{Poll: true, Services: true}},
		{"poll interval", func(c *config) { c.Poll.IPList = time.Minute }, reloadPlan{Poll: true}},
		{"manage", func(c *config) { c.Manage.UpdateListShare = 0.5 }, reloadPlan{Poll: true}},
		{"pool strategy", func(c *config) { c.Pool.Strategy = pool.Latency }, reloadPlan{Pool: true}},
		{"listener timeout", func(c *config) {
			c.Listener = append([]listenerConfig(nil), c.Listener...)
			c.Listener[0].IdleTimeout = time.Minute
		}, reloadPlan{Listeners: true}},
		{"listener upstream protocol", func(c *config) {
			c.Listener = append([]listenerConfig(nil), c.Listener...)
			c.Listener[1].Upstream = "http" // the poller fetches other lists
		}, reloadPlan{Listeners: true, Poll: true}},
		{"listener kind", func(c *config) {
			c.Listener = append([]listenerConfig(nil), c.Listener...)
			c.Listener[0].Kind = "fpr" // the poller fetches fewer lists
		}, reloadPlan{Listeners: true, Poll: true}},
		{"listener name", func(c *config) {
			c.Listener = append([]listenerConfig(nil), c.Listener...)
			c.Listener[0].Name = "web" // draws what it drew
		}, reloadPlan{Listeners: true}},
		{"admin address", func(c *config) { c.Admin.Address = "127.0.0.1:9999" }, reloadPlan{Admin: true, AdminMove: true}},
		{"admin token", func(c *config) { c.Admin.Token = "t" }, reloadPlan{Admin: true}},
		{"admin token file", func(c *config) { c.Admin.TokenFile = "/run/t" }, reloadPlan{Admin: true}},
		{"state dir", func(c *config) { c.State.Dir = "/srv/x" }, reloadPlan{State: true}},
		{"log format", func(c *config) { c.Log.Format = "json" }, reloadPlan{Log: true}},
		{"shutdown", func(c *config) { c.Shutdown.DrainTimeout = time.Second }, reloadPlan{Shutdown: true}},
	}
	for _, c := range cases {
		next := base
		c.change(&next)
		if got := planReload(base, next); got != c.want {
			t.Errorf("%s: plan %+v, want %+v", c.name, got, c.want)
		}
	}
	// A token file is read again at every reload, even when its name stays.
	withFile := base
	withFile.Admin.TokenFile = "/run/t"
	if p := planReload(withFile, withFile); !p.Admin || p.AdminMove {
		t.Errorf("admin token_file kept: plan %+v, want the token read again", p)
	}
}

// TestReloadRefusedChangesNothing: a reload whose admin address cannot be
// bound is refused whole: the pool keeps its strategy, the admin server its
// address, the log its level; the refusal is an event and a metric.
func TestReloadRefusedChangesNothing(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), nil)
	e.waitReady()
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	oldAdmin := e.d.adminAddr()
	next := e.cfg
	next.Pool.Strategy = pool.Latency
	next.Log.Level = "debug"
	next.Admin.Address = busy.Addr().String()
	if err := e.d.Reload(next); err == nil || !strings.Contains(err.Error(), "admin.address") {
		t.Fatalf("reload onto a taken admin address: %v", err)
	}
	if got := e.d.pool.Config().Strategy; got != pool.RoundRobin {
		t.Errorf("pool strategy after a refused reload: %q", got)
	}
	if e.d.adminAddr() != oldAdmin {
		t.Errorf("admin moved to %s after a refused reload", e.d.adminAddr())
	}
	if e.d.logs.level.Level() != logLevel("info") {
		t.Error("the log level changed after a refused reload")
	}
	if code, body := e.admin("/metrics"); code != 200 || !strings.Contains(body, "proxyd_config_last_reload_successful 0") {
		t.Errorf("reload metric: %d %s", code, grepLines(body, "reload"))
	}
	if evs := e.d.events.Events(pool.EventFilter{Kind: pool.EventReloadFailed}); len(evs) != 1 || !strings.Contains(evs[0].Reason, "admin.address") {
		t.Errorf("reload_failed events: %+v", evs)
	}
	// A state dir the process cannot create is refused the same way (a
	// path below a regular file: refused to root too).
	file := filepath.Join(t.TempDir(), "file")
	os.WriteFile(file, nil, 0o600)
	next = e.cfg
	next.State.Dir = filepath.Join(file, "state")
	next.Pool.Strategy = pool.Latency
	if err := e.d.Reload(next); err == nil || !strings.Contains(err.Error(), "state.dir") {
		t.Errorf("reload onto an unwritable state dir: %v", err)
	}
	if got := e.d.pool.Config().Strategy; got != pool.RoundRobin || e.d.stateDir() != e.cfg.State.Dir {
		t.Errorf("after a refused state dir: strategy %q, state dir %s", got, e.d.stateDir())
	}
	// And a credential the process cannot see change.
	envCfg := e.cfg
	envCfg.API.Token = "other"
	envCfg.Pool.Strategy = pool.Latency
	if err := e.d.Reload(envCfg); err == nil || !strings.Contains(err.Error(), "PROXYD_API_TOKEN") {
		t.Errorf("reload changing the token while PROXYD_API_TOKEN is set: %v", err)
	}
	if got := e.d.pool.Config().Strategy; got != pool.RoundRobin {
		t.Errorf("after a refused credential change: strategy %q", got)
	}
}

// TestReloadRefusedListenerChangesNothing: a reload that changes a listener
// and adds one on a port that is taken is refused before anything changes:
// the changed listener keeps running as it was (the same incarnation, with
// its config; a tunnel through it stays open), the pool keeps its strategy.
func TestReloadRefusedListenerChangesNothing(t *testing.T) {
	w := newWorld(t)
	fixed := freeport.Addr(t)
	e := startDaemon(t, w, t.TempDir(), func(c *config) {
		c.Listener[0].Address = fixed
	})
	e.waitReady()
	tunnel := connectTunnel(t, fixed, echoServer(t))
	defer tunnel.Close()
	roundTrip(t, tunnel, "before")
	e.d.mu.Lock()
	before := e.d.listeners["http"]
	e.d.mu.Unlock()
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	next := e.cfg
	next.Pool.Strategy = pool.Latency
	next.Listener = append([]listenerConfig(nil), next.Listener...)
	next.Listener[0].IdleTimeout = time.Minute // changed: would take the socket over
	extra := defaultListener()
	extra.Name, extra.Protocol, extra.Upstream, extra.Address = "extra", "http", "http", busy.Addr().String()
	next.Listener = append(next.Listener, extra)
	key := fmt.Sprintf("listener[%d].address: listen tcp %s", len(next.Listener)-1, extra.Address)
	if err := e.d.Reload(next); err == nil || !strings.HasPrefix(err.Error(), key) || strings.Contains(err.Error(), "of this proxyd") {
		t.Fatalf("reload onto a port another process holds: %v, want it to start with %q and not blame proxyd", err, key)
	}
	if got := e.d.pool.Config().Strategy; got != pool.RoundRobin {
		t.Errorf("pool strategy after a refused reload: %q", got)
	}
	e.d.mu.Lock()
	after := e.d.listeners["http"]
	e.d.mu.Unlock()
	if after != before || !reflect.DeepEqual(after.cfg, e.cfg.Listener[0]) {
		t.Errorf("the listener after a refused reload: %+v, want the incarnation that ran before", after.cfg)
	}
	roundTrip(t, tunnel, "after the refused reload")
	if e.d.listenerAddr("extra") != "" {
		t.Error("the refused listener is running")
	}
}

// TestReloadOntoItsOwnPort: a listener or admin address re-spelled or
// widened onto a port proxyd serves cannot be bound while proxyd holds it;
// the refusal says that it is proxyd's own socket, and what to do.
func TestReloadOntoItsOwnPort(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), func(c *config) { c.Admin.Address = "127.0.0.1:0" })
	e.waitReady()
	_, lport, _ := net.SplitHostPort(e.d.listenerAddr("http"))
	_, aport, _ := net.SplitHostPort(e.d.adminAddr())

	next := e.cfg
	next.Listener = append([]listenerConfig(nil), next.Listener...)
	next.Listener[0].Address = "localhost:" + lport
	err := e.d.Reload(next)
	if want := `(listener "http" of this proxyd holds 127.0.0.1:` + lport + `: a reload binds before it closes anything, so restart proxyd to move it)`; err == nil ||
		!strings.HasPrefix(err.Error(), "listener[0].address: listen tcp") || !strings.Contains(err.Error(), want) {
		t.Errorf("a listener re-spelled onto its own port: %v, want %q", err, want)
	}

	next = e.cfg
	next.Admin.Address = "localhost:" + aport
	err = e.d.Reload(next)
	if want := "(the admin server of this proxyd holds 127.0.0.1:" + aport; err == nil ||
		!strings.HasPrefix(err.Error(), "admin.address: listen tcp") || !strings.Contains(err.Error(), want) {
		t.Errorf("the admin address re-spelled onto its own port: %v, want %q", err, want)
	}
	if got := e.d.listenerAddr("http"); !strings.HasSuffix(got, ":"+lport) {
		t.Errorf("the listener after the refused reloads: %q", got)
	}
}

// heldHere names proxyd's own socket only where its port and address
// overlap the one refused (either side unspecified, in any form).
func TestHeldHere(t *testing.T) {
	inUse := &net.OpError{Op: "listen", Net: "tcp", Err: os.NewSyscallError("bind", syscall.EADDRINUSE)}
	held := []heldAddr{
		{`listener "http"`, &net.TCPAddr{IP: net.ParseIP("0.0.0.0"), Port: 8080}}, // ParseIP: the 16-byte form
		{"the admin server", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1).To4(), Port: 9900}},
		{`listener "lan"`, &net.TCPAddr{IP: net.ParseIP("192.0.2.1"), Port: 7000}},
	}
	for _, tc := range []struct {
		address, who string // who: "" when the error stays as it was
	}{
		{"127.0.0.1:8080", `listener "http"`},
		{"[::1]:8080", `listener "http"`},
		{":8080", `listener "http"`},
		{"localhost:9900", "the admin server"},
		{"0.0.0.0:9900", "the admin server"},
		{"[::ffff:127.0.0.1]:9900", "the admin server"},
		{"127.0.0.2:9900", ""},
		{"127.0.0.1:8081", ""},
		{"192.0.2.1:7000", `listener "lan"`},
		{"localhost:7000", ""}, // a name is resolved: localhost is not 192.0.2.1
	} {
		err := heldHere(inUse, tc.address, held)
		if got := strings.Contains(err.Error(), "of this proxyd holds"); got != (tc.who != "") || tc.who != "" && !strings.Contains(err.Error(), tc.who) {
			t.Errorf("%s: %v, want it to name %q", tc.address, err, tc.who)
		}
		if !errors.Is(err, syscall.EADDRINUSE) {
			t.Errorf("%s: %v lost the error it explains", tc.address, err)
		}
	}
	if err := heldHere(os.ErrPermission, "127.0.0.1:8080", held); err != os.ErrPermission {
		t.Errorf("another error than EADDRINUSE: %v", err)
	}
}

// TestReloadOfPrintedConfigChangesNothing: reloading the config that
// check -print printed is no change at all (an empty array and an absent
// key are the same).
func TestReloadOfPrintedConfigChangesNothing(t *testing.T) {
	for _, name := range []string{"print_full.toml", "print_minimal.toml", "zeros_kept.toml"} {
		cfg, err := loadConfig(filepath.Join("testdata", "config", name))
		if err != nil {
			t.Fatal(err)
		}
		again, err := parseConfig(printConfig(cfg))
		if err != nil {
			t.Fatal(err)
		}
		again = restoreSecrets(again, cfg)
		if p := planReload(cfg, again); p != (reloadPlan{}) && p != (reloadPlan{Admin: cfg.Admin.TokenFile != ""}) {
			t.Errorf("%s: reloading the printed config plans %v", name, p.changed())
		}
	}
}

// restoreSecrets puts back the secrets -print leaves out.
func restoreSecrets(c, from config) config {
	c.API.Token, c.API.Password, c.Admin.Token = from.API.Token, from.API.Password, from.Admin.Token
	c.Listener = slices.Clone(c.Listener)
	for i := range c.Listener {
		c.Listener[i].Users = slices.Clone(from.Listener[i].Users)
	}
	return c
}

// tokenGate fronts a simulated provider with a different API token: it
// accepts only "Authorization: Basic token" and passes requests on with the
// simulator's own token.
func tokenGate(t *testing.T, simURL, token string) string {
	t.Helper()
	target, _ := url.Parse(simURL)
	rp := httputil.NewSingleHostReverseProxy(target)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Basic "+token {
			w.WriteHeader(401)
			io.WriteString(w, `{"error":"Unauthenticated."}`)
			return
		}
		r.Header.Set("Authorization", "Basic "+providersim.DefaultToken)
		rp.ServeHTTP(w, r)
	})}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return "http://" + ln.Addr().String()
}

// reloadConfig is the config file of TestReloadEverySection.
type reloadConfig struct {
	baseURL, tokenFile, stateDir, strategy, admin, logFormat, listen, idle string
}

func (c reloadConfig) write(t *testing.T, path string) {
	t.Helper()
	text := fmt.Sprintf(`[api]
base_url = %q
token_file = %q
services = [101, 102]

[poll]
ip_list = "1h"
account = "1h"
network_status = "1s"
usage = "1s"
max_backoff = "2s"

[state]
dir = %q

[pool]
strategy = %q
latency_tolerance = 0.0

[admin]
address = %q

[log]
format = %q

[shutdown]
drain_timeout = "20s"

[[listener]]
name = "http"
protocol = "http"
address = %q
kind = "fpr"
allow_destinations = ["127.0.0.0/8"]
idle_timeout = %q
`, c.baseURL, c.tokenFile, c.stateDir, c.strategy, c.admin, c.logFormat, c.listen, c.idle)
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}

var viaRE = regexp.MustCompile(` via (\S+)`)

// TestReloadEverySection runs the real binary and reloads each section with
// SIGHUP while plain requests flow and a tunnel stays open: a new strategy
// changes the picks and keeps the health state of upstreams that stay; a
// moved admin address serves while the old one stops; a new log format and
// state dir take effect; a new [api] base_url and token switch the pool to
// the new provider's upstreams within one poll; a changed listener keeps
// its socket. The tunnel opened before the first reload loses no byte
// through all of them, and no request fails.
func TestReloadEverySection(t *testing.T) {
	if runtime.GOOS == "windows" {
		t.Skip("no SIGHUP on Windows")
	}
	bin := proxydBinary(t)
	a, b := newWorld(t), newWorld(t)
	bURL := tokenGate(t, b.simURL, "token-for-b")
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	os.WriteFile(tokenFile, []byte(providersim.DefaultToken+"\n"), 0o600)
	cfgPath := filepath.Join(dir, "config.toml")
	cfg := reloadConfig{baseURL: a.simURL, tokenFile: tokenFile, stateDir: filepath.Join(dir, "state1"),
		strategy: "round-robin", admin: freeport.Addr(t), logFormat: "text", listen: freeport.Addr(t), idle: "5m"}
	cfg.write(t, cfgPath)

	cmd, stderr, _ := runBinary(t, bin, cfgPath)
	adminGet := func(addr, path string) (int, string) {
		c := &http.Client{Timeout: 5 * time.Second}
		resp, err := c.Get("http://" + addr + path)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	poolOf := func() pool.Explanation {
		t.Helper()
		code, body := adminGet(cfg.admin, "/pool")
		var ex pool.Explanation
		if code != 200 || json.Unmarshal([]byte(body), &ex) != nil {
			t.Fatalf("/pool: %d %s", code, body)
		}
		return ex
	}
	waitFor(t, "readyz", 15*time.Second, func() bool { code, _ := adminGet(cfg.admin, "/readyz"); return code == 200 })

	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		Proxy: http.ProxyURL(mustURL("http://" + cfg.listen)), DisableKeepAlives: true}}
	carrier := func() (string, error) {
		resp, err := client.Get("http://" + a.origin + "/hello")
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		m := viaRE.FindStringSubmatch(string(body))
		if resp.StatusCode != 200 || m == nil {
			return "", fmt.Errorf("status %d: %s", resp.StatusCode, body)
		}
		return m[1], nil
	}
	carriers := func(n int) map[string]int {
		t.Helper()
		seen := map[string]int{}
		for range n {
			c, err := carrier()
			if err != nil {
				t.Fatalf("request: %v", err)
			}
			seen[c]++
		}
		return seen
	}

	// Traffic that flows through every reload.
	ld := startLoad(t, 1, 20*time.Millisecond, func() error { _, err := carrier(); return err })
	defer ld.stop()
	fails, oks, lastErr := &ld.fails, &ld.oks, &ld.lastErr
	var tunnel net.Conn // opened before the first reload, once the dead upstream is out

	reload := func(what string) {
		t.Helper()
		cfg.write(t, cfgPath)
		before := strings.Count(stderr.String(), "config reloaded")
		cmd.Process.Signal(syscall.SIGHUP)
		waitFor(t, "the reload of "+what, 10*time.Second, func() bool {
			return strings.Count(stderr.String(), "config reloaded") > before
		})
		roundTrip(t, tunnel, "after "+what)
	}

	// Round-robin spreads sequential requests over the three fpr upstreams.
	if seen := carriers(6); len(seen) < 2 {
		t.Fatalf("round-robin used %v", seen)
	}
	// One upstream fails until it is ejected: health state to keep.
	a.fprHTTP[0].Down()
	downAddr := a.fprHTTP[0].Addr()
	ejected := func() (pool.UpstreamExplanation, bool) {
		for _, u := range poolOf().Upstreams {
			if u.Address == downAddr && u.Protocol == pool.HTTP {
				return u, u.State == pool.Ejected
			}
		}
		return pool.UpstreamExplanation{}, false
	}
	waitFor(t, "the dead upstream ejected", 15*time.Second, func() bool {
		carrier()
		_, ok := ejected()
		return ok
	})
	before, _ := ejected()
	tunnel = connectTunnel(t, cfg.listen, echoServer(t))
	defer tunnel.Close()
	roundTrip(t, tunnel, "before")

	// [pool]: latency with tolerance 0 sends sequential requests to the one
	// best upstream; the ejected upstream stays ejected with its count.
	cfg.strategy = "latency"
	reload("[pool] strategy")
	if seen := carriers(6); len(seen) != 1 {
		t.Errorf("latency strategy after reload used %v, want one upstream", seen)
	}
	if u, ok := ejected(); !ok || u.Ejections != before.Ejections || u.Failures < before.Failures {
		t.Errorf("health state after reload: %+v, before %+v", u, before)
	}

	// [admin]: the new address serves, then the old one stops.
	oldAdmin := cfg.admin
	cfg.admin = freeport.Addr(t)
	reload("[admin] address")
	if code, _ := adminGet(cfg.admin, "/healthz"); code != 200 {
		t.Errorf("new admin address: %d", code)
	}
	waitFor(t, "the old admin address to stop", 5*time.Second, func() bool {
		c, err := net.DialTimeout("tcp", oldAdmin, time.Second)
		if err != nil {
			return true
		}
		c.Close()
		return false
	})

	// [[listener]]: a changed listener takes its socket over; the tunnel of
	// its old incarnation goes on.
	cfg.idle = "4m"
	reload("[[listener]] idle_timeout")
	if _, err := carrier(); err != nil {
		t.Errorf("a request through the changed listener: %v", err)
	}

	// [log] and [state]: JSON lines from now on; the state saved in the new dir.
	cfg.logFormat = "json"
	cfg.stateDir = filepath.Join(dir, "state2")
	reload("[log] format and [state] dir")
	waitFor(t, "the state saved in the new dir", 10*time.Second, func() bool {
		_, err := os.Stat(filepath.Join(cfg.stateDir, stateFileName))
		return err == nil
	})
	if !strings.Contains(stderr.String(), `{"time":`) {
		t.Error("no JSON log line after the format reload")
	}

	// [api]: another provider, with another token read from the token file.
	os.WriteFile(tokenFile, []byte("token-for-b\n"), 0o600)
	cfg.baseURL = bURL
	reload("[api] base_url and token")
	bAddrs := map[string]bool{}
	for _, p := range b.fprHTTP {
		bAddrs[p.Addr()] = true
	}
	waitFor(t, "the pool on the new provider's upstreams", 10*time.Second, func() bool {
		n := 0
		for _, u := range poolOf().Upstreams {
			if u.Protocol != pool.HTTP || u.Kind != pool.FPR || u.State == pool.Draining {
				continue
			}
			if !bAddrs[u.Address] {
				return false
			}
			n++
		}
		return n == len(bAddrs)
	})
	roundTrip(t, tunnel, "at the end")
	if n := fails.Load(); n > 0 {
		t.Errorf("%d requests failed across the reloads (%d ok); last: %v", n, oks.Load(), lastErr.Load())
	}
	if oks.Load() == 0 {
		t.Error("no request went through: the traffic check proves nothing")
	}
}

// connectAs opens a CONNECT tunnel as a local user and returns the
// connection and the answer's status code (the connection is closed unless
// it is 200).
func connectAs(t *testing.T, proxyAddr, dest, user, password string) (net.Conn, int) {
	t.Helper()
	c, err := net.Dial("tcp", proxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	auth := base64.StdEncoding.EncodeToString([]byte(user + ":" + password))
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\nProxy-Authorization: Basic %s\r\n\r\n", dest, dest, auth)
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	var head []byte
	b := make([]byte, 1)
	for !bytes.HasSuffix(head, []byte("\r\n\r\n")) { // byte by byte: nothing of the tunnel is consumed
		if _, err := c.Read(b); err != nil {
			t.Fatalf("CONNECT answer: %v (%q)", err, head)
		}
		head = append(head, b[0])
	}
	c.SetReadDeadline(time.Time{})
	var code int
	fmt.Sscanf(string(head), "HTTP/1.1 %d", &code)
	if code != 200 {
		c.Close()
		return nil, code
	}
	return c, code
}

// TestReloadRemovedUser: a local user removed by a reload keeps the tunnels
// it has open; new ones are refused (407); the users that stay are served.
func TestReloadRemovedUser(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), func(c *config) {
		c.Listener[0].Users = []forward.User{{Name: "alice", Password: "pa"}, {Name: "bob", Password: "pb"}}
	})
	e.waitReady()
	addr := e.d.listenerAddr("http")
	echo := echoServer(t)
	bob, code := connectAs(t, addr, echo, "bob", "pb")
	if code != 200 {
		t.Fatalf("bob before the reload: %d", code)
	}
	defer bob.Close()
	roundTrip(t, bob, "before")

	next := e.cfg
	next.Listener = append([]listenerConfig(nil), next.Listener...)
	next.Listener[0].Users = []forward.User{{Name: "alice", Password: "pa"}}
	if err := e.d.Reload(next); err != nil {
		t.Fatal(err)
	}
	roundTrip(t, bob, "after the reload") // the open tunnel finishes
	addr = e.d.listenerAddr("http")       // a ":0" listener that changed is bound anew
	if _, code := connectAs(t, addr, echo, "bob", "pb"); code != 407 {
		t.Errorf("a new tunnel of the removed user: %d, want 407", code)
	}
	alice, code := connectAs(t, addr, echo, "alice", "pa")
	if code != 200 {
		t.Fatalf("alice after the reload: %d", code)
	}
	defer alice.Close()
	roundTrip(t, alice, "alice")
}

// TestReloadPasswordFile: a local user's password_file is read at start and
// again at every reload: a changed file takes effect (the open tunnel goes
// on), an unchanged one leaves the listener alone, and one that cannot be
// read refuses the reload by its key, the running password kept.
func TestReloadPasswordFile(t *testing.T) {
	file := filepath.Join(t.TempDir(), "alice.password")
	if err := os.WriteFile(file, []byte("first\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), func(c *config) {
		c.Listener[0].Users = []forward.User{{Name: "alice", PasswordFile: file}}
	})
	e.waitReady()
	addr := e.d.listenerAddr("http")
	echo := echoServer(t)
	if _, code := connectAs(t, addr, echo, "alice", ""); code != 407 {
		t.Errorf("alice with an empty password: %d, want 407", code)
	}
	if _, code := connectAs(t, addr, echo, "alice", "second"); code != 407 {
		t.Errorf("alice with the file's next password before the reload: %d, want 407", code)
	}
	open, code := connectAs(t, addr, echo, "alice", "first")
	if code != 200 {
		t.Fatalf("alice with the file's password: %d", code)
	}
	defer open.Close()
	roundTrip(t, open, "before")

	running := func() *runningListener {
		e.d.mu.Lock()
		defer e.d.mu.Unlock()
		return e.d.listeners["http"]
	}
	before := running()
	if err := e.d.Reload(e.cfg); err != nil {
		t.Fatal(err)
	}
	if running() != before {
		t.Error("a reload with the same config and the same file restarted the listener")
	}

	if err := os.WriteFile(file, []byte("second\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := e.d.Reload(e.cfg); err != nil {
		t.Fatal(err)
	}
	roundTrip(t, open, "after the reload") // the open tunnel goes on
	addr = e.d.listenerAddr("http")
	if _, code := connectAs(t, addr, echo, "alice", "first"); code != 407 {
		t.Errorf("alice with the old password after the reload: %d, want 407", code)
	}
	c, code := connectAs(t, addr, echo, "alice", "second")
	if code != 200 {
		t.Fatalf("alice with the new password after the reload: %d", code)
	}
	c.Close()

	os.Remove(file)
	err := e.d.Reload(e.cfg)
	if err == nil || !strings.Contains(err.Error(), "listener[0].user[0].password_file: reading "+file) {
		t.Fatalf("reload without the password file: %v", err)
	}
	addr = e.d.listenerAddr("http")
	c, code = connectAs(t, addr, echo, "alice", "second")
	if code != 200 {
		t.Fatalf("alice after the refused reload: %d", code)
	}
	c.Close()
}

// TestReloadKeepsTunnels: a reload that changes a listener, whatever the
// key, leaves the tunnels open through it running past drain_timeout (they
// finish; the new incarnation takes the new connections). When proxyd then
// stops, those tunnels get its drain_timeout like every other, and no more.
func TestReloadKeepsTunnels(t *testing.T) {
	const drain = 200 * time.Millisecond
	for _, tc := range []struct {
		name   string
		change func(c *config)
	}{
		{"another user removed", func(c *config) { c.Listener[0].Users = c.Listener[0].Users[1:] }},
		{"idle_timeout", func(c *config) { c.Listener[0].IdleTimeout = 10 * time.Minute }},
		{"kind", func(c *config) { c.Listener[0].Kind = "fpr" }},
		{"max_connections", func(c *config) { c.Listener[0].MaxConnections = 77 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := startDaemon(t, newWorld(t), t.TempDir(), func(c *config) {
				c.Shutdown.DrainTimeout = drain
				c.Listener[0].Users = []forward.User{{Name: "alice", Password: "pa"}, {Name: "bob", Password: "pb"}}
			})
			e.waitReady()
			bob, code := connectAs(t, e.d.listenerAddr("http"), echoServer(t), "bob", "pb")
			if code != 200 {
				t.Fatalf("bob: %d", code)
			}
			defer bob.Close()
			roundTrip(t, bob, "before")
			e.d.mu.Lock()
			old := e.d.listeners["http"]
			e.d.mu.Unlock()
			next := e.nextConfig()
			tc.change(&next)
			if err := e.d.Reload(next); err != nil {
				t.Fatal(err)
			}
			e.d.mu.Lock()
			retired := e.d.listeners["http"] != old
			e.d.mu.Unlock()
			if !retired {
				t.Fatal("the changed listener's incarnation was not replaced")
			}
			time.Sleep(3 * drain) // a drain that began at the reload would have cut the tunnel
			roundTrip(t, bob, "past drain_timeout")
			if n := old.l.ActiveConns(); n != 1 {
				t.Errorf("the retired incarnation holds %d connections, want bob's tunnel", n)
			}

			// Stopping waits for the held tunnel up to drain_timeout, then
			// closes it: not at once, and not much later.
			start := time.Now()
			closed := make(chan struct{})
			go func() { e.d.Close(); close(closed) }()
			select {
			case <-closed:
				if took := time.Since(start); took < drain {
					t.Errorf("stopped after %s, before drain_timeout %s: the held tunnel was cut at once", took, drain)
				}
			case <-time.After(drain + 5*time.Second):
				t.Fatalf("proxyd not stopped %s after Close with drain_timeout %s", drain+5*time.Second, drain)
			}
			bob.SetReadDeadline(time.Now().Add(5 * time.Second))
			if n, err := bob.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
				t.Errorf("the retired incarnation's tunnel after proxyd stopped: read %d, %v; want it closed", n, err)
			}
		})
	}
}

// TestReloadKeepsTheCap: the connections a retired incarnation still holds
// count against its successor's max_connections, so a reload does not
// double the cap.
func TestReloadKeepsTheCap(t *testing.T) {
	e := startDaemon(t, newWorld(t), t.TempDir(), func(c *config) {
		c.Listener[0].MaxConnections = 1
		c.Listener[0].Users = []forward.User{{Name: "alice", Password: "pa"}}
	})
	e.waitReady()
	echo := echoServer(t)
	held, code := connectAs(t, e.d.listenerAddr("http"), echo, "alice", "pa")
	if code != 200 {
		t.Fatalf("first tunnel: %d", code)
	}
	defer held.Close()
	next := e.nextConfig()
	next.Listener[0].IdleTimeout = 10 * time.Minute
	if err := e.d.Reload(next); err != nil {
		t.Fatal(err)
	}
	addr := e.d.listenerAddr("http")
	if c, code := connectAs(t, addr, echo, "alice", "pa"); code != http.StatusServiceUnavailable {
		if c != nil {
			c.Close()
		}
		t.Errorf("a second tunnel past max_connections = 1, one held from before the reload: %d, want 503", code)
	}
	roundTrip(t, held, "still open")
	held.Close()
	waitFor(t, "a tunnel once the held one closed", 5*time.Second, func() bool {
		c, code := connectAs(t, addr, echo, "alice", "pa")
		if c != nil {
			c.Close()
		}
		return code == 200
	})
}

// TestReloadRenamedListenerMetrics: a listener renamed by a reload leaves no
// series behind (a usable-upstreams 0 under the old name would fire the
// no-usable-upstream alert for a listener that is gone).
func TestReloadRenamedListenerMetrics(t *testing.T) {
	e := startDaemon(t, newWorld(t), t.TempDir(), nil)
	e.waitReady()
	next := e.nextConfig()
	next.Listener[0].Name = "web"
	if err := e.d.Reload(next); err != nil {
		t.Fatal(err)
	}
	_, body := e.admin("/metrics")
	if !strings.Contains(body, `proxyd_listener_usable_upstreams{listener="web"}`) {
		t.Errorf("no usable-upstreams series of the new name:\n%s", body)
	}
	if l := grepLines(body, `{listener="http"}`); strings.Contains(l, "usable_upstreams") || strings.Contains(l, "panic") {
		t.Errorf("the renamed listener's pool series remain:\n%s", l)
	}
	// Its counters stay, with their last values, until its old incarnation
	// has drained, then go.
	waitFor(t, "the renamed listener's series gone", 5*time.Second, func() bool {
		_, body = e.admin("/metrics")
		return !strings.Contains(body, `listener="http"`)
	})
}

// capHeld starts a daemon whose listener on a fixed address has
// max_connections = 1 and holds one tunnel through it.
func capHeld(t *testing.T) (e *e2e, addr, echo string, held net.Conn) {
	addr = freeport.Addr(t)
	e = startDaemon(t, newWorld(t), t.TempDir(), func(c *config) {
		c.Listener[0].Address = addr
		c.Listener[0].MaxConnections = 1
		c.Listener[0].Users = []forward.User{{Name: "alice", Password: "pa"}}
	})
	e.waitReady()
	echo = echoServer(t)
	held, code := connectAs(t, addr, echo, "alice", "pa")
	if code != 200 {
		t.Fatalf("first tunnel: %d", code)
	}
	t.Cleanup(func() { held.Close() })
	return e, addr, echo, held
}

// nextConfig is the daemon's config to edit for a reload: its listeners
// are a copy of their own.
func (e *e2e) nextConfig() config {
	next := e.cfg
	next.Listener = slices.Clone(next.Listener)
	return next
}

// wantOverCap checks that one more tunnel through addr is refused (503).
func wantOverCap(t *testing.T, addr, echo, what string) {
	t.Helper()
	if c, code := connectAs(t, addr, echo, "alice", "pa"); code != http.StatusServiceUnavailable {
		if c != nil {
			c.Close()
		}
		t.Errorf("%s, max_connections = 1, one tunnel held: %d, want 503", what, code)
	}
}

// TestReloadKeepsTheCapRenamed: a listener renamed on the same address takes
// the socket over, and the connections of the one it replaces still count.
func TestReloadKeepsTheCapRenamed(t *testing.T) {
	e, addr, echo, held := capHeld(t)
	next := e.nextConfig()
	next.Listener[0].Name = "web"
	if err := e.d.Reload(next); err != nil {
		t.Fatal(err)
	}
	wantOverCap(t, addr, echo, "renamed listener")
	roundTrip(t, held, "still open")
}

// TestReloadUndoKeepsTheCap: a reload undone because a listener could not
// start gives the socket back to the old config, whose cap still counts the
// tunnel held, and leaves the socket bound for the failed listener to be
// closed (prepared.abandon closes what is still in sockets).
func TestReloadUndoKeepsTheCap(t *testing.T) {
	e, addr, echo, held := capHeld(t)
	next := e.nextConfig()
	next.Listener[0].IdleTimeout = time.Minute // changed: takes the socket over
	bad := next.Listener[0]
	bad.Name, bad.Protocol = "bad", "bogus" // NewListener refuses it
	ln, err := forward.Listen(context.Background(), "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	bad.Address = ln.Addr().String()
	next.Listener = append(next.Listener, bad)
	sockets := map[string]net.Listener{"bad": ln}
	e.d.mu.Lock()
	_, err = e.d.swapListeners(next, sockets)
	e.d.mu.Unlock()
	if err == nil {
		t.Fatal("a swap with a listener that cannot start went through")
	}
	if sockets["bad"] != ln {
		t.Error("the failed listener's socket left sockets: nothing would close it")
	}
	wantOverCap(t, addr, echo, "after an undone reload")
	roundTrip(t, held, "still open")
}

// TestReloadRenameAndReuseName: old `http` at A becomes `web` at A while a
// new `http` takes another address: the old incarnation's connections
// count against the listener that keeps its name, and `web` starts with a
// cap of its own (two listeners never share one count).
func TestReloadRenameAndReuseName(t *testing.T) {
	e, addr, echo, held := capHeld(t)
	next := e.nextConfig()
	next.Listener[0].Name = "web"
	moved := next.Listener[0]
	moved.Name, moved.Address = "http", freeport.Addr(t)
	next.Listener = append(next.Listener, moved)
	if err := e.d.Reload(next); err != nil {
		t.Fatal(err)
	}
	c, code := connectAs(t, addr, echo, "alice", "pa")
	if code != 200 {
		t.Fatalf("a first tunnel through web, max_connections = 1: %d, want 200", code)
	}
	defer c.Close()
	wantOverCap(t, addr, echo, "web with its own tunnel")
	wantOverCap(t, moved.Address, echo, "http, whose old incarnation holds one")
	roundTrip(t, held, "still open")
}

// A reload that only spells base_url otherwise (capitals, a trailing
// slash) keeps the running client, token_file read again or not: the poll
// loops are not restarted, nor the rounds in flight dropped.
func TestReloadRespelledBaseURLKeepsClient(t *testing.T) {
	w := newWorld(t)
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte("unused: the environment's token wins\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	e := startDaemon(t, w, t.TempDir(), func(c *config) { c.API.TokenFile = tokenFile })
	e.waitReady()
	e.d.mu.Lock()
	before := e.d.client
	e.d.mu.Unlock()
	next := e.nextConfig()
	next.API.BaseURL = "HTTP" + strings.TrimPrefix(next.API.BaseURL, "http") + "/"
	if err := e.d.Reload(next); err != nil {
		t.Fatal(err)
	}
	e.d.mu.Lock()
	after := e.d.client
	e.d.mu.Unlock()
	if after != before {
		t.Errorf("a re-spelled base_url (%s) replaced the client", next.API.BaseURL)
	}
}

// A reload that lowers [api] timeout lowers the watchdog's patience with
// the poll loops only once the old client's requests, which keep the old
// bound, may all have ended: a request hung in an API outage must not get
// proxyd killed as stuck.
func TestReloadLowerAPITimeoutKeepsWatchdogPatience(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), func(c *config) { c.API.Timeout = time.Minute })
	e.waitReady()
	next := e.nextConfig()
	next.API.Timeout = 5 * time.Second
	if err := e.d.Reload(next); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	if got := e.d.heartbeatAge(now); got != time.Minute+10*time.Second {
		t.Errorf("right after the reload: %s, want the old bound's %s", got, time.Minute+10*time.Second)
	}
	if got := e.d.heartbeatAge(now.Add(time.Minute + time.Second)); got != 15*time.Second {
		t.Errorf("once the old requests are over: %s, want the new bound's 15s", got)
	}
}
