package pool

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Pool is the upstream set. Pick, Report and Release are safe for concurrent
// use and lock-free except for the sticky table's sharded lock; the other
// methods are writers and serialize among themselves.
type Pool struct {
	cfg  Config
	opts Options
	log  *slog.Logger
	now  func() time.Time
	rand func() uint64
	tick atomic.Int64 // unix ns, refreshed by Run: the hot path's clock when Options.Now is nil

	snap    atomic.Pointer[snapshot]
	anyQuot atomic.Bool // some service is in quota: picks make a second pass
	sticky  *stickyTable

	mu        sync.Mutex              // writers: Update, SetListeners, SetProviderStatus, SetQuota, rotation results
	listeners []ListenerSlice         // as last set
	errored   map[int]map[string]bool // per service: errored IPs
	inactive  map[int]map[string]bool // per service: inactive IPs
	quota     map[int]bool            // per service: usage limit reached
	draining  map[string]*host        // removed upstreams with connections in flight
	gen       uint64                  // the last Update, for host.mark

	ejectMu sync.Mutex // ejection and re-admission against the per-slice counters

	changed chan struct{} // coalesced Changed notifications for Run

	rotMu     sync.Mutex
	rotClosed bool
	rotWG     sync.WaitGroup
	ctx       context.Context // cancels rotations when Run ends
	cancel    context.CancelFunc

	probeCursor int
	probeWindow time.Time
	probeUsed   int
}

// snapshot is one immutable view of the set; Pick reads it without locks.
type snapshot struct {
	hosts   []*host // current upstreams, in Update order
	byID    map[string]*host
	slices  []*slice
	all     *slice // the slice used when no listeners are set
	updated time.Time
}

// slice is one listener's part of a snapshot.
type slice struct {
	ListenerSlice
	members  []*host
	bands    [2]atomic.Pointer[band] // latency strategy: without, with quota upstreams
	eligible atomic.Int64            // members the provider does not exclude: the base of the ejection cap
	ejected  atomic.Int64            // members out of rotation by ejection
	_        [64]byte                // every pick writes rr: keep it off the lines every pick reads
	rr       atomic.Uint64           // round-robin position, also the start of scans
	_        [56]byte
}

func (sl *slice) matches(u *Upstream) bool { return sl.Covers(u.Service, u.Kind, u.Protocol) }

// New returns an empty pool; feed it with SetListeners and Update.
func New(cfg Config, opts Options) (*Pool, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("validating pool config: %w", err)
	}
	if cfg.ProbeInterval > 0 && opts.Prober == nil {
		return nil, fmt.Errorf("validating pool config: probe_interval is set but no prober was given")
	}
	p := &Pool{
		cfg:      cfg,
		opts:     opts,
		log:      opts.Logger,
		now:      opts.Now,
		rand:     opts.Rand,
		sticky:   newStickyTable(cfg.StickyMax),
		errored:  map[int]map[string]bool{},
		inactive: map[int]map[string]bool{},
		quota:    map[int]bool{},
		draining: map[string]*host{},
		changed:  make(chan struct{}, 1),
	}
	if p.log == nil {
		p.log = slog.New(slog.DiscardHandler)
	}
	if p.now == nil {
		p.now = time.Now
	}
	if p.rand == nil {
		p.rand = rand.Uint64
	}
	p.tick.Store(p.now().UnixNano())
	p.ctx, p.cancel = context.WithCancel(context.Background())
	p.snap.Store(p.build(nil, map[string]*host{}, time.Time{}))
	return p, nil
}

// tickEvery is how often Run refreshes the hot path's clock.
const tickEvery = 100 * time.Millisecond

// fastNow is the clock of the hot path (ejection ends, sticky idle times):
// Options.Now when given, else a time Run refreshes every tickEvery, since
// reading the system clock costs hundreds of nanoseconds on some virtual
// machines.
func (p *Pool) fastNow() int64 {
	if p.opts.Now != nil {
		return p.opts.Now().UnixNano()
	}
	return p.tick.Load()
}

func (p *Pool) notifyChanged() {
	select {
	case p.changed <- struct{}{}:
	default:
	}
}

// SetListeners sets the listener slices that Request.Listener names. Until
// it is called, or after it is called with none, every pick draws from the
// whole set whatever its listener. Names should be unique; the first wins.
func (p *Pool) SetListeners(ls []ListenerSlice) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.listeners = nil
	if len(ls) > 0 {
		p.listeners = slices.Clone(ls)
	}
	old := p.snap.Load()
	p.publish(p.build(old.hosts, old.byID, old.updated))
}

// build makes a snapshot of hosts with the current listener slices; the
// caller holds p.mu.
func (p *Pool) build(hosts []*host, byID map[string]*host, updated time.Time) *snapshot {
	s := &snapshot{hosts: hosts, byID: byID, updated: updated}
	if p.listeners == nil {
		s.all = &slice{members: hosts}
		s.slices = []*slice{s.all}
		return s
	}
	for _, l := range p.listeners {
		sl := &slice{ListenerSlice: l}
		sl.Services = slices.Clone(l.Services)
		for _, h := range hosts {
			if sl.matches(h.cur.Load()) {
				sl.members = append(sl.members, h)
			}
		}
		s.slices = append(s.slices, sl)
	}
	return s
}

// publish counts the per-slice figures of s from its hosts' state and makes
// it current; the caller holds p.mu.
func (p *Pool) publish(s *snapshot) {
	p.ejectMu.Lock()
	defer p.ejectMu.Unlock()
	for _, sl := range s.slices {
		sl.count()
	}
	p.snap.Store(s)
}

func (sl *slice) count() {
	var eligible, ejected int64
	for _, h := range sl.members {
		if h.flags.Load()&(fProviderError|fProviderInactive) == 0 {
			eligible++
		}
		if h.ejectedUntil.Load() != 0 {
			ejected++
		}
	}
	sl.eligible.Store(eligible)
	sl.ejected.Store(ejected)
}

func (s *snapshot) slice(name string) *slice {
	if s.all != nil {
		return s.all
	}
	for _, sl := range s.slices {
		if sl.Name == name {
			return sl
		}
	}
	return nil
}

func sameUpstream(a, b *Upstream) bool {
	return a.Service == b.Service && a.Kind == b.Kind && a.Protocol == b.Protocol &&
		a.Address == b.Address && a.Username == b.Username && a.Password == b.Password &&
		a.Server == b.Server && a.Session == b.Session && a.ExitIP == b.ExitIP
}

// Update swaps in a new upstream set. Upstreams whose ID stays keep their
// health, counters and sticky keys; new ones start healthy; removed ones
// drain: no new connections, and they leave once none is in flight.
// Duplicate IDs keep the first.
func (p *Pool) Update(ups []Upstream) {
	p.mu.Lock()
	old := p.snap.Load()
	p.gen++
	gen := p.gen
	hosts := make([]*host, 0, len(ups))
	var fresh map[string]*host // new or revived from draining
	var buf []byte
	var st serviceStatus
	var rotate []*host
	for i := range ups {
		u := &ups[i]
		buf = appendID(buf[:0], u)
		var h *host
		if i < len(old.hosts) && old.hosts[i].id == string(buf) {
			h = old.hosts[i] // a refresh in the same order needs no index lookup
		} else {
			h = old.byID[string(buf)]
		}
		switch {
		case h != nil && h.mark == gen:
			continue // a duplicate
		case h != nil:
			if !sameUpstream(h.cur.Load(), u) {
				h.setCur(u)
			}
		case fresh[string(buf)] != nil:
			continue
		default:
			if h = p.draining[string(buf)]; h != nil {
				delete(p.draining, h.id)
				h.setFlags(fDraining, 0)
				if !sameUpstream(h.cur.Load(), u) {
					h.setCur(u)
				}
			} else {
				h = newHost(string(buf), u)
			}
			if fresh == nil {
				fresh = make(map[string]*host)
			}
			fresh[h.id] = h
		}
		h.mark = gen
		hosts = append(hosts, h)
		if st.service != u.Service || !st.valid {
			st = p.statusOf(u.Service)
		}
		if st.apply(h) {
			rotate = append(rotate, h)
		}
	}
	var removed []*host
	for _, h := range old.hosts {
		if h.mark != gen {
			h.setFlags(fDraining, fDraining)
			p.draining[h.id] = h
			removed = append(removed, h)
		}
	}
	byID := old.byID // the common refresh changes nothing: share the index
	if len(fresh) > 0 || len(removed) > 0 {
		byID = maps.Clone(old.byID)
		for _, h := range removed {
			delete(byID, h.id)
		}
		for id, h := range fresh {
			byID[id] = h
		}
	}
	p.publish(p.build(hosts, byID, p.now()))
	p.pruneDraining()
	p.mu.Unlock()
	for _, h := range rotate {
		p.requestRotate(h)
	}
	p.notifyChanged()
}

// pruneDraining forgets removed upstreams with nothing in flight; the caller
// holds p.mu.
func (p *Pool) pruneDraining() {
	for id, h := range p.draining {
		if h.inFlight.Load() <= 0 {
			delete(p.draining, id)
		}
	}
}

// serviceStatus is the provider's last word on one service.
type serviceStatus struct {
	service           int
	valid             bool
	errored, inactive map[string]bool
	quota             bool
}

// statusOf returns service's status; the caller holds p.mu.
func (p *Pool) statusOf(service int) serviceStatus {
	return serviceStatus{service: service, valid: true,
		errored: p.errored[service], inactive: p.inactive[service], quota: p.quota[service]}
}

// apply sets h's provider and quota bits from st; it reports whether h is a
// ppr session whose exit IP is errored, to be rotated.
func (st *serviceStatus) apply(h *host) (rotate bool) {
	u := h.cur.Load()
	var f uint32
	if st.errored[h.addrHost] {
		f |= fProviderError
	}
	if st.inactive[h.addrHost] {
		f |= fProviderInactive
	}
	if u.Kind == PPR && u.Session != "" && u.ExitIP != "" && st.errored[u.ExitIP] {
		f |= fExitErrored
	}
	if st.quota {
		f |= fQuota
	}
	h.setFlags(providerBits, f)
	return f&fExitErrored != 0
}

// applyStatus is apply with h's service's status; the caller holds p.mu.
func (p *Pool) applyStatus(h *host) (rotate bool) {
	st := p.statusOf(h.cur.Load().Service)
	return st.apply(h)
}

// SetProviderStatus sets the provider's errored and inactive IPs of a
// service; it takes effect at once. An upstream whose host (for a ppr
// sticky session: its gateway) is listed takes no new connections. A ppr
// sticky session whose exit IP is errored is rotated instead (at most once
// per RotateInterval); it is not excluded for that.
func (p *Pool) SetProviderStatus(service int, errored, inactive []string) {
	p.mu.Lock()
	p.errored[service] = toSet(errored)
	p.inactive[service] = toSet(inactive)
	s := p.snap.Load()
	var rotate []*host
	changed := false
	for _, h := range s.hosts {
		if h.cur.Load().Service != service {
			continue
		}
		before := h.flags.Load() & providerBits
		if p.applyStatus(h) {
			rotate = append(rotate, h)
		}
		changed = changed || h.flags.Load()&providerBits != before
	}
	if changed {
		p.publish(s) // recount the ejection cap's base
	}
	p.mu.Unlock()
	for _, h := range rotate {
		p.requestRotate(h)
	}
	if changed {
		p.notifyChanged()
	}
}

func toSet(ips []string) map[string]bool {
	if len(ips) == 0 {
		return nil
	}
	m := make(map[string]bool, len(ips))
	for _, ip := range ips {
		m[ip] = true
	}
	return m
}

// SetQuota records whether a ppr service reached its usage limit. Its
// upstreams then take new connections only where no other service's
// upstream of the same listener slice is usable.
func (p *Pool) SetQuota(service int, reached bool) {
	p.mu.Lock()
	if p.quota[service] == reached {
		p.mu.Unlock()
		return
	}
	if reached {
		p.quota[service] = true
	} else {
		delete(p.quota, service)
	}
	p.anyQuot.Store(len(p.quota) > 0)
	for _, h := range p.snap.Load().hosts {
		if h.cur.Load().Service == service {
			p.applyStatus(h)
		}
	}
	p.mu.Unlock()
	p.notifyChanged()
}

// Upstreams returns the current set with credentials, for the state file.
func (p *Pool) Upstreams() []Upstream {
	s := p.snap.Load()
	out := make([]Upstream, len(s.hosts))
	for i, h := range s.hosts {
		out[i] = *h.cur.Load()
		out[i].h = nil
	}
	return out
}
