package providersim

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

var update = flag.Bool("update", false, "rewrite testdata/*.golden from the simulator's answers")

// endpoints holds one successful request per endpoint of the spec, in the
// spec's order, against the default world.
var endpoints = []struct {
	name, method, path, route, body string
}{
	{"01-clients", "GET", "/api/clients", "/api/clients", ""},
	{"02-stats", "GET", "/api/stats/102", "/api/stats/{id}", ""},
	{"03-rate", "GET", "/api/rate/102", "/api/rate/{id}", ""},
	{"04-product-fpr", "GET", "/api/product/11", "/api/product/{pid}", ""},
	{"05-order", "POST", "/api/product/11", "/api/product/{pid}", `{"clientid":7,"setip":"198.18.0.9"}`},
	{"06-products", "GET", "/api/products", "/api/products", ""},
	{"07-products-orderby", "GET", "/api/products/orderby/price", "/api/products/orderby/{field}", ""},
	{"08-networkstatus-errors", "GET", "/api/networkstatus/errors/101", "/api/networkstatus/errors/{id}", ""},
	{"09-networkstatus-inactive", "GET", "/api/networkstatus/inactive/101", "/api/networkstatus/inactive/{id}", ""},
	{"10-credit", "GET", "/api/billing/credit", "/api/billing/credit", ""},
	{"11-invoices", "GET", "/api/billing/invoices", "/api/billing/invoices", ""},
	{"12-invoice", "GET", "/api/billing/invoice/7002", "/api/billing/invoice/{id}", ""},
	{"13-service-fpr", "GET", "/api/service/101", "/api/service/{id}", ""},
	{"14-services", "GET", "/api/services", "/api/services", ""},
	{"15-service-update", "PUT", "/api/service/101", "/api/service/{id}", `{"setip":"198.18.0.10","update_list":"true","password":"bmV3LXBhc3N3b3Jk"}`},
	{"16-iplist", "GET", "/api/iplist/http-auth/txt/101", "/api/iplist/{typel}/{formatl}/{id}", ""},
	{"17-sticky-list", "GET", "/api/sticky/list/102", "/api/sticky/list/{id}", ""},
	{"18-sticky-rotate", "GET", "/api/sticky/rotate/102/gw1.sim.example/s1", "/api/sticky/rotate/{id}/{server}/{session}", ""},
	{"19-sticky-changettl", "GET", "/api/sticky/changettl/102/15", "/api/sticky/changettl/{id}/{ttl}", ""},
	{"20-sticky-resetall", "GET", "/api/sticky/resetall/102", "/api/sticky/resetall/{id}", ""},
}

// golden compares got with testdata/name.golden (rewritten under -update).
func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name+".golden")
	if *update {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("reading golden file: %v (run go test -update)", err)
	}
	if got != string(want) {
		t.Errorf("%s:\n got %q\nwant %q", name, got, want)
	}
}

// TestEndpointsGolden walks every endpoint's success path in order and
// compares the exact bytes served (key names and order, numbers encoded
// as strings where the world says so, empty dates).
func TestEndpointsGolden(t *testing.T) {
	ts := newTestSim(t, Config{})
	extra := []struct{ name, path string }{
		{"04-product-ppr", "/api/product/13"},
		{"04-product-hidden", "/api/product/14"},
		{"13-service-ppr", "/api/service/102"},
		{"13-service-strings", "/api/service/103"},
		{"13-service-new", "/api/service/106"},
		{"17-sticky-list-after", "/api/sticky/list/102"},
	}
	for _, e := range endpoints {
		a := ts.do(t, e.method, e.path, e.body)
		if a.status != http.StatusOK {
			t.Errorf("%s: status %d %q", e.name, a.status, a.body)
		}
		golden(t, e.name, a.contentType+"\n"+a.body)
	}
	for _, e := range extra {
		a := ts.do(t, "GET", e.path, "")
		if a.status != http.StatusOK {
			t.Errorf("%s: status %d %q", e.name, a.status, a.body)
		}
		golden(t, e.name, a.contentType+"\n"+a.body)
	}
}

func TestRequestsCountsRouteTemplates(t *testing.T) {
	ts := newTestSim(t, Config{})
	for _, e := range endpoints {
		ts.do(t, e.method, e.path, e.body)
	}
	ts.doAuth(t, "GET", "/api/clients", "", "") // refused, still counted
	want := map[string]int{}
	for _, e := range endpoints {
		want[e.route]++
		want[e.method+" "+e.route]++
	}
	want["/api/clients"]++
	want["GET /api/clients"]++
	for route, n := range want {
		if got := ts.Requests(route); got != n {
			t.Errorf("Requests(%q) = %d, want %d", route, got, n)
		}
	}
	if got := ts.Requests("/api/nope"); got != 0 {
		t.Errorf("Requests of an unknown route = %d", got)
	}
}

// TestAuthErrors checks every authentication answer of the API byte-exact on every
// endpoint.
func TestAuthErrors(t *testing.T) {
	ts := newTestSim(t, Config{})
	cases := []struct {
		name, header string
		status       int
		body         string
	}{
		{"missing", "", 401, "Unauthenticated"},
		{"wrong token", "Basic wrong-token", 401, "Unauthenticated"},
		{"wrong password", "Basic " + b64(DefaultLogin+":nope"), 401, "Unauthenticated"},
		{"wrong login", "Basic " + b64("eve@example.com:"+DefaultPassword), 401, "Unauthenticated"},
		{"base64 of binary", "Basic " + b64("\x00\x01\xff\xfe"), 401, "Unauthenticated"},
		{"other scheme", "Bearer " + DefaultToken, 400, "Invalid Authorization header"},
		{"scheme only", "Basic", 400, "Invalid Authorization header"},
		{"empty credential", "Basic   ", 400, "Invalid Authorization header"},
		{"two credentials", "Basic " + DefaultToken + " x", 400, "Invalid Authorization header"},
		{"token without scheme", DefaultToken, 400, "Invalid Authorization header"},
		{"no colon", "Basic " + b64("demo@example.com"), 400, "Invalid credentials format"},
		{"pipe instead of colon", "Basic " + b64(DefaultLogin+"|"+DefaultPassword), 400, "Invalid credentials format"},
	}
	for _, c := range cases {
		for _, e := range endpoints {
			a := ts.doAuth(t, e.method, e.path, e.body, c.header)
			a.want(t, c.name+" "+e.name, c.status, c.body)
			if a.contentType != "text/plain; charset=utf-8" {
				t.Errorf("%s %s: content type %q", c.name, e.name, a.contentType)
			}
		}
	}
	// Nothing was changed by refused requests.
	if got := ts.Credit(); got != InitialCredit {
		t.Errorf("credit after refused orders = %v", got)
	}
}

func TestAuthAccepted(t *testing.T) {
	ts := newTestSim(t, Config{Token: "tok3n", Login: "me@example.org", Password: "p:w"})
	for _, h := range []string{
		"Basic tok3n",
		"basic tok3n",
		"Basic  tok3n ",
		"Basic " + b64("me@example.org:p:w"), // the password may hold a colon
	} {
		ts.doAuth(t, "GET", "/api/billing/credit", "", h).want(t, h, 200, `{"credit":100}`)
	}
	ts.doAuth(t, "GET", "/api/billing/credit", "", "Basic "+DefaultToken).want(t, "default token of another sim", 401, "Unauthenticated")
}

func TestUnknownRouteAfterAuth(t *testing.T) {
	ts := newTestSim(t, Config{})
	ts.doAuth(t, "GET", "/api/nope", "", "").want(t, "unknown route without auth", 401, "Unauthenticated")
	if a := ts.do(t, "GET", "/api/nope", ""); a.status != http.StatusNotFound {
		t.Errorf("unknown route: %d", a.status)
	}
	if a := ts.do(t, "DELETE", "/api/service/101", ""); a.status != http.StatusMethodNotAllowed {
		t.Errorf("wrong method: %d", a.status)
	}
}

func TestFailNext(t *testing.T) {
	ts := newTestSim(t, Config{})
	ts.FailNext(2, 503, "<html>maintenance</html>")
	// Refused requests do not consume failures.
	ts.doAuth(t, "GET", "/api/clients", "", "").want(t, "unauthenticated", 401, "Unauthenticated")
	for i := range 2 {
		a := ts.do(t, "GET", "/api/iplist/http-ip/txt/101", "")
		a.want(t, fmt.Sprint("failure ", i), 503, "<html>maintenance</html>")
		if a.contentType != "text/plain; charset=utf-8" {
			t.Errorf("content type %q", a.contentType)
		}
	}
	ts.do(t, "GET", "/api/billing/credit", "").want(t, "after failures", 200, `{"credit":100}`)

	ts.FailNext(1, 500, `{"error":"Server Error"}`)
	a := ts.do(t, "POST", "/api/product/11", `{"clientid":7}`)
	a.wantError(t, "json failure", 500, "Server Error")
	if got := ts.Credit(); got != InitialCredit {
		t.Errorf("failed order charged credit: %v", got)
	}

	ts.FailNext(5, 502, "x")
	ts.FailNext(0, 0, "")
	ts.do(t, "GET", "/api/billing/credit", "").want(t, "cancelled failure", 200, `{"credit":100}`)
}

func TestLatencyHonoursContext(t *testing.T) {
	ts := newTestSim(t, Config{})
	ts.SetLatency(150 * time.Millisecond)
	start := time.Now()
	ts.do(t, "GET", "/api/billing/credit", "").want(t, "slow", 200, `{"credit":100}`)
	if d := time.Since(start); d < 150*time.Millisecond {
		t.Errorf("answer after %v, want at least the latency", d)
	}

	ts.SetLatency(time.Minute)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "GET", ts.srv.URL+"/api/billing/credit", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Basic "+DefaultToken)
	start = time.Now()
	_, err = ts.srv.Client().Do(req)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("request during a minute of latency: %v, want deadline exceeded", err)
	}
	// The handler must leave as soon as the client has gone: closing the
	// server waits for it, and must not wait for the minute.
	done := make(chan struct{})
	go func() {
		defer close(done)
		ts.srv.Close()
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("handler still sleeping after its request was cancelled")
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("took %v", d)
	}
}

func TestConfigValidate(t *testing.T) {
	if err := (Config{}).Validate(); err != nil {
		t.Errorf("zero config: %v", err)
	}
	if err := (Config{Layout: LayoutDefault}).Validate(); err != nil {
		t.Errorf("default layout: %v", err)
	}
	bad := []Config{
		{Token: "a b"},
		{Login: "a:b"},
		{UpdateListInterval: -time.Second},
		{Layout: Layout{TXT: "semicolon"}},
		{Layout: Layout{CSV: "tsv"}},
		{Layout: Layout{JSON: "yaml"}},
		{Layout: Layout{StickyShape: "nested"}},
	}
	for _, c := range bad {
		if err := c.Validate(); err == nil || !strings.HasPrefix(err.Error(), "validating providersim config: ") {
			t.Errorf("%+v: got %v", c, err)
		}
	}
}

// TestConcurrentUse drives every kind of request and control at once; run
// with -race. Credit must account exactly for the orders that succeeded.
func TestConcurrentUse(t *testing.T) {
	ts := newTestSim(t, Config{})
	ts.SetCredit(1000)
	const workers, rounds = 8, 25
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		orders int
	)
	auth := "Basic " + DefaultToken
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range rounds {
				var err error
				switch (w + i) % 6 {
				case 0:
					var a answer
					if a, err = ts.send("POST", "/api/product/11", `{"clientid":7}`, auth); err == nil && a.status == 200 {
						mu.Lock()
						orders++
						mu.Unlock()
					}
				case 1:
					_, err = ts.send("GET", "/api/sticky/rotate/102/gw1.sim.example/s1", "", auth)
				case 2:
					_, err = ts.send("PUT", "/api/service/101", `{"update_list":"true"}`, auth)
				case 3:
					_, err = ts.send("GET", "/api/iplist/http-auth/json/101", "", auth)
				case 4:
					ts.MarkErrored(101, fmt.Sprintf("10.0.0.%d", i))
					ts.SetLayout(Layout{TXT: TXTFourPart, CRLF: i%2 == 0})
					ts.SetEntries(101, "http-ip", []Entry{{Host: "127.0.0.1", Port: 1000 + i}})
				case 5:
					_, err = ts.send("GET", "/api/networkstatus/errors/101", "", auth)
					_ = ts.Sessions(102)
					_ = ts.Requests("/api/sticky/rotate/{id}/{server}/{session}")
				}
				if err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if want := 1000 - 10*float64(orders); ts.Credit() != want {
		t.Errorf("credit %v after %d orders, want %v", ts.Credit(), orders, want)
	}
	if orders == 0 {
		t.Error("no order succeeded")
	}
	var services []map[string]any
	ts.do(t, "GET", "/api/services", "").decode(t, "services", &services)
	if len(services) != 5+orders {
		t.Errorf("%d services after %d orders", len(services), orders)
	}
}
