package agent

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestNumberIntDate(t *testing.T) {
	for _, tc := range []struct {
		in      string
		num     float64
		numOK   bool
		integer int
		intOK   bool
	}{
		{`8080`, 8080, true, 8080, true},
		{`"8080"`, 8080, true, 8080, true},
		{`" 12.34 "`, 12.34, true, 0, false},
		{`12.34`, 12.34, true, 0, false},
		{`"12.00"`, 12, true, 12, true},
		{`-3`, -3, true, -3, true},
		{`1e3`, 1000, true, 1000, true},
		{`""`, 0, true, 0, true},
		{`null`, 0, true, 0, true},
		{`"abc"`, 0, false, 0, false},
		{`"NaN"`, 0, false, 0, false},
		{`"Inf"`, 0, false, 0, false},
		{`"0x10"`, 0, false, 0, false},
		{`"1_000"`, 0, false, 0, false},
		{`true`, 0, false, 0, false},
		{`[]`, 0, false, 0, false},
		{`{}`, 0, false, 0, false},
		{`"1e400"`, 0, false, 0, false},
	} {
		var n Number
		err := json.Unmarshal([]byte(tc.in), &n)
		if (err == nil) != tc.numOK || (err == nil && float64(n) != tc.num) {
			t.Errorf("Number(%s) = %v, %v; want %v ok=%v", tc.in, n, err, tc.num, tc.numOK)
		}
		var i Int
		err = json.Unmarshal([]byte(tc.in), &i)
		if (err == nil) != tc.intOK || (err == nil && int(i) != tc.integer) {
			t.Errorf("Int(%s) = %v, %v; want %v ok=%v", tc.in, i, err, tc.integer, tc.intOK)
		}
	}
	for _, tc := range []struct {
		in   string
		want string // "" = zero; "err" = error
	}{
		{`"2026-11-21"`, "2026-11-21"},
		{`"2026-11-21 13:45:00"`, "2026-11-21"},
		{`"2026-11-21 13:45:00.123456"`, "2026-11-21"},
		{`"2026-11-21T13:45:00"`, "2026-11-21"},
		{`"2026-11-21T23:45:00+02:00"`, "2026-11-21"},
		{`""`, ""},
		{`"0000-00-00"`, ""},
		{`"0000-00-00 00:00:00"`, ""},
		{`null`, ""},
		{`"21.11.2026"`, "err"},
		{`20261121`, "err"},
	} {
		var d Date
		err := json.Unmarshal([]byte(tc.in), &d)
		switch {
		case tc.want == "err" && err == nil:
			t.Errorf("Date(%s) = %v, want an error", tc.in, d)
		case tc.want != "err" && (err != nil || d.String() != tc.want):
			t.Errorf("Date(%s) = %q, %v; want %q", tc.in, d.String(), err, tc.want)
		}
	}
	b, _ := json.Marshal(struct{ A, B Date }{B: Date{time.Date(2026, 1, 2, 0, 0, 0, 0, time.UTC)}})
	if string(b) != `{"A":"","B":"2026-01-02"}` {
		t.Errorf("Date marshal = %s", b)
	}
}

// TestTypedEndpointsTolerant drives each typed GET method against bodies in
// the provider's PHP-ish encodings.
func TestTypedEndpointsTolerant(t *testing.T) {
	ctx := context.Background()
	call := func(body string) *Client {
		srv, _ := serve(t, 200, body)
		return newTestClient(t, srv.URL)
	}

	clients, err := call(`[{"id":"7","email":"alice@example.com","extra":1},{"id":8,"email":"bob@example.com"}]`).Clients(ctx)
	if err != nil || !reflect.DeepEqual(clients, []ClientRecord{{7, "alice@example.com"}, {8, "bob@example.com"}}) {
		t.Errorf("Clients = %+v, %v", clients, err)
	}
	for _, empty := range []string{`[]`, `null`, ``, `{}`} {
		got, err := call(empty).Clients(ctx)
		if err != nil || len(got) != 0 {
			t.Errorf("Clients(%q) = %+v, %v", empty, got, err)
		}
	}
	stats, err := call(`[{"date":"2026-11-20","rate":"12.5"},{"date":"2026-11-21","rate":3}]`).Stats(ctx, 102)
	if err != nil || len(stats) != 2 || stats[0].Rate != 12.5 || stats[1].Date.String() != "2026-11-21" {
		t.Errorf("Stats = %+v, %v", stats, err)
	}
	rate, err := call(`[{"limit":"1000","rate":"250.5"}]`).Rate(ctx, 102)
	if err != nil || !reflect.DeepEqual(rate, []RateItem{{1000, 250.5}}) {
		t.Errorf("Rate = %+v, %v", rate, err)
	}
	p, err := call(`{"productId":"11","productName":"Static US 10","price":"10.00","groupId":1,"groupName":"Static","created_at":"2026-01-02","product_hidden":0,"group_hidden":"1","product_type":"fpr","ip_count":"10","update_time":"2026-11-21 10:00:00","geo":[{"country":"US"}]}`).Product(ctx, 11)
	if err != nil || p.ProductID != 11 || p.Price != 10 || p.ProductHidden || !p.GroupHidden || p.IPCount != 10 ||
		p.UpdateTime != time.Date(2026, 11, 21, 10, 0, 0, 0, time.UTC) || string(p.Geo) != `[{"country":"US"}]` || p.CreatedAt.String() != "2026-01-02" {
		t.Errorf("Product = %+v, %v", p, err)
	}
	products, err := call(`{"0":{"productId":12,"price":20.5},"1":{"productId":"13","price":"15"}}`).ProductsOrderBy(ctx, "price")
	if err != nil || len(products) != 2 || products[1].ProductID != 13 || products[0].Price != 20.5 {
		t.Errorf("ProductsOrderBy = %+v, %v", products, err)
	}
	ips, err := call(`["10.0.0.1", {"ip":"10.0.0.2"}]`).NetworkErrors(ctx, 101)
	if err != nil || !reflect.DeepEqual(ips, []string{"10.0.0.1", "10.0.0.2"}) {
		t.Errorf("NetworkErrors = %q, %v", ips, err)
	}
	ips, err = call(`null`).NetworkInactive(ctx, 101)
	if err != nil || len(ips) != 0 {
		t.Errorf("NetworkInactive(null) = %q, %v", ips, err)
	}
	// An empty list beside the provider's error is no empty list: it must
	// not bring the errored IPs back. Beside no error, or with entries, it
	// is a list.
	if ips, err = call(`{"data":[],"error":"Service is not active"}`).NetworkErrors(ctx, 101); err == nil || !strings.Contains(err.Error(), "Service is not active") {
		t.Errorf("NetworkErrors(empty beside an error) = %q, %v; want an error", ips, err)
	}
	for _, none := range []string{`null`, `""`, `"none"`, `"0"`, `"false"`, `"ok"`, `false`} {
		if ips, err = call(`{"data":[],"error":`+none+`}`).NetworkErrors(ctx, 101); err != nil || len(ips) != 0 {
			t.Errorf("NetworkErrors(empty, error %s) = %q, %v; want an empty list", none, ips, err)
		}
	}
	if ips, err = call(`{"data":["10.0.0.1"],"error":"partial"}`).NetworkErrors(ctx, 101); err != nil || len(ips) != 1 {
		t.Errorf("NetworkErrors(entries beside an error) = %q, %v", ips, err)
	}
	if l, err := ParseIPList([]byte(`{"result":null,"error":"Unprocessable Entity"}`), "json"); err == nil {
		t.Errorf("IP list of nothing beside an error: %+v, want an error", l)
	}
	credit, err := call(`{"credit":"100.00"}`).Credit(ctx)
	if err != nil || credit != 100 {
		t.Errorf("Credit = %v, %v", credit, err)
	}
	// A byte order mark before the JSON (a PHP source file saved with one).
	if credit, err = call("\xef\xbb\xbf" + `{"credit":"7.50"}`).Credit(ctx); err != nil || credit != 7.5 {
		t.Errorf("Credit after a BOM = %v, %v", credit, err)
	}
	inv, err := call(`[{"id":"1","description":"x","status":"Paid","created_at":"2026-11-01","amount":"10.00","date_refunded":"0000-00-00","date_paid":"","paymentmethod":"credit","serviceid":"101"}]`).Invoices(ctx)
	if err != nil || len(inv) != 1 || inv[0].Amount != 10 || inv[0].ServiceID != 101 || !inv[0].DateRefunded.IsZero() || !inv[0].DatePaid.IsZero() {
		t.Errorf("Invoices = %+v, %v", inv, err)
	}
	inv, err = call(`{"id":3,"status":"Unpaid","amount":5}`).Invoice(ctx, 3)
	if err != nil || len(inv) != 1 || inv[0].ID != 3 {
		t.Errorf("Invoice(object) = %+v, %v", inv, err)
	}
	svc, err := call(`{"service_id":"101","orderid":"5","product_name":"Static US 10","regdate":"2026-01-01","nextduedate":"0000-00-00","status":"Active","billingcycle":"Monthly","username":"u","password":"p","bindedip":null,"product_type":"fpr","ip_count":"3","price":"10.00"}`).Service(ctx, 101)
	want := Service{ServiceID: 101, OrderID: 5, ProductName: "Static US 10", RegDate: Date{time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)},
		Status: "Active", BillingCycle: "Monthly", Username: "u", Password: "p", ProductType: "fpr", IPCount: 3, Price: 10}
	if err != nil || !reflect.DeepEqual(*svc, want) {
		t.Errorf("Service = %+v, %v", svc, err)
	}
	items, err := call(`[{"service_id":101,"product_name":"a","nextduedate":"","orderid":"5","status":"Active"}]`).Services(ctx)
	if err != nil || len(items) != 1 || items[0].OrderID != 5 || !items[0].NextDueDate.IsZero() {
		t.Errorf("Services = %+v, %v", items, err)
	}
}

func TestOrderAndUpdateService(t *testing.T) {
	ctx := context.Background()
	srv, rec := serve(t, 200, `{"serviceId":"106","orderId":9,"invoiceId":"12","amount":"10.00","ip":"10.0.0.9"}`)
	c := newTestClient(t, srv.URL)
	res, err := c.Order(ctx, 11, OrderRequest{ClientID: 7, SetIP: "203.0.113.5"})
	if err != nil || *res != (OrderResult{106, 9, 12, 10, "10.0.0.9"}) {
		t.Errorf("Order = %+v, %v", res, err)
	}
	r, b := rec.last()
	if r.Method != http.MethodPost || r.URL.Path != "/api/product/11" || string(b) != `{"clientid":7,"setip":"203.0.113.5"}` {
		t.Errorf("order request %s %s %s", r.Method, r.URL.Path, b)
	}

	srv, rec = serve(t, 200, `{"setip":{"success":"IP address updated successfully"},"update_list":{"success":"IP list updated successfully"},"password":{"success":"Password updated successfully"}}`)
	c = newTestClient(t, srv.URL)
	up, err := c.UpdateService(ctx, 101, ServiceUpdate{SetIP: "203.0.113.5", UpdateList: true, Password: "new pw"})
	if err != nil || up["setip"] != "IP address updated successfully" || up["update_list"] != "IP list updated successfully" || up["password"] != "Password updated successfully" {
		t.Errorf("UpdateService = %v, %v", up, err)
	}
	r, b = rec.last()
	var sent map[string]string
	json.Unmarshal(b, &sent)
	if r.Method != http.MethodPut || r.URL.Path != "/api/service/101" ||
		!reflect.DeepEqual(sent, map[string]string{"setip": "203.0.113.5", "update_list": "true", "password": "bmV3IHB3"}) {
		t.Errorf("update request %s %s %s", r.Method, r.URL.Path, b)
	}
	srv, rec = serve(t, 200, `[]`)
	up, err = newTestClient(t, srv.URL).UpdateService(ctx, 101, ServiceUpdate{})
	if err != nil || len(up) != 0 {
		t.Errorf("empty update = %v, %v", up, err)
	}
	if _, b := rec.last(); string(b) != `{}` {
		t.Errorf("empty update sent %s, want {}", b)
	}
}

// changingCalls are the calls that change the account, by name, each
// returning its error.
func changingCalls(c *Client) map[string]func() error {
	ctx := context.Background()
	return map[string]func() error{
		"order":     func() error { _, err := c.Order(ctx, 11, OrderRequest{ClientID: 7}); return err },
		"update":    func() error { _, err := c.UpdateService(ctx, 101, ServiceUpdate{UpdateList: true}); return err },
		"rotate":    func() error { _, err := c.StickyRotate(ctx, 102, "gw1.sim.example", "s1"); return err },
		"changettl": func() error { _, err := c.StickyChangeTTL(ctx, 102, 10); return err },
		"resetall":  func() error { _, err := c.StickyResetAll(ctx, 102); return err },
	}
}

// A 200 answer to a call that changes the account, whose body is the
// provider's error object (at the top; for the service update also under
// an action), is a refusal: the call fails with a *APIError carrying the
// provider's message on one line.
func TestRefusalIn200Answer(t *testing.T) {
	// An order is not among them: an order answer is read as before (an
	// error string next to a placed order must not make it look refused).
	all := []string{"update", "rotate", "changettl", "resetall"}
	for _, tc := range []struct {
		body    string
		refused []string // the calls that fail; the others must not fail with a *APIError
		message string
	}{
		{`{"error":"Session not found "}`, all, "Session not found"},
		{`{"Error":"Unprocessable Entity","ip":"198.51.100.9"}`, all, "Unprocessable Entity"},
		{`{"error":"token ` + testToken + ` refused"}`, all, "token [redacted] refused"},
		{`{"error":"line one\r\nline two\t\u001b[31mred\u2028end"}`, all, "line one line two [31mred end"},
		{`{"update_list":{"error":"Too Many Attempts (updateList). Next update possible: 2026-11-21 11:40:05"}}`, []string{"update"},
			"update_list: Too Many Attempts (updateList). Next update possible: 2026-11-21 11:40:05"},
		{`{"setip":{"success":"IP address updated successfully"},"password":{"error":"Unprocessable Entity "}}`, []string{"update"},
			"password: Unprocessable Entity"},
		// A "success" that says no is a refusal, with the error or the word.
		{`{"success":false,"error":"Session not found"}`, all, "Session not found"},
		{`{"success":"0"}`, all, "success: 0"},
	} {
		srv, _ := serve(t, 200, tc.body)
		for name, call := range changingCalls(newTestClient(t, srv.URL)) {
			err := call()
			var apiErr *APIError
			if !slices.Contains(tc.refused, name) {
				if errors.As(err, &apiErr) {
					t.Errorf("%s with body %s: %v, want no refusal", name, tc.body, err)
				}
				continue
			}
			if !errors.As(err, &apiErr) || apiErr.Status != 200 || apiErr.Message != tc.message {
				t.Errorf("%s with body %s: %v, want a *APIError of status 200 with message %q", name, tc.body, err, tc.message)
				continue
			}
			if msg := err.Error(); !strings.Contains(msg, tc.message) || !strings.Contains(msg, apiErr.Route) || apiErr.Route == "" {
				t.Errorf("%s: Error() = %q, want the message and the route", name, msg)
			}
			if strings.Contains(apiErr.Body, testToken) {
				t.Errorf("%s: the body excerpt keeps the token: %q", name, apiErr.Body)
			}
		}
	}
}

// Every other 200 answer to a call that changes the account stays what it
// was: a success for the sticky calls, whose success bodies are not
// public, and never a refusal for the others.
func TestNoRefusalWithoutErrorObject(t *testing.T) {
	for _, body := range []string{``, `[]`, `null`, `"Session not found"`, `[{"error":"x"}]`, `{"success":"rotated"}`,
		`{"message":"Session rotated"}`, `{"error":""}`, `{"error":"  "}`, `{"error":null,"ip":"198.51.100.9"}`, `{"error":false}`,
		`{"error":{"code":3}}`, `{"session":{"error":"x"}}`, `{"update_list":{"success":"IP list updated successfully"}}`, `{"error":`,
		`{"success":true,"error":"0"}`, `{"status":"ok","error":"none","ip":"198.51.100.9"}`, `{"error":"false"}`,
		`{"Success":"rotated","error":"Session rotated"}`, `{"update_list":{"success":"IP list updated successfully","error":"0"}}`} {
		srv, _ := serve(t, 200, body)
		for name, call := range changingCalls(newTestClient(t, srv.URL)) {
			err := call()
			var apiErr *APIError
			switch {
			case errors.As(err, &apiErr):
				t.Errorf("%s with body %s: refused: %v", name, body, err)
			case err != nil && name != "order" && name != "update":
				t.Errorf("%s with body %s: %v, want a success", name, body, err)
			}
		}
	}
}

// TestUndecodableBodies: every typed method gives an error naming its route
// for a body it cannot read, never a panic or a zero value.
func TestUndecodableBodies(t *testing.T) {
	ctx := context.Background()
	for _, body := range []string{`<html>oops</html>`, `{"id":`, `"str"`, `[1,2]`, `{"credit":"abc","service_id":"x","productId":"y","serviceId":"z"}`, `{}`, `[]`, `{"unrelated":1}`} {
		srv, _ := serve(t, 200, body)
		c := newTestClient(t, srv.URL)
		checks := []struct {
			route string
			call  func() (any, error)
		}{
			{RouteClients, func() (any, error) { return c.Clients(ctx) }},
			{RouteStats, func() (any, error) { return c.Stats(ctx, 1) }},
			{RouteRate, func() (any, error) { return c.Rate(ctx, 1) }},
			{RouteProduct, func() (any, error) { return c.Product(ctx, 1) }},
			{RouteProduct, func() (any, error) { return c.Order(ctx, 1, OrderRequest{ClientID: 1}) }},
			{RouteProducts, func() (any, error) { return c.Products(ctx) }},
			{RouteProductsOrderBy, func() (any, error) { return c.ProductsOrderBy(ctx, "price") }},
			{RouteNetworkErrors, func() (any, error) { return c.NetworkErrors(ctx, 1) }},
			{RouteNetworkInactive, func() (any, error) { return c.NetworkInactive(ctx, 1) }},
			{RouteCredit, func() (any, error) { return c.Credit(ctx) }},
			{RouteInvoices, func() (any, error) { return c.Invoices(ctx) }},
			{RouteInvoice, func() (any, error) { return c.Invoice(ctx, 1) }},
			{RouteService, func() (any, error) { return c.Service(ctx, 1) }},
			{RouteServices, func() (any, error) { return c.Services(ctx) }},
			{RouteService, func() (any, error) { return c.UpdateService(ctx, 1, ServiceUpdate{UpdateList: true}) }},
			{RouteStickyList, func() (any, error) { return c.StickyList(ctx, 1) }},
		}
		for _, ch := range checks {
			v, err := ch.call()
			if err == nil {
				if legitimate(ch.route, body, v) {
					continue
				}
				t.Errorf("%s with body %s: no error, got %+v", ch.route, body, v)
				continue
			}
			var de *DecodeError
			if !errors.As(err, &de) || de.Route != ch.route || !strings.Contains(err.Error(), ch.route) {
				t.Errorf("%s with body %s: err %v, want a DecodeError naming the route", ch.route, body, err)
			}
		}
	}
}

// legitimate reports whether a success for these bodies is right: {} and []
// are empty lists, and an update answers with whatever actions it names.
func legitimate(route, body string, v any) bool {
	if (body == `{}` || body == `[]`) && isEmptyList(v) {
		return true
	}
	if (body == `{}` || body == `[]`) && route == RouteStickyList {
		return len(v.(*StickyList).Sessions) == 0
	}
	if m, ok := v.(ServiceUpdateResult); ok {
		return strings.HasPrefix(body, "{") && len(m) == strings.Count(body, ":") || body == `[]` && len(m) == 0
	}
	return false
}

func isEmptyList(v any) bool {
	rv := reflect.ValueOf(v)
	return rv.Kind() == reflect.Slice && rv.Len() == 0
}

func TestDecodeErrorKeepsProviderMessage(t *testing.T) {
	srv, _ := serve(t, 200, `{"error":"Service not found "}`)
	c := newTestClient(t, srv.URL)
	for _, call := range []func() error{
		func() error { _, err := c.Service(context.Background(), 1); return err },
		func() error { _, err := c.Services(context.Background()); return err },
		func() error { _, err := c.StickyList(context.Background(), 1); return err },
		func() error { _, err := c.IPList(context.Background(), 1, "http-ip", "json"); return err },
	} {
		err := call()
		var de *DecodeError
		if !errors.As(err, &de) || !strings.Contains(err.Error(), `provider says "Service not found"`) {
			t.Errorf("err = %v, want a DecodeError with the provider's message", err)
		}
	}
}

// A credential that JSON escapes hide from the scrub of the raw body
// (PHP writes "/" as "\/") is scrubbed from the decoded message too, on
// an error answer and on a refusal in a 200 alike.
func TestScrubEscapedCredential(t *testing.T) {
	const token = "tok/Zq9XvB7rLm2+Kp4Ws8Yt1"
	escaped := strings.ReplaceAll(token, "/", `\/`)
	for _, status := range []int{422, 200} {
		apiErr, err := resetAllError(t, token, status, `{"error":"bad token `+escaped+`"}`)
		if strings.Contains(err.Error(), token) || strings.Contains(apiErr.Message, token) || strings.Contains(apiErr.Body, escaped) {
			t.Errorf("status %d: the token is in the error: %v", status, err)
		}
	}
}

// A token that is base64 of the login and password, joined by ":" or by
// "|" as some of the provider's clients build it, has its password
// scrubbed from an answer that echoes it, as the token itself is.
func TestScrubPasswordInsideToken(t *testing.T) {
	const password = "hunter2secret"
	for _, sep := range []string{":", "|"} {
		token := base64.StdEncoding.EncodeToString([]byte("user@example.com" + sep + password))
		apiErr, err := resetAllError(t, token, 400, `{"error":"bad credentials for user@example.com`+sep+password+`"}`)
		for _, shown := range []string{err.Error(), apiErr.Message, apiErr.Body} {
			if strings.Contains(shown, password) {
				t.Errorf("joined by %q: the password shows in %q", sep, shown)
			}
		}
	}
}

// An answer is read before its credentials are redacted: a short password
// that is part of a key or of the provider's message neither hides a
// refusal nor changes an error's class, and still shows nowhere.
func TestRedactAfterReading(t *testing.T) {
	for _, tc := range []struct {
		name, password string
		status         int
		body           string
		kind           error
	}{
		{"refusal, password in the key", "error", 200, `{"error":"Session expired"}`, nil},
		{"refusal, password in the message", "Attempts", 200, `{"update_list":{"error":"Too Many Attempts"}}`, ErrTooManyAttempts},
		{"422, password in the message", "funds", 422, `{"error":"Unprocessed entity or not enough funds to order"}`, ErrNotEnoughFunds},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, _ := serve(t, tc.status, tc.body)
			c, err := New(apiConfig(func(c *Config) {
				c.BaseURL, c.Token, c.Login, c.Password, c.Timeout = srv.URL, "", "user@example.com", tc.password, 5*time.Second
			}))
			if err != nil {
				t.Fatal(err)
			}
			_, err = c.UpdateService(context.Background(), 1, ServiceUpdate{UpdateList: true})
			var apiErr *APIError
			if !errors.As(err, &apiErr) {
				t.Fatalf("%v, want a *APIError", err)
			}
			if tc.kind != nil && !errors.Is(err, tc.kind) {
				t.Errorf("%v, want %v", err, tc.kind)
			}
			for _, shown := range []string{err.Error(), apiErr.Message, apiErr.Body} {
				if strings.Contains(shown, tc.password) {
					t.Errorf("the password shows in %q", shown)
				}
			}
		})
	}
}

// A service update refused for one action returns, with the refusal, what
// the answer says of every action: another may have been made.
func TestUpdateServicePartlyRefused(t *testing.T) {
	srv, _ := serve(t, 200, `{"setip":{"success":"IP address updated successfully"},"password":{"error":"Password too weak"}}`)
	res, err := newTestClient(t, srv.URL).UpdateService(context.Background(), 1, ServiceUpdate{SetIP: "192.0.2.7", Password: "weak"})
	var apiErr *APIError
	if !errors.As(err, &apiErr) || apiErr.Message != "password: Password too weak" {
		t.Fatalf("err = %v, want the password's refusal", err)
	}
	if res["setip"] != "IP address updated successfully" || res["password"] != "Password too weak" {
		t.Errorf("result %v, want both actions' messages", res)
	}
}

// A message longer than the excerpt is cut only after its credentials are
// redacted: one the cut would split leaves no part of itself behind.
func TestRedactBeforeCut(t *testing.T) {
	const token = "tok9XvB7rLm2Kp4Ws8Yt1Qa"
	for _, status := range []int{422, 200} {
		for _, at := range []int{240, 250, 255} {
			apiErr, err := resetAllError(t, token, status, `{"error":"`+strings.Repeat("x", at)+token+` and more"}`)
			for _, shown := range []string{err.Error(), apiErr.Message, apiErr.Body} {
				if strings.Contains(shown, token[:4]) {
					t.Errorf("status %d, token at %d: part of it shows in %q", status, at, shown)
				}
			}
		}
	}
}

// resetAllError calls a refused sticky reset through a client with token,
// against an answer of status and body, and returns the *APIError it
// fails with and the error as returned.
func resetAllError(t *testing.T, token string, status int, body string) (*APIError, error) {
	t.Helper()
	srv, _ := serve(t, status, body)
	c, err := New(apiConfig(func(c *Config) { c.BaseURL, c.Token, c.Version, c.Timeout = srv.URL, token, "1.2.3", 5*time.Second }))
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.StickyResetAll(context.Background(), 1)
	var apiErr *APIError
	if !errors.As(err, &apiErr) {
		t.Fatalf("status %d: %v, want a *APIError", status, err)
	}
	return apiErr, err
}
