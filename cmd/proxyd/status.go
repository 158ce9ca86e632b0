package main

import (
	"bytes"
	_ "embed"
	"fmt"
	"html/template"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/proxyd/proxyd/agent"
	"github.com/proxyd/proxyd/pool"
)

// The status page is one server-rendered HTML page for people, in the way of
// HAProxy's stats page: no script, no external asset, a small inline style,
// and a meta refresh every few seconds. html/template escapes every string,
// so provider-supplied names (products, reasons) show as text. Only fields
// chosen below reach it: never a password, token or user name.

//go:embed status.html
var statusHTML string

// statusTemplate is parsed once; it holds no state.
var statusTemplate = template.Must(template.New("status").Funcs(template.FuncMap{"count": count}).Parse(statusHTML))

// statusEvents is how many of the latest events the page lists.
const statusEvents = 50

// statusRefresh is the page's meta refresh interval in seconds.
const statusRefresh = 5

type statusPage struct {
	Version   string
	Now       string // RFC 3339 UTC
	Updated   string // when the pool last took the provider's word (any poll), or "never"
	Fetched   string // when its IP lists were last refreshed, or "never"
	Refresh   int
	Filter    statusFilter
	Listeners []pool.ListenerExplanation
	Groups    []statusGroup
	Upstreams int // shown, after filtering
	Account   statusAccount
	Events    []statusEvent
}

// statusFilter is the filter form: the values in force and the choices.
type statusFilter struct {
	Service, State, Listener string
	Active                   bool
	Services                 []int
	States                   []pool.State
	Listeners                []string
}

// statusGroup is one service's upstreams, and its sticky sessions no
// upstream stands for.
type statusGroup struct {
	Service   int
	Product   string
	Kind      string
	Summary   string // "3 healthy, 1 ejected"
	Upstreams []statusUpstream
	Unserved  []pool.UnservedExplanation
}

type statusUpstream struct {
	ID, Address, Protocol, Session, ExitIP string
	State                                  pool.State
	Reason                                 string
	Failures, Consecutive, Ejections       int64
	EjectedUntil                           string // RFC 3339 UTC, or ""
	Countdown                              string // "in 42s", "due", or ""
	InFlight                               int64
}

type statusAccount struct {
	Known         bool // the service list was fetched at least once
	CreditKnown   bool
	Credit        string
	InvoicesKnown bool
	Unpaid        int    // invoices Unpaid or in Collections: how services get suspended
	UnpaidUSD     string // their sum
	Services      []statusService
}

type statusService struct {
	ID                     int
	Product, Type, Status  string
	Due                    string // YYYY-MM-DD or ""
	Served                 bool
	HasUsage               bool
	Rate, Limit, UsageText string
	RateValue, LimitValue  float64
	Percent                int
	Over                   bool // usage reached quota_headroom × the limit: the pool holds the service at its quota
}

type statusEvent struct {
	Time, Ago string
	Kind      pool.EventKind
	Tone      string // "bad", "good" or "info": the colour of the kind
	Upstream  string
	Service   int
	Reason    string
}

// serveStatus answers GET / with the status page, filtered like /pool by
// ?service=ID&state=STATE&listener=NAME.
func (d *daemon) serveStatus(w http.ResponseWriter, r *http.Request) {
	f, err := parsePoolFilter(r)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	full := d.pool.Explain()
	ex, ok := d.filterPool(full, f)
	if !ok {
		http.Error(w, "unknown listener", http.StatusNotFound)
		return
	}
	d.mu.Lock()
	listeners := listenerNames(d.cfg.Listener)
	d.mu.Unlock()
	evFilter := pool.EventFilter{Service: f.service}
	page := buildStatusPage(statusInput{pool: ex, snap: d.poller.Snapshot(), events: d.events.Events(evFilter),
		fetched: d.metrics.StateTime(), atQuota: d.pool.AtQuota}, time.Now())
	page.Filter = statusFilter{
		Active:    f != poolFilter{},
		State:     string(f.state),
		Listener:  f.listener,
		Services:  serviceIDs(full),
		States:    pool.States(),
		Listeners: listeners,
	}
	if f.service != 0 {
		page.Filter.Service = strconv.Itoa(f.service)
	}
	// Rendered to a buffer first, so that a template failure is a clean
	// 500 and not half a page.
	var b bytes.Buffer
	if err := statusTemplate.Execute(&b, page); err != nil {
		d.log.Error("rendering the status page", "err", err)
		http.Error(w, "rendering the status page failed", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Write(b.Bytes())
}

func serviceIDs(ex pool.Explanation) []int {
	var ids []int
	for _, u := range ex.Upstreams {
		ids = append(ids, u.Service)
	}
	for _, u := range ex.Unserved {
		ids = append(ids, u.Service)
	}
	slices.Sort(ids)
	return slices.Compact(ids)
}

// statusInput is what the status page shows.
type statusInput struct {
	pool    pool.Explanation
	snap    agent.Snapshot
	events  []pool.Event // newest first
	fetched time.Time    // the last lists refresh of the pool served (proxyd_state_age_seconds counts from it)
	atQuota func(service int) bool
}

// buildStatusPage is the page's content, a pure function of in at now.
func buildStatusPage(in statusInput, now time.Time) statusPage {
	ex, snap, events := in.pool, in.snap, in.events
	now = now.UTC()
	p := statusPage{
		Version:   version,
		Now:       now.Format(time.RFC3339),
		Updated:   "never",
		Refresh:   statusRefresh,
		Listeners: ex.Listeners,
		Upstreams: len(ex.Upstreams),
	}
	if !ex.Updated.IsZero() {
		p.Updated = ex.Updated.UTC().Format(time.RFC3339) + " (" + ago(now, ex.Updated) + ")"
	}
	p.Fetched = "never"
	if !in.fetched.IsZero() {
		// The data's age: a pool that takes every network-status poll is
		// "updated" while the lists it serves may be hours old.
		p.Fetched = in.fetched.UTC().Format(time.RFC3339) + " (" + ago(now, in.fetched) + ")"
	}
	records := map[int]agent.Service{}
	for _, st := range snap.Services {
		records[st.ID] = st.Record
	}

	byService := map[int]*statusGroup{}
	group := func(service int, kind pool.Kind) *statusGroup {
		g := byService[service]
		if g == nil {
			g = &statusGroup{Service: service, Product: records[service].ProductName, Kind: string(kind)}
			byService[service] = g
		}
		return g
	}
	for _, u := range ex.Upstreams {
		g := group(u.Service, u.Kind)
		row := statusUpstream{
			ID: u.ID, Address: u.Address, Protocol: string(u.Protocol), Session: u.Session, ExitIP: u.ExitIP,
			State: u.State, Reason: u.Reason, Failures: u.Failures, Consecutive: u.ConsecutiveFailures,
			Ejections: u.Ejections, InFlight: u.InFlight,
		}
		if u.EjectedUntil != nil && !u.EjectedUntil.IsZero() {
			row.EjectedUntil = u.EjectedUntil.UTC().Format(time.RFC3339)
			row.Countdown = countdown(now, *u.EjectedUntil)
		}
		g.Upstreams = append(g.Upstreams, row)
	}
	for _, u := range ex.Unserved {
		g := group(u.Service, pool.PPR)
		g.Unserved = append(g.Unserved, u)
	}
	for _, g := range byService {
		g.Summary = stateSummary(g.Upstreams)
		if n := len(g.Unserved); n > 0 {
			if g.Summary != "" {
				g.Summary += ", "
			}
			g.Summary += count(n, "unserved session")
		}
		p.Groups = append(p.Groups, *g)
	}
	slices.SortFunc(p.Groups, func(a, b statusGroup) int { return a.Service - b.Service })

	p.Account = statusAccount{
		Known: snap.AccountKnown, CreditKnown: snap.CreditKnown, Credit: money(snap.Credit),
		InvoicesKnown: snap.InvoicesKnown, Unpaid: snap.UnpaidInvoices, UnpaidUSD: money(snap.UnpaidUSD),
	}
	for _, st := range snap.Services {
		s := statusService{
			ID: st.ID, Product: st.Record.ProductName, Type: st.Record.ProductType, Status: st.Record.Status,
			Due: dateText(st.Record.NextDueDate), Served: true, HasUsage: st.HasUsage,
		}
		if st.HasUsage {
			s.Rate, s.Limit = num(st.Rate), num(st.Limit)
			s.RateValue, s.LimitValue = st.Rate, st.Limit
			s.UsageText = s.Rate + " of " + s.Limit
			if st.Limit > 0 {
				s.Percent = int(100 * st.Rate / st.Limit)
				s.UsageText += fmt.Sprintf(" (%d%%)", s.Percent)
				s.Over = in.atQuota != nil && in.atQuota(st.ID)
			}
		}
		p.Account.Services = append(p.Account.Services, s)
	}
	// The account's other services (suspended, pending, not configured)
	// are listed too: an unpaid or suspended service explains a pool that
	// shrank.
	for _, it := range snap.Unserved() {
		p.Account.Services = append(p.Account.Services, statusService{
			ID: it.ServiceID, Product: it.ProductName, Status: it.Status, Due: dateText(it.NextDueDate),
		})
	}
	slices.SortFunc(p.Account.Services, func(a, b statusService) int { return a.ID - b.ID })

	for i, e := range events {
		if i == statusEvents {
			break
		}
		p.Events = append(p.Events, statusEvent{
			Time: e.Time.UTC().Format(time.RFC3339), Ago: ago(now, e.Time), Kind: e.Kind, Tone: eventTone(e.Kind),
			Upstream: e.Upstream, Service: e.Service, Reason: e.Reason,
		})
	}
	return p
}

func dateText(d agent.Date) string {
	if d.IsZero() {
		return ""
	}
	return d.Format("2006-01-02")
}

// countdown says when an ejection ends: "in 42s", or "due" once passed
// (the next trial connection decides).
func countdown(now, until time.Time) string {
	d := until.Sub(now).Round(time.Second)
	if d <= 0 {
		return "due"
	}
	return "in " + d.String()
}

func ago(now, t time.Time) string {
	d := now.Sub(t).Round(time.Second)
	if d < time.Second {
		return "just now"
	}
	return d.String() + " ago"
}

func stateSummary(ups []statusUpstream) string {
	counts := map[pool.State]int{}
	for _, u := range ups {
		counts[u.State]++
	}
	var b bytes.Buffer
	for _, s := range pool.States() {
		if counts[s] == 0 {
			continue
		}
		if b.Len() > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%d %s", counts[s], s)
	}
	return b.String()
}

// eventTone colours an event kind: what takes capacity away is bad, what
// gives it back is good, the rest is information.
func eventTone(k pool.EventKind) string {
	switch k {
	case pool.EventEjected, pool.EventProviderError, pool.EventProviderInactive, pool.EventRotationFailed,
		pool.EventQuota, pool.EventPanic, pool.EventListUpdateFailed, pool.EventReloadFailed, pool.EventRemoved:
		return "bad"
	case pool.EventReadmitted, pool.EventProviderOK, pool.EventRotated, pool.EventQuotaOK, pool.EventPanicOver,
		pool.EventListUpdated, pool.EventAdded:
		return "good"
	}
	return "info"
}
