package agent

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"time"
)

// ManageConfig is the [manage] section of the configuration file: actions
// proxyd takes on the account by itself, all off by default. Start from
// DefaultManageConfig.
type ManageConfig struct {
	// UpdateListShare is the share (0–1) of an fpr service's distinct IPs
	// that, while on the provider's errored or inactive lists for
	// UpdateListAfter, makes proxyd request a new IP list for the service
	// (which replaces the account's IPs). 0 switches it off.
	UpdateListShare float64 `toml:"update_list_share"`
	// UpdateListAfter is how long the share must hold, counted from when it
	// was reached (after a reload that turns the feature on or raises the
	// share: from the first status round that sees it held) and again from
	// each request; at most one request per this time. Must be more than
	// 0s when UpdateListShare is set.
	UpdateListAfter time.Duration `toml:"update_list_after"`
}

// DefaultManageConfig returns the [manage] section with every key at its
// default: list updates off.
func DefaultManageConfig() ManageConfig {
	return ManageConfig{UpdateListShare: 0, UpdateListAfter: 10 * time.Minute}
}

// Validate reports every problem of the section, joined with errors.Join;
// each message starts with the key as written in the file.
func (c ManageConfig) Validate() error {
	var errs []error
	if !(c.UpdateListShare >= 0 && c.UpdateListShare <= 1) {
		errs = append(errs, fmt.Errorf("update_list_share: must be within 0–1, got %g", c.UpdateListShare))
	}
	switch {
	case c.UpdateListAfter < 0:
		errs = append(errs, fmt.Errorf("update_list_after: must not be negative, got %s", c.UpdateListAfter))
	case c.UpdateListAfter == 0 && c.UpdateListShare > 0:
		errs = append(errs, errors.New("update_list_after: must be more than 0s while update_list_share is set"))
	}
	return errors.Join(errs...)
}

// Event is something the agent did on the account by itself, for the
// daemon's event log and metrics.
type Event struct {
	Kind    string // one of the Event* kinds
	Service int
	// Result is the outcome of a list update, the label of the metric
	// proxyd_list_updates_total: ResultOK, ResultError or ResultRateLimited;
	// "" for EventListUpdateRequested.
	Result string
	Reason string // human-readable detail; never a credential
}

// Kinds of Event.
const (
	EventListUpdateRequested = "list_update_requested"
	EventListUpdated         = "list_updated"
	EventListUpdateFailed    = "list_update_failed"
)

// Results of a list update.
const (
	ResultOK          = "ok"
	ResultError       = "error"
	ResultRateLimited = "rate_limited"
)

// Bounds of the wait a 429 imposes on a list update or a poll
// (Poller.rateLimited).
const (
	minRateLimitWait = time.Second
	maxRateLimitWait = time.Hour
)

// manageState is the list-update clock of one fpr service.
type manageState struct {
	heldSince   time.Time // when the share was reached, or the last request; zero while below
	share       float64   // the update_list_share of the last round
	lastRequest time.Time
	nextAllowed time.Time // from a 429
}

// badShare is the share of the service's distinct list IPs that are on its
// errored or inactive lists.
func badShare(st *ServiceState) float64 {
	ips := map[netip.Addr]bool{}
	for _, entries := range st.Lists {
		for _, e := range entries {
			if a, err := netip.ParseAddr(unbracket(e.Host)); err == nil {
				ips[a.Unmap()] = true
			}
		}
	}
	if len(ips) == 0 {
		return 0
	}
	bad := map[netip.Addr]bool{}
	for _, list := range [][]string{st.Errored, st.Inactive} {
		for _, s := range list {
			if a, err := netip.ParseAddr(unbracket(s)); err == nil && ips[a.Unmap()] {
				bad[a.Unmap()] = true
			}
		}
	}
	return float64(len(bad)) / float64(len(ips))
}

// manageLists requests a new IP list for each fpr service whose share of
// errored or inactive IPs has held for update_list_after, and polls the
// new list at once. Called after each status round.
func (p *Poller) manageLists(ctx context.Context) {
	_, cfg, _ := p.current()
	share, after := cfg.Manage.UpdateListShare, cfg.Manage.UpdateListAfter
	if share <= 0 {
		// Off: the share is not watched, so when it was reached is not
		// known when the feature comes back on.
		p.mu.Lock()
		for _, m := range p.manage {
			m.heldSince = time.Time{}
		}
		p.mu.Unlock()
		return
	}
	now := p.now()
	var due []int
	p.mu.Lock()
	// The client and its provider epoch read together: a reload between
	// two reads would send the old client's 429 to the new provider's state.
	client, provider := p.client, p.provider
	for id, st := range p.services {
		if st.Record.ProductType != "fpr" || !st.StatusKnown() {
			continue
		}
		m := p.manage[id]
		if m == nil {
			m = &manageState{}
			p.manage[id] = m
		}
		if share > m.share {
			// A reload raised it: when the new share was reached is not
			// known, so it counts from this round. (A lower share was
			// reached by the time the higher one was.)
			m.heldSince = time.Time{}
		}
		m.share = share
		if !st.ListsKnown || badShare(st) < share {
			m.heldSince = time.Time{}
			continue
		}
		if m.heldSince.IsZero() {
			m.heldSince = now
		}
		if now.Sub(m.heldSince) >= after && now.Sub(m.lastRequest) >= after && !now.Before(m.nextAllowed) {
			due = append(due, id)
			m.lastRequest, m.heldSince = now, now
		}
	}
	p.mu.Unlock()
	for _, id := range due {
		p.requestList(ctx, client, provider, id)
	}
}

// requestList sends one list update for service id to the provider of
// that epoch (Poller.provider) and reports it.
func (p *Poller) requestList(ctx context.Context, client *Client, provider uint64, id int) {
	p.event(Event{Kind: EventListUpdateRequested, Service: id, Reason: "errored or inactive IPs held the configured share"})
	_, err := client.UpdateService(ctx, id, ServiceUpdate{UpdateList: true})
	p.beat(LoopStatus)
	limit := p.rateLimited(err)
	var unread *DecodeError // a 2xx answer whose body is not the documented object
	switch {
	case err == nil || errors.As(err, &unread):
		// The status says the provider took the request; a body it
		// words otherwise does not undo the new list.
		if unread != nil {
			p.log.Warn("new IP list requested; the provider's answer could not be read", "service", id, "err", err)
		} else {
			p.log.Info("new IP list requested", "service", id)
		}
		// Said before the new list is fetched: what that changes in the
		// pool follows its cause in the event log.
		p.event(Event{Kind: EventListUpdated, Service: id, Result: ResultOK, Reason: "the provider replaced the IP list"})
		p.pollNewList(ctx, id)
		p.changed()
	case limit.ok:
		p.mu.Lock()
		// A reload meanwhile keeps it; a new provider does not.
		if m := p.manage[id]; m != nil && p.provider == provider {
			m.nextAllowed = limit.until
		}
		p.mu.Unlock()
		p.log.Warn("new IP list refused until the provider's next allowed time", "service", id, "next", limit.until.UTC())
		p.logRateLimitCapped(limit, "requesting a new IP list", "service", id)
		p.event(Event{Kind: EventListUpdateFailed, Service: id, Result: ResultRateLimited,
			Reason: "rate limited until " + limit.until.UTC().Format(time.DateTime) + " UTC"})
	default:
		p.log.Warn("requesting a new IP list failed", "service", id, "err", err)
		p.event(Event{Kind: EventListUpdateFailed, Service: id, Result: ResultError, Reason: err.Error()})
	}
}

// pollNewList polls service id's lists after a list update, as a round of
// the lists loop for that service would: the loop's clock for it (a 429's
// time included) says whether it may go now, else the loop polls it when
// that time has passed, and the outcome sets the clock.
func (p *Poller) pollNewList(ctx context.Context, id int) {
	u := unit{service: id}
	p.mu.Lock()
	c := p.clocks[LoopLists][u]
	limited := c != nil && p.now().Before(c.notBefore)
	p.mu.Unlock()
	if limited {
		p.kick(LoopLists, u)
		return
	}
	r := p.startRound(LoopLists)
	_, soon, err := p.pollServiceLists(ctx, LoopStatus, r.at, id)
	p.done(ctx, r, u, err, soon) // logs a failure with the wait before the loop's retry
	p.wake(LoopLists)            // which its clock now says
}

func (p *Poller) event(e Event) {
	_, cfg, _ := p.current()
	if cfg.OnEvent != nil {
		cfg.OnEvent(e)
	}
}
