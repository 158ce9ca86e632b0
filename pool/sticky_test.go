package pool

import (
	"context"
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"
)

func assignAll(t *testing.T, p *Pool, keys int) map[string]string {
	t.Helper()
	got := make(map[string]string, keys)
	for i := range keys {
		k := fmt.Sprintf("user1\x00key%d", i)
		got[k] = pickReport(t, p, Request{Key: k}, Success).ID()
	}
	return got
}

func TestStickyOnlyTheLostUpstreamsKeysMove(t *testing.T) {
	for _, how := range []string{"removed", "ejected", "provider_error"} {
		for _, strategy := range []string{RoundRobin, Random, LeastConn, Latency} {
			t.Run(how+"/"+strategy, func(t *testing.T) {
				clk := newClock()
				p := newTestPool(t, conf(func(c *Config) { c.Strategy = strategy }), Options{Now: clk.Now})
				const n, keys = 10, 1000
				set := ups(1, n)
				p.Update(set)
				before := assignAll(t, p, keys)
				lost := set[4]
				onLost := 0
				for _, id := range before {
					if id == lost.ID() {
						onLost++
					}
				}
				if onLost == 0 {
					t.Fatalf("no key on %s", lost.ID())
				}
				switch how {
				case "removed":
					p.Update(append(append([]Upstream{}, set[:4]...), set[5:]...))
				case "ejected":
					fail(p, handle(p, lost), 3)
				case "provider_error":
					p.SetProviderStatus(1, []string{hostPart(lost.Address)}, nil)
				}
				after := assignAll(t, p, keys)
				moved := 0
				for k, id := range after {
					switch {
					case before[k] == lost.ID():
						if id == lost.ID() {
							t.Fatalf("key %q stayed on the lost upstream", k)
						}
						moved++
					case id != before[k]:
						t.Fatalf("key %q moved from %s to %s though its upstream is fine", k, before[k], id)
					}
				}
				if moved != onLost {
					t.Errorf("%d keys moved, %d were on the lost upstream", moved, onLost)
				}
				// Each moved once: asking again changes nothing.
				if again := assignAll(t, p, keys); !equalMaps(again, after) {
					t.Errorf("keys moved a second time")
				}
				// The lost upstream recovers: its old keys stay where they are.
				switch how {
				case "removed":
					p.Update(set)
				case "ejected":
					clk.Advance(40 * time.Second) // past the ejection (30s ± 20 %), well within StickyIdle
					p.Report(handle(p, lost), Success, time.Millisecond)
				case "provider_error":
					p.SetProviderStatus(1, nil, nil)
				}
				if s := stateOf(t, p, lost.ID()); s.State != Healthy {
					t.Fatalf("recovered upstream: %s", s.State)
				}
				if again := assignAll(t, p, keys); !equalMaps(again, after) {
					t.Errorf("keys moved back after recovery")
				}
				// New keys use it again.
				seen := false
				for i := range 20 * n { // random: 0.9^200 odds of missing it
					if pickReport(t, p, Request{Key: fmt.Sprintf("new%d", i)}, Success).ID() == lost.ID() {
						seen = true
					}
				}
				if !seen {
					t.Errorf("no new key on the recovered upstream")
				}
			})
		}
	}
}

func equalMaps(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func TestStickyAvoidAndListeners(t *testing.T) {
	p := newTestPool(t, DefaultConfig(), Options{Now: newClock().Now})
	set := ups(1, 3)
	set[2].Protocol = SOCKS5
	p.Update(set)
	p.SetListeners([]ListenerSlice{{Name: "http", Protocol: HTTP}, {Name: "socks", Protocol: SOCKS5}})
	a := pickReport(t, p, Request{Listener: "http", Key: "k"}, Success)
	// A retry that already tried the key's upstream goes elsewhere, once.
	b := pickReport(t, p, Request{Listener: "http", Key: "k", Avoid: []string{a.ID()}}, DialRefused)
	if b.ID() == a.ID() {
		t.Errorf("Avoid ignored")
	}
	if c := pickReport(t, p, Request{Listener: "http", Key: "k"}, Success); c.ID() != a.ID() {
		t.Errorf("key moved by a retry: %s, want %s", c.ID(), a.ID())
	}
	// The same key on another listener is its own assignment.
	if s := pickReport(t, p, Request{Listener: "socks", Key: "k"}, Success); s.ID() != set[2].ID() {
		t.Errorf("socks listener: %s", s.ID())
	}
	if c := pickReport(t, p, Request{Listener: "http", Key: "k"}, Success); c.ID() != a.ID() {
		t.Errorf("key moved by another listener's pick: %s", c.ID())
	}
}

func TestStickyTableCapAndIdle(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, conf(func(c *Config) { c.StickyMax = 100; c.StickyIdle = time.Minute }), Options{Now: clk.Now})
	p.Update(ups(1, 5))
	for i := range 150 {
		pickReport(t, p, Request{Key: fmt.Sprint(i)}, Success)
		clk.Advance(time.Millisecond)
	}
	if n := p.sticky.len(); n != 100 {
		t.Fatalf("table holds %d keys, cap 100", n)
	}
	for i := range 150 {
		if got := p.sticky.lookup("", fmt.Sprint(i)) != nil; got != (i >= 50) {
			t.Fatalf("key %d present %v", i, got)
		}
	}
	// Using a key makes it recent: the next eviction takes the one after it.
	pickReport(t, p, Request{Key: "50"}, Success)
	pickReport(t, p, Request{Key: "new"}, Success)
	if p.sticky.lookup("", "50") == nil || p.sticky.lookup("", "51") != nil {
		t.Errorf("evicted the wrong key")
	}
	// Idle keys expire, in the sweep and on lookup.
	clk.Advance(30 * time.Second)
	pickReport(t, p, Request{Key: "52"}, Success)
	clk.Advance(31 * time.Second)
	p.sweep()
	if n := p.sticky.len(); n != 1 || p.sticky.lookup("", "52") == nil {
		t.Errorf("after the sweep: %d keys, want only the one used 31s ago", n)
	}
	clk.Advance(time.Minute)
	pickReport(t, p, Request{Key: "52"}, Success) // expired: assigned afresh
	if n := p.sticky.len(); n != 1 {
		t.Errorf("%d keys", n)
	}
}

func TestStickyTableShards(t *testing.T) {
	for _, tt := range []struct{ max, shards int }{{1, 1}, {100, 1}, {2048, 2}, {100000, 64}, {10000000, 64}} {
		st := newStickyTable(tt.max)
		if len(st.shards) != tt.shards || int(st.perShard.Load())*len(st.shards) < tt.max {
			t.Errorf("max %d: %d shards of %d", tt.max, len(st.shards), st.perShard.Load())
		}
	}
}

func TestStickyShardHashCollisions(t *testing.T) {
	s := &stickyShard{m: map[uint64]*stickyEntry{}}
	hs := makeHosts(make([]hostSpec, 4), 0)
	keys := []stickyKey{{"a", "k"}, {"b", "k"}, {"c", "k"}, {"a", "other"}}
	for i, k := range keys {
		hash := uint64(7)
		if i == 3 {
			hash = 8
		}
		s.add(k, hash, hs[i], int64(i+1), 10)
		s.release(k, hash, int64(i+1), 10)
	}
	for i, k := range keys[:3] {
		if e := s.get(k, 7, 10, 100); e == nil || e.h != hs[i] {
			t.Fatalf("key %v: %v", k, e)
		}
	}
	s.remove(s.find(keys[1], 7)) // the middle of the chain
	if s.find(keys[1], 7) != nil || s.find(keys[0], 7) == nil || s.find(keys[2], 7) == nil || s.n != 3 {
		t.Errorf("after removing the middle: n=%d", s.n)
	}
	s.remove(s.find(keys[2], 7)) // the head of the chain (added last)
	s.remove(s.find(keys[0], 7))
	if len(s.m) != 1 || s.n != 1 || s.head != s.tail || s.head.k != keys[3] {
		t.Errorf("after removing all of the chain: %d hashes, n=%d", len(s.m), s.n)
	}
	// Idle entries go on lookup.
	if s.get(keys[3], 8, 1000, 100) != nil || s.n != 0 || s.head != nil {
		t.Errorf("idle entry kept")
	}
}

// A key with a connection open neither idles out nor is evicted, however
// long the connection lasts; its idle time starts when the last of its
// connections ends.
func TestStickyKeyInUseStays(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, conf(func(c *Config) { c.StickyMax = 3; c.StickyIdle = time.Minute }), Options{Now: clk.Now})
	p.Update(ups(1, 5))
	long := Request{Key: "long"}
	u := mustPick(t, p, long) // a tunnel that stays open
	p.Report(u, Success, time.Millisecond)
	clk.Advance(2 * time.Minute)
	p.sweep()
	if h := p.sticky.lookup("", "long"); h == nil || h.id != u.ID() {
		t.Fatalf("a key in use expired in the sweep")
	}
	clk.Advance(2 * time.Minute)
	if again := pickReport(t, p, long, Success); again.ID() != u.ID() {
		t.Fatalf("a second connection of the key in use got %s, want %s", again.ID(), u.ID())
	}
	// New keys fill the table past it: the key in use is not evicted.
	for _, k := range []string{"b", "c", "d", "e"} {
		pickReport(t, p, Request{Key: k}, Success)
		clk.Advance(time.Millisecond)
	}
	if p.sticky.lookup("", "long") == nil || p.sticky.lookup("", "b") != nil || p.sticky.lookup("", "c") != nil {
		t.Fatalf("eviction took the key in use, or kept the oldest unused keys")
	}
	if n := p.sticky.len(); n != 3 {
		t.Errorf("table holds %d keys, want 3", n)
	}
	p.Release(u, long)
	clk.Advance(59 * time.Second)
	p.sweep()
	if p.sticky.lookup("", "long") == nil {
		t.Fatalf("expired less than sticky_idle after its connection ended")
	}
	clk.Advance(2 * time.Second)
	p.sweep()
	if p.sticky.lookup("", "long") != nil {
		t.Errorf("kept past sticky_idle after its connection ended")
	}
}

// Keys held past the table's size leave it, least recently released
// first, as their connections end. A pick made with stickiness off counts
// its key in use too, so that its Release after a reload that turns
// stickiness on does not take another connection's count.
func TestStickyKeysHeldPastTheSize(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, conf(func(c *Config) { c.StickyMax = 2 }), Options{Now: clk.Now})
	p.Update(ups(1, 5))
	var held []*Upstream
	for _, k := range []string{"a", "b", "c"} {
		held = append(held, mustPick(t, p, Request{Key: k}))
	}
	if n := p.sticky.len(); n != 3 {
		t.Fatalf("table holds %d keys in use, want all 3", n)
	}
	for i, k := range []string{"a", "b", "c"} {
		p.Report(held[i], Success, time.Millisecond)
		p.Release(held[i], Request{Key: k})
		clk.Advance(time.Millisecond)
	}
	if n := p.sticky.len(); n != 2 || p.sticky.lookup("", "a") != nil {
		t.Fatalf("after the releases: %d keys, a kept %v", n, p.sticky.lookup("", "a") != nil)
	}
	// Stickiness off, then on again: the old pick's Release leaves the
	// new connection's key held.
	if err := p.SetConfig(conf(func(c *Config) { c.StickyMax = 0 })); err != nil {
		t.Fatal(err)
	}
	offPick := mustPick(t, p, Request{Key: "x"})
	if err := p.SetConfig(conf(func(c *Config) { c.StickyMax = 2 })); err != nil {
		t.Fatal(err)
	}
	x := mustPick(t, p, Request{Key: "x"})
	p.Release(offPick, Request{Key: "x"})
	for _, k := range []string{"y", "z"} {
		pickReport(t, p, Request{Key: k}, Success)
	}
	if p.sticky.lookup("", "x") == nil {
		t.Errorf("a key in use was evicted after the Release of a pick made with stickiness off")
	}
	p.Release(x, Request{Key: "x"})
}

// A key whose rotation outlasts rotate_wait is in use by the connection
// that fell back to another session: it stays on its session, entered
// again if the table dropped it during the wait.
func TestStickyFallbackHoldsTheKey(t *testing.T) {
	clk := newClock()
	rot := &fakeRotator{fn: func(ctx context.Context, _ string) (string, error) {
		<-ctx.Done() // never answers; Run's end cancels it
		return "", ctx.Err()
	}}
	p := newTestPool(t, conf(func(c *Config) { c.RotateWait = time.Second; c.StickyMax = 1; c.StickyIdle = time.Minute }),
		Options{Now: clk.Now, Rotator: rot})
	ss := sessions(7, 3, "198.51.100.1")
	p.Update(ss)
	key := stickyOn(t, p, ss[0].ID())
	fail(p, handle(p, ss[0]), 1) // its rotation starts, and never ends
	got := pickLater(t, p, Request{Key: key})
	r := rotationOf(handle(p, ss[0]))
	waitFor(t, "the key's pick to wait", func() bool { return r.waiting.Load() == 1 })
	pickReport(t, p, Request{Key: "other"}, Success) // evicts the waiting key
	if p.sticky.lookup("", key) != nil {
		t.Fatalf("the waiting key was not evicted: the test does not test")
	}
	u := <-got
	if u == nil || u.ID() == ss[0].ID() {
		t.Fatalf("fallback: %+v", u)
	}
	if h := p.sticky.lookup("", key); h == nil || h.id != ss[0].ID() {
		t.Fatalf("the key is not on its session after the fallback")
	}
	clk.Advance(2 * time.Minute)
	p.sweep()
	if h := p.sticky.lookup("", key); h == nil || h.id != ss[0].ID() {
		t.Errorf("the fallback connection's key expired under it")
	}
	p.Report(u, Success, time.Millisecond)
	p.Release(u, Request{Key: key})
}

// A key whose session rotates again and again stays on it: a pick that
// comes as a rotation ends (its bit not yet cleared) waits for the end
// and tries again, and never reassigns the key. Picks race rotations
// here, as a busy key's do.
func TestStickyKeyStaysAcrossRotationEnds(t *testing.T) {
	clk := newClock()
	rot := &fakeRotator{fn: func(context.Context, string) (string, error) { return "203.0.113.200", nil }}
	p := newTestPool(t, conf(func(c *Config) {
		c.RotateInterval, c.RotateWait, c.FailureThreshold = 0, 0, 1000000
	}), Options{Now: clk.Now, Rand: midRand, Rotator: rot})
	ss := sessions(7, 2, "192.0.2.1")
	p.Update(append(ss, ups(8, 2)...))
	key := stickyOn(t, p, ss[0].ID())
	u := handle(p, ss[0])
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { // the session keeps failing: a rotation after each
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			u.h.inFlight.Add(1)
			p.Report(u, DialRefused, time.Millisecond)
			p.Release(u, Request{})
			runtime.Gosched()
		}
	}()
	deadline := time.Now().Add(2 * time.Second)
	for i := 0; i < 50000 && time.Now().Before(deadline); i++ {
		req := Request{Key: key}
		g, err := p.Pick(context.Background(), req)
		if err != nil {
			continue
		}
		p.Report(g, Canceled, 0)
		p.Release(g, req)
		if h := p.sticky.lookup("", key); h == nil || h.id != ss[0].ID() {
			close(stop)
			<-done
			t.Fatalf("pick %d: the key left its rotating session for %v", i, h)
		}
	}
	close(stop)
	<-done
}

// A pick that waited for its key's rotation, and finds another begun as
// that one ended, does not wait again nor move the key: this connection
// goes elsewhere, the key stays on its session.
func TestStickyKeyStaysWhenAnotherRotationFollows(t *testing.T) {
	clk := newClock()
	gate := make(chan struct{})
	rot := &fakeRotator{fn: func(ctx context.Context, _ string) (string, error) {
		select {
		case <-gate:
			return "203.0.113.200", nil
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}}
	var p *Pool
	var again atomic.Pointer[func()]
	p = newTestPool(t, conf(func(c *Config) {
		c.RotateInterval, c.RotateWait, c.FailureThreshold = 0, 5*time.Second, 1000000
	}), Options{Now: clk.Now, Rand: midRand, Rotator: rot, Hooks: Hooks{Rotated: func(int, string) {
		if f := again.Swap(nil); f != nil {
			(*f)() // as the first rotation ends, the session fails again
		}
	}}})
	defer close(gate)
	ss := sessions(7, 2, "192.0.2.1")
	p.Update(append(ss, ups(8, 2)...))
	for i := range 20 {
		key := stickyOn(t, p, ss[0].ID())
		u := handle(p, ss[0])
		fail(p, u, 1) // rotation 1
		got := pickLater(t, p, Request{Key: key})
		r := rotationOf(u)
		waitFor(t, "the key's pick to wait", func() bool { return r.waiting.Load() == 1 })
		next := func() { fail(p, handle(p, ss[0]), 1) } // rotation 2
		again.Store(&next)
		gate <- struct{}{}
		g := <-got
		if g == nil {
			t.Fatal("no pick")
		}
		p.Report(g, Canceled, 0)
		p.Release(g, Request{Key: key})
		if h := p.sticky.lookup("", key); h == nil || h.id != ss[0].ID() {
			t.Fatalf("round %d: the key moved to %v", i, h)
		}
		gate <- struct{}{} // rotation 2 ends
		waitFor(t, "rotation 2 to end", func() bool { return rotationOf(handle(p, ss[0])) == nil })
	}
}

// The connection of a key whose session rotates too long goes to another
// session of its service, unless that service is at its quota while
// another can serve.
func TestStickyFallbackMindsQuota(t *testing.T) {
	clk := newClock()
	rot := &fakeRotator{fn: func(ctx context.Context, _ string) (string, error) {
		<-ctx.Done() // never answers; Run's end cancels it
		return "", ctx.Err()
	}}
	p := newTestPool(t, conf(func(c *Config) { c.RotateWait = 10 * time.Millisecond }), Options{Now: clk.Now, Rand: midRand, Rotator: rot})
	ss := sessions(7, 2, "192.0.2.1")
	p.Update(append(ss, ups(8, 2)...))
	key := stickyOn(t, p, ss[0].ID())
	p.SetUsage(7, 100, 100)      // service 7 at its quota; the key stays on its session
	fail(p, handle(p, ss[0]), 1) // its rotation starts, and never ends
	g := mustPick(t, p, Request{Key: key})
	if g.Service == 7 {
		t.Errorf("the fallback took %s of the service at its quota while service 8 can serve", g.ID())
	}
	p.Report(g, Canceled, 0)
	p.Release(g, Request{Key: key})
	if h := p.sticky.lookup("", key); h == nil || h.id != ss[0].ID() {
		t.Errorf("the key moved to %v", h)
	}
}

// A rotating bit that outlived its rotation (none under way) does not hold
// a key's pick for ever, nor crash it: after a few looks the connection
// goes elsewhere and the key stays.
func TestStickyStaleRotatingBit(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, conf(func(c *Config) { c.RotateWait = 5 * time.Second }), Options{Now: clk.Now, Rand: midRand})
	ss := sessions(7, 2, "192.0.2.1")
	p.Update(append(ss, ups(8, 2)...))
	key := stickyOn(t, p, ss[0].ID())
	handle(p, ss[0]).h.setFlags(fRotating, fRotating) // no rotation behind it
	u := mustPick(t, p, Request{Key: key})
	if u.ID() == ss[0].ID() {
		t.Errorf("picked the session flagged rotating")
	}
	p.Report(u, Canceled, 0)
	p.Release(u, Request{Key: key})
	if h := p.sticky.lookup("", key); h == nil || h.id != ss[0].ID() {
		t.Errorf("the key moved to %v", h)
	}
}
