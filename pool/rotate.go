package pool

import (
	"context"
	"errors"
	"sync/atomic"
)

// rotation is one rotation of a ppr sticky session under way; done closes
// when it ends, and ok says whether the session got a new exit IP.
type rotation struct {
	done    chan struct{}
	ok      bool
	waiting atomic.Int64 // picks waiting for it
}

// requestRotate asks the Rotator to rotate h's session, at most once per
// session per RotateInterval; the session is rotating until the answer. A
// request held back by RotateInterval is counted by the Rotated hook as
// "rate_limited" but is no event: no rotation was tried, and it happens on
// every failure of the session within the interval.
func (p *Pool) requestRotate(h *host) {
	if p.opts.Rotator == nil || h.rot.Load() != nil {
		return
	}
	u := h.cur.Load()
	if u.Kind != PPR || u.Session == "" {
		return
	}
	now := p.now().UnixNano()
	last := h.lastRotate.Load()
	if last != 0 && now-last < int64(p.cfg.Load().RotateInterval) {
		p.rotated(u.Service, "rate_limited")
		return
	}
	if !h.lastRotate.CompareAndSwap(last, now) {
		return // another report got there first
	}
	r := &rotation{done: make(chan struct{})}
	if !h.rot.CompareAndSwap(nil, r) {
		return
	}
	p.rotMu.Lock()
	if p.rotClosed {
		p.rotMu.Unlock()
		h.rot.Store(nil)
		close(r.done)
		return
	}
	p.rotWG.Add(1)
	p.rotMu.Unlock()
	h.setFlags(fRotating, fRotating)
	go p.rotate(h, r, u)
}

func (p *Pool) rotated(service int, result string) {
	if f := p.opts.Hooks.Rotated; f != nil {
		f(service, result)
	}
}

// rotate runs one rotation; Run waits for it.
func (p *Pool) rotate(h *host, r *rotation, u *Upstream) {
	defer p.rotWG.Done()
	ctx, cancel := context.WithTimeout(p.ctx, p.cfg.Load().RotateTimeout)
	exitIP, err := p.opts.Rotator.Rotate(ctx, u.Service, u.Server, u.Session)
	cancel()
	result := "ok"
	switch {
	case err != nil && rateLimited(err):
		result = "rate_limited"
	case err != nil:
		result = "error"
	}
	if err != nil {
		p.log.Warn("rotating sticky session", "id", h.id, "result", result, "err", err)
	} else {
		p.mu.Lock()
		c := *h.cur.Load()
		c.ExitIP = exitIP
		h.setCur(&c)
		p.applyStatus(h)
		p.mu.Unlock()
		// A new exit IP: the session starts over as healthy.
		h.consec.Store(0)
		if h.held.Load() {
			p.unhold(h)
		}
		if h.ejectedUntil.Load() != 0 {
			p.readmit(h, p.now().UnixNano())
		}
		r.ok = true
		p.log.Debug("rotated sticky session", "id", h.id, "exit_ip", exitIP)
	}
	h.setFlags(fRotating, 0)
	h.rot.Store(nil)
	close(r.done)
	if r.ok {
		p.record(EventRotated, h.id, u.Service, result)
	} else {
		p.record(EventRotationFailed, h.id, u.Service, result)
	}
	p.rotated(u.Service, result)
	if r.ok {
		p.notifyChanged()
	}
}

func rateLimited(err error) bool {
	if errors.Is(err, ErrRotateRateLimited) {
		return true
	}
	var rl interface{ RateLimited() bool }
	return errors.As(err, &rl) && rl.RateLimited()
}

// stopRotations refuses new rotations, cancels the running ones and waits
// for them.
func (p *Pool) stopRotations() {
	p.rotMu.Lock()
	p.rotClosed = true
	p.rotMu.Unlock()
	p.cancel()
	p.rotWG.Wait()
}
