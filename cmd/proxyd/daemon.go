package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/proxyd/proxyd/agent"
	"github.com/proxyd/proxyd/forward"
	"github.com/proxyd/proxyd/metrics"
	"github.com/proxyd/proxyd/pool"
)

// daemon is `proxyd run`: the agent's poll loops feeding the pool, the
// listeners drawing from it, the admin server, state and systemd. Run and
// Close are what end-to-end tests drive.
type daemon struct {
	log     *slog.Logger
	logs    *logControl // level and format, set on reload; nil: fixed
	getenv  func(string) string
	notify  *notifier
	reg     *prometheus.Registry
	metrics *metrics.Metrics
	client  *agent.Client // the API client of the running [api]; replaced by a reload
	api     agent.Config  // its [api], with the credential resolved
	credSrc string        // where its credential came from (agent's source names)
	poller  *agent.Poller
	pool    *pool.Pool
	prober  *tcpProber     // the pool's active probe, dialing from the listeners' source addresses
	events  *pool.EventLog // GET /events: what happened to upstreams, services, listeners and reloads

	reloadMu  sync.Mutex          // serializes reloads: what prepare read stays current until the commit
	applyMu   sync.Mutex          // serializes apply
	status    map[int]savedStatus // provider status by service, as last known (guarded by applyMu)
	lastSaved string              // stateKey of the state file's content, "" when unknown: the next save writes (guarded by applyMu)
	fetched   time.Time           // the last successful lists refresh of the pool served, saved with it (guarded by applyMu)
	fetchedAt string              // the base URL of that refresh (guarded by applyMu)
	draining  atomic.Bool         // SIGTERM: the accept loops are closing on purpose
	mu        sync.Mutex
	cfg       config
	listeners map[string]*runningListener
	admin     *adminServer
	running   bool // listeners bound and not yet stopping; Reload needs it

	ready   chan struct{} // closed once every listener accepts
	stop    chan struct{} // closed by Close
	stopped chan struct{} // closed when Run returned
	once    sync.Once
	wg      sync.WaitGroup

	// Incarnations a reload retired keep their connections until those end
	// or proxyd's own drain does (retiring ends); retired counts them, and
	// winding lists them while they run (guarded by mu): their names stay
	// in the pool (setPoolListeners).
	retiring    context.Context
	endRetiring context.CancelFunc
	retired     sync.WaitGroup
	winding     []*runningListener

	// A reload that lowered [api] timeout: until slowUntil, requests of the
	// old client may still take slowTimeout (guarded by mu).
	slowTimeout time.Duration
	slowUntil   time.Time
}

// runningListener is one served listener and its accept loop.
type runningListener struct {
	cfg  listenerConfig
	l    *forward.Listener
	acc  *acceptor     // the bound socket; may pass to the next incarnation
	done chan struct{} // closed when Serve returned
}

type daemonOptions struct {
	getenv func(string) string
	logger *slog.Logger
	logs   *logControl // the logger's level and format, set on reload; may be nil
}

func newDaemon(cfg config, opts daemonOptions) (*daemon, error) {
	if opts.getenv == nil {
		opts.getenv = os.Getenv
	}
	if err := cfg.readPasswordFiles(); err != nil {
		return nil, err
	}
	logger := opts.logger
	if logger == nil {
		logger, opts.logs = newLogger(cfg.Log, os.Stderr)
	}
	d := &daemon{
		events:    pool.NewEventLog(pool.DefaultEventLogSize, logger, nil),
		prober:    &tcpProber{},
		log:       logger,
		logs:      opts.logs,
		getenv:    opts.getenv,
		notify:    newNotifier(opts.getenv),
		reg:       prometheus.NewRegistry(),
		cfg:       cfg,
		listeners: map[string]*runningListener{},
		status:    map[int]savedStatus{},
		ready:     make(chan struct{}),
		stop:      make(chan struct{}),
		stopped:   make(chan struct{}),
	}
	d.retiring, d.endRetiring = context.WithCancel(context.Background())
	var err error
	d.metrics, err = metrics.New(d.reg, metrics.Options{
		Version:   version,
		Listeners: listenerNames(cfg.Listener),
		Services:  cfg.API.Services,
	})
	if err != nil {
		return nil, fmt.Errorf("registering metrics: %w", err)
	}
	d.client, d.api, d.credSrc, err = d.newClient(cfg.API)
	if err != nil {
		return nil, err
	}
	logger.Debug("API credential", "source", d.credSrc)

	d.pool, err = pool.New(cfg.Pool, pool.Options{
		Logger: logger,
		Events: d.events,
		Prober: d.prober,
		Hooks: pool.Hooks{
			Failure: func(service int, r pool.Result) { d.metrics.UpstreamFailure(service, r.String()) },
			Ejected: d.metrics.Ejection,
			Rotated: d.metrics.Rotation,
		},
		Rotator: rotatorFunc(func(ctx context.Context, service int, server, session string) (string, error) {
			return d.poller.Rotate(ctx, service, server, session)
		}),
	})
	if err != nil {
		return nil, fmt.Errorf("configuring the pool: %w", err)
	}
	d.pool.SetListeners(listenerSlices(cfg.Listener))
	d.prober.setListeners(cfg.Listener)
	d.metrics.SetPoolSource(d.pool.Explain)

	d.poller, err = agent.NewPoller(d.client, d.pollConfig(cfg), d.apply, logger)
	if err != nil {
		return nil, fmt.Errorf("configuring the poll loops: %w", err)
	}
	return d, nil
}

// newClient is the API client of an [api] section, with the credential
// resolved now (token_file and password_file are read again each time).
func (d *daemon) newClient(api agent.Config) (*agent.Client, agent.Config, string, error) {
	c, source, err := api.ResolveCredential(d.getenv)
	if err != nil {
		return nil, c, "", sectionProblems("api", err)
	}
	c.Version = version
	c.Observe = d.metrics.APIRequest
	c.Logger = d.log
	client, err := agent.New(c)
	if err != nil {
		return nil, c, "", fmt.Errorf("configuring the API client: %w", err)
	}
	return client, c, source, nil
}

// agentEvent records what the agent did on the account by itself (list
// updates) in the event log and proxyd_list_updates_total.
func (d *daemon) agentEvent(e agent.Event) {
	d.events.Record(pool.Event{Kind: pool.EventKind(e.Kind), Service: e.Service, Reason: cmp.Or(e.Reason, e.Result)})
	if e.Result != "" {
		d.metrics.ListUpdate(e.Service, e.Result)
	}
}

// pollConfig is the poll loops' configuration with the daemon's callbacks.
func (d *daemon) pollConfig(c config) agent.PollConfig {
	pc := pollConfig(c)
	pc.Manage = c.Manage
	pc.OnEvent = d.agentEvent
	pc.Draws = draws(listenerSlices(c.Listener))
	return pc
}

type rotatorFunc func(ctx context.Context, service int, server, session string) (string, error)

func (f rotatorFunc) Rotate(ctx context.Context, service int, server, session string) (string, error) {
	return f(ctx, service, server, session)
}

// Run serves until ctx ends, then drains and stops. A listener or admin
// address that cannot be bound fails Run at once.
func (d *daemon) Run(ctx context.Context) error {
	defer close(d.stopped)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-d.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	d.loadState()

	d.mu.Lock()
	cfg := d.cfg
	for _, lc := range cfg.Listener {
		if err := d.startListener(lc, nil, nil); err != nil {
			d.mu.Unlock()
			d.closeListeners()
			return err
		}
	}
	admin, err := bindAdmin(cfg.Admin, d)
	if err != nil {
		d.mu.Unlock()
		d.closeListeners()
		return err
	}
	admin.serve(d.log)
	d.admin = admin
	d.running = true
	d.mu.Unlock()

	bg, stopBG := context.WithCancel(context.Background())
	d.wg.Add(3)
	go func() { defer d.wg.Done(); d.poller.Run(bg) }()
	go func() { defer d.wg.Done(); d.pool.Run(bg) }()
	go func() { defer d.wg.Done(); d.watchdog(bg) }()

	close(d.ready)
	d.notified(d.notify.ready())
	d.log.Info("proxyd serving", "listeners", len(cfg.Listener), "admin", d.adminAddr(), "upstreams", len(d.pool.Upstreams()))

	<-ctx.Done()
	d.draining.Store(true)
	d.mu.Lock()
	timeout := d.cfg.Shutdown.DrainTimeout // a reload may have changed it
	d.mu.Unlock()
	d.notified(d.notify.stopping(timeout + stopMargin))
	d.log.Info("stopping: draining connections", "timeout", timeout)
	drain, cancel := context.WithTimeout(context.Background(), timeout)
	d.shutdownListeners(drain)
	cancel()
	stopBG()
	d.wg.Wait()
	d.mu.Lock()
	admin = d.admin // a reload may have moved it
	d.mu.Unlock()
	admin.close()
	d.log.Info("stopped")
	return nil
}

// stopMargin is what a stop may take beyond drain_timeout: closing the
// connections left, cancelling the poll loops' API calls and closing the
// admin server, none of which waits on a peer.
const stopMargin = 10 * time.Second

// Close stops a running daemon as SIGTERM does and waits for Run to return.
func (d *daemon) Close() error {
	d.once.Do(func() { close(d.stop) })
	<-d.stopped
	return nil
}

// listenerAddr is the bound address of a listener ("" if not running).
func (d *daemon) listenerAddr(name string) string {
	d.mu.Lock()
	defer d.mu.Unlock()
	if rl, ok := d.listeners[name]; ok {
		return rl.acc.ln.Addr().String()
	}
	return ""
}

// adminAddr is the bound admin address ("" if off).
func (d *daemon) adminAddr() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.admin == nil || d.admin.ln == nil {
		return ""
	}
	return d.admin.ln.Addr().String()
}

// startListener serves one listener on acc, or on a fresh socket bound to
// its address when acc is nil; prev, if not nil, is the incarnation of the
// same name a reload retires (its open connections count against the new
// one's max_connections); d.mu is held.
func (d *daemon) startListener(lc listenerConfig, acc *acceptor, prev *runningListener) error {
	l, err := forward.NewListener(lc.served(), d.pool, d.metrics.Listener(lc.Name), d.log) // forward adds "listener"
	if err != nil {
		return fmt.Errorf("listener %s: %w", lc.Name, err)
	}
	if prev != nil {
		l.Succeed(prev.l)
	}
	if acc == nil {
		ln, err := forward.Listen(context.Background(), lc.Address)
		if err != nil {
			return fmt.Errorf("%s: %w", listenerKey(d.cfg.Listener, lc.Name, "address"), err)
		}
		acc = newAcceptor(ln, d.log.With("listener", lc.Name))
	}
	rl := &runningListener{cfg: lc, l: l, acc: acc, done: make(chan struct{})}
	d.listeners[lc.Name] = rl
	hl := acc.attach()
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		defer close(rl.done)
		// Serve ends when its handoff listener closes: a reload handed the
		// socket on, or proxyd is stopping; the acceptor logs a socket that
		// failed on its own.
		if err := l.Serve(hl); err != nil && !errors.Is(err, net.ErrClosed) {
			d.log.Error("listener stopped", "listener", lc.Name, "err", err)
		}
	}()
	return nil
}

// shutdownListeners stops every accept at once, then lets the open
// connections finish until ctx ends, those of incarnations a reload retired
// included.
func (d *daemon) shutdownListeners(ctx context.Context) {
	d.mu.Lock()
	d.running = false
	ls := make([]*runningListener, 0, len(d.listeners))
	for _, rl := range d.listeners {
		ls = append(ls, rl)
	}
	d.mu.Unlock()
	for _, rl := range ls {
		rl.acc.close()
	}
	var wg sync.WaitGroup
	for _, rl := range ls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := rl.l.Shutdown(ctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
				d.log.Warn("listener shutdown", "listener", rl.cfg.Name, "err", err)
			}
			rl.l.Close()
		}()
	}
	wg.Wait()
	stop := context.AfterFunc(ctx, d.endRetiring)
	d.retired.Wait()
	stop()
}

func (d *daemon) closeListeners() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for name, rl := range d.listeners {
		rl.acc.close()
		rl.l.Close()
		delete(d.listeners, name)
	}
}

// watchdog pings systemd at half of WATCHDOG_USEC while the accept loops and
// the poll loops are alive, and through a drain after SIGTERM, which closes
// the accept loops on purpose and has its own bound (drain_timeout).
func (d *daemon) watchdog(ctx context.Context) {
	every := watchdogInterval(d.getenv)
	if every <= 0 || !d.notify.enabled() {
		return
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if alive, why := d.alive(d.heartbeatAge(time.Now())); alive || d.draining.Load() {
			d.notified(d.notify.watchdog())
		} else {
			d.log.Error("not pinging the systemd watchdog", "reason", why)
		}
	}
}

// heartbeatAge is how long a poll loop may go without a beat before the
// watchdog takes it for stuck: one API request's bound and 10 s. A reload
// may change the bound; a lower one applies once the old client's
// requests, which keep its bound, may all have ended: those in flight
// (slowUntil), and those the rounds begun before the reload still make
// with it (OlderRounds).
func (d *daemon) heartbeatAge(now time.Time) time.Duration {
	older := d.poller.OlderRounds()
	d.mu.Lock()
	defer d.mu.Unlock()
	return max(d.cfg.API.Timeout, d.oldTimeout(now, older)) + 10*time.Second
}

// oldTimeout is the timeout that requests of a client a reload replaced
// may still run with: slowTimeout while they may (in flight until
// slowUntil, or made by rounds begun before the reload: older), else 0.
// d.mu is held.
func (d *daemon) oldTimeout(now time.Time, older bool) time.Duration {
	if now.Before(d.slowUntil) || older {
		return d.slowTimeout
	}
	return 0
}

// notified logs a message systemd did not take; the daemon goes on.
func (d *daemon) notified(err error) {
	if err != nil {
		d.log.Warn("systemd notify failed", "err", err)
	}
}

// stoppedListener names a listener whose accept loop has ended.
func (d *daemon) stoppedListener() (string, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for name, rl := range d.listeners {
		select {
		case <-rl.done:
			return name, true
		default:
		}
	}
	return "", false
}

func (d *daemon) alive(maxAge time.Duration) (bool, string) {
	if name, stopped := d.stoppedListener(); stopped {
		return false, "listener " + name + " stopped accepting"
	}
	if !d.poller.Alive(maxAge) {
		return false, "a poll loop is stuck"
	}
	return true, ""
}

// apply turns an agent snapshot into pool updates (the upstreams each
// service's lists and sticky sessions give, the sessions none stands for,
// which the pool still rotates, provider status, usage) and
// saves the state. Services whose lists are not known yet keep the upstreams the
// pool has (from the state file), so a partial first poll never empties it.
//
// The poll loops call it concurrently; applying one at a time, and always
// the poller's latest snapshot, keeps an older view from landing last.
func (d *daemon) apply(agent.Snapshot) {
	d.applyMu.Lock()
	defer d.applyMu.Unlock()
	s := d.poller.Snapshot()
	prev := d.pool.Upstreams()
	known := map[int]bool{}
	var next []pool.Upstream
	var unserved []pool.UnservedSession
	for i := range s.Services {
		st := &s.Services[i]
		if !st.ListsKnown {
			continue
		}
		known[st.ID] = true
		for _, u := range st.Upstreams() {
			next = append(next, poolUpstream(u))
		}
		for _, ss := range st.UnservedSessions() {
			unserved = append(unserved, pool.UnservedSession{Service: st.ID, Server: ss.Server, Session: ss.Session, ExitIP: ss.ExitIP})
		}
	}
	dropped := map[int]bool{}
	for _, id := range s.Dropped {
		dropped[id] = true
	}
	wanted := map[int]bool{}
	for _, id := range s.Wanted {
		wanted[id] = true
	}
	// Upstreams of a service whose lists are not known yet stay (a failed
	// first poll must not empty the pool); those of a service that is no
	// longer meant to be served leave: one the account no longer has
	// active, or one [api] services no longer names (restored from the
	// state file before a reload narrowed it, the API silent).
	d.mu.Lock()
	pc := pollConfig(d.cfg)
	d.mu.Unlock()
	for _, u := range prev {
		if known[u.Service] || dropped[u.Service] {
			continue
		}
		if s.AccountKnown && !wanted[u.Service] || !pc.Serves(u.Service) {
			dropped[u.Service] = true
			continue
		}
		next = append(next, u)
	}
	if len(known) > 0 || len(dropped) > 0 {
		d.pool.Update(next, unserved...)
		d.metrics.PoolUpdated(time.Now())
		d.logPoolChange(prev, next)
	}
	// Provider status and quota from the state file stay until the API
	// speaks for the service again.
	for id := range dropped {
		delete(d.status, id)
		d.pool.SetUsage(id, 0, 0)
		d.metrics.ForgetUsage(id) // restored ones are in no metrics service set
	}
	account := metrics.Account{
		Credit: s.Credit, CreditKnown: s.CreditKnown,
		UnpaidInvoices: s.UnpaidInvoices, UnpaidUSD: s.UnpaidUSD, InvoicesKnown: s.InvoicesKnown,
	}
	for _, st := range s.Services {
		if st.ErroredKnown || st.InactiveKnown {
			// Each list as soon as it is known (one endpoint failing must
			// not hold back the other); the other as last known.
			saved := d.status[st.ID]
			if st.ErroredKnown {
				saved.Errored = st.Errored
			}
			if st.InactiveKnown {
				saved.Inactive = st.Inactive
			}
			d.pool.SetProviderStatus(st.ID, saved.Errored, saved.Inactive)
			d.status[st.ID] = saved
		}
		switch {
		case st.HasUsage:
			d.pool.SetUsage(st.ID, st.Rate, st.Limit) // the pool weighs it against quota_headroom
			d.metrics.SetUsage(st.ID, st.Rate, st.Limit)
		case st.UsageEmpty:
			// No figures any more: no quota to weigh, no gauge to show.
			// (Not read yet, the usage restored from the state file stays.)
			d.pool.SetUsage(st.ID, 0, 0)
			d.metrics.ForgetUsage(st.ID)
		}
		account.Services = append(account.Services, metrics.ServiceInfo{
			ID: st.ID, Product: st.Record.ProductName, Kind: st.Record.ProductType,
			Status: st.Record.Status, Due: st.Record.NextDueDate.Time,
		})
	}
	// The account's other services too (proxyd_service_info is about each
	// service of the account): a suspended one shows its status instead of
	// leaving the series. Their kind is not in the account's list.
	for _, it := range s.Unserved() {
		account.Services = append(account.Services, metrics.ServiceInfo{
			ID: it.ServiceID, Product: it.ProductName, Status: it.Status, Due: it.NextDueDate.Time,
		})
	}
	if s.AccountKnown {
		d.metrics.SetAccount(account)
		ids := make([]int, 0, len(s.Services))
		for _, st := range s.Services {
			ids = append(ids, st.ID)
		}
		d.metrics.SetServices(ids)
	}
	// The state's age is that of the data served: the saved file's until
	// the lists are fetched, then the last successful refresh, which makes
	// it fresh even when nothing changed. The file keeps it, so that a
	// restart during an outage tells the same age.
	if !s.ListsUpdated.IsZero() {
		d.fetched = s.ListsUpdated
	}
	if s.ListsFrom != "" {
		d.fetchedAt = s.ListsFrom // also after a round in which some service failed
	}
	d.saveState()
	if !d.fetched.IsZero() {
		d.metrics.SetStateTime(d.fetched)
	}
}

// logPoolChange logs a summary line when the upstream set changed.
func (d *daemon) logPoolChange(prev, next []pool.Upstream) {
	before := make(map[string]bool, len(prev))
	for i := range prev {
		before[prev[i].ID()] = true
	}
	added, kept := 0, 0
	for i := range next {
		if before[next[i].ID()] {
			kept++
		} else {
			added++
		}
	}
	if removed := len(prev) - kept; added > 0 || removed > 0 {
		d.log.Info("pool updated", "upstreams", len(next), "added", added, "removed", removed)
	}
}

// saveState writes the pool and the provider's last word to the state file
// when they changed; d.applyMu is held.
func (d *daemon) saveState() {
	ups := d.pool.Upstreams()
	st := &savedState{Version: stateVersion, BaseURL: d.fetchedAt, Fetched: d.fetched, Status: d.status, Usage: d.pool.Usage()}
	for _, u := range ups {
		st.Upstreams = append(st.Upstreams, savedUpstream{
			Service: u.Service, Kind: string(u.Kind), Protocol: string(u.Protocol), Address: u.Address,
			Username: u.Username, Password: u.Password, Server: u.Server, Session: u.Session, ExitIP: u.ExitIP,
			Match: u.Match, StatusIP: u.StatusIP,
		})
	}
	slices.SortFunc(st.Upstreams, func(a, b savedUpstream) int {
		return cmp.Or(cmp.Compare(a.Service, b.Service), cmp.Compare(a.Address, b.Address),
			cmp.Compare(a.Protocol, b.Protocol), cmp.Compare(a.Session, b.Session))
	})
	key := stateKey(st)
	if key == d.lastSaved {
		return
	}
	st.Saved = time.Now().UTC()
	if err := writeState(d.stateDir(), st); err != nil {
		d.log.Warn("saving pool state", "err", err)
		d.lastSaved = "" // what the file holds is unknown: the next save writes, changed pool or not
		return
	}
	d.lastSaved = key
}

// stateDir is the running [state] dir; a reload may change it.
func (d *daemon) stateDir() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.cfg.State.Dir
}

// stateKey is a state's content without its time: what decides whether a
// save is needed.
func stateKey(st *savedState) string {
	c := *st
	c.Saved = time.Time{}
	return fmt.Sprintf("%v", c)
}

// loadState serves the last known pool until the API answers.
func (d *daemon) loadState() {
	st, err := readState(d.stateDir())
	if err != nil {
		d.log.Warn("ignoring saved pool state", "err", err)
		return
	}
	if st == nil {
		d.log.Info("no saved pool state; waiting for the provider API", "dir", d.stateDir())
		return
	}
	d.mu.Lock()
	cfg, baseURL := d.cfg, d.client.BaseURL()
	d.mu.Unlock()
	if st.BaseURL != "" && agent.ProviderURL(st.BaseURL) != baseURL {
		// Another provider's upstreams, with its credentials: the new
		// provider's lists replace them, so they must not stand in for
		// them meanwhile (a reload that changes the provider swaps the
		// pool for the same reason).
		d.log.Warn("ignoring saved pool state of another provider; waiting for the provider API",
			"saved_base_url", st.BaseURL, "base_url", baseURL)
		return
	}
	// Only what the config serves and its listeners draw: a service left
	// out of [api] services, or a kind or protocol no listener takes,
	// since the file was saved is not served from it (nor its sessions
	// rotated, nor its sizes kept for the shrink confirmation).
	pc, drawn := pollConfig(cfg), draws(listenerSlices(cfg.Listener))
	st.Upstreams = slices.DeleteFunc(st.Upstreams, func(u savedUpstream) bool {
		return !pc.Serves(u.Service) || !drawn(u.Service, u.Kind, u.Protocol)
	})
	maps.DeleteFunc(st.Status, func(id int, _ savedStatus) bool { return !pc.Serves(id) })
	maps.DeleteFunc(st.Usage, func(id int, _ pool.ServiceUsage) bool { return !pc.Serves(id) })
	specs := make([]agent.UpstreamSpec, 0, len(st.Upstreams))
	ups := make([]pool.Upstream, 0, len(st.Upstreams))
	for _, u := range st.Upstreams {
		specs = append(specs, agent.UpstreamSpec(u))
		ups = append(ups, poolUpstream(agent.UpstreamSpec(u)))
	}
	d.pool.Update(ups)
	for id, s := range st.Status {
		d.pool.SetProviderStatus(id, s.Errored, s.Inactive)
		d.status[id] = s
	}
	for id, u := range st.Usage {
		d.pool.SetUsage(id, u.Rate, u.Limit)
		d.metrics.SetUsage(id, u.Rate, u.Limit)
	}
	d.lastSaved = stateKey(st)
	d.poller.Seed(specs)
	d.fetched = cmp.Or(st.Fetched, st.Saved) // a file from before "fetched" was kept
	d.fetchedAt = st.BaseURL
	d.metrics.SetStateTime(d.fetched)
	d.metrics.PoolUpdated(st.Saved)
	d.log.Info("serving the saved pool until the provider API answers", "upstreams", len(ups), "saved", st.Saved.Format(time.RFC3339))
}

func listenerNames(ls []listenerConfig) []string {
	names := make([]string, len(ls))
	for i, l := range ls {
		names[i] = l.Name
	}
	return names
}
