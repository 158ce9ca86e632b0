package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Loop names one poll loop of the Poller.
type Loop int

const (
	LoopAccount Loop = iota // services, service records, credit, invoices
	LoopLists               // IP lists and sticky sessions of each served service
	LoopStatus              // network status: errored and inactive IPs
	LoopUsage               // stats and rate of ppr services
	numLoops
)

var loopNames = [numLoops]string{"account", "lists", "status", "usage"}

func (l Loop) String() string { return loopNames[l] }

// PollConfig holds the options of the poll loops. Zero durations take the
// defaults of DESIGN.md §4.
type PollConfig struct {
	Services      []int         // service IDs to serve; empty = every Active service of the account
	Protocols     []string      // how listeners dial upstreams: "http", "socks5"; decides which lists are fetched
	IPList        time.Duration // default 10m
	NetworkStatus time.Duration // default 30s
	Usage         time.Duration // default 1m
	Account       time.Duration // default 15m
	Jitter        float64       // share of each interval added or removed at random; default 0.1
	MaxBackoff    time.Duration // cap of the wait after failures; default 10m
}

func (c *PollConfig) setDefaults() {
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&c.IPList, 10*time.Minute)
	def(&c.NetworkStatus, 30*time.Second)
	def(&c.Usage, time.Minute)
	def(&c.Account, 15*time.Minute)
	def(&c.MaxBackoff, 10*time.Minute)
	if c.Jitter == 0 {
		c.Jitter = 0.1
	}
	if len(c.Protocols) == 0 {
		c.Protocols = []string{"http", "socks5"}
	}
}

// Validate reports options that cannot work.
func (c PollConfig) Validate() error {
	for _, d := range []time.Duration{c.IPList, c.NetworkStatus, c.Usage, c.Account} {
		if d != 0 && d < time.Second {
			return fmt.Errorf("poll intervals must be at least 1s, got %s", d)
		}
	}
	if c.Jitter < 0 || c.Jitter > 0.5 {
		return fmt.Errorf("jitter must be between 0 and 0.5, got %g", c.Jitter)
	}
	for _, p := range c.Protocols {
		if p != "http" && p != "socks5" {
			return fmt.Errorf("unknown protocol %q", p)
		}
	}
	return nil
}

// ServiceState is what the agent knows of one served service.
type ServiceState struct {
	ID          int
	Record      Service            // the single-service record: kind, status, credentials
	Lists       map[string][]Entry // IP list by type ("http-auth", "socks-ip", "ppr-http", "ppr-socks")
	Sticky      []StickySession    // ppr sticky sessions
	Errored     []string           // networkstatus/errors
	Inactive    []string           // networkstatus/inactive
	Rate, Limit float64            // ppr usage; HasUsage when known
	HasUsage    bool
	ListsKnown  bool // every needed list was fetched at least once
	StatusKnown bool
}

// Snapshot is the agent's whole view, handed to the daemon after each change.
// It is a deep copy: the receiver may keep it.
type Snapshot struct {
	Time         time.Time
	AccountKnown bool           // the service list was fetched at least once
	ListsUpdated time.Time      // end of the last lists round in which every fetch succeeded
	Services     []ServiceState // served services, by ID
	Dropped      []int          // services known but not served (Suspended, Terminated, Cancelled, …)
	Wanted       []int          // the services meant to be served: configured, or the account's Active ones
	Credit       float64
	CreditKnown  bool
	Accounts     []ServiceItem // every service of the account, as listed
	Invoices     []Invoice
}

// Poller runs the agent's poll loops against a Client and hands a Snapshot
// to OnChange after every change. Each loop has a PollOnce for tests.
type Poller struct {
	client   *Client
	cfg      PollConfig
	onChange func(Snapshot)
	log      *slog.Logger
	now      func() time.Time

	mu       sync.Mutex
	snap     Snapshot
	services map[int]*ServiceState
	pending  map[string]int // list key → size of an unconfirmed small list
	lastGood map[string]int // list key → size of the last list swapped in

	protocols []string // guarded by mu; starts as cfg.Protocols
	kicks     [numLoops]chan struct{}

	beats  [numLoops]atomic.Int64 // unix nanos of each loop's last heartbeat
	rounds [numLoops]atomic.Int64 // rounds completed, successful or not
}

// NewPoller returns a Poller; onChange may be nil.
func NewPoller(c *Client, cfg PollConfig, onChange func(Snapshot), logger *slog.Logger) (*Poller, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if onChange == nil {
		onChange = func(Snapshot) {}
	}
	p := &Poller{client: c, cfg: cfg, onChange: onChange, log: logger, now: time.Now,
		services: map[int]*ServiceState{}, pending: map[string]int{}, lastGood: map[string]int{}}
	p.protocols = slices.Clone(cfg.Protocols)
	for i := range p.beats {
		p.beats[i].Store(p.now().UnixNano())
		p.kicks[i] = make(chan struct{}, 1)
	}
	return p, nil
}

// Run runs every loop until ctx ends. The account loop polls first so that
// the others know which services to serve.
func (p *Poller) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	intervals := [numLoops]time.Duration{p.cfg.Account, p.cfg.IPList, p.cfg.NetworkStatus, p.cfg.Usage}
	first := make(chan struct{}) // closed after the account loop's first round
	for l := Loop(0); l < numLoops; l++ {
		wg.Go(func() {
			afterRound := func() {}
			if l == LoopAccount {
				afterRound = sync.OnceFunc(func() { close(first) })
			} else if !p.wait(ctx, l, first, nil) {
				return
			}
			p.loop(ctx, l, intervals[l], afterRound)
		})
	}
	wg.Wait()
	return nil
}

// heartbeatEvery is how often an idle loop shows it is alive.
const heartbeatEvery = time.Second

func (p *Poller) loop(ctx context.Context, l Loop, interval time.Duration, afterRound func()) {
	failures := 0
	for {
		err := p.PollOnce(ctx, l)
		afterRound()
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			failures++
		}
		wait := p.nextWait(interval, failures, err)
		if err != nil {
			p.log.Warn("provider API poll failed", "loop", l.String(), "err", err, "failures", failures, "retry_in", wait.Round(time.Millisecond))
		} else {
			if failures > 0 {
				p.log.Info("provider API poll recovered", "loop", l.String(), "after_failures", failures)
			}
			failures = 0
		}
		t := time.NewTimer(wait)
		woke := p.wait(ctx, l, p.kicks[l], t.C)
		t.Stop()
		if !woke {
			return
		}
	}
}

// wait beats loop l's heartbeat until wake or timer fires (true) or ctx
// ends (false): a loop waiting for its next round, or a slow API holding up
// the account loop's first round, must not look stuck. A nil channel never
// fires.
func (p *Poller) wait(ctx context.Context, l Loop, wake <-chan struct{}, timer <-chan time.Time) bool {
	hb := time.NewTicker(heartbeatEvery)
	defer hb.Stop()
	for {
		p.beat(l)
		select {
		case <-ctx.Done():
			return false
		case <-wake:
			return true
		case <-timer:
			return true
		case <-hb.C:
		}
	}
}

// Kick makes loop l poll now instead of at the end of its wait.
func (p *Poller) Kick(l Loop) {
	select {
	case p.kicks[l] <- struct{}{}:
	default:
	}
}

// SetProtocols changes which upstream protocols the listeners dial, and so
// which IP lists are fetched (after a reload); the lists loop polls at once.
func (p *Poller) SetProtocols(protocols []string) {
	p.mu.Lock()
	changed := !slices.Equal(p.protocols, protocols)
	p.protocols = slices.Clone(protocols)
	p.mu.Unlock()
	if changed {
		p.Kick(LoopLists)
	}
}

// Seed tells the poller the sizes of the lists the daemon serves from its
// saved state, so that the first poll after a restart gets the same
// shrink confirmation as any later one. Keys are "<service>/<list type>"
// and "<service>/sticky".
func (p *Poller) Seed(sizes map[string]int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for k, n := range sizes {
		if _, ok := p.lastGood[k]; !ok {
			p.lastGood[k] = n
		}
	}
}

func (p *Poller) beat(l Loop) { p.beats[l].Store(p.now().UnixNano()) }

// Rounds is how many rounds of loop l have completed.
func (p *Poller) Rounds(l Loop) int64 { return p.rounds[l].Load() }

// Alive reports whether every loop beat within maxAge: a heartbeat of the
// loop itself, not a successful poll, so an API outage does not count.
func (p *Poller) Alive(maxAge time.Duration) bool {
	now := p.now().UnixNano()
	for i := range p.beats {
		if now-p.beats[i].Load() > int64(maxAge) {
			return false
		}
	}
	return true
}

func (p *Poller) jitter(d time.Duration) time.Duration {
	if p.cfg.Jitter <= 0 {
		return d
	}
	f := 1 + p.cfg.Jitter*(2*rand.Float64()-1)
	return time.Duration(float64(d) * f)
}

// nextWait is the time until a loop's next round: the interval with
// jitter after a success; after failures the backoff, and never before the
// next-allowed time a 429 named.
func (p *Poller) nextWait(interval time.Duration, failures int, err error) time.Duration {
	if err == nil {
		return p.jitter(interval)
	}
	wait := p.backoff(interval, failures)
	var apiErr *APIError
	if errors.As(err, &apiErr) && !apiErr.NextAllowed.IsZero() {
		if d := apiErr.NextAllowed.Sub(p.now()); d > wait {
			wait = d
		}
	}
	return wait
}

// backoff after n consecutive failures: starting at the smaller of the
// interval and 5s, doubling, capped by MaxBackoff (and never below 1s).
func (p *Poller) backoff(interval time.Duration, n int) time.Duration {
	base := min(interval, 5*time.Second)
	d := base
	for i := 1; i < n && d < p.cfg.MaxBackoff; i++ {
		d *= 2
	}
	d = min(d, p.cfg.MaxBackoff)
	return max(p.jitter(d), time.Second)
}

// PollOnce runs one round of loop l.
func (p *Poller) PollOnce(ctx context.Context, l Loop) error {
	if l < 0 || l >= numLoops {
		return fmt.Errorf("unknown loop %d", l)
	}
	defer p.beat(l)
	defer p.rounds[l].Add(1)
	polls := [numLoops]func(context.Context) error{p.pollAccount, p.pollLists, p.pollStatus, p.pollUsage}
	return polls[l](ctx)
}

// served returns the IDs of the services the other loops work on.
func (p *Poller) served() []int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Sorted(maps.Keys(p.services))
}

func servable(status string) bool { return status == "Active" }

func (p *Poller) pollAccount(ctx context.Context) error {
	items, err := p.client.Services(ctx)
	if err != nil {
		return fmt.Errorf("polling services: %w", err)
	}
	p.beat(LoopAccount)
	p.mu.Lock()
	listOK := len(p.cfg.Services) > 0 || p.confirm("services", len(items))
	p.mu.Unlock()
	if !listOK {
		// An empty service list, or one far smaller than the last, would
		// take every upstream away: wait for the next poll to confirm it.
		p.log.Warn("service list shrank; keeping the served services until the next poll confirms it", "services", len(items))
		items = nil
		p.mu.Lock()
		for id := range p.services {
			items = append(items, ServiceItem{ServiceID: id, Status: "Active"})
		}
		p.mu.Unlock()
	}
	want := p.cfg.Services
	if len(want) == 0 {
		for _, s := range items {
			if servable(s.Status) {
				want = append(want, s.ServiceID)
			}
		}
	}
	records := map[int]Service{}
	var dropped []int
	var firstErr error
	for _, id := range want {
		rec, err := p.client.Service(ctx, id)
		p.beat(LoopAccount)
		if err != nil {
			if firstErr == nil {
				firstErr = fmt.Errorf("polling service %d: %w", id, err)
			}
			continue
		}
		if !servable(rec.Status) {
			dropped = append(dropped, id)
			continue
		}
		records[id] = *rec
	}
	credit, cerr := p.client.Credit(ctx)
	p.beat(LoopAccount)
	invoices, ierr := p.client.Invoices(ctx)
	p.beat(LoopAccount)

	p.mu.Lock()
	p.snap.AccountKnown = p.snap.AccountKnown || listOK
	p.snap.Wanted = slices.Clone(want)
	if listOK {
		p.snap.Accounts = items
	}
	for id, rec := range records {
		st := p.services[id]
		if st == nil {
			st = &ServiceState{ID: id, Lists: map[string][]Entry{}}
			p.services[id] = st
		}
		st.Record = rec
	}
	// A service that failed to load keeps its last state; one that is no
	// longer served (or no longer Active) leaves.
	for id := range p.services {
		if _, ok := records[id]; ok {
			continue
		}
		if slices.Contains(dropped, id) || !slices.Contains(want, id) {
			delete(p.services, id)
			if !slices.Contains(dropped, id) {
				dropped = append(dropped, id)
			}
		}
	}
	p.snap.Dropped = dropped
	if cerr == nil {
		p.snap.Credit, p.snap.CreditKnown = credit, true
	}
	if ierr == nil {
		p.snap.Invoices = invoices
	}
	p.mu.Unlock()
	p.changed()
	switch {
	case firstErr != nil:
		return firstErr
	case cerr != nil:
		return fmt.Errorf("polling credit: %w", cerr)
	case ierr != nil:
		return fmt.Errorf("polling invoices: %w", ierr)
	}
	return nil
}

// listTypes returns the IP list types a service needs (DESIGN.md §2).
func (p *Poller) listTypes(kind string) []string {
	var types []string
	p.mu.Lock()
	protocols := p.protocols
	p.mu.Unlock()
	for _, proto := range protocols {
		switch {
		case kind == "ppr" && proto == "http":
			types = append(types, "ppr-http")
		case kind == "ppr" && proto == "socks5":
			types = append(types, "ppr-socks")
		case proto == "http":
			types = append(types, "http-auth")
		case proto == "socks5":
			types = append(types, "socks-ip")
		}
	}
	return types
}

func (p *Poller) pollLists(ctx context.Context) error {
	var firstErr error
	fetched := 0
	for _, id := range p.served() {
		p.mu.Lock()
		st := p.services[id]
		kind := ""
		if st != nil {
			kind = st.Record.ProductType
		}
		p.mu.Unlock()
		if st == nil {
			continue
		}
		lists := map[string][]Entry{}
		ok := true
		for _, typ := range p.listTypes(kind) {
			l, err := p.client.IPList(ctx, id, typ, "json")
			p.beat(LoopLists)
			if err != nil {
				ok = false
				if firstErr == nil {
					firstErr = fmt.Errorf("polling %s list of service %d: %w", typ, id, err)
				}
				continue
			}
			if l.Bad > 0 {
				p.log.Warn("IP list has lines that could not be read", "service", id, "type", typ, "bad", l.Bad)
			}
			lists[typ] = l.Entries
		}
		var sticky []StickySession
		stickyOK := true
		if kind == "ppr" {
			sl, err := p.client.StickyList(ctx, id)
			p.beat(LoopLists)
			if err != nil {
				stickyOK = false
				if firstErr == nil {
					firstErr = fmt.Errorf("polling sticky sessions of service %d: %w", id, err)
				}
			} else {
				sticky = sl.Sessions
			}
		}
		p.mu.Lock()
		st = p.services[id]
		if st != nil {
			accepted := true
			for typ, entries := range lists {
				key := fmt.Sprintf("%d/%s", id, typ)
				if p.confirm(key, len(entries)) {
					st.Lists[typ] = entries
				} else {
					accepted = false
					p.log.Warn("IP list shrank; keeping the last good one until the next poll confirms it",
						"service", id, "type", typ, "entries", len(entries), "last_good", p.lastGood[key])
				}
			}
			if stickyOK && kind == "ppr" {
				if p.confirm(fmt.Sprintf("%d/sticky", id), len(sticky)) {
					st.Sticky = sticky
				} else {
					accepted = false
				}
			}
			// Known once every list was fetched and swapped in: until then
			// the daemon keeps serving what it had for this service.
			if ok && stickyOK && accepted {
				st.ListsKnown = true
			}
			if ok && stickyOK {
				fetched++
			}
		}
		p.mu.Unlock()
	}
	if firstErr == nil && fetched > 0 {
		p.mu.Lock()
		p.snap.ListsUpdated = p.now()
		p.mu.Unlock()
	}
	p.changed()
	return firstErr
}

// confirm decides whether a fetched list of n entries replaces the last good
// one: an empty list, or one less than half the last good one, is swapped
// in only when the next poll brings the same size again. Called with p.mu held.
func (p *Poller) confirm(key string, n int) bool {
	last, seen := p.lastGood[key]
	suspicious := n == 0 && (!seen || last > 0) || seen && n*2 < last
	if !suspicious {
		p.lastGood[key] = n
		delete(p.pending, key)
		return true
	}
	if prev, ok := p.pending[key]; ok && prev == n {
		p.lastGood[key] = n
		delete(p.pending, key)
		return true
	}
	p.pending[key] = n
	return false
}

func (p *Poller) pollStatus(ctx context.Context) error {
	var firstErr error
	for _, id := range p.served() {
		errored, err := p.client.NetworkErrors(ctx, id)
		p.beat(LoopStatus)
		if err != nil {
			if firstErr == nil {
				firstErr = fmt.Errorf("polling network errors of service %d: %w", id, err)
			}
			continue
		}
		inactive, err := p.client.NetworkInactive(ctx, id)
		p.beat(LoopStatus)
		if err != nil {
			if firstErr == nil {
				firstErr = fmt.Errorf("polling inactive servers of service %d: %w", id, err)
			}
			continue
		}
		p.mu.Lock()
		if st := p.services[id]; st != nil {
			st.Errored, st.Inactive, st.StatusKnown = errored, inactive, true
		}
		p.mu.Unlock()
	}
	p.changed()
	return firstErr
}

func (p *Poller) pollUsage(ctx context.Context) error {
	var firstErr error
	for _, id := range p.served() {
		p.mu.Lock()
		st := p.services[id]
		ppr := st != nil && st.Record.ProductType == "ppr"
		p.mu.Unlock()
		if !ppr {
			continue
		}
		if _, err := p.client.Stats(ctx, id); err != nil && firstErr == nil {
			firstErr = fmt.Errorf("polling stats of service %d: %w", id, err)
		}
		p.beat(LoopUsage)
		rate, err := p.client.Rate(ctx, id)
		p.beat(LoopUsage)
		if err != nil {
			if firstErr == nil {
				firstErr = fmt.Errorf("polling rate of service %d: %w", id, err)
			}
			continue
		}
		if len(rate) == 0 {
			continue
		}
		p.mu.Lock()
		if st := p.services[id]; st != nil {
			st.Rate, st.Limit, st.HasUsage = rate[0].Rate, rate[0].Limit, true
		}
		p.mu.Unlock()
	}
	p.changed()
	return firstErr
}

// Snapshot returns a deep copy of the current view.
func (p *Poller) Snapshot() Snapshot {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.snapshotLocked()
}

func (p *Poller) snapshotLocked() Snapshot {
	s := p.snap
	s.Time = p.now()
	s.Accounts = slices.Clone(p.snap.Accounts)
	s.Invoices = slices.Clone(p.snap.Invoices)
	s.Dropped = slices.Clone(p.snap.Dropped)
	s.Wanted = slices.Clone(p.snap.Wanted)
	s.Services = make([]ServiceState, 0, len(p.services))
	for _, st := range p.services {
		c := *st
		c.Lists = make(map[string][]Entry, len(st.Lists))
		for k, v := range st.Lists {
			c.Lists[k] = slices.Clone(v)
		}
		c.Sticky = slices.Clone(st.Sticky)
		c.Errored = slices.Clone(st.Errored)
		c.Inactive = slices.Clone(st.Inactive)
		s.Services = append(s.Services, c)
	}
	slices.SortFunc(s.Services, func(a, b ServiceState) int { return a.ID - b.ID })
	return s
}

func (p *Poller) changed() { p.onChange(p.Snapshot()) }

// Rotate asks the provider for a new exit IP of a sticky session; it
// implements the pool's Rotator.
func (p *Poller) Rotate(ctx context.Context, service int, server, session string) (string, error) {
	res, err := p.client.StickyRotate(ctx, service, server, session)
	if err != nil {
		return "", fmt.Errorf("rotating session %s on %s of service %d: %w", session, server, service, err)
	}
	if res.ExitIP == "" {
		return "", nil // the answer names no exit IP: the next lists round brings it
	}
	p.mu.Lock()
	if st := p.services[service]; st != nil {
		for i := range st.Sticky {
			if st.Sticky[i].Server == server && st.Sticky[i].Session == session {
				st.Sticky[i].ExitIP = res.ExitIP
			}
		}
	}
	p.mu.Unlock()
	return res.ExitIP, nil
}

// UpstreamSpec is one dialable upstream derived from a Snapshot by the table
// of DESIGN.md §2; the daemon turns it into a pool.Upstream unchanged.
type UpstreamSpec struct {
	Service  int
	Kind     string // fpr | ppr
	Protocol string // http | socks5
	Address  string // host:port
	Username string
	Password string
	Server   string
	Session  string
	ExitIP   string
}

var listProtocol = map[string]string{"http-auth": "http", "socks-ip": "socks5", "ppr-http": "http", "ppr-socks": "socks5"}

// Upstreams derives the dialable upstreams of one service (DESIGN.md §2).
func (s *ServiceState) Upstreams() []UpstreamSpec {
	kind := s.Record.ProductType
	var out []UpstreamSpec
	for _, typ := range slices.Sorted(maps.Keys(s.Lists)) {
		proto, ok := listProtocol[typ]
		if !ok {
			continue
		}
		entries := s.Lists[typ]
		creds := func(e Entry) (string, string) {
			if typ == "socks-ip" || e.Login == "" {
				return s.Record.Username, s.Record.Password
			}
			return e.Login, e.Password
		}
		if kind == "ppr" && len(s.Sticky) > 0 {
			for _, ss := range s.Sticky {
				var e Entry
				found := false
				for _, cand := range entries {
					if cand.Host == ss.Server {
						e, found = cand, true
						break
					}
				}
				port := ss.Port
				if port == 0 {
					if !found {
						continue
					}
					port = e.Port
				}
				if !found && len(entries) > 0 {
					e = entries[0] // credentials of the list when the gateway is not on it
				}
				u, pw := creds(e)
				out = append(out, UpstreamSpec{Service: s.ID, Kind: kind, Protocol: proto,
					Address: net.JoinHostPort(ss.Server, strconv.Itoa(port)), Username: u, Password: pw,
					Server: ss.Server, Session: ss.Session, ExitIP: ss.ExitIP})
			}
			continue
		}
		for _, e := range entries {
			u, pw := creds(e)
			out = append(out, UpstreamSpec{Service: s.ID, Kind: kind, Protocol: proto,
				Address: net.JoinHostPort(e.Host, strconv.Itoa(e.Port)), Username: u, Password: pw})
		}
	}
	return out
}
