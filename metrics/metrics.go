// Package metrics holds proxyd's Prometheus metrics on a registry made in
// main, the Grafana dashboard (grafana/proxyd.json) and the alert rules
// (alerts.yml) that ship with them.
//
// The metric names, types and labels are a contract that dashboards and
// alerts outside this repository rely on: every name starts with proxyd_, and
// every label takes values from a small fixed set (listener and service
// names, result and failure classes, route templates), so the number of
// series stays bounded whatever the traffic. README_monitoring.md lists them.
//
// Two kinds of metrics live here. Events (connections, bytes, retries, hedged
// requests, dials, upstream failures, ejections, rotations, list updates, API
// requests) are counters and histograms whose label values are bound in
// advance, so that the connection path does a few atomic adds and nothing
// else. Things that come and go (upstreams by state, listener health, the
// provider account and its unpaid invoices, the age of the pool state) are
// built at scrape time from the last snapshot handed in, in the manner of
// node_exporter's collectors, so nothing that left stays behind as a stale
// series. A listener is both: its health goes with the reload that removes
// it (SetListeners), while its connection counters stay until main says
// its last incarnation is gone (ListenerGone), since that one may still
// accept and finish connections. A scrape only reads: it forgets nothing.
//
// Left out: labels that identify an upstream, a client, a destination or a
// user. Per-upstream detail belongs to the admin /pool endpoint. The package
// never imports forward's or pool's implementations, only their contract
// types (and agent's route templates), and it does not serve HTTP itself:
// Handler is mounted by main.
package metrics

import (
	"errors"
	"fmt"
	"net/http"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/proxyd/proxyd/forward"
	"github.com/proxyd/proxyd/pool"
)

const namespace = "proxyd"

// Options configures New. The zero value is valid apart from the registry
// requirement described at Gatherer.
type Options struct {
	// Version is proxyd's version, the version label of proxyd_build_info.
	// Default "unknown".
	Version string
	// Listeners are the names of the configured listeners; their series
	// exist at zero from the start. More can be added with AddListener,
	// SetListeners replaces the set after a reload, and ListenerGone
	// forgets a retired one.
	Listeners []string
	// Services are the IDs of the served services; their series exist at
	// zero from the start. SetServices replaces the set after a reload.
	Services []int
	// Gatherer is what Handler serves. Default: the registerer given to New,
	// which must then be a *prometheus.Registry.
	Gatherer prometheus.Gatherer
	// Now is the clock for ages computed at scrape time. Default time.Now.
	Now func() time.Time
}

// Validate reports the first problem with o.
func (o Options) Validate() error {
	seen := make(map[string]bool, len(o.Listeners))
	for _, l := range o.Listeners {
		if l == "" {
			return errors.New("validating listeners: empty listener name")
		}
		if seen[l] {
			return fmt.Errorf("validating listeners: duplicate listener %q", l)
		}
		seen[l] = true
	}
	for _, s := range o.Services {
		if s <= 0 {
			return fmt.Errorf("validating services: service ID %d is not positive", s)
		}
	}
	return nil
}

// Account is the provider-side view of the account that the agent polls.
// The credit's and the invoices' metrics are exposed only once each is
// known (CreditKnown, InvoicesKnown): unknown is not zero.
type Account struct {
	Credit        float64 // USD
	CreditKnown   bool    // the credit has been read at least once
	InvoicesKnown bool    // the invoices have been read at least once (a 0 before would hide unpaid ones)
	// UnpaidInvoices counts the account's unpaid invoices: those whose
	// status is Unpaid or Collections (Payment Pending is not unpaid). An
	// unpaid invoice is how the provider comes to suspend a service, which
	// takes its upstreams away.
	UnpaidInvoices int
	UnpaidUSD      float64 // the sum of their amounts in USD
	Services       []ServiceInfo
}

// ServiceInfo is one service of the account as the provider describes it.
type ServiceInfo struct {
	ID      int
	Product string    // product name
	Kind    string    // "fpr" or "ppr"
	Status  string    // provider status ("Active", "Suspended", ...)
	Due     time.Time // next due date; zero when unknown
}

// Metrics owns every proxyd metric. All methods are safe for concurrent use.
type Metrics struct {
	now      func() time.Time
	gatherer prometheus.Gatherer
	reasons  []string // pool.FailureReasons(), which builds its slice on each call

	failures    *prometheus.CounterVec
	ejections   *prometheus.CounterVec
	rotations   *prometheus.CounterVec
	listUpdates *prometheus.CounterVec
	apiRequests *prometheus.CounterVec
	apiSeconds  *prometheus.HistogramVec
	poolUpdated prometheus.Gauge
	usageRate   *prometheus.GaugeVec
	usageLimit  *prometheus.GaugeVec
	reloadOK    prometheus.Gauge
	reloadTime  prometheus.Gauge

	stateTime atomic.Int64 // unix nanoseconds; 0 = no state yet

	// services are the served services with their event series bound; the
	// map is replaced, never changed, by SetServices under mu.
	services atomic.Pointer[map[int]*serviceCounters]

	mu        sync.Mutex
	listeners map[string]*listenerObserver // current ones, and retired ones until ListenerGone
	// dialGone holds the dials of the listeners ListenerGone forgot:
	// proxyd_upstream_dial_seconds has no listener label, so its totals
	// keep them, or the histogram would go down (guarded by mu).
	dialGone   [len(dialProtocols)]dialHistogram
	account    Account
	poolSource func() pool.Explanation
}

// serviceCounters are the event series of one served service, bound when it
// joins: the pool calls UpstreamFailure, Ejection and Rotation on the
// connection path, where they neither format the service ID nor look up a
// series.
type serviceCounters struct {
	failures    []prometheus.Counter // in the order of Metrics.reasons
	rotations   []prometheus.Counter // in the order of RotationResults()
	listUpdates []prometheus.Counter // in the order of ListUpdateResults()
	ejections   prometheus.Counter
}

// New makes every proxyd metric, registers it with the Go and process
// collectors on reg, and creates the series of the known label values at
// zero.
func New(reg prometheus.Registerer, o Options) (*Metrics, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	if reg == nil {
		return nil, errors.New("making metrics: nil registerer")
	}
	g := o.Gatherer
	if g == nil {
		r, ok := reg.(*prometheus.Registry)
		if !ok {
			return nil, errors.New("making metrics: registerer is not a *prometheus.Registry and Options.Gatherer is nil")
		}
		g = r
	}
	version := o.Version
	if version == "" {
		version = "unknown"
	}
	m := &Metrics{
		now:       o.Now,
		gatherer:  g,
		reasons:   pool.FailureReasons(),
		listeners: make(map[string]*listenerObserver),
	}
	m.services.Store(new(map[int]*serviceCounters))
	if m.now == nil {
		m.now = time.Now
	}

	m.failures = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: namespace, Name: "upstream_failures_total",
		Help: "Failures of upstreams themselves, by service and failure class.",
	}, []string{"service", "reason"})
	m.ejections = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: namespace, Name: "ejections_total",
		Help: "Upstreams ejected after consecutive failures, by service.",
	}, []string{"service"})
	m.rotations = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: namespace, Name: "sticky_rotations_total",
		Help: "Sticky session rotations requested from the provider, by service and result.",
	}, []string{"service", "result"})
	m.listUpdates = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: namespace, Name: "list_updates_total",
		Help: "Fresh IP lists requested from the provider for a service whose IPs keep failing, by service and result.",
	}, []string{"service", "result"})
	m.apiRequests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: namespace, Name: "api_requests_total",
		Help: "Provider API requests, by route template and HTTP status (error: no answer).",
	}, []string{"endpoint", "code"})
	m.apiSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: namespace, Name: "api_request_seconds",
		Help:    "Provider API request latency, by route template.",
		Buckets: []float64{.05, .1, .25, .5, 1, 2.5, 5, 10, 15, 30},
	}, []string{"endpoint"})
	m.poolUpdated = prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: namespace, Name: "pool_last_update_timestamp_seconds",
		Help: "When the upstream pool last took a new snapshot, as a Unix time.",
	})
	m.usageRate = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: namespace, Name: "usage_rate",
		Help: "Usage of a ppr service as the provider's rate endpoint reports it.",
	}, []string{"service"})
	m.usageLimit = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: namespace, Name: "usage_limit",
		Help: "Usage limit of a ppr service as the provider's rate endpoint reports it.",
	}, []string{"service"})
	m.reloadOK = prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: namespace, Name: "config_last_reload_successful",
		Help: "Whether the last configuration load or reload succeeded (1) or was refused (0).",
	})
	m.reloadTime = prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: namespace, Name: "config_last_reload_success_timestamp_seconds",
		Help: "When the configuration was last loaded successfully, as a Unix time.",
	})
	buildInfo := prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: namespace, Name: "build_info",
		Help:        "Always 1; the labels say which proxyd this is.",
		ConstLabels: prometheus.Labels{"version": version, "goversion": runtime.Version()},
	})
	buildInfo.Set(1)
	m.reloadOK.Set(1)
	m.reloadTime.Set(unixSeconds(m.now()))

	cs := []prometheus.Collector{
		newConnCollector(m),
		m.failures, m.ejections, m.rotations, m.listUpdates, m.apiRequests, m.apiSeconds,
		m.poolUpdated, m.usageRate, m.usageLimit, m.reloadOK, m.reloadTime, buildInfo,
		newScrapeCollector(m),
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("registering metrics: %w", err)
		}
	}

	for _, r := range APIRoutes() {
		m.apiSeconds.WithLabelValues(r)
		m.apiRequests.WithLabelValues(r, "200")
		m.apiRequests.WithLabelValues(r, "error")
	}
	for _, l := range o.Listeners {
		m.AddListener(l)
	}
	m.SetServices(o.Services)
	return m, nil
}

// Handler serves the exposition of the gatherer chosen in New. A collector
// that fails does not hide the others.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.gatherer, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError})
}

// AddListener creates the series of a listener at zero, and makes it one of
// the current listeners (again, if SetListeners left it out). It is
// idempotent; Listener calls it.
func (m *Metrics) AddListener(name string) {
	m.listenerObserver(name)
}

func (m *Metrics) listenerObserver(name string) *listenerObserver {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.addListener(name)
}

// addListener is AddListener; the caller holds m.mu.
func (m *Metrics) addListener(name string) *listenerObserver {
	if l, ok := m.listeners[name]; ok {
		l.retired = false
		return l
	}
	l := &listenerObserver{name: name}
	m.listeners[name] = l
	return l
}

// SetListeners makes names the current listeners, after a reload: new ones
// get their series at zero (as with AddListener), and the others are
// retired: no longer in the listener health series, while their connection
// series stay, counting what the retired incarnation still accepts and the
// connections it lets finish, for every scrape to see, until ListenerGone
// forgets them. main calls it where it sets the pool's listener slices.
func (m *Metrics) SetListeners(names []string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, l := range m.listeners {
		l.retired = true
	}
	for _, name := range names {
		m.addListener(name)
	}
}

// ListenerGone forgets the connection series of a listener that a reload
// retired, so that a removed or renamed listener leaves no series behind
// and the set does not grow with every rename. main calls it when a
// retired incarnation of name has finished: its socket closed (or handed
// to its successor) and its connections ended. It forgets nothing when
// name is current again (a reload changed the listener, or brought the
// name back: the series go on), nor while connections counted under name
// are still open (another retired incarnation of the same name still
// drains; its own call forgets them). Forgotten, a name that comes back
// starts over at zero.
func (m *Metrics) ListenerGone(name string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if l, ok := m.listeners[name]; ok && l.retired && l.active() == 0 {
		for p := range l.dial {
			m.dialGone[p].add(&l.dial[p])
		}
		delete(m.listeners, name)
	}
}

// Listener returns the observer of one listener's connections, with every
// series bound in advance: its methods do neither allocation nor lookup.
func (m *Metrics) Listener(name string) forward.Observer {
	return m.listenerObserver(name)
}

// SetServices replaces the set of served services after a reload or an
// account poll: new services get their series at zero, and the usage gauges
// of services that left are removed. Their counters stay, as counters do.
func (m *Metrics) SetServices(ids []int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	old := *m.services.Load()
	next := make(map[int]*serviceCounters, len(ids))
	for _, id := range ids {
		switch {
		case old[id] != nil:
			next[id] = old[id]
		case next[id] == nil:
			next[id] = m.bindService(id)
		}
	}
	for id := range old {
		if next[id] == nil {
			m.ForgetUsage(id)
		}
	}
	m.services.Store(&next)
}

// bindService creates the event series of a service at zero.
func (m *Metrics) bindService(id int) *serviceCounters {
	s := strconv.Itoa(id)
	c := &serviceCounters{ejections: m.ejections.WithLabelValues(s)}
	for _, r := range m.reasons {
		c.failures = append(c.failures, m.failures.WithLabelValues(s, r))
	}
	for _, r := range RotationResults() {
		c.rotations = append(c.rotations, m.rotations.WithLabelValues(s, r))
	}
	for _, r := range ListUpdateResults() {
		c.listUpdates = append(c.listUpdates, m.listUpdates.WithLabelValues(s, r))
	}
	return c
}

// UpstreamFailure counts a failure of an upstream of service. Only the
// classes of pool.FailureReasons() are counted: the other results
// (ok, destination_error, canceled) say nothing about the upstream.
func (m *Metrics) UpstreamFailure(service int, reason string) {
	i := slices.Index(m.reasons, reason)
	if i < 0 {
		return
	}
	if c := (*m.services.Load())[service]; c != nil {
		c.failures[i].Inc()
		return
	}
	m.failures.WithLabelValues(strconv.Itoa(service), reason).Inc() // not served (any more)
}

// Ejection counts an ejection of an upstream of service.
func (m *Metrics) Ejection(service int) {
	if c := (*m.services.Load())[service]; c != nil {
		c.ejections.Inc()
		return
	}
	m.ejections.WithLabelValues(strconv.Itoa(service)).Inc()
}

// Rotation counts a sticky rotation of a session of service; result is one
// of RotationResults(), anything else counts as "error".
func (m *Metrics) Rotation(service int, result string) {
	i, result := requestResult(result)
	if c := (*m.services.Load())[service]; c != nil {
		c.rotations[i].Inc()
		return
	}
	m.rotations.WithLabelValues(strconv.Itoa(service), result).Inc()
}

// ListUpdate counts a request for a fresh IP list of service; result is one
// of ListUpdateResults() (rate_limited: the provider answered 429), anything
// else counts as "error".
func (m *Metrics) ListUpdate(service int, result string) {
	i, result := requestResult(result)
	if c := (*m.services.Load())[service]; c != nil {
		c.listUpdates[i].Inc()
		return
	}
	m.listUpdates.WithLabelValues(strconv.Itoa(service), result).Inc()
}

// APIRequest counts one provider API request. route is the route template
// (one of APIRoutes, optionally after a method: "GET /api/services"); code is
// the HTTP status or "error" when no answer came. Its signature is that of
// the agent's observe hook.
func (m *Metrics) APIRequest(route, code string, took time.Duration) {
	r := normalizeRoute(route)
	m.apiRequests.WithLabelValues(r, normalizeCode(code)).Inc()
	m.apiSeconds.WithLabelValues(r).Observe(took.Seconds())
}

// SetAccount keeps the last account data; proxyd_account_credit_usd,
// proxyd_invoices_unpaid, proxyd_invoices_unpaid_usd, proxyd_service_info and
// proxyd_service_due_timestamp_seconds are built from it at scrape time.
func (m *Metrics) SetAccount(a Account) {
	a.Services = slices.Clone(a.Services)
	m.mu.Lock()
	m.account = a
	m.mu.Unlock()
}

// ForgetUsage removes a ppr service's usage gauges: the provider has no
// figures for it (any more).
func (m *Metrics) ForgetUsage(service int) {
	s := strconv.Itoa(service)
	m.usageRate.DeleteLabelValues(s)
	m.usageLimit.DeleteLabelValues(s)
}

// SetUsage sets the usage rate and limit of a ppr service.
func (m *Metrics) SetUsage(service int, rate, limit float64) {
	s := strconv.Itoa(service)
	m.usageRate.WithLabelValues(s).Set(rate)
	m.usageLimit.WithLabelValues(s).Set(limit)
}

// ConfigReloaded records the outcome of a configuration reload. The initial
// load is counted as a success by New.
func (m *Metrics) ConfigReloaded(ok bool) {
	if !ok {
		m.reloadOK.Set(0)
		return
	}
	m.reloadOK.Set(1)
	m.reloadTime.Set(unixSeconds(m.now()))
}

// PoolUpdated records when the pool took a new snapshot.
func (m *Metrics) PoolUpdated(t time.Time) {
	if t.IsZero() {
		return
	}
	m.poolUpdated.Set(unixSeconds(t))
}

// SetStateTime records the time of the pool state being served (the time of
// the last good provider data, also after it was loaded from the state
// file); proxyd_state_age_seconds is now minus t, computed at scrape time.
// Until it is first called the age is not exposed.
func (m *Metrics) SetStateTime(t time.Time) {
	if t.IsZero() {
		return
	}
	m.stateTime.Store(t.UnixNano())
}

// StateTime is what SetStateTime last set, the time
// proxyd_state_age_seconds counts from; zero before.
func (m *Metrics) StateTime() time.Time {
	if ns := m.stateTime.Load(); ns != 0 {
		return time.Unix(0, ns)
	}
	return time.Time{}
}

// SetPoolSource sets the function that the scrape-time collector calls for
// proxyd_upstreams, proxyd_listener_usable_upstreams and
// proxyd_listener_panic. Until it is set those metrics are not exposed:
// unknown is not zero. Listener health is exported for the listeners the
// explanation names (the pool's listener slices, which exist now); one that
// names none leaves the current listeners (see SetListeners) at 0 usable.
func (m *Metrics) SetPoolSource(f func() pool.Explanation) {
	m.mu.Lock()
	m.poolSource = f
	m.mu.Unlock()
}

func unixSeconds(t time.Time) float64 { return float64(t.UnixNano()) / 1e9 }
