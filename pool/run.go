package pool

import (
	"context"
	"sync"
	"time"
)

// Run does the pool's background work until ctx ends: the sticky table's
// idle sweep, forgetting drained upstreams, the optional active probe, and
// the Changed hook, and the hot path's copy of the clock: without Run (and
// without Options.Now) ejections do not end and sticky keys do not expire.
// A round of probes runs on a goroutine of its own, one round at a time (a
// probe tick while one runs is skipped), so that probes slow to answer hold
// up none of the rest. A SetConfig resets its sweep and probe periods. When
// ctx ends it cancels the probe round and running rotations, waits for them
// and returns nil. Call it once.
func (p *Pool) Run(ctx context.Context) error {
	defer p.stopRotations()
	var probes sync.WaitGroup
	defer probes.Wait()
	// Cancelled before probes.Wait: the round's probes end with Run.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// One round at a time; the buffer takes the last round's end when Run
	// has stopped listening.
	probed := make(chan struct{}, 1)
	probing := false
	tick := time.NewTicker(tickEvery)
	defer tick.Stop()
	var sweep, probe *time.Ticker
	var probeC <-chan time.Time
	stop := func() {
		sweep.Stop()
		if probe != nil {
			probe.Stop()
		}
	}
	start := func() {
		cfg := p.cfg.Load()
		sweep = time.NewTicker(sweepEvery(cfg.StickyIdle))
		probe, probeC = nil, nil
		if cfg.ProbeInterval > 0 {
			probe = time.NewTicker(cfg.ProbeInterval)
			probeC = probe.C
		}
	}
	start()
	defer stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case t := <-tick.C:
			p.tick.Store(p.nanos(t))
		case <-sweep.C:
			p.sweep()
		case <-probeC:
			if !probing {
				probing = true
				probes.Go(func() {
					p.probeOnce(ctx)
					probed <- struct{}{}
				})
			}
		case <-probed:
			probing = false
		case <-p.reconfig:
			stop()
			start()
		case <-p.changed:
			if f := p.opts.Hooks.Changed; f != nil {
				f()
			}
		}
	}
}

// sweepEvery is the period of the idle sweep of sticky keys.
func sweepEvery(idle time.Duration) time.Duration {
	return min(max(idle/4, time.Second), time.Minute)
}

// sweep drops idle sticky keys, drained upstreams and resting sessions
// whose rotation limit has passed.
func (p *Pool) sweep() {
	now := p.mono()
	cfg := p.cfg.Load()
	idle := int64(cfg.StickyIdle)
	for i := range p.sticky.shards {
		p.sticky.shards[i].expire(now, idle)
	}
	p.mu.Lock()
	p.pruneDraining()
	p.pruneResting(now, int64(cfg.RotateInterval))
	p.mu.Unlock()
}

// probeOnce probes ejected upstreams, as many as the minute's budget allows,
// continuing where the last round stopped, each bounded by ProbeTimeout. A
// success re-admits the upstream; a failure of the upstream is one like a
// connection's (see failed), and past the ejection the probe is the trial
// that decides. Run calls it on a goroutine of its own, never two at once:
// the probe cursor and budget are the round's.
func (p *Pool) probeOnce(ctx context.Context) {
	if p.opts.Prober == nil {
		return
	}
	now := p.now()
	if now.Sub(p.probeWindow) >= time.Minute {
		p.probeWindow, p.probeUsed = now, 0
	}
	cfg := p.cfg.Load()
	s := p.snap.Load()
	n := len(s.hosts)
	for i := 0; i < n && p.probeUsed < cfg.ProbeBudget && ctx.Err() == nil; i++ {
		p.probeCursor++
		if p.probeCursor >= n {
			p.probeCursor = 0
		}
		h := s.hosts[p.probeCursor]
		if h.ejectedUntil.Load() == 0 || h.flags.Load()&excluded != 0 {
			continue
		}
		if !h.trial.CompareAndSwap(false, true) {
			continue // a connection is trying it
		}
		p.probeUsed++
		pctx, cancel := context.WithTimeout(ctx, cfg.ProbeTimeout)
		r := p.opts.Prober.Probe(pctx, h.cur.Load())
		cancel()
		switch {
		case ctx.Err() != nil: // Run is stopping: the probe was cut, not answered
			h.trial.Store(false)
			return
		case r == Success:
			p.readmit(h, p.mono())
		case r.UpstreamFault() && p.mono() >= h.ejectedUntil.Load():
			// Past the ejection the probe was its trial, and its failure
			// takes a connection's rule: counted, one more consecutive
			// failure, a ppr session's rotation asked for, ejected again.
			// Within the ejection it only says the upstream is still down:
			// counted nowhere (probe traffic must not inflate the failure
			// metrics, nor ask for a rotation that would end the ejection).
			p.failed(h, r, true)
			h.trial.Store(false) // the probe's claim, if the failure left it
		default:
			h.trial.Store(false)
		}
	}
}
