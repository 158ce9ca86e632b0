package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
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

// PollConfig is the [poll] section of the configuration file and the
// options of the poll loops. Start from DefaultPollConfig: a key present in
// the file keeps its value, and Validate refuses what cannot work. Fields
// without a key (toml:"-") are set by the program.
type PollConfig struct {
	IPList        time.Duration `toml:"ip_list"`        // IP lists and sticky sessions
	NetworkStatus time.Duration `toml:"network_status"` // errored and inactive IPs
	Usage         time.Duration `toml:"usage"`          // rate of ppr services
	Account       time.Duration `toml:"account"`        // services, credit, invoices
	// Jitter is the share of each wait added or removed at random, 0–0.5;
	// 0 waits exactly the interval.
	Jitter float64 `toml:"jitter"`
	// MaxBackoff caps the wait after failures (a 429's named time still
	// wins, up to maxRateLimitWait).
	MaxBackoff time.Duration `toml:"max_backoff"`

	// Services are the service IDs to serve (the [api] services key); empty
	// means every Active service of the account.
	Services []int `toml:"-"`
	// Draws reports whether some listener draws the upstreams of a service
	// of this kind ("fpr", "ppr") dialed by this protocol ("http",
	// "socks5"). It decides which IP lists and sticky sessions are fetched:
	// a list no listener draws is not polled, and one kept from before a
	// reload goes. nil draws every one. It must not block or call back
	// into the poller.
	Draws func(service int, kind, protocol string) bool `toml:"-"`
	// Manage is the [manage] section: actions taken on the account.
	Manage ManageConfig `toml:"-"`
	// OnEvent, if set, receives the events of the list updates Manage
	// requests. It is called from the poll loops and must not block.
	OnEvent func(Event) `toml:"-"`
	// LookupHost resolves the provider's gateway names, once per lists
	// round: the sticky sessions' servers and the list entries' hosts, so
	// that a session's port is found in a list of IPs and an upstream
	// dialed by name gets the IP the network-status lists name it by
	// (UpstreamSpec.StatusIP). nil means net.DefaultResolver.LookupHost.
	LookupHost func(ctx context.Context, host string) ([]string, error) `toml:"-"`
	// Now is the poller's clock, for tests that must move it (a shrunken
	// list is confirmed only by a poll an interval later); nil means
	// time.Now. NewPoller reads it; Reconfigure keeps the clock it set.
	Now func() time.Time `toml:"-"`
}

// DefaultPollConfig returns the [poll] section with every key at its
// default, every list drawn and [manage] at its defaults (off).
func DefaultPollConfig() PollConfig {
	return PollConfig{
		IPList:        10 * time.Minute,
		NetworkStatus: 30 * time.Second,
		Usage:         time.Minute,
		Account:       15 * time.Minute,
		Jitter:        0.1,
		MaxBackoff:    10 * time.Minute,
		Manage:        DefaultManageConfig(),
	}
}

// Validate reports every problem of the section, joined with errors.Join;
// each message starts with the key as written in the file. Manage is
// validated on its own (ManageConfig.Validate), as its own section.
func (c PollConfig) Validate() error {
	var errs []error
	for _, d := range []struct {
		key string
		v   time.Duration
	}{{"ip_list", c.IPList}, {"network_status", c.NetworkStatus}, {"usage", c.Usage}, {"account", c.Account}, {"max_backoff", c.MaxBackoff}} {
		if d.v < time.Second {
			errs = append(errs, fmt.Errorf("%s: must be at least 1s, got %s", d.key, d.v))
		}
	}
	if c.Jitter < 0 || c.Jitter > 0.5 || c.Jitter != c.Jitter {
		errs = append(errs, fmt.Errorf("jitter: must be within 0–0.5, got %g", c.Jitter))
	}
	// Services come from the [api] section, whose Validate checks them.
	return errors.Join(errs...)
}

// Serves reports whether service id may be served under this
// configuration: every service when Services is empty (the account then
// says which are Active), else only those listed.
func (c PollConfig) Serves(id int) bool {
	return len(c.Services) == 0 || slices.Contains(c.Services, id)
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
	// UsageEmpty: the service has no figures (any more) to weigh against
	// a quota: the last rate answer was an empty array, or it is not (any
	// longer) a ppr service, whose rate alone is read. Both false: not
	// read yet.
	UsageEmpty bool
	// ListsKnown: every needed list was fetched and swapped in at least
	// once, so the daemon may serve what they give instead of what it had.
	// A list awaiting confirmation (see Poller.confirm) holds the service
	// back, except a first answer that is empty while another list of the
	// service came with entries: there is nothing older to keep then, and
	// the service's entries are served while the empty list is confirmed.
	ListsKnown bool
	// ErroredKnown and InactiveKnown: that network-status list was
	// fetched at least once. Each list is polled on its own clock and
	// updated whenever its own fetch succeeds; one whose fetch fails keeps
	// its last good value (and backs off alone), so the daemon applies each
	// list once it is known, the other keeping what the daemon had.
	ErroredKnown, InactiveKnown bool
	// Resolved maps each host name among the sticky sessions' servers and
	// the list entries' hosts to the addresses it resolved to in the last
	// lists round: how a session's port is found in a list of IPs, and the
	// IP the network-status lists name for an upstream dialed by name
	// (UpstreamSpec.StatusIP). A name whose lookup failed keeps the
	// addresses of its last good one (none if it never resolved).
	Resolved map[string][]string

	// listsAt and stickyAt: when the round began whose IP lists (sticky
	// sessions) are in, or (stickyAt) a rotation changed a session: an
	// answer to a round begun before is older than what is in, and is not
	// taken (a regular round answering after a list update's own poll, or
	// after a rotation, would put the old list or exit IP back).
	listsAt, stickyAt time.Time
}

// StatusKnown reports whether both network-status lists are known.
func (s *ServiceState) StatusKnown() bool { return s.ErroredKnown && s.InactiveKnown }

// Snapshot is the agent's whole view, handed to the daemon after each change.
// It is a deep copy: the receiver may keep it.
type Snapshot struct {
	Time         time.Time
	AccountKnown bool           // the service list was fetched at least once
	ListsUpdated time.Time      // end of the last lists round in which every fetch succeeded
	ListsFrom    string         // the base URL (Client.BaseURL) of the last lists round that fetched any service's lists
	Services     []ServiceState // served services, by ID
	Dropped      []int          // services known but not served (Suspended, Terminated, Cancelled, …)
	Wanted       []int          // the services meant to be served: configured, or the account's Active ones
	Credit       float64
	CreditKnown  bool
	Accounts     []ServiceItem // every service of the account, as listed
	Invoices     []Invoice
	// UnpaidInvoices and UnpaidUSD count and sum the account's invoices in
	// status Unpaid or Collections ("Payment Pending" is not unpaid): an
	// unpaid invoice is how the provider suspends services. Valid when
	// InvoicesKnown.
	UnpaidInvoices int
	UnpaidUSD      float64
	InvoicesKnown  bool
}

// Unserved lists the account's services that are not served (suspended,
// pending, or left out of [api] services), as the account's list gives
// them; the served ones are in Services.
func (s *Snapshot) Unserved() []ServiceItem {
	var out []ServiceItem
	for _, it := range s.Accounts {
		if !slices.ContainsFunc(s.Services, func(st ServiceState) bool { return st.ID == it.ServiceID }) {
			out = append(out, it)
		}
	}
	return out
}

// Poller runs the agent's poll loops against a Client and hands a Snapshot
// to OnChange after every change. Each loop has a PollOnce for tests. A
// failed poll backs off (PollConfig.MaxBackoff): in the lists, status and
// usage loops, which poll each service on its own clock, a failing
// service backs off alone and the others keep their interval.
type Poller struct {
	onChange func(Snapshot)
	log      *slog.Logger
	now      func() time.Time // the clock; tests replace it before any round

	mu       sync.Mutex
	client   *Client
	cfg      PollConfig
	gen      uint64          // bumped by Reconfigure: a round begun before drops its results
	inflight map[uint64]int  // rounds running, by the generation they began in
	trusted  map[string]bool // after a provider change: keys already swapped in without confirmation
	snap     Snapshot
	services map[int]*ServiceState
	pending  map[string]pendingList // list key → an unconfirmed small list
	lastGood map[string]int         // list key → size of the last list swapped in
	formats  map[string]string      // list type → the format that last parsed
	manage   map[int]*manageState
	provider uint64 // bumped by Reconfigure with a new provider: its 429s are not the old one's
	// clocks are the schedules of each loop's units (see Poller.loop).
	clocks [numLoops]map[unit]*clock

	kicks [numLoops]chan struct{}
	// kickAfterAccount makes the end of the next account round kick the
	// other loops: set by Reconfigure, so that a new provider's services
	// get their lists at once.
	kickAfterAccount atomic.Bool

	beats  [numLoops]atomic.Int64 // unix nanos of each loop's last heartbeat
	rounds [numLoops]atomic.Int64 // rounds completed, successful or not
}

// NewPoller returns a Poller; onChange may be nil. cfg is used as given:
// start from DefaultPollConfig.
func NewPoller(c *Client, cfg PollConfig, onChange func(Snapshot), logger *slog.Logger) (*Poller, error) {
	if err := errors.Join(cfg.Validate(), cfg.Manage.Validate()); err != nil {
		return nil, err
	}
	if c == nil {
		return nil, errors.New("poller needs a client")
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if onChange == nil {
		onChange = func(Snapshot) {}
	}
	now := cfg.Now
	if now == nil {
		now = time.Now
	}
	p := &Poller{client: c, cfg: cloneConfig(cfg), onChange: onChange, log: logger, now: now,
		services: map[int]*ServiceState{}, pending: map[string]pendingList{}, lastGood: map[string]int{}, inflight: map[uint64]int{},
		formats: map[string]string{}, manage: map[int]*manageState{}}
	for i := range p.beats {
		p.clocks[i] = map[unit]*clock{}
		p.beats[i].Store(p.now().UnixNano())
		p.kicks[i] = make(chan struct{}, 1)
	}
	return p, nil
}

func cloneConfig(c PollConfig) PollConfig {
	c.Services = slices.Clone(c.Services)
	return c
}

// Reconfigure moves the loops to client c and cfg at once (a reload): every
// loop is woken (Kick: a 429's time still holds), its next wait uses the
// new intervals, and results of rounds begun before are dropped. Rotations
// in flight finish against the client they started with. providerChanged
// (a new base URL or credential) clears the loops' clocks and lets the
// next lists and service list replace the old ones without the
// confirmation a far smaller list needs (the operator asked for the
// change). A service a narrower [api] services leaves out is dropped at
// once (in Snapshot.Dropped, API answering or not); one it adds joins at
// the account round this triggers, which kicks the other loops when it
// ends. The caller applies the snapshot after it (no callback runs here).
func (p *Poller) Reconfigure(c *Client, cfg PollConfig, providerChanged bool) error {
	if err := errors.Join(cfg.Validate(), cfg.Manage.Validate()); err != nil {
		return err
	}
	if c == nil {
		return errors.New("poller needs a client")
	}
	p.mu.Lock()
	p.client = c
	p.cfg = cloneConfig(cfg)
	p.gen++
	// A service left out of [api] services is not served from now on,
	// whether or not the API answers the next account round: the daemon
	// takes its upstreams out at the next snapshot, as for a suspended one.
	for id := range p.services {
		if !cfg.Serves(id) {
			p.forgetService(id)
			if !slices.Contains(p.snap.Dropped, id) {
				p.snap.Dropped = append(p.snap.Dropped, id)
			}
		}
	}
	p.forgetSizes(listsOf(func(id int) bool { return !cfg.Serves(id) }))
	p.snap.Wanted = slices.DeleteFunc(p.snap.Wanted, func(id int) bool { return !cfg.Serves(id) })
	p.pruneClocks()
	if providerChanged {
		p.provider++
		p.trusted = map[string]bool{}
		clear(p.pending)
		// The new provider's lists start their own clocks: no backoff or
		// 429 of the old one holds them back.
		clear(p.manage)
		for _, clocks := range p.clocks {
			clear(clocks)
		}
	}
	p.mu.Unlock()
	p.kickAfterAccount.Store(true)
	for l := Loop(0); l < numLoops; l++ {
		p.Kick(l)
	}
	return nil
}

// forgetService drops a service that is no longer served: its state and
// its list-update state. Its lists' sizes go with forgetSizes. Called with
// p.mu held.
func (p *Poller) forgetService(id int) {
	delete(p.services, id)
	delete(p.manage, id)
}

// forgetSizes drops the last good and pending sizes of the lists gone
// names (keys "<service>/<list>"): a
// list whose upstreams left the pool keeps nothing that a smaller first
// answer could be held back for when it is drawn or served again. Called
// with p.mu held.
func (p *Poller) forgetSizes(gone func(key string) bool) {
	maps.DeleteFunc(p.lastGood, func(key string, _ int) bool { return gone(key) })
	maps.DeleteFunc(p.pending, func(key string, _ pendingList) bool { return gone(key) })
}

// listsOf is a forgetSizes test for every list of the services gone names,
// also those only Seed knew (restored from the daemon's state file, never
// polled); the account's service-list key is kept.
func listsOf(gone func(service int) bool) func(key string) bool {
	return func(key string) bool {
		id, _, ok := strings.Cut(key, "/")
		n, err := strconv.Atoi(id)
		return ok && err == nil && gone(n)
	}
}

// current returns the client, config and generation a round works with.
func (p *Poller) current() (*Client, PollConfig, uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.client, p.cfg, p.gen
}

// Run runs every loop until ctx ends. The account loop polls first so that
// the others know which services to serve.
func (p *Poller) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	first := make(chan struct{}) // closed after the account loop's first round
	for l := Loop(0); l < numLoops; l++ {
		wg.Go(func() {
			afterRound := func() {}
			if l == LoopAccount {
				closeFirst := sync.OnceFunc(func() { close(first) })
				afterRound = func() {
					closeFirst()
					if p.kickAfterAccount.Swap(false) {
						for o := LoopAccount + 1; o < numLoops; o++ {
							p.Kick(o)
						}
					}
				}
			} else if !p.wait(ctx, l, first, nil) {
				return
			}
			p.loop(ctx, l, afterRound)
		})
	}
	wg.Wait()
	return nil
}

// heartbeatEvery is how often an idle loop shows it is alive.
const heartbeatEvery = time.Second

// maxConfirmWait bounds confirmWait.
const maxConfirmWait = 10 * time.Second

// confirmWait is how soon the lists loop, with interval, polls again a
// service with a list that was empty on its first answer (see
// Poller.confirm): a tenth of the interval, at most maxConfirmWait. That
// poll settles the list whatever it brings, so it is brought forward once.
func confirmWait(interval time.Duration) time.Duration {
	return min(interval/10, maxConfirmWait)
}

// confirmAge is how long after the round that brought a shrunken list
// the round that confirms it must begin, in a loop with interval and
// jitter: the least a regular wait can be (the interval less its
// jitter), so that only the next regular poll confirms it, never one
// brought forward by Kick, a backoff retry or another list's early poll.
func confirmAge(interval time.Duration, jitter float64) time.Duration {
	if jitter <= 0 {
		return interval
	}
	return time.Duration(float64(interval) * (1 - jitter))
}

func (p *Poller) interval(l Loop) time.Duration {
	_, cfg, _ := p.current()
	return [numLoops]time.Duration{cfg.Account, cfg.IPList, cfg.NetworkStatus, cfg.Usage}[l]
}

// loop runs loop l until ctx ends. Each unit the loop polls (the
// account, or one service) keeps its own clock: a unit whose poll fails
// backs off alone (nextWait after its own failures, a 429's time
// included), while the others keep the loop's interval. Each round polls
// the units that are due, and the loop sleeps until the next one is.
// afterRound runs after each round.
func (p *Poller) loop(ctx context.Context, l Loop, afterRound func()) {
	for {
		p.round(ctx, l, true) // errors are logged per unit (done)
		afterRound()
		if ctx.Err() != nil {
			return
		}
		t := time.NewTimer(p.untilDue(l))
		woke := p.wait(ctx, l, p.kicks[l], t.C)
		t.Stop()
		if !woke {
			return
		}
	}
}

// unit is what one clock of a loop schedules: in the account loop the
// account (service 0), in the status loop one network-status list of a
// served service (part: statusErrors or statusInactive), in the others
// one served service.
type unit struct {
	service int
	part    string
}

// The parts of a service the status loop polls on their own clocks.
const (
	statusErrors   = "errors"   // networkstatus/errors
	statusInactive = "inactive" // networkstatus/inactive
)

// clock is when a loop next polls one unit, and how many polls of it
// failed in a row.
type clock struct {
	next time.Time // Kick clears it
	// notBefore is the time a 429 named (Poller.rateLimited): the unit is
	// not polled before it, Kick or not.
	notBefore time.Time
	failures  int
}

// due is when the unit is due.
func (c *clock) due() time.Time {
	if c.notBefore.After(c.next) {
		return c.notBefore
	}
	return c.next
}

// roundStart is what the clocks of the units a round polls are set from.
type roundStart struct {
	loop     Loop
	gen      uint64    // the generation the round began in
	provider uint64    // the provider epoch it began in (Poller.provider)
	at       time.Time // when it began
	next     time.Time // when the units that answer are next due
}

// startRound begins a round of loop l: the units that answer in it are
// next due after the interval with jitter, once for the round, so that
// they stay in one round.
func (p *Poller) startRound(l Loop) roundStart {
	p.mu.Lock()
	gen, provider := p.gen, p.provider
	p.mu.Unlock()
	now := p.now()
	return roundStart{loop: l, gen: gen, provider: provider, at: now, next: now.Add(p.jitter(p.interval(l)))}
}

// units returns the units loop l polls: the account, every served
// service (LoopStatus: each of its two lists, for a service some listener
// draws, as nothing else uses them), or (LoopUsage) the ppr ones. Called
// with p.mu held.
func (p *Poller) units(l Loop) []unit {
	if l == LoopAccount {
		return []unit{{}}
	}
	var us []unit
	for _, id := range slices.Sorted(maps.Keys(p.services)) {
		switch {
		case l == LoopStatus:
			if len(listTypes(p.cfg, id, p.services[id].Record.ProductType)) > 0 {
				us = append(us, unit{id, statusErrors}, unit{id, statusInactive})
			}
		case l == LoopUsage && p.services[id].Record.ProductType != "ppr":
		default:
			us = append(us, unit{service: id})
		}
	}
	return us
}

// pruneClocks drops the clocks of units no longer polled: those of
// services that left, or (LoopUsage) stopped being ppr. With done, which
// keeps no clock for such a unit, it bounds the clocks by the served
// services. Called with p.mu held.
func (p *Poller) pruneClocks() {
	for l, clocks := range p.clocks {
		units := p.units(Loop(l))
		for u := range clocks {
			if !slices.Contains(units, u) {
				delete(clocks, u)
			}
		}
	}
}

// pollable returns the units loop l polls; with onlyDue, those whose
// clock is due.
func (p *Poller) pollable(l Loop, onlyDue bool) []unit {
	now := p.now()
	p.mu.Lock()
	defer p.mu.Unlock()
	var due []unit
	for _, u := range p.units(l) {
		if c := p.clocks[l][u]; onlyDue && c != nil && now.Before(c.due()) {
			continue
		}
		due = append(due, u)
	}
	return due
}

// untilDue is the time until the next unit of loop l is due, at most the
// loop's interval.
func (p *Poller) untilDue(l Loop) time.Duration {
	wait := p.jitter(p.interval(l))
	now := p.now()
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, u := range p.units(l) {
		c := p.clocks[l][u]
		if c == nil {
			return 0
		}
		wait = min(wait, c.due().Sub(now))
	}
	return max(wait, 0)
}

// done sets the clock of unit u after a poll of it in round r (unless u
// is no longer polled, or the poller was reconfigured since: then only a
// 429's time is kept, when the provider is the same): the
// round's next time after a success, or after confirmWait when soon asks
// for a list that was empty on its first answer to be polled again soon;
// its own backoff after a failure, which is logged (and a recovery), and
// after a 429 not before the time it named (notBefore, which Kick leaves).
// Nothing is recorded once ctx has ended.
func (p *Poller) done(ctx context.Context, r roundStart, u unit, err error, soon bool) {
	if ctx.Err() != nil {
		return
	}
	l := r.loop
	p.mu.Lock()
	// The unit's clock takes the round's outcome, or after a reload of the
	// same provider only a 429's time (held); otherwise c is logged below
	// and not kept.
	kept := slices.Contains(p.units(l), u) && (p.gen == r.gen || p.provider == r.provider)
	c := p.clocks[l][u]
	if kept && c == nil {
		c = &clock{}
		p.clocks[l][u] = c
	}
	var held *clock
	switch {
	case !kept:
		c = &clock{}
	case p.gen != r.gen:
		held, c = c, &clock{}
	}
	before := c.failures
	if err != nil {
		c.failures++
	} else {
		c.failures = 0
	}
	failures := c.failures
	p.mu.Unlock()
	next, wait := r.next, time.Duration(0)
	limit := p.rateLimited(err)
	switch {
	case err != nil:
		wait = p.nextWait(p.interval(l), failures, limit)
		next = p.now().Add(wait)
	case soon:
		if t := p.now().Add(p.jitter(confirmWait(p.interval(l)))); t.Before(next) {
			next = t
		}
	}
	p.mu.Lock()
	c.next, c.notBefore = next, limit.until
	if held != nil && limit.until.After(held.notBefore) {
		held.notBefore = limit.until // a reload does not lift the provider's 429
	}
	p.mu.Unlock()
	if err == nil {
		failures = before // a recovery is logged with the failures it ends
	}
	var what []any
	if l != LoopAccount {
		what = []any{"service", u.service}
	}
	if u.part != "" {
		what = append(what, "list", u.part)
	}
	p.logPoll(l, err, limit, failures, wait, what...)
}

// logPoll logs the outcome of one poll in loop l: a failure with the
// failures in a row and the wait before the next try (and a 429's time
// beyond the longest wait, from limit), or, with err nil, a recovery after
// failures (none logged when failures is 0). what names the service
// polled, as slog key-value pairs.
func (p *Poller) logPoll(l Loop, err error, limit rateLimit, failures int, wait time.Duration, what ...any) {
	attrs := slices.Concat([]any{"loop", l.String()}, what)
	switch {
	case err != nil:
		p.log.Warn("provider API poll failed", slices.Concat(attrs,
			[]any{"err", err, "failures", failures, "retry_in", wait.Round(time.Millisecond)})...)
		p.logRateLimitCapped(limit, "polling", attrs...)
	case failures > 0:
		p.log.Info("provider API poll recovered", slices.Concat(attrs, []any{"after_failures", failures})...)
	}
}

// logRateLimitCapped logs that a 429 named a time beyond
// maxRateLimitWait, so that doing (a gerund) is tried again before it.
func (p *Poller) logRateLimitCapped(limit rateLimit, doing string, attrs ...any) {
	if limit.capped {
		p.log.Warn("the provider's next allowed time is beyond the longest wait; "+doing+" again before it",
			slices.Concat(attrs, []any{"next_allowed", limit.named.UTC(), "longest_wait", maxRateLimitWait})...)
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

// Kick makes loop l poll every unit now instead of at the end of its
// wait, those backing off included (their failure counts stay), but not
// before the time a 429 named: "a 429 waits at least until the time it
// names", whatever woke the loop (a reload, a service joining).
func (p *Poller) Kick(l Loop) {
	if l < 0 || l >= numLoops {
		return
	}
	p.kick(l)
}

// kick makes loop l poll units now, every unit when none is named.
func (p *Poller) kick(l Loop, units ...unit) {
	p.mu.Lock()
	for u, c := range p.clocks[l] {
		if len(units) == 0 || slices.Contains(units, u) {
			c.next = time.Time{}
		}
	}
	p.mu.Unlock()
	p.wake(l)
}

// wake makes loop l look at its clocks again now: a unit's clock changed
// outside its rounds.
func (p *Poller) wake(l Loop) {
	select {
	case p.kicks[l] <- struct{}{}:
	default:
	}
}

// Seed tells the poller the upstreams the daemon serves from its saved
// state, so that the first poll after a restart gets the same shrink
// confirmation as any later one: the sizes of the lists and sticky session
// lists they came from, and the number of services.
func (p *Poller) Seed(ups []UpstreamSpec) {
	sizes := map[string]int{}
	services := map[int]bool{}
	sessions := map[[2]string]bool{} // a session is one upstream per protocol
	for _, u := range ups {
		services[u.Service] = true
		switch {
		case u.Session != "":
			key := sizeKey(u.Service, stickyList)
			if !sessions[[2]string{key, u.Session}] {
				sessions[[2]string{key, u.Session}] = true
				sizes[key]++
			}
		case listType(u.Kind, u.Protocol) != "":
			sizes[sizeKey(u.Service, listType(u.Kind, u.Protocol))]++
		}
	}
	sizes[serviceListKey] = len(services)
	p.mu.Lock()
	defer p.mu.Unlock()
	for k, n := range sizes {
		if _, ok := p.lastGood[k]; !ok {
			p.lastGood[k] = n
		}
	}
}

func (p *Poller) beat(l Loop) { p.beats[l].Store(p.now().UnixNano()) }

// OlderRounds reports whether a round begun before the last Reconfigure
// still runs: it goes on with the client it began with, whose requests
// keep that client's timeout.
func (p *Poller) OlderRounds() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for gen := range p.inflight {
		if gen < p.gen {
			return true
		}
	}
	return false
}

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
	_, cfg, _ := p.current()
	if cfg.Jitter <= 0 {
		return d
	}
	f := 1 + cfg.Jitter*(2*rand.Float64()-1)
	return time.Duration(float64(d) * f)
}

// nextWait is the time until a unit's next poll: the interval with
// jitter after a success (failures 0); after failures the backoff, and
// never before limit.until, the time a 429 named as far as rateLimited
// allows.
func (p *Poller) nextWait(interval time.Duration, failures int, limit rateLimit) time.Duration {
	if failures == 0 {
		return p.jitter(interval)
	}
	wait := p.backoff(interval, failures)
	if limit.ok {
		wait = max(wait, limit.until.Sub(p.now()))
	}
	return wait
}

// rateLimit is what a 429 asks of the poller (Poller.rateLimited); the
// zero value is an error that is no 429, or none.
type rateLimit struct {
	ok     bool      // the error is a rate limit (ErrTooManyAttempts)
	until  time.Time // not to be tried before then
	named  time.Time // the time the rate limit named, zero if none
	capped bool      // named was beyond maxRateLimitWait, so until is earlier
}

// rateLimited reports whether err is a rate limit (a 429, or the
// provider's message in a 2xx refusal), and until when it asks to
// wait: the time it names, at least minRateLimitWait and at most
// maxRateLimitWait from now. A Retry-After may name up to 2^31 s, and a
// loop or list update parked that long would never try again; after the
// hour it asks again, and a 429 that names the time again is honoured
// again. The one rule for the poll loops and list updates; computed once
// per failure and passed on.
func (p *Poller) rateLimited(err error) rateLimit {
	limited, named := limitOf(err)
	if !limited {
		return rateLimit{}
	}
	now := p.now()
	r := rateLimit{ok: true, until: now.Add(minRateLimitWait), named: named}
	if r.named.After(r.until) {
		r.until = r.named
	}
	if longest := now.Add(maxRateLimitWait); r.until.After(longest) {
		r.until, r.capped = longest, true
	}
	return r
}

// limitOf reports whether err is the API's rate limit (a 429), and the
// time it names as the next allowed, zero if none.
func limitOf(err error) (limited bool, named time.Time) {
	if apiErr, ok := errors.AsType[*APIError](err); ok && apiErr.RateLimited() {
		return true, apiErr.NextAllowed
	}
	return errors.Is(err, ErrTooManyAttempts), time.Time{}
}

// keepErr is the error a unit of several requests reports (one clock for
// all of them), given the one kept so far and the next: the first, unless
// the next is a rate limit and the kept one is not, or names a later time.
// So the unit's clock honours the longest wait the API asked for, whatever
// failed before it in the round.
func keepErr(kept, next error) error {
	if kept == nil || next == nil {
		return cmp.Or(kept, next)
	}
	kl, kt := limitOf(kept)
	nl, nt := limitOf(next)
	if nl && (!kl || nt.After(kt)) {
		return next
	}
	return kept
}

// backoff after n consecutive failures: starting at the smaller of the
// interval and 5s, doubling, capped by max_backoff (and never below 1s).
func (p *Poller) backoff(interval time.Duration, n int) time.Duration {
	_, cfg, _ := p.current()
	base := min(interval, 5*time.Second)
	d := base
	for i := 1; i < n && d < cfg.MaxBackoff; i++ {
		d *= 2
	}
	d = min(d, cfg.MaxBackoff)
	return max(p.jitter(d), time.Second)
}

// PollOnce runs one round of loop l over every unit, also those that back
// off in the loop (their clocks are set as in the loop).
func (p *Poller) PollOnce(ctx context.Context, l Loop) error {
	if l < 0 || l >= numLoops {
		return fmt.Errorf("unknown loop %d", l)
	}
	return p.round(ctx, l, false)
}

// round runs one round of loop l; onlyDue limits it to the units that
// are due.
func (p *Poller) round(ctx context.Context, l Loop, onlyDue bool) error {
	defer p.beat(l)
	defer p.rounds[l].Add(1)
	r, units := p.startRound(l), p.pollable(l, onlyDue)
	p.mu.Lock()
	p.inflight[r.gen]++
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		if p.inflight[r.gen]--; p.inflight[r.gen] == 0 {
			delete(p.inflight, r.gen)
		}
		p.mu.Unlock()
	}()
	switch l {
	case LoopAccount:
		if len(units) == 0 {
			return nil
		}
		err := p.pollAccount(ctx, r)
		p.done(ctx, r, unit{}, err, false)
		return err
	case LoopLists:
		return p.pollLists(ctx, r, units)
	case LoopStatus:
		return p.pollStatus(ctx, r, units)
	default:
		return p.pollUsage(ctx, r, units)
	}
}

func servable(status string) bool { return status == "Active" }

// unpaid reports whether an invoice in this status is owed: Unpaid or
// Collections. Payment Pending is on its way and does not count.
func unpaid(status string) bool { return status == "Unpaid" || status == "Collections" }

// unpaidTotal counts and sums the unpaid invoices.
func unpaidTotal(invoices []Invoice) (n int, usd float64) {
	for _, v := range invoices {
		if unpaid(v.Status) {
			n++
			usd += v.Amount
		}
	}
	return n, usd
}

func (p *Poller) pollAccount(ctx context.Context, r roundStart) error {
	client, cfg, gen := p.current()
	items, err := client.Services(ctx)
	if err != nil {
		return fmt.Errorf("polling services: %w", err)
	}
	p.beat(LoopAccount)
	p.mu.Lock()
	if p.gen != gen {
		p.mu.Unlock()
		return nil // reconfigured meanwhile: the next round asks the new API
	}
	// The daemon's saved pool stands behind the service list even before
	// this process has seen one: its confirmation always waits (strict).
	listOK := len(cfg.Services) > 0 ||
		p.confirm(serviceListKey, len(items), r.at, confirmAge(cfg.Account, cfg.Jitter), true)
	p.mu.Unlock()
	if !listOK {
		// An empty service list, or one far smaller than the last, would
		// take every upstream away: wait for a regular poll to confirm it.
		p.log.Warn("service list shrank; keeping the served services until the next regular poll confirms it", "services", len(items))
		items = nil
		p.mu.Lock()
		for id := range p.services {
			items = append(items, ServiceItem{ServiceID: id, Status: "Active"})
		}
		p.mu.Unlock()
	}
	want := cfg.Services
	if len(want) == 0 {
		for _, s := range items {
			if servable(s.Status) {
				want = append(want, s.ServiceID)
			}
		}
	}
	records := map[int]Service{}
	var dropped []int
	var unitErr error
	for _, id := range want {
		rec, err := client.Service(ctx, id)
		p.beat(LoopAccount)
		if err != nil {
			unitErr = keepErr(unitErr, fmt.Errorf("polling service %d: %w", id, err))
			continue
		}
		if !servable(rec.Status) {
			dropped = append(dropped, id)
			continue
		}
		records[id] = *rec
	}
	credit, cerr := client.Credit(ctx)
	p.beat(LoopAccount)
	invoices, ierr := client.Invoices(ctx)
	p.beat(LoopAccount)

	p.mu.Lock()
	if p.gen != gen {
		p.mu.Unlock()
		return nil
	}
	p.snap.AccountKnown = p.snap.AccountKnown || listOK
	p.snap.Wanted = slices.Clone(want)
	if listOK {
		p.snap.Accounts = items
	}
	added := false
	for id, rec := range records {
		st := p.services[id]
		if st == nil {
			st = &ServiceState{ID: id, Lists: map[string][]Entry{}}
			p.services[id] = st
			added = true
		}
		st.Record = rec
		if rec.ProductType != "ppr" {
			// Its rate is not read: figures from when it was ppr (or a
			// restored state) must not keep a quota on it.
			st.Rate, st.Limit, st.HasUsage, st.UsageEmpty = 0, 0, false, true
		}
	}
	// A service that failed to load keeps its last state; one that is no
	// longer served (or no longer Active) leaves.
	for id := range p.services {
		if _, ok := records[id]; ok {
			continue
		}
		if slices.Contains(dropped, id) || !slices.Contains(want, id) {
			p.forgetService(id)
			if !slices.Contains(dropped, id) {
				dropped = append(dropped, id)
			}
		}
	}
	// The sizes of the services dropped go, and (a trusted list: one
	// withheld as shrunk keeps them) those seeded for services this round
	// does not serve.
	p.forgetSizes(listsOf(func(id int) bool {
		return slices.Contains(dropped, id) || listOK && !slices.Contains(want, id)
	}))
	p.snap.Dropped = dropped
	p.pruneClocks()
	if cerr == nil {
		p.snap.Credit, p.snap.CreditKnown = credit, true
	}
	if ierr == nil {
		p.snap.Invoices = invoices
		p.snap.UnpaidInvoices, p.snap.UnpaidUSD = unpaidTotal(invoices)
		p.snap.InvoicesKnown = true
	}
	p.mu.Unlock()
	if added && p.rounds[LoopAccount].Load() > 0 {
		// A service that joined later gets its lists and status now, not
		// after the other loops' intervals.
		for l := LoopAccount + 1; l < numLoops; l++ {
			p.Kick(l)
		}
	}
	p.changed()
	if cerr != nil {
		unitErr = keepErr(unitErr, fmt.Errorf("polling credit: %w", cerr))
	}
	if ierr != nil {
		unitErr = keepErr(unitErr, fmt.Errorf("polling invoices: %w", ierr))
	}
	return unitErr
}

// listTypes returns the IP list types of service id, of kind, that some
// listener draws (cfg.Draws), one list per protocol: fpr http from
// http-auth, fpr socks5 from socks-ip, ppr from ppr-http and ppr-socks.
func listTypes(cfg PollConfig, id int, kind string) []string {
	var types []string
	for _, proto := range []string{"http", "socks5"} {
		if cfg.Draws == nil || cfg.Draws(id, kind, proto) {
			types = append(types, listType(kind, proto))
		}
	}
	return types
}

// pollLists polls the lists of the services units; each one's clock is
// set by its own outcome.
func (p *Poller) pollLists(ctx context.Context, r roundStart, units []unit) error {
	var firstErr error
	fetched := 0
	gen := r.gen
	for _, u := range units {
		ok, soon, err := p.pollServiceLists(ctx, LoopLists, r.at, u.service)
		p.done(ctx, r, u, err, soon)
		if err != nil && firstErr == nil {
			firstErr = err
		}
		if ok {
			fetched++
		}
	}
	p.mu.Lock()
	if fetched > 0 && p.gen == gen {
		// Some lists came from this provider, even if others failed.
		p.snap.ListsFrom = p.client.BaseURL()
		if firstErr == nil {
			p.snap.ListsUpdated = p.now()
		}
	}
	p.mu.Unlock()
	p.changed()
	return firstErr
}

// pollServiceLists fetches the IP lists (and sticky sessions) of one
// service in a round begun at at and swaps in what is accepted; ok
// reports that it fetched something and every fetch succeeded (a service
// no listener draws asks for nothing: it refreshes no data), soon that a list was empty on its
// first answer, with nothing older, and is best confirmed soon
// (confirmWait). owner is the loop doing the work (the lists loop, or the
// status loop polling a list it had renewed): each answer beats its
// heartbeat, so that a slow API never makes it look stuck.
func (p *Poller) pollServiceLists(ctx context.Context, owner Loop, at time.Time, id int) (ok, soon bool, unitErr error) {
	client, cfg, gen := p.current()
	minAge := confirmAge(cfg.IPList, cfg.Jitter)
	p.mu.Lock()
	st := p.services[id]
	kind := ""
	var hosts []string // host names of the lists and sessions kept, and of those fetched
	var resolved map[string][]string
	if st != nil {
		kind = st.Record.ProductType
		hosts = hostNames(st.Sticky, st.Lists)
		resolved = st.Resolved // replaced by each round, never changed in place
	}
	p.mu.Unlock()
	if st == nil {
		return false, false, nil
	}
	lists := map[string][]Entry{}
	ok = true
	wanted := listTypes(cfg, id, kind)
	// Sessions become upstreams only through a drawn ppr list.
	wantSticky := kind == "ppr" && len(wanted) > 0
	for _, typ := range wanted {
		l, err := p.fetchList(ctx, owner, client, id, typ)
		p.beat(owner)
		if err != nil {
			ok = false
			unitErr = keepErr(unitErr, fmt.Errorf("polling %s list of service %d: %w", typ, id, err))
			continue
		}
		if l.Bad > 0 {
			p.log.Warn("IP list has lines that could not be read", "service", id, "type", typ, "bad", l.Bad)
		}
		lists[typ] = l.Entries
	}
	var sticky []StickySession
	stickyOK := true
	if wantSticky {
		sl, err := client.StickyList(ctx, id)
		p.beat(owner)
		switch {
		case errors.Is(err, ErrUnprocessable) || errors.Is(err, ErrListRefused):
			// The sticky list's own failure (PROVIDER_API: 422 with the
			// backend's message, such as sessions not set up for the
			// service; or that message beside an empty list in a 200):
			// no sessions to serve, as an empty list says (confirmed as
			// any shrink), and the service's list entries serve as plain
			// rotating upstreams meanwhile, rather than the service not
			// at all.
			p.log.Warn("sticky sessions refused; the service's list entries serve as rotating upstreams", "service", id, "err", err)
		case err != nil:
			stickyOK = false
			unitErr = keepErr(unitErr, fmt.Errorf("polling sticky sessions of service %d: %w", id, err))
		default:
			sticky = sl.Sessions
		}
	}
	resolved = p.resolveHosts(ctx, owner, cfg, append(hosts, hostNames(sticky, lists)...), resolved)
	p.mu.Lock()
	defer p.mu.Unlock()
	st = p.services[id]
	if st == nil || p.gen != gen {
		return false, false, nil
	}
	// withheld: a list awaits confirmation with a last good size behind it
	// (from this process or the daemon's saved state); firstEmpty: one
	// awaits it after an empty first answer, with nothing older to keep.
	withheld, firstEmpty, entries := false, false, false
	take := func(key, what string, n int) bool {
		last, seen := p.lastGood[key]
		// Not strict: only a last good size (this process's or Seed's)
		// stands behind a service's list.
		if p.confirm(key, n, at, minAge, false) {
			entries = entries || n > 0
			return true
		}
		if seen {
			withheld = true
			p.log.Warn(what+" shrank; keeping the last good one until the next regular poll confirms it",
				"service", id, "list", key, "entries", n, "last_good", last)
		} else {
			firstEmpty = true
			p.log.Info(what+" is empty on its first poll; the next poll confirms it", "service", id, "list", key)
		}
		return false
	}
	staleLists, staleSticky := at.Before(st.listsAt), at.Before(st.stickyAt)
	if staleLists || staleSticky {
		p.log.Debug("lists round answered after a newer one; keeping the newer", "service", id)
	}
	for typ, l := range lists {
		if !staleLists && take(sizeKey(id, typ), "IP list", len(l)) {
			st.Lists[typ] = l
		}
	}
	if !staleLists && len(lists) > 0 {
		st.listsAt = at
	}
	// A type no listener draws any more (a reload changed the listeners)
	// goes: its upstreams would serve no one, and its IPs would count in
	// the list-update share. Sessions likewise: unserved, an errored exit
	// IP would still have them rotated. Their last good size goes too:
	// nothing is kept that a smaller answer could be held back for, so
	// drawn again, the first answer is taken as any first one.
	var gone []string
	for typ := range listProtocol { // every type, also one seeded from the state file alone
		if !slices.Contains(wanted, typ) {
			delete(st.Lists, typ)
			gone = append(gone, sizeKey(id, typ))
		}
	}
	if !wantSticky {
		st.Sticky = nil
		gone = append(gone, sizeKey(id, stickyList))
	}
	if len(gone) > 0 {
		p.forgetSizes(func(key string) bool { return slices.Contains(gone, key) })
	}
	if stickyOK && wantSticky && !staleSticky {
		if take(sizeKey(id, stickyList), "sticky session list", len(sticky)) {
			st.Sticky = sticky
		}
		st.stickyAt = at
	}
	st.Resolved = resolved
	// Known once every list was fetched and swapped in: until then the
	// daemon keeps serving what it had for this service. A first empty
	// answer holds back only a service that has no entries elsewhere.
	if ok && stickyOK && !withheld && (!firstEmpty || entries) {
		st.ListsKnown = true
	}
	return ok && stickyOK && len(wanted) > 0, firstEmpty, unitErr
}

// listFormats is the order in which list formats are tried.
var listFormats = [...]string{"json", "txt", "csv"}

// fetchList fetches one IP list in the format that last parsed for its type
// (json at first). When the answer cannot be parsed, the next formats are
// tried in the same round, and the first that parses is kept for the type
// from then on (logged once, when it changes). Each answer beats loop
// owner.
func (p *Poller) fetchList(ctx context.Context, owner Loop, client *Client, id int, typ string) (*IPList, error) {
	p.mu.Lock()
	current := p.formats[typ]
	p.mu.Unlock()
	if current == "" {
		current = listFormats[0]
	}
	start := slices.Index(listFormats[:], current)
	var fetchErr error
	for i := range listFormats {
		format := listFormats[(start+i)%len(listFormats)]
		l, err := client.IPList(ctx, id, typ, format)
		if err == nil {
			if format != current {
				p.mu.Lock()
				p.formats[typ] = format
				p.mu.Unlock()
				p.log.Info("IP list format chosen: the previous one could not be parsed",
					"type", typ, "format", format, "instead_of", current)
			}
			return l, nil
		}
		fetchErr = keepErr(fetchErr, err)
		var de *DecodeError
		if !errors.As(err, &de) {
			break // not a parsing problem: another format will not help
		}
		p.beat(owner)
	}
	return nil, fetchErr
}

// serviceListKey is the confirm key of the account's service list; a
// service's lists have sizeKey's.
const serviceListKey = "services"

// stickyList stands for a service's sticky session list in sizeKey.
const stickyList = "sticky"

// sizeKey is the confirm key of service id's list: an IP list type or
// stickyList.
func sizeKey(id int, list string) string { return strconv.Itoa(id) + "/" + list }

// pendingList is a small list awaiting confirmation: its size, and when
// the round that brought it began.
type pendingList struct {
	n  int
	at time.Time
}

// confirm decides whether a fetched list of n entries, from a round begun
// at at, replaces the last good one. An empty list, or one less than half
// the last good one, is swapped in only when a later poll says the same
// again: empty again, or again less than half (its own size then, which
// may have moved meanwhile, as a sticky session list's does): a passing
// [] must not empty the pool, and the provider answers [] for what it
// holds inactive (an empty first answer is confirmed too). When a last good size stands behind the list (this
// process's, or the saved state's through Seed), and always when strict
// (the caller knows something stands behind it that confirm cannot see),
// the confirming round must begin at least minAge (confirmAge) after the
// one that brought the size: a glitch of seconds, re-polled by a Kick, a
// backoff retry or another list's early poll, is not confirmed by
// itself. Otherwise a first empty list has nothing older to lose, and any
// later poll confirms it. After a provider change each key's first list
// is swapped in at once. Called with p.mu held.
func (p *Poller) confirm(key string, n int, at time.Time, minAge time.Duration, strict bool) bool {
	last, seen := p.lastGood[key]
	suspicious := n == 0 && (!seen || last > 0) || seen && n*2 < last
	if p.trusted != nil && !p.trusted[key] {
		p.trusted[key] = true
		suspicious = false
	}
	prev, pending := p.pending[key]
	switch {
	case !suspicious:
	case !pending || (prev.n == 0) != (n == 0):
		// The first such answer, or an empty one after a small one (or
		// the reverse): it waits from now.
		p.pending[key] = pendingList{n: n, at: at}
		return false
	case (seen || strict) && at.Before(prev.at.Add(minAge)):
		// Far smaller (or empty) again, but too soon to confirm it; a
		// size that changes meanwhile, as a sticky session list's does
		// with the sessions' TTLs, is kept as the latest.
		p.pending[key] = pendingList{n: n, at: prev.at}
		return false
	}
	p.lastGood[key] = n
	delete(p.pending, key)
	return true
}

// pollStatus reads the network-status lists units; each one's clock is
// set by its own outcome, and each list is applied when its own fetch
// succeeded (the other keeps its last good value).
func (p *Poller) pollStatus(ctx context.Context, r roundStart, units []unit) error {
	client, _, gen := p.current()
	var firstErr error
	for _, u := range units {
		id := u.service
		fetch, what := client.NetworkErrors, "network errors"
		if u.part == statusInactive {
			fetch, what = client.NetworkInactive, "inactive servers"
		}
		ips, err := fetch(ctx, id)
		p.beat(LoopStatus)
		if err != nil {
			err = fmt.Errorf("polling %s of service %d: %w", what, id, err)
		}
		p.done(ctx, r, u, err, false)
		if err != nil {
			if firstErr == nil {
				firstErr = err
			}
			continue
		}
		p.mu.Lock()
		if st := p.services[id]; st != nil && p.gen == gen {
			if u.part == statusInactive {
				st.Inactive, st.InactiveKnown = ips, true
			} else {
				st.Errored, st.ErroredKnown = ips, true
			}
		}
		p.mu.Unlock()
	}
	if len(units) > 0 {
		p.changed()
	}
	p.manageLists(ctx)
	return firstErr
}

// pollUsage reads the rate and limit of ppr services ids; each one's
// clock is set by its own outcome. The daily statistics endpoint is not
// polled: nothing uses its answer.
func (p *Poller) pollUsage(ctx context.Context, r roundStart, units []unit) error {
	client, _, gen := p.current()
	var firstErr error
	for _, u := range units {
		id := u.service
		rate, err := client.Rate(ctx, id)
		p.beat(LoopUsage)
		if err != nil {
			err = fmt.Errorf("polling rate of service %d: %w", id, err)
		}
		p.done(ctx, r, u, err, false)
		if err != nil {
			if firstErr == nil {
				firstErr = err
			}
			continue
		}
		p.mu.Lock()
		// Not ppr any more (an account round said so while this one
		// waited): no figures, as that round left it.
		if st := p.services[id]; st != nil && p.gen == gen && st.Record.ProductType == "ppr" {
			if len(rate) == 0 {
				st.Rate, st.Limit, st.HasUsage, st.UsageEmpty = 0, 0, false, true
			} else {
				st.Rate, st.Limit, st.HasUsage, st.UsageEmpty = rate[0].Rate, rate[0].Limit, true, false
			}
		}
		p.mu.Unlock()
	}
	if len(units) > 0 {
		p.changed()
	}
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
		for i := range c.Sticky {
			c.Sticky[i].Ports = maps.Clone(c.Sticky[i].Ports)
			c.Sticky[i].Extra = maps.Clone(c.Sticky[i].Extra)
		}
		c.Errored = slices.Clone(st.Errored)
		c.Inactive = slices.Clone(st.Inactive)
		if st.Resolved != nil {
			c.Resolved = make(map[string][]string, len(st.Resolved))
			for k, v := range st.Resolved {
				c.Resolved[k] = slices.Clone(v)
			}
		}
		s.Services = append(s.Services, c)
	}
	slices.SortFunc(s.Services, func(a, b ServiceState) int { return a.ID - b.ID })
	return s
}

func (p *Poller) changed() { p.onChange(p.Snapshot()) }

// Rotate asks the provider for a new exit IP of a sticky session; it
// implements the pool's Rotator. It finishes against the client current
// when it started, even if a reload changes it meanwhile.
func (p *Poller) Rotate(ctx context.Context, service int, server, session string) (string, error) {
	client, _, _ := p.current()
	res, err := client.StickyRotate(ctx, service, server, session)
	if err != nil {
		return "", fmt.Errorf("rotating session %s on %s of service %d: %w", session, server, service, err)
	}
	// An answer that names no exit IP still says the old one is gone: the
	// session is left without one until the next lists round brings it, or
	// every snapshot until then would hand the pool the old, errored IP
	// back, which asks for the same rotation again.
	p.mu.Lock()
	if st := p.services[service]; st != nil {
		for i := range st.Sticky {
			if st.Sticky[i].Server == server && st.Sticky[i].Session == session {
				st.Sticky[i].ExitIP = res.ExitIP
				// A sticky list asked for before says the old exit IP.
				// (Only of a session known from a list: sessions served
				// from the state file alone wait for their first list.)
				st.stickyAt = p.now()
			}
		}
	}
	p.mu.Unlock()
	return res.ExitIP, nil
}
