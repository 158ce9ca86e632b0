package metrics

import (
	"maps"
	"slices"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/proxyd/proxyd/pool"
)

// scrapeCollector builds, at each scrape, the metrics of things that come and
// go: upstreams by state and listener health from the pool snapshot, the
// account from the agent's last poll, and the age of the pool state.
type scrapeCollector struct {
	m *Metrics

	upstreams, usable, panicking, credit, unpaid, unpaidUSD, serviceInfo, serviceDue, stateAge *prometheus.Desc
}

func newScrapeCollector(m *Metrics) *scrapeCollector {
	return &scrapeCollector{
		m: m,
		upstreams: prometheus.NewDesc("proxyd_upstreams",
			"Upstreams in the pool, by service and state.", []string{"service", "state"}, nil),
		usable: prometheus.NewDesc("proxyd_listener_usable_upstreams",
			"Upstreams a listener can pick now.", []string{"listener"}, nil),
		panicking: prometheus.NewDesc("proxyd_listener_panic",
			"1 while a listener is in panic mode: more of its upstreams fail than may be ejected at once.", []string{"listener"}, nil),
		credit: prometheus.NewDesc("proxyd_account_credit_usd",
			"Credit of the provider account in USD.", nil, nil),
		unpaid: prometheus.NewDesc("proxyd_invoices_unpaid",
			"Unpaid invoices of the provider account (status Unpaid or Collections); an unpaid invoice is how services get suspended.", nil, nil),
		unpaidUSD: prometheus.NewDesc("proxyd_invoices_unpaid_usd",
			"Sum of the unpaid invoices of the provider account in USD.", nil, nil),
		serviceInfo: prometheus.NewDesc("proxyd_service_info",
			"Always 1 for each service of the account; the labels describe it.", []string{"service", "product", "kind", "status"}, nil),
		serviceDue: prometheus.NewDesc("proxyd_service_due_timestamp_seconds",
			"Next due date of a service, as a Unix time.", []string{"service"}, nil),
		stateAge: prometheus.NewDesc("proxyd_state_age_seconds",
			"Age of the pool state being served: time since its provider data was fetched.", nil, nil),
	}
}

func (c *scrapeCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.upstreams, c.usable, c.panicking, c.credit, c.unpaid, c.unpaidUSD, c.serviceInfo, c.serviceDue, c.stateAge} {
		ch <- d
	}
}

func (c *scrapeCollector) Collect(ch chan<- prometheus.Metric) {
	m := c.m
	m.mu.Lock()
	src := m.poolSource
	account := m.account
	services := slices.Collect(maps.Keys(*m.services.Load()))
	listeners := make([]string, 0, len(m.listeners))
	for name, l := range m.listeners {
		if !l.retired {
			listeners = append(listeners, name)
		}
	}
	m.mu.Unlock()

	if src != nil {
		c.collectPool(ch, src(), services, listeners)
	}
	if account.CreditKnown {
		ch <- prometheus.MustNewConstMetric(c.credit, prometheus.GaugeValue, account.Credit)
	}
	if account.InvoicesKnown {
		ch <- prometheus.MustNewConstMetric(c.unpaid, prometheus.GaugeValue, float64(account.UnpaidInvoices))
		ch <- prometheus.MustNewConstMetric(c.unpaidUSD, prometheus.GaugeValue, account.UnpaidUSD)
	}
	seen := make(map[int]bool, len(account.Services))
	for _, s := range account.Services {
		if seen[s.ID] {
			continue // one series per service, whatever the agent hands in
		}
		seen[s.ID] = true
		id := strconv.Itoa(s.ID)
		ch <- prometheus.MustNewConstMetric(c.serviceInfo, prometheus.GaugeValue, 1, id, s.Product, s.Kind, s.Status)
		if !s.Due.IsZero() {
			ch <- prometheus.MustNewConstMetric(c.serviceDue, prometheus.GaugeValue, unixSeconds(s.Due), id)
		}
	}
	if t := m.stateTime.Load(); t != 0 {
		age := m.now().Sub(time.Unix(0, t)).Seconds()
		ch <- prometheus.MustNewConstMetric(c.stateAge, prometheus.GaugeValue, max(age, 0))
	}
}

// collectPool emits every state for every service that is served or present
// in the snapshot (zeros included, so a state that empties reads 0 rather
// than vanishing), and the health of the listeners that exist now: those
// the snapshot explains, the pool's listener slices, which main sets from
// the configuration at each reload. A snapshot that explains none (a pool
// without listener slices) leaves the current listeners with nothing
// usable. A listener known here but not explained is not exported: a
// reload removed or renamed it, and 0 usable would fire
// ProxydNoUsableUpstream for a listener that is gone.
func (c *scrapeCollector) collectPool(ch chan<- prometheus.Metric, e pool.Explanation, services []int, listeners []string) {
	states := pool.States()
	counts := make(map[int]map[pool.State]int)
	for _, id := range services {
		counts[id] = make(map[pool.State]int, len(states))
	}
	for _, u := range e.Upstreams {
		byState := counts[u.Service]
		if byState == nil {
			byState = make(map[pool.State]int, len(states))
			counts[u.Service] = byState
		}
		byState[u.State]++
	}
	ids := make([]int, 0, len(counts))
	for id := range counts {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		s := strconv.Itoa(id)
		for _, st := range states {
			ch <- prometheus.MustNewConstMetric(c.upstreams, prometheus.GaugeValue, float64(counts[id][st]), s, string(st))
		}
	}

	explained := make(map[string]bool, len(e.Listeners))
	for _, l := range e.Listeners {
		if explained[l.Name] {
			continue
		}
		explained[l.Name] = true
		ch <- prometheus.MustNewConstMetric(c.usable, prometheus.GaugeValue, float64(l.Usable), l.Name)
		ch <- prometheus.MustNewConstMetric(c.panicking, prometheus.GaugeValue, boolValue(l.Panic), l.Name)
	}
	if len(explained) > 0 {
		return
	}
	for _, name := range listeners {
		ch <- prometheus.MustNewConstMetric(c.usable, prometheus.GaugeValue, 0, name)
		ch <- prometheus.MustNewConstMetric(c.panicking, prometheus.GaugeValue, 0, name)
	}
}

func boolValue(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
