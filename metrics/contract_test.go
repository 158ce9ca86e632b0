package metrics

import (
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/proxyd/proxyd/forward"
	"github.com/proxyd/proxyd/pool"
)

// TestContract checks every metric other programs may rely on (dashboards,
// alert rules, an operator's own queries): its name, type and label names,
// and the label values it may take.
func TestContract(t *testing.T) {
	_, families := scriptedFamilies(t)
	got := make(map[string]*dto.MetricFamily)
	for _, f := range families {
		got[f.GetName()] = f
	}
	counter, gauge, histogram := dto.MetricType_COUNTER, dto.MetricType_GAUGE, dto.MetricType_HISTOGRAM
	outcomes := make([]string, 0, forward.NumOutcomes)
	for o := range forward.NumOutcomes {
		outcomes = append(outcomes, o.String())
	}
	states := make([]string, 0, len(pool.States()))
	for _, s := range pool.States() {
		states = append(states, string(s))
	}
	for _, c := range []struct {
		name   string
		typ    dto.MetricType
		labels []string
		values map[string][]string // allowed values of some labels
	}{
		{"proxyd_connections_total", counter, []string{"listener", "result"}, map[string][]string{"result": outcomes}},
		{"proxyd_http_requests_total", counter, []string{"listener", "result"}, map[string][]string{"result": outcomes}},
		{"proxyd_connections_active", gauge, []string{"listener"}, nil},
		{"proxyd_bytes_total", counter, []string{"direction", "listener"}, map[string][]string{"direction": {"up", "down"}}},
		{"proxyd_retries_total", counter, []string{"listener"}, nil},
		{"proxyd_upstream_dial_seconds", histogram, []string{"protocol"}, map[string][]string{"protocol": {"http", "socks5"}}},
		{"proxyd_upstreams", gauge, []string{"service", "state"}, map[string][]string{"state": states}},
		{"proxyd_upstream_failures_total", counter, []string{"reason", "service"}, map[string][]string{"reason": pool.FailureReasons()}},
		{"proxyd_sticky_rotations_total", counter, []string{"result", "service"}, map[string][]string{"result": RotationResults()}},
		{"proxyd_api_requests_total", counter, []string{"code", "endpoint"}, map[string][]string{"endpoint": append(APIRoutes(), OtherRoute)}},
		{"proxyd_api_request_seconds", histogram, []string{"endpoint"}, map[string][]string{"endpoint": append(APIRoutes(), OtherRoute)}},
		{"proxyd_pool_last_update_timestamp_seconds", gauge, nil, nil},
		{"proxyd_account_credit_usd", gauge, nil, nil},
		{"proxyd_service_info", gauge, []string{"kind", "product", "service", "status"}, nil},
		{"proxyd_service_due_timestamp_seconds", gauge, []string{"service"}, nil},
		{"proxyd_usage_rate", gauge, []string{"service"}, nil},
		{"proxyd_usage_limit", gauge, []string{"service"}, nil},
		{"proxyd_config_last_reload_successful", gauge, nil, nil},
		{"proxyd_build_info", gauge, []string{"goversion", "version"}, nil},
		{"proxyd_listener_usable_upstreams", gauge, []string{"listener"}, nil},
		{"proxyd_listener_panic", gauge, []string{"listener"}, nil},
		{"proxyd_ejections_total", counter, []string{"service"}, nil},
		{"proxyd_state_age_seconds", gauge, nil, nil},
		{"proxyd_hedged_requests_total", counter, []string{"listener"}, nil},
		{"proxyd_invoices_unpaid", gauge, nil, nil},
		{"proxyd_invoices_unpaid_usd", gauge, nil, nil},
		{"proxyd_list_updates_total", counter, []string{"result", "service"}, map[string][]string{"result": ListUpdateResults()}},
	} {
		f := got[c.name]
		if f == nil {
			t.Errorf("%s is not exported", c.name)
			continue
		}
		if f.GetType() != c.typ {
			t.Errorf("%s is a %v, want %v", c.name, f.GetType(), c.typ)
		}
		for _, mt := range f.GetMetric() {
			var names []string
			for _, lp := range mt.GetLabel() {
				names = append(names, lp.GetName())
				if allowed, ok := c.values[lp.GetName()]; ok && !slices.Contains(allowed, lp.GetValue()) {
					t.Errorf("%s{%s=%q}: not an allowed value %q", c.name, lp.GetName(), lp.GetValue(), allowed)
				}
			}
			if !slices.Equal(names, c.labels) {
				t.Errorf("%s has labels %q, want %q", c.name, names, c.labels)
			}
			if c.name == "proxyd_service_info" || c.name == "proxyd_build_info" {
				if v := mt.GetGauge().GetValue(); v != 1 {
					t.Errorf("%s = %v, want 1", c.name, v)
				}
			}
		}
	}
}

// TestConcurrentUse scrapes while every kind of event and update happens:
// it keeps gathering until each worker has gone round many times, so the
// scrapes really overlap the updates.
func TestConcurrentUse(t *testing.T) {
	reg, m := newTestMetrics(t)
	scriptedRun(m)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	var rounds []*atomic.Int64
	worker := func(f func(i int)) {
		n := new(atomic.Int64)
		rounds = append(rounds, n)
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
					f(i)
					n.Add(1)
				}
			}
		})
	}
	busy := func() bool {
		for _, n := range rounds {
			if n.Load() < 100 {
				return true
			}
		}
		return false
	}
	l := m.Listener("http")
	worker(func(int) {
		l.Opened()
		l.Dialed(pool.SOCKS5, time.Millisecond)
		l.Closed(forward.OutcomeOK, 10, 20, 0)
	})
	worker(func(i int) {
		m.APIRequest("/api/services", "200", time.Millisecond)
		m.UpstreamFailure(101, "dial_timeout")
		m.SetUsage(202, float64(i), 100)
		m.SetStateTime(epoch)
		m.ListUpdate(101+i%2, "ok")
	})
	worker(func(i int) {
		m.SetAccount(Account{CreditKnown: true, InvoicesKnown: true, Credit: float64(i), UnpaidInvoices: i % 3, UnpaidUSD: float64(i), Services: []ServiceInfo{{ID: 101, Product: "p", Kind: "fpr", Status: "Active"}}})
		m.SetServices([]int{101, 202 + i%2})
		m.AddListener("socks")
		m.SetListeners([]string{"http", "socks"}[:1+i%2]) // retires socks every other round
		m.ListenerGone("socks")                           // and forgets it then
	})
	for gathers := 0; gathers < 5 || busy(); gathers++ {
		if _, err := reg.Gather(); err != nil {
			t.Error(err)
			break
		}
	}
	close(stop)
	wg.Wait()
}
