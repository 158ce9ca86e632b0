package pool

import (
	"context"
	"encoding/json"
	"errors"
	"maps"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		set  func(c *Config)
		want string
	}{
		{func(c *Config) {}, ""},
		{func(c *Config) { c.Strategy = "latency"; c.MaxEjectedPercent = 100 }, ""},
		{func(c *Config) { c.Strategy = "fastest" }, `strategy: must be round-robin, random, least-conn or latency, got "fastest"`},
		{func(c *Config) { c.Strategy = "" }, `strategy: must be round-robin, random, least-conn or latency, got ""`},
		{func(c *Config) { c.FailureThreshold = -1 }, "failure_threshold: must be at least 1, got -1"},
		{func(c *Config) { c.FailureThreshold = 0 }, "failure_threshold: must be at least 1, got 0"},
		{func(c *Config) { c.EjectBase = -time.Second }, "eject_base: must be positive, got -1s"},
		{func(c *Config) { c.EjectBase = 0 }, "eject_base: must be positive, got 0s"},
		{func(c *Config) { c.EjectMax = 0 }, "eject_max: must be positive, got 0s"},
		{func(c *Config) { c.MaxEjectedPercent = 150 }, "max_ejected_percent: must be within 0–100, got 150"},
		{func(c *Config) { c.MaxEjectedPercent = -1 }, "max_ejected_percent: must be within 0–100, got -1"},
		{func(c *Config) { c.MaxEjectedPercent = 0 }, ""}, // never eject
		{func(c *Config) { c.LatencyTolerance = math.NaN() }, "latency_tolerance: must not be negative, got NaN"},
		{func(c *Config) { c.LatencyTolerance = math.Inf(1) }, "latency_tolerance: must be finite, got +Inf"},
		{func(c *Config) { c.LatencyTolerance = 0 }, ""}, // only the best
		{func(c *Config) { c.EjectBase = time.Minute; c.EjectMax = time.Second }, "eject_max: must not be less than eject_base (1m0s), got 1s"},
		{func(c *Config) { c.EjectBase = 10 * time.Minute }, "eject_max: must not be less than eject_base (10m0s), got 5m0s"},
		{func(c *Config) { c.StickyMax = -5 }, "sticky_max: must not be negative, got -5"},
		{func(c *Config) { c.StickyMax = 0 }, ""}, // stickiness off
		{func(c *Config) { c.StickyIdle = 0 }, "sticky_idle: must be positive (sticky_max = 0 turns stickiness off), got 0s"},
		{func(c *Config) { c.RotateInterval = 0; c.RotateWait = 0 }, ""},
		{func(c *Config) { c.RotateInterval = -time.Second }, "rotate_interval: must not be negative, got -1s"},
		{func(c *Config) { c.RotateWait = -1 }, "rotate_wait: must not be negative, got -1ns"},
		{func(c *Config) { c.RotateTimeout = 0 }, "rotate_timeout: must be positive, got 0s"},
		{func(c *Config) { c.ProbeInterval = -time.Second }, "probe_interval: must not be negative, got -1s"},
		{func(c *Config) { c.ProbeBudget = -1 }, "probe_budget: must not be negative, got -1"},
		{func(c *Config) { c.ProbeBudget = 0 }, ""}, // unused without probe_interval
		{func(c *Config) { c.ProbeBudget = 0; c.ProbeInterval = time.Second }, "probe_budget: must be at least 1 while probe_interval is set, got 0"},
		{func(c *Config) { c.ProbeTimeout = 0 }, "probe_timeout: must be positive, got 0s"},
		{func(c *Config) { c.QuotaHeadroom = 0 }, "quota_headroom: must be a positive number, got 0"},
		{func(c *Config) { c.QuotaHeadroom = math.NaN() }, "quota_headroom: must be a positive number, got NaN"},
		{func(c *Config) { c.QuotaHeadroom = math.Inf(1) }, "quota_headroom: must be a positive number, got +Inf"},
		{func(c *Config) { c.QuotaHeadroom = 0.5 }, ""},
		{func(c *Config) { c.QuotaHeadroom = 1.5 }, ""},
		// Every problem at once, in the order of the fields.
		{func(c *Config) { *c = Config{} }, strings.Join([]string{
			`strategy: must be round-robin, random, least-conn or latency, got ""`,
			"failure_threshold: must be at least 1, got 0",
			"eject_base: must be positive, got 0s",
			"eject_max: must be positive, got 0s",
			"sticky_idle: must be positive (sticky_max = 0 turns stickiness off), got 0s",
			"rotate_timeout: must be positive, got 0s",
			"probe_timeout: must be positive, got 0s",
			"quota_headroom: must be a positive number, got 0",
		}, "\n")},
	}
	for _, tt := range tests {
		cfg := conf(tt.set)
		err := cfg.Validate()
		got := ""
		if err != nil {
			got = err.Error()
			if n := len(err.(interface{ Unwrap() []error }).Unwrap()); n != strings.Count(got, "\n")+1 {
				t.Errorf("Validate(%+v): %d joined errors for %q", cfg, n, got)
			}
		}
		if got != tt.want {
			t.Errorf("Validate(%+v) = %q, want %q", cfg, got, tt.want)
		}
		if _, err := New(cfg, Options{}); (err == nil) != (tt.want == "") {
			t.Errorf("New(%+v) = %v, want an error: %v", cfg, err, tt.want != "")
		}
	}
	if _, err := New(conf(func(c *Config) { c.ProbeInterval = time.Second }), Options{}); err == nil {
		t.Errorf("New with probe_interval and no Prober: no error")
	}
	want := Config{Strategy: RoundRobin, FailureThreshold: 3, EjectBase: 30 * time.Second, EjectMax: 5 * time.Minute,
		MaxEjectedPercent: 50, LatencyTolerance: 0.2, StickyIdle: 30 * time.Minute, StickyMax: 100000,
		RotateInterval: 30 * time.Second, RotateWait: 5 * time.Second, RotateTimeout: 30 * time.Second, ProbeBudget: 10, ProbeTimeout: 10 * time.Second,
		QuotaHeadroom: 1}
	if d := DefaultConfig(); d != want {
		t.Errorf("defaults = %+v, want %+v", d, want)
	}
}

// TestConfigTOMLKeys checks that every field carries its key in the file.
func TestConfigTOMLKeys(t *testing.T) {
	want := []string{"strategy", "failure_threshold", "eject_base", "eject_max", "max_ejected_percent",
		"latency_tolerance", "sticky_idle", "sticky_max", "rotate_interval", "rotate_wait", "rotate_timeout",
		"probe_interval", "probe_budget", "probe_timeout", "quota_headroom"}
	var got []string
	for f := range reflect.TypeFor[Config]().Fields() {
		got = append(got, f.Tag.Get("toml"))
	}
	if !slices.Equal(got, want) {
		t.Errorf("toml keys = %q, want %q", got, want)
	}
}

func TestAppendIDMatchesID(t *testing.T) {
	for _, u := range append(ups(7, 2), sessions(9, 2, "198.51.100.1")...) {
		if got := string(appendID(nil, &u)); got != u.ID() {
			t.Errorf("appendID = %q, ID() = %q", got, u.ID())
		}
	}
	// A pool-handed upstream's ID is the one computed once; a copy with
	// other fields has its own.
	p := newTestPool(t, DefaultConfig(), Options{Now: newClock().Now})
	set := append(ups(7, 2), sessions(9, 2, "198.51.100.1")...)
	p.Update(set)
	for _, u := range set {
		h := handle(p, u)
		if got := h.ID(); got != u.ID() {
			t.Errorf("handed-out ID = %q, want %q", got, u.ID())
		}
		c := *h
		c.Address = "192.0.2.1:1"
		if got, want := c.ID(), string(appendID(nil, &c)); got != want {
			t.Errorf("copy's ID = %q, want %q", got, want)
		}
	}
	u := Upstream{Service: 101, Protocol: HTTP, Address: "[2001:db8::1]:8080"}
	if got, want := u.ID(), "101/http/[2001:db8::1]:8080"; got != want {
		t.Errorf("ID = %q, want %q", got, want)
	}
	for addr, want := range map[string]string{"1.2.3.4:80": "1.2.3.4", "[2001:db8::1]:80": "2001:db8::1", "gw.example": "gw.example", "2001:db8::1": "2001:db8::1"} {
		if got := hostPart(addr); got != want {
			t.Errorf("hostPart(%q) = %q, want %q", addr, got, want)
		}
	}
}

// FailureReasons is derived from Result: it must stay the five failure
// classes that count against an upstream (a contract: they are the label
// values of proxyd_upstream_failures_total and the reasons in /pool).
func TestFailureReasons(t *testing.T) {
	want := []string{"dial_refused", "dial_timeout", "handshake_timeout", "auth_rejected", "proxy_error"}
	if got := FailureReasons(); !slices.Equal(got, want) {
		t.Errorf("FailureReasons() = %q, want %q", got, want)
	}
}

func TestListenerSlices(t *testing.T) {
	p := newTestPool(t, DefaultConfig(), Options{Now: newClock().Now})
	socks := ups(2, 3)
	for i := range socks {
		socks[i].Protocol = SOCKS5
	}
	all := append(append(ups(1, 3), socks...), sessions(3, 2, "198.51.100.1")...)
	p.Update(all)
	if u := pickReport(t, p, Request{Listener: "anything"}, Success); u == nil {
		t.Fatal("no listeners set: want the whole set")
	}
	p.SetListeners([]ListenerSlice{
		{Name: "http", Protocol: HTTP},
		{Name: "socks", Protocol: SOCKS5},
		{Name: "static", Kind: FPR, Services: []int{1, 2}},
		{Name: "ppr", Kind: PPR},
	})
	check := func(listener string, ok func(*Upstream) bool, total int) {
		t.Helper()
		for range 20 {
			u := pickReport(t, p, Request{Listener: listener}, Success)
			if !ok(u) {
				t.Errorf("listener %s picked %s", listener, u.ID())
			}
		}
		if l := listenerOf(t, p, listener); l.Total != total || l.Usable != total {
			t.Errorf("listener %s: %+v, want total and usable %d", listener, l, total)
		}
	}
	check("http", func(u *Upstream) bool { return u.Protocol == HTTP }, 5)
	check("socks", func(u *Upstream) bool { return u.Protocol == SOCKS5 }, 3)
	check("static", func(u *Upstream) bool { return u.Kind == FPR }, 6)
	check("ppr", func(u *Upstream) bool { return u.Kind == PPR }, 2)
	if _, err := p.Pick(context.Background(), Request{Listener: "nope"}); !errors.Is(err, ErrUnknownListener) {
		t.Errorf("unknown listener: err = %v", err)
	}
	p.SetListeners(nil)
	if u := pickReport(t, p, Request{Listener: "nope"}, Success); u == nil {
		t.Errorf("no listeners again: want the whole set")
	}
}

func TestProviderExclusion(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, DefaultConfig(), Options{Now: clk.Now})
	set := append(ups(1, 4), ups(2, 2)...)
	p.Update(set)
	bad, idle := set[0], set[1]
	p.SetProviderStatus(1, []string{"10.1.0.0"}, []string{"10.1.0.1", "10.2.0.0"}) // 10.2.0.0 is service 2's, not 1's
	for range 50 {
		u := pickReport(t, p, Request{}, Success)
		if u.ID() == bad.ID() || u.ID() == idle.ID() {
			t.Fatalf("picked provider-excluded %s", u.ID())
		}
	}
	if s := stateOf(t, p, bad.ID()); s.State != ProviderError {
		t.Errorf("errored upstream state = %s", s.State)
	}
	if s := stateOf(t, p, idle.ID()); s.State != ProviderInactive {
		t.Errorf("inactive upstream state = %s", s.State)
	}
	if s := stateOf(t, p, set[4].ID()); s.State != Healthy {
		t.Errorf("service 2's upstream with a listed IP of service 1: state = %s", s.State)
	}
	// A refresh keeps the exclusion; new upstreams get it from the start.
	more := append(set, Upstream{Service: 1, Kind: FPR, Protocol: SOCKS5, Address: "10.1.0.0:1080"})
	p.Update(more)
	if s := stateOf(t, p, more[6].ID()); s.State != ProviderError {
		t.Errorf("new upstream on an errored IP: state = %s", s.State)
	}
	// Cleared at once.
	p.SetProviderStatus(1, nil, nil)
	seen := map[string]bool{}
	for range 50 {
		seen[pickReport(t, p, Request{}, Success).ID()] = true
	}
	if !seen[bad.ID()] || !seen[idle.ID()] {
		t.Errorf("after clearing: picked %v, want both formerly excluded", seen)
	}
	// Everything excluded: no upstream.
	p.SetProviderStatus(1, []string{"10.1.0.0", "10.1.0.1", "10.1.0.2", "10.1.0.3"}, nil)
	p.SetProviderStatus(2, nil, []string{"10.2.0.0", "10.2.0.1"})
	if _, err := p.Pick(context.Background(), Request{}); !errors.Is(err, ErrNoUpstream) {
		t.Errorf("all excluded: err = %v, want ErrNoUpstream", err)
	}
}

func TestSessionGatewayExcludedExitIPNot(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, DefaultConfig(), Options{Now: clk.Now}) // no Rotator
	ss := append(sessions(5, 2, "198.51.100.1"), sessions(6, 1, "198.51.100.2")...)
	p.Update(ss)
	p.SetProviderStatus(5, nil, []string{"198.51.100.1"})
	for range 10 {
		if u := pickReport(t, p, Request{}, Success); u.Service != 6 {
			t.Fatalf("picked %s behind an inactive gateway", u.ID())
		}
	}
	if s := stateOf(t, p, ss[0].ID()); s.State != ProviderInactive {
		t.Errorf("state = %s", s.State)
	}
	// An errored exit IP (here without a Rotator) is a reason to rotate, not
	// to exclude.
	p.SetProviderStatus(5, []string{ss[1].ExitIP}, nil)
	if s := stateOf(t, p, ss[1].ID()); s.State != Healthy || !strings.Contains(s.Reason, "exit ip") {
		t.Errorf("errored exit ip: %s %q", s.State, s.Reason)
	}
	if s := stateOf(t, p, ss[0].ID()); s.State != Healthy || s.Reason != "" {
		t.Errorf("session with a clean exit ip: %s %q", s.State, s.Reason)
	}
	seen := false
	for range 10 {
		seen = seen || pickReport(t, p, Request{}, Success).ID() == ss[1].ID()
	}
	if !seen {
		t.Errorf("session with an errored exit ip not picked")
	}
}

func TestQuota(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, DefaultConfig(), Options{Now: clk.Now})
	a, b := sessions(1, 3, "198.51.100.1"), ups(2, 2)
	for i := range a {
		a[i].Session = "" // plain rotating upstreams
		a[i].Address = a[i].ExitIP + ":9000"
	}
	p.Update(append(a, b...))
	p.SetListeners([]ListenerSlice{{Name: "all"}, {Name: "ppr", Kind: PPR}})
	p.SetUsage(1, 100, 100)
	for range 30 {
		if u := pickReport(t, p, Request{Listener: "all"}, Success); u.Service != 2 {
			t.Fatalf("picked %s of a service in quota while another can serve", u.ID())
		}
	}
	if s := stateOf(t, p, a[0].ID()); s.State != Quota {
		t.Errorf("state = %s, want quota", s.State)
	}
	// Where only the quota service can serve, it still serves.
	if u := pickReport(t, p, Request{Listener: "ppr"}, Success); u.Service != 1 {
		t.Errorf("ppr listener picked %s", u.ID())
	}
	if l := listenerOf(t, p, "ppr"); l.Usable != 3 {
		t.Errorf("ppr listener usable = %d, want 3 (quota serves when nothing else can)", l.Usable)
	}
	// Once the other service is gone (excluded), the quota service serves.
	p.SetProviderStatus(2, []string{"10.2.0.0", "10.2.0.1"}, nil)
	if u := pickReport(t, p, Request{Listener: "all"}, Success); u.Service != 1 {
		t.Errorf("picked %s", u.ID())
	}
	p.SetProviderStatus(2, nil, nil)
	p.SetUsage(1, 10, 100)
	seen := map[int]bool{}
	for range 20 {
		seen[pickReport(t, p, Request{Listener: "all"}, Success).Service] = true
	}
	if !seen[1] || !seen[2] {
		t.Errorf("after quota lifted: services %v", seen)
	}
}

func TestUpdateKeepsStateAndDrains(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, conf(func(c *Config) { c.MaxEjectedPercent = 100 }), Options{Now: clk.Now})
	set := ups(1, 4)
	p.Update(set)
	ej := handle(p, set[0])
	fail(p, ej, 3)
	if s := stateOf(t, p, ej.ID()); s.State != Ejected {
		t.Fatalf("state = %s, want ejected", s.State)
	}
	busy := handle(p, set[1])
	fail(p, busy, 2)
	// Hold a connection on set[3], which the refresh removes.
	gone := pickUntil(t, p, Request{}, set[3].ID())
	p.Report(gone, Success, time.Millisecond)

	next := append([]Upstream{}, set[:3]...)
	next[1].Password = "rotated" // a changed credential keeps the state
	next = append(next, ups(1, 6)[4:]...)
	p.Update(next)

	if s := stateOf(t, p, ej.ID()); s.State != Ejected || s.Ejections != 1 || s.Failures != 3 {
		t.Errorf("ejected upstream after refresh: %+v", s)
	}
	if s := stateOf(t, p, busy.ID()); s.ConsecutiveFailures != 2 || s.State != Healthy {
		t.Errorf("kept upstream: %+v", s)
	}
	if s := stateOf(t, p, set[3].ID()); s.State != Draining || s.InFlight != 1 {
		t.Errorf("removed upstream: %+v", s)
	}
	if s := stateOf(t, p, next[3].ID()); s.State != Healthy || s.Failures != 0 {
		t.Errorf("new upstream: %+v", s)
	}
	for range 40 {
		u := pickReport(t, p, Request{}, Success)
		switch u.ID() {
		case set[3].ID():
			t.Fatalf("picked a draining upstream")
		case set[0].ID():
			t.Fatalf("picked an ejected upstream")
		case set[1].ID():
			if u.Password != "rotated" {
				t.Fatalf("old credential after refresh")
			}
		}
	}
	got := p.Upstreams()
	if len(got) != 5 || got[1].Password != "rotated" {
		t.Errorf("Upstreams() = %d upstreams, [1] password %q", len(got), got[1].Password)
	}
	// The held connection ends: the removed upstream leaves.
	p.Release(gone, Request{})
	for _, u := range p.Explain().Upstreams {
		if u.ID == set[3].ID() {
			t.Errorf("drained upstream still listed: %+v", u)
		}
	}
	p.sweep()
	p.mu.Lock()
	n := len(p.draining)
	p.mu.Unlock()
	if n != 0 {
		t.Errorf("%d drained upstreams kept", n)
	}
	// Back again: its state comes back with it.
	p.Update(set)
	if s := stateOf(t, p, set[0].ID()); s.State != Ejected {
		t.Errorf("re-added: %+v", s)
	}
}

func TestExplainHoldsNoPassword(t *testing.T) {
	p := newTestPool(t, DefaultConfig(), Options{Now: newClock().Now})
	set := append(ups(1, 3), sessions(2, 2, "198.51.100.1")...)
	p.Update(set)
	p.SetListeners([]ListenerSlice{{Name: "b"}, {Name: "a", Kind: PPR}})
	x := p.Explain()
	b, err := json.Marshal(x)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(b), "secret") {
		t.Errorf("Explain holds a password: %s", b)
	}
	for i := 1; i < len(x.Upstreams); i++ {
		if x.Upstreams[i-1].ID >= x.Upstreams[i].ID {
			t.Errorf("not in ID order: %s, %s", x.Upstreams[i-1].ID, x.Upstreams[i].ID)
		}
	}
	if len(x.Listeners) != 2 || x.Listeners[0].Name != "b" || x.Listeners[1].Total != 2 {
		t.Errorf("listeners = %+v", x.Listeners)
	}
	if l := p.Listeners(); len(l) != 2 || l[0] != x.Listeners[0] || l[1] != x.Listeners[1] {
		t.Errorf("Listeners() = %+v, Explain has %+v", l, x.Listeners)
	}
	if !x.Updated.Equal(newClock().Now()) {
		t.Errorf("updated = %v", x.Updated)
	}
}

func TestChangedHook(t *testing.T) {
	changed := make(chan struct{}, 10)
	p := newTestPool(t, DefaultConfig(), Options{Hooks: Hooks{Changed: func() { changed <- struct{}{} }}})
	p.Update(ups(1, 2))
	select {
	case <-changed:
	case <-time.After(5 * time.Second):
		t.Fatal("Changed not called after Update")
	}
}

// TestQuotaHeadroom: at quota_headroom 0.5, a service whose usage is at 60 %
// of its limit takes no new connections while another service serves the
// listener, and takes them again once its usage drops under half its limit.
func TestQuotaHeadroom(t *testing.T) {
	clk := newClock()
	events := NewEventLog(0, nil, clk.Now)
	p := newTestPool(t, conf(func(c *Config) { c.QuotaHeadroom = 0.5 }), Options{Now: clk.Now, Events: events})
	a, b := sessions(1, 3, "198.51.100.1"), ups(2, 2)
	for i := range a {
		a[i].Session = "" // plain rotating upstreams
		a[i].Address = a[i].ExitIP + ":9000"
	}
	p.Update(append(a, b...))
	p.SetListeners([]ListenerSlice{{Name: "all"}})
	services := func() map[int]int {
		seen := map[int]int{}
		for range 20 {
			seen[pickReport(t, p, Request{Listener: "all"}, Success).Service]++
		}
		return seen
	}

	p.SetUsage(1, 40, 100) // 40 %: under the headroom
	if seen := services(); seen[1] == 0 || seen[2] == 0 {
		t.Fatalf("at 40 %% of the limit: picks per service %v, want both", seen)
	}
	p.SetUsage(1, 60, 100) // 60 %: over half the limit
	if seen := services(); seen[1] != 0 {
		t.Fatalf("at 60 %% of the limit with headroom 0.5: picks per service %v, want none of service 1", seen)
	}
	if s := stateOf(t, p, a[0].ID()); s.State != Quota {
		t.Errorf("state = %s, want quota", s.State)
	}
	p.SetUsage(1, 70, 100) // still over: no second event
	if got := p.Usage(); !maps.Equal(got, map[int]ServiceUsage{1: {Rate: 70, Limit: 100}}) {
		t.Errorf("Usage() = %v", got)
	}
	p.SetUsage(1, 45, 100) // back under
	if seen := services(); seen[1] == 0 || seen[2] == 0 {
		t.Fatalf("back at 45 %%: picks per service %v, want both", seen)
	}
	if s := stateOf(t, p, a[0].ID()); s.State != Healthy {
		t.Errorf("state = %s, want healthy", s.State)
	}
	// A limit of 0 is no limit: never over quota, and forgotten.
	p.SetUsage(1, 1e9, 0)
	if seen := services(); seen[1] == 0 {
		t.Errorf("without a limit: picks per service %v", seen)
	}
	if got := p.Usage(); len(got) != 0 {
		t.Errorf("Usage() = %v after a limit of 0", got)
	}

	var evs []Event
	var kinds []EventKind
	for _, e := range events.Events(EventFilter{}) {
		if e.Kind != EventQuota && e.Kind != EventQuotaOK {
			continue
		}
		if e.Upstream != "" || e.Service != 1 {
			t.Errorf("quota event: %+v", e)
		}
		evs = append(evs, e)
		kinds = append(kinds, e.Kind)
	}
	if want := []EventKind{EventQuotaOK, EventQuota}; !slices.Equal(kinds, want) {
		t.Errorf("service 1 events newest first = %v, want %v (%+v)", kinds, want, evs)
	}
	if len(evs) == 2 && !strings.Contains(evs[1].Reason, "usage 60 of limit 100") {
		t.Errorf("quota reason = %q", evs[1].Reason)
	}
}

// TestMatch: an upstream's Match is shown in /pool as "match", and is not
// part of its identity: a new Match keeps the upstream's state.
func TestMatch(t *testing.T) {
	p := newTestPool(t, conf(func(c *Config) { c.MaxEjectedPercent = 100 }), Options{Now: newClock().Now})
	set := sessions(1, 2, "198.51.100.1")
	set[0].Match = "record"
	p.Update(set)
	id := set[0].ID()
	fail(p, handle(p, set[0]), 3)
	if s := stateOf(t, p, id); s.Match != "record" || s.State != Ejected {
		t.Fatalf("%s: match %q, state %s", id, s.Match, s.State)
	}
	if s := stateOf(t, p, set[1].ID()); s.Match != "" {
		t.Errorf("%s: match %q, want empty", set[1].ID(), s.Match)
	}
	set[0].Match = "list"
	p.Update(set)
	if set[0].ID() != id {
		t.Fatalf("ID changed with match: %s", set[0].ID())
	}
	s := stateOf(t, p, id)
	if s.Match != "list" || s.State != Ejected || s.Ejections != 1 {
		t.Errorf("after a new match: %+v", s)
	}
	b, err := json.Marshal(s)
	if err != nil || !strings.Contains(string(b), `"match":"list"`) {
		t.Errorf("JSON %s, %v", b, err)
	}
}

// TestGatewayByNameLeavesOnItsIP: a gateway dialed by host name is named by
// its IP in the provider's status lists (StatusIP); listed there, it leaves
// the pool; a refresh that learns the IP only later applies the status
// already known.
func TestGatewayByNameLeavesOnItsIP(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, DefaultConfig(), Options{Now: clk.Now})
	gw := Upstream{Service: 7, Kind: PPR, Protocol: HTTP, Address: "gw1.example.net:3000", StatusIP: "192.0.2.21"}
	other := Upstream{Service: 7, Kind: PPR, Protocol: HTTP, Address: "gw2.example.net:3000", StatusIP: "192.0.2.22"}
	p.Update([]Upstream{gw, other})
	p.SetProviderStatus(7, []string{"192.0.2.21"}, nil)
	if s := stateOf(t, p, gw.ID()); s.State != ProviderError {
		t.Errorf("gateway whose IP is errored: state = %s", s.State)
	}
	if s := stateOf(t, p, other.ID()); s.State != Healthy {
		t.Errorf("the other gateway: state = %s", s.State)
	}
	// The name did not resolve at first: nothing to match; once it does,
	// the status in force applies.
	other.StatusIP = ""
	p.SetProviderStatus(7, []string{"192.0.2.22"}, nil)
	p.Update([]Upstream{gw, other})
	if s := stateOf(t, p, other.ID()); s.State != Healthy {
		t.Errorf("gateway with no known IP: state = %s", s.State)
	}
	other.StatusIP = "192.0.2.22"
	p.Update([]Upstream{gw, other})
	if s := stateOf(t, p, other.ID()); s.State != ProviderError {
		t.Errorf("gateway once its IP is known: state = %s", s.State)
	}
	// The changes a refresh makes are events, as any other way on or off
	// the lists is: errored while its IP was known (SetProviderStatus),
	// off when the refresh lost the IP, on again when it learned it.
	var kinds []EventKind
	for _, e := range p.events.Events(EventFilter{Upstream: other.ID()}) {
		kinds = append([]EventKind{e.Kind}, kinds...) // oldest first
	}
	if want := []EventKind{EventAdded, EventProviderError, EventProviderOK, EventProviderError}; !slices.Equal(kinds, want) {
		t.Errorf("events of %s: %v, want %v", other.ID(), kinds, want)
	}
}

// A retiring listener slice (a listener a reload removed, whose
// connections still pick under its name) serves their picks, and counts
// for nothing else: it caps no ejection, is in no panic and is not
// explained.
func TestRetiringSliceServesPicksOnly(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, conf(func(c *Config) { c.MaxEjectedPercent = 50 }), Options{Now: clk.Now, Rand: midRand})
	set := append(ups(1, 2), ups(2, 4)...)
	p.Update(set)
	p.SetListeners([]ListenerSlice{{Name: "all"}, {Name: "gone", Services: []int{1}, Retiring: true}})
	if u := pickReport(t, p, Request{Listener: "gone"}, Success); u.Service != 1 {
		t.Errorf("a pick under the retiring name got %s", u.ID())
	}
	// Both members of the retiring slice fail: its cap (1 of 2) would hold
	// the second in; all's (3 of 6) lets both out.
	fail(p, handle(p, set[0]), 3)
	fail(p, handle(p, set[1]), 3)
	for _, u := range set[:2] {
		if s := stateOf(t, p, u.ID()); s.State != Ejected {
			t.Errorf("%s: %s, want ejected (a retiring slice caps nothing)", u.ID(), s.State)
		}
	}
	for _, l := range p.Explain().Listeners {
		if l.Name == "gone" {
			t.Errorf("the retiring slice is explained: %+v", l)
		}
	}
}
