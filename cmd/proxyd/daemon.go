package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"reflect"
	"slices"
	"strings"
	"sync"
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
	level   *slog.LevelVar
	getenv  func(string) string
	notify  *notifier
	reg     *prometheus.Registry
	metrics *metrics.Metrics
	client  *agent.Client
	poller  *agent.Poller
	pool    *pool.Pool
	events  *pool.EventLog // GET /events: what happened to upstreams, services, listeners and reloads

	applyMu   sync.Mutex          // serializes apply
	status    map[int]savedStatus // provider status by service, as last known (guarded by applyMu)
	quota     map[int]bool        // quota by service, as last known (guarded by applyMu)
	lastSaved string              // stateKey of the state file's content (guarded by applyMu)
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
	level  *slog.LevelVar // the logger's level, set on reload; may be nil
}

func newDaemon(cfg config, opts daemonOptions) (*daemon, error) {
	if opts.getenv == nil {
		opts.getenv = os.Getenv
	}
	logger := opts.logger
	if logger == nil {
		logger, opts.level = newLogger(cfg.Log, os.Stderr)
	}
	d := &daemon{
		events:    pool.NewEventLog(pool.DefaultEventLogSize, logger, nil),
		log:       logger,
		level:     opts.level,
		getenv:    opts.getenv,
		notify:    newNotifier(opts.getenv),
		reg:       prometheus.NewRegistry(),
		cfg:       cfg,
		listeners: map[string]*runningListener{},
		status:    map[int]savedStatus{},
		quota:     map[int]bool{},
		ready:     make(chan struct{}),
		stop:      make(chan struct{}),
		stopped:   make(chan struct{}),
	}
	var err error
	d.metrics, err = metrics.New(d.reg, metrics.Options{
		Version:   version,
		Listeners: listenerNames(cfg.Listener),
		Services:  cfg.API.Services,
	})
	if err != nil {
		return nil, fmt.Errorf("registering metrics: %w", err)
	}
	token, login, password, source, err := cfg.API.credential(opts.getenv)
	if err != nil {
		return nil, err
	}
	d.client, err = agent.New(agent.Config{
		BaseURL:  cfg.API.BaseURL,
		Token:    token,
		Login:    login,
		Password: password,
		Timeout:  cfg.API.Timeout.D(),
		Version:  version,
		Observe:  d.metrics.APIRequest,
		Logger:   logger,
	})
	if err != nil {
		return nil, fmt.Errorf("configuring the API client: %w", err)
	}
	logger.Debug("API credential", "source", source)

	d.pool, err = pool.New(poolConfig(cfg.Pool), pool.Options{
		Logger: logger,
		Prober: tcpProber{},
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
	d.metrics.SetPoolSource(d.pool.Explain)

	d.poller, err = agent.NewPoller(d.client, pollConfig(cfg), d.apply, logger)
	if err != nil {
		return nil, fmt.Errorf("configuring the poll loops: %w", err)
	}
	return d, nil
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
		if err := d.startListener(lc, nil); err != nil {
			d.mu.Unlock()
			d.closeListeners()
			return err
		}
	}
	admin, err := startAdmin(cfg.Admin, d)
	if err != nil {
		d.mu.Unlock()
		d.closeListeners()
		return err
	}
	d.admin = admin
	d.running = true
	d.mu.Unlock()

	bg, stopBG := context.WithCancel(context.Background())
	d.wg.Add(3)
	go func() { defer d.wg.Done(); d.poller.Run(bg) }()
	go func() { defer d.wg.Done(); d.pool.Run(bg) }()
	go func() { defer d.wg.Done(); d.watchdog(bg) }()

	close(d.ready)
	if err := d.notify.ready(); err != nil {
		d.log.Warn("systemd notify failed", "err", err)
	}
	d.log.Info("proxyd serving", "listeners", len(cfg.Listener), "admin", cfg.Admin.Address, "upstreams", len(d.pool.Upstreams()))

	<-ctx.Done()
	d.notify.stopping()
	d.mu.Lock()
	timeout := d.cfg.Shutdown.DrainTimeout.D() // a reload may have changed it
	d.mu.Unlock()
	d.log.Info("stopping: draining connections", "timeout", timeout)
	drain, cancel := context.WithTimeout(context.Background(), timeout)
	d.shutdownListeners(drain)
	cancel()
	stopBG()
	d.wg.Wait()
	d.admin.close()
	d.log.Info("stopped")
	return nil
}

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
// its address when acc is nil; d.mu is held.
func (d *daemon) startListener(lc listenerConfig, acc *acceptor) error {
	fc, err := forwardConfig(lc)
	if err != nil {
		return err
	}
	l, err := forward.NewListener(fc, d.pool, d.metrics.Listener(lc.Name), d.log.With("listener", lc.Name))
	if err != nil {
		return fmt.Errorf("listener %s: %w", lc.Name, err)
	}
	if acc == nil {
		ln, err := forward.Listen(context.Background(), lc.Address)
		if err != nil {
			return fmt.Errorf("listener %s: %w", lc.Name, err)
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
// connections finish until ctx ends.
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

// Reload swaps in a new config: listeners added, removed or changed without
// touching the ones that stay the same. On error the old config stays.
func (d *daemon) Reload(next config) error {
	return d.reload(func() (config, error) { return next, nil })
}

// ReloadFile is SIGHUP: Reload of the config file at path. A file that
// cannot be read or parsed is refused like an invalid config.
func (d *daemon) ReloadFile(path string) error {
	return d.reload(func() (config, error) { return loadConfig(path) })
}

// reload swaps in the config that load returns, between systemd's
// RELOADING=1 and READY=1.
func (d *daemon) reload(load func() (config, error)) error {
	d.mu.Lock()
	running := d.running
	d.mu.Unlock()
	if !running {
		return errors.New("not reloading: proxyd is starting or stopping")
	}
	d.notify.reloading()
	defer d.notify.ready()
	next, err := load()
	if err == nil {
		if errs := wireProblems(&next); len(errs) > 0 {
			err = errs
		}
	}
	if err != nil {
		d.metrics.ConfigReloaded(false)
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.running {
		return errors.New("not reloading: proxyd is starting or stopping")
	}
	if !reflect.DeepEqual(next.API, d.cfg.API) || !reflect.DeepEqual(next.Poll, d.cfg.Poll) ||
		!reflect.DeepEqual(next.Pool, d.cfg.Pool) || next.State != d.cfg.State || next.Admin != d.cfg.Admin {
		d.log.Warn("reload: only [[listener]], [log] level and [shutdown] changes take effect without a restart; other sections keep their running values")
	}
	// Listeners whose settings are unchanged keep running. The others get
	// a new incarnation: on the socket already bound to their address if
	// there is one (so its backlog is kept), else on a new socket. Only
	// when all are in place do the old incarnations drain.
	old := d.listeners
	byAddr := map[string]*runningListener{}
	for _, rl := range old {
		byAddr[rl.cfg.Address] = rl
		byAddr[rl.acc.ln.Addr().String()] = rl // a ":0" address, as bound
	}
	type handover struct {
		acc   *acceptor
		owner *runningListener
	}
	var fresh []*runningListener // incarnations started by this reload
	var took []handover          // sockets handed from an old incarnation
	d.listeners = map[string]*runningListener{}
	undo := func(err error) error {
		d.listeners = old
		for _, h := range took {
			d.reattach(h.owner) // give the socket back to its owner
		}
		for _, rl := range fresh {
			if !slices.ContainsFunc(took, func(h handover) bool { return h.acc == rl.acc }) {
				rl.acc.close()
			}
			d.retire(rl) // it may have taken connections already: let them finish
		}
		d.metrics.ConfigReloaded(false)
		return err
	}
	var started []string
	for _, lc := range next.Listener {
		if rl, ok := old[lc.Name]; ok && reflect.DeepEqual(rl.cfg, lc) {
			d.listeners[lc.Name] = rl
			continue
		}
		var acc *acceptor
		if owner, ok := byAddr[lc.Address]; ok && !strings.HasSuffix(lc.Address, ":0") {
			if kept, ok := next.listenerNamed(owner.cfg.Name); !ok || !reflect.DeepEqual(kept, owner.cfg) {
				acc = owner.acc
				took = append(took, handover{acc: acc, owner: owner})
			}
		}
		if err := d.startListener(lc, acc); err != nil {
			return undo(err)
		}
		fresh = append(fresh, d.listeners[lc.Name])
		started = append(started, lc.Name)
	}
	var retire []*runningListener
	for name, rl := range old {
		if d.listeners[name] != rl {
			retire = append(retire, rl)
		}
	}
	for _, lc := range next.Listener {
		d.metrics.AddListener(lc.Name)
	}
	d.pool.SetListeners(listenerSlices(next.Listener))
	d.poller.SetProtocols(pollConfig(next).Protocols)
	d.cfg.Listener = next.Listener
	if next.Log.Format != d.cfg.Log.Format {
		d.log.Warn("reload: a new [log] format takes effect at the next restart")
	}
	if d.level != nil {
		d.level.Set(logLevel(next.Log.Level))
	}
	d.cfg.Log.Level = next.Log.Level
	d.cfg.Shutdown = next.Shutdown
	for _, rl := range retire {
		handed := slices.ContainsFunc(took, func(h handover) bool { return h.owner == rl })
		if !handed {
			rl.acc.close() // its address is no longer served
		}
		d.retire(rl)
	}
	d.metrics.ConfigReloaded(true)
	d.log.Info("config reloaded", "listeners", len(next.Listener), "started", started, "retired", len(retire))
	return nil
}

// reattach serves rl's config again on its own socket after a reload that
// took the socket was undone; d.mu is held.
func (d *daemon) reattach(rl *runningListener) {
	if err := d.startListener(rl.cfg, rl.acc); err != nil {
		d.log.Error("restoring a listener after a failed reload", "listener", rl.cfg.Name, "err", err)
		return
	}
	d.retire(rl) // its accept loop ended when the socket was taken
}

// retire lets an incarnation's open connections finish within the drain
// timeout, in the background; d.mu is held.
func (d *daemon) retire(rl *runningListener) {
	drain := d.cfg.Shutdown.DrainTimeout.D()
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), drain)
		defer cancel()
		rl.l.Shutdown(ctx)
		rl.l.Close()
	}()
}

func (c *config) listenerNamed(name string) (listenerConfig, bool) {
	for _, l := range c.Listener {
		if l.Name == name {
			return l, true
		}
	}
	return listenerConfig{}, false
}

// watchdog pings systemd at half of WATCHDOG_USEC while the accept loops and
// the poll loops are alive.
func (d *daemon) watchdog(ctx context.Context) {
	every := watchdogInterval(d.getenv)
	if every <= 0 || !d.notify.enabled() {
		return
	}
	t := time.NewTicker(every)
	defer t.Stop()
	maxAge := d.cfg.API.Timeout.D() + 10*time.Second
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if alive, why := d.alive(maxAge); alive {
			d.notify.watchdog()
		} else {
			d.log.Error("not pinging the systemd watchdog", "reason", why)
		}
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

// apply turns an agent snapshot into pool updates (DESIGN.md §2) and saves
// the state. Services whose lists are not known yet keep the upstreams the
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
	for i := range s.Services {
		st := &s.Services[i]
		if !st.ListsKnown {
			continue
		}
		known[st.ID] = true
		for _, u := range st.Upstreams() {
			next = append(next, poolUpstream(u))
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
	// longer meant to be served leave.
	for _, u := range prev {
		if known[u.Service] || dropped[u.Service] {
			continue
		}
		if s.AccountKnown && !wanted[u.Service] {
			dropped[u.Service] = true
			continue
		}
		next = append(next, u)
	}
	if len(known) > 0 || len(dropped) > 0 {
		d.pool.Update(next)
		d.metrics.PoolUpdated(time.Now())
		d.logPoolChange(prev, next)
	}
	// Provider status and quota from the state file stay until the API
	// speaks for the service again.
	for id := range dropped {
		delete(d.status, id)
		delete(d.quota, id)
	}
	var account metrics.Account
	account.Credit, account.Known = s.Credit, s.CreditKnown
	for _, st := range s.Services {
		if st.StatusKnown {
			d.pool.SetProviderStatus(st.ID, st.Errored, st.Inactive)
			d.status[st.ID] = savedStatus{Errored: st.Errored, Inactive: st.Inactive}
		}
		if st.HasUsage {
			reached := st.Limit > 0 && st.Rate >= st.Limit
			d.pool.SetQuota(st.ID, reached)
			d.quota[st.ID] = reached
			d.metrics.SetUsage(st.ID, st.Rate, st.Limit)
		}
		account.Services = append(account.Services, metrics.ServiceInfo{
			ID: st.ID, Product: st.Record.ProductName, Kind: st.Record.ProductType,
			Status: st.Record.Status, Due: st.Record.NextDueDate.Time,
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
	d.saveState()
	// The state's age is that of the data served: the saved file's until
	// the lists are fetched, then the last successful refresh, which makes
	// it fresh even when nothing changed.
	if !s.ListsUpdated.IsZero() {
		d.metrics.SetStateTime(s.ListsUpdated)
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
	st := &savedState{Version: stateVersion, Status: d.status, Quota: d.quota}
	for _, u := range ups {
		st.Upstreams = append(st.Upstreams, savedUpstream{
			Service: u.Service, Kind: string(u.Kind), Protocol: string(u.Protocol), Address: u.Address,
			Username: u.Username, Password: u.Password, Server: u.Server, Session: u.Session, ExitIP: u.ExitIP,
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
	if err := writeState(d.cfg.State.Dir, st); err != nil {
		d.log.Warn("saving pool state", "err", err)
		return
	}
	d.lastSaved = key
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
	st, err := readState(d.cfg.State.Dir)
	if err != nil {
		d.log.Warn("ignoring saved pool state", "err", err)
		return
	}
	if st == nil {
		d.log.Info("no saved pool state; waiting for the provider API", "dir", d.cfg.State.Dir)
		return
	}
	ups := make([]pool.Upstream, 0, len(st.Upstreams))
	for _, u := range st.Upstreams {
		ups = append(ups, poolUpstream(agent.UpstreamSpec(u)))
	}
	d.pool.Update(ups)
	for id, s := range st.Status {
		d.pool.SetProviderStatus(id, s.Errored, s.Inactive)
		d.status[id] = s
	}
	for id, q := range st.Quota {
		d.pool.SetQuota(id, q)
		d.quota[id] = q
	}
	d.lastSaved = stateKey(st)
	d.poller.Seed(seedSizes(st))
	d.metrics.SetStateTime(st.Saved)
	d.metrics.PoolUpdated(st.Saved)
	d.log.Info("serving the saved pool until the provider API answers", "upstreams", len(ups), "saved", st.Saved.Format(time.RFC3339))
}

// seedSizes are the list sizes the saved pool was built from, for the
// poller's shrink confirmation after a restart.
func seedSizes(st *savedState) map[string]int {
	listType := map[string]string{"fpr/http": "http-auth", "fpr/socks5": "socks-ip", "ppr/http": "ppr-http", "ppr/socks5": "ppr-socks"}
	type session struct {
		service int
		id      string
	}
	sizes := map[string]int{}
	services := map[int]bool{}
	sessions := map[session]bool{} // a session is one upstream per protocol
	for _, u := range st.Upstreams {
		services[u.Service] = true
		if u.Session != "" {
			sessions[session{u.Service, u.Session}] = true
			continue
		}
		if typ := listType[u.Kind+"/"+u.Protocol]; typ != "" {
			sizes[fmt.Sprintf("%d/%s", u.Service, typ)]++
		}
	}
	for s := range sessions {
		sizes[fmt.Sprintf("%d/sticky", s.service)]++
	}
	sizes["services"] = len(services)
	return sizes
}

func listenerNames(ls []listenerConfig) []string {
	names := make([]string, len(ls))
	for i, l := range ls {
		names[i] = l.Name
	}
	return names
}
