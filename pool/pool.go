package pool

import (
	"context"
	"errors"
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
	cfg    atomic.Pointer[Config] // replaced whole by SetConfig; read once per operation
	opts   Options
	log    *slog.Logger
	events *EventLog
	now    func() time.Time
	epoch  time.Time // the origin of nanos, taken from now at New
	rand   func() uint64
	tick   atomic.Int64 // nanos, refreshed by Run: the hot path's clock when Options.Now is nil

	snap    atomic.Pointer[snapshot]
	anyQuot atomic.Bool // some service is in quota: picks make a second pass
	sticky  *stickyTable

	mu        sync.Mutex              // writers: Update, SetListeners, SetProviderStatus, SetUsage, SetConfig, rotations
	listeners []ListenerSlice         // as last set
	errored   map[int]map[string]bool // per service: errored IPs
	inactive  map[int]map[string]bool // per service: inactive IPs
	usage     map[int]ServiceUsage    // per ppr service with a limit: the provider's last figures
	quota     map[int]bool            // per service: over quota_headroom × its limit
	draining  map[string]*host        // removed upstreams with connections in flight
	gen       uint64                  // the last Update, for host.mark
	sessions  map[sessionKey]*session // ppr sticky sessions of the current set, each shared by its upstreams
	resting   map[sessionKey]*session // sessions out of the set whose rotation limit still runs (see dropSessions)
	unserved  []*session              // sessions of the set that no upstream stands for (UnservedSession)
	linked    int                     // sessions the Update under way linked so far

	ejectMu sync.Mutex // ejection and re-admission against the per-slice counters

	changed  chan struct{} // coalesced Changed notifications for Run
	reconfig chan struct{} // SetConfig tells Run to reset its tickers

	rotMu     sync.Mutex
	rotClosed bool
	rotWG     sync.WaitGroup
	ctx       context.Context // cancels rotations when Run ends
	cancel    context.CancelFunc

	// The active probe's position and budget, used by one probe round at
	// a time (Run starts the next only after the last one ended).
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
	ejected  atomic.Int64            // eligible members out of rotation by ejection
	held     atomic.Int64            // eligible failing members kept in by the ejection cap
	panic    atomic.Bool             // held > 0 and the cap is reached; changes under Pool.ejectMu
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
	if err := needProber(cfg, opts); err != nil {
		return nil, err
	}
	p := &Pool{
		opts:     opts,
		log:      opts.Logger,
		events:   opts.Events,
		now:      opts.Now,
		rand:     opts.Rand,
		sticky:   newStickyTable(cfg.StickyMax),
		errored:  map[int]map[string]bool{},
		inactive: map[int]map[string]bool{},
		usage:    map[int]ServiceUsage{},
		quota:    map[int]bool{},
		draining: map[string]*host{},
		sessions: map[sessionKey]*session{},
		resting:  map[sessionKey]*session{},
		changed:  make(chan struct{}, 1),
		reconfig: make(chan struct{}, 1),
	}
	p.cfg.Store(&cfg)
	if p.log == nil {
		p.log = slog.New(slog.DiscardHandler)
	}
	if p.events == nil {
		p.events = NewEventLog(DefaultEventLogSize, p.log, opts.Now)
	}
	if p.now == nil {
		p.now = time.Now
	}
	if p.rand == nil {
		p.rand = rand.Uint64
	}
	// A second before now, so that no reading of the pool's clock is 0,
	// which its fields use for "never".
	p.epoch = p.now().Add(-time.Second)
	p.tick.Store(p.nanos(p.now()))
	p.ctx, p.cancel = context.WithCancel(context.Background())
	p.snap.Store(p.build(nil, map[string]*host{}, time.Time{}))
	return p, nil
}

func needProber(cfg Config, opts Options) error {
	if cfg.ProbeInterval > 0 && opts.Prober == nil {
		return errors.New("validating pool config: probe_interval is set but no prober was given")
	}
	return nil
}

// record adds an event to the log, stamped with the pool's clock.
func (p *Pool) record(kind EventKind, upstream string, service int, reason string) {
	p.events.Record(Event{Time: p.now(), Kind: kind, Upstream: upstream, Service: service, Reason: reason})
}

// tickEvery is how often Run refreshes the hot path's clock.
const tickEvery = 100 * time.Millisecond

// fastNow is the clock of the hot path (ejection ends, sticky idle times):
// Options.Now when given, else a time Run refreshes every tickEvery, since
// reading the system clock costs hundreds of nanoseconds on some virtual
// machines.
func (p *Pool) fastNow() int64 {
	if p.opts.Now != nil {
		return p.nanos(p.opts.Now())
	}
	return p.tick.Load()
}

// nanos is t on the pool's clock, the one of every time it keeps in its
// fields (ejection ends, sticky idle times, rotation times): nanoseconds
// since its epoch, measured on the monotonic clock when t carries its
// reading (time.Now's do), so that a step of the wall clock (NTP, a
// virtual machine resumed) neither stretches nor cuts those times.
func (p *Pool) nanos(t time.Time) int64 { return int64(t.Sub(p.epoch)) }

// mono is now on the pool's clock.
func (p *Pool) mono() int64 { return p.nanos(p.now()) }

func (p *Pool) notifyChanged() {
	select {
	case p.changed <- struct{}{}:
	default:
	}
}

// SetConfig swaps in a new configuration, for a reload: it validates cfg
// and, if it is good, applies it to the next pick. The strategy, the health
// options (failure_threshold, the ejection times and cap, the latency band),
// the quota headroom (every service's quota state is evaluated again), the
// sticky limits (a smaller sticky_max evicts the least recently used keys
// with no connection open; 0 drops them all, those in use as their
// connections end) and the rotation and probe options all take effect;
// upstreams keep their health state, ejections and sticky assignments. An
// ejection under way keeps the end it was given, unless a lower
// max_ejected_percent leaves no room for it: then it ends at once and its
// upstream stays in, failing (see MaxEjectedPercent). A bad cfg changes
// nothing.
// Safe to call while picks, reports and releases run.
func (p *Pool) SetConfig(cfg Config) error {
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("validating pool config: %w", err)
	}
	if err := needProber(cfg, p.opts); err != nil {
		return err
	}
	p.mu.Lock()
	p.cfg.Store(&cfg)
	p.sticky.resize(cfg.StickyMax)
	var events []Event
	for _, service := range slices.Sorted(maps.Keys(p.usage)) {
		if ev := p.evalQuota(service, cfg.QuotaHeadroom); ev.Kind != "" {
			events = append(events, ev)
		}
	}
	// Fresh listener slices: latency bands of the new tolerance and panic
	// modes under the new cap.
	s := p.snap.Load()
	p.publish(p.build(s.hosts, s.byID, s.updated))
	p.mu.Unlock()
	for _, ev := range events {
		p.events.Record(ev)
	}
	select {
	case p.reconfig <- struct{}{}:
	default:
	}
	p.notifyChanged()
	return nil
}

// Config returns the configuration in force.
func (p *Pool) Config() Config { return *p.cfg.Load() }

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
// it current; ejections that no longer fit under a cap end (see fitCaps),
// and a listener whose panic mode starts or ends with it (its members, or
// the ejection cap, changed) gets an event. The caller holds p.mu.
func (p *Pool) publish(s *snapshot) {
	p.ejectMu.Lock()
	defer p.ejectMu.Unlock()
	old := p.snap.Load()
	cfg := p.cfg.Load()
	for _, sl := range s.slices {
		sl.count()
		if o := old.slice(sl.Name); o != nil && o != old.all {
			sl.panic.Store(o.panic.Load()) // the listener's mode so far
		}
	}
	ended := p.fitCaps(cfg, s)
	p.snap.Store(s)
	for _, h := range ended {
		p.record(EventReadmitted, h.id, h.cur.Load().Service, "ejection ended early: past max_ejected_percent, kept in")
	}
	if len(ended) > 0 {
		p.notifyChanged()
	}
	for _, sl := range s.slices {
		p.checkPanic(cfg, s, sl)
	}
	for _, o := range old.slices {
		if o != old.all && o.panic.Load() {
			if n := s.slice(o.Name); n == nil || n == s.all {
				p.record(EventPanicOver, "", 0, o.Name) // the listener is gone
			}
		}
	}
}

// count counts sl's figures from its members' state; ejected and held
// members count only when eligible, like the base of the cap (see capped).
func (sl *slice) count() {
	var eligible, ejected, held int64
	for _, h := range sl.members {
		if !capped(h.flags.Load()) {
			continue
		}
		eligible++
		if h.ejectedUntil.Load() != 0 {
			ejected++
		}
		if h.held.Load() {
			held++
		}
	}
	sl.eligible.Store(eligible)
	sl.ejected.Store(ejected)
	sl.held.Store(held)
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
		a.Server == b.Server && a.Session == b.Session && a.ExitIP == b.ExitIP && a.Match == b.Match &&
		a.StatusIP == b.StatusIP
}

// Update swaps in a new upstream set. Upstreams whose ID stays keep their
// health, counters and sticky keys; new ones start healthy; removed ones
// drain: no new connections, and they leave once none is in flight.
// Duplicate IDs keep the first. Each upstream that joins or leaves gets an
// event (added, removed), and one that joins on a provider's list gets that
// list's event too, as does one that stays and moves on or off a list
// (the address the lists name it by changed). The unserved sessions replace those of the last Update:
// they serve no connection, and are rotated when their exit IP is errored.
func (p *Pool) Update(ups []Upstream, unserved ...UnservedSession) {
	p.mu.Lock()
	old := p.snap.Load()
	p.gen++
	gen := p.gen
	p.linked = 0
	hosts := make([]*host, 0, len(ups))
	var fresh map[string]*host // new or revived from draining
	var buf []byte
	var st serviceStatus
	var rotate []*host
	var moved []providerChange
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
		p.linkSession(h, gen)
		if st.service != u.Service || !st.valid {
			st = p.statusOf(u.Service)
		}
		before := h.flags.Load()
		if st.apply(h) {
			rotate = append(rotate, h)
		}
		if after := h.flags.Load(); fresh[h.id] != h && providerState(before) != providerState(after) {
			// Kept, and now named otherwise by the status lists (its
			// StatusIP moved): its provider state changed here.
			moved = append(moved, providerChange{h, before, after})
		}
	}
	p.unserved = p.unserved[:0]
	var idle []*session // unserved, to be rotated
	for _, us := range unserved {
		if s := p.linkUnserved(us, gen); s != nil {
			if st.service != us.Service || !st.valid {
				st = p.statusOf(us.Service)
			}
			if st.exitErrored(s.exitIP) {
				idle = append(idle, s)
			}
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
	p.dropSessions(gen)
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
	if len(fresh) > 0 {
		for _, h := range hosts {
			if fresh[h.id] == h {
				u := h.cur.Load()
				p.record(EventAdded, h.id, u.Service, "")
				p.recordProvider(h, 0, h.flags.Load())
			}
		}
	}
	for _, c := range moved {
		p.recordProvider(c.h, c.before, c.after) // as of the change, not of a later one
	}
	for _, h := range removed {
		p.record(EventRemoved, h.id, h.cur.Load().Service, "")
	}
	p.requestRotations(rotate, idle)
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
	named := h.addrHost
	if u.StatusIP != "" {
		named = u.StatusIP
	}
	var f uint32
	if st.errored[named] {
		f |= fProviderError
	}
	if st.inactive[named] {
		f |= fProviderInactive
	}
	if u.Kind == PPR && u.Session != "" && st.exitErrored(u.ExitIP) {
		f |= fExitErrored
	}
	if st.quota {
		f |= fQuota
	}
	h.setFlags(providerBits, f)
	return f&fExitErrored != 0
}

// exitErrored reports whether a ppr session's exit IP is on the errored
// list: a session to rotate.
func (st *serviceStatus) exitErrored(exitIP string) bool {
	return exitIP != "" && st.errored[exitIP]
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
// per RotateInterval), with upstreams or unserved; it is not excluded for
// that. Each upstream whose
// provider state changes gets an event (provider_error, provider_inactive,
// provider_ok); one whose state stays gets none, however often it is set.
func (p *Pool) SetProviderStatus(service int, errored, inactive []string) {
	type change struct {
		h           *host
		before, now uint32
	}
	p.mu.Lock()
	p.errored[service] = toSet(errored)
	p.inactive[service] = toSet(inactive)
	s := p.snap.Load()
	var rotate []*host
	var changes []change
	changed := false
	for _, h := range s.hosts {
		if h.cur.Load().Service != service {
			continue
		}
		before := h.flags.Load() & providerBits
		if p.applyStatus(h) {
			rotate = append(rotate, h)
		}
		now := h.flags.Load() & providerBits
		changed = changed || now != before
		if providerState(before) != providerState(now) {
			changes = append(changes, change{h, before, now})
		}
	}
	var idle []*session
	st := p.statusOf(service)
	for _, s := range p.unserved {
		if s.key.service == service && st.exitErrored(s.exitIP) {
			idle = append(idle, s)
		}
	}
	if changed {
		p.publish(s) // recount the ejection cap's base
	}
	p.mu.Unlock()
	for _, c := range changes {
		p.recordProvider(c.h, c.before, c.now)
	}
	p.requestRotations(rotate, idle)
	if changed {
		p.notifyChanged()
	}
}

// providerState is the event kind of the provider bits f ("" when the
// provider excludes nothing); inactive wins, as in /pool.
func providerState(f uint32) EventKind {
	switch {
	case f&fProviderInactive != 0:
		return EventProviderInactive
	case f&fProviderError != 0:
		return EventProviderError
	}
	return ""
}

// providerChange is a host's flags before and after a change.
type providerChange struct {
	h             *host
	before, after uint32
}

// recordProvider records h's provider event for a change of its flags from
// before to now, if the change is one.
func (p *Pool) recordProvider(h *host, before, now uint32) {
	b, n := providerState(before), providerState(now)
	if b == n {
		return
	}
	kind, reason := n, ""
	switch n {
	case EventProviderInactive:
		reason = "on the provider's inactive list"
	case EventProviderError:
		reason = "on the provider's errored list"
	default:
		kind, reason = EventProviderOK, "off the provider's errored and inactive lists"
	}
	p.record(kind, h.id, h.cur.Load().Service, reason)
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

// ServiceUsage is a ppr service's usage as the provider last reported it:
// rate against limit, in requests or MB.
type ServiceUsage struct {
	Rate  float64 `json:"rate"`
	Limit float64 `json:"limit"`
}

// SetUsage records a ppr service's usage. The service is over quota when
// limit > 0 and rate >= quota_headroom × limit: its upstreams then take new
// connections only where no other service's upstream of the same listener
// slice is usable. A service back under serves again. Each change gets an
// event (quota, quota_ok). A limit of 0 (or less) means no limit: the
// service is never over quota, and its figures are forgotten.
func (p *Pool) SetUsage(service int, rate, limit float64) {
	p.mu.Lock()
	if limit > 0 {
		p.usage[service] = ServiceUsage{Rate: rate, Limit: limit}
	} else {
		delete(p.usage, service)
	}
	ev := p.evalQuota(service, p.cfg.Load().QuotaHeadroom)
	p.mu.Unlock()
	if ev.Kind != "" {
		p.events.Record(ev)
		p.notifyChanged()
	}
}

// AtQuota reports whether service's usage is at or over quota_headroom ×
// its limit: its upstreams are in state quota.
func (p *Pool) AtQuota(service int) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.quota[service]
}

// Usage returns the figures SetUsage holds, per service with a limit: what
// a state file keeps, and restores with SetUsage.
func (p *Pool) Usage() map[int]ServiceUsage {
	p.mu.Lock()
	defer p.mu.Unlock()
	return maps.Clone(p.usage)
}

// evalQuota sets service's quota state from its usage and headroom and
// returns the event of a change (a zero Event when none); the caller holds
// p.mu and records the event after unlocking.
func (p *Pool) evalQuota(service int, headroom float64) Event {
	u, ok := p.usage[service]
	over := ok && u.Limit > 0 && u.Rate >= headroom*u.Limit
	if p.quota[service] == over {
		return Event{}
	}
	if over {
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
	ev := Event{Time: p.now(), Kind: EventQuotaOK, Service: service,
		Reason: fmt.Sprintf("usage %g of limit %g, under quota_headroom %g", u.Rate, u.Limit, headroom)}
	if over {
		ev.Kind = EventQuota
		ev.Reason = fmt.Sprintf("usage %g of limit %g, at or over quota_headroom %g", u.Rate, u.Limit, headroom)
	} else if !ok {
		ev.Reason = "no usage limit"
	}
	return ev
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
