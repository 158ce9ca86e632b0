package pool

import (
	"context"
	"errors"
	"slices"
	"sync/atomic"
)

// session is one ppr sticky session as the provider knows it: (service,
// server, session), the arguments of sticky/rotate. It stands behind one
// upstream per protocol it can be dialed with, and those upstreams share
// it: the session is rotated at most once per RotateInterval whichever of
// them asks, all of them are rotating until the provider answers (a key on
// any of them waits), and all get the new exit IP.
type session struct {
	key        sessionKey
	rot        atomic.Pointer[rotation] // non-nil while a rotation is under way
	lastRotate atomic.Int64             // pool clock of the last rotation request

	// Under Pool.mu:
	hosts  []*host // its upstreams in the current set
	mark   uint64  // the last Update that listed one of them, or listed it unserved
	exitIP string  // an unserved session's exit IP (UnservedSession); its upstreams carry theirs
}

type sessionKey struct {
	service         int
	server, session string
}

// rotation is one rotation of a ppr sticky session under way; done closes
// when it ends, and ok says whether the session got a new exit IP.
type rotation struct {
	done    chan struct{}
	ok      bool
	cause   Result       // the upstream failure that asked for it; numResults for an errored exit IP
	waiting atomic.Int64 // picks waiting for it
}

// rotation returns the rotation under way of h's session, or nil.
func (h *host) rotation() *rotation {
	if s := h.sess.Load(); s != nil {
		return s.rot.Load()
	}
	return nil
}

// syncRotating sets h's rotating bit from its session's rotation: the one
// rule for the bit, which linkSession and both ends of a rotation apply.
// The caller holds Pool.mu, under which a rotation starts and ends.
func (h *host) syncRotating() {
	var f uint32
	if h.rotation() != nil {
		f = fRotating
	}
	h.setFlags(fRotating, f)
}

// linkSession links h, an upstream of the set Update gen makes, to the
// session it stands for, shared with the session's other upstreams; its
// rotating bit follows its session's rotation, whatever it was (an
// upstream back from draining may carry the bit of a rotation that ended
// while it was out). The caller holds p.mu.
func (p *Pool) linkSession(h *host, gen uint64) {
	u := h.cur.Load()
	var s *session
	if u.Kind == PPR && u.Session != "" {
		s = p.sessionOf(sessionKey{u.Service, u.Server, u.Session}, h.sess.Load())
		if s.mark != gen {
			s.mark, s.hosts = gen, s.hosts[:0]
			p.linked++
		}
		s.hosts = append(s.hosts, h)
	}
	if h.sess.Load() != s {
		h.sess.Store(s)
	}
	h.syncRotating()
}

// sessionOf returns the session of key k in the set, adding it if needed.
// Back in the set, a session keeps its rotation history: the latest object
// of k is the one resting, if any, else prev (the one its upstream had
// before it drained) when it is k's. The caller holds p.mu.
func (p *Pool) sessionOf(k sessionKey, prev *session) *session {
	s := p.sessions[k]
	if s == nil {
		if s = p.resting[k]; s != nil {
			delete(p.resting, k)
		} else if prev != nil && prev.key == k {
			s = prev
		} else {
			s = &session{key: k}
		}
		p.sessions[k] = s
	}
	return s
}

// linkUnserved adds us, a session no upstream of Update gen stands for, to
// the set (p.unserved), where it is rotated when its exit IP is errored;
// it returns the session, or nil when us is not one: incomplete, or linked
// already (by an upstream or twice). The caller holds p.mu and has linked
// the upstreams of gen.
func (p *Pool) linkUnserved(us UnservedSession, gen uint64) *session {
	if us.Server == "" || us.Session == "" {
		return nil
	}
	s := p.sessionOf(sessionKey{us.Service, us.Server, us.Session}, nil)
	if s.mark == gen {
		return nil
	}
	s.mark, s.hosts, s.exitIP = gen, nil, us.ExitIP
	p.linked++
	p.unserved = append(p.unserved, s)
	return s
}

// restingMax bounds the sessions kept out of the set for their rotation
// limit (a few hundred bytes each); past it only those whose rotation is
// under way are kept.
const restingMax = 4096

// dropSessions takes out of the set the sessions that Update gen did not
// link; their draining upstreams keep theirs while in flight. A session
// whose rotation is under way, or whose last rotation was less than
// RotateInterval ago, is kept aside (resting) for as long as that lasts,
// so that back in a later refresh it is the same session: a provider
// list that misses it for one poll does not lift its limit of one
// rotation at a time and one per interval. Those whose time has passed are
// forgotten. The caller holds p.mu.
func (p *Pool) dropSessions(gen uint64) {
	now, interval := p.mono(), int64(p.cfg.Load().RotateInterval)
	p.pruneResting(now, interval)
	if p.linked == len(p.sessions) {
		return
	}
	for k, s := range p.sessions {
		if s.mark != gen {
			s.hosts = nil
			delete(p.sessions, k)
			if s.rot.Load() != nil || (s.limited(now, interval) && len(p.resting) < restingMax) {
				p.resting[k] = s
			}
		}
	}
}

// limited reports whether s's last rotation request is less than interval
// before now.
func (s *session) limited(now, interval int64) bool {
	return tooSoon(s.lastRotate.Load(), now, interval)
}

// tooSoon reports whether a rotation requested at last (pool clock; 0: none
// yet) is less than interval before now: the rule of limited, for
// requestRotate, which needs the value it tested for its compare-and-swap.
func tooSoon(last, now, interval int64) bool {
	return last != 0 && now-last < interval
}

// pruneResting forgets the resting sessions whose rotation has ended and
// whose interval has passed; the caller holds p.mu.
func (p *Pool) pruneResting(now, interval int64) {
	for k, s := range p.resting {
		if s.rot.Load() == nil && !s.limited(now, interval) {
			delete(p.resting, k)
		}
	}
}

// requestRotations asks for the rotation of the sessions of hs and of
// the unserved sessions idle, whose exit IPs are errored: once per
// session, however many of its upstreams hs holds.
func (p *Pool) requestRotations(hs []*host, idle []*session) {
	var asked map[*session]bool
	for _, h := range hs {
		s := h.sess.Load()
		if s == nil || asked[s] {
			continue
		}
		if len(hs) > 1 {
			if asked == nil {
				asked = make(map[*session]bool)
			}
			asked[s] = true
		}
		p.requestRotate(s, h, numResults)
	}
	for _, s := range idle {
		p.requestRotate(s, nil, numResults)
	}
}

// requestRotate asks the Rotator to rotate session s (nil: none, h stands
// for no session) because of the failure cause of h, one of its upstreams,
// or (numResults) its errored exit IP, h then being any of its upstreams
// or nil for an unserved session: at most once per session per
// RotateInterval, whoever asks. The session is rotating until the answer.
// A request held back by RotateInterval is neither counted by the Rotated
// hook nor an event: no rotation was asked of the provider, and it happens
// on every failure of the session within the interval ("rate_limited" is
// the provider's refusal for coming too soon).
func (p *Pool) requestRotate(s *session, h *host, cause Result) {
	if p.opts.Rotator == nil || s == nil || s.rot.Load() != nil {
		return
	}
	now := p.mono()
	last := s.lastRotate.Load()
	if tooSoon(last, now, int64(p.cfg.Load().RotateInterval)) {
		return
	}
	if !s.lastRotate.CompareAndSwap(last, now) {
		return // another report got there first
	}
	p.rotMu.Lock()
	if p.rotClosed {
		p.rotMu.Unlock()
		return
	}
	p.rotWG.Add(1)
	p.rotMu.Unlock()
	r := &rotation{done: make(chan struct{}), cause: cause}
	if !s.rot.CompareAndSwap(nil, r) {
		p.rotWG.Done()
		return
	}
	// h at once, so that the next pick passes it by; the session's other
	// upstreams as the rotation starts, under p.mu, where Update links them.
	if h != nil {
		h.setFlags(fRotating, fRotating)
	}
	go p.rotate(s, r, h)
}

func (p *Pool) rotated(service int, result string) {
	if f := p.opts.Hooks.Rotated; f != nil {
		f(service, result)
	}
}

// rotate runs one rotation of s, which h asked for (nil: s is unserved);
// Run waits for it. The session's upstreams are rotating while it runs:
// those of the set, and h, as it starts; those linked meanwhile, by
// linkSession. As it ends, every one of them marked at its start and every
// one of the set gets its bit back from its session (see syncRotating),
// whether it is still in the set, draining or linked elsewhere by now.
func (p *Pool) rotate(s *session, r *rotation, h *host) {
	defer p.rotWG.Done()
	k := s.key
	p.mu.Lock()
	marked := slices.Clone(s.hosts)
	if h != nil && !slices.Contains(marked, h) {
		marked = append(marked, h)
	}
	for _, t := range marked {
		t.syncRotating()
	}
	p.mu.Unlock()
	ctx, cancel := context.WithTimeout(p.ctx, p.cfg.Load().RotateTimeout)
	exitIP, err := p.opts.Rotator.Rotate(ctx, k.service, k.server, k.session)
	cancel()
	result := "ok"
	switch {
	case err != nil && rateLimited(err):
		result = "rate_limited"
	case err != nil:
		result = "error"
	}
	p.mu.Lock()
	// The news is for the session's upstreams in the set, and for the
	// asking one if it left the set since and still drains (connections
	// in flight): once per upstream ID, so not once it is forgotten or
	// when its ID came back meanwhile as another host of the session.
	hosts := slices.Clone(s.hosts)
	if h != nil && h.sess.Load() == s && p.draining[h.id] == h &&
		!slices.ContainsFunc(hosts, func(t *host) bool { return t.id == h.id }) {
		hosts = append(hosts, h)
	}
	if err == nil {
		s.exitIP = exitIP
		for _, t := range hosts {
			c := *t.cur.Load()
			c.ExitIP = exitIP
			t.setCur(&c)
			p.applyStatus(t)
		}
	}
	p.mu.Unlock()
	if err != nil {
		p.log.Warn("rotating sticky session", "service", k.service, "server", k.server, "session", k.session,
			"result", result, "err", err)
	} else {
		now := p.mono()
		for _, t := range hosts {
			// A new exit IP: the session starts over as healthy.
			t.consec.Store(0)
			if t.held.Load() {
				p.unhold(t)
			}
			if t.ejectedUntil.Load() != 0 {
				p.readmit(t, now)
			}
		}
		r.ok = true
		p.log.Debug("rotated sticky session", "service", k.service, "server", k.server, "session", k.session,
			"exit_ip", exitIP)
	}
	p.mu.Lock()
	s.rot.Store(nil)
	for _, t := range marked {
		t.syncRotating()
	}
	for _, t := range s.hosts {
		t.syncRotating()
	}
	p.mu.Unlock()
	close(r.done)
	kind := EventRotationFailed
	if r.ok {
		kind = EventRotated
	}
	for _, t := range hosts {
		p.record(kind, t.id, t.cur.Load().Service, result) // once per upstream ID
	}
	if len(hosts) == 0 {
		// No upstream to name (unserved, or its upstreams left the set
		// while the rotation ran): the session itself, in the reason.
		p.record(kind, "", k.service, result+": session "+k.session+" on "+k.server+", which no upstream stands for")
	}
	p.rotated(k.service, result)
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
