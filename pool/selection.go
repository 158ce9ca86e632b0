package pool

import (
	"context"
	"sync/atomic"
	"time"
)

// filter decides which members of a slice may take a new connection.
type filter struct {
	avoid []string // IDs already tried by this connection
	skip  *host    // one more host to leave out
	quota bool     // whether upstreams of a service in quota may serve
	now   int64    // unix ns, read from the clock only when needed
	clock func() int64
}

// eligible reports whether h may take a new connection, without claiming it.
func (f *filter) eligible(h *host) bool {
	fl := h.flags.Load()
	if fl&excluded != 0 || (fl&fQuota != 0 && !f.quota) || h == f.skip {
		return false
	}
	if until := h.ejectedUntil.Load(); until != 0 {
		// Ejected, or probing: past the ejection, one trial connection at a time.
		if f.now == 0 {
			f.now = f.clock()
		}
		if f.now < until || h.trial.Load() {
			return false
		}
	}
	for _, id := range f.avoid {
		if id == h.id {
			return false
		}
	}
	return true
}

// take claims h for one connection; it fails when another connection won
// h's trial first.
func take(h *host) bool {
	if h.ejectedUntil.Load() != 0 && !h.trial.CompareAndSwap(false, true) {
		return false
	}
	h.inFlight.Add(1)
	return true
}

// The strategies are pure functions over a slice's members: they return the
// index of the chosen eligible member or -1 (latencyBand: the members to
// choose among), and claim nothing. start spreads ties and scans.

// pickFirst scans from start and returns the first eligible member: round
// robin with start the slice's counter, random with a random start.
func pickFirst(hs []*host, start uint64, f *filter) int {
	n := uint64(len(hs))
	if n == 0 {
		return -1
	}
	i := start % n
	for range n {
		if f.eligible(hs[i]) {
			return int(i)
		}
		if i++; i == n {
			i = 0
		}
	}
	return -1
}

// pickLeastConn returns an eligible member with the fewest connections in
// flight; among equals the first from start. An idle member ends the scan.
func pickLeastConn(hs []*host, start uint64, f *filter) int {
	n := uint64(len(hs))
	best, bestN := -1, int64(0)
	if n == 0 {
		return -1
	}
	i := start % n
	for range n {
		h := hs[i]
		if c := h.inFlight.Load(); (best < 0 || c < bestN) && f.eligible(h) {
			best, bestN = int(i), c
			if c <= 0 {
				break
			}
		}
		if i++; i == n {
			i = 0
		}
	}
	return best
}

// latencyBand returns the eligible members whose moving average of dial +
// handshake time is within (1+tol) × the best one's. Members not measured
// yet count as within the band, so that they get measured.
func latencyBand(hs []*host, f *filter, tol float64) []*host {
	var best int64 = -1
	for _, h := range hs {
		if e := h.ewma.Load(); (best < 0 || e < best) && e > 0 && f.eligible(h) {
			best = e
		}
	}
	limit := int64(float64(best) * (1 + tol))
	var band []*host
	for _, h := range hs {
		if e := h.ewma.Load(); (best < 0 || e <= limit) && f.eligible(h) {
			band = append(band, h)
		}
	}
	return band
}

// band is a slice's current latency band for one quota mode. Computing it
// walks the whole slice, so it is reused for a number of picks or a second,
// whichever ends first; picks take turns among its members.
type band struct {
	hosts      []*host
	left       atomic.Int64 // picks before a refresh
	until      int64        // unix ns after which it is refreshed
	refreshing atomic.Bool
}

const bandMaxAge = int64(time.Second)

func (p *Pool) band(sl *slice, quota, stale bool) *band {
	i := 0
	if quota {
		i = 1
	}
	b := sl.bands[i].Load()
	if b != nil && !stale {
		fresh := b.left.Add(-1) >= 0 && p.fastNow() < b.until
		if fresh || !b.refreshing.CompareAndSwap(false, true) {
			return b // fresh, or another pick is refreshing it
		}
	}
	f := filter{quota: quota, clock: p.fastNow}
	nb := &band{hosts: latencyBand(sl.members, &f, p.cfg.Load().LatencyTolerance), until: p.fastNow() + bandMaxAge}
	nb.left.Store(int64(max(64, len(sl.members)/8)))
	sl.bands[i].Store(nb)
	return nb
}

// choose runs the strategy over sl and claims the chosen host. Upstreams of
// services in quota serve only when nothing else can.
func (p *Pool) choose(sl *slice, f *filter) *host {
	f.quota = false
	if h := p.chooseOnce(sl, f); h != nil || !p.anyQuot.Load() {
		return h
	}
	f.quota = true
	return p.chooseOnce(sl, f)
}

func (p *Pool) chooseOnce(sl *slice, f *filter) *host {
	cfg := p.cfg.Load()
	for range 4 { // take fails only when another connection won a trial
		hs := sl.members
		var i int
		switch cfg.Strategy {
		case Random:
			i = pickFirst(hs, p.rand(), f)
		case LeastConn:
			i = pickLeastConn(hs, sl.rr.Add(1), f)
		case Latency:
			hs = p.band(sl, f.quota, false).hosts
			if i = pickFirst(hs, sl.rr.Add(1), f); i < 0 {
				// Nothing of the band can serve this pick: its members
				// went out since it was made, or this connection tried
				// them already; then the best of the rest for it alone.
				if len(f.avoid) == 0 && f.skip == nil {
					hs = p.band(sl, f.quota, true).hosts
				} else {
					hs = latencyBand(sl.members, f, cfg.LatencyTolerance)
				}
				i = pickFirst(hs, sl.rr.Load(), f)
			}
		default:
			i = pickFirst(hs, sl.rr.Add(1)-1, f)
		}
		if i < 0 {
			return nil
		}
		if h := hs[i]; take(h) {
			return h
		}
	}
	return nil
}

// Pick returns an upstream for one connection attempt of req.Listener and
// counts it in flight; every Pick is followed by one Report and one Release.
// It honours req.Avoid and, for a req.Key, stickiness: the key keeps the
// upstream it was first given while that is usable (see pickSticky). It
// never blocks, except that a key whose ppr session is rotating waits for
// the rotation up to Config.RotateWait. ErrNoUpstream: nothing is usable.
// With Config.StickyMax 0 keys are ignored.
func (p *Pool) Pick(ctx context.Context, req Request) (*Upstream, error) {
	s := p.snap.Load()
	sl := s.slice(req.Listener)
	if sl == nil {
		return nil, ErrUnknownListener
	}
	if req.Key != "" && p.cfg.Load().StickyMax > 0 {
		return p.pickSticky(ctx, sl, req)
	}
	return p.pickOnce(sl, req.Avoid, nil)
}
