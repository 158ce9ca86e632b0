package pool

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestConcurrentPickReportUpdateRotate(t *testing.T) {
	baseline := runtime.NumGoroutine()
	// Cleanups run last-in first-out: this one runs after the pool's Run
	// has returned.
	t.Cleanup(func() {
		waitFor(t, "goroutines to end", func() bool { return runtime.NumGoroutine() <= baseline })
	})
	clk := newClock()
	var rotateN atomic.Int64
	rot := &fakeRotator{fn: func(ctx context.Context, _ string) (string, error) {
		n := rotateN.Add(1)
		if n%3 == 0 {
			return "", errors.New("503")
		}
		return fmt.Sprintf("203.0.113.%d", n%250+1), nil
	}}
	var ejections atomic.Int64
	func() {
		p := newTestPool(t, conf(func(c *Config) { c.RotateWait = 20 * time.Millisecond; c.StickyMax = 500 }), Options{
			Now: clk.Now, Rotator: rot,
			Hooks: Hooks{Ejected: func(int) { ejections.Add(1) }, Changed: func() {}},
		})
		p.SetListeners([]ListenerSlice{{Name: "all"}, {Name: "http", Protocol: HTTP}, {Name: "ppr", Kind: PPR}})

		// Service 1: 10.1.0.0-9 are always errored, 10.1.0.10-19 always
		// inactive, 10.1.0.20-29 sometimes errored. Service 2's sessions
		// behind gateway 198.51.100.9 are always inactive.
		var always []string
		for i := range 10 {
			always = append(always, fmt.Sprintf("10.1.0.%d", i))
		}
		var inactive []string
		for i := 10; i < 20; i++ {
			inactive = append(inactive, fmt.Sprintf("10.1.0.%d", i))
		}
		excluded := func(u *Upstream) bool {
			if u.Service == 2 {
				return hostPart(u.Address) == "198.51.100.9"
			}
			var last int
			if _, err := fmt.Sscanf(hostPart(u.Address), "10.1.0.%d", &last); err != nil {
				t.Errorf("unexpected upstream %s", u.ID())
			}
			return last < 20
		}
		p.SetProviderStatus(1, always, inactive)
		p.SetProviderStatus(2, nil, []string{"198.51.100.9"})

		fpr := ups(1, 60)
		for i := 30; i < 60; i++ {
			fpr[i].Protocol = SOCKS5
		}
		good := sessions(2, 10, "198.51.100.8")
		bad := sessions(2, 5, "198.51.100.9")
		for i := range bad {
			bad[i].Session = fmt.Sprint("bad", i)
		}
		setA := append(append(append([]Upstream{}, fpr...), good...), bad...)
		setB := append(append(append([]Upstream{}, fpr[5:50]...), good[3:]...), bad...)
		p.Update(setA)

		ctx, cancel := context.WithCancel(context.Background())
		var writers sync.WaitGroup
		writers.Add(1)
		go func() {
			defer writers.Done()
			sometimes := append([]string{}, always...)
			for i := 0; ctx.Err() == nil; i++ {
				switch i % 6 {
				case 0:
					p.Update(setA)
				case 1:
					p.Update(setB)
				case 2:
					st := sometimes
					if i%12 == 2 {
						st = append(append([]string{}, always...), "10.1.0.20", "10.1.0.21", "10.1.0.22")
					}
					p.SetProviderStatus(1, st, inactive)
				case 3:
					// Errored exit IPs: rotations.
					p.SetProviderStatus(2, []string{good[i%10].ExitIP, "203.0.113.7"}, []string{"198.51.100.9"})
				case 4:
					p.SetUsage(2, float64(i%8*20), 100) // over quota every fourth time
				case 5:
					clk.Advance(10 * time.Second)
					_ = p.Explain()
					p.sweep()
				}
			}
		}()

		const workers, rounds = 64, 300
		var wg sync.WaitGroup
		var picked atomic.Int64
		listeners := []string{"all", "http", "ppr"}
		results := []Result{Success, Success, Success, DialRefused, DestinationError, Canceled, HandshakeTimeout}
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(uint64(w), 1))
				for i := range rounds {
					req := Request{Listener: listeners[rng.IntN(3)]}
					if rng.IntN(3) == 0 {
						req.Key = fmt.Sprint("w", w, "k", rng.IntN(20))
					}
					var tried []string
					for attempt := 0; attempt < 3; attempt++ {
						req.Avoid = tried
						u, err := p.Pick(context.Background(), req)
						if err != nil {
							if !errors.Is(err, ErrNoUpstream) {
								t.Errorf("Pick: %v", err)
							}
							break
						}
						picked.Add(1)
						if excluded(u) {
							t.Errorf("worker %d round %d: picked provider-excluded %s", w, i, u.ID())
						}
						r := results[rng.IntN(len(results))]
						p.Report(u, r, time.Duration(rng.IntN(100))*time.Millisecond)
						p.Release(u, req)
						if r == Success || !r.UpstreamFault() {
							break
						}
						tried = append(tried, u.ID())
					}
				}
			}()
		}
		wg.Wait()
		cancel()
		writers.Wait()
		capHolds(t, p, "after the run")
		if picked.Load() < workers*rounds/2 {
			t.Errorf("only %d picks succeeded", picked.Load())
		}
		// In flight back to zero, current and drained alike.
		p.Update(setA)
		for _, u := range p.Explain().Upstreams {
			if u.InFlight != 0 {
				t.Errorf("%s: %d in flight", u.ID, u.InFlight)
			}
		}
		for _, u := range setB {
			if h := p.snap.Load().byID[u.ID()]; h == nil || h.inFlight.Load() != 0 {
				t.Errorf("%s: in flight wrong", u.ID())
			}
		}
		p.mu.Lock()
		if len(p.draining) != 0 {
			t.Errorf("%d draining upstreams left", len(p.draining))
		}
		p.mu.Unlock()
		t.Logf("%d picks, %d rotations, %d ejections", picked.Load(), rot.count(), ejections.Load())
	}()
}
