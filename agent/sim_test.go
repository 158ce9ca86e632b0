package agent

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/proxyd/proxyd/agent/providersim"
)

// Tests of every endpoint against the simulated provider. IDs are those of
// providersim's default world.

var simNow = time.Date(2026, 11, 21, 10, 0, 0, 0, time.UTC)

func newSim(t *testing.T, cfg providersim.Config) (*providersim.Sim, string) {
	t.Helper()
	if cfg.Now == nil {
		cfg.Now = func() time.Time { return simNow }
	}
	sim := providersim.New(cfg)
	srv := httptest.NewServer(sim)
	t.Cleanup(srv.Close)
	return sim, srv.URL
}

func simClient(t *testing.T, url string, mod func(*Config)) *Client {
	t.Helper()
	cfg := DefaultConfig()
	cfg.BaseURL, cfg.Token, cfg.Timeout = url, providersim.DefaultToken, 5*time.Second
	if mod != nil {
		mod(&cfg)
	}
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestSimAccountEndpoints(t *testing.T) {
	ctx := context.Background()
	sim, url := newSim(t, providersim.Config{})
	c := simClient(t, url, nil)

	clients, err := c.Clients(ctx)
	if err != nil || !reflect.DeepEqual(clients, []ClientRecord{{7, "alice@example.com"}, {8, "bob@example.com"}}) {
		t.Errorf("Clients = %+v, %v", clients, err)
	}

	products, err := c.Products(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var ids []int
	for _, p := range products {
		ids = append(ids, p.ProductID)
	}
	if !reflect.DeepEqual(ids, []int{11, 12, 13}) || products[1].Price != 20.5 || products[0].GroupName != "Static" || products[0].CreatedAt.IsZero() {
		t.Errorf("Products = %+v", products)
	}
	byPrice, err := c.ProductsOrderBy(ctx, "price")
	if err != nil || len(byPrice) != 3 {
		t.Fatalf("ProductsOrderBy = %+v, %v", byPrice, err)
	}
	for i := 1; i < len(byPrice); i++ {
		if byPrice[i-1].Price > byPrice[i].Price {
			t.Errorf("ProductsOrderBy(price) not ordered: %+v", byPrice)
		}
	}

	p, err := c.Product(ctx, 11)
	if err != nil || p.ProductID != 11 || p.ProductType != "fpr" || p.Price != 10 || p.IPCount != 3 || p.UpdateTime.IsZero() ||
		!bytes.Contains(p.Geo, []byte(`"New York"`)) || p.ProductHidden {
		t.Errorf("Product(11) = %+v, %v", p, err)
	}
	p, err = c.Product(ctx, 13)
	if err != nil || p.ProductType != "ppr" || p.Geo != nil || p.IPCount != 0 {
		t.Errorf("Product(13) = %+v, %v", p, err)
	}
	p, err = c.Product(ctx, 14)
	if err != nil || !p.ProductHidden || !p.GroupHidden {
		t.Errorf("Product(14) = %+v, %v", p, err)
	}
	if _, err := c.Product(ctx, 99); !errors.Is(err, ErrProductNotFound) {
		t.Errorf("Product(99): %v", err)
	}

	credit, err := c.Credit(ctx)
	if err != nil || credit != 100 {
		t.Errorf("Credit = %v, %v", credit, err)
	}
	inv, err := c.Invoices(ctx)
	if err != nil || len(inv) != 3 || inv[1].ID != 7002 || inv[1].Amount != 15 || inv[1].ServiceID != 102 || !inv[0].DateRefunded.IsZero() || inv[0].DatePaid.IsZero() {
		t.Errorf("Invoices = %+v, %v", inv, err)
	}
	one, err := c.Invoice(ctx, 7003)
	if err != nil || len(one) != 1 || one[0].Status != "Unpaid" || one[0].Amount != 20.5 {
		t.Errorf("Invoice(7003) = %+v, %v", one, err)
	}
	if none, err := c.Invoice(ctx, 1); err != nil || len(none) != 0 {
		t.Errorf("Invoice(1) = %+v, %v", none, err)
	}

	services, err := c.Services(ctx)
	if err != nil || len(services) != 5 || services[2].ServiceID != 103 || services[2].OrderID == 0 || !services[3].NextDueDate.IsZero() || !services[4].NextDueDate.IsZero() {
		t.Errorf("Services = %+v, %v", services, err)
	}
	s101, err := c.Service(ctx, 101)
	if err != nil || s101.Status != "Active" || s101.ProductType != "fpr" || s101.BindedIP != "203.0.113.50" || s101.IPCount != 3 ||
		s101.Username == "" || s101.Password == "" || s101.Price != 10 || s101.RegDate.IsZero() || s101.NextDueDate.IsZero() {
		t.Errorf("Service(101) = %+v, %v", s101, err)
	}
	s103, err := c.Service(ctx, 103)
	if err != nil || s103.ServiceID != 103 || s103.Status != "Suspended" || s103.IPCount != 5 || s103.Price != 20.5 {
		t.Errorf("Service(103) (numbers as strings) = %+v, %v", s103, err)
	}
	for _, id := range []int{104, 105} {
		s, err := c.Service(ctx, id)
		if err != nil || !s.NextDueDate.IsZero() {
			t.Errorf("Service(%d) = %+v, %v; want an empty next due date", id, s, err)
		}
	}
	if _, err := c.Service(ctx, 555); !errors.Is(err, ErrUnprocessable) {
		t.Errorf("Service(555): %v", err)
	}

	stats, err := c.Stats(ctx, 102)
	if err != nil || len(stats) != 3 || stats[2].Rate != 300.5 || stats[2].Date.IsZero() {
		t.Errorf("Stats(102) = %+v, %v", stats, err)
	}
	rate, err := c.Rate(ctx, 102)
	if err != nil || !reflect.DeepEqual(rate, []RateItem{{Limit: 1024, Rate: 300.5}}) {
		t.Errorf("Rate(102) = %+v, %v", rate, err)
	}
	sim.SetUsage(102, 12.25, 2048)
	if rate, err := c.Rate(ctx, 102); err != nil || !reflect.DeepEqual(rate, []RateItem{{Limit: 2048, Rate: 12.25}}) {
		t.Errorf("Rate(102) after SetUsage = %+v, %v", rate, err)
	}
	if _, err := c.Stats(ctx, 555); !errors.Is(err, ErrUnprocessable) {
		t.Errorf("Stats(555): %v", err)
	}
	if _, err := c.Rate(ctx, 555); !errors.Is(err, ErrUnprocessable) {
		t.Errorf("Rate(555): %v", err)
	}
}

func TestSimNetworkStatus(t *testing.T) {
	ctx := context.Background()
	sim, url := newSim(t, providersim.Config{})
	c := simClient(t, url, nil)
	for _, get := range []func(context.Context, int) ([]string, error){c.NetworkErrors, c.NetworkInactive} {
		if ips, err := get(ctx, 101); err != nil || len(ips) != 0 {
			t.Errorf("initial status = %q, %v", ips, err)
		}
	}
	sim.MarkErrored(101, "10.0.0.1", "10.0.0.3")
	sim.MarkInactive(101, "10.0.0.2")
	if ips, err := c.NetworkErrors(ctx, 101); err != nil || !reflect.DeepEqual(ips, []string{"10.0.0.1", "10.0.0.3"}) {
		t.Errorf("NetworkErrors = %q, %v", ips, err)
	}
	if ips, err := c.NetworkInactive(ctx, 101); err != nil || !reflect.DeepEqual(ips, []string{"10.0.0.2"}) {
		t.Errorf("NetworkInactive = %q, %v", ips, err)
	}
	sim.ClearStatus(101)
	if ips, err := c.NetworkErrors(ctx, 101); err != nil || len(ips) != 0 {
		t.Errorf("after ClearStatus = %q, %v", ips, err)
	}
	// The 400 JSON form of "ClientID not found" and the trailing-space 422.
	_, err := c.NetworkErrors(ctx, 900)
	var apiErr *APIError
	if !errors.Is(err, ErrClientNotFound) || !errors.As(err, &apiErr) || apiErr.Status != 400 {
		t.Errorf("NetworkErrors(900): %v", err)
	}
	_, err = c.NetworkInactive(ctx, 555)
	if !errors.As(err, &apiErr) || apiErr.Status != 422 || apiErr.Message != "Unprocessable Entity" || !errors.Is(err, ErrUnprocessable) {
		t.Errorf("NetworkInactive(555): %v", err)
	}
}

func TestSimOrder(t *testing.T) {
	ctx := context.Background()
	sim, url := newSim(t, providersim.Config{})
	c := simClient(t, url, nil)

	res, err := c.Order(ctx, 11, OrderRequest{ClientID: 7, SetIP: "203.0.113.77"})
	if err != nil || res.ServiceID == 0 || res.OrderID == 0 || res.InvoiceID == 0 || res.Amount != 10 || res.IP != "203.0.113.77" {
		t.Fatalf("Order = %+v, %v", res, err)
	}
	if credit, _ := c.Credit(ctx); credit != 90 || sim.Credit() != 90 {
		t.Errorf("credit after order = %v", credit)
	}
	svc, err := c.Service(ctx, res.ServiceID)
	if err != nil || svc.BindedIP != "203.0.113.77" || svc.Status != "Active" {
		t.Errorf("ordered service = %+v, %v", svc, err)
	}
	if inv, err := c.Invoice(ctx, res.InvoiceID); err != nil || len(inv) != 1 || inv[0].ServiceID != res.ServiceID {
		t.Errorf("order invoice = %+v, %v", inv, err)
	}
	l, err := c.IPList(ctx, res.ServiceID, "http-auth", "txt")
	if err != nil || len(l.Entries) != 3 || l.Entries[0].Login != svc.Username {
		t.Errorf("ordered service list = %+v, %v", l, err)
	}

	for _, tc := range []struct {
		pid  int
		req  OrderRequest
		want error
	}{
		{99, OrderRequest{ClientID: 7}, ErrProductNotFound},
		{11, OrderRequest{ClientID: 99}, ErrClientNotFound},
		{11, OrderRequest{ClientID: 7, SetIP: "not-an-ip"}, ErrIncorrectPostedData},
		{11, OrderRequest{ClientID: 7, SetIP: "203.0.113.77"}, ErrIncorrectPostedData}, // already bound
	} {
		if _, err := c.Order(ctx, tc.pid, tc.req); !errors.Is(err, tc.want) || !errors.Is(err, ErrUnprocessable) {
			t.Errorf("Order(%d, %+v): %v, want %v", tc.pid, tc.req, err, tc.want)
		}
	}
	// 90 USD buys four 20.50 products; the fifth fails.
	for i := 0; i < 4; i++ {
		if _, err := c.Order(ctx, 12, OrderRequest{ClientID: 8}); err != nil {
			t.Fatalf("order %d: %v", i, err)
		}
	}
	if _, err := c.Order(ctx, 12, OrderRequest{ClientID: 8}); !errors.Is(err, ErrNotEnoughFunds) {
		t.Errorf("order without funds: %v", err)
	}
	// Incorrect posted data through the raw call: clientid missing.
	if _, err := c.Call(ctx, http.MethodPost, RouteProduct, []string{"11"}, []byte(`{"setip":""}`)); !errors.Is(err, ErrIncorrectPostedData) {
		t.Errorf("order without clientid: %v", err)
	}
}

func TestSimUpdateService(t *testing.T) {
	ctx := context.Background()
	now := simNow
	_, url := newSim(t, providersim.Config{Now: func() time.Time { return now }})
	c := simClient(t, url, nil)

	res, err := c.UpdateService(ctx, 101, ServiceUpdate{SetIP: "203.0.113.60", UpdateList: true, Password: "n3w p@ss:word"})
	want := ServiceUpdateResult{"setip": "IP address updated successfully", "update_list": "IP list updated successfully", "password": "Password updated successfully"}
	if err != nil || !reflect.DeepEqual(res, want) {
		t.Fatalf("UpdateService = %v, %v", res, err)
	}
	svc, err := c.Service(ctx, 101)
	if err != nil || svc.BindedIP != "203.0.113.60" || svc.Password != "n3w p@ss:word" {
		t.Fatalf("after update: %+v, %v", svc, err)
	}
	l, err := c.IPList(ctx, 101, "http-auth", "txt")
	if err != nil || len(l.Entries) != 3 || l.Entries[0].Password != "n3w p@ss:word" {
		t.Errorf("list after password change = %+v, %v", l, err)
	}

	// update_list again within the interval: 429 with the next time in UTC.
	_, err = c.UpdateService(ctx, 101, ServiceUpdate{UpdateList: true})
	var apiErr *APIError
	if !errors.Is(err, ErrTooManyAttempts) || !errors.As(err, &apiErr) {
		t.Fatalf("second update_list: %v", err)
	}
	if want := simNow.Add(providersim.DefaultUpdateListInterval); !apiErr.NextAllowed.Equal(want) || apiErr.NextAllowed.Location() != time.UTC {
		t.Errorf("NextAllowed = %v, want %v", apiErr.NextAllowed, want)
	}
	now = apiErr.NextAllowed
	if _, err := c.UpdateService(ctx, 101, ServiceUpdate{UpdateList: true}); err != nil {
		t.Errorf("update_list at NextAllowed: %v", err)
	}

	for _, tc := range []struct {
		id   int
		u    ServiceUpdate
		want error
	}{
		{105, ServiceUpdate{SetIP: "203.0.113.999"}, ErrInvalidIPv4},
		{105, ServiceUpdate{SetIP: "2001:db8::1"}, ErrInvalidIPv4},
		{105, ServiceUpdate{SetIP: "203.0.113.60"}, ErrIPAlreadyBound},
		{900, ServiceUpdate{UpdateList: true}, ErrClientNotFound},
		{555, ServiceUpdate{UpdateList: true}, ErrUnprocessable},
	} {
		if _, err := c.UpdateService(ctx, tc.id, tc.u); !errors.Is(err, tc.want) {
			t.Errorf("UpdateService(%d, %+v): %v, want %v", tc.id, tc.u, err, tc.want)
		}
	}
	if _, err := c.Call(ctx, http.MethodPut, RouteService, []string{"101"}, []byte(`{"password":"%%%"}`)); !errors.Is(err, ErrIncorrectPostedData) {
		t.Errorf("bad password encoding: %v", err)
	}
	if res, err := c.UpdateService(ctx, 101, ServiceUpdate{}); err != nil || len(res) != 0 {
		t.Errorf("empty update = %v, %v", res, err)
	}
}

// simEntries are tricky entries served by SetEntries: passwords with '@',
// ':' and ',', an IPv6 host and a host name.
var simEntries = []providersim.Entry{
	{Host: "10.9.0.1", Port: 8080, Login: "alice", Password: "p@ss:w,rd"},
	{Host: "2001:db8::10", Port: 3128, Login: "bob", Password: "x"},
	{Host: "gw.example.net", Port: 65535, Login: "c@rol", Password: "pw"},
}

func TestSimIPListEveryLayout(t *testing.T) {
	ctx := context.Background()
	sim, url := newSim(t, providersim.Config{})
	c := simClient(t, url, nil)
	types := map[string]int{"http-auth": 101, "http-ip": 101, "socks-ip": 101, "ppr-http": 102, "ppr-socks": 102}
	for typ, id := range types {
		sim.SetEntries(id, typ, simEntries)
	}
	var layouts []providersim.Layout
	for _, txt := range []string{providersim.TXTColon, providersim.TXTLoginFirst, providersim.TXTFourPart} {
		for _, csv := range []string{providersim.CSVHeader, providersim.CSVPlain} {
			for _, js := range []string{providersim.JSONObjects, providersim.JSONObjectsAlt, providersim.JSONStrings, providersim.JSONLines} {
				for _, crlf := range []bool{false, true} {
					layouts = append(layouts, providersim.Layout{TXT: txt, CSV: csv, JSON: js, CRLF: crlf, NoFinalNewline: crlf})
				}
			}
		}
	}
	for _, layout := range layouts {
		sim.SetLayout(layout)
		for typ, id := range types {
			want := make([]Entry, len(simEntries))
			for i, e := range simEntries {
				want[i] = Entry{Host: e.Host, Port: e.Port}
				if typ == "http-auth" || strings.HasPrefix(typ, "ppr-") {
					want[i].Login, want[i].Password = e.Login, e.Password
				}
			}
			for _, format := range []string{"txt", "csv", "json"} {
				l, err := c.IPList(ctx, id, typ, format)
				if err != nil {
					t.Errorf("%+v %s/%s: %v", layout, typ, format, err)
					continue
				}
				if !reflect.DeepEqual(l.Entries, want) || l.Bad != 0 {
					t.Errorf("%+v %s/%s: entries %+v bad %d %q\nraw %q", layout, typ, format, l.Entries, l.Bad, l.BadLines, l.Raw)
				}
			}
		}
	}
	// Default world lists, and the errors of endpoint 16.
	_, url2 := newSim(t, providersim.Config{})
	c2 := simClient(t, url2, nil)
	l, err := c2.IPList(ctx, 101, "http-auth", "txt")
	if err != nil || len(l.Entries) != 3 || l.Entries[0].Host != "10.0.0.1" || l.Entries[0].Port != 8080 || l.Entries[0].Login == "" {
		t.Errorf("default http-auth list = %+v, %v", l, err)
	}
	if l, err := c2.IPList(ctx, 105, "http-ip", "csv"); err != nil || len(l.Entries) != 0 {
		t.Errorf("empty list = %+v, %v", l, err)
	}
	for _, bad := range []struct {
		id          int
		typ, format string
	}{{101, "ppr-http", "txt"}, {102, "http-auth", "json"}, {101, "nope", "txt"}, {555, "http-ip", "txt"}} {
		if _, err := c2.IPList(ctx, bad.id, bad.typ, bad.format); !errors.Is(err, ErrUnprocessable) {
			t.Errorf("IPList(%d, %s, %s): %v", bad.id, bad.typ, bad.format, err)
		}
	}
	if _, err := c2.IPList(ctx, 101, "http-ip", "xml"); err == nil {
		t.Error("IPList with format xml succeeded")
	}
}

func TestSimSticky(t *testing.T) {
	ctx := context.Background()
	for _, shape := range []string{providersim.StickyArray, providersim.StickyWrapped} {
		sim, url := newSim(t, providersim.Config{Layout: providersim.Layout{StickyShape: shape}})
		c := simClient(t, url, nil)
		l, err := c.StickyList(ctx, 102)
		want := []StickySession{
			{Server: providersim.StickyGateway, Session: "s1", Port: 10001, ExitIP: "198.51.100.1", TTL: 5},
			{Server: providersim.StickyGateway, Session: "s2", Port: 10002, ExitIP: "198.51.100.2", TTL: 5},
		}
		if err != nil || !reflect.DeepEqual(l.Sessions, want) || len(l.Raw) == 0 {
			t.Fatalf("%s: StickyList = %+v, %v", shape, l, err)
		}
		for _, id := range []int{101, 103, 104} {
			if l, err := c.StickyList(ctx, id); err != nil || len(l.Sessions) != 0 || string(l.Raw) == "" {
				t.Errorf("%s: StickyList(%d) = %+v, %v", shape, id, l, err)
			}
		}
		var apiErr *APIError
		if _, err := c.StickyList(ctx, 555); !errors.Is(err, ErrUnprocessable) || !errors.As(err, &apiErr) || apiErr.Message != "Service not found" {
			t.Errorf("%s: StickyList(555): %v", shape, err)
		}

		res, err := c.StickyRotate(ctx, 102, providersim.StickyGateway, "s1")
		if err != nil || res.ExitIP == "" || res.ExitIP == "198.51.100.1" || res.ExitIP != sim.Sessions(102)[0].ExitIP {
			t.Errorf("%s: rotate = %+v, %v; sim has %+v", shape, res, err, sim.Sessions(102))
		}
		if _, err := c.StickyRotate(ctx, 102, providersim.StickyGateway, "nope"); !errors.Is(err, ErrUnprocessable) {
			t.Errorf("%s: rotate unknown session: %v", shape, err)
		}

		if res, err := c.StickyChangeTTL(ctx, 102, 10); err != nil || len(res.Raw) == 0 {
			t.Errorf("%s: changettl = %+v, %v", shape, res, err)
		}
		if l, _ := c.StickyList(ctx, 102); l.Sessions[0].TTL != 10 || l.Sessions[1].TTL != 10 {
			t.Errorf("%s: TTL after changettl: %+v", shape, l.Sessions)
		}
		for _, ttl := range []int{0, 4, 16, -1} {
			if _, err := c.StickyChangeTTL(ctx, 102, ttl); !errors.Is(err, ErrUnprocessable) {
				t.Errorf("%s: changettl %d: %v", shape, ttl, err)
			}
		}
		if res, err := c.StickyChangeTTL(ctx, 101, 5); err != nil || len(res.Raw) != 0 {
			t.Errorf("%s: changettl on fpr = %+v, %v; want an empty answer", shape, res, err)
		}

		before := sim.Sessions(102)
		if res, err := c.StickyResetAll(ctx, 102); err != nil || len(res.Raw) == 0 {
			t.Errorf("%s: resetall = %+v, %v", shape, res, err)
		}
		after := sim.Sessions(102)
		if after[0].ExitIP == before[0].ExitIP || after[1].ExitIP == before[1].ExitIP {
			t.Errorf("%s: resetall kept exit IPs: %+v -> %+v", shape, before, after)
		}
		if res, err := c.StickyResetAll(ctx, 101); err != nil || string(res.Raw) != "[]" {
			t.Errorf("%s: resetall on fpr = %q, %v", shape, res.Raw, err)
		}

		sim.RotateHook(func(service int, server, session string) (int, string) {
			return 200, `{"data":{"session":"` + session + `","exit_ip":"198.51.100.200"}}`
		})
		if res, err := c.StickyRotate(ctx, 102, "gw 2/x", "s/1"); err != nil || res.ExitIP != "198.51.100.200" {
			t.Errorf("%s: hooked rotate = %+v, %v", shape, res, err)
		}
	}
}

func TestSimAuth(t *testing.T) {
	ctx := context.Background()
	_, url := newSim(t, providersim.Config{})
	for _, tc := range []struct {
		name string
		mod  func(*Config)
		want error
	}{
		{"token", nil, nil},
		{"login", func(c *Config) {
			c.Token, c.Login, c.Password = "", providersim.DefaultLogin, providersim.DefaultPassword
		}, nil},
		{"wrong token", func(c *Config) { c.Token = "wrong-token" }, ErrUnauthenticated},
		{"wrong password", func(c *Config) { c.Token, c.Login, c.Password = "", providersim.DefaultLogin, "nope" }, ErrUnauthenticated},
		{"no colon", func(c *Config) { c.Token = base64.StdEncoding.EncodeToString([]byte("no-colon-here")) }, ErrInvalidCredentialsFormat},
		{"other scheme", func(c *Config) { c.Transport = rewriteAuth("Bearer " + providersim.DefaultToken) }, ErrInvalidAuthHeader},
		{"no header", func(c *Config) { c.Transport = rewriteAuth("") }, ErrUnauthenticated},
	} {
		c := simClient(t, url, tc.mod)
		_, err := c.Services(ctx)
		if tc.want == nil && err != nil || tc.want != nil && !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
}

// rewriteAuth is a Transport that replaces (or with "" removes) the
// Authorization header.
func rewriteAuth(value string) http.RoundTripper {
	return roundTripFunc(func(r *http.Request) (*http.Response, error) {
		r = r.Clone(r.Context())
		if value == "" {
			r.Header.Del("Authorization")
		} else {
			r.Header.Set("Authorization", value)
		}
		return http.DefaultTransport.RoundTrip(r)
	})
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func TestSimFailuresLatencyAndCounts(t *testing.T) {
	ctx := context.Background()
	sim, url := newSim(t, providersim.Config{})
	c := simClient(t, url, nil)

	sim.FailNext(1, 502, "<html><body>"+strings.Repeat("Bad Gateway ", 100)+"</body></html>")
	_, err := c.Services(ctx)
	var apiErr *APIError
	if !errors.As(err, &apiErr) || apiErr.Status != 502 || apiErr.Route != RouteServices || apiErr.Message != "" ||
		len(apiErr.Body) > maxExcerpt || !strings.HasPrefix(apiErr.Body, "<html>") {
		t.Errorf("502: %#v", apiErr)
	}
	sim.FailNext(1, 503, `{"error":"Maintenance "}`)
	if _, err := c.Credit(ctx); !errors.As(err, &apiErr) || apiErr.Status != 503 || apiErr.Message != "Maintenance" {
		t.Errorf("503: %v", err)
	}
	if _, err := c.Credit(ctx); err != nil {
		t.Errorf("after FailNext: %v", err)
	}

	sim.SetLatency(2 * time.Second)
	slow := simClient(t, url, func(cfg *Config) { cfg.Timeout = 100 * time.Millisecond })
	start := time.Now()
	if _, err := slow.Clients(ctx); err == nil || time.Since(start) > time.Second {
		t.Errorf("latency: err %v after %v, want a timeout", err, time.Since(start))
	}
	sim.SetLatency(0)

	before := sim.Requests(RouteIPList)
	for i := 0; i < 3; i++ {
		if _, err := c.IPList(ctx, 101, "http-ip", "json"); err != nil {
			t.Fatal(err)
		}
	}
	if got := sim.Requests(RouteIPList) - before; got != 3 {
		t.Errorf("Requests(%s) = %d, want 3", RouteIPList, got)
	}
}

// TestSimTokenNeverLeaks: 401, 400 and 500 answers of the simulator leave
// no trace of the credential in errors or logs.
func TestSimTokenNeverLeaks(t *testing.T) {
	ctx := context.Background()
	sim, url := newSim(t, providersim.Config{})
	const wrong = "wrong-Tq8Lz3Vw0Np6"
	noColon := base64.StdEncoding.EncodeToString([]byte("no-colon-Hj5Rk2"))
	var logBuf bytes.Buffer
	logger := slog.New(slog.NewJSONHandler(&logBuf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	var errs []string
	for _, token := range []string{wrong, noColon, providersim.DefaultToken} {
		c := simClient(t, url, func(cfg *Config) { cfg.Token, cfg.Logger = token, logger })
		if token == providersim.DefaultToken {
			sim.FailNext(2, 500, "Internal Server Error\nstack trace")
		}
		for _, call := range []func() error{
			func() error { _, err := c.Services(ctx); return err },
			func() error { _, err := c.StickyRotate(ctx, 102, "gw", "s"); return err },
		} {
			err := call()
			if err == nil {
				t.Fatalf("token %d: want an error", len(errs))
			}
			errs = append(errs, err.Error(), fmt.Sprintf("%+v %#v", err, err))
		}
	}
	all := strings.Join(errs, "\n") + logBuf.String()
	for _, secret := range []string{wrong, noColon, providersim.DefaultToken} {
		if strings.Contains(all, secret) {
			t.Errorf("credential %q leaked:\n%s", secret, all)
		}
	}
	for _, want := range []string{"401", "400", "500"} {
		if !strings.Contains(all, want) {
			t.Errorf("no %s answer seen:\n%s", want, all)
		}
	}
}
