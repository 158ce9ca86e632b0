package metrics

import (
	"slices"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/proxyd/proxyd/forward"
	"github.com/proxyd/proxyd/pool"
)

// dialBounds are the bucket upper bounds of proxyd_upstream_dial_seconds.
var dialBounds = [...]time.Duration{
	5 * time.Millisecond, 10 * time.Millisecond, 25 * time.Millisecond, 50 * time.Millisecond,
	100 * time.Millisecond, 250 * time.Millisecond, 500 * time.Millisecond,
	time.Second, 2500 * time.Millisecond, 5 * time.Second, 10 * time.Second,
}

// dialProtocols are the protocol label values, in the index order of
// listenerObserver.dial.
var dialProtocols = [...]pool.Protocol{pool.HTTP, pool.SOCKS5}

// listenerObserver is the forward.Observer of one listener. The connection
// path is the hottest caller of this package, so it does plain atomic adds on
// fields of its own and nothing else: one add per Opened, three or four per
// Closed, two per Dialed. The active gauge is opened minus closed, and the
// histogram count is the sum of its buckets, both computed at scrape time by
// connCollector; that saves an add on every call.
type listenerObserver struct {
	name    string
	retired bool // left out by SetListeners; under Metrics.mu
	opened  atomic.Uint64
	results [forward.NumOutcomes]atomic.Uint64
	invalid atomic.Uint64 // closed with an outcome out of range: a caller bug, kept out of results
	up      atomic.Uint64
	down    atomic.Uint64
	retries atomic.Uint64
	hedged  atomic.Uint64
	// requests counts plain HTTP requests by result (an outcome out of
	// range, a caller bug, is not counted).
	requests [forward.NumOutcomes]atomic.Uint64
	dial     [len(dialProtocols)]dialHistogram
}

// dialHistogram holds non-cumulative bucket counts (the last one is +Inf)
// and the sum of the observed durations in nanoseconds.
type dialHistogram struct {
	buckets  [len(dialBounds) + 1]atomic.Uint64
	sumNanos atomic.Uint64
}

// add adds o's counts to h.
func (h *dialHistogram) add(o *dialHistogram) {
	for i := range o.buckets {
		h.buckets[i].Add(o.buckets[i].Load())
	}
	h.sumNanos.Add(o.sumNanos.Load())
}

var _ forward.Observer = (*listenerObserver)(nil)

func (l *listenerObserver) Opened() { l.opened.Add(1) }

func (l *listenerObserver) Closed(o forward.Outcome, up, down int64, retries int) {
	if o < forward.NumOutcomes {
		l.results[o].Add(1)
	} else {
		l.invalid.Add(1)
	}
	// Negative counts are a caller bug; they must not make counters go down.
	if up > 0 {
		l.up.Add(uint64(up))
	}
	if down > 0 {
		l.down.Add(uint64(down))
	}
	if retries > 0 {
		l.retries.Add(uint64(retries))
	}
}

// Hedged counts a plain request sent through one more upstream.
func (l *listenerObserver) Hedged() { l.hedged.Add(1) }

// Requested counts a plain HTTP request answered with result o.
func (l *listenerObserver) Requested(o forward.Outcome) {
	if o < forward.NumOutcomes {
		l.requests[o].Add(1)
	}
}

// Dialed records a successful dial; an unknown protocol is ignored.
func (l *listenerObserver) Dialed(p pool.Protocol, took time.Duration) {
	k := slices.Index(dialProtocols[:], p)
	if k < 0 {
		return
	}
	h := &l.dial[k]
	took = max(took, 0)
	i := 0
	for i < len(dialBounds) && took > dialBounds[i] {
		i++
	}
	h.buckets[i].Add(1)
	h.sumNanos.Add(uint64(took))
}

// connCollector exposes the listeners' connection counters at scrape time.
type connCollector struct {
	m *Metrics

	connections, active, bytes, retries, hedged, requests, dial *prometheus.Desc
}

func newConnCollector(m *Metrics) *connCollector {
	return &connCollector{
		m: m,
		connections: prometheus.NewDesc("proxyd_connections_total",
			"Client connections that ended, by listener and result class.", []string{"listener", "result"}, nil),
		active: prometheus.NewDesc("proxyd_connections_active",
			"Client connections open now, by listener.", []string{"listener"}, nil),
		bytes: prometheus.NewDesc("proxyd_bytes_total",
			"Bytes relayed, by listener and direction (up: client to upstream, down: back).", []string{"listener", "direction"}, nil),
		retries: prometheus.NewDesc("proxyd_retries_total",
			"Further upstreams tried after a failed dial or handshake, by listener.", []string{"listener"}, nil),
		hedged: prometheus.NewDesc("proxyd_hedged_requests_total",
			"Plain requests also sent through one more upstream after the hedge delay without an answer head, by listener.", []string{"listener"}, nil),
		requests: prometheus.NewDesc("proxyd_http_requests_total",
			"Plain HTTP requests (absolute URI, upgrades included; not CONNECT) answered, by listener and result class: "+
				"a keep-alive connection carries many, and proxyd_connections_total counts only its last.", []string{"listener", "result"}, nil),
		dial: prometheus.NewDesc("proxyd_upstream_dial_seconds",
			"Time of a successful dial and proxy handshake through an upstream, by upstream protocol.", []string{"protocol"}, nil),
	}
}

func (c *connCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.connections, c.active, c.bytes, c.retries, c.hedged, c.requests, c.dial} {
		ch <- d
	}
}

// active is how many connections l counted as opened and not closed.
// Results are read before opened: a connection counted as closed was
// opened before, so the difference does not go below zero.
func (l *listenerObserver) active() uint64 {
	var closed uint64
	for o := range forward.NumOutcomes {
		closed += l.results[o].Load()
	}
	closed += l.invalid.Load()
	opened := l.opened.Load()
	return opened - min(closed, opened)
}

// Collect exports every listener the Metrics knows, current and retired
// alike: a scrape only reads, and a retired listener's series go only when
// main says its incarnation is gone (Metrics.ListenerGone).
func (c *connCollector) Collect(ch chan<- prometheus.Metric) {
	var (
		counts [len(dialProtocols)][len(dialBounds) + 1]uint64
		sums   [len(dialProtocols)]uint64
	)
	c.m.mu.Lock()
	ls := make([]*listenerObserver, 0, len(c.m.listeners))
	for _, l := range c.m.listeners {
		ls = append(ls, l)
	}
	for p := range c.m.dialGone { // read with the map: a forgotten listener counts here or there, once
		for i := range c.m.dialGone[p].buckets {
			counts[p][i] = c.m.dialGone[p].buckets[i].Load()
		}
		sums[p] = c.m.dialGone[p].sumNanos.Load()
	}
	c.m.mu.Unlock()

	for _, l := range ls {
		for o := range forward.NumOutcomes {
			ch <- prometheus.MustNewConstMetric(c.connections, prometheus.CounterValue, float64(l.results[o].Load()), l.name, o.String())
			ch <- prometheus.MustNewConstMetric(c.requests, prometheus.CounterValue, float64(l.requests[o].Load()), l.name, o.String())
		}
		ch <- prometheus.MustNewConstMetric(c.active, prometheus.GaugeValue, float64(l.active()), l.name)
		ch <- prometheus.MustNewConstMetric(c.bytes, prometheus.CounterValue, float64(l.up.Load()), l.name, "up")
		ch <- prometheus.MustNewConstMetric(c.bytes, prometheus.CounterValue, float64(l.down.Load()), l.name, "down")
		ch <- prometheus.MustNewConstMetric(c.retries, prometheus.CounterValue, float64(l.retries.Load()), l.name)
		ch <- prometheus.MustNewConstMetric(c.hedged, prometheus.CounterValue, float64(l.hedged.Load()), l.name)
		for p := range l.dial {
			// Sum after buckets, so the sum never lags the count it goes with.
			for i := range l.dial[p].buckets {
				counts[p][i] += l.dial[p].buckets[i].Load()
			}
			sums[p] += l.dial[p].sumNanos.Load()
		}
	}
	for p, proto := range dialProtocols {
		var total uint64
		buckets := make(map[float64]uint64, len(dialBounds))
		for i, b := range dialBounds {
			total += counts[p][i]
			buckets[b.Seconds()] = total
		}
		total += counts[p][len(dialBounds)]
		ch <- prometheus.MustNewConstHistogram(c.dial, total, time.Duration(sums[p]).Seconds(), buckets, string(proto))
	}
}
