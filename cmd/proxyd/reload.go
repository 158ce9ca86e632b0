package main

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unicode"

	"github.com/proxyd/proxyd/agent"
	"github.com/proxyd/proxyd/forward"
	"github.com/proxyd/proxyd/pool"
)

// Reload: every key takes effect on SIGHUP. A reload is computed as a plan
// (old config, new config → what changes), which is pure and tested on its
// own, then applied in two steps: prepare takes every step that can fail
// (binding new sockets, re-reading credentials, checking the state dir)
// before anything is committed; commit swaps the new parts in and undoes
// what it started if a listener cannot start. A config that cannot be
// applied whole leaves the running one as it was.

// reloadPlan is what a reload changes.
type reloadPlan struct {
	API       bool // [api]: a new client (base URL, credential keys, timeout); token_file is re-read even when unchanged
	Provider  bool // base URL or credential keys changed: the next lists replace the old ones without confirmation
	Poll      bool // [poll] intervals, services, what listeners draw, [manage]: the poll loops reconfigure
	Pool      bool // [pool]: applies to the next pick; health state and sticky keys stay
	Listeners bool // [[listener]]: some start, move or retire (sockets of unchanged ones untouched)
	Admin     bool // [admin] address or token: a new socket, or a new handler on the same one
	AdminMove bool // [admin] address: the new socket serves before the old one closes
	State     bool // [state] dir: saved there from now on
	Log       bool // [log] level or format
	Shutdown  bool // [shutdown]
	Services  bool // [api] services: metrics series and pool follow at the next poll
}

// planReload compares two valid configs.
func planReload(old, next config) reloadPlan {
	var p reloadPlan
	p.Provider = agent.ProviderURL(old.API.BaseURL) != agent.ProviderURL(next.API.BaseURL) ||
		credentialKeys(old.API) != credentialKeys(next.API)
	p.API = p.Provider || old.API.Timeout != next.API.Timeout
	p.Services = !slices.Equal(old.API.Services, next.API.Services)
	p.Poll = p.Services || !reflect.DeepEqual(pollConfig(old), pollConfig(next)) ||
		!reflect.DeepEqual(old.Manage, next.Manage) || !reflect.DeepEqual(drawnBy(old.Listener), drawnBy(next.Listener))
	p.Pool = !reflect.DeepEqual(old.Pool, next.Pool)
	p.Listeners = !reflect.DeepEqual(old.Listener, next.Listener)
	p.AdminMove = old.Admin.Address != next.Admin.Address
	p.Admin = old.Admin != next.Admin || next.Admin.TokenFile != ""
	p.State = old.State != next.State
	p.Log = old.Log != next.Log
	p.Shutdown = old.Shutdown != next.Shutdown
	return p
}

// drawnBy is what the listeners draw, whatever their names: a change of it
// changes which lists the poll loops fetch (agent.PollConfig.Draws).
func drawnBy(ls []listenerConfig) []pool.ListenerSlice {
	out := listenerSlices(ls)
	for i := range out {
		out[i].Name = ""
	}
	return out
}

// changed names the sections a plan touches, for the log.
func (p reloadPlan) changed() []string {
	var out []string
	v := reflect.ValueOf(p)
	for i := range v.NumField() {
		if v.Field(i).Bool() {
			out = append(out, strings.ToLower(v.Type().Field(i).Name))
		}
	}
	return out
}

// Reload swaps in a new config. On error the old config stays, whole.
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
	d.notified(d.notify.reloading())
	defer func() { d.notified(d.notify.ready()) }()
	next, err := load()
	if err == nil {
		if errs := next.validate(); len(errs) > 0 {
			err = errs
		}
	}
	if err == nil {
		err = next.readPasswordFiles()
	}
	if err == nil {
		err = d.applyConfig(next)
	}
	if err != nil {
		d.metrics.ConfigReloaded(false)
		d.events.Record(pool.Event{Kind: pool.EventReloadFailed, Reason: oneLine(err)})
		return err
	}
	d.metrics.ConfigReloaded(true)
	return nil
}

// oneLine is an error's text on one line: config problems (one a line)
// joined by "; ", any other control character (a provider's message may
// hold "\r\n" or terminal escapes) shown as a space.
func oneLine(err error) string {
	return strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return ' '
		}
		return r
	}, strings.ReplaceAll(err.Error(), "\n", "; "))
}

// prepared holds what a reload made ready before committing: released by
// abandon when the reload does not go through.
type prepared struct {
	client      *clientSwap
	admin       *adminServer            // a newly bound admin socket
	handlerOnly bool                    // the admin token changed, not its address
	sockets     map[string]net.Listener // listener name → a newly bound socket for it
}

func (p *prepared) abandon() {
	if p.admin != nil && !p.handlerOnly {
		p.admin.abandon()
	}
	for _, ln := range p.sockets {
		ln.Close()
	}
}

// prepare takes every step of plan that can fail, without d.mu (it reads
// files and binds sockets; the watchdog and the admin server must not wait on
// it). Reloads are serialized by reloadMu, so what it read stays current
// until the commit.
func (d *daemon) prepare(old, next config, plan reloadPlan, running map[string]*runningListener, held []heldAddr) (_ *prepared, err error) {
	p := &prepared{}
	defer func() {
		if err != nil {
			p.abandon() // what was bound before the step that failed
		}
	}()
	if plan.API || next.API.TokenFile != "" || next.API.PasswordFile != "" {
		c, err := d.prepareClient(old, next)
		if err != nil {
			return nil, err
		}
		p.client = c
	}
	if plan.Poll || plan.Listeners || plan.API {
		// What Reconfigure would refuse, refused before anything changes.
		pc := d.pollConfig(next)
		if err := errors.Join(pc.Validate(), pc.Manage.Validate()); err != nil {
			return nil, fmt.Errorf("poll loops: %w", err)
		}
	}
	if plan.State {
		if err := checkWritableDir(next.State.Dir); err != nil {
			return nil, keyError{Key: "state.dir", Msg: err.Error()}
		}
	}
	if plan.Admin {
		if plan.AdminMove {
			a, err := bindAdmin(next.Admin, d)
			if err != nil {
				return nil, heldHere(err, next.Admin.Address, held)
			}
			p.admin = a
		} else {
			h, err := d.adminAccess(next.Admin)
			if err != nil {
				return nil, err
			}
			p.admin = &adminServer{}
			p.admin.handler.Store(&h)
			p.handlerOnly = true
		}
	}
	if plan.Listeners {
		_, bind := socketPlan(running, next)
		p.sockets = map[string]net.Listener{}
		for _, lc := range bind {
			ln, err := forward.Listen(context.Background(), lc.Address)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", listenerKey(next.Listener, lc.Name, "address"), heldHere(err, lc.Address, held))
			}
			p.sockets[lc.Name] = ln
		}
	}
	return p, nil
}

// applyConfig carries a valid config out: prepare, then commit.
func (d *daemon) applyConfig(next config) error {
	d.reloadMu.Lock()
	defer d.reloadMu.Unlock()
	d.mu.Lock()
	old, running := d.cfg, maps.Clone(d.listeners)
	held := d.heldAddrs()
	d.mu.Unlock()
	plan := planReload(old, next)
	p, err := d.prepare(old, next, plan, running, held)
	if err != nil {
		return err
	}

	d.mu.Lock()
	if !d.running {
		d.mu.Unlock()
		p.abandon()
		return errors.New("not reloading: proxyd is starting or stopping")
	}
	finishListeners := func() {}
	if plan.Listeners {
		finish, err := d.swapListeners(next, p.sockets)
		if err != nil {
			d.mu.Unlock()
			p.abandon()
			return err
		}
		finishListeners = finish
	}
	// From here on nothing fails: next was validated, and prepare took
	// every step that could. The reload is said first, so that what it
	// causes (a listener's panic over, quotas under a new headroom,
	// services that leave) follows it in the event log.
	d.events.Record(pool.Event{Kind: pool.EventReload, Reason: strings.Join(plan.changed(), ",")})
	finishListeners()
	if plan.Pool {
		if err := d.pool.SetConfig(next.Pool); err != nil {
			d.log.Error("reload: the pool kept its configuration", "err", err) // validated: cannot happen
		}
	}
	if p.client != nil && p.client.changed {
		was := max(d.api.Timeout, d.oldTimeout(time.Now(), d.poller.OlderRounds())) // an older client's requests too
		if was > p.client.api.Timeout {
			// Requests of the old client may still run that long.
			d.slowTimeout, d.slowUntil = was, time.Now().Add(was)
		}
		d.client, d.api, d.credSrc = p.client.client, p.client.api, p.client.source
	}
	if plan.Poll || plan.Listeners || (p.client != nil && p.client.changed) {
		if err := d.poller.Reconfigure(d.client, d.pollConfig(next), plan.Provider); err != nil {
			// prepare checked what Reconfigure checks; the loops keep running as they were.
			d.log.Error("reload: the poll loops kept their configuration", "err", err)
		}
	}
	var oldAdmin *adminServer
	if plan.Admin {
		if p.handlerOnly {
			if d.admin != nil && d.admin.srv != nil {
				d.admin.handler.Store(p.admin.handler.Load())
			}
		} else {
			p.admin.serve(d.log)
			oldAdmin, d.admin = d.admin, p.admin
		}
	}
	if plan.Log && d.logs != nil {
		d.logs.set(next.Log)
	}
	d.cfg = next
	d.mu.Unlock()

	// The new admin socket serves before the old one stops; its answers in
	// flight may need d.mu, so it closes after the commit.
	oldAdmin.close()
	if plan.Services {
		// A service no longer configured leaves the pool now, not when
		// the API next answers (Reconfigure dropped it).
		d.apply(agent.Snapshot{})
	}
	if plan.State {
		// Saved there from now on: at once, changed pool or not.
		d.applyMu.Lock()
		d.lastSaved = ""
		d.saveState()
		d.applyMu.Unlock()
	}
	d.log.Info("config reloaded", "changed", plan.changed())
	return nil
}

// clientSwap is the API client a reload prepared.
type clientSwap struct {
	client  *agent.Client
	api     agent.Config // its [api] with the credential resolved
	source  string
	changed bool // another credential, base URL or timeout than the running client's
}

// prepareClient resolves the credential of next's [api] and builds its
// client. When the file's credential keys changed but the credential still
// comes from where the running process cannot see it change (the
// environment, systemd's credentials), the change could not take effect:
// the reload is refused with that reason.
func (d *daemon) prepareClient(old, next config) (*clientSwap, error) {
	c, api, src, err := d.newClient(next.API)
	if err != nil {
		return nil, err
	}
	if agent.FixedSource(src) && credentialKeys(old.API) != credentialKeys(next.API) {
		return nil, keyError{Key: "api", Msg: fmt.Sprintf("the API credential comes from %s, which is fixed while proxyd runs: restart proxyd to change it", src)}
	}
	d.mu.Lock()
	running := d.api
	d.mu.Unlock()
	same := agent.ProviderURL(api.BaseURL) == agent.ProviderURL(running.BaseURL) && api.Token == running.Token && api.Login == running.Login &&
		api.Password == running.Password && api.Timeout == running.Timeout
	return &clientSwap{client: c, api: api, source: src, changed: !same}, nil
}

// credentialKeys are the [api] keys that name the credential.
func credentialKeys(c agent.Config) [5]string {
	return [5]string{c.Token, c.TokenFile, c.Login, c.Password, c.PasswordFile}
}

// checkWritableDir reports whether the daemon can save its state in dir.
func checkWritableDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("cannot create %s: %w", dir, err)
	}
	f, err := os.CreateTemp(dir, ".proxyd-check-*")
	if err != nil {
		return fmt.Errorf("cannot write in %s: %w", dir, err)
	}
	f.Close()
	return os.Remove(f.Name())
}

// heldAddr is a socket this proxyd serves: a listener's or the admin's.
type heldAddr struct {
	who  string // `listener "http"`, "the admin server"
	addr *net.TCPAddr
}

// heldAddrs lists the sockets proxyd serves; d.mu is held.
func (d *daemon) heldAddrs() []heldAddr {
	var out []heldAddr
	for name, rl := range d.listeners {
		if ta, ok := rl.acc.ln.Addr().(*net.TCPAddr); ok {
			out = append(out, heldAddr{fmt.Sprintf("listener %q", name), ta})
		}
	}
	if d.admin != nil && d.admin.ln != nil {
		if ta, ok := d.admin.ln.Addr().(*net.TCPAddr); ok {
			out = append(out, heldAddr{"the admin server", ta})
		}
	}
	return out
}

// heldHere explains a bind to address that failed because this proxyd holds
// the port on an overlapping address (the same address spelled otherwise, or
// either side unspecified, as in 127.0.0.1:8080 → 0.0.0.0:8080): the kernel
// refuses the new socket while the old one is open, and a reload binds
// before it lets go of anything, so only a restart can move the port there.
func heldHere(err error, address string, held []heldAddr) error {
	if !errors.Is(err, syscall.EADDRINUSE) {
		return err
	}
	host, port, splitErr := net.SplitHostPort(address)
	if splitErr != nil {
		return err
	}
	var ips []netip.Addr // none: all addresses (":8080")
	if host != "" {
		if ip, perr := netip.ParseAddr(host); perr == nil {
			ips = []netip.Addr{ip}
		} else {
			// A name the failed bind resolved a moment ago ("localhost").
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			if ips, perr = net.DefaultResolver.LookupNetIP(ctx, "ip", host); perr != nil || len(ips) == 0 {
				return err
			}
		}
	}
	overlaps := func(mine netip.Addr) bool {
		if len(ips) == 0 || mine.IsUnspecified() {
			return true
		}
		for _, ip := range ips {
			if ip = ip.Unmap(); ip.IsUnspecified() || ip == mine {
				return true
			}
		}
		return false
	}
	for _, h := range held {
		mine, _ := netip.AddrFromSlice(h.addr.IP) // 0.0.0.0 may come in its 16-byte form
		if strconv.Itoa(h.addr.Port) == port && overlaps(mine.Unmap()) {
			return fmt.Errorf("%w (%s of this proxyd holds %s: a reload binds before it closes anything, so restart proxyd to move it)", err, h.who, h.addr)
		}
	}
	return err
}

// socketPlan says, for the listeners of next that are new or changed,
// which take over the socket of a running listener on their address (so its
// backlog is kept) and which need a socket of their own.
func socketPlan(running map[string]*runningListener, next config) (take map[string]*runningListener, bind []listenerConfig) {
	byAddr := map[string]*runningListener{}
	for _, rl := range running {
		byAddr[rl.cfg.Address] = rl
		byAddr[rl.acc.ln.Addr().String()] = rl // a ":0" address, as bound
	}
	take = map[string]*runningListener{}
	for _, lc := range next.Listener {
		if rl, ok := running[lc.Name]; ok && reflect.DeepEqual(rl.cfg, lc) {
			continue // unchanged: keeps running
		}
		if owner, ok := byAddr[lc.Address]; ok && !strings.HasSuffix(lc.Address, ":0") {
			if kept, ok := next.listenerNamed(owner.cfg.Name); !ok || !reflect.DeepEqual(kept, owner.cfg) {
				take[lc.Name] = owner
				continue
			}
		}
		bind = append(bind, lc)
	}
	return take, bind
}

// swapListeners starts the listeners that are new or changed, on the
// sockets prepare bound or taken over from the running listener on their
// address; unchanged ones keep running untouched. On error every listener
// is as it was. Else it returns finish, which cannot fail: it makes the
// new set current (metrics, pool slices, probes) and retires the ones
// that left or changed, so that only when all are in place do the old
// incarnations drain. d.mu is held, for both.
func (d *daemon) swapListeners(next config, sockets map[string]net.Listener) (finish func(), err error) {
	old := d.listeners
	take, _ := socketPlan(old, next)
	type handover struct {
		acc   *acceptor
		owner *runningListener
	}
	var fresh []*runningListener // incarnations started by this reload
	var took []handover          // sockets handed from an old incarnation
	d.listeners = map[string]*runningListener{}
	// The new names are in the pool before their incarnations accept, and
	// the old ones stay while theirs serve: a pick finds its slice
	// whichever incarnation accepted the connection.
	d.setPoolListeners(next.Listener, old)
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
		d.setPoolListeners(d.cfg.Listener, nil)
		return err
	}
	var started []string
	for _, lc := range next.Listener {
		if rl, ok := old[lc.Name]; ok && reflect.DeepEqual(rl.cfg, lc) {
			d.listeners[lc.Name] = rl
			continue
		}
		var acc *acceptor
		prev := old[lc.Name] // its connections count against lc's cap
		if owner, ok := take[lc.Name]; ok {
			acc = owner.acc
			took = append(took, handover{acc: acc, owner: owner})
			if _, kept := next.listenerNamed(owner.cfg.Name); prev == nil && !kept {
				prev = owner // renamed on the same address (its name is not taken again)
			}
		} else if ln, ok := sockets[lc.Name]; ok {
			acc = newAcceptor(ln, d.log.With("listener", lc.Name))
		}
		if err := d.startListener(lc, acc, prev); err != nil {
			return nil, undo(err) // a socket of its own stays in sockets: abandon closes it
		}
		delete(sockets, lc.Name) // the listener's acceptor owns it now
		fresh = append(fresh, d.listeners[lc.Name])
		started = append(started, lc.Name)
	}
	return func() {
		var retire []*runningListener
		for name, rl := range old {
			if d.listeners[name] != rl {
				retire = append(retire, rl)
			}
		}
		d.metrics.SetListeners(listenerNames(next.Listener))
		d.prober.setListeners(next.Listener)
		for _, rl := range retire {
			handed := slices.ContainsFunc(took, func(h handover) bool { return h.owner == rl })
			if !handed {
				rl.acc.close() // its address is no longer served
			}
			d.retire(rl)
		}
		d.setPoolListeners(next.Listener, nil)
		d.log.Info("listeners reloaded", "listeners", len(next.Listener), "started", started, "retired", len(retire))
	}, nil
}

// reattach serves rl's config again on its own socket after a reload that
// took the socket was undone; d.mu is held.
func (d *daemon) reattach(rl *runningListener) {
	if err := d.startListener(rl.cfg, rl.acc, rl); err != nil {
		d.log.Error("restoring a listener after a failed reload", "listener", rl.cfg.Name, "err", err)
		return
	}
	d.retire(rl) // its accept loop ended when the socket was taken
}

// retire stops an incarnation from taking connections and lets the ones it
// has finish, in the background: a reload does not cut a tunnel, whichever
// key changed (idle_timeout still ends the idle ones, and the new
// incarnation's rules apply to every new connection). When proxyd stops,
// they get the same drain_timeout as everything else; d.mu is held.
func (d *daemon) retire(rl *runningListener) {
	d.retired.Add(1)
	d.winding = append(d.winding, rl)
	go func() {
		defer d.retired.Done()
		rl.l.Shutdown(d.retiring)
		rl.l.Close()
		// Every connection it had is counted now (forward reports a close
		// before it stops counting it as active); its series go, unless the
		// name is current again, and so does its pool slice.
		d.metrics.ListenerGone(rl.cfg.Name)
		d.mu.Lock()
		d.winding = slices.DeleteFunc(d.winding, func(w *runningListener) bool { return w == rl })
		d.setPoolListeners(d.cfg.Listener, nil)
		d.mu.Unlock()
	}()
}

// setPoolListeners gives the pool the slices of ls, and of the incarnations
// in also and those a reload retired that still serve, under a name ls does
// not have (a listener renamed or removed): a connection they accepted
// still finds its slice, which is Retiring (it counts for nothing else). A
// name of ls takes its config from ls. d.mu is held.
func (d *daemon) setPoolListeners(ls []listenerConfig, also map[string]*runningListener) {
	sls := listenerSlices(ls)
	add := func(rl *runningListener) {
		if !slices.ContainsFunc(sls, func(sl pool.ListenerSlice) bool { return sl.Name == rl.cfg.Name }) {
			sl := listenerSlices([]listenerConfig{rl.cfg})[0]
			sl.Retiring = true
			sls = append(sls, sl)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(also)) {
		add(also[name])
	}
	for _, rl := range d.winding {
		add(rl)
	}
	d.pool.SetListeners(sls)
}

func (c *config) listenerNamed(name string) (listenerConfig, bool) {
	for _, l := range c.Listener {
		if l.Name == name {
			return l, true
		}
	}
	return listenerConfig{}, false
}
