package metrics

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/proxyd/proxyd/forward"
	"github.com/proxyd/proxyd/pool"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata")

// epoch is the fixed clock of the tests, so that the golden file holds.
var epoch = time.Date(2026, 11, 21, 10, 0, 0, 0, time.UTC)

func newTestMetrics(t testing.TB) (*prometheus.Registry, *Metrics) {
	t.Helper()
	reg := prometheus.NewRegistry()
	m, err := New(reg, Options{
		Version:   "1.2.3",
		Listeners: []string{"http", "socks"},
		Services:  []int{101, 202},
		Now:       func() time.Time { return epoch },
	})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return reg, m
}

// scriptedFamilies gathers a fresh Metrics after scriptedRun.
func scriptedFamilies(t *testing.T) (*Metrics, []*dto.MetricFamily) {
	t.Helper()
	reg, m := newTestMetrics(t)
	scriptedRun(m)
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	return m, families
}

// countSeries is testutil.GatherAndCount failing the test when gathering
// fails, so that an error cannot pass for "no series".
func countSeries(t *testing.T, g prometheus.Gatherer, names ...string) int {
	t.Helper()
	n, err := testutil.GatherAndCount(g, names...)
	if err != nil {
		t.Fatalf("counting %q: %v", names, err)
	}
	return n
}

// sumSeries adds up the values of every series of a family; for a histogram,
// its sample counts.
func sumSeries(t *testing.T, g prometheus.Gatherer, name string) float64 {
	t.Helper()
	families, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		var sum float64
		for _, mt := range f.GetMetric() {
			sum += mt.GetCounter().GetValue() + mt.GetGauge().GetValue() + float64(mt.GetHistogram().GetSampleCount())
		}
		return sum
	}
	t.Fatalf("%s is not exported", name)
	return 0
}

// Secrets and identities the scripted run hands to the package in places
// where they could leak into labels; none may appear in the exposition.
var leaky = []string{
	"1.2.3.4", "1.2.3.4:8080", "[2001:db8::1]:1080", "gw1.example-provider.net",
	"gw1.example-provider.net:9000", "sess123", "alice", "s3cret", "203.0.113.7",
}

// scriptedRun drives m through every kind of event: connections of each
// result class, dials, failures, an ejection, rotations, list updates, API
// polls, the account with unpaid invoices, usage, the pool snapshot, a failed
// reload.
func scriptedRun(m *Metrics) {
	httpL, socksL := m.Listener("http"), m.Listener("socks")
	for o := range forward.NumOutcomes {
		httpL.Opened()
		if o == forward.OutcomeOK || o == forward.OutcomeUpstreamError {
			httpL.Dialed(pool.HTTP, 30*time.Millisecond)
		}
		retries := 0
		if o == forward.OutcomeUpstreamError {
			retries = 2
		}
		httpL.Closed(o, 1000, 5000, retries)
	}
	// A keep-alive connection of three plain requests, the first two of
	// which failed: proxyd_connections_total says ok, the requests all.
	httpL.Opened()
	httpL.Requested(forward.OutcomeUpstreamError)
	httpL.Requested(forward.OutcomeDestinationError)
	httpL.Requested(forward.OutcomeOK)
	httpL.Closed(forward.OutcomeOK, 10, 20, 0)
	socksL.Opened()
	socksL.Dialed(pool.SOCKS5, 120*time.Millisecond)
	socksL.Closed(forward.OutcomeOK, 300, 70000, 1)
	socksL.Opened() // still open at scrape time

	for range 3 {
		m.UpstreamFailure(101, "dial_refused")
	}
	m.UpstreamFailure(101, "destination_error") // not the upstream's fault: not counted
	m.UpstreamFailure(202, "handshake_timeout")
	m.Ejection(101)
	m.Rotation(202, "ok")
	m.Rotation(202, "rate_limited")
	m.ListUpdate(101, "rate_limited")
	m.ListUpdate(101, "ok")

	m.APIRequest("/api/services", "200", 120*time.Millisecond)
	m.APIRequest("GET /api/iplist/{typel}/{formatl}/{id}", "200", 300*time.Millisecond)
	m.APIRequest("/api/iplist/http-auth/txt/101", "200", 200*time.Millisecond) // filled in: other
	m.APIRequest("/api/networkstatus/errors/{id}", "error", 15*time.Second)
	m.APIRequest("/api/billing/credit", "503", 50*time.Millisecond)
	m.APIRequest("/api/sticky/rotate/{id}/{server}/{session}", "429", 80*time.Millisecond)

	m.SetAccount(Account{Credit: 42.5, CreditKnown: true, InvoicesKnown: true, UnpaidInvoices: 2, UnpaidUSD: 13.5, Services: []ServiceInfo{
		{ID: 101, Product: "Static Datacenter 10", Kind: "fpr", Status: "Active", Due: epoch.Add(30 * 24 * time.Hour)},
		{ID: 202, Product: "Rotating Residential 5 GB", Kind: "ppr", Status: "Active", Due: epoch.Add(2 * 24 * time.Hour)},
	}})
	m.SetUsage(202, 4.5, 5)
	m.PoolUpdated(epoch.Add(-time.Minute))
	m.SetStateTime(epoch.Add(-90 * time.Second))
	m.ConfigReloaded(false)

	until := epoch.Add(30 * time.Second)
	m.SetPoolSource(func() pool.Explanation {
		return pool.Explanation{
			Updated: epoch.Add(-time.Minute),
			Listeners: []pool.ListenerExplanation{
				{Name: "http", Usable: 2, Total: 3},
				{Name: "socks", Usable: 1, Total: 2, Panic: true},
			},
			Upstreams: []pool.UpstreamExplanation{
				{ID: "101/http/1.2.3.4:8080", Service: 101, Kind: pool.FPR, Protocol: pool.HTTP, Address: "1.2.3.4:8080", State: pool.Healthy},
				{ID: "101/socks5/[2001:db8::1]:1080", Service: 101, Kind: pool.FPR, Protocol: pool.SOCKS5, Address: "[2001:db8::1]:1080", State: pool.Ejected, Reason: "dial_refused", EjectedUntil: &until},
				{ID: "202/http/gw1.example-provider.net:9000/sess123", Service: 202, Kind: pool.PPR, Protocol: pool.HTTP, Address: "gw1.example-provider.net:9000", Server: "gw1.example-provider.net", Session: "sess123", ExitIP: "203.0.113.7", State: pool.Rotating},
				{ID: "202/http/gw1.example-provider.net:9001", Service: 202, Kind: pool.PPR, Protocol: pool.HTTP, Address: "gw1.example-provider.net:9001", State: pool.Healthy},
			},
		}
	})
}

// scrape fetches /metrics from m's handler over a real socket.
func scrape(t *testing.T, m *Metrics) []byte {
	t.Helper()
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/metrics", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatalf("scraping: %v", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading scrape: %v", err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape status %d: %s", resp.StatusCode, body)
	}
	return body
}

// proxydOnly keeps the proxyd_ families (the Go and process collectors vary
// from run to run) and replaces the Go version, which varies by toolchain.
func proxydOnly(exposition []byte) []byte {
	var out bytes.Buffer
	goversion := regexp.MustCompile(`goversion="[^"]*"`)
	for line := range strings.Lines(string(exposition)) {
		name := line
		if rest, ok := strings.CutPrefix(line, "# HELP "); ok {
			name = rest
		} else if rest, ok := strings.CutPrefix(line, "# TYPE "); ok {
			name = rest
		}
		if !strings.HasPrefix(name, "proxyd_") {
			continue
		}
		out.WriteString(goversion.ReplaceAllString(line, `goversion="GOVERSION"`))
	}
	return out.Bytes()
}

func TestExpositionGolden(t *testing.T) {
	_, m := newTestMetrics(t)
	scriptedRun(m)
	full := scrape(t, m)
	got := proxydOnly(full)

	golden := filepath.Join("testdata", "metrics.golden")
	if *update {
		if err := os.WriteFile(golden, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatalf("reading golden file (regenerate with go test ./metrics -run Golden -update): %v", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("exposition differs from %s (regenerate with -update after checking the change):\n%s", golden, lineDiff(string(want), string(got)))
	}

	for _, family := range []string{"go_goroutines", "process_start_time_seconds", "proxyd_build_info"} {
		if !bytes.Contains(full, []byte("\n"+family)) {
			t.Errorf("exposition lacks %s", family)
		}
	}

	promtool := promtoolPath(t)
	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = bytes.NewReader(full)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("promtool check metrics: %v\n%s", err, out)
	}
}

// lineDiff lists the lines only in want (-) and only in got (+).
func lineDiff(want, got string) string {
	in := func(s string) map[string]bool {
		m := map[string]bool{}
		for l := range strings.Lines(s) {
			m[l] = true
		}
		return m
	}
	w, g := in(want), in(got)
	var b strings.Builder
	for l := range strings.Lines(want) {
		if !g[l] {
			b.WriteString("- " + l)
		}
	}
	for l := range strings.Lines(got) {
		if !w[l] {
			b.WriteString("+ " + l)
		}
	}
	return b.String()
}

// promtoolPath finds promtool (on PATH, or where Debian's prometheus package
// puts it); without it the test skips, or fails under CI.
func promtoolPath(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"promtool", "/usr/bin/promtool"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("promtool not found (apt-get install prometheus)")
	}
	t.Skip("promtool not found (apt-get install prometheus); CI=true makes this a failure")
	return ""
}

func TestCardinality(t *testing.T) {
	m, families := scriptedFamilies(t)
	ipv4 := regexp.MustCompile(`\b\d{1,3}(\.\d{1,3}){3}\b`)
	ipv6 := regexp.MustCompile(`(?i)[0-9a-f]{0,4}:[0-9a-f]{0,4}:[0-9a-f:]*`)
	hostPort := regexp.MustCompile(`[^\s/:]+:\d{1,5}$`)
	hostname := regexp.MustCompile(`(?i)^([a-z0-9-]+\.)+[a-z]{2,}$`)
	allowedLabels := map[string]bool{
		"listener": true, "result": true, "direction": true, "protocol": true, "service": true,
		"state": true, "reason": true, "endpoint": true, "code": true, "product": true,
		"kind": true, "status": true, "version": true, "goversion": true,
	}
	n := 0
	for _, f := range families {
		for _, mt := range f.GetMetric() {
			for _, lp := range mt.GetLabel() {
				n++
				name, v := lp.GetName(), lp.GetValue()
				if strings.HasPrefix(f.GetName(), "proxyd_") && !allowedLabels[name] {
					t.Errorf("%s has label %q, which is not one of proxyd's bounded labels", f.GetName(), name)
				}
				for _, re := range []*regexp.Regexp{ipv4, ipv6, hostPort, hostname} {
					if re.MatchString(v) {
						t.Errorf("%s{%s=%q}: label value looks like an address or host (%s)", f.GetName(), name, v, re)
					}
				}
				for _, s := range leaky {
					if strings.Contains(v, s) {
						t.Errorf("%s{%s=%q}: label value holds %q from an upstream, client or user", f.GetName(), name, v, s)
					}
				}
			}
		}
	}
	if n == 0 {
		t.Fatal("no labels gathered")
	}
	// Unbounded input maps onto bounded values.
	m.APIRequest("/api/service/101", "599 weird", time.Second)
	m.Rotation(202, "gw1.example-provider.net")
	m.ListUpdate(101, "gw1.example-provider.net")
	if got := testutil.ToFloat64(m.apiRequests.WithLabelValues(OtherRoute, "error")); got != 1 {
		t.Errorf("filled-in path with a bad code: other/error = %v, want 1", got)
	}
	if got := testutil.ToFloat64(m.rotations.WithLabelValues("202", "error")); got != 1 {
		t.Errorf("unknown rotation result: error = %v, want 1", got)
	}
	if got := testutil.ToFloat64(m.listUpdates.WithLabelValues("101", "error")); got != 1 {
		t.Errorf("unknown list update result: error = %v, want 1", got)
	}
}

func TestPreCreatedSeries(t *testing.T) {
	reg, _ := newTestMetrics(t)
	for name, want := range map[string]int{
		"proxyd_connections_total":                  2 * int(forward.NumOutcomes),
		"proxyd_connections_active":                 2,
		"proxyd_bytes_total":                        2 * 2,
		"proxyd_retries_total":                      2,
		"proxyd_upstream_dial_seconds":              2,
		"proxyd_upstream_failures_total":            2 * len(pool.FailureReasons()),
		"proxyd_sticky_rotations_total":             2 * 3,
		"proxyd_list_updates_total":                 2 * 3,
		"proxyd_hedged_requests_total":              2,
		"proxyd_ejections_total":                    2,
		"proxyd_api_requests_total":                 2 * len(APIRoutes()),
		"proxyd_api_request_seconds":                len(APIRoutes()),
		"proxyd_build_info":                         1,
		"proxyd_config_last_reload_successful":      1,
		"proxyd_pool_last_update_timestamp_seconds": 1,
		"proxyd_upstreams":                          0, // no pool source yet: unknown is not zero
		"proxyd_listener_usable_upstreams":          0,
		"proxyd_account_credit_usd":                 0, // not known yet
		"proxyd_invoices_unpaid":                    0,
		"proxyd_invoices_unpaid_usd":                0,
		"proxyd_state_age_seconds":                  0,
	} {
		if got, err := testutil.GatherAndCount(reg, name); err != nil || got != want {
			t.Errorf("%s: %d series (err %v), want %d", name, got, err, want)
		}
	}
	if got := len(APIRoutes()); got != 18 {
		t.Errorf("APIRoutes: %d templates, want 18 (20 endpoints, two pairs share a path)", got)
	}
}

func TestScrapeTimeSeriesFollowSnapshots(t *testing.T) {
	reg, m := newTestMetrics(t)
	var exp pool.Explanation
	m.SetPoolSource(func() pool.Explanation { return exp })

	// No upstream yet: every state of each served service reads 0, and each
	// known listener has nothing usable.
	if got := countSeries(t, reg, "proxyd_upstreams"); got != 2*len(pool.States()) {
		t.Errorf("proxyd_upstreams: %d series, want %d", got, 2*len(pool.States()))
	}
	check := func(name, text string) {
		t.Helper()
		if err := testutil.GatherAndCompare(reg, strings.NewReader(text), name); err != nil {
			t.Error(err)
		}
	}
	check("proxyd_listener_usable_upstreams", `
# HELP proxyd_listener_usable_upstreams Upstreams a listener can pick now.
# TYPE proxyd_listener_usable_upstreams gauge
proxyd_listener_usable_upstreams{listener="http"} 0
proxyd_listener_usable_upstreams{listener="socks"} 0
`)

	// A service outside the configured set appears with all its states; after
	// a reload that drops it and an empty snapshot, it is gone.
	exp = pool.Explanation{Upstreams: []pool.UpstreamExplanation{{Service: 303, State: pool.Quota}}}
	if got := countSeries(t, reg, "proxyd_upstreams"); got != 3*len(pool.States()) {
		t.Errorf("with service 303: %d series, want %d", got, 3*len(pool.States()))
	}
	m.SetUsage(202, 1, 2)
	m.SetServices([]int{101})
	exp = pool.Explanation{}
	if got := countSeries(t, reg, "proxyd_upstreams"); got != len(pool.States()) {
		t.Errorf("after SetServices([101]): %d series, want %d", got, len(pool.States()))
	}
	if got := countSeries(t, reg, "proxyd_usage_rate", "proxyd_usage_limit"); got != 0 {
		t.Errorf("usage of a service that left: %d series, want 0", got)
	}

	// Service info is rebuilt from the last account only.
	m.SetAccount(Account{CreditKnown: true, InvoicesKnown: true, Credit: 1, Services: []ServiceInfo{{ID: 101, Product: "A", Kind: "fpr", Status: "Active"}, {ID: 202, Product: "B", Kind: "ppr", Status: "Active", Due: epoch}}})
	m.SetAccount(Account{CreditKnown: true, InvoicesKnown: true, Credit: 2, Services: []ServiceInfo{{ID: 101, Product: "A", Kind: "fpr", Status: "Suspended"}}})
	check("proxyd_service_info", `
# HELP proxyd_service_info Always 1 for each service of the account; the labels describe it.
# TYPE proxyd_service_info gauge
proxyd_service_info{kind="fpr",product="A",service="101",status="Suspended"} 1
`)
	if got := countSeries(t, reg, "proxyd_service_due_timestamp_seconds"); got != 0 {
		t.Errorf("due date of a service that left: %d series, want 0", got)
	}

	// A listener added after a reload has its series at once.
	m.AddListener("extra")
	if got := countSeries(t, reg, "proxyd_connections_total"); got != 3*int(forward.NumOutcomes) {
		t.Errorf("after AddListener: %d connection series, want %d", got, 3*int(forward.NumOutcomes))
	}
}

// Listener health is exported for the listeners that exist now: those the
// pool explains. A listener a reload removed or renamed would otherwise
// read "0 usable upstreams" forever, and ProxydNoUsableUpstream fire for it.
func TestListenerHealthOnlyForCurrentListeners(t *testing.T) {
	reg, m := newTestMetrics(t) // listeners http, socks
	m.AddListener("socks5")     // a reload renamed socks to socks5
	m.SetPoolSource(func() pool.Explanation {
		return pool.Explanation{Listeners: []pool.ListenerExplanation{
			{Name: "http", Usable: 3, Total: 3}, {Name: "socks5", Usable: 2, Total: 3, Panic: true},
		}}
	})
	want := `
# HELP proxyd_listener_panic 1 while a listener is in panic mode: more of its upstreams fail than may be ejected at once.
# TYPE proxyd_listener_panic gauge
proxyd_listener_panic{listener="http"} 0
proxyd_listener_panic{listener="socks5"} 1
# HELP proxyd_listener_usable_upstreams Upstreams a listener can pick now.
# TYPE proxyd_listener_usable_upstreams gauge
proxyd_listener_usable_upstreams{listener="http"} 3
proxyd_listener_usable_upstreams{listener="socks5"} 2
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "proxyd_listener_usable_upstreams", "proxyd_listener_panic"); err != nil {
		t.Error(err)
	}
}

// SetListeners makes a set of listeners current: the others' connection
// series stay, however often they are scraped, while their incarnation
// drains, and are gone once main says it is (ListenerGone); a pool that
// explains no listener leaves the current ones at 0 usable.
func TestRetiredListenerGoesWhenItsIncarnationIsGone(t *testing.T) {
	reg, m := newTestMetrics(t) // listeners http, socks
	m.SetPoolSource(func() pool.Explanation { return pool.Explanation{} })
	socks := m.Listener("socks")
	socks.Opened() // a tunnel that outlives the reload
	m.SetListeners([]string{"http", "socks5"})
	check := func(when, name, want string) {
		t.Helper()
		if err := testutil.GatherAndCompare(reg, strings.NewReader(want), name); err != nil {
			t.Errorf("%s: %v", when, err)
		}
	}
	const usable = `
# HELP proxyd_listener_usable_upstreams Upstreams a listener can pick now.
# TYPE proxyd_listener_usable_upstreams gauge
proxyd_listener_usable_upstreams{listener="http"} 0
proxyd_listener_usable_upstreams{listener="socks5"} 0
`
	check("after the reload", "proxyd_listener_usable_upstreams", usable)
	const active = `
# HELP proxyd_connections_active Client connections open now, by listener.
# TYPE proxyd_connections_active gauge
proxyd_connections_active{listener="http"} 0
`
	check("after the reload", "proxyd_connections_active", active+`proxyd_connections_active{listener="socks"} 1
proxyd_connections_active{listener="socks5"} 0
`)
	m.ListenerGone("socks") // too early: a tunnel is open
	socks.Closed(forward.OutcomeOK, 10, 20, 0)
	for _, when := range []string{"its last tunnel closed", "scraped again"} {
		check(when, "proxyd_connections_active", active+`proxyd_connections_active{listener="socks"} 0
proxyd_connections_active{listener="socks5"} 0
`)
	}
	m.ListenerGone("socks") // its incarnation is gone
	check("then", "proxyd_connections_active", active+`proxyd_connections_active{listener="socks5"} 0
`)
	if got := countSeries(t, reg, "proxyd_connections_total"); got != 2*int(forward.NumOutcomes) {
		t.Errorf("connection series of two listeners: %d, want %d", got, 2*int(forward.NumOutcomes))
	}
	check("then", "proxyd_listener_usable_upstreams", usable)
	// Made current again, a listener starts over at zero.
	m.AddListener("socks")
	check("socks added again", "proxyd_connections_active", active+`proxyd_connections_active{listener="socks"} 0
proxyd_connections_active{listener="socks5"} 0
`)
	if got := sumSeries(t, reg, "proxyd_bytes_total"); got != 0 {
		t.Errorf("bytes after socks came back: %g, want 0", got)
	}
	// A current listener is not forgotten: a reload that changed it
	// retires its old incarnation under the same name.
	m.Listener("socks").Closed(forward.OutcomeOK, 1, 1, 0)
	m.ListenerGone("socks")
	if got := sumSeries(t, reg, "proxyd_bytes_total"); got != 2 {
		t.Errorf("bytes of a current listener after ListenerGone: %g, want 2", got)
	}
}

// proxyd_upstream_dial_seconds has no listener label: the dials of a
// listener that a reload removed stay in it once the listener's own series
// go, or the histogram would go down and read as a reset.
func TestDialHistogramKeepsForgottenListeners(t *testing.T) {
	reg, m := newTestMetrics(t) // listeners http, socks
	socks := m.Listener("socks")
	for range 5 {
		socks.Opened()
		socks.Dialed(pool.HTTP, 30*time.Millisecond)
		socks.Closed(forward.OutcomeOK, 1, 1, 0)
	}
	m.Listener("http").Dialed(pool.HTTP, 2*time.Second)
	count := func() (n, sum float64) {
		t.Helper()
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() != "proxyd_upstream_dial_seconds" {
				continue
			}
			for _, s := range mf.GetMetric() {
				if s.GetLabel()[0].GetValue() == "http" {
					h := s.GetHistogram()
					return float64(h.GetSampleCount()), h.GetSampleSum()
				}
			}
		}
		t.Fatal("no proxyd_upstream_dial_seconds{protocol=\"http\"}")
		return 0, 0
	}
	n0, sum0 := count()
	m.SetListeners([]string{"http"})
	m.ListenerGone("socks")
	if n, sum := count(); n != 6 || n0 != 6 || math.Abs(sum-sum0) > 1e-9 {
		t.Errorf("dial count %g (sum %g) after socks was forgotten, %g (sum %g) before", n, sum, n0, sum0)
	}
	if err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP proxyd_connections_active Client connections open now, by listener.
# TYPE proxyd_connections_active gauge
proxyd_connections_active{listener="http"} 0
`), "proxyd_connections_active"); err != nil {
		t.Errorf("the forgotten listener's own series: %v", err)
	}
}

// A retired listener's socket may still accept for a moment after the
// reload, and any scrape may come in between (a second Prometheus, a
// curl): what it counts then is counted, and every scrape sees it.
func TestRetiredListenerCountsSurviveScrapes(t *testing.T) {
	reg, m := newTestMetrics(t) // listeners http, socks
	socks := m.Listener("socks")
	m.SetListeners([]string{"http"}) // socks removed, its socket not closed yet
	_ = sumSeries(t, reg, "proxyd_connections_total")
	socks.Opened() // accepted before the close
	socks.Closed(forward.OutcomeOK, 1, 2, 0)
	for _, when := range []string{"first", "second"} {
		if got := sumSeries(t, reg, "proxyd_connections_total"); got != 1 {
			t.Errorf("%s scrape: proxyd_connections_total sums to %g after one connection, want 1", when, got)
		}
	}
}

// The invoice gauges appear once the account is known, hold what the last
// account says, and read 0 (not nothing) once the invoices are paid.
func TestUnpaidInvoices(t *testing.T) {
	reg, m := newTestMetrics(t)
	const help = `
# HELP proxyd_invoices_unpaid Unpaid invoices of the provider account (status Unpaid or Collections); an unpaid invoice is how services get suspended.
# TYPE proxyd_invoices_unpaid gauge
# HELP proxyd_invoices_unpaid_usd Sum of the unpaid invoices of the provider account in USD.
# TYPE proxyd_invoices_unpaid_usd gauge
`
	check := func(when, values string) {
		t.Helper()
		if err := testutil.GatherAndCompare(reg, strings.NewReader(help+values), "proxyd_invoices_unpaid", "proxyd_invoices_unpaid_usd"); err != nil {
			t.Errorf("%s: %v", when, err)
		}
	}
	m.SetAccount(Account{UnpaidInvoices: 1, UnpaidUSD: 3.5}) // not known: not shown
	if got := countSeries(t, reg, "proxyd_invoices_unpaid", "proxyd_invoices_unpaid_usd"); got != 0 {
		t.Errorf("before the account is known: %d series, want 0", got)
	}
	m.SetAccount(Account{CreditKnown: true, InvoicesKnown: true, UnpaidInvoices: 3, UnpaidUSD: 27.25})
	check("three unpaid", "proxyd_invoices_unpaid 3\nproxyd_invoices_unpaid_usd 27.25\n")
	m.SetAccount(Account{CreditKnown: true, InvoicesKnown: true, Credit: 5})
	check("paid", "proxyd_invoices_unpaid 0\nproxyd_invoices_unpaid_usd 0\n")
	// The credit read, the invoices not (their endpoint failed so far): no
	// invoice series, rather than a 0 that would hide unpaid ones; and the
	// other way round.
	m.SetAccount(Account{CreditKnown: true, Credit: 5})
	if got := countSeries(t, reg, "proxyd_invoices_unpaid", "proxyd_invoices_unpaid_usd"); got != 0 {
		t.Errorf("invoices not read: %d invoice series, want 0", got)
	}
	if got := countSeries(t, reg, "proxyd_account_credit_usd"); got != 1 {
		t.Errorf("credit read: %d credit series, want 1", got)
	}
	m.SetAccount(Account{InvoicesKnown: true, UnpaidInvoices: 1, UnpaidUSD: 3.5})
	check("credit not read", "proxyd_invoices_unpaid 1\nproxyd_invoices_unpaid_usd 3.5\n")
	if got := countSeries(t, reg, "proxyd_account_credit_usd"); got != 0 {
		t.Errorf("credit not read: %d credit series, want 0", got)
	}
}

func TestConfigReloadAndState(t *testing.T) {
	reg, m := newTestMetrics(t)
	m.ConfigReloaded(false)
	if got := testutil.ToFloat64(m.reloadOK); got != 0 {
		t.Errorf("after a failed reload: %v, want 0", got)
	}
	m.ConfigReloaded(true)
	if got := testutil.ToFloat64(m.reloadOK); got != 1 {
		t.Errorf("after a good reload: %v, want 1", got)
	}
	m.SetStateTime(epoch.Add(-time.Hour))
	if err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP proxyd_state_age_seconds Age of the pool state being served: time since its provider data was fetched.
# TYPE proxyd_state_age_seconds gauge
proxyd_state_age_seconds 3600
`), "proxyd_state_age_seconds"); err != nil {
		t.Error(err)
	}
}

func TestObserverRobustness(t *testing.T) {
	reg, m := newTestMetrics(t)
	l := m.Listener("http")
	if l != m.Listener("http") {
		t.Error("Listener returns a different observer for the same name")
	}
	l.Opened()
	l.Closed(forward.Outcome(200), -1, -5, -3) // must not panic
	l.Dialed("carrier-pigeon", time.Second)    // unknown protocol: ignored
	if err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP proxyd_connections_active Client connections open now, by listener.
# TYPE proxyd_connections_active gauge
proxyd_connections_active{listener="http"} 0
proxyd_connections_active{listener="socks"} 0
`), "proxyd_connections_active"); err != nil {
		t.Errorf("active after open and a bad close: %v", err)
	}
	if got := countSeries(t, reg, "proxyd_upstream_dial_seconds"); got != 2 {
		t.Errorf("dial histograms: %d, want one per protocol", got)
	}
	// The bad close counts as no result, no byte and no retry, and the
	// unknown protocol's dial goes into no histogram.
	for _, name := range []string{"proxyd_connections_total", "proxyd_bytes_total", "proxyd_retries_total", "proxyd_upstream_dial_seconds"} {
		if got := sumSeries(t, reg, name); got != 0 {
			t.Errorf("%s after a bad close and an unknown dial: %v, want 0", name, got)
		}
	}
}

func TestNewErrors(t *testing.T) {
	for name, tc := range map[string]struct {
		reg prometheus.Registerer
		o   Options
	}{
		"nil registerer":     {nil, Options{}},
		"not a registry":     {prometheus.WrapRegistererWithPrefix("x_", prometheus.NewRegistry()), Options{}},
		"empty listener":     {prometheus.NewRegistry(), Options{Listeners: []string{""}}},
		"duplicate listener": {prometheus.NewRegistry(), Options{Listeners: []string{"a", "a"}}},
		"bad service":        {prometheus.NewRegistry(), Options{Services: []int{0}}},
	} {
		if _, err := New(tc.reg, tc.o); err == nil {
			t.Errorf("%s: New succeeded", name)
		}
	}
	reg := prometheus.NewRegistry()
	if _, err := New(reg, Options{}); err != nil {
		t.Fatal(err)
	}
	if _, err := New(reg, Options{}); err == nil {
		t.Error("registering twice on one registry succeeded")
	}
	// A wrapped registerer works when a gatherer is given.
	inner := prometheus.NewRegistry()
	if _, err := New(prometheus.WrapRegistererWith(prometheus.Labels{"instance_role": "a"}, inner), Options{Gatherer: inner}); err != nil {
		t.Errorf("wrapped registerer with gatherer: %v", err)
	}
}

func TestObserverDoesNotAllocate(t *testing.T) {
	_, m := newTestMetrics(t)
	l := m.Listener("http")
	allocs := testing.AllocsPerRun(1000, func() {
		l.Opened()
		l.Dialed(pool.HTTP, 20*time.Millisecond)
		l.Closed(forward.OutcomeOK, 1234, 56789, 1)
	})
	if allocs != 0 {
		t.Errorf("connection metrics allocate %v times per connection", allocs)
	}
}

// The pool's hooks run on the connection path: for a served service they
// count through series bound in advance, without allocating; a service
// outside the served set is counted all the same.
func TestServiceEventsDoNotAllocate(t *testing.T) {
	_, m := newTestMetrics(t)
	check := func(when string, want map[string]float64) {
		t.Helper()
		got := map[string]float64{
			"failures 101":     testutil.ToFloat64(m.failures.WithLabelValues("101", "dial_refused")),
			"ejections 101":    testutil.ToFloat64(m.ejections.WithLabelValues("101")),
			"rate_limited 202": testutil.ToFloat64(m.rotations.WithLabelValues("202", "rate_limited")),
			"ejections 303":    testutil.ToFloat64(m.ejections.WithLabelValues("303")),
			"error 303":        testutil.ToFloat64(m.rotations.WithLabelValues("303", "error")),
			"list ok 101":      testutil.ToFloat64(m.listUpdates.WithLabelValues("101", "ok")),
			"list error 303":   testutil.ToFloat64(m.listUpdates.WithLabelValues("303", "error")),
		}
		for k, v := range want {
			if got[k] != v {
				t.Errorf("%s: %s = %v, want %v", when, k, got[k], v)
			}
		}
	}
	const runs = 1000
	allocs := testing.AllocsPerRun(runs, func() {
		m.UpstreamFailure(101, "dial_refused")
		m.Ejection(101)
		m.Rotation(202, "rate_limited")
		m.ListUpdate(101, "ok")
	})
	if allocs != 0 {
		t.Errorf("service events allocate %v times per round", allocs)
	}
	// AllocsPerRun runs the function once more to warm up.
	check("served", map[string]float64{"failures 101": runs + 1, "ejections 101": runs + 1, "rate_limited 202": runs + 1, "list ok 101": runs + 1})
	m.SetServices([]int{202}) // 101 leaves: its counters stay and still count
	m.UpstreamFailure(101, "dial_refused")
	m.Ejection(303)
	m.Rotation(303, "bogus")
	m.ListUpdate(303, "bogus")
	check("not served", map[string]float64{"failures 101": runs + 2, "ejections 303": 1, "error 303": 1, "list error 303": 1})
}

// BenchmarkConnectionMetrics is the metrics work of one connection: open,
// one successful dial, close with bytes (and, in the second case, a retry).
// Budget: 50 ns. The baseline is the floor on this machine: six bare atomic
// adds, what a connection with a dial and no retry costs at the least.
func BenchmarkConnectionMetrics(b *testing.B) {
	b.Run("baseline=6-atomic-adds", func(b *testing.B) {
		var c [6]atomic.Uint64
		for b.Loop() {
			for i := range c {
				c[i].Add(uint64(i + 1))
			}
		}
	})
	for _, retries := range []int{0, 1} {
		b.Run(fmt.Sprintf("retries=%d", retries), func(b *testing.B) {
			_, m := newTestMetrics(b)
			l := m.Listener("http")
			b.ReportAllocs()
			for b.Loop() {
				l.Opened()
				l.Dialed(pool.HTTP, 20*time.Millisecond)
				l.Closed(forward.OutcomeOK, 1234, 56789, retries)
			}
		})
	}
}

func BenchmarkConnectionMetricsParallel(b *testing.B) {
	_, m := newTestMetrics(b)
	l := m.Listener("http")
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			l.Opened()
			l.Dialed(pool.HTTP, 20*time.Millisecond)
			l.Closed(forward.OutcomeOK, 1234, 56789, 1)
		}
	})
}
