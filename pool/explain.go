package pool

import (
	"cmp"
	"slices"
	"strings"
	"time"
)

// state is h's state as /pool shows it, with the reason for it.
func (p *Pool) state(h *host, now int64) (State, string) {
	fl := h.flags.Load()
	switch {
	case fl&fDraining != 0:
		return Draining, "removed from the provider's list"
	case fl&fProviderInactive != 0:
		return ProviderInactive, "on the provider's inactive list"
	case fl&fProviderError != 0:
		return ProviderError, "on the provider's errored list"
	case fl&fRotating != 0:
		if fl&fExitErrored != 0 {
			return Rotating, "exit ip on the provider's errored list"
		}
		if r := h.rotation(); r != nil && r.cause.UpstreamFault() {
			return Rotating, r.cause.String() // the failure of whichever of the session's upstreams failed
		}
		return Rotating, Result(h.reason.Load()).String()
	}
	if until := h.ejectedUntil.Load(); until != 0 {
		if now < until {
			return Ejected, Result(h.reason.Load()).String()
		}
		return Probing, "ejection over, waiting for a trial connection"
	}
	if fl&fQuota != 0 {
		return Quota, "service usage reached quota_headroom of its limit"
	}
	if fl&fExitErrored != 0 {
		return Healthy, "exit ip on the provider's errored list, not rotated yet"
	}
	if h.held.Load() {
		return Healthy, "failing, kept in by the ejection cap: " + Result(h.reason.Load()).String()
	}
	return Healthy, ""
}

// Explain returns what /pool shows: every upstream, current and draining, in
// ID order, per listener slice its usable count and panic flag, and the
// sticky sessions no upstream stands for. It holds no password.
func (p *Pool) Explain() Explanation {
	p.mu.Lock()
	s := p.snap.Load()
	hosts := slices.Clone(s.hosts)
	for _, h := range p.draining {
		if h.inFlight.Load() > 0 {
			hosts = append(hosts, h)
		}
	}
	unserved := make([]UnservedExplanation, 0, len(p.unserved))
	for _, ss := range p.unserved {
		st := p.statusOf(ss.key.service)
		unserved = append(unserved, UnservedExplanation{
			Service: ss.key.service, Server: ss.key.server, Session: ss.key.session, ExitIP: ss.exitIP,
			ExitErrored: st.exitErrored(ss.exitIP), Rotating: ss.rot.Load() != nil,
		})
	}
	p.mu.Unlock()
	slices.SortFunc(unserved, func(a, b UnservedExplanation) int {
		return cmp.Or(a.Service-b.Service, strings.Compare(a.Server, b.Server), strings.Compare(a.Session, b.Session))
	})
	now := p.now()
	ns := p.nanos(now)
	x := Explanation{Updated: s.updated.UTC(), Upstreams: make([]UpstreamExplanation, 0, len(hosts)), Unserved: unserved}
	x.Listeners = p.listenersOf(s, ns)
	slices.SortFunc(hosts, func(a, b *host) int { return strings.Compare(a.id, b.id) })
	for _, h := range hosts {
		u := h.cur.Load()
		st, reason := p.state(h, ns)
		ue := UpstreamExplanation{
			ID: h.id, Service: u.Service, Kind: u.Kind, Protocol: u.Protocol, Address: u.Address,
			Server: u.Server, Session: u.Session, ExitIP: u.ExitIP, Match: u.Match, State: st, Reason: reason,
			Failures: h.failures.Load(), ConsecutiveFailures: h.consec.Load(),
			Ejections: h.ejections.Load(), InFlight: h.inFlight.Load(),
		}
		if until := h.ejectedUntil.Load(); until != 0 && st == Ejected {
			t := now.Add(time.Duration(until - ns)).UTC() // the wall time the ejection ends at, from now
			ue.EjectedUntil = &t
		}
		x.Upstreams = append(x.Upstreams, ue)
	}
	return x
}

// Listeners returns the listener slices of Explain alone: usable and total
// counts and the panic flag, without walking the upstreams' details or
// sorting them; for /readyz and metrics.
func (p *Pool) Listeners() []ListenerExplanation {
	return p.listenersOf(p.snap.Load(), p.mono())
}

func (p *Pool) listenersOf(s *snapshot, ns int64) []ListenerExplanation {
	var out []ListenerExplanation
	for _, sl := range s.slices {
		if sl == s.all || sl.Retiring {
			continue
		}
		le := ListenerExplanation{Name: sl.Name, Total: len(sl.members)}
		quota := 0
		for _, h := range sl.members {
			st, _ := p.state(h, ns)
			switch st {
			case Healthy, Probing:
				le.Usable++
			case Quota:
				quota++
			}
		}
		if le.Usable == 0 {
			le.Usable = quota // quota upstreams serve when nothing else can
		}
		le.Panic = sl.panic.Load()
		out = append(out, le)
	}
	return out
}
