package pool

import (
	"context"
	"errors"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestEjectionCountsOnlyUpstreamFaults(t *testing.T) {
	var failures, ejections int
	clk := newClock()
	p := newTestPool(t, conf(func(c *Config) { c.MaxEjectedPercent = 100 }), Options{Now: clk.Now, Hooks: Hooks{
		Failure: func(int, Result) { failures++ },
		Ejected: func(int) { ejections++ },
	}})
	set := ups(1, 2)
	p.Update(set)
	u := handle(p, set[0])
	report := func(r Result) {
		u.h.inFlight.Add(1)
		p.Report(u, r, time.Millisecond)
		p.Release(u, Request{})
	}
	tests := []struct {
		results []Result
		consec  int64
		state   State
	}{
		{[]Result{DestinationError, DestinationError, DestinationError, Canceled, Canceled}, 0, Healthy},
		{[]Result{DialRefused, DialTimeout}, 2, Healthy},
		{[]Result{DestinationError, Success}, 0, Healthy}, // a success resets the count
		{[]Result{HandshakeTimeout, AuthRejected}, 2, Healthy},
		{[]Result{Canceled, ProxyError}, 3, Ejected},
	}
	for i, tt := range tests {
		for _, r := range tt.results {
			report(r)
		}
		s := stateOf(t, p, u.ID())
		if s.ConsecutiveFailures != tt.consec || s.State != tt.state {
			t.Errorf("step %d: consecutive %d state %s, want %d %s", i, s.ConsecutiveFailures, s.State, tt.consec, tt.state)
		}
	}
	s := stateOf(t, p, u.ID())
	if s.Failures != 5 || failures != 5 || ejections != 1 || s.Reason != "proxy_error" {
		t.Errorf("failures %d (hook %d), ejections hook %d, reason %q", s.Failures, failures, ejections, s.Reason)
	}
	if s.EjectedUntil == nil {
		t.Fatal("no ejected_until")
	}
	for range 10 {
		if got := pickReport(t, p, Request{}, Success); got.ID() == u.ID() {
			t.Fatal("picked an ejected upstream")
		}
	}
}

// midRand makes the jitter factor exactly 1.
func midRand() uint64 { return 1 << 63 }

func TestEjectionBackoffGrowsToCap(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, conf(func(c *Config) { c.MaxEjectedPercent = 100 }), Options{Now: clk.Now, Rand: midRand})
	set := ups(1, 2)
	p.Update(set)
	u := handle(p, set[0])
	fail(p, u, 3)
	want := []time.Duration{30 * time.Second, time.Minute, 2 * time.Minute, 4 * time.Minute, 5 * time.Minute, 5 * time.Minute}
	for k, d := range want {
		s := stateOf(t, p, u.ID())
		if s.State != Ejected || s.Ejections != int64(k+1) {
			t.Fatalf("ejection %d: %+v", k+1, s)
		}
		if got := s.EjectedUntil.Sub(clk.Now()); got != d {
			t.Errorf("ejection %d lasts %s, want %s", k+1, got, d)
		}
		clk.Advance(d - time.Second)
		if s := stateOf(t, p, u.ID()); s.State != Ejected {
			t.Fatalf("ejection %d over a second early: %s", k+1, s.State)
		}
		clk.Advance(time.Second)
		if s := stateOf(t, p, u.ID()); s.State != Probing {
			t.Fatalf("after ejection %d: %s, want probing", k+1, s.State)
		}
		// The trial connection fails: ejected again, for longer.
		trial := pickUntil(t, p, Request{}, u.ID())
		p.Report(trial, DialTimeout, time.Second)
		p.Release(trial, Request{})
	}
	// A success after the ejection re-admits; a long healthy stretch
	// forgets the history.
	clk.Advance(5 * time.Minute)
	p.Report(u, Success, time.Millisecond)
	if s := stateOf(t, p, u.ID()); s.State != Healthy {
		t.Fatalf("after success: %s", s.State)
	}
	clk.Advance(5 * time.Minute)
	p.Report(u, Success, time.Millisecond)
	fail(p, u, 3)
	if s := stateOf(t, p, u.ID()); s.EjectedUntil.Sub(clk.Now()) != 30*time.Second {
		t.Errorf("after a healthy stretch: ejected for %s, want the base 30s", s.EjectedUntil.Sub(clk.Now()))
	}
}

func TestEjectionJitterBounds(t *testing.T) {
	cfg := conf(func(c *Config) { c.EjectBase = 10 * time.Second; c.EjectMax = 100 * time.Second })
	for _, tt := range []struct {
		name string
		rand func() uint64
	}{
		{"low", func() uint64 { return 0 }},
		{"high", func() uint64 { return math.MaxUint64 }},
		{"random", nil},
	} {
		p, err := New(cfg, Options{Rand: tt.rand})
		if err != nil {
			t.Fatal(err)
		}
		for k := 1; k <= 6; k++ {
			nominal := min(10*time.Second<<(k-1), 100*time.Second)
			lo, hi := time.Duration(float64(nominal)*0.8), min(time.Duration(float64(nominal)*1.2), 100*time.Second)
			var seenLo, seenHi time.Duration = math.MaxInt64, 0
			for range 2000 {
				d := p.ejectDuration(p.cfg.Load(), k)
				if d < lo || d > hi {
					t.Fatalf("%s: ejection %d: %s outside [%s, %s]", tt.name, k, d, lo, hi)
				}
				seenLo, seenHi = min(seenLo, d), max(seenHi, d)
			}
			switch tt.name {
			case "low":
				if seenLo != lo {
					t.Errorf("low: ejection %d: %s, want %s", k, seenLo, lo)
				}
			case "high":
				if hi-seenHi > time.Millisecond {
					t.Errorf("high: ejection %d: %s, want %s", k, seenHi, hi)
				}
			case "random":
				// The spread is used: both ends of the band are approached.
				if seenLo > lo+(hi-lo)/10 || (nominal < 100*time.Second && seenHi < hi-(hi-lo)/10) {
					t.Errorf("random: ejection %d: seen [%s, %s] of [%s, %s]", k, seenLo, seenHi, lo, hi)
				}
			}
		}
	}
}

func TestProbingOneTrialAtATime(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, conf(func(c *Config) { c.MaxEjectedPercent = 100 }), Options{Now: clk.Now, Rand: midRand})
	set := ups(1, 3)
	p.Update(set)
	u := handle(p, set[0])
	fail(p, u, 3)
	clk.Advance(30 * time.Second)
	// Many picks: exactly one of them is the trial on u.
	var held []*Upstream
	trials := 0
	for range 30 {
		got, err := p.Pick(context.Background(), Request{})
		if err != nil {
			t.Fatal(err)
		}
		if got.ID() == u.ID() {
			trials++
		}
		held = append(held, got)
	}
	if trials != 1 {
		t.Fatalf("%d trial connections on a probing upstream, want 1", trials)
	}
	if s := stateOf(t, p, u.ID()); s.State != Probing || s.InFlight != 1 {
		t.Errorf("during the trial: %+v", s)
	}
	// A cancelled trial gives no verdict: another connection tries.
	for _, h := range held {
		r := Success
		if h.ID() == u.ID() {
			r = Canceled
		}
		p.Report(h, r, time.Millisecond)
		p.Release(h, Request{})
	}
	if s := stateOf(t, p, u.ID()); s.State != Probing {
		t.Fatalf("after a cancelled trial: %s", s.State)
	}
	trial := pickUntil(t, p, Request{}, u.ID())
	p.Report(trial, Success, time.Millisecond)
	p.Release(trial, Request{})
	if s := stateOf(t, p, u.ID()); s.State != Healthy || s.InFlight != 0 || s.ConsecutiveFailures != 0 {
		t.Errorf("after a successful trial: %+v", s)
	}
	n := 0
	for range 30 {
		if pickReport(t, p, Request{}, Success).ID() == u.ID() {
			n++
		}
	}
	if n != 10 {
		t.Errorf("re-admitted upstream took %d of 30 round-robin picks, want 10", n)
	}
}

func TestEjectionCapAndPanic(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, DefaultConfig(), Options{Now: clk.Now, Rand: midRand})
	set := ups(1, 4)
	p.Update(set)
	p.SetListeners([]ListenerSlice{{Name: "l"}})
	a, b, c, d := handle(p, set[0]), handle(p, set[1]), handle(p, set[2]), handle(p, set[3])
	fail(p, a, 3)
	fail(p, b, 3)
	if l := listenerOf(t, p, "l"); l.Usable != 2 || l.Panic {
		t.Fatalf("two of four ejected: %+v", l)
	}
	// The cap (50 % of 4) is reached: c stays in, with its failures counted.
	fail(p, c, 5)
	s := stateOf(t, p, c.ID())
	if s.State != Healthy || s.ConsecutiveFailures != 5 || s.Reason == "" {
		t.Errorf("c past the cap: %+v", s)
	}
	if l := listenerOf(t, p, "l"); !l.Panic || l.Usable != 2 {
		t.Errorf("panic not shown: %+v", l)
	}
	seen := map[string]bool{}
	for range 20 {
		u := mustPick(t, p, Request{Listener: "l"})
		seen[u.ID()] = true
		p.Report(u, Canceled, 0)
		p.Release(u, Request{Listener: "l"})
	}
	if !seen[c.ID()] || !seen[d.ID()] || len(seen) != 2 {
		t.Errorf("in panic, picked %v; want c and d", seen)
	}
	// d fails too: panic, clients still served.
	fail(p, d, 3)
	if u := mustPick(t, p, Request{Listener: "l"}); u.ID() != c.ID() && u.ID() != d.ID() {
		t.Errorf("picked %s", u.ID())
	} else {
		p.Report(u, Canceled, 0)
		p.Release(u, Request{Listener: "l"})
	}
	// d recovers: still panic because of c.
	p.Report(d, Success, time.Millisecond)
	if l := listenerOf(t, p, "l"); !l.Panic {
		t.Errorf("panic left while c still failing: %+v", l)
	}
	// a's ejection ends and its trial succeeds: room under the cap, so c's
	// next failure ejects it and the panic is over.
	clk.Advance(30 * time.Second)
	p.Report(a, Success, time.Millisecond)
	if s := stateOf(t, p, a.ID()); s.State != Healthy {
		t.Fatalf("a: %s", s.State)
	}
	fail(p, c, 1)
	if s := stateOf(t, p, c.ID()); s.State != Ejected {
		t.Errorf("c with room under the cap: %s", s.State)
	}
	if l := listenerOf(t, p, "l"); l.Panic || l.Usable != 3 { // a, d, and b probing
		t.Errorf("after c's ejection: %+v", l)
	}
	// Entering again and leaving through a success.
	fail(p, d, 3)
	if l := listenerOf(t, p, "l"); !l.Panic {
		t.Errorf("d past the cap: %+v", l)
	}
	p.Report(d, Success, time.Millisecond)
	if l := listenerOf(t, p, "l"); l.Panic {
		t.Errorf("d recovered: %+v", l)
	}
}

// The ejection cap is a share of the upstreams the provider does not
// exclude, and only those count against it: one the provider lists after
// its ejection (or while it is kept in failing) cannot be tried while
// listed, and must not hold a place under the cap meanwhile.
func TestProviderExcludedUpstreamsLeaveTheEjectionCap(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, DefaultConfig(), Options{Now: clk.Now, Rand: midRand})
	p.SetListeners([]ListenerSlice{{Name: "l"}})
	set := ups(1, 6)
	p.Update(set)
	a, b, c, d, e := handle(p, set[0]), handle(p, set[1]), handle(p, set[2]), handle(p, set[3]), handle(p, set[4])
	fail(p, a, 3)
	fail(p, b, 3)
	fail(p, c, 3) // 3 of 6: the cap
	fail(p, d, 3) // held
	if s := stateOf(t, p, d.ID()); s.State != Healthy {
		t.Fatalf("d past the cap: %s", s.State)
	}
	if l := listenerOf(t, p, "l"); !l.Panic {
		t.Fatalf("d held: %+v, want panic", l)
	}
	// The provider confirms that a and d are broken: 4 usable, cap 2,
	// b and c ejected, nothing usable held.
	p.SetProviderStatus(1, []string{"10.1.0.0", "10.1.0.3"}, nil)
	if l := listenerOf(t, p, "l"); l.Panic {
		t.Errorf("a and d listed: %+v, want no panic", l)
	}
	// It lists c too: 3 usable, cap 1, b ejected; e has no room.
	p.SetProviderStatus(1, []string{"10.1.0.0", "10.1.0.2", "10.1.0.3"}, nil)
	fail(p, e, 3)
	if s := stateOf(t, p, e.ID()); s.State != Healthy {
		t.Errorf("e with b ejected, 3 usable: %s", s.State)
	}
	if l := listenerOf(t, p, "l"); !l.Panic {
		t.Errorf("e held: %+v, want panic", l)
	}
	// b's trial succeeds: room for e, whatever a and c still say.
	clk.Advance(time.Minute)
	p.Report(b, Success, time.Millisecond)
	fail(p, e, 1)
	if s := stateOf(t, p, e.ID()); s.State != Ejected {
		t.Errorf("e with none of the 3 usable ejected: %s", s.State)
	}
	if l := listenerOf(t, p, "l"); l.Panic {
		t.Errorf("e ejected: %+v, want no panic", l)
	}
	// Off the lists, a, c and d count again: a and c are past their
	// ejections, probing, and with e fill the cap of 3; d, still failing,
	// is held.
	p.SetProviderStatus(1, nil, nil)
	if s := stateOf(t, p, a.ID()); s.State != Probing {
		t.Errorf("a off the list: %s, want probing", s.State)
	}
	if l := listenerOf(t, p, "l"); !l.Panic {
		t.Errorf("a, c and e ejected, d held: %+v, want panic", l)
	}
}

// capHolds checks the ejection cap on every slice of p: no more of its
// usable members are out by ejection (ejected or probing) than
// max_ejected_percent allows, its running figures agree with a recount,
// and it is in panic mode exactly when a failing member is held at the cap.
func capHolds(t *testing.T, p *Pool, when string) {
	t.Helper()
	p.ejectMu.Lock()
	defer p.ejectMu.Unlock()
	cfg, s := p.cfg.Load(), p.snap.Load()
	for _, sl := range s.slices {
		var eligible, ejected, held int64
		for _, h := range sl.members {
			if !capped(h.flags.Load()) {
				continue
			}
			eligible++
			if h.ejectedUntil.Load() != 0 {
				ejected++
			}
			if h.held.Load() {
				held++
			}
		}
		limit := int64(cfg.MaxEjectedPercent) * eligible / 100
		if ejected > limit {
			t.Errorf("%s: %s has %d of %d usable upstreams out by ejection, cap %d", when, sl.Name, ejected, eligible, limit)
		}
		if sl.eligible.Load() != eligible || sl.ejected.Load() != ejected || sl.held.Load() != held {
			t.Errorf("%s: %s counts eligible %d ejected %d held %d, a recount %d %d %d", when, sl.Name,
				sl.eligible.Load(), sl.ejected.Load(), sl.held.Load(), eligible, ejected, held)
		}
		if panic := held > 0 && ejected >= limit; sl.panic.Load() != panic {
			t.Errorf("%s: %s panic %v with %d ejected (cap %d) and %d held", when, sl.Name, sl.panic.Load(), ejected, limit, held)
		}
	}
}

// The ejection cap holds however the count got there: when ejected
// upstreams come back into it (off the provider's lists, back from
// draining) or the cap shrinks (a member listed, a lower
// max_ejected_percent), the ejections that would end first end at once and
// their upstreams stay in, held, with the listener in panic mode. The
// first case is a regression of counting only unlisted upstreams in the
// cap: ejections made while others were listed added up past it.
func TestEjectionCapHoldsInEveryOrder(t *testing.T) {
	const keptIn = "ejection ended early: past max_ejected_percent, kept in"
	setup := func(t *testing.T, n int) (*clock, *Pool, *EventLog, []Upstream, []*Upstream) {
		clk := newClock()
		events := NewEventLog(0, nil, clk.Now)
		p := newTestPool(t, DefaultConfig(), Options{Now: clk.Now, Rand: midRand, Events: events})
		p.SetListeners([]ListenerSlice{{Name: "l"}})
		set := ups(1, n)
		p.Update(set)
		var hs []*Upstream
		for _, u := range set {
			hs = append(hs, handle(p, u))
		}
		return clk, p, events, set, hs
	}
	countState := func(p *Pool, st State) int {
		n := 0
		for _, u := range p.Explain().Upstreams {
			if u.State == st {
				n++
			}
		}
		return n
	}
	// heldIn checks that u's ejection ended and it is in, held, failing.
	heldIn := func(t *testing.T, p *Pool, u *Upstream) {
		t.Helper()
		s := stateOf(t, p, u.ID())
		if s.State != Healthy || s.EjectedUntil != nil || s.ConsecutiveFailures < 3 || s.Ejections != 1 ||
			s.Reason != "failing, kept in by the ejection cap: dial_refused" {
			t.Errorf("%s after its ejection was ended early: %+v", u.ID(), s)
		}
	}

	t.Run("ejected upstreams come off the provider's list", func(t *testing.T) {
		_, p, events, _, hs := setup(t, 6)
		fail(p, hs[0], 3)
		fail(p, hs[1], 3)
		fail(p, hs[2], 3) // 3 of 6 ejected: the cap
		// The provider confirms a, b, c: base 3, cap 1, none counted.
		p.SetProviderStatus(1, []string{"10.1.0.0", "10.1.0.1", "10.1.0.2"}, nil)
		capHolds(t, p, "a, b, c listed")
		fail(p, hs[3], 3) // d is ejected
		capHolds(t, p, "d ejected")
		// The provider's next poll clears a, b, c while they are ejected:
		// 4 would be out of 6. a's ejection (the first to end; all end
		// together here, and a comes first) ends.
		p.SetProviderStatus(1, nil, nil)
		capHolds(t, p, "a, b, c off the list")
		if n := countState(p, Ejected); n != 3 {
			t.Errorf("%d of 6 ejected, cap 3", n)
		}
		heldIn(t, p, hs[0])
		if l := listenerOf(t, p, "l"); !l.Panic || l.Usable != 3 {
			t.Errorf("a held at the cap: %+v, want panic", l)
		}
		wantEvents(t, events, EventReadmitted, Event{Kind: EventReadmitted, Upstream: hs[0].ID(), Service: 1, Reason: keptIn})
		wantEvents(t, events, EventPanic, Event{Kind: EventPanic, Reason: "l"})
		// a works: the panic is over; it fails again: held, no room.
		p.Report(hs[0], Success, time.Millisecond)
		if l := listenerOf(t, p, "l"); l.Panic {
			t.Errorf("a recovered: %+v", l)
		}
		if st := hs[0].h.streak.Load(); st != 1 {
			t.Errorf("a's ejection streak after a success just after its early end: %d, want 1 (kept, as after a re-admission)", st)
		}
		fail(p, hs[0], 3)
		capHolds(t, p, "a failing again")
		if s := stateOf(t, p, hs[0].ID()); s.State != Healthy {
			t.Errorf("a at a full cap: %s", s.State)
		}
	})

	t.Run("the cap shrinks as a member is listed", func(t *testing.T) {
		clk, p, _, _, hs := setup(t, 6)
		fail(p, hs[0], 3)
		clk.Advance(time.Second)
		fail(p, hs[1], 3)
		fail(p, hs[2], 3)
		p.SetProviderStatus(1, []string{"10.1.0.5"}, nil) // base 5, cap 2
		capHolds(t, p, "f listed")
		heldIn(t, p, hs[0]) // the first ejected ends first
		if n := countState(p, Ejected); n != 2 {
			t.Errorf("%d ejected, cap 2", n)
		}
	})

	t.Run("a reload lowers max_ejected_percent", func(t *testing.T) {
		clk, p, _, _, hs := setup(t, 6)
		fail(p, hs[2], 3)
		clk.Advance(time.Second)
		fail(p, hs[1], 3)
		clk.Advance(time.Second)
		fail(p, hs[0], 3)
		if err := p.SetConfig(conf(func(c *Config) { c.MaxEjectedPercent = 20 })); err != nil { // cap 1
			t.Fatal(err)
		}
		capHolds(t, p, "cap lowered")
		heldIn(t, p, hs[2])
		heldIn(t, p, hs[1])
		if s := stateOf(t, p, hs[0].ID()); s.State != Ejected {
			t.Errorf("the last ejected: %s", s.State)
		}
	})

	t.Run("an ejected upstream comes back from draining", func(t *testing.T) {
		_, p, _, set, hs := setup(t, 7)
		fail(p, hs[0], 3)
		fail(p, hs[1], 3)
		fail(p, hs[2], 3)       // 3 of 7 ejected: the cap
		hs[0].h.inFlight.Add(1) // a connection through a, picked before
		p.Update(set[1:])       // a drains: base 6, cap 3, b and c ejected
		fail(p, hs[3], 3)       // d is ejected
		capHolds(t, p, "a draining, d ejected")
		p.Update(set) // a is back, still ejected: 4 of 7
		capHolds(t, p, "a back")
		if n := countState(p, Ejected); n != 3 {
			t.Errorf("%d of 7 ejected, cap 3", n)
		}
		heldIn(t, p, hs[0])
		p.Release(hs[0], Request{})
	})
}

// A failure reported late, by a connection picked before the provider
// listed its upstream, counts (in /pool and the Failure hook) but does not
// eject: the upstream counts in no cap while listed, and ejected there it
// would come back into the count past the cap.
func TestLateFailureOfExcludedUpstreamDoesNotEject(t *testing.T) {
	clk := newClock()
	var hooked []Result
	p := newTestPool(t, DefaultConfig(), Options{Now: clk.Now, Rand: midRand,
		Hooks: Hooks{Failure: func(_ int, r Result) { hooked = append(hooked, r) }}})
	p.SetListeners([]ListenerSlice{{Name: "l"}})
	set := ups(1, 6)
	p.Update(set)
	a, b, c, d := handle(p, set[0]), handle(p, set[1]), handle(p, set[2]), handle(p, set[3])
	fail(p, a, 3)
	fail(p, b, 3)
	c.h.inFlight.Add(3) // three connections through c, then the provider lists it
	p.SetProviderStatus(1, []string{"10.1.0.2"}, nil)
	for range 3 {
		p.Report(c, DialRefused, time.Millisecond)
		p.Release(c, Request{})
	}
	s := stateOf(t, p, c.ID())
	if s.State != ProviderError || s.Failures != 3 || s.ConsecutiveFailures != 3 || s.Ejections != 0 || len(hooked) != 9 {
		t.Errorf("c after late failures while listed: %+v; Failure hook told %d", s, len(hooked))
	}
	capHolds(t, p, "c listed")
	p.SetProviderStatus(1, nil, nil)
	capHolds(t, p, "c off the list")
	if s := stateOf(t, p, c.ID()); s.State != Healthy || s.Ejections != 0 {
		t.Errorf("c off the list: %+v", s)
	}
	fail(p, d, 3) // 3 of 6: the cap
	// c's next failure is weighed against the cap: held, panic.
	fail(p, c, 1)
	capHolds(t, p, "c failing again")
	if s, l := stateOf(t, p, c.ID()), listenerOf(t, p, "l"); s.State != Healthy || s.Ejections != 0 || !l.Panic {
		t.Errorf("c failing at a full cap: %+v, listener %+v", s, l)
	}
}

func TestSingleUpstreamNeverEjected(t *testing.T) {
	p := newTestPool(t, DefaultConfig(), Options{Now: newClock().Now})
	p.Update(ups(1, 1))
	for range 10 {
		pickReport(t, p, Request{}, DialRefused)
	}
	if l := p.Explain().Upstreams[0]; l.State != Healthy || l.ConsecutiveFailures != 10 {
		t.Errorf("%+v", l)
	}
}

func TestActiveProbe(t *testing.T) {
	clk := newClock()
	probed := map[string]int{}
	results := map[string]Result{}
	prober := proberFunc(func(_ context.Context, u *Upstream) Result {
		probed[u.ID()]++
		return results[u.ID()]
	})
	p, err := New(conf(func(c *Config) { c.MaxEjectedPercent = 100; c.ProbeInterval = time.Hour; c.ProbeBudget = 2 }), Options{Now: clk.Now, Rand: midRand, Prober: prober})
	if err != nil {
		t.Fatal(err)
	}
	set := ups(1, 10)
	p.Update(set)
	for i := range 3 {
		fail(p, handle(p, set[i]), 3)
		results[set[i].ID()] = DialRefused
	}
	results[set[1].ID()] = Success
	p.probeOnce(context.Background())
	p.probeOnce(context.Background()) // same minute: no budget left
	total := 0
	for id, n := range probed {
		total += n
		if id != set[0].ID() && id != set[1].ID() && id != set[2].ID() {
			t.Errorf("probed %s, which is not ejected", id)
		}
	}
	if total != 2 {
		t.Errorf("%d probes in a minute, budget 2", total)
	}
	clk.Advance(time.Minute)
	p.probeOnce(context.Background())
	p.probeOnce(context.Background())
	if probed[set[0].ID()] == 0 || probed[set[1].ID()] != 1 || probed[set[2].ID()] == 0 {
		t.Errorf("probes %v: want each ejected upstream probed, set[1] once", probed)
	}
	if s := stateOf(t, p, set[1].ID()); s.State != Healthy {
		t.Errorf("successful probe: %s", s.State)
	}
	if s := stateOf(t, p, set[0].ID()); s.State != Ejected {
		t.Errorf("failed probe: %s", s.State)
	}
	p.stopRotations()
}

// ejectedForProbe sets up a pool probed by prober whose first of three
// upstreams was ejected and whose ejection is over (a probe is its trial),
// with the Failure hook's results recorded in hooked.
func ejectedForProbe(t *testing.T, prober Prober) (p *Pool, u *Upstream, hooked *[]Result) {
	t.Helper()
	clk := newClock()
	hooked = new([]Result)
	p, err := New(conf(func(c *Config) { c.MaxEjectedPercent = 100; c.ProbeInterval = time.Hour }), Options{
		Now: clk.Now, Rand: midRand, Prober: prober,
		Hooks: Hooks{Failure: func(_ int, r Result) { *hooked = append(*hooked, r) }},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.stopRotations)
	set := ups(1, 3)
	p.Update(set)
	u = handle(p, set[0])
	fail(p, u, 3)
	clk.Advance(30 * time.Second)
	return p, u, hooked
}

// A failed probe is a failure of the upstream like any other: /pool's count
// and the Failure hook (proxyd_upstream_failures_total) move together.
func TestFailedProbeCountsAsFailure(t *testing.T) {
	p, u, hooked := ejectedForProbe(t, proberFunc(func(context.Context, *Upstream) Result { return HandshakeTimeout }))
	p.probeOnce(context.Background())
	s := stateOf(t, p, u.ID())
	if s.State != Ejected || s.Ejections != 2 || s.Reason != "handshake_timeout" {
		t.Errorf("after a failed probe: %+v", s)
	}
	if h := *hooked; s.Failures != 4 || len(h) != 4 || h[3] != HandshakeTimeout {
		t.Errorf("/pool counts %d failures, the Failure hook was told %v", s.Failures, h)
	}
}

// A probe cut short because Run is stopping says nothing about its
// upstream: no failure is counted, the upstream stays as it was.
func TestCutProbeCountsNothing(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	p, u, hooked := ejectedForProbe(t, proberFunc(func(pctx context.Context, _ *Upstream) Result {
		cancel() // Run stops while the probe waits
		<-pctx.Done()
		return HandshakeTimeout
	}))
	p.probeOnce(ctx)
	s := stateOf(t, p, u.ID())
	if s.Failures != 3 || len(*hooked) != 3 || s.Ejections != 1 || s.State != Probing {
		t.Errorf("after a probe cut by Run's end: %+v; Failure hook told %v", s, *hooked)
	}
	if u.h.trial.Load() {
		t.Error("the cut probe kept the trial claim: the upstream could never be tried again")
	}
}

// A probe that hangs holds up neither the hot path's clock nor the rest of
// Run's work, and Run does not return before the probe it started did.
func TestHangingProbeDoesNotStopRun(t *testing.T) {
	started := make(chan struct{}, 1)
	var returned atomic.Int32
	prober := proberFunc(func(ctx context.Context, _ *Upstream) Result {
		select {
		case started <- struct{}{}:
		default:
		}
		<-ctx.Done() // hangs until its timeout or Run's end
		returned.Add(1)
		return DialTimeout
	})
	var changed atomic.Int32
	p, err := New(conf(func(c *Config) {
		c.ProbeInterval = 10 * time.Millisecond
		c.ProbeTimeout = time.Hour
		c.EjectBase = time.Hour
		c.EjectMax = time.Hour
		c.MaxEjectedPercent = 100
	}), Options{Prober: prober, Hooks: Hooks{Changed: func() { changed.Add(1) }}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	stopRun := sync.OnceFunc(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("Run did not return")
		}
	})
	defer stopRun()
	set := ups(1, 3)
	p.Update(set)
	fail(p, handle(p, set[0]), 3)
	select {
	case <-started:
	case <-time.After(5 * time.Second):
		t.Fatal("no probe started")
	}
	since := p.nanos(time.Now())
	waitFor(t, "the clock to move on while a probe hangs", func() bool {
		return p.tick.Load() > since+int64(3*tickEvery)
	})
	n := changed.Load()
	p.SetProviderStatus(1, []string{"10.1.0.1"}, nil)
	waitFor(t, "the Changed hook while a probe hangs", func() bool { return changed.Load() > n })
	stopRun()
	if returned.Load() != 1 {
		t.Errorf("Run returned with %d of 1 probes returned", returned.Load())
	}
}

type proberFunc func(context.Context, *Upstream) Result

func (f proberFunc) Probe(ctx context.Context, u *Upstream) Result { return f(ctx, u) }

func TestProbingOneTrialUnderConcurrency(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, conf(func(c *Config) { c.MaxEjectedPercent = 100 }), Options{Now: clk.Now, Rand: midRand})
	set := ups(1, 1)
	p.Update(append(set, ups(2, 1)...))
	u := handle(p, set[0])
	fail(p, u, 3)
	clk.Advance(time.Minute)
	const n = 32
	got := make(chan *Upstream, n)
	start := make(chan struct{})
	for range n {
		go func() {
			<-start
			u, err := p.Pick(context.Background(), Request{})
			if err != nil {
				t.Error(err)
			}
			got <- u
		}()
	}
	close(start)
	trials := 0
	var all []*Upstream
	for range n {
		g := <-got
		all = append(all, g)
		if g.ID() == u.ID() {
			trials++
		}
	}
	if trials != 1 {
		t.Errorf("%d concurrent trials, want 1", trials)
	}
	for _, g := range all {
		p.Report(g, Success, time.Millisecond)
		p.Release(g, Request{})
	}
	if s := stateOf(t, p, u.ID()); s.State != Healthy || s.InFlight != 0 {
		t.Errorf("after the trial: %+v", s)
	}
}

// Without Options.Now the hot path reads the clock copy Run refreshes: an
// ejection still ends on time.
func TestEjectionEndsWithTheRealClock(t *testing.T) {
	p := newTestPool(t, conf(func(c *Config) {
		c.EjectBase = 50 * time.Millisecond
		c.EjectMax = time.Second
		c.MaxEjectedPercent = 100
	}), Options{})
	set := ups(1, 2)
	p.Update(set)
	u := handle(p, set[0])
	fail(p, u, 3)
	ejectedAt := time.Now()
	if s := stateOf(t, p, u.ID()); s.State != Ejected {
		t.Fatalf("state %s", s.State)
	}
	waitFor(t, "a trial on the ejected upstream", func() bool {
		g := pickReport(t, p, Request{}, Success)
		return g.ID() == u.ID()
	})
	if took := time.Since(ejectedAt); took < 35*time.Millisecond { // 40ms at least, less the time fail took
		t.Errorf("picked %s after the ejection, which lasts 50ms ± 20 %%", took)
	}
	if s := stateOf(t, p, u.ID()); s.State != Healthy {
		t.Errorf("after the trial: %s", s.State)
	}
}

func TestPanicIsPerSlice(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, DefaultConfig(), Options{Now: clk.Now, Rand: midRand})
	set := ups(1, 10)
	for i := 2; i < 10; i++ {
		set[i].Protocol = SOCKS5
	}
	p.Update(set)
	p.SetListeners([]ListenerSlice{{Name: "http", Protocol: HTTP}, {Name: "all"}})
	a, b := handle(p, set[0]), handle(p, set[1])
	fail(p, a, 3) // http: 1 of 2 ejected, its cap
	fail(p, b, 3) // held by http's cap, though "all" has room
	if s := stateOf(t, p, b.ID()); s.State != Healthy {
		t.Fatalf("b: %s", s.State)
	}
	if l := listenerOf(t, p, "http"); !l.Panic {
		t.Errorf("http: %+v, want panic", l)
	}
	if l := listenerOf(t, p, "all"); l.Panic {
		t.Errorf("all: %+v, want no panic (1 of 10 ejected)", l)
	}
}

// A failed probe past the ejection was the upstream's trial and takes a
// connection failure's path: besides the count and the Failure hook, one
// more consecutive failure, for a ppr sticky session a rotation request,
// and the upstream is ejected again. Within the ejection it only says the
// upstream is still down: nothing is counted and no rotation asked for (a
// successful one would end the ejection), and the upstream can still be
// tried.
func TestFailedProbeTakesTheConnectionFailurePath(t *testing.T) {
	clk := newClock()
	var hooked atomic.Int64
	rot := &fakeRotator{seen: make(chan string, 10), fn: func(context.Context, string) (string, error) {
		return "", errors.New("502 from the api") // no new exit ip: the session stays failing
	}}
	var rs rotations
	prober := proberFunc(func(context.Context, *Upstream) Result { return HandshakeTimeout })
	p, err := New(conf(func(c *Config) { c.MaxEjectedPercent = 100; c.ProbeInterval = time.Hour }), Options{
		Now: clk.Now, Rand: midRand, Prober: prober, Rotator: rot,
		Hooks: Hooks{Failure: func(int, Result) { hooked.Add(1) }, Rotated: rs.hook},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer p.stopRotations()
	set := sessions(7, 2, "198.51.100.1")
	set[1].Address = "198.51.100.1:9001"
	p.Update(set)
	u := handle(p, set[0])
	fail(p, u, 1) // asks for a rotation, which fails
	<-rot.seen
	waitFor(t, "the first rotation", func() bool { return len(rs.get()) == 1 })
	fail(p, u, 2) // held back by the interval; the third failure ejects
	if s := stateOf(t, p, u.ID()); s.State != Ejected || s.ConsecutiveFailures != 3 {
		t.Fatalf("after three failures: %+v", s)
	}

	p.probeOnce(context.Background()) // within the ejection: says only "still down"
	s := stateOf(t, p, u.ID())
	if s.State != Ejected || s.Failures != 3 || s.ConsecutiveFailures != 3 || s.Ejections != 1 || hooked.Load() != 3 {
		t.Errorf("after a failed probe within the ejection: %+v, Failure hook told %d; want nothing counted", s, hooked.Load())
	}
	if u.h.trial.Load() {
		t.Errorf("the failed probe kept the trial claim")
	}
	if got := rs.get(); len(got) != 1 {
		t.Errorf("rotation results %v: a probe within the ejection asks for no rotation", got)
	}

	clk.Advance(time.Minute) // the ejection and the rotate interval are over
	p.probeOnce(context.Background())
	if last := u.h.sess.Load().lastRotate.Load(); last != p.nanos(clk.Now()) {
		t.Fatalf("the failed trial probe asked for no rotation of its session")
	}
	if got := <-rot.seen; got != "s0" {
		t.Errorf("rotated %s", got)
	}
	waitFor(t, "the second rotation", func() bool { return len(rs.get()) == 2 })
	s = stateOf(t, p, u.ID())
	if s.State != Ejected || s.Failures != 4 || s.ConsecutiveFailures != 4 || s.Ejections != 2 || hooked.Load() != 4 {
		t.Errorf("after a failed probe as the trial: %+v, Failure hook told %d", s, hooked.Load())
	}
}

// Only the trial connection's own report decides the trial: a late
// failure or cancellation of a connection picked before the ejection
// neither ejects the upstream again nor frees the trial for a second
// connection; the trial's success ends the ejection.
func TestOnlyTheTrialDecides(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, conf(func(c *Config) { c.MaxEjectedPercent = 100 }), Options{Now: clk.Now, Rand: midRand})
	set := ups(1, 2)
	p.Update(set)
	// Two connections picked on the upstream before it is ejected.
	early := pickUntil(t, p, Request{}, set[0].ID())
	early2 := pickUntil(t, p, Request{}, set[0].ID())
	fail(p, handle(p, set[0]), 3)
	s := stateOf(t, p, set[0].ID())
	if s.State != Ejected {
		t.Fatalf("after 3 failures: %s", s.State)
	}
	clk.Advance(s.EjectedUntil.Sub(clk.Now()))
	trial := pickUntil(t, p, Request{}, set[0].ID())
	p.Report(early, HandshakeTimeout, time.Second) // late: its verdict came now
	p.Release(early, Request{})
	p.Report(early2, Canceled, 0)
	p.Release(early2, Request{})
	if s := stateOf(t, p, set[0].ID()); s.State != Probing || s.Ejections != 1 {
		t.Errorf("after late reports of earlier connections: %s with %d ejections, want probing with 1", s.State, s.Ejections)
	}
	for range 10 {
		if u := pickReport(t, p, Request{}, Success); u.ID() == set[0].ID() {
			t.Fatal("a second connection got the upstream while its trial was out")
		}
	}
	p.Report(trial, Success, time.Millisecond)
	p.Release(trial, Request{})
	if s := stateOf(t, p, set[0].ID()); s.State != Healthy {
		t.Errorf("after the trial's success: %s", s.State)
	}
}

// A pick that found the upstream eligible just before it was ejected does
// not claim the trial of that ejection (which would leave the upstream
// probing with no trial out once the ejection ended): take refuses it.
func TestTakeRefusesAnUpstreamEjectedMeanwhile(t *testing.T) {
	clk := newClock()
	p := newTestPool(t, conf(func(c *Config) { c.MaxEjectedPercent = 100 }), Options{Now: clk.Now, Rand: midRand})
	set := ups(1, 2)
	p.Update(set)
	h := handle(p, set[0]).h
	f := filter{clock: p.fastNow}
	if !f.eligible(h) {
		t.Fatal("a healthy upstream is not eligible")
	}
	fail(p, handle(p, set[0]), 3) // ejected between the filter and the claim
	if u := take(h, &f); u != nil {
		t.Fatalf("take handed out %s, ejected since the filter passed it", u.ID())
	}
	if h.trial.Load() || h.inFlight.Load() != 0 {
		t.Errorf("after the refused take: trial %v, in flight %d", h.trial.Load(), h.inFlight.Load())
	}
	clk.Advance(time.Hour)
	if u := pickUntil(t, p, Request{}, set[0].ID()); !u.trial {
		t.Error("the pick after the ejection is not its trial")
	}
}

// The pool keeps its times (ejection ends, sticky idle times, rotation
// times) as durations on its own clock, read from time.Now's monotonic
// reading: a step of the wall clock (NTP, a virtual machine resumed)
// neither stretches nor ends them. Its readings are durations since the
// pool began, not wall times.
func TestPoolClockIsMonotonic(t *testing.T) {
	p := newTestPool(t, DefaultConfig(), Options{})
	if !strings.Contains(p.epoch.String(), " m=") {
		t.Errorf("the pool's epoch %v has no monotonic reading", p.epoch)
	}
	for name, v := range map[string]int64{"fastNow": p.fastNow(), "mono": p.mono()} {
		if v < int64(time.Second) || v > int64(time.Minute) {
			t.Errorf("%s = %d, want the time since the pool began (a second before New)", name, v)
		}
	}
}

// A trial whose ejection ended otherwise (a late success re-admitted the
// upstream) decides no later ejection's trial: its report neither frees
// the new trial nor ejects the upstream again.
func TestStaleTrialDecidesNoLaterEjection(t *testing.T) {
	for _, late := range []Result{Canceled, HandshakeTimeout} {
		t.Run(late.String(), func(t *testing.T) {
			clk := newClock()
			p := newTestPool(t, conf(func(c *Config) { c.MaxEjectedPercent = 100 }), Options{Now: clk.Now, Rand: midRand})
			set := ups(1, 2)
			p.Update(set)
			id := set[0].ID()
			early := pickUntil(t, p, Request{}, id)
			fail(p, handle(p, set[0]), 3)
			clk.Advance(stateOf(t, p, id).EjectedUntil.Sub(clk.Now()))
			a := pickUntil(t, p, Request{}, id)        // the first ejection's trial
			p.Report(early, Success, time.Millisecond) // late, past the ejection: re-admits
			p.Release(early, Request{})
			if s := stateOf(t, p, id); s.State != Healthy {
				t.Fatalf("after the late success: %s", s.State)
			}
			fail(p, handle(p, set[0]), 3) // ejected again
			clk.Advance(stateOf(t, p, id).EjectedUntil.Sub(clk.Now()))
			b := pickUntil(t, p, Request{}, id) // the second ejection's trial
			p.Report(a, late, time.Second)
			p.Release(a, Request{})
			if s := stateOf(t, p, id); s.State != Probing || s.Ejections != 2 {
				t.Errorf("after the old trial's %s: %s with %d ejections, want probing with 2", late, s.State, s.Ejections)
			}
			for range 10 {
				if u := pickReport(t, p, Request{}, Success); u.ID() == id {
					t.Fatal("a second trial went out while the current one was")
				}
			}
			p.Report(b, Success, time.Millisecond)
			p.Release(b, Request{})
			if s := stateOf(t, p, id); s.State != Healthy {
				t.Errorf("after the current trial's success: %s", s.State)
			}
		})
	}
}
