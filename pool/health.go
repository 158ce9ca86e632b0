package pool

import (
	"cmp"
	"net"
	"slices"
	"sync/atomic"
	"time"
)

// Bits of host.flags. The provider bits are recomputed by the writer (under
// Pool.mu); fRotating belongs to the rotation of the host's session (see
// session), fDraining to Update.
const (
	fProviderError    uint32 = 1 << iota // the upstream's gateway IP is on the errored list
	fProviderInactive                    // ... on the inactive list
	fExitErrored                         // a ppr session whose exit IP is on the errored list: rotated, not excluded
	fQuota                               // its ppr service reached its usage limit
	fDraining                            // removed from the set; in-flight connections finish
	fRotating                            // its ppr session is waiting for its rotation

	providerBits = fProviderError | fProviderInactive | fExitErrored | fQuota
	// excluded are the bits that keep an upstream from any new connection.
	excluded = fProviderError | fProviderInactive | fDraining | fRotating
)

// host is the pool's mutable per-upstream state, shared by every *Upstream
// value that stands for the same ID. Everything the hot path reads is an
// atomic; writers that must agree with each other (ejection and the ejection
// cap) take Pool.ejectMu.
type host struct {
	// Read by Update for every upstream: kept together at the front.
	cur      atomic.Pointer[Upstream] // the current exported fields (replaced by Update and rotation)
	mark     uint64                   // the last Update that listed it; under Pool.mu
	flags    atomic.Uint32
	reason   atomic.Uint32 // last failure Result
	id       string
	addrHost string                  // host part of Address, as the status lists name it unless StatusIP says otherwise
	sess     atomic.Pointer[session] // the ppr sticky session it stands for, if any; Update links it

	inFlight     atomic.Int64
	ejectedUntil atomic.Int64 // pool clock (Pool.nanos); non-zero from ejection until a trial succeeds
	consec       atomic.Int64 // consecutive upstream failures
	failures     atomic.Int64 // all upstream failures
	ejections    atomic.Int64
	readmitted   atomic.Int64 // pool clock of the last re-admission
	ewma         atomic.Int64 // moving average of dial + handshake, ns; 0 = not measured
	streak       atomic.Int32 // ejections in a row; decides the ejection's length
	trial        atomic.Bool  // the one trial connection of a probing upstream is out
	held         atomic.Bool  // its ejection was refused by the ejection cap (panic)
}

func newHost(id string, u *Upstream) *host {
	h := &host{id: id, addrHost: hostPart(u.Address)}
	h.reason.Store(uint32(numResults))
	h.setCur(u)
	return h
}

// setCur publishes a copy of u as the host's current upstream.
func (h *host) setCur(u *Upstream) {
	c := *u
	c.h = h
	h.cur.Store(&c)
}

// setFlags replaces the bits of mask with val.
func (h *host) setFlags(mask, val uint32) (old uint32) {
	for {
		old = h.flags.Load()
		if h.flags.CompareAndSwap(old, old&^mask|val&mask) {
			return old
		}
	}
}

// hostPart is the host of addr as the provider's status lists name it;
// addr itself when it has no port.
func hostPart(addr string) string {
	if h, _, err := net.SplitHostPort(addr); err == nil {
		return h
	}
	return addr
}

// Report records the outcome of dial + handshake through u, which Pick
// handed out; took is how long that took and feeds the latency average on
// Success. Failures of the upstream itself count toward ejection; a failing
// ppr sticky session is also rotated.
func (p *Pool) Report(u *Upstream, r Result, took time.Duration) {
	h := u.h
	if h == nil {
		return
	}
	// The trial of the ejection under way, if u holds it: not of one that
	// ended since by other means.
	trial := u.trial && u.trialOf == h.ejections.Load() && h.ejectedUntil.Load() != 0
	switch {
	case r == Success:
		h.observe(took)
		p.succeeded(h, trial)
	case r.UpstreamFault():
		p.failed(h, r, trial)
	default: // destination errors and cancellations say nothing about the upstream
		if trial {
			h.trial.Store(false) // let another connection decide
		}
	}
}

// Release ends an attempt or the connection it carried; req is the
// Request of its Pick. A sticky key's idle time starts when the last pick
// of it is released, so that a key does not expire under a connection
// that outlasts sticky_idle.
func (p *Pool) Release(u *Upstream, req Request) {
	if h := u.h; h != nil {
		h.inFlight.Add(-1)
	}
	if req.Key != "" {
		k := stickyKey{req.Listener, req.Key}
		sh, hash := p.sticky.locate(k)
		sh.mu.Lock()
		sh.release(k, hash, p.fastNow(), p.sticky.perShard.Load())
		sh.mu.Unlock()
	}
}

const ewmaShift = 2 // weight of a new sample: 1/4

func (h *host) observe(took time.Duration) {
	if took <= 0 {
		return
	}
	x := int64(took)
	for {
		old := h.ewma.Load()
		n := x
		if old != 0 {
			n = old + (x-old)>>ewmaShift
		}
		if h.ewma.CompareAndSwap(old, n) {
			return
		}
	}
}

// succeeded is the rule for a success through h, of a connection (trial:
// the one trial of its ejection) or of a probe holding the trial claim.
// The trial's success ends the ejection; so does any other that comes once
// the ejection is over (a connection picked before it, whose handshake
// took that long, still shows the upstream works), never one within it.
func (p *Pool) succeeded(h *host, trial bool) {
	if h.consec.Load() != 0 {
		h.consec.Store(0)
	}
	if h.held.Load() {
		p.unhold(h)
	}
	until := h.ejectedUntil.Load()
	if until == 0 && h.streak.Load() == 0 {
		return
	}
	now := p.mono()
	if until != 0 {
		if trial || now >= until {
			p.readmit(h, now)
		}
		return
	}
	// A long healthy stretch since the last re-admission forgets the ejection
	// history, so that a flap next week starts at the base duration again.
	if now-h.readmitted.Load() >= int64(p.cfg.Load().EjectMax) {
		h.streak.Store(0)
	}
}

// failed is the rule for a failure of h itself, reported by a connection
// (Report) or by an active probe: counted, one more consecutive failure,
// a rotation asked for if h stands for a ppr sticky session, and then
// ejection at the threshold, or a new ejection when the failure was the
// trial of a probing h (trial: a connection or a probe holding its trial
// claim).
func (p *Pool) failed(h *host, r Result, trial bool) {
	p.countFailure(h, r)
	c := h.consec.Add(1)
	p.requestRotate(h.sess.Load(), h, r) // if it stands for a ppr sticky session
	if h.ejectedUntil.Load() != 0 {
		if trial {
			p.reeject(h) // the trial failed
		}
		return // a late report of a connection picked before the ejection
	}
	if c >= int64(p.cfg.Load().FailureThreshold) {
		p.eject(h)
	}
}

// countFailure records a failure of h itself for failed: its reason, the
// failures /pool shows and the Failure hook
// (proxyd_upstream_failures_total), which must agree.
func (p *Pool) countFailure(h *host, r Result) {
	h.reason.Store(uint32(r))
	h.failures.Add(1)
	if f := p.opts.Hooks.Failure; f != nil {
		f(h.cur.Load().Service, r)
	}
}

// eject takes h out of rotation unless that would put a listener slice
// containing it past the ejection cap; then h stays in, held, and the slice
// is in panic mode. An h that counts in no cap (draining, or excluded by
// the provider: a late report of a connection picked before) is not
// ejected: its failures are counted, and should it count again its next
// failure is weighed against the cap like any other. Ejected there, it
// would come back into the count past the cap.
func (p *Pool) eject(h *host) {
	p.ejectMu.Lock()
	if h.ejectedUntil.Load() != 0 || !capped(h.flags.Load()) {
		p.ejectMu.Unlock()
		return
	}
	cfg := p.cfg.Load()
	s := p.snap.Load()
	u := h.cur.Load()
	for _, sl := range s.slices {
		if !sl.Retiring && sl.matches(u) && sl.ejected.Load()+1 > ejectCap(cfg, sl) {
			p.setHeld(s, h, u, true)
			p.checkPanics(cfg, s, u)
			p.ejectMu.Unlock()
			return
		}
	}
	for _, sl := range s.slices {
		if sl.matches(u) {
			sl.ejected.Add(1)
		}
	}
	p.startEjection(cfg, h)
	p.setHeld(s, h, u, false)
	p.checkPanics(cfg, s, u)
	p.ejectMu.Unlock()
	p.ejected(h, u)
}

// fitCaps ends the ejections that no longer fit under the caps of s,
// whose figures count has just counted; it returns their hosts. The caller
// holds p.ejectMu. A slice's count grows past its cap without an ejection
// when ejected members count again (off the provider's lists, back from
// draining) or when the cap shrinks (its base shrinks, or a reload lowers
// MaxEjectedPercent). Past the cap, failing upstreams stay in with their
// failures counted and the slice is in panic mode, whatever the order in
// which that came about: so the ejections that would end first (a probing
// member's has ended already) end now, and their upstreams are held, as if
// the cap had refused them. Their failure counts and ejection history stay.
func (p *Pool) fitCaps(cfg *Config, s *snapshot) []*host {
	var ended []*host
	for _, sl := range s.slices {
		over := sl.ejected.Load() - ejectCap(cfg, sl)
		if over <= 0 || sl.Retiring {
			continue
		}
		type out struct {
			h     *host
			until int64
		}
		var outs []out
		for _, h := range sl.members {
			if until := h.ejectedUntil.Load(); until != 0 && capped(h.flags.Load()) {
				outs = append(outs, out{h, until})
			}
		}
		slices.SortStableFunc(outs, func(a, b out) int { return cmp.Compare(a.until, b.until) })
		now := p.mono()
		for _, o := range outs[:min(over, int64(len(outs)))] {
			h, u := o.h, o.h.cur.Load()
			endEjection(s, h, u, now) // back in as a re-admission is
			p.setHeld(s, h, u, true)
			ended = append(ended, h)
		}
	}
	return ended
}

// ejectCap is how many members of sl may be ejected at once.
func ejectCap(cfg *Config, sl *slice) int64 {
	return int64(cfg.MaxEjectedPercent) * sl.eligible.Load() / 100
}

// capped reports whether an upstream with flags fl counts in its slices'
// ejection caps: whether it is one of the usable upstreams the cap is a
// share of (neither draining nor excluded by the provider). Only those
// count as ejected or held, so that the cap's share and base are of the
// same set: an upstream the provider lists after its ejection can be
// neither picked nor probed, and would otherwise hold a place under the cap
// for as long as it stays listed.
func capped(fl uint32) bool {
	return fl&(fDraining|fProviderError|fProviderInactive) == 0
}

// setHeld sets whether h is a failing upstream kept in by the ejection cap,
// and counts it in the slices of s that hold it; the caller holds
// p.ejectMu, and h counts in the caps (capped).
func (p *Pool) setHeld(s *snapshot, h *host, u *Upstream, held bool) {
	if h.held.Swap(held) == held {
		return
	}
	d := int64(1)
	if !held {
		d = -1
	}
	for _, sl := range s.slices {
		if sl.matches(u) {
			sl.held.Add(d)
		}
	}
}

// unhold clears h's held mark: it worked again, or has a new exit IP.
func (p *Pool) unhold(h *host) {
	p.ejectMu.Lock()
	defer p.ejectMu.Unlock()
	if !h.held.Load() {
		return
	}
	if !capped(h.flags.Load()) {
		h.held.Store(false) // in no slice's counts
		return
	}
	cfg, s, u := p.cfg.Load(), p.snap.Load(), h.cur.Load()
	p.setHeld(s, h, u, false)
	p.checkPanics(cfg, s, u)
}

// checkPanics updates the panic mode of the listener slices of s that hold
// u; the caller holds p.ejectMu.
func (p *Pool) checkPanics(cfg *Config, s *snapshot, u *Upstream) {
	for _, sl := range s.slices {
		if sl.matches(u) {
			p.checkPanic(cfg, s, sl)
		}
	}
}

// checkPanic sets sl's panic mode, on when a failing member is kept in
// because the slice has no room under its ejection cap, and records the
// change; the caller holds p.ejectMu. The whole-set slice used while no
// listeners are set is no listener's and records nothing.
func (p *Pool) checkPanic(cfg *Config, s *snapshot, sl *slice) {
	on := !sl.Retiring && sl.held.Load() > 0 && sl.ejected.Load() >= ejectCap(cfg, sl)
	if sl.panic.Swap(on) == on || sl == s.all {
		return
	}
	kind := EventPanic
	if !on {
		kind = EventPanicOver
	}
	p.record(kind, "", 0, sl.Name)
}

// reeject extends the ejection of a probing upstream whose trial failed; it
// is already counted against the cap, if it counts in it at all.
func (p *Pool) reeject(h *host) {
	p.ejectMu.Lock()
	if h.ejectedUntil.Load() == 0 {
		p.ejectMu.Unlock()
		return
	}
	p.startEjection(p.cfg.Load(), h)
	p.ejectMu.Unlock()
	p.ejected(h, h.cur.Load())
}

// startEjection starts h's ejection, or a probing h's next one, from now:
// the next of its streak, as long as ejectDuration makes it. The caller
// holds p.ejectMu and has counted h against the caps it counts in. The end
// goes in before the trial claim is freed: a probing h whose trial failed
// is past its last end, and would otherwise look free to a pick in
// between, whose connection would hold the trial of the new ejection.
func (p *Pool) startEjection(cfg *Config, h *host) {
	k := h.streak.Add(1)
	h.ejectedUntil.Store(p.mono() + int64(p.ejectDuration(cfg, int(k))))
	h.ejections.Add(1) // before the claim is freed: a trial of this ejection carries its number
	h.trial.Store(false)
}

// ejected tells the hook and the event log about an ejection of h; the
// event's reason is the failure class that ejected it.
func (p *Pool) ejected(h *host, u *Upstream) {
	if f := p.opts.Hooks.Ejected; f != nil {
		f(u.Service)
	}
	p.record(EventEjected, h.id, u.Service, Result(h.reason.Load()).String())
	p.notifyChanged()
}

// readmit puts an ejected upstream back into rotation.
func (p *Pool) readmit(h *host, now int64) {
	p.ejectMu.Lock()
	if h.ejectedUntil.Load() == 0 {
		p.ejectMu.Unlock()
		return
	}
	h.consec.Store(0)
	u, s := h.cur.Load(), p.snap.Load()
	if endEjection(s, h, u, now) {
		p.checkPanics(p.cfg.Load(), s, u)
	}
	p.ejectMu.Unlock()
	p.record(EventReadmitted, h.id, u.Service, "")
	p.notifyChanged()
}

// endEjection puts h, whose upstream is u, back into rotation at now and
// takes it off the ejected counts of the slices of s that hold it, if it
// counts in their caps (counted); its streak stays, for the next ejection's
// length. The caller holds p.ejectMu.
func endEjection(s *snapshot, h *host, u *Upstream, now int64) (counted bool) {
	// readmitted first: a success that sees the ejection over must see
	// this re-admission too, or it takes the upstream for one healthy
	// since long and forgets its ejection history (succeeded).
	h.readmitted.Store(now)
	h.ejectedUntil.Store(0)
	h.trial.Store(false)
	if !capped(h.flags.Load()) {
		return false
	}
	for _, sl := range s.slices {
		if sl.matches(u) {
			sl.ejected.Add(-1)
		}
	}
	return true
}

// ejectDuration is EjectBase × 2^(k-1), capped at EjectMax, ±20 % jitter,
// never past EjectMax.
func (p *Pool) ejectDuration(cfg *Config, k int) time.Duration {
	d := cfg.EjectBase
	for i := 1; i < k && d < cfg.EjectMax; i++ {
		d *= 2
	}
	d = min(d, cfg.EjectMax)
	// jitter factor in [0.8, 1.2]
	j := float64(p.rand()>>11) / (1 << 53)
	d = time.Duration(float64(d) * (0.8 + 0.4*j))
	return min(d, cfg.EjectMax)
}
