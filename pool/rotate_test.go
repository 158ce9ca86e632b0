package pool

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"
)

// fakeRotator records calls and answers through fn.
type fakeRotator struct {
	mu    sync.Mutex
	calls []string
	fn    func(ctx context.Context, session string) (string, error)
	seen  chan string // each call's session, if set
}

func (f *fakeRotator) Rotate(ctx context.Context, service int, server, session string) (string, error) {
	f.mu.Lock()
	f.calls = append(f.calls, fmt.Sprintf("%d/%s/%s", service, server, session))
	fn := f.fn
	f.mu.Unlock()
	if f.seen != nil {
		f.seen <- session
	}
	return fn(ctx, session)
}

// await returns the session of the next call, failing the test after 5 s.
func (f *fakeRotator) await(t *testing.T) string {
	t.Helper()
	select {
	case s := <-f.seen:
		return s
	case <-time.After(5 * time.Second):
		t.Fatal("timed out waiting for a sticky/rotate call")
		return ""
	}
}

func (f *fakeRotator) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.calls)
}

// rotations collects Rotated hook results.
type rotations struct {
	mu      sync.Mutex
	results []string
}

func (r *rotations) hook(_ int, result string) {
	r.mu.Lock()
	r.results = append(r.results, result)
	r.mu.Unlock()
}

func (r *rotations) get() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.results...)
}

type rateLimitedErr struct{}

func (rateLimitedErr) Error() string     { return "429: rotated too recently" }
func (rateLimitedErr) RateLimited() bool { return true }

func TestRotationRateLimitAndResults(t *testing.T) {
	clk := newClock()
	var answer error
	var mu sync.Mutex
	rot := &fakeRotator{fn: func(context.Context, string) (string, error) {
		mu.Lock()
		defer mu.Unlock()
		return "203.0.113.99", answer
	}}
	var rs rotations
	p := newTestPool(t, conf(func(c *Config) { c.MaxEjectedPercent = 100 }), Options{Now: clk.Now, Rotator: rot, Hooks: Hooks{Rotated: rs.hook}})
	ss := sessions(7, 3, "198.51.100.1")
	p.Update(ss)
	s0 := handle(p, ss[0])
	fail(p, s0, 1)
	waitFor(t, "the rotation", func() bool { return len(rs.get()) == 1 })
	rot.mu.Lock()
	if len(rot.calls) != 1 || rot.calls[0] != "7/gw.example.net/s0" {
		t.Errorf("calls %v", rot.calls)
	}
	rot.mu.Unlock()
	if s := stateOf(t, p, ss[0].ID()); s.State != Healthy || s.ExitIP != "203.0.113.99" || s.ConsecutiveFailures != 0 {
		t.Errorf("after the rotation: %+v", s)
	}
	// Within the interval: no call, and no rotation counted (nothing was
	// asked of the provider).
	clk.Advance(29 * time.Second)
	fail(p, handle(p, ss[0]), 1)
	if got := rs.get(); rot.count() != 1 || !slices.Equal(got, []string{"ok"}) {
		t.Errorf("within the interval: %d calls, results %v, want 1 and ok alone", rot.count(), got)
	}
	// Past it: rotated again; the provider's answers are classified.
	for i, tt := range []struct {
		err  error
		want string
	}{
		{errors.New("502 from the api"), "error"},
		{fmt.Errorf("rotating: %w", ErrRotateRateLimited), "rate_limited"},
		{fmt.Errorf("rotating: %w", rateLimitedErr{}), "rate_limited"},
		{nil, "ok"},
	} {
		mu.Lock()
		answer = tt.err
		mu.Unlock()
		clk.Advance(30 * time.Second)
		fail(p, handle(p, ss[0]), 1)
		waitFor(t, "the rotation", func() bool { return len(rs.get()) == 2+i })
		if got := rs.get()[1+i]; got != tt.want {
			t.Errorf("answer %v: result %q, want %q", tt.err, got, tt.want)
		}
	}
	if rot.count() != 5 {
		t.Errorf("%d calls, want 5", rot.count())
	}
	// Other sessions are not rotated; fpr upstreams never. Rotations run
	// in their own goroutines: stopping them waits for any that started.
	p.Update(append(ss, ups(8, 1)...))
	fail(p, handle(p, ups(8, 1)[0]), 1)
	p.stopRotations()
	if rot.count() != 5 {
		t.Errorf("an fpr failure rotated")
	}
	rot.mu.Lock()
	for _, c := range rot.calls {
		if c != "7/gw.example.net/s0" {
			t.Errorf("rotated %s, which never failed", c)
		}
	}
	rot.mu.Unlock()
}

// stickyOn returns a key that the pool assigns to want.
func stickyOn(t *testing.T, p *Pool, want string) string {
	t.Helper()
	for i := range 100 {
		k := fmt.Sprint("key", i)
		if pickReport(t, p, Request{Key: k}, Success).ID() == want {
			return k
		}
	}
	t.Fatalf("no key lands on %s", want)
	return ""
}

func TestRotationReleasesWaitingKeys(t *testing.T) {
	clk := newClock()
	rot, release := blockingRotator("203.0.113.50")
	started := rot.seen
	var rs rotations
	p := newTestPool(t, conf(func(c *Config) { c.RotateWait = time.Minute }), Options{Now: clk.Now, Rotator: rot, Hooks: Hooks{Rotated: rs.hook}})
	ss := sessions(7, 3, "198.51.100.1")
	p.Update(ss)
	key := stickyOn(t, p, ss[0].ID())
	other := stickyOn(t, p, ss[1].ID())

	// The key's connection fails; it retries with the session in Avoid.
	u := mustPick(t, p, Request{Key: key})
	p.Report(u, DialRefused, time.Millisecond)
	p.Release(u, Request{Key: key})
	<-started
	if s := stateOf(t, p, ss[0].ID()); s.State != Rotating || s.Reason != "dial_refused" {
		t.Fatalf("state %s %q, want rotating", s.State, s.Reason)
	}
	type res struct {
		u   *Upstream
		err error
	}
	const waiters = 5
	got := make(chan res, waiters)
	for i := range waiters {
		req := Request{Key: key}
		if i == 0 {
			req.Avoid = []string{ss[0].ID()}
		}
		go func() {
			u, err := p.Pick(context.Background(), req)
			got <- res{u, err}
		}()
	}
	// Other picks never wait, and never get the rotating session.
	for range 20 {
		for _, req := range []Request{{}, {Key: other}, {Key: "fresh"}} {
			u := pickReport(t, p, req, Success)
			if u.ID() == ss[0].ID() {
				t.Fatalf("picked the rotating session for %+v", req)
			}
		}
	}
	r := rotationOf(handle(p, ss[0]))
	waitFor(t, "the picks to wait", func() bool { return r.waiting.Load() == waiters })
	select {
	case r := <-got:
		t.Fatalf("a waiting key's pick returned before the rotation: %+v", r)
	default:
	}
	close(release)
	for range waiters {
		r := <-got
		if r.err != nil || r.u.ID() != ss[0].ID() || r.u.ExitIP != "203.0.113.50" {
			t.Fatalf("waiting pick: %v %+v", r.err, r.u)
		}
		p.Report(r.u, Success, time.Millisecond)
		p.Release(r.u, Request{Key: key})
	}
	if s := stateOf(t, p, ss[0].ID()); s.State != Healthy || s.InFlight != 0 {
		t.Errorf("after the rotation: %+v", s)
	}
	if got := rs.get(); len(got) != 1 || got[0] != "ok" {
		t.Errorf("results %v", got)
	}
}

// On a listener that serves fpr and ppr alike, a key whose session's
// rotation outlasts rotate_wait falls back to another session of its
// service, not to a static IP; only where the service has none left does
// the connection take any upstream of the listener.
func TestRotationFallbackStaysWithItsService(t *testing.T) {
	clk := newClock()
	rot := &fakeRotator{fn: func(ctx context.Context, _ string) (string, error) {
		<-ctx.Done() // never answers; Run's end cancels it
		return "", ctx.Err()
	}}
	const bound = 20 * time.Millisecond
	p := newTestPool(t, conf(func(c *Config) { c.RotateWait = bound; c.MaxEjectedPercent = 100 }), Options{Now: clk.Now, Rotator: rot})
	ss := sessions(7, 3, "198.51.100.1")
	static := ups(9, 6)
	p.Update(append(slices.Clone(ss), static...))
	key := stickyOn(t, p, ss[0].ID())
	fail(p, handle(p, ss[0]), 1) // its rotation starts, and never ends
	for range 8 {
		u := mustPick(t, p, Request{Key: key})
		if u.Service != 7 || u.ID() == ss[0].ID() {
			t.Errorf("fallback to %s, want another session of service 7", u.ID())
		}
		p.Report(u, Success, time.Millisecond)
		p.Release(u, Request{Key: key})
	}
	// The service's other sessions out: any upstream serves the connection.
	for _, s := range ss[1:] {
		fail(p, handle(p, s), DefaultConfig().FailureThreshold)
	}
	u := mustPick(t, p, Request{Key: key})
	if u.Service != 9 {
		t.Errorf("with no other session to give, fallback to %s, want a static upstream", u.ID())
	}
	p.Report(u, Success, time.Millisecond)
	p.Release(u, Request{Key: key})
	if h := p.sticky.lookup("", key); h == nil || h.id != ss[0].ID() {
		t.Errorf("key moved off its rotating session")
	}
}

func TestRotationFallbackAfterBound(t *testing.T) {
	clk := newClock()
	rot := &fakeRotator{fn: func(ctx context.Context, _ string) (string, error) {
		<-ctx.Done() // never answers; Run's end cancels it
		return "", ctx.Err()
	}}
	const bound = 50 * time.Millisecond
	p := newTestPool(t, conf(func(c *Config) { c.RotateWait = bound }), Options{Now: clk.Now, Rotator: rot})
	ss := sessions(7, 3, "198.51.100.1")
	p.Update(ss)
	key := stickyOn(t, p, ss[0].ID())
	fail(p, handle(p, ss[0]), 1)
	start := time.Now()
	u := mustPick(t, p, Request{Key: key})
	if took := time.Since(start); took < bound {
		t.Errorf("returned after %s, before the bound %s", took, bound)
	}
	if u.ID() == ss[0].ID() {
		t.Fatalf("fell back to the rotating session")
	}
	p.Report(u, Success, time.Millisecond)
	p.Release(u, Request{Key: key})
	// The fallback was for that connection only.
	if h := p.sticky.lookup("", key); h == nil || h.id != ss[0].ID() {
		t.Errorf("key moved off its rotating session")
	}
	// A cancelled context ends the wait too.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := p.Pick(ctx, Request{Key: key}); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled wait: %v", err)
	}
}

func TestRotationFailing(t *testing.T) {
	clk := newClock()
	release := make(chan struct{})
	rot := &fakeRotator{fn: func(ctx context.Context, _ string) (string, error) {
		<-release
		return "", errors.New("503 from the api")
	}}
	var rs rotations
	p := newTestPool(t, conf(func(c *Config) { c.RotateWait = time.Minute }), Options{Now: clk.Now, Rotator: rot, Hooks: Hooks{Rotated: rs.hook}})
	ss := sessions(7, 3, "198.51.100.1")
	p.Update(ss)

	// A failure-triggered rotation fails: waiting keys are released at once
	// and stay on their session, which is not excluded by one failure.
	key := stickyOn(t, p, ss[0].ID())
	fail(p, handle(p, ss[0]), 1)
	got := pickLater(t, p, Request{Key: key})
	waitFor(t, "the rotation to start", func() bool { return rot.count() == 1 })
	r := rotationOf(handle(p, ss[0]))
	waitFor(t, "the pick to wait", func() bool { return r.waiting.Load() == 1 })
	start := time.Now()
	release <- struct{}{}
	u := <-got
	if took := time.Since(start); took > 10*time.Second || u == nil || u.ID() != ss[0].ID() {
		t.Fatalf("after a failed rotation: %v after %s", u, took)
	}
	p.Report(u, Success, time.Millisecond)
	p.Release(u, Request{Key: key})

	// An errored exit IP: the session is rotated and not used meanwhile;
	// when the rotation fails it is not excluded for that, and its key stays.
	key1 := stickyOn(t, p, ss[1].ID())
	p.SetProviderStatus(7, []string{ss[1].ExitIP}, nil)
	waitFor(t, "the rotation to start", func() bool { return rot.count() == 2 })
	if s := stateOf(t, p, ss[1].ID()); s.State != Rotating || s.Reason != "exit ip on the provider's errored list" {
		t.Errorf("rotating: %s %q", s.State, s.Reason)
	}
	for range 6 {
		if u := pickReport(t, p, Request{}, Success); u.ID() == ss[1].ID() {
			t.Fatalf("picked the rotating session")
		}
	}
	release <- struct{}{}
	waitFor(t, "the result", func() bool { return len(rs.get()) == 2 })
	if got := rs.get(); got[0] != "error" || got[1] != "error" {
		t.Errorf("results %v", got)
	}
	if s := stateOf(t, p, ss[1].ID()); s.State != Healthy || s.Reason != "exit ip on the provider's errored list, not rotated yet" {
		t.Errorf("after the failed rotation: %s %q", s.State, s.Reason)
	}
	if u := pickReport(t, p, Request{Key: key1}, Success); u.ID() != ss[1].ID() {
		t.Errorf("key moved off a session whose rotation failed: %s", u.ID())
	}
	// The next status poll past the interval retries, and a success with a
	// clean exit IP brings the session back.
	close(release)
	rot.mu.Lock()
	rot.fn = func(context.Context, string) (string, error) { return "203.0.113.200", nil }
	rot.mu.Unlock()
	clk.Advance(30 * time.Second)
	p.SetProviderStatus(7, []string{ss[1].ExitIP}, nil)
	waitFor(t, "the rotation", func() bool { return len(rs.get()) == 3 })
	if got := rs.get(); got[2] != "ok" {
		t.Errorf("results %v, want the third ok", got)
	}
	if s := stateOf(t, p, ss[1].ID()); s.State != Healthy || s.ExitIP != "203.0.113.200" || s.Reason != "" {
		t.Errorf("after a successful rotation: %+v", s)
	}
}

// rotationOf is the rotation under way of u's session, or nil.
func rotationOf(u *Upstream) *rotation { return u.h.rotation() }

// twins makes each session of ss dialable over HTTP and SOCKS5: two
// upstreams of one session, on the gateway's two ports.
func twins(ss []Upstream) []Upstream {
	var out []Upstream
	for _, s := range ss {
		h, k := s, s
		h.Address = "198.51.100.1:3081"
		k.Protocol, k.Address = SOCKS5, "198.51.100.1:2087"
		out = append(out, h, k)
	}
	return out
}

// A session dialable over HTTP and SOCKS5 is two upstreams and one
// session: whichever of them asks, it is rotated once per interval, both
// are rotating until the provider answers (a key on either waits), both
// get the new exit IP, and each records its event.
func TestRotationIsPerSession(t *testing.T) {
	clk := newClock()
	release := make(chan struct{})
	started := make(chan string, 10)
	rot := &fakeRotator{seen: started, fn: func(ctx context.Context, session string) (string, error) {
		select {
		case <-release:
			return "203.0.113.5" + session[1:], nil
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}}
	var rs rotations
	events := NewEventLog(0, nil, clk.Now)
	p := newTestPool(t, conf(func(c *Config) { c.RotateWait = time.Minute }),
		Options{Now: clk.Now, Rotator: rot, Events: events, Hooks: Hooks{Rotated: rs.hook}})
	set := twins(sessions(7, 3, "198.51.100.1"))
	p.Update(set)
	s0h, s0s, s1h, s1s := set[0], set[1], set[2], set[3]
	key := stickyOn(t, p, s1s.ID())

	// The exit IP is errored: both upstreams ask, the session is rotated once.
	p.SetProviderStatus(7, []string{s0h.ExitIP}, nil)
	if got := <-started; got != "s0" {
		t.Fatalf("rotated %s", got)
	}
	for _, u := range []Upstream{s0h, s0s} {
		waitFor(t, u.ID()+" rotating", func() bool { return stateOf(t, p, u.ID()).State == Rotating })
		if s := stateOf(t, p, u.ID()); s.Reason != "exit ip on the provider's errored list" {
			t.Errorf("%s: rotating for %q", u.ID(), s.Reason)
		}
	}
	release <- struct{}{}
	waitFor(t, "the rotation", func() bool { return len(rs.get()) == 1 })
	for _, u := range []Upstream{s0h, s0s} {
		if s := stateOf(t, p, u.ID()); s.State != Healthy || s.ExitIP != "203.0.113.50" {
			t.Errorf("%s after the rotation: %s, exit ip %s", u.ID(), s.State, s.ExitIP)
		}
	}
	// Within the interval, a failure of the twin is held back too.
	fail(p, handle(p, s0s), 1)

	// A failure of the HTTP upstream rotates the session; its SOCKS5
	// upstream is rotating as well, and a key on it waits for the answer.
	fail(p, handle(p, s1h), 1)
	if got := <-started; got != "s1" {
		t.Fatalf("rotated %s", got)
	}
	waitFor(t, "the twin rotating", func() bool { return stateOf(t, p, s1s.ID()).State == Rotating })
	if s := stateOf(t, p, s1s.ID()); s.Reason != "dial_refused" {
		t.Errorf("twin rotating for %q", s.Reason)
	}
	// A refresh meanwhile (the agent has seen s0's new exit IP) keeps it so.
	refresh := slices.Clone(set)
	refresh[0].ExitIP, refresh[1].ExitIP = "203.0.113.50", "203.0.113.50"
	p.Update(refresh)
	for _, u := range []Upstream{s1h, s1s} {
		if s := stateOf(t, p, u.ID()); s.State != Rotating {
			t.Errorf("%s after a refresh: %s", u.ID(), s.State)
		}
	}
	for range 8 {
		if u := pickReport(t, p, Request{}, Success); u.Session == "s1" {
			t.Fatalf("picked %s of the rotating session", u.ID())
		}
	}
	got := pickLater(t, p, Request{Key: key})
	r := rotationOf(handle(p, s1s))
	if r == nil {
		t.Fatal("no rotation under way for the twin")
	}
	waitFor(t, "the key's pick to wait", func() bool { return r.waiting.Load() == 1 })
	release <- struct{}{}
	if u := <-got; u == nil || u.ID() != s1s.ID() || u.ExitIP != "203.0.113.51" {
		t.Fatalf("the waiting key got %+v", u)
	} else {
		p.Report(u, Success, time.Millisecond)
		p.Release(u, Request{Key: key})
	}
	waitFor(t, "the rotation", func() bool { return len(rs.get()) == 2 })
	if s := stateOf(t, p, s1h.ID()); s.State != Healthy || s.ExitIP != "203.0.113.51" || s.ConsecutiveFailures != 0 {
		t.Errorf("%s after the rotation: %+v", s1h.ID(), s)
	}
	if n := rot.count(); n != 2 {
		rot.mu.Lock()
		t.Errorf("%d rotations, want one per session: %v", n, rot.calls)
		rot.mu.Unlock()
	}
	if got := rs.get(); !slices.Equal(got, []string{"ok", "ok"}) {
		t.Errorf("results %v, want two ok (a hold-back is not counted)", got)
	}
	wantEvents(t, events, EventRotated,
		Event{Kind: EventRotated, Upstream: s1s.ID(), Service: 7, Reason: "ok"},
		Event{Kind: EventRotated, Upstream: s1h.ID(), Service: 7, Reason: "ok"},
		Event{Kind: EventRotated, Upstream: s0s.ID(), Service: 7, Reason: "ok"},
		Event{Kind: EventRotated, Upstream: s0h.ID(), Service: 7, Reason: "ok"})
}

// blockingRotator returns a rotator whose calls report on its seen channel
// and answer exitIP once release gives them leave.
func blockingRotator(exitIP string) (*fakeRotator, chan struct{}) {
	release := make(chan struct{})
	rot := &fakeRotator{seen: make(chan string, 10), fn: func(ctx context.Context, _ string) (string, error) {
		select {
		case <-release:
			return exitIP, nil
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}}
	return rot, release
}

// An upstream's rotating bit mirrors its session's rotation, however it
// came and went while the rotation ran: a twin that drained during the
// rotation and comes back after it is not rotating any more, whether it
// was marked when the rotation started or linked to it meanwhile.
func TestRevivedTwinLeavesRotatingWithItsSession(t *testing.T) {
	for _, joins := range []string{"at the start", "during the rotation"} {
		t.Run("twin marked "+joins, func(t *testing.T) {
			clk := newClock()
			rot, release := blockingRotator("203.0.113.77")
			var rs rotations
			p := newTestPool(t, DefaultConfig(), Options{Now: clk.Now, Rotator: rot, Hooks: Hooks{Rotated: rs.hook}})
			set := twins(sessions(7, 2, "198.51.100.1"))
			s0h, s0s := set[0], set[1]
			without := slices.Delete(slices.Clone(set), 1, 2)
			if joins == "at the start" {
				p.Update(set)
			} else {
				p.Update(without)
			}
			fail(p, handle(p, s0h), 1)
			rot.await(t) // the rotation has marked the session's upstreams
			if joins != "at the start" {
				p.Update(set) // the twin joins, rotating
			}
			if s := stateOf(t, p, s0s.ID()); s.State != Rotating {
				t.Fatalf("twin while its session rotates: %s", s.State)
			}
			tunnel := handle(p, s0s)
			tunnel.h.inFlight.Add(1) // a long tunnel through the twin
			p.Update(without)        // the twin drains
			release <- struct{}{}
			waitFor(t, "the rotation", func() bool { return len(rs.get()) == 1 })
			p.Update(set) // and is back
			if s := stateOf(t, p, s0s.ID()); s.State != Healthy {
				t.Errorf("twin back after its session's rotation ended: %+v", s)
			}
			seen := false
			for range 4 {
				if u := pickReport(t, p, Request{}, Success); u.ID() == s0s.ID() {
					seen = true
				}
			}
			if !seen {
				t.Errorf("%s never picked again", s0s.ID())
			}
			p.Release(tunnel, Request{})
		})
	}
}

// A rotation's event is recorded once per upstream ID: the asking upstream
// leaves the set during the rotation (nothing in flight: forgotten at once)
// and its ID comes back before the answer as a new upstream of the same
// session, which gets the event; the forgotten one gets none. One that
// still drains gets its own.
func TestRotatedEventOncePerUpstreamID(t *testing.T) {
	for _, inFlight := range []bool{false, true} {
		t.Run(fmt.Sprintf("in flight %v", inFlight), func(t *testing.T) {
			clk := newClock()
			rot, release := blockingRotator("203.0.113.77")
			var rs rotations
			events := NewEventLog(0, nil, clk.Now)
			p := newTestPool(t, DefaultConfig(), Options{Now: clk.Now, Rotator: rot, Events: events, Hooks: Hooks{Rotated: rs.hook}})
			set := twins(sessions(7, 2, "198.51.100.1"))
			p.Update(set)
			s0h, s0s := set[0], set[1]
			asking := handle(p, s0h)
			if inFlight {
				asking.h.inFlight.Add(1)
			}
			fail(p, asking, 1)
			rot.await(t)
			p.Update(slices.Delete(slices.Clone(set), 0, 1)) // s0h leaves
			h0 := Event{Kind: EventRotated, Upstream: s0h.ID(), Service: 7, Reason: "ok"}
			s0 := Event{Kind: EventRotated, Upstream: s0s.ID(), Service: 7, Reason: "ok"}
			want := []Event{h0, s0} // newest first: the draining asker comes after the set
			if !inFlight {
				p.Update(set) // s0h is back, a new upstream of the session
				want = []Event{s0, h0}
			}
			release <- struct{}{}
			waitFor(t, "the rotation", func() bool { return len(rs.get()) == 1 })
			wantEvents(t, events, EventRotated, want...)
			if inFlight {
				if got := asking.h.cur.Load().ExitIP; got != "203.0.113.77" {
					t.Errorf("draining asker's exit ip %s", got)
				}
				p.Release(asking, Request{})
			}
		})
	}
}

// A session that one refresh misses and the next lists again is the same
// session: its rotation under way goes on (no second one starts), and its
// rotate_interval still holds it back. Only past the interval is it
// forgotten while out of the set.
func TestSessionKeepsItsRotationLimitAcrossARefreshWithoutIt(t *testing.T) {
	clk := newClock()
	rot, release := blockingRotator("203.0.113.77")
	var rs rotations
	p := newTestPool(t, DefaultConfig(), Options{Now: clk.Now, Rotator: rot, Hooks: Hooks{Rotated: rs.hook}})
	set := sessions(7, 2, "198.51.100.1")
	set[1].Address = "198.51.100.1:9001"
	p.Update(set)
	fail(p, handle(p, set[0]), 1)
	rot.await(t)
	r := rotationOf(handle(p, set[0]))
	missed := func() { // one poll without s0, the next with it
		p.Update(set[1:])
		p.Update(set)
	}
	resting := func() int {
		p.mu.Lock()
		defer p.mu.Unlock()
		return len(p.resting)
	}

	missed()
	u := handle(p, set[0])
	if got := rotationOf(u); got != r {
		t.Fatalf("back after a missed poll, s0's rotation is %p, want the one under way %p", got, r)
	}
	if s := stateOf(t, p, u.ID()); s.State != Rotating {
		t.Errorf("s0 back while its rotation runs: %s", s.State)
	}
	fail(p, u, 1) // no second rotation while the first runs
	if got := rotationOf(u); got != r {
		t.Errorf("a failure started another rotation of s0")
	}
	release <- struct{}{}
	waitFor(t, "the rotation", func() bool { return len(rs.get()) == 1 })

	missed()
	fail(p, handle(p, set[0]), 1) // within rotate_interval: held back
	if got := rs.get(); !slices.Equal(got, []string{"ok"}) || rot.count() != 1 {
		t.Errorf("rotation results %v after %d calls, want ok alone (held back, not asked)", got, rot.count())
	}

	clk.Advance(DefaultConfig().RotateInterval)
	p.Update(set[1:])
	if n := resting(); n != 0 {
		t.Errorf("%d sessions kept past their rotate_interval", n)
	}
	p.Update(set)
	fail(p, handle(p, set[0]), 1)
	rot.await(t) // rotated again
	release <- struct{}{}
	waitFor(t, "the second rotation", func() bool { return len(rs.get()) == 2 })
	if n := rot.count(); n != 2 {
		t.Errorf("%d sticky/rotate calls, want 2", n)
	}
}

// The sessions kept aside for their rotation limit are bounded: past
// restingMax, only those whose rotation is under way are kept.
func TestRestingSessionsBounded(t *testing.T) {
	clk := newClock()
	rot, release := blockingRotator("203.0.113.77")
	p := newTestPool(t, DefaultConfig(), Options{Now: clk.Now, Rotator: rot})
	set := sessions(7, restingMax+10, "198.51.100.1")
	p.Update(set)
	last := handle(p, set[len(set)-1])
	p.mu.Lock()
	for _, s := range p.sessions {
		if s != last.h.sess.Load() {
			s.lastRotate.Store(p.nanos(clk.Now())) // rotated a moment ago
		}
	}
	p.mu.Unlock()
	fail(p, last, 1)
	rot.await(t)
	p.Update(nil)
	p.mu.Lock()
	n, kept := len(p.resting), p.resting[last.h.sess.Load().key] != nil
	p.mu.Unlock()
	// The rotating one counts in the bound if it came first, else on top.
	if n < restingMax || n > restingMax+1 || !kept {
		t.Errorf("%d sessions resting (the rotating one kept: %v), want %d and the rotating one", n, kept, restingMax)
	}
	close(release)
}

// A sticky session that no upstream stands for serves no connection, but
// its errored exit IP is rotated as any session's: when the status names
// it, and when an Update lists it under a status that already does; one
// rotation at a time, at most once per rotate_interval, also across
// Updates; with its new exit IP it is errored no more. When it gets an
// upstream later, its limit goes with it.
func TestUnservedSessionRotatedWhenExitErrored(t *testing.T) {
	clk := newClock()
	rot, release := blockingRotator("203.0.113.77")
	var rs rotations
	events := NewEventLog(0, nil, clk.Now)
	p := newTestPool(t, DefaultConfig(), Options{Now: clk.Now, Rotator: rot, Events: events, Hooks: Hooks{Rotated: rs.hook}})
	served := sessions(7, 1, "198.51.100.1")
	idle := UnservedSession{Service: 7, Server: "gw.example.net", Session: "s9", ExitIP: "203.0.113.9"}
	other := UnservedSession{Service: 8, Server: "gw.example.net", Session: "s9", ExitIP: "203.0.113.9"}
	p.Update(served, idle, other)
	if n := len(p.Upstreams()); n != 1 {
		t.Fatalf("%d upstreams, want 1: an unserved session is none", n)
	}

	p.SetProviderStatus(7, []string{"203.0.113.8"}, nil) // another exit IP
	p.SetProviderStatus(7, []string{"203.0.113.9"}, nil)
	if got := rot.await(t); got != "s9" {
		t.Fatalf("rotated %s, want s9", got)
	}
	// Past the interval while the rotation is under way: no second one.
	clk.Advance(DefaultConfig().RotateInterval)
	p.SetProviderStatus(7, []string{"203.0.113.9"}, nil)
	release <- struct{}{}
	waitFor(t, "the rotation", func() bool { return len(rs.get()) == 1 })
	rot.mu.Lock()
	if !slices.Equal(rot.calls, []string{"7/gw.example.net/s9"}) {
		t.Errorf("sticky/rotate calls %v, want one of service 7's s9", rot.calls)
	}
	rot.mu.Unlock()
	wantEvents(t, events, EventRotated, Event{Kind: EventRotated, Service: 7,
		Reason: "ok: session s9 on gw.example.net, which no upstream stands for"})

	// Its new exit IP is not errored: nothing to rotate, however often the
	// status comes, until a poll brings the old one back.
	clk.Advance(DefaultConfig().RotateInterval)
	p.SetProviderStatus(7, []string{"203.0.113.9"}, nil)
	if got := rs.get(); len(got) != 1 {
		t.Errorf("rotation results %v after the new exit IP, want one", got)
	}
	p.Update(served, idle) // the agent's view before it heard of the rotation
	rot.await(t)
	release <- struct{}{}
	waitFor(t, "the second rotation", func() bool { return len(rs.get()) == 2 })

	// Within the interval, the next poll is held back, and so is the
	// session once it has an upstream.
	p.Update(served, idle)
	served = append(served, sessions(7, 10, "198.51.100.1")[9])
	served[1].ExitIP = "203.0.113.9"
	p.Update(served)
	if got := rs.get(); !slices.Equal(got, []string{"ok", "ok"}) {
		t.Errorf("rotation results %v, want ok, ok (the two held back are not counted)", got)
	}
	if n := rot.count(); n != 2 {
		t.Errorf("%d sticky/rotate calls, want 2", n)
	}
}

// A rotation whose session's upstreams all left the set while it ran is
// still recorded: with no upstream to name, by its session.
func TestRotationEventWithoutUpstreams(t *testing.T) {
	clk := newClock()
	rot, release := blockingRotator("203.0.113.77")
	var rs rotations
	events := NewEventLog(0, nil, clk.Now)
	p := newTestPool(t, DefaultConfig(), Options{Now: clk.Now, Rotator: rot, Events: events, Hooks: Hooks{Rotated: rs.hook}})
	set := sessions(7, 1, "198.51.100.1")
	p.Update(set)
	fail(p, handle(p, set[0]), 1)
	rot.await(t)
	p.Update(nil, UnservedSession{Service: 7, Server: set[0].Server, Session: set[0].Session, ExitIP: set[0].ExitIP})
	release <- struct{}{}
	waitFor(t, "the rotation", func() bool { return len(rs.get()) == 1 })
	wantEvents(t, events, EventRotated, Event{Kind: EventRotated, Service: 7,
		Reason: "ok: session s0 on gw.example.net, which no upstream stands for"})
}

// Explain lists the sessions no upstream stands for, with their exit IP,
// whether it is errored, and whether their rotation is under way.
func TestExplainUnservedSessions(t *testing.T) {
	clk := newClock()
	rot, release := blockingRotator("203.0.113.77")
	var rs rotations
	p := newTestPool(t, DefaultConfig(), Options{Now: clk.Now, Rotator: rot, Hooks: Hooks{Rotated: rs.hook}})
	served := sessions(7, 1, "198.51.100.1")
	b := UnservedSession{Service: 7, Server: "gw.example.net", Session: "s9", ExitIP: "203.0.113.9"}
	a := UnservedSession{Service: 7, Server: "gw.example.net", Session: "s8", ExitIP: "203.0.113.8"}
	p.Update(served, b, a)
	want := []UnservedExplanation{
		{Service: 7, Server: "gw.example.net", Session: "s8", ExitIP: "203.0.113.8"},
		{Service: 7, Server: "gw.example.net", Session: "s9", ExitIP: "203.0.113.9"},
	}
	if got := p.Explain().Unserved; !slices.Equal(got, want) {
		t.Errorf("unserved %+v, want %+v (in order)", got, want)
	}
	if n := len(p.Explain().Upstreams); n != 1 {
		t.Errorf("%d upstreams, want the served session's alone", n)
	}

	p.SetProviderStatus(7, []string{"203.0.113.9"}, nil)
	rot.await(t)
	want[1].ExitErrored, want[1].Rotating = true, true
	if got := p.Explain().Unserved; !slices.Equal(got, want) {
		t.Errorf("while s9 rotates: %+v, want %+v", got, want)
	}
	release <- struct{}{}
	waitFor(t, "the rotation", func() bool { return len(rs.get()) == 1 })
	want[1] = UnservedExplanation{Service: 7, Server: "gw.example.net", Session: "s9", ExitIP: "203.0.113.77"}
	if got := p.Explain().Unserved; !slices.Equal(got, want) {
		t.Errorf("after s9's rotation: %+v, want %+v", got, want)
	}
}
