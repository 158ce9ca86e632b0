package pool

import (
	"context"
	"hash/maphash"
	"sync"
	"sync/atomic"
	"time"
)

// stickyKey scopes a key by listener: the same key on two listeners with
// different slices is two assignments.
type stickyKey struct {
	listener, key string
}

type stickyEntry struct {
	k          stickyKey
	hash       uint64
	h          *host
	used       int64        // pool clock of the last pick, or of the last release that left it unused
	open       int          // picks of the key not yet released; while > 0 the entry is off the list
	prev, next *stickyEntry // the shard's list of unused entries
	chain      *stickyEntry // the next entry with the same hash
}

// stickyShard is one lock's worth of the table. Its entries are indexed by
// the key's hash, which the shard choice computes anyway; equal hashes
// chain. The entries of keys no connection uses (open 0) are in a list from
// most (head) to least (tail) recently used, which eviction and expiry take
// from the tail; a key in use is off the list, so it neither idles out nor
// is evicted under a long connection, and n counts it. While it is in use
// its entry stays the one Release finds for its key.
type stickyShard struct {
	mu         sync.Mutex
	m          map[uint64]*stickyEntry
	n          int
	head, tail *stickyEntry
	_          [64]byte // keep shards' locks off each other's cache lines
}

// stickyTable maps keys to hosts, bounded in size and idle time. Each shard
// holds max/len(shards) keys and evicts its least recently used one; small
// tables have a single shard, so their eviction is exactly the oldest key.
// Keys in use are never evicted: a shard holds more than its share only
// while that many keys have connections open.
type stickyTable struct {
	seed     maphash.Seed
	shards   []stickyShard
	mask     uint64
	perShard atomic.Int64 // changed by resize
}

func newStickyTable(max int) *stickyTable {
	n := 1
	for n < 64 && max/(n*2) >= 1024 {
		n *= 2
	}
	t := &stickyTable{seed: maphash.MakeSeed(), shards: make([]stickyShard, n), mask: uint64(n - 1)}
	t.perShard.Store(int64((max + n - 1) / n))
	for i := range t.shards {
		t.shards[i].m = make(map[uint64]*stickyEntry)
	}
	return t
}

// resize bounds the table to max keys, evicting the least recently used
// unused ones past it (keys in use stay until released). The number of
// shards stays what the first size made it.
func (t *stickyTable) resize(max int) {
	n := len(t.shards)
	per := (max + n - 1) / n
	t.perShard.Store(int64(per))
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		s.trim(int64(per))
		s.mu.Unlock()
	}
}

// locate returns k's shard and hash.
func (t *stickyTable) locate(k stickyKey) (*stickyShard, uint64) {
	h := maphash.String(t.seed, k.key)
	return &t.shards[h>>32&t.mask], h
}

func (s *stickyShard) find(k stickyKey, hash uint64) *stickyEntry {
	for e := s.m[hash]; e != nil; e = e.chain {
		if e.k == k {
			return e
		}
	}
	return nil
}

func (s *stickyShard) unlink(e *stickyEntry) {
	if e.prev != nil {
		e.prev.next = e.next
	} else {
		s.head = e.next
	}
	if e.next != nil {
		e.next.prev = e.prev
	} else {
		s.tail = e.prev
	}
	e.prev, e.next = nil, nil
}

func (s *stickyShard) pushFront(e *stickyEntry) {
	e.next = s.head
	if s.head != nil {
		s.head.prev = e
	}
	s.head = e
	if s.tail == nil {
		s.tail = e
	}
}

// get returns k's live entry, marked used at now; an idle one is dropped.
func (s *stickyShard) get(k stickyKey, hash uint64, now, idle int64) *stickyEntry {
	e := s.find(k, hash)
	if e == nil {
		return nil
	}
	if e.open == 0 {
		if now-e.used >= idle {
			s.remove(e)
			return nil
		}
		if e.used != now && s.head != e { // the hot path's clock ticks: at most one move per tick
			s.unlink(e)
			s.pushFront(e)
		}
	}
	e.used = now
	return e
}

// hold counts one more pick of e's key in use, taking e off the list.
func (s *stickyShard) hold(e *stickyEntry) {
	if e.open == 0 {
		s.unlink(e)
	}
	e.open++
}

// release counts one pick of k's key over; the last one puts its entry back
// on the list as used at now, and trims the shard to max.
func (s *stickyShard) release(k stickyKey, hash uint64, now, max int64) {
	e := s.find(k, hash)
	if e == nil || e.open == 0 {
		return // a Release without its Pick: nothing to count
	}
	e.open--
	if e.open == 0 {
		e.used = now
		s.pushFront(e)
		s.trim(max)
	}
}

// trim evicts the least recently used unused keys while the shard holds
// more than max; keys in use stay.
func (s *stickyShard) trim(max int64) {
	for int64(s.n) > max && s.tail != nil {
		s.remove(s.tail)
	}
}

func (s *stickyShard) remove(e *stickyEntry) {
	s.unlink(e)
	s.n--
	first := s.m[e.hash]
	switch {
	case first == e && e.chain == nil:
		delete(s.m, e.hash)
	case first == e:
		s.m[e.hash] = e.chain
	default:
		for first.chain != e {
			first = first.chain
		}
		first.chain = e.chain
	}
	e.chain = nil
}

// add enters k, assigned to h and held (see hold), and trims the shard to
// max.
func (s *stickyShard) add(k stickyKey, hash uint64, h *host, now int64, max int64) {
	s.m[hash] = &stickyEntry{k: k, hash: hash, h: h, used: now, open: 1, chain: s.m[hash]}
	s.n++
	s.trim(max)
}

// expire drops entries idle since before now-idle.
func (s *stickyShard) expire(now, idle int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for s.tail != nil && now-s.tail.used >= idle {
		s.remove(s.tail)
	}
}

func (t *stickyTable) len() int {
	n := 0
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		n += s.n
		s.mu.Unlock()
	}
	return n
}

// lookup returns the host k is assigned to, or nil; for tests and Explain.
func (t *stickyTable) lookup(listener, key string) *host {
	k := stickyKey{listener, key}
	s, hash := t.locate(k)
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.find(k, hash); e != nil {
		return e.h
	}
	return nil
}

// pickSticky serves a pick with a key. A known key keeps its upstream while
// that is usable; when it is not, the key is reassigned once to the
// strategy's pick. A key whose ppr session is rotating waits for the
// rotation up to RotateWait, then uses another upstream for this one
// connection. A key whose upstream this connection already tried (Avoid)
// also uses another one for this connection only. Every pick it returns
// holds the key's entry until its Release (see stickyShard).
func (p *Pool) pickSticky(ctx context.Context, sl *slice, req Request) (*Upstream, error) {
	k := stickyKey{req.Listener, req.Key}
	sh, hash := p.sticky.locate(k)
	cfg := p.cfg.Load()
	idle := int64(cfg.StickyIdle)
	rotated := false // the key's session just rotated: its new exit IP is worth trying again
	waited := false
	ends := 0 // rotations seen ending, their bit not yet cleared
	for {
		now := p.fastNow()
		f := filter{avoid: req.Avoid, clock: p.fastNow, now: now}
		sh.mu.Lock()
		e := sh.get(k, hash, now, idle)
		if e != nil && e.h.flags.Load()&fDraining == 0 && sl.matches(e.h.cur.Load()) {
			h := e.h
			fh := f
			if rotated {
				fh.avoid = nil
			}
			if fh.eligible(h) {
				if u := take(h, &fh); u != nil {
					return sh.held(e, u)
				}
			}
			if r := h.rotation(); r != nil || rotating(h) {
				sh.mu.Unlock()
				if r == nil && ends < maxRotationEnds {
					// Its rotation is ending: the bit goes under Pool.mu
					// once the rotation is gone. Past that, again.
					p.mu.Lock()
					p.mu.Unlock()
					ends++
					continue
				}
				if r != nil && !waited {
					done, err := p.waitRotation(ctx, r, cfg.RotateWait)
					if err != nil {
						return nil, err
					}
					waited = true
					if done {
						rotated = r.ok
						continue
					}
				}
				// The rotation takes too long, another began as the one
				// waited for ended, or rotations keep ending as this pick
				// looks: the key stays on h, and this connection goes
				// elsewhere.
				return p.fallback(sl, req, k, h)
			}
			if fq := (filter{avoid: fh.avoid, quota: true, clock: p.fastNow, now: now}); h.flags.Load()&fQuota != 0 && fq.eligible(h) {
				// Only its service's quota keeps h out: move only if
				// another service can serve.
				alt := filter{avoid: req.Avoid, clock: p.fastNow, now: now}
				if a := p.chooseOnce(sl, &alt); a != nil {
					e.h = a.h
					return sh.held(e, a)
				}
				if u := take(h, &fq); u != nil {
					return sh.held(e, u)
				}
			}
			if fa := (filter{quota: true, clock: p.fastNow, now: now}); fa.eligible(h) {
				// Usable, but this connection already tried it.
				u, err := p.pickOnce(sl, req.Avoid, nil, 0)
				if err == nil {
					sh.hold(e)
				}
				sh.mu.Unlock()
				return u, err
			}
			if fa := (filter{quota: true, clock: p.fastNow}); rotating(h) || fa.eligible(h) {
				// A rotation began, or one began and ended, while this
				// pick looked: the key stays; look again, to wait for it
				// or fall back.
				sh.mu.Unlock()
				if ends < maxRotationEnds {
					ends++
					continue
				}
				return p.fallback(sl, req, k, h)
			}
		}
		// A new key, or its upstream stopped being usable: (re)assign.
		u := p.choose(sl, &f)
		if u == nil {
			sh.mu.Unlock()
			return nil, ErrNoUpstream
		}
		if e != nil {
			e.h = u.h
			return sh.held(e, u)
		}
		sh.add(k, hash, u.h, now, p.sticky.perShard.Load())
		sh.mu.Unlock()
		return u, nil
	}
}

// rotating reports whether h's session rotates, or its rotating bit is
// still set (a rotation that just ended clears it under Pool.mu).
func rotating(h *host) bool { return h.rotation() != nil || h.flags.Load()&fRotating != 0 }

// maxRotationEnds bounds how often one pick waits for the end of a
// rotation to clear its session's bit before it falls back: rotations that
// keep ending (a session failing again at once) must not hold it, nor a
// bit that outlived its rotation.
const maxRotationEnds = 4

// fallback serves a connection of key k, whose session h is rotating,
// with another upstream for this connection only: another session of its
// service that is not at its quota, else another upstream of the listener
// (those at quota last). The key stays on h.
func (p *Pool) fallback(sl *slice, req Request, k stickyKey, h *host) (*Upstream, error) {
	f := filter{avoid: req.Avoid, skip: h, service: h.cur.Load().Service, clock: p.fastNow}
	u := p.chooseOnce(sl, &f)
	if u == nil {
		var err error
		if u, err = p.pickOnce(sl, req.Avoid, h, 0); err != nil {
			return nil, err
		}
	}
	p.holdKey(k, h)
	return u, nil
}

// held holds e for a pick that took u, unlocks the shard and returns the
// pick.
func (s *stickyShard) held(e *stickyEntry, u *Upstream) (*Upstream, error) {
	s.hold(e)
	s.mu.Unlock()
	return u, nil
}

// holdKey holds k's entry for a pick made with its shard unlocked,
// entering k on h if it is not there (it went meanwhile, or stickiness is
// off), so that the pick's Release finds it.
func (p *Pool) holdKey(k stickyKey, h *host) {
	sh, hash := p.sticky.locate(k)
	now := p.fastNow()
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if e := sh.get(k, hash, now, int64(p.cfg.Load().StickyIdle)); e != nil {
		sh.hold(e)
		return
	}
	sh.add(k, hash, h, now, p.sticky.perShard.Load())
}

// pickOnce picks without touching the sticky table; service, when not 0,
// keeps the pick to that service's upstreams.
func (p *Pool) pickOnce(sl *slice, avoid []string, skip *host, service int) (*Upstream, error) {
	f := filter{avoid: avoid, skip: skip, service: service, clock: p.fastNow}
	u := p.choose(sl, &f)
	if u == nil {
		return nil, ErrNoUpstream
	}
	return u, nil
}

// waitRotation waits for r up to bound; done is false when the bound passed
// first (at once when it is 0). The error is the context's.
func (p *Pool) waitRotation(ctx context.Context, r *rotation, bound time.Duration) (done bool, err error) {
	if bound <= 0 {
		return false, nil
	}
	r.waiting.Add(1)
	defer r.waiting.Add(-1)
	t := time.NewTimer(bound)
	defer t.Stop()
	select {
	case <-r.done:
		return true, nil
	case <-t.C:
		return false, nil
	case <-ctx.Done():
		return false, context.Cause(ctx)
	}
}
