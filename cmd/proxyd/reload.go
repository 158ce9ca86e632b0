package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"reflect"
	"slices"
	"strings"

	"github.com/proxyd/proxyd/agent"
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
	Poll      bool // [poll] intervals, services, listener protocols, [manage]: the poll loops reconfigure
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
	p.Provider = old.API.BaseURL != next.API.BaseURL || credentialKeys(old.API) != credentialKeys(next.API)
	p.API = p.Provider || old.API.Timeout != next.API.Timeout
	p.Services = !slices.Equal(old.API.Services, next.API.Services)
	p.Poll = p.Services || !reflect.DeepEqual(pollConfig(old), pollConfig(next)) ||
		!reflect.DeepEqual(old.Manage, next.Manage)
	p.Pool = !reflect.DeepEqual(old.Pool, next.Pool)
	p.Listeners = !reflect.DeepEqual(old.Listener, next.Listener)
	p.AdminMove = old.Admin.Address != next.Admin.Address
	p.Admin = old.Admin != next.Admin || next.Admin.TokenFile != ""
	p.State = old.State != next.State
	p.Log = old.Log != next.Log
	p.Shutdown = old.Shutdown != next.Shutdown
	return p
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
	d.notify.reloading()
	defer d.notify.ready()
	next, err := load()
	if err == nil {
		if errs := next.validate(); len(errs) > 0 {
			err = errs
		}
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

// oneLine is an error's text on one line (config problems are one a line).
func oneLine(err error) string {
	return strings.ReplaceAll(err.Error(), "\n", "; ")
}

// prepared holds what a reload made ready before committing: released by
// abandon when the reload does not go through.
type prepared struct {
	client      *clientSwap
	admin       *adminServer // a newly bound admin socket
	handlerOnly bool         // the admin token changed, not its address
}

func (p *prepared) abandon() {
	if p.admin != nil && !p.handlerOnly {
		p.admin.abandon()
	}
}

// prepare takes every step of plan that can fail; d.mu is held.
func (d *daemon) prepare(old, next config, plan reloadPlan) (*prepared, error) {
	var p prepared
	if plan.API || next.API.TokenFile != "" || next.API.PasswordFile != "" {
		c, err := d.prepareClient(next)
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
				return nil, err
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
	return &p, nil
}

// applyConfig carries a valid config out: prepare, then commit.
func (d *daemon) applyConfig(next config) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.running {
		return errors.New("not reloading: proxyd is starting or stopping")
	}
	old := d.cfg
	plan := planReload(old, next)
	p, err := d.prepare(old, next, plan)
	if err != nil {
		return err
	}
	if plan.Pool {
		if err := d.pool.SetConfig(next.Pool); err != nil {
			p.abandon()
			return fmt.Errorf("pool: %w", err)
		}
	}
	if plan.Listeners {
		if err := d.swapListeners(next); err != nil {
			if plan.Pool {
				d.pool.SetConfig(old.Pool) // valid: it was running
			}
			p.abandon()
			return err
		}
	}
	// From here on nothing fails.
	if p.client != nil && p.client.changed {
		d.client, d.api, d.credSrc = p.client.client, p.client.api, p.client.source
	}
	if plan.Poll || plan.Listeners || (p.client != nil && p.client.changed) {
		if err := d.poller.Reconfigure(d.client, d.pollConfig(next), plan.Provider); err != nil {
			// prepare checked what Reconfigure checks; the loops keep running as they were.
			d.log.Error("reload: the poll loops kept their configuration", "err", err)
		}
	}
	if plan.Admin {
		if p.handlerOnly {
			if d.admin != nil && d.admin.srv != nil {
				d.admin.handler.Store(p.admin.handler.Load())
			}
		} else {
			p.admin.serve(d.log)
			old := d.admin
			d.admin = p.admin
			old.close() // the new socket serves before the old one stops
		}
	}
	if plan.Log && d.logs != nil {
		d.logs.set(next.Log)
	}
	if plan.Services {
		d.metrics.SetServices(next.API.Services)
	}
	d.cfg = next
	if plan.State {
		// Saved there from now on: at once, changed pool or not. The save
		// takes applyMu, which is taken before d.mu, so it runs after.
		d.stateMoved.Store(true)
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			d.applyMu.Lock()
			defer d.applyMu.Unlock()
			d.saveState()
		}()
	}
	d.events.Record(pool.Event{Kind: pool.EventReload, Reason: strings.Join(plan.changed(), ",")})
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
// client. A credential the running process cannot see change (the
// environment, systemd's credentials) is refused when the file's credential
// keys changed: the change could not take effect.
func (d *daemon) prepareClient(next config) (*clientSwap, error) {
	if agent.FixedSource(d.credSrc) && credentialKeys(d.cfg.API) != credentialKeys(next.API) {
		return nil, keyError{Key: "api", Msg: fmt.Sprintf("the API credential comes from %s, which is fixed while proxyd runs: restart proxyd to change it", d.credSrc)}
	}
	c, api, src, err := d.newClient(next.API)
	if err != nil {
		return nil, err
	}
	running := d.api
	same := api.BaseURL == running.BaseURL && api.Token == running.Token && api.Login == running.Login &&
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

// swapListeners starts the listeners that are new or changed and retires
// the ones that left or changed; unchanged ones keep running untouched. On
// error every listener is as it was; d.mu is held.
func (d *daemon) swapListeners(next config) error {
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
	for _, rl := range retire {
		handed := slices.ContainsFunc(took, func(h handover) bool { return h.owner == rl })
		if !handed {
			rl.acc.close() // its address is no longer served
		}
		d.retire(rl)
	}
	d.log.Info("listeners reloaded", "listeners", len(next.Listener), "started", started, "retired", len(retire))
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
	drain := d.cfg.Shutdown.DrainTimeout
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
