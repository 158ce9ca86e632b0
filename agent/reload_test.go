package agent

import (
	"context"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/proxyd/proxyd/agent/providersim"
)

func simServer(t *testing.T) (*providersim.Sim, *Client) {
	t.Helper()
	sim := providersim.New(providersim.Config{})
	srv := httptest.NewServer(sim)
	t.Cleanup(srv.Close)
	c, err := New(clientConfig(srv.URL, providersim.DefaultToken, 5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	return sim, c
}

func gatewayEntries(n int) []providersim.Entry {
	var out []providersim.Entry
	for i := range n {
		out = append(out, providersim.Entry{Host: "192.0.2.21", Port: 8000 + i, Login: "u", Password: "p"})
	}
	return out
}

// Reconfigure with a new provider: the running loops (hour-long intervals,
// so only the reload can wake them) move to the new API at once, the new
// provider's far smaller list is swapped in without confirmation, a
// service it does not serve leaves, and a rotation in flight finishes
// against the API it started with.
func TestPollerReconfigureProviderChange(t *testing.T) {
	simA, clientA := simServer(t)
	simB, clientB := simServer(t)
	simA.SetEntries(104, "ppr-http", gatewayEntries(6))
	simB.SetEntries(104, "ppr-http", gatewayEntries(2)) // far smaller: would need confirmation
	simB.SetServiceStatus(101, "Suspended")

	hour := pollConfig(func(c *PollConfig) {
		c.IPList, c.NetworkStatus, c.Usage, c.Account = time.Hour, time.Hour, time.Hour, time.Hour
		c.LookupHost = simA.LookupHost
	})
	var mu sync.Mutex
	var last Snapshot
	p, err := NewPoller(clientA, hour, func(s Snapshot) { mu.Lock(); last = s; mu.Unlock() }, nil)
	if err != nil {
		t.Fatal(err)
	}
	snap := func() Snapshot { mu.Lock(); defer mu.Unlock(); return last }
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); p.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })

	waitUntil(t, 5*time.Second, "the lists of provider A", func() bool {
		st := serviceByID(snap(), 104)
		return st != nil && len(st.Lists["ppr-http"]) == 6 && serviceByID(snap(), 101) != nil
	})

	// A rotation that is in flight when the reload comes.
	release := make(chan struct{})
	started := make(chan struct{})
	simA.RotateHook(func(int, string, string) (int, string) {
		close(started)
		<-release
		return 0, ""
	})
	rotated := make(chan error, 1)
	go func() {
		_, err := p.Rotate(ctx, 102, providersim.StickyGateway, "s1")
		rotated <- err
	}()
	<-started

	if err := p.Reconfigure(clientB, hour, true); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 5*time.Second, "the lists of provider B", func() bool {
		s := snap()
		st := serviceByID(s, 104)
		return st != nil && len(st.Lists["ppr-http"]) == 2 && serviceByID(s, 101) == nil
	})
	close(release)
	if err := <-rotated; err != nil {
		t.Fatalf("rotation in flight: %v", err)
	}
	if simA.Requests(RouteStickyRotate) != 1 || simB.Requests(RouteStickyRotate) != 0 {
		t.Errorf("rotate requests: A %d, B %d; the rotation must finish against A",
			simA.Requests(RouteStickyRotate), simB.Requests(RouteStickyRotate))
	}
	// Every loop moved to B at once.
	for _, route := range []string{RouteServices, RouteIPList, RouteNetworkErrors, RouteRate} {
		if simB.Requests(route) == 0 {
			waitUntil(t, 5*time.Second, "a request to B on "+route, func() bool { return simB.Requests(route) > 0 })
		}
	}
	// Another round of every loop reaches B only.
	polledA := func() int {
		return simA.Requests(RouteServices) + simA.Requests(RouteIPList) + simA.Requests(RouteNetworkErrors) + simA.Requests(RouteRate)
	}
	before := polledA()
	var rounds [numLoops]int64
	for l := Loop(0); l < numLoops; l++ {
		rounds[l] = p.Rounds(l)
		p.Kick(l)
	}
	waitUntil(t, 5*time.Second, "one more round of every loop", func() bool {
		for l := Loop(0); l < numLoops; l++ {
			if p.Rounds(l) <= rounds[l] {
				return false
			}
		}
		return true
	})
	if after := polledA(); after != before {
		t.Errorf("provider A still polled after the reload: %d requests, then %d", before, after)
	}
}

// Without a provider change a far smaller list still needs confirmation,
// and new intervals apply at once.
func TestPollerReconfigureSameProvider(t *testing.T) {
	sim, client := simServer(t)
	sim.SetEntries(104, "ppr-http", gatewayEntries(6))
	clock := newFakeClock()
	cfg := pollConfig(func(c *PollConfig) { c.Services = []int{104}; c.Draws = drawn("http"); c.Now = clock.Now })
	p, err := NewPoller(client, cfg, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	pollAll(t, p)
	sim.SetEntries(104, "ppr-http", gatewayEntries(2))
	cfg.IPList = 2 * time.Second
	if err := p.Reconfigure(client, cfg, false); err != nil {
		t.Fatal(err)
	}
	if got := p.interval(LoopLists); got != 2*time.Second {
		t.Errorf("lists interval %v after the reload, want 2s", got)
	}
	pollAll(t, p)
	if got := len(serviceByID(p.Snapshot(), 104).Lists["ppr-http"]); got != 6 {
		t.Errorf("far smaller list swapped in without confirmation: %d entries", got)
	}
	clock.Advance(2 * time.Second) // the new ip_list
	pollAll(t, p)
	if got := len(serviceByID(p.Snapshot(), 104).Lists["ppr-http"]); got != 2 {
		t.Errorf("confirmed list not swapped in: %d entries", got)
	}
	bad := cfg
	bad.Account = 0
	if err := p.Reconfigure(client, bad, false); err == nil {
		t.Error("Reconfigure accepted account = 0s")
	}
	if got := p.interval(LoopAccount); got != cfg.Account {
		t.Errorf("a refused reload changed the account interval to %v", got)
	}
}

// A reload that leaves a service out of [api] services drops it at once,
// with the API failing: it is in Dropped, no longer in the snapshot, and
// the rounds that follow ask nothing about it.
func TestPollerReconfigureNarrowsServices(t *testing.T) {
	sim := providersim.New(providersim.Config{})
	var down atomic.Bool
	var asked, about102 atomic.Int32
	c := interceptClient(t, sim, 5*time.Second, func(w http.ResponseWriter, r *http.Request) bool {
		if !down.Load() {
			return false
		}
		asked.Add(1)
		if strings.HasSuffix(r.URL.Path, "/102") {
			about102.Add(1)
		}
		w.WriteHeader(http.StatusInternalServerError)
		return true
	})
	cfg := pollConfig(func(c *PollConfig) { c.Services = []int{101, 102}; c.LookupHost = sim.LookupHost })
	p, err := NewPoller(c, cfg, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	pollAll(t, p)
	if serviceByID(p.Snapshot(), 102) == nil {
		t.Fatal("service 102 not served before the reload")
	}
	down.Store(true)
	cfg.Services = []int{101}
	if err := p.Reconfigure(p.client, cfg, false); err != nil {
		t.Fatal(err)
	}
	s := p.Snapshot()
	if serviceByID(s, 102) != nil || !slices.Contains(s.Dropped, 102) || slices.Contains(s.Wanted, 102) {
		t.Errorf("after the reload: served %v, dropped %v, wanted %v", s.Services, s.Dropped, s.Wanted)
	}
	if serviceByID(s, 101) == nil {
		t.Error("service 101 left too")
	}
	for l := LoopLists; l < numLoops; l++ {
		_ = p.PollOnce(context.Background(), l) // fails: the API is down
	}
	if asked.Load() == 0 || about102.Load() != 0 {
		t.Errorf("%d requests after the reload, %d of them about service 102; want some, none about it", asked.Load(), about102.Load())
	}
}

// A service a reload left out and a later one names again starts fresh:
// its lists' last good sizes went with it, so a list that shrank meanwhile
// is taken at once, not held back as a shrink of what was dropped.
func TestPollerServiceServedAgainStartsFresh(t *testing.T) {
	cfg := pollConfig(func(c *PollConfig) { c.Services = []int{101, 102} })
	p, sim, _ := newPollerForTest(t, cfg)
	pollAll(t, p)
	if st := serviceByID(p.Snapshot(), 101); st == nil || len(st.Lists["socks-ip"]) != 3 {
		t.Fatalf("service 101 before: %+v", st)
	}
	cfg.Services = []int{102}
	if err := p.Reconfigure(p.client, cfg, false); err != nil {
		t.Fatal(err)
	}
	sim.SetEntries(101, "socks-ip", []providersim.Entry{{Host: "10.0.0.1", Port: 1080}})
	cfg.Services = []int{101, 102}
	if err := p.Reconfigure(p.client, cfg, false); err != nil {
		t.Fatal(err)
	}
	pollAll(t, p)
	if st := serviceByID(p.Snapshot(), 101); st == nil || len(st.Lists["socks-ip"]) != 1 || !st.ListsKnown {
		t.Errorf("service 101 served again: %+v, want the provider's one socks-ip entry, known", st)
	}
}

// A lists round that asks for nothing (its only service is drawn by no
// listener) refreshes nothing: with the API down, the time of the last
// refresh stays where it was.
func TestPollerListsUpdatedOnlyByFetches(t *testing.T) {
	clock := newFakeClock()
	cfg := pollConfig(func(c *PollConfig) {
		c.Services = []int{101, 102}
		c.Draws = func(_ int, kind, _ string) bool { return kind == "fpr" }
		c.Now = clock.Now
	})
	p, sim, _ := newPollerForTest(t, cfg)
	pollAll(t, p)
	before := p.Snapshot().ListsUpdated
	if before.IsZero() {
		t.Fatal("no lists round succeeded")
	}
	clock.Advance(time.Minute) // a refresh now would show
	sim.FailNext(1<<30, 500, "down")
	requests := sim.Requests("/api/iplist/{typel}/{formatl}/{id}")
	// A round in which only 102 is due (101 backs off on its own clock).
	if err := p.pollLists(context.Background(), p.startRound(LoopLists), []unit{{service: 102}}); err != nil {
		t.Fatal(err)
	}
	if n := sim.Requests("/api/iplist/{typel}/{formatl}/{id}") - requests; n != 0 {
		t.Fatalf("%d list requests for a service no listener draws", n)
	}
	if after := p.Snapshot().ListsUpdated; !after.Equal(before) {
		t.Errorf("the last refresh moved from %v to %v with nothing fetched", before, after)
	}
}

// Sizes seeded from the daemon's state file for a service the poller never
// polled go when the service is not served (a reload leaves it out, or the
// account drops it): served again after its list shrank, its first answer
// is taken, not held back an interval with nothing in its place.
func TestPollerSeededSizesOfUnservedServiceForgotten(t *testing.T) {
	for _, tt := range []struct {
		name  string
		leave func(t *testing.T, p *Poller, sim *providersim.Sim, cfg PollConfig)
		back  func(t *testing.T, p *Poller, sim *providersim.Sim, cfg PollConfig)
	}{
		{"reload", func(t *testing.T, p *Poller, _ *providersim.Sim, cfg PollConfig) {
			cfg.Services = []int{102}
			if err := p.Reconfigure(p.client, cfg, false); err != nil {
				t.Fatal(err)
			}
		}, func(t *testing.T, p *Poller, _ *providersim.Sim, cfg PollConfig) {
			if err := p.Reconfigure(p.client, cfg, false); err != nil {
				t.Fatal(err)
			}
		}},
		{"suspension", func(t *testing.T, p *Poller, sim *providersim.Sim, _ PollConfig) {
			sim.SetServiceStatus(101, "Suspended")
			if err := p.PollOnce(context.Background(), LoopAccount); err != nil {
				t.Fatal(err)
			}
		}, func(t *testing.T, _ *Poller, sim *providersim.Sim, _ PollConfig) {
			sim.SetServiceStatus(101, "Active")
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg := pollConfig(func(c *PollConfig) { c.Services = []int{101, 102} })
			p, sim, _ := newPollerForTest(t, cfg)
			p.Seed(slices.Concat(restored(101, "fpr", "http", 3, false), restored(101, "fpr", "socks5", 3, false))) // as restored at a restart
			tt.leave(t, p, sim, cfg)
			if serviceByID(p.Snapshot(), 101) != nil {
				t.Fatal("service 101 still served")
			}
			sim.SetEntries(101, "socks-ip", []providersim.Entry{{Host: "10.0.0.1", Port: 1080}})
			tt.back(t, p, sim, cfg)
			pollAll(t, p)
			if st := serviceByID(p.Snapshot(), 101); st == nil || len(st.Lists["socks-ip"]) != 1 || !st.ListsKnown {
				t.Errorf("service 101 served again: %+v, want the provider's one socks-ip entry, known", st)
			}
		})
	}
}

// A lists round in which one service fails still says which provider the
// other services' lists came from; only a round in which every fetch
// succeeded moves the time of the last refresh.
func TestPollerListsFromAfterPartialRound(t *testing.T) {
	sim := providersim.New(providersim.Config{})
	c := interceptClient(t, sim, 5*time.Second, func(w http.ResponseWriter, r *http.Request) bool {
		if strings.HasPrefix(r.URL.Path, "/api/iplist/") && strings.HasSuffix(r.URL.Path, "/102") {
			w.WriteHeader(http.StatusInternalServerError)
			return true
		}
		return false
	})
	p, err := NewPoller(c, pollConfig(func(c *PollConfig) { c.Services = []int{101, 102} }), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.PollOnce(context.Background(), LoopAccount); err != nil {
		t.Fatal(err)
	}
	if err := p.PollOnce(context.Background(), LoopLists); err == nil {
		t.Fatal("the lists round did not fail for service 102")
	}
	s := p.Snapshot()
	if s.ListsFrom != c.BaseURL() || !s.ListsUpdated.IsZero() {
		t.Errorf("after a partial round: lists from %q (want %q), updated %v (want none)", s.ListsFrom, c.BaseURL(), s.ListsUpdated)
	}
}
