package agent

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/proxyd/proxyd/agent/providersim"
	"github.com/proxyd/proxyd/internal/syncbuf"
)

// Unpaid invoices: status Unpaid or Collections, every other status not;
// amounts as numbers or strings.
func TestUnpaidInvoices(t *testing.T) {
	body := `[
		{"id":1,"status":"Unpaid","amount":"3.50"},
		{"id":2,"status":"Collections","amount":10},
		{"id":3,"status":"Unpaid","amount":1.25},
		{"id":4,"status":"Unpaid","amount":"7"},
		{"id":5,"status":"Paid","amount":"100.00"},
		{"id":6,"status":"Cancelled","amount":100},
		{"id":7,"status":"Refunded","amount":"100"},
		{"id":8,"status":"Payment Pending","amount":"100.00"},
		{"id":9,"status":"Pending","amount":100},
		{"id":10,"status":"Collections","amount":""}
	]`
	var invoices []Invoice
	if err := json.Unmarshal([]byte(body), &invoices); err != nil {
		t.Fatal(err)
	}
	n, usd := unpaidTotal(invoices)
	if n != 5 || usd != 3.5+10+1.25+7 {
		t.Errorf("unpaid %d invoices, %v USD; want 5, 21.75", n, usd)
	}
	for status, want := range map[string]bool{"Unpaid": true, "Collections": true, "Paid": false, "Cancelled": false,
		"Refunded": false, "Payment Pending": false, "Pending": false, "": false} {
		if unpaid(status) != want {
			t.Errorf("unpaid(%q) = %v", status, !want)
		}
	}
}

// The account round fills the snapshot's unpaid invoices from the
// simulator's, and the usage round reads rate without polling stats.
func TestPollerAccountAndUsage(t *testing.T) {
	p, sim, _ := newPollerForTest(t, DefaultPollConfig())
	pollAll(t, p)
	s := p.Snapshot()
	if !s.InvoicesKnown || len(s.Invoices) == 0 {
		t.Fatalf("invoices not known: %+v", s.Invoices)
	}
	n, usd := unpaidTotal(s.Invoices)
	if n != 1 || usd != 20.50 {
		t.Errorf("the default world has one unpaid invoice of 20.50 USD; counted %d, %v", n, usd)
	}
	if s.UnpaidInvoices != n || s.UnpaidUSD != usd {
		t.Errorf("snapshot unpaid %d/%v, want %d/%v", s.UnpaidInvoices, s.UnpaidUSD, n, usd)
	}
	if st := serviceByID(s, 102); st == nil || !st.HasUsage {
		t.Errorf("no usage for 102: %+v", st)
	}
	if got := sim.Requests(RouteStats); got != 0 {
		t.Errorf("stats polled %d times; nothing uses it", got)
	}
	if sim.Requests(RouteRate) == 0 {
		t.Error("rate not polled")
	}
}

// When a list cannot be parsed in json, the same round tries txt (and then
// csv), keeps the first that parses for that list type, and logs the
// choice once.
func TestPollerListFormatFallback(t *testing.T) {
	sim := providersim.New(providersim.Config{})
	var mu sync.Mutex
	formats := map[string]int{}
	c := interceptClient(t, sim, 5*time.Second, func(w http.ResponseWriter, r *http.Request) bool {
		if rest, ok := strings.CutPrefix(r.URL.Path, "/api/iplist/"); ok {
			parts := strings.Split(rest, "/")
			mu.Lock()
			formats[parts[0]+"/"+parts[1]]++
			mu.Unlock()
			if parts[1] == "json" && parts[0] == "http-auth" {
				io.WriteString(w, "<html><body>Service temporarily unavailable</body></html>")
				return true
			}
		}
		return false
	})
	var logBuf syncbuf.Buffer
	logger := slog.New(slog.NewTextHandler(&logBuf, nil))
	p, err := NewPoller(c, pollConfig(func(c *PollConfig) { c.Services = []int{101} }), nil, logger)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := p.PollOnce(ctx, LoopAccount); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := p.PollOnce(ctx, LoopLists); err != nil {
			t.Fatalf("lists round: %v", err)
		}
		if got := serviceByID(p.Snapshot(), 101).Lists["http-auth"]; len(got) != 3 || got[0].Login == "" {
			t.Fatalf("http-auth list: %+v", got)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if formats["http-auth/json"] != 1 || formats["http-auth/txt"] != 3 || formats["http-auth/csv"] != 0 {
		t.Errorf("http-auth requests by format %v: want json once, then txt in every round", formats)
	}
	if formats["socks-ip/json"] != 3 || formats["socks-ip/txt"] != 0 {
		t.Errorf("socks-ip requests by format %v: its json parses, it keeps json", formats)
	}
	if n := strings.Count(logBuf.String(), "IP list format chosen"); n != 1 {
		t.Errorf("format choice logged %d times:\n%s", n, logBuf.String())
	}
}
