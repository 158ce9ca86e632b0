package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/proxyd/proxyd/agent"
	"github.com/proxyd/proxyd/pool"
)

// adminEndpoints is every path the admin address answers.
var adminEndpoints = []string{"/", "/events", "/pool", "/metrics", "/healthz", "/readyz"}

type adminAnswer struct {
	code   int
	header http.Header
	body   string
}

// adminGet sends GET path to addr with the given Host header ("" = addr)
// and Authorization ("" = none).
func adminGet(t *testing.T, addr, path, host, auth string, basic ...string) adminAnswer {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if host != "" {
		req.Host = host
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	if len(basic) == 2 {
		req.SetBasicAuth(basic[0], basic[1])
	}
	tr := &http.Transport{Proxy: nil}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: reading: %v", path, err)
	}
	return adminAnswer{resp.StatusCode, resp.Header, string(b)}
}

func TestAdminHostCheck(t *testing.T) {
	for _, tc := range []struct {
		admin string
		host  string
		ok    bool
	}{
		{"127.0.0.1:9900", "127.0.0.1:9900", true},
		{"127.0.0.1:9900", "127.0.0.1", true},
		{"127.0.0.1:9900", "localhost:9900", true},
		{"127.0.0.1:9900", "LOCALHOST", true},
		{"127.0.0.1:9900", "localhost.:8000", true}, // a tunnel may change the port
		{"127.0.0.1:9900", "[::1]:9900", true},
		{"127.0.0.1:9900", "[::1]", true},
		{"127.0.0.1:9900", "evil.example:9900", false},
		{"127.0.0.1:9900", "evil.example", false},
		{"127.0.0.1:9900", "localhost.evil.example", false},
		{"127.0.0.1:9900", "", false},
		{"127.0.0.1:9900", "192.0.2.9:9900", false},
		{"192.0.2.2:9900", "192.0.2.2:9900", true},
		{"192.0.2.2:9900", "192.0.2.2", true},
		{"192.0.2.2:9900", "localhost:9900", true},
		{"192.0.2.2:9900", "192.0.2.3:9900", false},
		{"proxy.internal:9900", "Proxy.Internal:9900", true},
		{"proxy.internal:9900", "evil.example:9900", false},
		{"[2001:db8::1]:9900", "[2001:db8::1]:9900", true},
		{"[2001:db8::1]:9900", "[2001:db8::2]:9900", false},
		// Bound to every address: any literal IP is one of ours, a name
		// other than localhost is a rebound one.
		{"0.0.0.0:9900", "192.0.2.2:9900", true},
		{"0.0.0.0:9900", "[2001:db8::1]:9900", true},
		{"0.0.0.0:9900", "evil.example:9900", false},
		{":9900", "192.0.2.2:9900", true},
		{":9900", "evil.example", false},
		{"[::]:9900", "10.1.2.3", true},
	} {
		if got := newHostCheck(tc.admin).allowed(tc.host); got != tc.ok {
			t.Errorf("admin %s, Host %q: allowed %v, want %v", tc.admin, tc.host, got, tc.ok)
		}
	}
}

// TestAdminHostRebinding: a request whose Host names another site gets 403
// on every admin endpoint, with the token and without, while the same
// request naming the admin address or localhost is answered.
func TestAdminHostRebinding(t *testing.T) {
	w := newWorld(t)
	const token = "adm-rebind-5e1"
	e := startDaemon(t, w, t.TempDir(), func(c *config) { c.Admin.Token = token })
	addr := e.d.adminAddr()
	_, port, _ := net.SplitHostPort(addr)
	for _, path := range adminEndpoints {
		for _, host := range []string{"evil.example", "evil.example:" + port, "127.0.0.1.evil.example:" + port} {
			for _, auth := range []string{"", "Bearer " + token} {
				a := adminGet(t, addr, path, host, auth)
				if a.code != http.StatusForbidden {
					t.Errorf("GET %s Host %s (auth %q): %d, want 403", path, host, auth, a.code)
				}
				if cc := a.header.Get("Cache-Control"); cc != "no-store" {
					t.Errorf("GET %s Host %s: Cache-Control %q", path, host, cc)
				}
				if strings.Contains(a.body, token) {
					t.Errorf("GET %s Host %s: the answer holds the token", path, host)
				}
			}
		}
		for _, host := range []string{"", "localhost:" + port, "localhost"} {
			a := adminGet(t, addr, path, host, "Bearer "+token)
			if a.code == http.StatusForbidden || a.code == http.StatusUnauthorized || a.code == http.StatusNotFound {
				t.Errorf("GET %s Host %q with the token: %d", path, host, a.code)
			}
			if cc := a.header.Get("Cache-Control"); cc != "no-store" {
				t.Errorf("GET %s Host %q: Cache-Control %q", path, host, cc)
			}
		}
	}
}

// TestAdminBasicLoginNonLoopback: on an admin address outside loopback,
// which needs a token, a browser logs in the way browsers do: its first
// request gets 401 with a Basic challenge, the next one carries any user
// name and the token as password. Bearer works too; /healthz stays open.
func TestAdminBasicLoginNonLoopback(t *testing.T) {
	w := newWorld(t)
	const token = "adm-basic-91f"
	// Every interface: an address outside loopback, which needs a token.
	// The test's own traffic still goes to 127.0.0.1, the one address of
	// this machine tests may send to.
	e := startDaemon(t, w, t.TempDir(), func(c *config) {
		c.Admin.Address = "0.0.0.0:0"
		c.Admin.Token = token
	})
	bound := e.d.adminAddr()
	host, port, _ := net.SplitHostPort(bound)
	if ip := net.ParseIP(host); ip == nil || !ip.IsUnspecified() {
		t.Fatalf("admin bound to %s, want every interface", bound)
	}
	addr := net.JoinHostPort("127.0.0.1", port)
	e.waitReadyAt(addr, token)

	first := adminGet(t, addr, "/", "", "")
	if first.code != http.StatusUnauthorized {
		t.Fatalf("GET / without credentials: %d", first.code)
	}
	if got := first.header.Get("WWW-Authenticate"); got != `Basic realm="proxyd"` {
		t.Errorf("401 challenge %q, want Basic realm=\"proxyd\"", got)
	}
	page := adminGet(t, addr, "/", "", "", "anyone", token)
	if page.code != http.StatusOK || !strings.Contains(page.header.Get("Content-Type"), "text/html") {
		t.Fatalf("GET / with Basic login: %d %s", page.code, page.header.Get("Content-Type"))
	}
	if !strings.Contains(page.body, "<title>proxyd status</title>") {
		t.Errorf("the page is not the status page:\n%s", page.body)
	}
	if strings.Contains(page.body, token) {
		t.Error("the page holds the admin token")
	}
	// Another user name works; a wrong password or a malformed header does not.
	if a := adminGet(t, addr, "/pool", "", "", "", token); a.code != http.StatusOK {
		t.Errorf("Basic with an empty user name: %d", a.code)
	}
	for _, bad := range []adminAnswer{
		adminGet(t, addr, "/", "", "", "anyone", token+"x"),
		adminGet(t, addr, "/", "", "", token, ""),
		adminGet(t, addr, "/", "", "Basic !!!"),
		adminGet(t, addr, "/", "", "Bearer "+token[:len(token)-1]),
		adminGet(t, addr, "/", "", token),
	} {
		if bad.code != http.StatusUnauthorized {
			t.Errorf("wrong credentials: %d, want 401", bad.code)
		}
	}
	for _, path := range adminEndpoints {
		if path == "/healthz" {
			continue
		}
		if a := adminGet(t, addr, path, "", ""); a.code != http.StatusUnauthorized {
			t.Errorf("GET %s without credentials: %d", path, a.code)
		}
		if a := adminGet(t, addr, path, "", "Bearer "+token); a.code != http.StatusOK {
			t.Errorf("GET %s with Bearer: %d", path, a.code)
		}
		if a := adminGet(t, addr, path, "", "", "browser", token); a.code != http.StatusOK {
			t.Errorf("GET %s with Basic: %d", path, a.code)
		}
	}
	if a := adminGet(t, addr, "/healthz", "", ""); a.code != http.StatusOK {
		t.Errorf("/healthz stays open for liveness checks: %d", a.code)
	}
	// The page has the headers of a page that loads nothing from elsewhere.
	if csp := page.header.Get("Content-Security-Policy"); !strings.Contains(csp, "default-src 'none'") {
		t.Errorf("Content-Security-Policy %q", csp)
	}
	if got := page.header.Get("X-Content-Type-Options"); got != "nosniff" {
		t.Errorf("X-Content-Type-Options %q", got)
	}
	if got := page.header.Get("Cache-Control"); got != "no-store" {
		t.Errorf("Cache-Control %q", got)
	}

	// A real browser, given the token as the password of the URL.
	t.Run("chromium", func(t *testing.T) {
		bin := requireChromium(t)
		u := url.URL{Scheme: "http", User: url.UserPassword("browser", token), Host: addr, Path: "/"}
		dom, err := chromium(t, bin, "--dump-dom", u.String())
		if err != nil {
			t.Fatalf("chromium: %v", err)
		}
		if !bytes.Contains(dom, []byte(`id="upstreams"`)) {
			t.Errorf("Chromium did not get the status page:\n%s", dom)
		}
		if bytes.Contains(dom, []byte(token)) {
			t.Error("the page holds the admin token")
		}
	})
}

// waitReadyAt is waitReady for an admin address that wants a token.
func (e *e2e) waitReadyAt(addr, token string) {
	e.t.Helper()
	waitFor(e.t, "/readyz 200", 10*time.Second, func() bool {
		return adminGet(e.t, addr, "/readyz", "", "Bearer "+token).code == http.StatusOK
	})
}

// TestEventsEndpoint checks /events' shape, order and filters on a log
// filled through the daemon's own EventLog.
func TestEventsEndpoint(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), nil)
	base := time.Now().Add(-time.Hour).Truncate(time.Second)
	recorded := []pool.Event{
		{Time: base, Kind: pool.EventEjected, Upstream: "101/http/127.0.1.1:1111", Service: 101, Reason: "dial_refused"},
		{Time: base.Add(time.Second), Kind: pool.EventProviderError, Upstream: "101/socks5/127.0.2.1:2222", Service: 101, Reason: "errors list"},
		{Time: base.Add(2 * time.Second), Kind: pool.EventRotated, Upstream: "102/http/127.0.3.1:3333/s1", Service: 102, Reason: "198.51.100.9"},
		{Time: base.Add(3 * time.Second), Kind: pool.EventReload, Reason: "config reloaded"},
	}
	for _, ev := range recorded {
		e.d.events.Record(ev)
	}
	events := func(query string) []map[string]any {
		t.Helper()
		code, body := e.admin("/events" + query)
		if code != 200 {
			t.Fatalf("/events%s: %d %s", query, code, body)
		}
		var out struct {
			Events []map[string]any `json:"events"`
		}
		if err := json.Unmarshal([]byte(body), &out); err != nil {
			t.Fatalf("decoding /events%s: %v: %s", query, err, body)
		}
		// Only the recorded ones: the daemon's own events are not this test's.
		var ours []map[string]any
		for _, ev := range out.Events {
			if ts, _ := ev["time"].(string); ts != "" {
				if tm, err := time.Parse(time.RFC3339, ts); err == nil && !tm.After(base.Add(3*time.Second)) && !tm.Before(base) {
					ours = append(ours, ev)
				}
			}
		}
		return ours
	}
	all := events("")
	if len(all) != len(recorded) {
		t.Fatalf("/events: %d of the recorded events, want %d: %v", len(all), len(recorded), all)
	}
	for i, ev := range all {
		want := recorded[len(recorded)-1-i] // newest first
		if len(ev) != 5 {
			t.Errorf("event %d has fields %v, want time, kind, upstream, service, reason", i, ev)
		}
		ts := ev["time"].(string)
		if !strings.HasSuffix(ts, "Z") {
			t.Errorf("event %d time %q is not UTC", i, ts)
		}
		if tm, _ := time.Parse(time.RFC3339, ts); !tm.Equal(want.Time) {
			t.Errorf("event %d time %s, want %s", i, ts, want.Time)
		}
		if ev["kind"] != string(want.Kind) || ev["upstream"] != want.Upstream ||
			ev["service"] != float64(want.Service) || ev["reason"] != want.Reason {
			t.Errorf("event %d: %v, want %+v", i, ev, want)
		}
	}
	if got := events("?service=101"); len(got) != 2 || got[0]["kind"] != "provider_error" || got[1]["kind"] != "ejected" {
		t.Errorf("?service=101: %v", got)
	}
	if got := events("?kind=rotated"); len(got) != 1 || got[0]["upstream"] != "102/http/127.0.3.1:3333/s1" {
		t.Errorf("?kind=rotated: %v", got)
	}
	if got := events("?upstream=101/http/127.0.1.1:1111"); len(got) != 1 || got[0]["kind"] != "ejected" {
		t.Errorf("?upstream=: %v", got)
	}
	if got := events("?kind=reload&service=101"); len(got) != 0 {
		t.Errorf("?kind=reload&service=101: %v", got)
	}
	for _, q := range []string{"?kind=exploded", "?service=x", "?service=-1"} {
		if code, body := e.admin("/events" + q); code != 400 {
			t.Errorf("/events%s: %d %s, want 400", q, code, body)
		}
	}
	// An empty log is an empty list, not null.
	code, body := e.admin("/events?upstream=nothing-here")
	if code != 200 || !strings.Contains(body, `"events": []`) {
		t.Errorf("empty /events: %d %s", code, body)
	}

	// proxyd pool -events prints the same, as a table or as the JSON.
	poolCmd := func(args ...string) (int, string, string) {
		var out, errb bytes.Buffer
		rc := runMain(context.Background(), append([]string{"pool", "-admin", e.d.adminAddr()}, args...),
			stdio{out: &out, err: &errb, getenv: func(string) string { return "" }})
		return rc, out.String(), errb.String()
	}
	rc, out, errOut := poolCmd("-events", "-service", "101")
	if rc != 0 || !strings.Contains(out, "KIND") || !strings.Contains(out, "101/http/127.0.1.1:1111") ||
		strings.Index(out, "provider_error") > strings.Index(out, "ejected") || strings.Contains(out, "rotated") {
		t.Errorf("proxyd pool -events -service 101: %d\n%s%s", rc, out, errOut)
	}
	rc, out, errOut = poolCmd("-events", "-json", "-kind", "rotated")
	if rc != 0 || !strings.Contains(out, `"kind": "rotated"`) || strings.Contains(out, `"ejected"`) {
		t.Errorf("proxyd pool -events -json -kind rotated: %d\n%s%s", rc, out, errOut)
	}
	if rc, _, errOut = poolCmd("-events", "-kind", "exploded"); rc != 1 || !strings.Contains(errOut, "unknown kind") {
		t.Errorf("proxyd pool -events -kind exploded: %d %s", rc, errOut)
	}
	if rc, _, _ = poolCmd("-events", "-state", "healthy"); rc != 2 {
		t.Errorf("-events with -state: exit %d, want 2", rc)
	}
	if rc, _, _ = poolCmd("-kind", "ejected"); rc != 2 {
		t.Errorf("-kind without -events: exit %d, want 2", rc)
	}
}

// TestRenderEventsGolden pins the table of `proxyd pool -events`.
func TestRenderEventsGolden(t *testing.T) {
	at := time.Date(2026, 11, 21, 10, 0, 0, 0, time.UTC)
	ev := eventsAnswer{Events: []eventJSON{
		{Time: at.Add(50 * time.Second), Kind: pool.EventReload, Reason: "config reloaded"},
		{Time: at.Add(40 * time.Second), Kind: pool.EventRotated, Upstream: "102/socks5/gw.example:9000/s1", Service: 102, Reason: "198.51.100.8"},
		{Time: at.Add(30 * time.Second), Kind: pool.EventProviderOK, Upstream: "101/http/192.0.2.2:8080", Service: 101},
		{Time: at, Kind: pool.EventEjected, Upstream: "101/http/192.0.2.2:8080", Service: 101, Reason: "dial_refused"},
	}}
	var b bytes.Buffer
	if err := renderEvents(&b, ev, at.Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	golden(t, "events_table", b.String())
}

// TestEventsOfARealDaemon: what happens to a running daemon's upstreams
// shows in /events once per upstream ID, with the kind, the ID as /pool
// names it, the service and the reason, newest first.
func TestEventsOfARealDaemon(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), nil)
	e.waitReady()
	type key struct{ kind, upstream string }
	events := func() (all []eventJSON, count map[key]int) {
		t.Helper()
		code, body := e.admin("/events")
		var ev eventsAnswer
		if err := json.Unmarshal([]byte(body), &ev); code != 200 || err != nil {
			t.Fatalf("/events: %d %v %s", code, err, body)
		}
		count = map[key]int{}
		for _, x := range ev.Events {
			count[key{string(x.Kind), x.Upstream}]++
		}
		return ev.Events, count
	}
	idOf := func(addr string, proto pool.Protocol) pool.UpstreamExplanation {
		t.Helper()
		for _, u := range e.poolState().Upstreams {
			if u.Address == addr && u.Protocol == proto {
				return u
			}
		}
		t.Fatalf("no %s upstream %s in /pool", proto, addr)
		return pool.UpstreamExplanation{}
	}
	expectOnce := func(kind pool.EventKind, u pool.UpstreamExplanation, reason string) {
		t.Helper()
		all, count := events()
		if n := count[key{string(kind), u.ID}]; n != 1 {
			t.Errorf("%d %s events for %s, want 1", n, kind, u.ID)
		}
		for _, x := range all {
			if x.Kind == kind && x.Upstream == u.ID {
				if x.Service != u.Service || (reason != "" && x.Reason != reason) {
					t.Errorf("%s event of %s: service %d reason %q, want %d %q", kind, u.ID, x.Service, x.Reason, u.Service, reason)
				}
			}
		}
	}

	// A provider mark and its clearing.
	marked := idOf(w.fprHTTP[0].Addr(), pool.HTTP)
	w.sim.MarkErrored(demoFPR, hostOf(marked.Address))
	e.pollOnce(agent.LoopStatus)
	expectOnce(pool.EventProviderError, marked, "")
	w.sim.ClearStatus(demoFPR)
	e.pollOnce(agent.LoopStatus)
	expectOnce(pool.EventProviderOK, marked, "")
	expectOnce(pool.EventProviderError, marked, "") // still once

	// An ejection.
	dead := idOf(w.fprSOCKS[1].Addr(), pool.SOCKS5)
	w.fprSOCKS[1].Down()
	waitFor(t, "an ejected event", 30*time.Second, func() bool {
		e.get("socks", "")
		_, count := events()
		return count[key{string(pool.EventEjected), dead.ID}] > 0
	})
	expectOnce(pool.EventEjected, dead, pool.DialRefused.String())

	// A rotation: a sticky key on a ppr session whose gateway stops.
	var via string
	var stickyKey string
	for i := 0; i < 20 && !strings.HasPrefix(via, "ppr-session-"); i++ {
		stickyKey = "k" + strconv.Itoa(i)
		via = e.mustGet("http", stickyKey)
	}
	if !strings.HasPrefix(via, "ppr-session-") {
		t.Fatalf("no sticky key landed on a ppr session (last via %q)", via)
	}
	idx := 0
	if via == "ppr-session-s2" {
		idx = 1
	}
	session := w.sim.Sessions(demoPPR)[idx].Session
	w.sessions[idx].Down()
	e.get("http", stickyKey)
	waitFor(t, "a rotated event", 15*time.Second, func() bool {
		all, _ := events()
		for _, x := range all {
			if x.Kind == pool.EventRotated {
				return true
			}
		}
		return false
	})
	all, count := events()
	ups := e.poolState().Upstreams
	for _, x := range all {
		if x.Kind != pool.EventRotated {
			continue
		}
		if count[key{string(x.Kind), x.Upstream}] != 1 {
			t.Errorf("%d rotated events for %s, want 1", count[key{string(x.Kind), x.Upstream}], x.Upstream)
		}
		found := false
		for _, u := range ups {
			if u.ID == x.Upstream && u.Session == session && u.Service == demoPPR && x.Service == demoPPR {
				found = true
			}
		}
		if !found {
			t.Errorf("rotated event %+v names no upstream of session %s in /pool", x, session)
		}
	}

	// A reload.
	next := e.cfg
	next.Log.Level = "debug"
	if err := e.d.Reload(next); err != nil {
		t.Fatal(err)
	}
	all, count = events()
	if count[key{string(pool.EventReload), ""}] != 1 {
		t.Errorf("%d reload events, want 1", count[key{string(pool.EventReload), ""}])
	}
	if len(all) == 0 || all[0].Kind != pool.EventReload || all[0].Service != 0 {
		t.Errorf("the newest event is %+v, want the reload", all[0])
	}
	for i := 1; i < len(all); i++ {
		if all[i].Time.After(all[i-1].Time) {
			t.Errorf("event %d (%s %s) is newer than event %d (%s %s): not newest first",
				i, all[i].Kind, all[i].Time, i-1, all[i-1].Kind, all[i-1].Time)
		}
	}
}
