package pool

import (
	"context"
	"math/bits"
	"sync/atomic"
	"time"
)

// filter decides which members of a slice may take a new connection.
type filter struct {
	avoid   []string // IDs already tried by this connection
	skip    *host    // one more host to leave out
	service int      // when not 0, only this service's upstreams
	quota   bool     // whether upstreams of a service in quota may serve
	now     int64    // pool clock (Pool.nanos), read only when needed
	clock   func() int64
}

// eligible reports whether h may take a new connection, without claiming it.
func (f *filter) eligible(h *host) bool {
	fl := h.flags.Load()
	if fl&excluded != 0 || (fl&fQuota != 0 && !f.quota) || h == f.skip {
		return false
	}
	if f.service != 0 && h.cur.Load().Service != f.service {
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

// take claims h for one connection, found eligible by f, and returns the
// upstream to hand out: h's, counted in flight, or past an ejection, as its
// one trial, a copy that says so (Upstream.trial). It returns nil when h
// was ejected since f found it eligible (its trial comes only once that
// ejection is over), or another connection won its trial first.
func take(h *host, f *filter) *Upstream {
	u := h.cur.Load()
	if until := h.ejectedUntil.Load(); until != 0 {
		if f.now == 0 {
			f.now = f.clock()
		}
		if f.now < until || !h.trial.CompareAndSwap(false, true) {
			return nil
		}
		if f.now < h.ejectedUntil.Load() {
			// Ejected again between the look and the claim (its trial
			// failed): this claim is not that ejection's trial.
			h.trial.Store(false)
			return nil
		}
		c := *u
		c.trial, c.trialOf = true, h.ejections.Load()
		u = &c
	}
	h.inFlight.Add(1)
	return u
}

// The strategies are pure functions over a slice's members: they return the
// index of the chosen eligible member or -1 (latencyBand: the members to
// choose among), and claim nothing. start spreads ties and scans. Only
// takeTurn, which runs the scans of round robin and least-conn from the
// cursor's turn, also moves the slice's cursor.

// pickFirst scans from start and returns the first eligible member, and how
// many members it passed over before it.
func pickFirst(hs []*host, start uint64, f *filter) (i int, passed uint64) {
	n := uint64(len(hs))
	if n == 0 {
		return -1, 0
	}
	j := start % n
	for k := range n {
		if f.eligible(hs[j]) {
			return int(j), k
		}
		if j++; j == n {
			j = 0
		}
	}
	return -1, n
}

// pickTurn is round robin over the eligible members of hs: the member whose
// turn the cursor rr gives, or else the first eligible one after it.
func pickTurn(hs []*host, rr *atomic.Uint64, f *filter) int {
	return takeTurn(hs, rr, f, false)
}

// takeTurn runs a scan, pickFirst or (leastConn) pickLeastConn, from the
// turn the cursor rr gives, and then moves the cursor past the chosen
// member, so that the members it passed over used up their turns: after a
// run of ineligible members the next eligible one gets its own turn, not
// the whole run's (a member after k ejected ones would take k+1 turns a
// round), and every eligible member gets one turn a round. Picks at the
// same instant that start in the same run may still meet on one member.
// One atomic add when the turn's member is chosen, a load and a
// compare-and-swap or a few more when it is not. A flag says which scan,
// not a func value: escape analysis cannot see through the call of a func
// value, and every pick's filter would move to the heap.
func takeTurn(hs []*host, rr *atomic.Uint64, f *filter, leastConn bool) int {
	start := rr.Add(1) - 1
	var i int
	var passed uint64
	if leastConn {
		i, passed = pickLeastConn(hs, start, f)
	} else {
		i, passed = pickFirst(hs, start, f)
	}
	if i >= 0 && passed > 0 {
		passTurns(rr, start, passed)
	}
	return i
}

// passTurns moves the cursor rr past the member chosen by the pick that had
// turn start and passed over passed members before it: to start+passed+1
// at least, so that the turns of the run it passed are used up whatever
// other picks did with the cursor meanwhile (those that started in the
// same run chose the same member, and the later ones moved it further
// already). It only raises the cursor, with a compare-and-swap that other
// picks moving it make fail; after passTries failures it gives up, which
// costs evenness only, never correctness. No lock: the cursor is the one
// line every pick writes. Its values only grow (2^64 picks are centuries).
func passTurns(rr *atomic.Uint64, start, passed uint64) {
	past := start + passed + 1
	for range passTries {
		cur := rr.Load()
		if cur >= past || rr.CompareAndSwap(cur, past) {
			return
		}
	}
}

// passTries bounds passTurns' compare-and-swap loop: each failure means
// another pick moved the cursor, so under heavy contention a few suffice
// for it to pass the run.
const passTries = 8

// randomDraws is how many members pickRandom draws before it gives up.
const randomDraws = 4

// pickRandom draws members at random until one is eligible, so that every
// eligible member is as likely; -1 after randomDraws misses (most members
// are out), and the caller takes turns (pickTurn) instead, which spreads
// as evenly. A scan from a random start would give the member after a run
// of ineligible ones the whole run's chances.
func pickRandom(hs []*host, rand func() uint64, f *filter) int {
	n := uint64(len(hs))
	if n == 0 {
		return -1
	}
	for range randomDraws {
		// rand × n / 2^64: uniform in [0, n) without a division.
		if i, _ := bits.Mul64(rand(), n); f.eligible(hs[i]) {
			return int(i)
		}
	}
	return -1
}

// pickLeastConn returns an eligible member with the fewest connections in
// flight; among equals the first from start. An idle member ends the scan.
// passed is how far from start the chosen member is: takeTurn moves the
// cursor on past it, or the idle member after a run of ineligible ones
// would take the run's ties too.
func pickLeastConn(hs []*host, start uint64, f *filter) (i int, passed uint64) {
	n := uint64(len(hs))
	best, bestN := -1, int64(0)
	if n == 0 {
		return -1, 0
	}
	j := start % n
	for k := range n {
		h := hs[j]
		if c := h.inFlight.Load(); (best < 0 || c < bestN) && f.eligible(h) {
			best, bestN, passed = int(j), c, k
			if c <= 0 {
				break
			}
		}
		if j++; j == n {
			j = 0
		}
	}
	return best, passed
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
	until      int64        // pool clock after which it is refreshed
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

// choose runs the strategy over sl, claims the chosen host and returns
// what take handed out. Upstreams of services in quota serve only when
// nothing else can.
func (p *Pool) choose(sl *slice, f *filter) *Upstream {
	f.quota = false
	if u := p.chooseOnce(sl, f); u != nil || !p.anyQuot.Load() {
		return u
	}
	f.quota = true
	return p.chooseOnce(sl, f)
}

func (p *Pool) chooseOnce(sl *slice, f *filter) *Upstream {
	cfg := p.cfg.Load()
	for range 4 { // take fails only when another connection won a trial
		hs := sl.members
		var i int
		switch cfg.Strategy {
		case Random:
			if i = pickRandom(hs, p.rand, f); i < 0 {
				i = pickTurn(hs, &sl.rr, f)
			}
		case LeastConn:
			i = takeTurn(hs, &sl.rr, f, true)
		case Latency:
			hs = p.band(sl, f.quota, false).hosts
			if i = pickTurn(hs, &sl.rr, f); i < 0 {
				// Nothing of the band can serve this pick: its members
				// went out since it was made, or this connection tried
				// them already; then the best of the rest for it alone.
				if len(f.avoid) == 0 && f.skip == nil {
					hs = p.band(sl, f.quota, true).hosts
				} else {
					hs = latencyBand(sl.members, f, cfg.LatencyTolerance)
				}
				i = pickTurn(hs, &sl.rr, f)
			}
		default:
			i = pickTurn(hs, &sl.rr, f)
		}
		if i < 0 {
			return nil
		}
		if u := take(hs[i], f); u != nil {
			return u
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
// With Config.StickyMax 0 keys take no part in the choice; a key's pick
// is still counted in use until its Release (a shard lock and a table
// entry for the while), so that the count holds across a reload that
// turns stickiness on.
func (p *Pool) Pick(ctx context.Context, req Request) (*Upstream, error) {
	s := p.snap.Load()
	sl := s.slice(req.Listener)
	if sl == nil {
		return nil, ErrUnknownListener
	}
	if req.Key == "" {
		return p.pickOnce(sl, req.Avoid, nil, 0)
	}
	if p.cfg.Load().StickyMax > 0 {
		return p.pickSticky(ctx, sl, req)
	}
	u, err := p.pickOnce(sl, req.Avoid, nil, 0)
	if err == nil {
		p.holdKey(stickyKey{req.Listener, req.Key}, u.h)
	}
	return u, err
}
