package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/proxyd/proxyd/agent/providersim"
	"github.com/proxyd/proxyd/internal/syncbuf"
)

func newPollerForTest(t *testing.T, cfg PollConfig) (*Poller, *providersim.Sim, *[]Snapshot) {
	t.Helper()
	sim := providersim.New(providersim.Config{})
	srv := httptest.NewServer(sim)
	t.Cleanup(srv.Close)
	c, err := New(clientConfig(srv.URL, "sim-token", 5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var snaps []Snapshot
	if cfg.LookupHost == nil {
		cfg.LookupHost = sim.LookupHost // the sim's gateway names resolve to its list IPs
	}
	p, err := NewPoller(c, cfg, func(s Snapshot) { mu.Lock(); snaps = append(snaps, s); mu.Unlock() }, nil)
	if err != nil {
		t.Fatal(err)
	}
	return p, sim, &snaps
}

// clientConfig is DefaultConfig with a base URL, token and timeout.
func clientConfig(url, token string, timeout time.Duration) Config {
	c := DefaultConfig()
	c.BaseURL, c.Token, c.Timeout = url, token, timeout
	return c
}

// interceptClient returns a client of sim whose requests intercept sees
// first: it answers those it returns true for, and sim the others.
func interceptClient(t *testing.T, sim *providersim.Sim, timeout time.Duration, intercept func(w http.ResponseWriter, r *http.Request) (answered bool)) *Client {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !intercept(w, r) {
			sim.ServeHTTP(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	c, err := New(clientConfig(srv.URL, providersim.DefaultToken, timeout))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// drawn is PollConfig.Draws for listeners that dial these protocols and
// draw every service of either kind.
func drawn(protocols ...string) func(int, string, string) bool {
	return func(_ int, _, protocol string) bool { return slices.Contains(protocols, protocol) }
}

// pollConfig is DefaultPollConfig changed by set.
func pollConfig(set func(c *PollConfig)) PollConfig {
	c := DefaultPollConfig()
	set(&c)
	return c
}

func pollAll(t *testing.T, p *Poller) {
	t.Helper()
	ctx := context.Background()
	for l := Loop(0); l < numLoops; l++ {
		if err := p.PollOnce(ctx, l); err != nil {
			t.Fatalf("poll %s: %v", l, err)
		}
	}
}

// waitUntil polls cond until it holds, failing the test after timeout.
func waitUntil(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after %v: %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func serviceByID(s Snapshot, id int) *ServiceState {
	for i := range s.Services {
		if s.Services[i].ID == id {
			return &s.Services[i]
		}
	}
	return nil
}

func TestPollerServesActiveServices(t *testing.T) {
	p, sim, _ := newPollerForTest(t, DefaultPollConfig())
	sim.MarkErrored(101, "203.0.113.9")
	sim.SetUsage(102, 900, 1000)
	pollAll(t, p)
	s := p.Snapshot()
	var ids []int
	for _, st := range s.Services {
		ids = append(ids, st.ID)
	}
	if !slices.Equal(ids, []int{101, 102, 104}) {
		t.Fatalf("served services %v, want the Active ones [101 102 104]", ids)
	}
	fpr := serviceByID(s, 101)
	if !fpr.ListsKnown || len(fpr.Lists["http-auth"]) == 0 || len(fpr.Lists["socks-ip"]) == 0 {
		t.Fatalf("fpr lists: %+v", fpr.Lists)
	}
	if _, ok := fpr.Lists["ppr-http"]; ok {
		t.Error("an fpr service must not fetch ppr lists")
	}
	if !fpr.StatusKnown() || !slices.Contains(fpr.Errored, "203.0.113.9") {
		t.Errorf("errored list: %v", fpr.Errored)
	}
	ppr := serviceByID(s, 102)
	if len(ppr.Sticky) != 2 || !ppr.HasUsage || ppr.Rate != 900 || ppr.Limit != 1000 {
		t.Errorf("ppr state: sticky %v usage %v %v/%v", ppr.Sticky, ppr.HasUsage, ppr.Rate, ppr.Limit)
	}
	if !s.CreditKnown || s.Credit != sim.Credit() {
		t.Errorf("credit %v, want %v", s.Credit, sim.Credit())
	}

	// fpr http from http-auth with the line's credentials,
	// fpr socks5 from socks-ip with the service record's.
	ups := fpr.Upstreams()
	var http, socks int
	for _, u := range ups {
		switch u.Protocol {
		case "http":
			http++
			if u.Username == "" {
				t.Errorf("http upstream without credentials: %+v", u)
			}
		case "socks5":
			socks++
			if u.Username != fpr.Record.Username || u.Password != fpr.Record.Password {
				t.Errorf("socks upstream must use the service record's credentials: %+v", u)
			}
		}
	}
	if http != len(fpr.Lists["http-auth"]) || socks != len(fpr.Lists["socks-ip"]) {
		t.Errorf("upstreams: %d http, %d socks from %d/%d entries", http, socks, len(fpr.Lists["http-auth"]), len(fpr.Lists["socks-ip"]))
	}
	// ppr with sticky sessions: one upstream per session and protocol.
	for _, u := range ppr.Upstreams() {
		if u.Session == "" || u.Server == "" || u.Kind != "ppr" {
			t.Errorf("ppr sticky upstream: %+v", u)
		}
	}
	if got := len(ppr.Upstreams()); got != 2*len(ppr.Sticky) {
		t.Errorf("ppr upstreams %d, want %d", got, 2*len(ppr.Sticky))
	}
	// ppr without sticky sessions: its list entries as rotating upstreams.
	plain := serviceByID(s, 104)
	for _, u := range plain.Upstreams() {
		if u.Session != "" {
			t.Errorf("service 104 has no sessions: %+v", u)
		}
	}
	if len(plain.Upstreams()) == 0 {
		t.Error("service 104 gives no upstreams")
	}
}

func TestPollerConfiguredServicesAndProtocols(t *testing.T) {
	p, sim, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) { c.Services = []int{101, 103}; c.Draws = drawn("http") }))
	pollAll(t, p)
	s := p.Snapshot()
	if len(s.Services) != 1 || s.Services[0].ID != 101 {
		t.Fatalf("services %+v, want only 101 (103 is Suspended)", s.Services)
	}
	if !slices.Contains(s.Dropped, 103) {
		t.Errorf("dropped %v, want 103", s.Dropped)
	}
	if _, ok := s.Services[0].Lists["socks-ip"]; ok {
		t.Error("no listener dials socks5: socks-ip must not be fetched")
	}
	if n := sim.Requests("/api/iplist/{typel}/{formatl}/{id}"); n != 1 {
		t.Errorf("%d list requests, want 1", n)
	}
	// A service that stops being Active leaves at the next account poll.
	sim.SetServiceStatus(101, "Suspended")
	if err := p.PollOnce(context.Background(), LoopAccount); err != nil {
		t.Fatal(err)
	}
	s = p.Snapshot()
	if len(s.Services) != 0 || !slices.Contains(s.Dropped, 101) {
		t.Errorf("after suspension: services %+v dropped %v", s.Services, s.Dropped)
	}
}

// A far smaller list is swapped in when a poll an ip_list interval later
// brings it again; a poll brought forward does not confirm it.
func TestPollerConfirmsShrinkingLists(t *testing.T) {
	clock := newFakeClock()
	p, sim, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) {
		c.Services, c.Draws, c.Now = []int{101}, drawn("http"), clock.Now
	}))
	pollAll(t, p)
	full := len(serviceByID(p.Snapshot(), 101).Lists["http-auth"])
	if full < 3 {
		t.Fatalf("need at least 3 entries, have %d", full)
	}
	sim.SetEntries(101, "http-auth", nil)
	ctx := context.Background()
	clock.Advance(10 * time.Minute)
	if err := p.PollOnce(ctx, LoopLists); err != nil {
		t.Fatal(err)
	}
	if n := len(serviceByID(p.Snapshot(), 101).Lists["http-auth"]); n != full {
		t.Fatalf("an empty list was swapped in without confirmation: %d entries", n)
	}
	clock.Advance(time.Minute)
	if err := p.PollOnce(ctx, LoopLists); err != nil {
		t.Fatal(err)
	}
	if n := len(serviceByID(p.Snapshot(), 101).Lists["http-auth"]); n != full {
		t.Fatalf("an empty list was confirmed by a poll 1m later (ip_list 10m): %d entries", n)
	}
	clock.Advance(9 * time.Minute)
	if err := p.PollOnce(ctx, LoopLists); err != nil {
		t.Fatal(err)
	}
	if n := len(serviceByID(p.Snapshot(), 101).Lists["http-auth"]); n != 0 {
		t.Fatalf("the confirmed empty list must be swapped in: %d entries", n)
	}
	// Growing lists need no confirmation.
	sim.SetEntries(101, "http-auth", []providersim.Entry{{Host: "192.0.2.1", Port: 8080, Login: "u", Password: "p"}})
	if err := p.PollOnce(ctx, LoopLists); err != nil {
		t.Fatal(err)
	}
	if n := len(serviceByID(p.Snapshot(), 101).Lists["http-auth"]); n != 1 {
		t.Fatalf("entries %d, want 1", n)
	}
}

func TestPollerKeepsLastGoodDataOnFailure(t *testing.T) {
	p, sim, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) { c.Services = []int{101} }))
	pollAll(t, p)
	before := p.Snapshot()
	sim.FailNext(1000, 500, "<html>oops</html>")
	for l := Loop(0); l < numLoops; l++ {
		if err := p.PollOnce(context.Background(), l); err == nil && l != LoopUsage {
			t.Errorf("poll %s: want an error while the API fails", l)
		}
	}
	after := p.Snapshot()
	b, a := serviceByID(before, 101), serviceByID(after, 101)
	if a == nil || len(a.Lists["http-auth"]) != len(b.Lists["http-auth"]) || a.Record.Username != b.Record.Username {
		t.Fatalf("last good data lost: %+v", a)
	}
}

func TestPollerWaits(t *testing.T) {
	clock := newFakeClock()
	p, _, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) { c.Jitter = 0.1; c.MaxBackoff = time.Minute; c.Now = clock.Now }))
	now := clock.Now()
	for range 100 {
		if w := p.nextWait(10*time.Second, 0, p.rateLimited(nil)); w < 9*time.Second || w > 11*time.Second {
			t.Fatalf("success wait %v outside interval ±10%%", w)
		}
	}
	fail := errors.New("boom")
	prev := time.Duration(0)
	for n := 1; n <= 8; n++ {
		w := p.nextWait(30*time.Second, n, p.rateLimited(fail))
		base := min(5*time.Second<<(n-1), time.Minute)
		if w < base*9/10 || w > base*11/10 {
			t.Errorf("failure %d: wait %v, want %v ±10%%", n, w, base)
		}
		if n > 1 && w < prev*8/10 {
			t.Errorf("backoff shrank: %v after %v", w, prev)
		}
		prev = w
	}
	// A 429 is never retried before the time it names.
	tooMany := &APIError{Status: 429, NextAllowed: now.Add(7 * time.Minute)}
	if w := p.nextWait(30*time.Second, 1, p.rateLimited(tooMany)); w < 7*time.Minute {
		t.Errorf("429 wait %v, want at least 7m", w)
	}
}

func TestPollerRunBacksOffAndBeats(t *testing.T) {
	p, sim, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) {
		c.Services = []int{101}
		c.NetworkStatus = time.Second
		c.IPList = time.Second
		c.Usage = time.Second
		c.Account = time.Second
		c.MaxBackoff = 4 * time.Second
		c.Jitter = 0.01
	}))
	sim.FailNext(1<<30, 500, "down")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); p.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	// Backoff: 1s, 2s, 4s, 4s, … — in 5.5s the account loop makes at most 4
	// attempts where a healthy 1s loop would make 6.
	deadline := time.Now().Add(5500 * time.Millisecond)
	for time.Now().Before(deadline) {
		if !p.Alive(3 * time.Second) {
			t.Fatal("loops must stay alive (heartbeat) while the API fails")
		}
		time.Sleep(100 * time.Millisecond)
	}
	if n := sim.Requests("/api/services"); n < 2 || n > 4 {
		t.Errorf("%d attempts on /api/services in 5.5s, want 2–4 with backoff", n)
	}
}

func TestPollerRotate(t *testing.T) {
	p, sim, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) { c.Services = []int{102} }))
	pollAll(t, p)
	sess := sim.Sessions(102)[0]
	ip, err := p.Rotate(context.Background(), 102, sess.Server, sess.Session)
	if err != nil {
		t.Fatal(err)
	}
	if ip == "" || ip == sess.ExitIP || sim.Sessions(102)[0].ExitIP != ip {
		t.Fatalf("rotate gave %q; old %q, provider now %q", ip, sess.ExitIP, sim.Sessions(102)[0].ExitIP)
	}
	found := false
	for _, ss := range serviceByID(p.Snapshot(), 102).Sticky {
		if ss.Session == sess.Session {
			found = true
			if ss.ExitIP != ip {
				t.Errorf("snapshot keeps the old exit IP %q", ss.ExitIP)
			}
		}
	}
	if !found {
		t.Errorf("session %q missing from the snapshot", sess.Session)
	}
}

// A rotation whose answer names no exit IP succeeds, and the session is
// left without an exit IP until the next lists round: keeping the old one
// would hand the pool the IP that was rotated away (errored, most often)
// with every snapshot, and the pool would rotate the session again.
func TestPollerRotateWithoutExitIP(t *testing.T) {
	p, sim, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) { c.Services = []int{102} }))
	pollAll(t, p)
	sess := sim.Sessions(102)[0]
	if sess.ExitIP == "" {
		t.Fatal("the simulated session has no exit IP: the test proves nothing")
	}
	sim.RotateHook(func(int, string, string) (int, string) { return 200, `{"status":"ok"}` })
	ip, err := p.Rotate(context.Background(), 102, sess.Server, sess.Session)
	if ip != "" || err != nil {
		t.Fatalf("rotate = %q, %v; want a success without an exit IP", ip, err)
	}
	found := false
	for _, ss := range serviceByID(p.Snapshot(), 102).Sticky {
		if ss.Session == sess.Session && ss.Server == sess.Server {
			found = true
			if ss.ExitIP != "" {
				t.Errorf("snapshot keeps the rotated-away exit IP %q", ss.ExitIP)
			}
		}
	}
	if !found {
		t.Errorf("session %q missing from the snapshot", sess.Session)
	}
}

// A rotation the provider refuses in a 200 answer fails, and the session
// keeps its exit IP, even when the refusal names an address.
func TestPollerRotateRefusedIn200(t *testing.T) {
	p, sim, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) { c.Services = []int{102} }))
	pollAll(t, p)
	sess := sim.Sessions(102)[0]
	sim.RotateHook(func(int, string, string) (int, string) {
		return 200, `{"error":"Session expired","ip":"198.51.100.77"}`
	})
	ip, err := p.Rotate(context.Background(), 102, sess.Server, sess.Session)
	var apiErr *APIError
	if ip != "" || !errors.As(err, &apiErr) || apiErr.Message != "Session expired" {
		t.Fatalf("refused rotate = %q, %v; want the provider's refusal", ip, err)
	}
	if rotateRateLimited(err) {
		t.Errorf("a refusal for another reason reads as a rate limit: %v", err)
	}
	for _, ss := range serviceByID(p.Snapshot(), 102).Sticky {
		if ss.Session == sess.Session && ss.ExitIP != sess.ExitIP {
			t.Errorf("snapshot has exit IP %q after a refused rotate, want %q", ss.ExitIP, sess.ExitIP)
		}
	}
}

// A rotation the provider refuses for coming too soon, with a 429 or with
// its rate-limit message in a 200, reads as rate limited to the pool, which
// counts it as "rate_limited" rather than "error" (a pool.Rotator's error
// says so with a RateLimited() bool method or pool.ErrRotateRateLimited).
func TestPollerRotateRateLimited(t *testing.T) {
	p, sim, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) { c.Services = []int{102} }))
	pollAll(t, p)
	sess := sim.Sessions(102)[0]
	for _, answer := range []struct {
		status int
		body   string
	}{
		{http.StatusTooManyRequests, `{"error":"Too Many Attempts"}`},
		{http.StatusTooManyRequests, `Too Many Requests`},
		{http.StatusOK, `{"error":"Too many attempts, try again later"}`},
	} {
		sim.RotateHook(func(int, string, string) (int, string) { return answer.status, answer.body })
		ip, err := p.Rotate(context.Background(), 102, sess.Server, sess.Session)
		if ip != "" || !rotateRateLimited(err) {
			t.Errorf("rotate answered %d %s = %q, %v; want a rate-limited error", answer.status, answer.body, ip, err)
		}
	}
}

// rotateRateLimited is how the pool tells a rate-limited rotation
// (pool.Rotator's contract).
func rotateRateLimited(err error) bool {
	var rl interface{ RateLimited() bool }
	return errors.As(err, &rl) && rl.RateLimited()
}

// restored is n upstreams of service id as a state file gives them back:
// from kind's list for protocol, or (sessions) one per sticky session.
func restored(id int, kind, protocol string, n int, sessions bool) []UpstreamSpec {
	var ups []UpstreamSpec
	for i := range n {
		u := UpstreamSpec{Service: id, Kind: kind, Protocol: protocol, Address: fmt.Sprintf("10.0.0.%d:8080", i+1)}
		if sessions {
			u.Session = fmt.Sprintf("s%d", i)
		}
		ups = append(ups, u)
	}
	return ups
}

// Seed counts what the saved upstreams came from: each list type, each
// service's sessions once whatever the protocols, and the services.
func TestPollerSeedCountsWhatUpstreamsCameFrom(t *testing.T) {
	p, _, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) { c.Services = []int{101, 104} }))
	ups := slices.Concat(restored(101, "fpr", "http", 3, false), restored(101, "fpr", "socks5", 2, false),
		restored(104, "ppr", "http", 2, true), restored(104, "ppr", "socks5", 2, true), restored(104, "ppr", "socks5", 1, false))
	p.Seed(ups)
	p.mu.Lock()
	got := maps.Clone(p.lastGood)
	p.mu.Unlock()
	want := map[string]int{"101/http-auth": 3, "101/socks-ip": 2, "104/sticky": 2, "104/ppr-socks": 1, "services": 2}
	if !maps.Equal(got, want) {
		t.Errorf("seeded %v, want %v", got, want)
	}
}

// httpEntries is n http-auth list entries, 10.0.1.1 on.
func httpEntries(n int) []providersim.Entry {
	var out []providersim.Entry
	for i := range n {
		out = append(out, providersim.Entry{Host: fmt.Sprintf("10.0.1.%d", i+1), Port: 8080, Login: "u", Password: "p"})
	}
	return out
}

// pollAccountAndLists runs one account round, then one lists round.
func pollAccountAndLists(t *testing.T, p *Poller) {
	t.Helper()
	for _, l := range []Loop{LoopAccount, LoopLists} {
		if err := p.PollOnce(context.Background(), l); err != nil {
			t.Fatal(err)
		}
	}
}

// After a restart the daemon seeds the sizes it serves from its state: an
// empty or much smaller first list then needs confirmation like any other.
func TestPollerFirstPollAfterRestartNeedsConfirmation(t *testing.T) {
	clock := newFakeClock()
	p, sim, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) {
		c.Services, c.Draws, c.Now = []int{101}, drawn("http"), clock.Now
	}))
	p.Seed(restored(101, "fpr", "http", 3, false))
	sim.SetEntries(101, "http-auth", nil)
	ctx := context.Background()
	if err := p.PollOnce(ctx, LoopAccount); err != nil {
		t.Fatal(err)
	}
	if err := p.PollOnce(ctx, LoopLists); err != nil {
		t.Fatal(err)
	}
	if st := serviceByID(p.Snapshot(), 101); st.ListsKnown {
		t.Fatalf("an unconfirmed empty first list counts as known: %+v", st.Lists)
	}
	clock.Advance(10 * time.Minute)
	if err := p.PollOnce(ctx, LoopLists); err != nil {
		t.Fatal(err)
	}
	if st := serviceByID(p.Snapshot(), 101); !st.ListsKnown || len(st.Lists["http-auth"]) != 0 {
		t.Fatalf("the confirmed empty list: known %v, %d entries", st.ListsKnown, len(st.Lists["http-auth"]))
	}

	// Without a seed, an empty first list needs confirmation as well.
	q, sim2, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) { c.Services = []int{101}; c.Draws = drawn("http") }))
	sim2.SetEntries(101, "http-auth", nil)
	for _, l := range []Loop{LoopAccount, LoopLists} {
		if err := q.PollOnce(ctx, l); err != nil {
			t.Fatal(err)
		}
	}
	if serviceByID(q.Snapshot(), 101).ListsKnown {
		t.Fatal("an empty first list was taken without confirmation")
	}
}

// An empty service list would take every service away: it needs the next
// regular poll to confirm it.
func TestPollerServiceListShrinkNeedsConfirmation(t *testing.T) {
	clock := newFakeClock()
	p, sim, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) { c.Now = clock.Now }))
	pollAll(t, p)
	if n := len(p.Snapshot().Services); n != 3 {
		t.Fatalf("%d services, want 3", n)
	}
	// The provider answers an empty service list once.
	sim.FailNext(1, 200, "[]")
	ctx := context.Background()
	if err := p.PollOnce(ctx, LoopAccount); err != nil {
		t.Fatal(err)
	}
	if n := len(p.Snapshot().Services); n != 3 {
		t.Fatalf("an empty service list dropped services at once: %d left", n)
	}
	clock.Advance(15 * time.Minute)
	sim.FailNext(1, 200, "[]")
	if err := p.PollOnce(ctx, LoopAccount); err != nil {
		t.Fatal(err)
	}
	if n := len(p.Snapshot().Services); n != 0 {
		t.Fatalf("the confirmed empty list must drop them: %d left", n)
	}
}

func TestPollerAliveDuringSlowAccountRound(t *testing.T) {
	sim := providersim.New(providersim.Config{})
	c := interceptClient(t, sim, time.Second, func(w http.ResponseWriter, r *http.Request) bool {
		if strings.HasPrefix(r.URL.Path, "/api/service/") {
			time.Sleep(900 * time.Millisecond) // each request within its timeout
		}
		return false
	})
	p, err := NewPoller(c, pollConfig(func(c *PollConfig) { c.Services = []int{101, 102, 104} }), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); p.Run(ctx) }()
	defer func() { cancel(); <-done }()
	maxAge := 2 * time.Second // the daemon uses the API timeout + 10s
	waitedPastMaxAge := false
	for start := time.Now(); time.Since(start) < 3500*time.Millisecond; time.Sleep(100 * time.Millisecond) {
		if !p.Alive(maxAge) {
			t.Fatalf("not alive after %v while every request answered within its timeout", time.Since(start))
		}
		if time.Since(start) > maxAge && p.Rounds(LoopLists) == 0 {
			waitedPastMaxAge = true
		}
	}
	// Else the first account round ended too soon for the other loops'
	// wait to matter, and the test proved nothing.
	if !waitedPastMaxAge {
		t.Error("the other loops never waited longer than maxAge for the first account round")
	}
}

func TestPollerReconfigureFetchesNewlyDrawnLists(t *testing.T) {
	cfg := pollConfig(func(c *PollConfig) {
		c.Services = []int{101}
		c.Draws = drawn("http")
		c.IPList = time.Hour
		c.Account = time.Hour
		c.NetworkStatus = time.Hour
		c.Usage = time.Hour
	})
	p, _, _ := newPollerForTest(t, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); p.Run(ctx) }()
	defer func() { cancel(); <-done }()
	waitUntil(t, 5*time.Second, "no lists round has run", func() bool { return p.Rounds(LoopLists) > 0 })
	if st := serviceByID(p.Snapshot(), 101); st == nil || len(st.Lists["socks-ip"]) > 0 {
		t.Fatalf("before the reload: %+v, want service 101 without a socks-ip list", st)
	}
	cfg.Draws = drawn("http", "socks5")
	if err := p.Reconfigure(p.client, cfg, false); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 5*time.Second, "the socks-ip list was not fetched after the reload", func() bool {
		st := serviceByID(p.Snapshot(), 101)
		return st != nil && len(st.Lists["socks-ip"]) > 0
	})
}

func TestPollOnceUnknownLoop(t *testing.T) {
	p, _, _ := newPollerForTest(t, DefaultPollConfig())
	for _, l := range []Loop{-1, numLoops} {
		if err := p.PollOnce(context.Background(), l); err == nil {
			t.Errorf("PollOnce(%d) succeeded", l)
		}
	}
}

// When the errored list is fetched and the inactive one fails, the fresh
// errored list is applied and the inactive one keeps its last good value;
// the round still reports the failure.
func TestPollerStatusAppliesErroredWhenInactiveFails(t *testing.T) {
	sim := providersim.New(providersim.Config{})
	var failInactive atomic.Bool
	c := interceptClient(t, sim, 5*time.Second, func(w http.ResponseWriter, r *http.Request) bool {
		if failInactive.Load() && strings.HasPrefix(r.URL.Path, "/api/networkstatus/inactive/") {
			w.WriteHeader(http.StatusServiceUnavailable)
			return true
		}
		return false
	})
	p, err := NewPoller(c, pollConfig(func(c *PollConfig) { c.Services = []int{101} }), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := p.PollOnce(ctx, LoopAccount); err != nil {
		t.Fatal(err)
	}
	sim.MarkInactive(101, "10.0.0.3")
	if err := p.PollOnce(ctx, LoopStatus); err != nil {
		t.Fatal(err)
	}
	failInactive.Store(true)
	sim.MarkErrored(101, "10.0.0.1")
	if err := p.PollOnce(ctx, LoopStatus); err == nil {
		t.Error("the round reported no error while the inactive list failed")
	}
	st := serviceByID(p.Snapshot(), 101)
	if !st.StatusKnown() || !slices.Equal(st.Errored, []string{"10.0.0.1"}) || !slices.Equal(st.Inactive, []string{"10.0.0.3"}) {
		t.Errorf("known %v, errored %v, inactive %v; want known, errored [10.0.0.1], inactive [10.0.0.3] kept",
			st.StatusKnown(), st.Errored, st.Inactive)
	}
}

// A 429 whose Retry-After names a time far away (up to 2^31 s can be
// written) parks a loop for at most maxRateLimitWait, and the loop says so
// in the log; a nearer time is still honoured in full.
func TestPollerRateLimitWaitBounded(t *testing.T) {
	clock := newFakeClock()
	p, _, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) { c.Now = clock.Now }))
	now := clock.Now()
	far := &APIError{Status: 429, NextAllowed: retryAfter("2147483647", now)}
	if w := p.nextWait(30*time.Second, 1, p.rateLimited(far)); w != maxRateLimitWait {
		t.Errorf("wait after a 429 naming 2^31 s: %v, want %v", w, maxRateLimitWait)
	}
	near := &APIError{Status: 429, NextAllowed: now.Add(50 * time.Minute)}
	if w := p.nextWait(30*time.Second, 1, p.rateLimited(near)); w != 50*time.Minute {
		t.Errorf("wait after a 429 naming 50m: %v, want 50m", w)
	}

	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Retry-After", "2147483647")
		w.WriteHeader(http.StatusTooManyRequests)
	}))
	defer srv.Close()
	c, err := New(clientConfig(srv.URL, "t", 5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var logBuf syncbuf.Buffer
	q, err := NewPoller(c, DefaultPollConfig(), nil, slog.New(slog.NewTextHandler(&logBuf, nil)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); q.Run(ctx) }()
	defer func() { cancel(); <-done }()
	waitUntil(t, 5*time.Second, "the capped wait was not logged", func() bool {
		return strings.Contains(logBuf.String(), "beyond the longest wait")
	})
	if out := logBuf.String(); !strings.Contains(out, "retry_in=1h0m0s") || !strings.Contains(out, "longest_wait=1h0m0s") {
		t.Errorf("log does not show the 1h wait:\n%s", out)
	}
}

// failingService serves the simulator, answering 422 to the requests
// under each of prefixes for service failing, and counts the requests
// under the first prefix by service.
func failingService(t *testing.T, failing int, prefixes ...string) (*providersim.Sim, *Client, func(id int) int) {
	t.Helper()
	sim := providersim.New(providersim.Config{})
	var mu sync.Mutex
	counts := map[int]int{}
	c := interceptClient(t, sim, 5*time.Second, func(w http.ResponseWriter, r *http.Request) bool {
		if id, err := strconv.Atoi(strings.TrimPrefix(r.URL.Path, prefixes[0])); err == nil {
			mu.Lock()
			counts[id]++
			mu.Unlock()
		}
		for _, prefix := range prefixes {
			if r.URL.Path == prefix+strconv.Itoa(failing) {
				w.WriteHeader(http.StatusUnprocessableEntity)
				io.WriteString(w, `{"error":"Unprocessable Entity "}`)
				return true
			}
		}
		return false
	})
	return sim, c, func(id int) int { mu.Lock(); defer mu.Unlock(); return counts[id] }
}

// runSchedule runs loop l's rounds as its loop would for d of clock's
// time, and fails the test if a wait is not within (0, interval].
func runSchedule(t *testing.T, p *Poller, clock *fakeClock, l Loop, d time.Duration) {
	t.Helper()
	ctx := context.Background()
	for end := clock.Now().Add(d); clock.Now().Before(end); {
		p.round(ctx, l, true)
		w := p.untilDue(l)
		if w <= 0 || w > p.interval(l) {
			t.Fatalf("at %v: next %s round in %v, want within (0, %v]", clock.Now(), l, w, p.interval(l))
		}
		clock.Advance(w)
	}
}

// step advances clock to when loop l's next unit is due and runs that
// round, as the loop would.
func step(t *testing.T, p *Poller, clock *fakeClock, l Loop) {
	t.Helper()
	w := p.untilDue(l)
	if w <= 0 || w > p.interval(l) {
		t.Fatalf("at %v: next %s round in %v, want within (0, %v]", clock.Now(), l, w, p.interval(l))
	}
	clock.Advance(w)
	p.round(context.Background(), l, true)
}

// A service whose network status keeps failing backs off on its own
// clock; the other services keep the loop's interval. Ten minutes of the
// status loop's schedule, on a fake clock.
func TestPollerStatusBackoffPerService(t *testing.T) {
	sim, c, requests := failingService(t, 104, "/api/networkstatus/errors/", "/api/networkstatus/inactive/")
	clock := newFakeClock()
	p, err := NewPoller(c, pollConfig(func(c *PollConfig) {
		c.Services = []int{101, 104}
		c.NetworkStatus = 30 * time.Second
		c.Jitter = 0
		c.Now = clock.Now
	}), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := p.PollOnce(ctx, LoopAccount); err != nil {
		t.Fatal(err)
	}
	runSchedule(t, p, clock, LoopStatus, 10*time.Minute)
	// 101 every 30s: 20 polls. 104 at 0s and then after 5s, 10s, 20s, …,
	// 320s (the next try, 640s later, is past the 10m): 7 polls.
	if n := requests(101); n != 20 {
		t.Errorf("service 101 polled %d times in 10m, want 20 (every network_status interval)", n)
	}
	if n := requests(104); n != 7 {
		t.Errorf("failing service 104 polled %d times in 10m, want 7 (its own backoff)", n)
	}
	// And a new errored IP of 101 is seen within one interval.
	sim.MarkErrored(101, "10.0.0.1")
	runSchedule(t, p, clock, LoopStatus, 30*time.Second)
	if st := serviceByID(p.Snapshot(), 101); !slices.Equal(st.Errored, []string{"10.0.0.1"}) {
		t.Errorf("service 101 errored %v one interval after the provider listed 10.0.0.1", st.Errored)
	}
}

// When only the inactive list of a service fails, its errored list keeps
// the network_status interval and, from a fresh start, is known (for the
// daemon to apply) on its own. Ten minutes of the status loop, on a fake
// clock.
func TestPollerStatusListsOwnClocks(t *testing.T) {
	sim := providersim.New(providersim.Config{})
	clock := newFakeClock()
	const errored101, inactive101 = "/api/networkstatus/errors/101", "/api/networkstatus/inactive/101"
	c, requests := countPaths(t, sim, clock, func(path string) bool { return path == inactive101 },
		errored101, inactive101, "/api/networkstatus/errors/102")
	p, err := NewPoller(c, pollConfig(func(c *PollConfig) {
		c.Services = []int{101, 102}
		c.NetworkStatus, c.Jitter, c.Now = 30*time.Second, 0, clock.Now
	}), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.PollOnce(context.Background(), LoopAccount); err != nil {
		t.Fatal(err)
	}
	sim.MarkErrored(101, "10.0.0.1")
	runSchedule(t, p, clock, LoopStatus, 10*time.Minute)
	// Errored lists every 30s: 20 polls each; 101's inactive list at 0s,
	// then after 5s, 10s, 20s, …, 320s: 7.
	if e1, e2, i1 := len(requests(errored101)), len(requests("/api/networkstatus/errors/102")), len(requests(inactive101)); e1 != 20 || e2 != 20 || i1 != 7 {
		t.Errorf("in 10m: errored 101 %d (want 20), errored 102 %d (want 20), inactive 101 %d (want 7, its own backoff)", e1, e2, i1)
	}
	st := serviceByID(p.Snapshot(), 101)
	if !st.ErroredKnown || st.InactiveKnown || st.StatusKnown() || !slices.Equal(st.Errored, []string{"10.0.0.1"}) {
		t.Errorf("service 101: errored known %v %v, inactive known %v, status known %v; want the errored list known alone",
			st.ErroredKnown, st.Errored, st.InactiveKnown, st.StatusKnown())
	}
	if st := serviceByID(p.Snapshot(), 102); !st.ErroredKnown || !st.InactiveKnown || !st.StatusKnown() {
		t.Errorf("service 102: errored known %v, inactive known %v, status known %v; want all", st.ErroredKnown, st.InactiveKnown, st.StatusKnown())
	}
}

// The same through Run: while service 104's status fails and backs off,
// a new errored IP of service 101 is seen within network_status.
func TestPollerRunStatusBackoffPerService(t *testing.T) {
	sim, c, requests := failingService(t, 104, "/api/networkstatus/errors/", "/api/networkstatus/inactive/")
	p, err := NewPoller(c, pollConfig(func(c *PollConfig) {
		c.Services = []int{101, 104}
		c.NetworkStatus = time.Second
		c.Jitter = 0
	}), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); p.Run(ctx) }()
	defer func() { cancel(); <-done }()
	// After 3 failures in a row the next try of 104 is 4s away.
	waitUntil(t, 10*time.Second, "service 104 was not polled 3 times", func() bool { return requests(104) >= 3 })
	sim.MarkErrored(101, "10.0.0.1")
	waitUntil(t, 2*time.Second, "service 101's new errored IP not seen within 2s (network_status 1s)", func() bool {
		st := serviceByID(p.Snapshot(), 101)
		return st != nil && len(st.Errored) > 0
	})
}

// An empty rate answer leaves the service without figures: the last ones
// are not kept (a quota they reached would never lift), and the state says
// it was read, unlike a service not read yet.
func TestPollerEmptyRateClearsUsage(t *testing.T) {
	p, sim, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) { c.Services = []int{102} }))
	pollAll(t, p)
	st := serviceByID(p.Snapshot(), 102)
	if st == nil || !st.HasUsage || st.UsageEmpty || st.Limit != 1024 {
		t.Fatalf("usage before: %+v", st)
	}
	sim.ClearUsage(102)
	if err := p.PollOnce(context.Background(), LoopUsage); err != nil {
		t.Fatal(err)
	}
	st = serviceByID(p.Snapshot(), 102)
	if st.HasUsage || !st.UsageEmpty || st.Rate != 0 || st.Limit != 0 {
		t.Errorf("after an empty answer: has %v, empty %v, rate %g of %g", st.HasUsage, st.UsageEmpty, st.Rate, st.Limit)
	}
	sim.SetUsage(102, 10, 100)
	if err := p.PollOnce(context.Background(), LoopUsage); err != nil {
		t.Fatal(err)
	}
	if st = serviceByID(p.Snapshot(), 102); !st.HasUsage || st.UsageEmpty || st.Rate != 10 || st.Limit != 100 {
		t.Errorf("figures again: %+v", st)
	}
}

// A ppr service that becomes another product loses its figures with the
// account round that says so: its rate is no longer read, and the last
// one would otherwise hold a quota on it for good.
func TestPollerServiceNoLongerPPRClearsUsage(t *testing.T) {
	p, sim, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) { c.Services = []int{102} }))
	pollAll(t, p)
	if st := serviceByID(p.Snapshot(), 102); st == nil || !st.HasUsage || st.Limit != 1024 {
		t.Fatalf("usage before: %+v", st)
	}
	sim.SetProductType(102, "fpr")
	if err := p.PollOnce(context.Background(), LoopAccount); err != nil {
		t.Fatal(err)
	}
	st := serviceByID(p.Snapshot(), 102)
	if st.Record.ProductType != "fpr" || st.HasUsage || !st.UsageEmpty || st.Rate != 0 || st.Limit != 0 {
		t.Errorf("after it became fpr: type %q, has %v, empty %v, rate %g of %g",
			st.Record.ProductType, st.HasUsage, st.UsageEmpty, st.Rate, st.Limit)
	}
}

// A ppr service whose sticky list the provider refuses (422 with its
// message, as PROVIDER_API lists for the sticky list) is served from its
// lists as plain rotating upstreams, not held back for ever.
func TestPollerStickyRefusedServesListEntries(t *testing.T) {
	for _, status := range []int{http.StatusUnprocessableEntity, http.StatusOK} {
		t.Run(strconv.Itoa(status), func(t *testing.T) { stickyRefused(t, status) })
	}
}

// stickyRefused: the sticky list refused with status; a 200 says it beside
// an empty list.
func stickyRefused(t *testing.T, status int) {
	sim := providersim.New(providersim.Config{})
	c := interceptClient(t, sim, 5*time.Second, func(w http.ResponseWriter, r *http.Request) bool {
		if !strings.HasPrefix(r.URL.Path, "/api/sticky/list/") {
			return false
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		if status == http.StatusOK {
			_, _ = io.WriteString(w, `{"data":[],"error":"Sticky sessions are not enabled for this service"}`)
		} else {
			_, _ = io.WriteString(w, `{"error":"Sticky sessions are not enabled for this service"}`)
		}
		return true
	})
	p, err := NewPoller(c, pollConfig(func(c *PollConfig) { c.Services, c.LookupHost = []int{102}, sim.LookupHost }), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := p.PollOnce(ctx, LoopAccount); err != nil {
		t.Fatal(err)
	}
	if err := p.PollOnce(ctx, LoopLists); err != nil {
		t.Errorf("lists round: %v", err)
	}
	st := serviceByID(p.Snapshot(), 102)
	ups := st.Upstreams()
	if !st.ListsKnown || len(ups) == 0 {
		t.Fatalf("known %v, %d upstreams: the service is not served", st.ListsKnown, len(ups))
	}
	for _, u := range ups {
		if u.Session != "" {
			t.Errorf("upstream %+v stands for a session, but none was listed", u)
		}
	}
}

// holdOnce answers the first request whose path starts with prefix, once
// armed, as the simulator answered it when it came, but only after
// release is closed; arrived says it came. Other requests go through.
type holdOnce struct {
	prefix  string
	armed   atomic.Bool
	once    sync.Once
	arrived chan struct{}
	release chan struct{}
}

func newHoldOnce(prefix string) *holdOnce {
	return &holdOnce{prefix: prefix, arrived: make(chan struct{}, 1), release: make(chan struct{})}
}

func (h *holdOnce) intercept(sim *providersim.Sim) func(http.ResponseWriter, *http.Request) bool {
	return func(w http.ResponseWriter, r *http.Request) bool {
		if !h.armed.Load() || !strings.HasPrefix(r.URL.Path, h.prefix) {
			return false
		}
		held := false
		h.once.Do(func() { held = true })
		if !held {
			return false
		}
		rec := httptest.NewRecorder()
		sim.ServeHTTP(rec, r) // the answer as it was when asked
		h.arrived <- struct{}{}
		<-h.release
		w.WriteHeader(rec.Code)
		w.Write(rec.Body.Bytes())
		return true
	}
}

func (h *holdOnce) await(t *testing.T) {
	t.Helper()
	select {
	case <-h.arrived:
	case <-time.After(5 * time.Second):
		t.Fatalf("no request to %s within 5s", h.prefix)
	}
}

// A regular lists round that answers after a list update's own poll took
// the new list does not put the old one back (it began before).
func TestPollerLateListsRoundKeepsNewerList(t *testing.T) {
	sim := providersim.New(providersim.Config{})
	hold := newHoldOnce("/api/iplist/http-auth/")
	c := interceptClient(t, sim, 5*time.Second, hold.intercept(sim))
	p, err := NewPoller(c, pollConfig(func(c *PollConfig) { c.Services, c.Draws = []int{101}, drawn("http") }), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	pollAll(t, p)
	hold.armed.Store(true)
	round := make(chan error, 1)
	go func() { round <- p.PollOnce(ctx, LoopLists) }()
	hold.await(t) // the round has the old list in hand
	fresh := []providersim.Entry{{Host: "10.0.9.1", Port: 8080, Login: "u", Password: "p"},
		{Host: "10.0.9.2", Port: 8080, Login: "u", Password: "p"}, {Host: "10.0.9.3", Port: 8080, Login: "u", Password: "p"}}
	sim.SetEntries(101, "http-auth", fresh) // the provider replaced the list
	p.pollNewList(ctx, 101)
	close(hold.release)
	if err := <-round; err != nil {
		t.Fatal(err)
	}
	if got := serviceByID(p.Snapshot(), 101).Lists["http-auth"]; len(got) != 3 || got[0].Host != "10.0.9.1" {
		t.Errorf("after the late round: %+v, want the new list", got)
	}
}

// Nor does a lists round that answers after a rotation put the session's
// old exit IP back.
func TestPollerLateStickyListKeepsRotation(t *testing.T) {
	sim := providersim.New(providersim.Config{})
	hold := newHoldOnce("/api/sticky/list/")
	c := interceptClient(t, sim, 5*time.Second, hold.intercept(sim))
	p, err := NewPoller(c, pollConfig(func(c *PollConfig) { c.Services, c.LookupHost = []int{102}, sim.LookupHost }), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	pollAll(t, p)
	sessions := serviceByID(p.Snapshot(), 102).Sticky
	if len(sessions) == 0 {
		t.Fatal("no sticky sessions to rotate")
	}
	s0 := sessions[0]
	hold.armed.Store(true)
	round := make(chan error, 1)
	go func() { round <- p.PollOnce(ctx, LoopLists) }()
	hold.await(t) // the round has the sessions as they were
	ip, err := p.Rotate(ctx, 102, s0.Server, s0.Session)
	if err != nil || ip == "" || ip == s0.ExitIP {
		t.Fatalf("rotation: %q, %v (was %s)", ip, err, s0.ExitIP)
	}
	close(hold.release)
	if err := <-round; err != nil {
		t.Fatal(err)
	}
	for _, s := range serviceByID(p.Snapshot(), 102).Sticky {
		if s.Server == s0.Server && s.Session == s0.Session && s.ExitIP != ip {
			t.Errorf("session %s after the late round: exit %s, want the rotated %s", s.Session, s.ExitIP, ip)
		}
	}
}

// A rotation of a session the poller knows from no list (the daemon
// serves it from its state file, and rotates it) does not make the first
// sticky list, asked for before it, stale: that list is taken, and the
// service is not known without its sessions.
func TestPollerRotationBeforeFirstStickyList(t *testing.T) {
	sim := providersim.New(providersim.Config{})
	hold := newHoldOnce("/api/sticky/list/")
	c := interceptClient(t, sim, 5*time.Second, hold.intercept(sim))
	p, err := NewPoller(c, pollConfig(func(c *PollConfig) { c.Services, c.LookupHost = []int{102}, sim.LookupHost }), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := p.PollOnce(ctx, LoopAccount); err != nil {
		t.Fatal(err)
	}
	s0 := sim.Sessions(102)[0]
	hold.armed.Store(true)
	round := make(chan error, 1)
	go func() { round <- p.PollOnce(ctx, LoopLists) }()
	hold.await(t)
	if _, err := p.Rotate(ctx, 102, s0.Server, s0.Session); err != nil {
		t.Fatal(err)
	}
	close(hold.release)
	if err := <-round; err != nil {
		t.Fatal(err)
	}
	if st := serviceByID(p.Snapshot(), 102); !st.ListsKnown || len(st.Sticky) == 0 {
		t.Errorf("known %v with %d sessions: the first sticky list was not taken", st.ListsKnown, len(st.Sticky))
	}
}

// OlderRounds says whether a round begun before the last Reconfigure
// still runs (with its old client, whose timeout the daemon's watchdog
// must still allow for).
func TestPollerOlderRounds(t *testing.T) {
	sim := providersim.New(providersim.Config{})
	hold := newHoldOnce("/api/services")
	c := interceptClient(t, sim, 5*time.Second, hold.intercept(sim))
	cfg := pollConfig(func(c *PollConfig) { c.Services = []int{101} })
	p, err := NewPoller(c, cfg, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	hold.armed.Store(true)
	round := make(chan error, 1)
	go func() { round <- p.PollOnce(context.Background(), LoopAccount) }()
	hold.await(t)
	if p.OlderRounds() {
		t.Error("a round of the current generation counts as older")
	}
	if err := p.Reconfigure(c, cfg, false); err != nil {
		t.Fatal(err)
	}
	if !p.OlderRounds() {
		t.Error("the round begun before Reconfigure does not count as older")
	}
	close(hold.release)
	<-round
	if p.OlderRounds() {
		t.Error("an older round that ended still counts")
	}
}

// A usage round that asked for the rate before the account round said the
// service is no ppr any more does not bring the figures back when its
// answer comes after.
func TestPollerLateRateOfServiceNoLongerPPR(t *testing.T) {
	sim := providersim.New(providersim.Config{})
	gate, asked := make(chan struct{}), make(chan struct{}, 1)
	c := interceptClient(t, sim, 5*time.Second, func(w http.ResponseWriter, r *http.Request) bool {
		if !strings.Contains(r.URL.Path, "/rate/") {
			return false
		}
		rec := httptest.NewRecorder()
		sim.ServeHTTP(rec, r) // the answer as it was when asked
		asked <- struct{}{}
		<-gate
		w.WriteHeader(rec.Code)
		w.Write(rec.Body.Bytes())
		return true
	})
	p, err := NewPoller(c, pollConfig(func(c *PollConfig) { c.Services = []int{102} }), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := p.PollOnce(ctx, LoopAccount); err != nil {
		t.Fatal(err)
	}
	usage := make(chan error, 1)
	go func() { usage <- p.PollOnce(ctx, LoopUsage) }()
	select {
	case <-asked:
	case <-time.After(5 * time.Second):
		t.Fatal("the usage round did not ask for the rate within 5s")
	}
	sim.SetProductType(102, "fpr")
	if err := p.PollOnce(ctx, LoopAccount); err != nil {
		t.Fatal(err)
	}
	close(gate)
	if err := <-usage; err != nil {
		t.Fatal(err)
	}
	if st := serviceByID(p.Snapshot(), 102); st.HasUsage || !st.UsageEmpty {
		t.Errorf("a late rate answer of a service no longer ppr: has %v, empty %v, rate %g of %g", st.HasUsage, st.UsageEmpty, st.Rate, st.Limit)
	}
}

// The usage loop likewise: service 104's failing rate backs off alone and
// service 102's rate is read every usage interval. Kick polls every
// service at once, the one backing off included.
func TestPollerUsageBackoffPerService(t *testing.T) {
	sim, c, requests := failingService(t, 104, "/api/rate/")
	clock := newFakeClock()
	p, err := NewPoller(c, pollConfig(func(c *PollConfig) {
		c.Services = []int{101, 102, 104}
		c.Usage = time.Minute
		c.Jitter = 0
		c.Now = clock.Now
	}), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := p.PollOnce(ctx, LoopAccount); err != nil {
		t.Fatal(err)
	}
	runSchedule(t, p, clock, LoopUsage, 10*time.Minute)
	// 102 every minute: 10 polls; 104 at 0s, 5s, 15s, 35s, 75s, 155s,
	// 315s: 7; fpr service 101 has no rate.
	if n, m, f := requests(102), requests(104), requests(101); n != 10 || m != 7 || f != 0 {
		t.Errorf("rate requests in 10m: 102 %d (want 10), 104 %d (want 7), 101 %d (want 0)", n, m, f)
	}
	sim.SetUsage(102, 900, 1000)
	runSchedule(t, p, clock, LoopUsage, time.Minute)
	if st := serviceByID(p.Snapshot(), 102); st.Rate != 900 || st.Limit != 1000 {
		t.Errorf("service 102 usage %v/%v one interval after it changed, want 900/1000", st.Rate, st.Limit)
	}
	before := requests(104)
	p.Kick(LoopUsage)
	if ids := p.pollable(LoopUsage, true); !slices.Equal(ids, []unit{{service: 102}, {service: 104}}) {
		t.Errorf("due after Kick: %v, want [102 104]", ids)
	}
	p.round(ctx, LoopUsage, true)
	if requests(104) != before+1 {
		t.Error("Kick did not poll the service backing off")
	}
}

// A first empty answer awaits confirmation but does not hold back the
// service's lists that came with entries: a ppr service without sticky
// sessions and an fpr service with an empty socks-ip list are served
// after their first lists round.
func TestPollerFirstEmptyListDoesNotHoldBackSiblings(t *testing.T) {
	p, sim, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) { c.Services = []int{101, 104} }))
	sim.SetEntries(101, "socks-ip", nil)
	ctx := context.Background()
	for _, l := range []Loop{LoopAccount, LoopLists} {
		if err := p.PollOnce(ctx, l); err != nil {
			t.Fatal(err)
		}
	}
	s := p.Snapshot()
	if st := serviceByID(s, 104); !st.ListsKnown || len(st.Lists["ppr-http"]) == 0 || len(st.Sticky) != 0 {
		t.Errorf("ppr 104 without sessions: known %v, ppr-http %d entries, sticky %d; want known with its entries",
			st.ListsKnown, len(st.Lists["ppr-http"]), len(st.Sticky))
	}
	if st := serviceByID(s, 101); !st.ListsKnown || len(st.Lists["http-auth"]) == 0 || len(st.Lists["socks-ip"]) != 0 {
		t.Errorf("fpr 101 with an empty socks-ip list: known %v, http-auth %d entries, socks-ip %d; want known",
			st.ListsKnown, len(st.Lists["http-auth"]), len(st.Lists["socks-ip"]))
	}
	// confirmWait(10m) is 10s, 11s with the jitter.
	if w := p.untilDue(LoopLists); w > 11*time.Second {
		t.Errorf("the empty lists await confirmation, but the next lists poll is %v away", w)
	}
	if err := p.PollOnce(ctx, LoopLists); err != nil {
		t.Fatal(err)
	}
	if w := p.untilDue(LoopLists); w < 9*time.Minute {
		t.Errorf("the empty lists are still awaiting confirmation after the second round: next poll %v away", w)
	}
}

// countPaths serves sim, counting the requests whose path starts with
// each of prefixes at the times clock gives, and failing with 500 those
// for which fail (if set) says so.
func countPaths(t *testing.T, sim *providersim.Sim, clock *fakeClock, fail func(path string) bool, prefixes ...string) (*Client, func(prefix string) []time.Duration) {
	t.Helper()
	start := clock.Now()
	var mu sync.Mutex
	seen := map[string][]time.Duration{}
	c := interceptClient(t, sim, 5*time.Second, func(w http.ResponseWriter, r *http.Request) bool {
		for _, prefix := range prefixes {
			if strings.HasPrefix(r.URL.Path, prefix) {
				mu.Lock()
				seen[prefix] = append(seen[prefix], clock.Now().Sub(start))
				mu.Unlock()
			}
		}
		if fail != nil && fail(r.URL.Path) {
			w.WriteHeader(http.StatusInternalServerError)
			return true
		}
		return false
	})
	return c, func(prefix string) []time.Duration { mu.Lock(); defer mu.Unlock(); return slices.Clone(seen[prefix]) }
}

// A list that is empty on its first answer, with nothing older to keep,
// is confirmed soon: its service alone is polled again after a tenth of
// ip_list. An empty sticky list where the saved state had sessions is a
// shrink: it is confirmed only by the next regular poll, an ip_list
// later. On a fake clock.
func TestPollerConfirmsFirstEmptyListSoon(t *testing.T) {
	cfg := pollConfig(func(c *PollConfig) {
		c.Services = []int{101, 104} // 104: ppr without sticky sessions
		c.IPList, c.Jitter = 5*time.Second, 0
	})
	newPoller := func() (*Poller, *fakeClock, func(string) []time.Duration) {
		sim := providersim.New(providersim.Config{})
		clock := newFakeClock()
		c, requests := countPaths(t, sim, clock, nil, "/api/sticky/list/104", "/api/iplist/http-auth/json/101")
		cfg.LookupHost, cfg.Now = sim.LookupHost, clock.Now
		p, err := NewPoller(c, cfg, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.PollOnce(context.Background(), LoopAccount); err != nil {
			t.Fatal(err)
		}
		return p, clock, requests
	}

	p, clock, requests := newPoller()
	runSchedule(t, p, clock, LoopLists, 6*time.Second)
	// 104 at 0s, 0.5s (confirmWait) and 5.5s; 101 at 0s and 5s only.
	if got, want := requests("/api/sticky/list/104"), []time.Duration{0, 500 * time.Millisecond, 5500 * time.Millisecond}; !slices.Equal(got, want) {
		t.Errorf("service 104's sticky list polled at %v, want %v", got, want)
	}
	if got, want := requests("/api/iplist/http-auth/json/101"), []time.Duration{0, 5 * time.Second}; !slices.Equal(got, want) {
		t.Errorf("service 101's list polled at %v, want %v (not brought forward with 104)", got, want)
	}
	p.mu.Lock()
	n, confirmed := p.lastGood["104/sticky"]
	p.mu.Unlock()
	if !confirmed || n != 0 || !serviceByID(p.Snapshot(), 104).ListsKnown {
		t.Errorf("the empty sticky list of 104 is not confirmed (%v, %d) or the service not known", confirmed, n)
	}

	q, clock, requests := newPoller()
	q.Seed(restored(104, "ppr", "http", 2, true))
	q.round(context.Background(), LoopLists, true) // at 0s
	if serviceByID(q.Snapshot(), 104).ListsKnown {
		t.Fatal("an empty sticky list replaced the saved sessions without confirmation")
	}
	if w := q.untilDue(LoopLists); w != 5*time.Second {
		t.Errorf("a shrink against the saved state's sessions is polled again after %v, want 5s (ip_list)", w)
	}
	step(t, q, clock, LoopLists) // at 5s
	if !serviceByID(q.Snapshot(), 104).ListsKnown {
		t.Error("the empty sticky list was not confirmed by the poll one ip_list later")
	}
}

// A far smaller list is not confirmed by a poll that comes sooner than
// ip_list: neither one a Kick brings forward nor the service's backoff
// retries while another of its lists fails. On a fake clock.
func TestPollerShrinkNotConfirmedEarly(t *testing.T) {
	sim := providersim.New(providersim.Config{})
	ten := httpEntries(10)
	one := ten[:1]
	clock := newFakeClock()
	var failSocks atomic.Bool
	c, requests := countPaths(t, sim, clock, func(path string) bool {
		return failSocks.Load() && strings.HasPrefix(path, "/api/iplist/socks-ip/")
	}, "/api/iplist/http-auth/")
	p, err := NewPoller(c, pollConfig(func(c *PollConfig) {
		c.Services = []int{101}
		c.IPList, c.MaxBackoff, c.Jitter, c.Now = time.Minute, 10*time.Minute, 0, clock.Now
	}), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	entries := func() int { return len(serviceByID(p.Snapshot(), 101).Lists["http-auth"]) }
	sim.SetEntries(101, "http-auth", ten)
	pollAccountAndLists(t, p)

	// Kicked 1s after the round that brought the small list.
	sim.SetEntries(101, "http-auth", one)
	step(t, p, clock, LoopLists) // at 1m
	clock.Advance(time.Second)
	p.Kick(LoopLists)
	p.round(ctx, LoopLists, true)
	if n := entries(); n != 10 {
		t.Fatalf("a kicked poll 1s after the shrink confirmed it: %d entries", n)
	}
	step(t, p, clock, LoopLists) // at 2m1s
	if n := entries(); n != 1 {
		t.Fatalf("the poll one ip_list later did not confirm the shrink: %d entries", n)
	}

	// The list grows back (no confirmation needed), then shrinks while
	// socks-ip fails: the service retries at 5s, 15s, 35s, 75s.
	sim.SetEntries(101, "http-auth", ten)
	step(t, p, clock, LoopLists) // at 3m1s
	if n := entries(); n != 10 {
		t.Fatalf("the grown list was not swapped in: %d entries", n)
	}
	sim.SetEntries(101, "http-auth", one)
	failSocks.Store(true)
	before := len(requests("/api/iplist/http-auth/"))
	for range 4 { // 4m1s, 4m6s, 4m16s, 4m36s
		step(t, p, clock, LoopLists)
	}
	if got := len(requests("/api/iplist/http-auth/")) - before; got != 4 {
		t.Errorf("%d polls of the list while socks-ip failed, want 4", got)
	}
	if n := entries(); n != 10 {
		t.Fatalf("a backoff retry confirmed the shrink: %d entries", n)
	}
	step(t, p, clock, LoopLists) // 5m16s
	if n := entries(); n != 1 {
		t.Errorf("the retry past one ip_list did not confirm the shrink: %d entries", n)
	}
}

// A shrink that holds over a regular poll is confirmed though its size
// moved meanwhile (a sticky session list's does, with the sessions'
// TTLs), with the latest size; an empty answer after a small one is
// another claim and waits from its own poll.
func TestPollerShrinkOfMovingSizeConfirmed(t *testing.T) {
	sim := providersim.New(providersim.Config{})
	ten := httpEntries(10)
	clock := newFakeClock()
	c, _ := countPaths(t, sim, clock, func(string) bool { return false }, "/api/iplist/http-auth/")
	p, err := NewPoller(c, pollConfig(func(c *PollConfig) {
		c.Services, c.Draws = []int{101}, drawn("http")
		c.IPList, c.Jitter, c.Now = time.Minute, 0, clock.Now
	}), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	entries := func() int { return len(serviceByID(p.Snapshot(), 101).Lists["http-auth"]) }
	sim.SetEntries(101, "http-auth", ten)
	pollAccountAndLists(t, p)
	sim.SetEntries(101, "http-auth", ten[:2])
	step(t, p, clock, LoopLists) // 1m: far smaller, held
	if n := entries(); n != 10 {
		t.Fatalf("a first shrink was swapped in: %d entries", n)
	}
	sim.SetEntries(101, "http-auth", ten[:3])
	step(t, p, clock, LoopLists) // 2m: far smaller again, another size
	if n := entries(); n != 3 {
		t.Fatalf("a shrink that held for an ip_list was not confirmed: %d entries, want the latest 3", n)
	}
	sim.SetEntries(101, "http-auth", ten)
	step(t, p, clock, LoopLists) // 3m: grown back
	sim.SetEntries(101, "http-auth", ten[:2])
	step(t, p, clock, LoopLists) // 4m: far smaller, held
	sim.SetEntries(101, "http-auth", nil)
	step(t, p, clock, LoopLists) // 5m: empty: a claim of its own
	if n := entries(); n != 10 {
		t.Fatalf("an empty answer confirmed a small one's claim: %d entries", n)
	}
	step(t, p, clock, LoopLists) // 6m: empty again
	if n := entries(); n != 0 {
		t.Errorf("the empty list held for an ip_list was not confirmed: %d entries", n)
	}
}

// An empty service list is not polled again early, and not confirmed by a
// poll a Kick (a reload, a service joining) brings forward: only by the
// next regular one, an account interval later.
func TestPollerServiceListShrinkConfirmedOnlyAtInterval(t *testing.T) {
	sim := providersim.New(providersim.Config{})
	clock := newFakeClock()
	var empty atomic.Bool
	c := interceptClient(t, sim, 5*time.Second, func(w http.ResponseWriter, r *http.Request) bool {
		if empty.Load() && r.URL.Path == "/api/services" {
			io.WriteString(w, "[]")
			return true
		}
		return false
	})
	p, err := NewPoller(c, pollConfig(func(c *PollConfig) { c.Jitter, c.Now = 0, clock.Now }), nil, nil) // account 15m
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := p.PollOnce(ctx, LoopAccount); err != nil {
		t.Fatal(err)
	}
	served := func() int { return len(p.Snapshot().Services) }
	if served() != 3 {
		t.Fatalf("%d services, want 3", served())
	}
	empty.Store(true)
	step(t, p, clock, LoopAccount) // 15m
	if w := p.untilDue(LoopAccount); w != 15*time.Minute {
		t.Errorf("after an empty service list the next account poll is %v away, want 15m", w)
	}
	clock.Advance(10 * time.Second)
	p.Kick(LoopAccount)
	p.round(ctx, LoopAccount, true)
	if served() != 3 {
		t.Fatalf("a kicked poll 10s after an empty service list dropped the services: %d left", served())
	}
	step(t, p, clock, LoopAccount) // 30m10s
	if served() != 0 {
		t.Errorf("the empty list, again an account interval later, must drop them: %d left", served())
	}
}

// A first empty service list, with no last good size in this process
// (no Seed), is still confirmed only by the next regular poll: the
// daemon's saved pool stands behind it, unlike a service's first empty
// IP list, which any later poll confirms.
func TestPollerFirstEmptyServiceListConfirmedOnlyAtInterval(t *testing.T) {
	clock := newFakeClock()
	p, sim, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) { c.Now = clock.Now })) // account 15m, jitter 0.1
	ctx := context.Background()
	confirmed := func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		_, ok := p.lastGood[serviceListKey]
		return ok
	}
	for _, after := range []time.Duration{0, 10 * time.Second} {
		clock.Advance(after)
		sim.FailNext(1, 200, "[]")
		if err := p.PollOnce(ctx, LoopAccount); err != nil {
			t.Fatal(err)
		}
		if confirmed() {
			t.Fatalf("a first empty service list was confirmed by a poll %v after it came", after)
		}
	}
	clock.Advance(15 * time.Minute)
	sim.FailNext(1, 200, "[]")
	if err := p.PollOnce(ctx, LoopAccount); err != nil {
		t.Fatal(err)
	}
	if !confirmed() {
		t.Error("the empty service list, again an account interval later, was not confirmed")
	}
}

// The lists loop, too, backs off a failing service alone: service 102's
// sticky list answers a 422 (a failure the API documents for endpoint
// 17), and service 101's lists keep ip_list. An hour of the loop's
// schedule, on a fake clock.
func TestPollerListsBackoffPerService(t *testing.T) {
	sim := providersim.New(providersim.Config{})
	var mu sync.Mutex
	lists := map[int]int{} // IP list requests by service
	c := interceptClient(t, sim, 5*time.Second, func(w http.ResponseWriter, r *http.Request) bool {
		if r.URL.Path == "/api/sticky/list/102" {
			// A failure that may pass (a 422 would say the service has
			// no sessions, which is no failure of the round).
			w.WriteHeader(http.StatusInternalServerError)
			io.WriteString(w, `{"error":"sticky sessions unavailable"}`)
			return true
		}
		if strings.HasPrefix(r.URL.Path, "/api/iplist/") {
			id, _ := strconv.Atoi(r.URL.Path[strings.LastIndex(r.URL.Path, "/")+1:])
			mu.Lock()
			lists[id]++
			mu.Unlock()
		}
		return false
	})
	clock := newFakeClock()
	p, err := NewPoller(c, pollConfig(func(c *PollConfig) {
		c.Services = []int{101, 102}
		c.IPList, c.MaxBackoff, c.Jitter = 10*time.Minute, 10*time.Minute, 0
		c.LookupHost, c.Now = sim.LookupHost, clock.Now
	}), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.PollOnce(context.Background(), LoopAccount); err != nil {
		t.Fatal(err)
	}
	runSchedule(t, p, clock, LoopLists, time.Hour)
	// 101 every 10m: 6 rounds of 2 lists. 102 at 0s, then after 5s, 10s,
	// 20s, …, 320s and 600s (max_backoff) until 3035s: 12 rounds of 2.
	mu.Lock()
	defer mu.Unlock()
	if lists[101] != 6*2 || lists[102] != 12*2 {
		t.Errorf("IP list requests in 1h: 101 %d (want 12, every ip_list), 102 %d (want 24, its own backoff)", lists[101], lists[102])
	}
	if st := serviceByID(p.Snapshot(), 101); !st.ListsKnown {
		t.Error("service 101's lists are not known")
	}
}

// A 429 waits at least until the time it names, though Kick (every
// reload, a service joining) wakes the loop: in the usage loop service
// 104's rate, in the account loop the service list. On a fake clock.
func TestPollerKickKeepsRateLimitWait(t *testing.T) {
	sim := providersim.New(providersim.Config{})
	clock := newFakeClock()
	var limited atomic.Bool
	tooMany := func(path string) bool {
		return path == "/api/rate/104" || limited.Load() && path == "/api/services"
	}
	c := interceptClient(t, sim, 5*time.Second, func(w http.ResponseWriter, r *http.Request) bool {
		if tooMany(r.URL.Path) {
			w.WriteHeader(http.StatusTooManyRequests)
			io.WriteString(w, `{"error":"Too Many Attempts. Next update possible: 2026-11-21 10:30:00"}`)
			return true
		}
		return false
	})
	cfg := pollConfig(func(c *PollConfig) { c.Services = []int{102, 104}; c.Jitter = 0; c.Now = clock.Now })
	p, err := NewPoller(c, cfg, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := p.PollOnce(ctx, LoopAccount); err != nil {
		t.Fatal(err)
	}
	p.round(ctx, LoopUsage, true) // 104: 429 until 10:30
	limited.Store(true)
	clock.Advance(15 * time.Minute)
	p.round(ctx, LoopAccount, true) // 10:15: 429 until 10:30
	rates, services := sim.Requests(RouteRate), sim.Requests(RouteServices)

	clock.Advance(time.Minute)
	if err := p.Reconfigure(c, cfg, false); err != nil { // kicks every loop
		t.Fatal(err)
	}
	if got, want := p.pollable(LoopUsage, true), []unit{{service: 102}}; !slices.Equal(got, want) {
		t.Errorf("due in the usage loop after Kick: %v, want %v (104 waits for 10:30)", got, want)
	}
	p.round(ctx, LoopUsage, true)
	p.round(ctx, LoopAccount, true)
	if got := sim.Requests(RouteRate) - rates; got != 1 {
		t.Errorf("%d rate requests after Kick, want 1 (102's)", got)
	}
	if got := sim.Requests(RouteServices) - services; got != 0 {
		t.Errorf("the service list was polled after Kick, before the 429's time")
	}
	if w := p.untilDue(LoopAccount); w != 14*time.Minute {
		t.Errorf("next account round in %v, want 14m (10:30)", w)
	}

	clock.Advance(14 * time.Minute) // 10:30
	limited.Store(false)
	if got := p.pollable(LoopUsage, true); !slices.Contains(got, unit{service: 104}) {
		t.Errorf("due in the usage loop at the 429's time: %v, want 104 among them", got)
	}
	p.round(ctx, LoopAccount, true)
	if got := sim.Requests(RouteServices) - services; got != 1 {
		t.Errorf("%d service list requests at the 429's time, want 1", got)
	}
}

// Clocks are kept only for the units the loops poll: none for a service
// that left while it was polled, none from a round begun before a
// reload, none for a service no longer served; and a provider change
// clears them all (the new provider owes nothing to the old one's
// backoff or 429).
func TestPollerClocksBounded(t *testing.T) {
	clock := newFakeClock()
	cfg := pollConfig(func(c *PollConfig) { c.Services = []int{101, 102}; c.Now = clock.Now })
	p, _, _ := newPollerForTest(t, cfg)
	ctx := context.Background()
	pollAll(t, p)
	count := func() (n int) {
		p.mu.Lock()
		defer p.mu.Unlock()
		for _, clocks := range p.clocks {
			n += len(clocks)
		}
		return n
	}
	// account 1, lists 2, status 2×2, usage 1 (ppr 102)
	if n := count(); n != 8 {
		t.Fatalf("%d clocks after a round of every loop, want 8", n)
	}
	p.done(ctx, p.startRound(LoopStatus), unit{999, statusErrors}, nil, false)
	if n := count(); n != 8 {
		t.Errorf("%d clocks after a poll of service 999, which is not served, want 8", n)
	}

	// A round begun before a reload keeps nothing of its own outcome, but
	// the same provider's 429 still holds the unit back; a new provider's
	// units owe nothing to the old one's.
	r := p.startRound(LoopUsage)
	client, _, _ := p.current()
	if err := p.Reconfigure(client, cfg, false); err != nil {
		t.Fatal(err)
	}
	p.done(ctx, r, unit{service: 102}, &APIError{Status: 429, NextAllowed: clock.Now().Add(30 * time.Minute)}, false)
	if got := p.pollable(LoopUsage, true); len(got) != 0 {
		t.Errorf("due after a reload and a 429 of the round begun before it: %v, want none until the 429's time", got)
	}
	clock.Advance(30 * time.Minute)
	if got := p.pollable(LoopUsage, true); !slices.Equal(got, []unit{{service: 102}}) {
		t.Errorf("due at the 429's time: %v, want 102", got)
	}
	r = p.startRound(LoopUsage)
	if err := p.Reconfigure(client, cfg, true); err != nil {
		t.Fatal(err)
	}
	p.done(ctx, r, unit{service: 102}, &APIError{Status: 429, NextAllowed: clock.Now().Add(30 * time.Minute)}, false)
	if got := p.pollable(LoopUsage, true); !slices.Equal(got, []unit{{service: 102}}) {
		t.Errorf("due after a provider change: %v, want 102 (the 429 came from the old provider)", got)
	}
	pollAll(t, p)

	cfg.Services = []int{101}
	if err := p.Reconfigure(client, cfg, false); err != nil {
		t.Fatal(err)
	}
	if err := p.PollOnce(ctx, LoopAccount); err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	for l, clocks := range p.clocks {
		for u := range clocks {
			if u.service == 102 {
				t.Errorf("loop %s keeps a clock for service 102, no longer served", Loop(l))
			}
		}
	}
	p.mu.Unlock()

	if err := p.Reconfigure(client, cfg, true); err != nil {
		t.Fatal(err)
	}
	if n := count(); n != 0 {
		t.Errorf("%d clocks after a provider change, want none", n)
	}
}

// PollConfig.Now is the poller's clock: a test outside the package can
// confirm a shrunken list by moving it an interval on.
func TestPollerConfigNow(t *testing.T) {
	clock := newFakeClock()
	p, sim, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) {
		c.Services, c.Draws, c.Now = []int{101}, drawn("http"), clock.Now
	}))
	pollAll(t, p)
	if got := p.Snapshot().Time; !got.Equal(clock.Now()) {
		t.Errorf("snapshot time %v, want the configured clock's %v", got, clock.Now())
	}
	sim.SetEntries(101, "http-auth", nil)
	ctx := context.Background()
	if err := p.PollOnce(ctx, LoopLists); err != nil {
		t.Fatal(err)
	}
	clock.Advance(10 * time.Minute)
	if err := p.PollOnce(ctx, LoopLists); err != nil {
		t.Fatal(err)
	}
	if n := len(serviceByID(p.Snapshot(), 101).Lists["http-auth"]); n != 0 {
		t.Errorf("%d entries: the configured clock did not confirm the empty list an ip_list later", n)
	}
}

// A unit of several requests (a service's lists; the account's services,
// credit and invoices) has one clock: a 429 on a later request of the
// round is honoured although an earlier one failed otherwise.
func TestPollerRateLimitAfterAnotherFailure(t *testing.T) {
	for _, tt := range []struct {
		name          string
		loop          Loop
		first, second string // path prefixes: the first answers 500, the second 429
	}{
		{"lists", LoopLists, "/api/iplist/http-auth/", "/api/iplist/socks-ip/"},
		{"account", LoopAccount, "/api/billing/credit", "/api/billing/invoices"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			clock := newFakeClock()
			sim := providersim.New(providersim.Config{Now: clock.Now})
			var fail atomic.Bool
			var limited, answers, failedAt, limitedAt atomic.Int32 // answers numbers them in order
			c := interceptClient(t, sim, 5*time.Second, func(w http.ResponseWriter, r *http.Request) bool {
				switch {
				case !fail.Load():
					return false
				case strings.HasPrefix(r.URL.Path, tt.first):
					failedAt.Store(answers.Add(1))
					w.WriteHeader(http.StatusInternalServerError)
					return true
				case strings.HasPrefix(r.URL.Path, tt.second):
					limitedAt.Store(answers.Add(1))
					limited.Add(1)
					// On the test's clock (the client reads seconds on the real one).
					w.Header().Set("Retry-After", clock.Now().Add(30*time.Minute).Format(http.TimeFormat))
					w.WriteHeader(http.StatusTooManyRequests)
					_, _ = w.Write([]byte(`{"error":"Too Many Attempts"}`))
					return true
				}
				return false
			})
			p, err := NewPoller(c, pollConfig(func(c *PollConfig) {
				c.Services = []int{101}
				c.Now = clock.Now
			}), nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			pollAll(t, p)
			fail.Store(true)
			clock.Advance(time.Hour) // every unit is due
			_ = p.round(context.Background(), tt.loop, true)
			if limited.Load() != 1 || failedAt.Load() == 0 || failedAt.Load() > limitedAt.Load() {
				t.Fatalf("%d rate-limited answers in the round (the 500 as answer %d, the 429 as %d), want one 429 after the 500",
					limited.Load(), failedAt.Load(), limitedAt.Load())
			}
			for range 29 {
				clock.Advance(time.Minute)
				_ = p.round(context.Background(), tt.loop, true)
			}
			if n := limited.Load() - 1; n != 0 {
				t.Errorf("%d more requests within the 30 minutes the 429 named", n)
			}
			clock.Advance(2 * time.Minute)
			_ = p.round(context.Background(), tt.loop, true)
			if n := limited.Load() - 1; n != 1 {
				t.Errorf("%d more requests once the 429's time passed, want 1", n)
			}
		})
	}
}

// A list type no listener draws any more after a reload leaves the
// service at the next lists round, with its upstreams; a ppr service no
// listener draws loses its sticky sessions too.
func TestPollerDropsListsNoLongerDrawn(t *testing.T) {
	cfg := pollConfig(func(c *PollConfig) { c.Services = []int{101, 102} })
	p, sim, _ := newPollerForTest(t, cfg)
	sessions := sim.Sessions(102)
	for i := range 2 { // four sessions, so that one is "far smaller"
		ss := sessions[i]
		ss.Session += "b"
		sessions = append(sessions, ss)
	}
	sim.SetStickySessions(102, sessions)
	pollAll(t, p)
	st := serviceByID(p.Snapshot(), 101)
	if st == nil || len(st.Lists["http-auth"]) == 0 || len(st.Lists["socks-ip"]) == 0 {
		t.Fatalf("both lists before: %+v", st)
	}
	if st := serviceByID(p.Snapshot(), 102); st == nil || len(st.Sticky) == 0 || len(st.Lists) == 0 {
		t.Fatalf("ppr lists and sessions before: %+v", st)
	}
	cfg.Draws = func(_ int, kind, protocol string) bool { return kind == "fpr" && protocol == "http" }
	if err := p.Reconfigure(p.client, cfg, false); err != nil {
		t.Fatal(err)
	}
	if err := p.PollOnce(context.Background(), LoopLists); err != nil {
		t.Fatal(err)
	}
	st = serviceByID(p.Snapshot(), 101)
	if _, ok := st.Lists["socks-ip"]; ok || len(st.Lists["http-auth"]) == 0 {
		t.Fatalf("lists after socks5 left: %v", slices.Collect(maps.Keys(st.Lists)))
	}
	for _, u := range st.Upstreams() {
		if u.Protocol != "http" {
			t.Errorf("upstream %+v of a protocol no listener dials", u)
		}
	}
	st = serviceByID(p.Snapshot(), 102)
	if len(st.Lists) != 0 || len(st.Sticky) != 0 || len(st.Upstreams()) != 0 || len(st.UnservedSessions()) != 0 {
		t.Errorf("ppr service no listener draws kept lists %v, sessions %v", slices.Collect(maps.Keys(st.Lists)), st.Sticky)
	}

	// Drawn again after the provider's lists shrank meanwhile: nothing
	// was kept, so the smaller answers are taken at once, not held back
	// as a shrink of what was dropped.
	sim.SetEntries(101, "socks-ip", []providersim.Entry{{Host: "10.0.0.1", Port: 1080}})
	sim.SetStickySessions(102, sessions[:1])
	cfg.Draws = nil
	if err := p.Reconfigure(p.client, cfg, false); err != nil {
		t.Fatal(err)
	}
	if err := p.PollOnce(context.Background(), LoopLists); err != nil {
		t.Fatal(err)
	}
	if st := serviceByID(p.Snapshot(), 101); len(st.Lists["socks-ip"]) != 1 {
		t.Errorf("socks-ip drawn again: %d entries, want the provider's 1", len(st.Lists["socks-ip"]))
	}
	if st := serviceByID(p.Snapshot(), 102); len(st.Sticky) != 1 {
		t.Errorf("sessions drawn again: %d, want the provider's 1", len(st.Sticky))
	}
}

// Only what some listener draws is fetched: by kind (an fpr-only config
// asks for no ppr list and no sticky session) and by service.
func TestPollerFetchesOnlyDrawnLists(t *testing.T) {
	for _, tt := range []struct {
		name  string
		draws func(int, string, string) bool
		want  map[int][]string // service: list types held after a round
	}{
		{"fpr listeners", func(_ int, kind, _ string) bool { return kind == "fpr" },
			map[int][]string{101: {"http-auth", "socks-ip"}, 102: nil, 104: nil}},
		{"one service over socks5", func(id int, _, protocol string) bool { return id == 102 && protocol == "socks5" },
			map[int][]string{101: nil, 102: {"ppr-socks"}, 104: nil}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p, sim, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) { c.Services = []int{101, 102, 104}; c.Draws = tt.draws }))
			pollAll(t, p)
			lists := 0
			for id, want := range tt.want {
				st := serviceByID(p.Snapshot(), id)
				if st == nil {
					t.Fatalf("service %d not served", id)
				}
				got := slices.Sorted(maps.Keys(st.Lists))
				if !slices.Equal(got, want) {
					t.Errorf("service %d holds lists %v, want %v", id, got, want)
				}
				lists += len(want)
			}
			if n := sim.Requests("/api/iplist/{typel}/{formatl}/{id}"); n != lists {
				t.Errorf("%d list requests, want %d", n, lists)
			}
			// The network status of a service with no list drawn is of no
			// use either: one service's, in each case.
			if n := sim.Requests("/api/networkstatus/errors/{id}"); n != 1 {
				t.Errorf("%d network-status requests, want 1", n)
			}
			wantSticky := 0
			if tt.draws(102, "ppr", "socks5") {
				wantSticky = 1
			}
			if n := sim.Requests("/api/sticky/list/{id}"); n != wantSticky {
				t.Errorf("%d sticky-session requests, want %d", n, wantSticky)
			}
		})
	}
}
