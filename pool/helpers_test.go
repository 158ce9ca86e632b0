package pool

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"
)

// clock is a settable clock for Options.Now.
type clock struct{ ns atomic.Int64 }

func newClock() *clock {
	c := &clock{}
	c.ns.Store(time.Date(2026, 11, 21, 10, 0, 0, 0, time.UTC).UnixNano())
	return c
}
func (c *clock) Now() time.Time          { return time.Unix(0, c.ns.Load()) }
func (c *clock) Advance(d time.Duration) { c.ns.Add(int64(d)) }

// newTestPool makes a pool with a fake clock unless opts has one, and runs
// it until the test ends.
func newTestPool(t testing.TB, cfg Config, opts Options) *Pool {
	t.Helper()
	p, err := New(cfg, opts)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("Run did not return")
		}
	})
	return p
}

// ups makes n fpr http upstreams of a service at 10.s.x.y:8080; past
// 65,536 of them the port goes up, so that every ID is distinct.
func ups(service, n int) []Upstream {
	out := make([]Upstream, n)
	for i := range out {
		out[i] = Upstream{
			Service: service, Kind: FPR, Protocol: HTTP,
			Address:  fmt.Sprintf("10.%d.%d.%d:%d", service%256, i/256%256, i%256, 8080+i/65536),
			Username: "u", Password: fmt.Sprintf("secret-%d", i),
		}
	}
	return out
}

// sessions makes n ppr sticky sessions of a service behind gateway gw.
func sessions(service, n int, gw string) []Upstream {
	out := make([]Upstream, n)
	for i := range out {
		out[i] = Upstream{
			Service: service, Kind: PPR, Protocol: HTTP, Address: gw + ":9000",
			Username: "u", Password: "secret", Server: "gw.example.net",
			Session: fmt.Sprintf("s%d", i), ExitIP: fmt.Sprintf("203.0.113.%d", i+1),
		}
	}
	return out
}

// pickReport picks, fails the test on an error, and reports and releases at
// once with r.
func pickReport(t testing.TB, p *Pool, req Request, r Result) *Upstream {
	t.Helper()
	u, err := p.Pick(context.Background(), req)
	if err != nil {
		t.Fatalf("Pick(%+v): %v", req, err)
	}
	p.Report(u, r, time.Millisecond)
	p.Release(u, req)
	return u
}

// pickUntil picks until the pick is the upstream id and returns it, held;
// the picks before it are reported Canceled (no verdict) and released.
func pickUntil(t testing.TB, p *Pool, req Request, id string) *Upstream {
	t.Helper()
	for range 1000 {
		u := mustPick(t, p, req)
		if u.ID() == id {
			return u
		}
		p.Report(u, Canceled, 0)
		p.Release(u, req)
	}
	t.Fatalf("1000 picks, none of them %s", id)
	return nil
}

// pickLater picks on a goroutine of its own (a pick that waits for a
// rotation) and sends what it got: nil after an error, which it reports.
func pickLater(t testing.TB, p *Pool, req Request) <-chan *Upstream {
	got := make(chan *Upstream, 1)
	go func() {
		u, err := p.Pick(context.Background(), req)
		if err != nil {
			t.Error(err)
		}
		got <- u
	}()
	return got
}

func mustPick(t testing.TB, p *Pool, req Request) *Upstream {
	t.Helper()
	u, err := p.Pick(context.Background(), req)
	if err != nil {
		t.Fatalf("Pick(%+v): %v", req, err)
	}
	return u
}

func stateOf(t testing.TB, p *Pool, id string) UpstreamExplanation {
	t.Helper()
	for _, u := range p.Explain().Upstreams {
		if u.ID == id {
			return u
		}
	}
	t.Fatalf("%s not in Explain", id)
	return UpstreamExplanation{}
}

func listenerOf(t testing.TB, p *Pool, name string) ListenerExplanation {
	t.Helper()
	for _, l := range p.Explain().Listeners {
		if l.Name == name {
			return l
		}
	}
	t.Fatalf("listener %s not in Explain", name)
	return ListenerExplanation{}
}

// fail reports n upstream failures through u, a handle from the pool, as
// if n connections had been picked on it.
func fail(p *Pool, u *Upstream, n int) {
	for range n {
		u.h.inFlight.Add(1)
		p.Report(u, DialRefused, time.Millisecond)
		p.Release(u, Request{})
	}
}

// handle returns the pool's current *Upstream for u's ID.
func handle(p *Pool, u Upstream) *Upstream {
	return p.snap.Load().byID[u.ID()].cur.Load()
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// conf returns DefaultConfig with set's changes.
func conf(set func(c *Config)) Config {
	c := DefaultConfig()
	set(&c)
	return c
}
