package pool

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestSetConfigKeepsState: a new configuration applies to the next pick
// (strategy, failure_threshold) while upstreams keep their health state,
// ejections and sticky assignments; a bad one changes nothing.
func TestSetConfigKeepsState(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, conf(func(c *Config) { c.MaxEjectedPercent = 100 }), Options{Now: clk.Now, Rand: midRand})
	p.SetListeners([]ListenerSlice{{Name: "http", Protocol: HTTP}})
	set := ups(1, 4)
	p.Update(set)
	ej := handle(p, set[0])
	fail(p, ej, 3)
	before := stateOf(t, p, set[0].ID())
	if before.State != Ejected {
		t.Fatalf("state = %s, want ejected", before.State)
	}
	keyed := mustPick(t, p, Request{Listener: "http", Key: "user\x00k"})
	p.Report(keyed, Success, time.Millisecond)
	p.Release(keyed, Request{Listener: "http", Key: "user\x00k"})
	fail(p, handle(p, set[3]), 1)

	// Round robin ignores connections in flight: a held upstream comes
	// round again.
	held := pickUntil(t, p, Request{Listener: "http"}, set[1].ID())
	again := false
	for range 6 {
		again = again || pickReport(t, p, Request{Listener: "http"}, Success).ID() == set[1].ID()
	}
	if !again {
		t.Fatalf("round-robin never came back to %s", set[1].ID())
	}

	bad := conf(func(c *Config) { c.Strategy = LeastConn; c.MaxEjectedPercent = 150; c.ProbeTimeout = 0 })
	err := p.SetConfig(bad)
	if err == nil || !strings.Contains(err.Error(), "max_ejected_percent: must be within 0–100, got 150") ||
		!strings.Contains(err.Error(), "probe_timeout: must be positive, got 0s") {
		t.Fatalf("SetConfig(bad) = %v", err)
	}
	if err := p.SetConfig(conf(func(c *Config) { c.ProbeInterval = time.Second })); err == nil {
		t.Errorf("SetConfig with probe_interval and no Prober: no error")
	}
	if got := p.Config(); got.Strategy != RoundRobin || got.MaxEjectedPercent != 100 {
		t.Fatalf("a refused config took effect: %+v", got)
	}

	next := conf(func(c *Config) { c.Strategy = LeastConn; c.FailureThreshold = 1; c.MaxEjectedPercent = 100 })
	if err := p.SetConfig(next); err != nil {
		t.Fatal(err)
	}
	if got := p.Config(); got != next {
		t.Errorf("Config() = %+v, want %+v", got, next)
	}
	// Least-conn: the held upstream is not picked while others are idle.
	for range 12 {
		if u := pickReport(t, p, Request{Listener: "http"}, Success); u.ID() == set[1].ID() || u.ID() == set[0].ID() {
			t.Fatalf("least-conn picked %s (held or ejected)", u.ID())
		}
	}
	p.Report(held, Success, time.Millisecond)
	p.Release(held, Request{Listener: "http"})
	// The ejection stays as it was; the sticky key keeps its upstream.
	if after := stateOf(t, p, set[0].ID()); after.State != Ejected || *after.EjectedUntil != *before.EjectedUntil || after.Failures != 3 {
		t.Errorf("ejection changed by SetConfig: before %+v, after %+v", before, after)
	}
	if s := stateOf(t, p, set[3].ID()); s.Failures != 1 {
		t.Errorf("failure count lost: %+v", s)
	}
	for range 3 {
		if u := pickReport(t, p, Request{Listener: "http", Key: "user\x00k"}, Success); u.ID() != keyed.ID() {
			t.Fatalf("sticky key moved from %s to %s", keyed.ID(), u.ID())
		}
	}
	// failure_threshold 1: one failure ejects.
	fail(p, handle(p, set[2]), 1)
	if s := stateOf(t, p, set[2].ID()); s.State != Ejected {
		t.Errorf("failure_threshold 1: one failure left %s %s", set[2].ID(), s.State)
	}
}

// TestSetConfigStickyLimits: a smaller sticky_max evicts the least recently
// used keys; sticky_max 0 turns stickiness off.
func TestSetConfigStickyLimits(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, conf(func(c *Config) { c.StickyMax = 100 }), Options{Now: clk.Now})
	p.SetListeners([]ListenerSlice{{Name: "http"}})
	p.Update(ups(1, 8))
	keys := make(map[string]string)
	for i := range 10 {
		k := fmt.Sprint("user\x00k", i)
		keys[k] = pickReport(t, p, Request{Listener: "http", Key: k}, Success).ID()
		clk.Advance(time.Millisecond)
	}
	if err := p.SetConfig(conf(func(c *Config) { c.StickyMax = 4 })); err != nil {
		t.Fatal(err)
	}
	if n := p.sticky.len(); n != 4 {
		t.Fatalf("%d keys after sticky_max 4", n)
	}
	for i := 6; i < 10; i++ {
		k := fmt.Sprint("user\x00k", i)
		if h := p.sticky.lookup("http", k); h == nil || h.id != keys[k] {
			t.Errorf("recent key %d lost or moved", i)
		}
	}
	if err := p.SetConfig(conf(func(c *Config) { c.StickyMax = 0 })); err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for range 8 {
		seen[pickReport(t, p, Request{Listener: "http", Key: "user\x00k9"}, Success).ID()] = true
	}
	if len(seen) != 8 || p.sticky.len() != 0 {
		t.Errorf("stickiness off: one key went to %d upstreams, %d keys held", len(seen), p.sticky.len())
	}
}

// TestSetConfigReevaluates: a new quota_headroom and a new ejection cap
// take effect at once, with their events.
func TestSetConfigReevaluates(t *testing.T) {
	clk := newClock()
	events := NewEventLog(0, nil, clk.Now)
	p := newTestPool(t, DefaultConfig(), Options{Now: clk.Now, Rand: midRand, Events: events})
	p.SetListeners([]ListenerSlice{{Name: "one"}})
	set := ups(1, 2)
	quotaSvc := sessions(2, 1, "198.51.100.1")
	quotaSvc[0].Session = ""
	p.Update(append(set, quotaSvc...))
	p.SetUsage(2, 60, 100)
	if s := stateOf(t, p, quotaSvc[0].ID()); s.State != Healthy {
		t.Fatalf("at 60 %% with headroom 1: %s", s.State)
	}
	if err := p.SetConfig(conf(func(c *Config) { c.QuotaHeadroom = 0.5 })); err != nil {
		t.Fatal(err)
	}
	if s := stateOf(t, p, quotaSvc[0].ID()); s.State != Quota {
		t.Errorf("at 60 %% with headroom 0.5: %s", s.State)
	}
	wantEvents(t, events, EventQuota, Event{Kind: EventQuota, Service: 2, Reason: "usage 60 of limit 100, at or over quota_headroom 0.5"})

	// Panic: of 3 eligible upstreams at 50 %, one may be ejected; the
	// second failing one is kept in.
	fail(p, handle(p, set[0]), 3)
	fail(p, handle(p, set[1]), 3)
	if !listenerOf(t, p, "one").Panic {
		t.Fatalf("not in panic: %+v", p.Explain())
	}
	if err := p.SetConfig(conf(func(c *Config) { c.QuotaHeadroom = 0.5; c.MaxEjectedPercent = 100 })); err != nil {
		t.Fatal(err)
	}
	if listenerOf(t, p, "one").Panic {
		t.Errorf("still in panic with room under the new cap")
	}
	wantEvents(t, events, EventPanicOver, Event{Kind: EventPanicOver, Reason: "one"})
	// The held upstream is ejected by its next failure.
	fail(p, handle(p, set[1]), 1)
	if s := stateOf(t, p, set[1].ID()); s.State != Ejected {
		t.Errorf("held upstream after the cap grew: %s", s.State)
	}
}

// TestSetConfigStartsProbing: Run picks up a new probe_interval.
func TestSetConfigStartsProbing(t *testing.T) {
	var probes atomic.Int64
	prober := proberFunc(func(context.Context, *Upstream) Result { probes.Add(1); return Success })
	p := newTestPool(t, conf(func(c *Config) { c.MaxEjectedPercent = 100 }), Options{Prober: prober, Rand: midRand})
	set := ups(1, 2)
	p.Update(set)
	fail(p, handle(p, set[0]), 3)
	if s := stateOf(t, p, set[0].ID()); s.State != Ejected {
		t.Fatalf("state %s", s.State)
	}
	if err := p.SetConfig(conf(func(c *Config) { c.MaxEjectedPercent = 100; c.ProbeInterval = 5 * time.Millisecond })); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a probe to readmit the upstream", func() bool { return stateOf(t, p, set[0].ID()).State == Healthy })
	if probes.Load() == 0 {
		t.Errorf("readmitted without a probe")
	}
}

// TestSetConfigConcurrent swaps configurations while picks, reports and
// releases run (for the race detector), then checks the bookkeeping.
func TestSetConfigConcurrent(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, DefaultConfig(), Options{Now: clk.Now})
	p.SetListeners([]ListenerSlice{{Name: "all"}, {Name: "http", Protocol: HTTP}})
	set := append(ups(1, 20), sessions(2, 5, "198.51.100.1")...)
	p.Update(set)
	configs := []Config{
		DefaultConfig(),
		conf(func(c *Config) { c.Strategy = Latency; c.LatencyTolerance = 0; c.MaxEjectedPercent = 0 }),
		conf(func(c *Config) { c.Strategy = LeastConn; c.FailureThreshold = 1; c.StickyMax = 3 }),
		conf(func(c *Config) {
			c.Strategy = Random
			c.StickyMax = 0
			c.QuotaHeadroom = 0.1
			c.MaxEjectedPercent = 100
		}),
	}
	ctx, cancel := context.WithCancel(context.Background())
	var writer sync.WaitGroup
	writer.Add(1)
	go func() {
		defer writer.Done()
		for i := 0; ctx.Err() == nil; i++ {
			if err := p.SetConfig(configs[i%len(configs)]); err != nil {
				t.Error(err)
				return
			}
			p.SetUsage(2, 50, 100)
			clk.Advance(time.Second)
		}
	}()
	var wg sync.WaitGroup
	for w := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 2))
			for range 500 {
				req := Request{Listener: []string{"all", "http"}[rng.IntN(2)]}
				if rng.IntN(2) == 0 {
					req.Key = fmt.Sprint("w", w, "k", rng.IntN(10))
				}
				u, err := p.Pick(context.Background(), req)
				if err != nil {
					if !errors.Is(err, ErrNoUpstream) {
						t.Errorf("Pick: %v", err)
					}
					continue
				}
				p.Report(u, []Result{Success, Success, DialRefused}[rng.IntN(3)], time.Millisecond)
				p.Release(u, req)
			}
		}()
	}
	wg.Wait()
	cancel()
	writer.Wait()
	for _, u := range p.Explain().Upstreams {
		if u.InFlight != 0 {
			t.Errorf("%s: %d in flight", u.ID, u.InFlight)
		}
	}
	// The per-slice counts agree with the upstreams' own state.
	s := p.snap.Load()
	p.ejectMu.Lock()
	defer p.ejectMu.Unlock()
	for _, sl := range s.slices {
		var ejected, held int64
		for _, h := range sl.members {
			if h.ejectedUntil.Load() != 0 {
				ejected++
			}
			if h.held.Load() {
				held++
			}
		}
		if ejected != sl.ejected.Load() || held != sl.held.Load() {
			t.Errorf("slice %q: counted %d ejected, %d held; upstreams say %d, %d", sl.Name, sl.ejected.Load(), sl.held.Load(), ejected, held)
		}
	}
}
