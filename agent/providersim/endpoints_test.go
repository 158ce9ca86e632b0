package providersim

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

const (
	unprocessable      = "Unprocessable Entity"
	unprocessableSpace = "Unprocessable Entity "
)

func TestProducts(t *testing.T) {
	ts := newTestSim(t, Config{})
	ts.do(t, "GET", "/api/product/1999", "").wantError(t, "unknown product", 422, "Unprocessable Entity or product ID not found")
	ts.do(t, "GET", "/api/product/abc", "").wantError(t, "non-numeric product", 422, "Unprocessable Entity or product ID not found")

	order := func(field string) []int {
		var ps []struct {
			ProductID int `json:"productId"`
		}
		ts.do(t, "GET", "/api/products/orderby/"+field, "").decode(t, field, &ps)
		var ids []int
		for _, p := range ps {
			ids = append(ids, p.ProductID)
		}
		return ids
	}
	for field, want := range map[string]string{
		"productId":   "[11 12 13]",
		"productName": "[13 12 11]",
		"price":       "[11 13 12]",
		"groupId":     "[11 12 13]",
		"groupName":   "[13 11 12]",
		"created_at":  "[11 12 13]",
	} {
		if got := fmt.Sprint(order(field)); got != want {
			t.Errorf("orderby %s: %s, want %s (hidden product 14 never listed)", field, got, want)
		}
	}
	ts.do(t, "GET", "/api/products/orderby/nope", "").wantError(t, "unknown field", 422, unprocessable)
}

func TestOrder(t *testing.T) {
	ts := newTestSim(t, Config{})
	for _, c := range []struct {
		name, path, body, msg string
	}{
		{"unknown product", "/api/product/1999", `{"clientid":7}`, "Unprocessable Entity or product ID not found"},
		{"unknown product, bad body", "/api/product/1999", `{`, "Unprocessable Entity or product ID not found"},
		{"bad json", "/api/product/11", `{`, "Unprocessable Entity. Incorrect posted data"},
		{"not an object", "/api/product/11", `[7]`, "Unprocessable Entity. Incorrect posted data"},
		{"empty body", "/api/product/11", ``, "Unprocessable Entity. Incorrect posted data"},
		{"no clientid", "/api/product/11", `{"setip":"198.18.1.1"}`, "Unprocessable Entity. Incorrect posted data"},
		{"clientid not a number", "/api/product/11", `{"clientid":"seven"}`, "Unprocessable Entity. Incorrect posted data"},
		{"clientid fractional", "/api/product/11", `{"clientid":7.5}`, "Unprocessable Entity. Incorrect posted data"},
		{"setip not a string", "/api/product/11", `{"clientid":7,"setip":1}`, "Unprocessable Entity. Incorrect posted data"},
		{"setip not IPv4", "/api/product/11", `{"clientid":7,"setip":"::1"}`, "Unprocessable Entity. Incorrect posted data"},
		{"setip bound", "/api/product/11", `{"clientid":7,"setip":"203.0.113.50"}`, "Unprocessable Entity. Incorrect posted data"},
		{"unknown client", "/api/product/11", `{"clientid":99}`, "Unprocessable Entity. ClientID not found"},
	} {
		ts.do(t, "POST", c.path, c.body).wantError(t, c.name, 422, c.msg)
	}
	if got := ts.Credit(); got != InitialCredit {
		t.Fatalf("refused orders charged credit: %v", got)
	}

	// A ppr order ignores setip; clientid may be a numeric string.
	ts.do(t, "POST", "/api/product/13", `{"clientid":"8","setip":"198.18.1.1"}`).want(t, "ppr order", 200,
		`{"serviceId":106,"orderId":5006,"invoiceId":7004,"amount":15,"ip":""}`)
	ts.do(t, "POST", "/api/product/14", `{"clientid":7}`).want(t, "hidden product order", 200,
		`{"serviceId":107,"orderId":5007,"invoiceId":7005,"amount":5,"ip":""}`)
	if got := ts.Credit(); got != 80 {
		t.Errorf("credit after orders of 15 and 5: %v", got)
	}
	ts.do(t, "GET", "/api/billing/credit", "").want(t, "credit", 200, `{"credit":80}`)
	ts.do(t, "GET", "/api/billing/invoice/7005", "").want(t, "invoice of the order", 200,
		`[{"id":7005,"description":"Private Static - service #107","status":"Paid","created_at":"2026-11-21","amount":5,"date_refunded":"0000-00-00","date_paid":"2026-11-21","paymentmethod":"credit","serviceid":107}]`)
	ts.do(t, "GET", "/api/iplist/ppr-socks/txt/106", "").want(t, "lists of the new ppr service", 200,
		"192.0.2.21:9000@u106:pw-106-sim\n192.0.2.22:9000@u106:pw-106-sim\n")
	ts.do(t, "GET", "/api/iplist/http-auth/txt/107", "").want(t, "lists of the new fpr service", 200,
		"10.1.107.1:8080@u107:pw-107-sim\n")
	ts.do(t, "GET", "/api/sticky/list/106", "").want(t, "new ppr service has no sessions", 200, `[]`)

	// Not enough funds: nothing changes.
	ts.SetCredit(20.49)
	ts.do(t, "POST", "/api/product/12", `{"clientid":7}`).wantError(t, "funds", 422, "Unprocessed entity or not enough funds to order")
	if got := ts.Credit(); got != 20.49 {
		t.Errorf("credit after a refused order: %v", got)
	}
	ts.SetCredit(20.50)
	ts.do(t, "POST", "/api/product/12", `{"clientid":7}`).want(t, "exact funds", 200,
		`{"serviceId":108,"orderId":5008,"invoiceId":7006,"amount":20.5,"ip":""}`)
	ts.do(t, "GET", "/api/billing/credit", "").want(t, "credit spent", 200, `{"credit":0}`)
}

func TestServiceGetAndList(t *testing.T) {
	ts := newTestSim(t, Config{})
	for _, p := range []string{"/api/service/1999", "/api/service/950", "/api/service/x", "/api/service/0", "/api/service/-1"} {
		ts.do(t, "GET", p, "").wantError(t, p, 422, unprocessable)
	}
	ts.SetServiceStatus(101, "Fraud")
	var list []struct {
		ServiceID any    `json:"service_id"`
		Status    string `json:"status"`
	}
	ts.do(t, "GET", "/api/services", "").decode(t, "services", &list)
	if len(list) != 5 || fmt.Sprint(list[0].ServiceID) != "101" || list[0].Status != "Fraud" || fmt.Sprint(list[2].ServiceID) != "103" {
		t.Errorf("services: %+v", list)
	}
	ts.do(t, "GET", "/api/billing/invoice/123", "").want(t, "unknown invoice", 200, `[]`)
	ts.do(t, "GET", "/api/billing/invoice/abc", "").want(t, "non-numeric invoice", 200, `[]`)
}

func TestServiceUpdate(t *testing.T) {
	ts := newTestSim(t, Config{})
	put := func(id int, body string) answer { return ts.do(t, "PUT", fmt.Sprintf("/api/service/%d", id), body) }

	put(950, `{"setip":"198.18.0.1"}`).wantError(t, "orphan service", 400, "Unprocessable Entity. ClientID not found")
	put(1999, `{"setip":"198.18.0.1"}`).wantError(t, "unknown service", 422, unprocessable)
	for _, c := range []struct{ name, body, msg string }{
		{"bad json", `{"setip":`, "Unprocessable Entity. Incorrect posted data"},
		{"array", `["setip"]`, "Unprocessable Entity. Incorrect posted data"},
		{"setip number", `{"setip":1}`, "Unprocessable Entity. Incorrect posted data"},
		{"update_list junk", `{"update_list":"yes"}`, "Unprocessable Entity. Incorrect posted data"},
		{"update_list number", `{"update_list":1}`, "Unprocessable Entity. Incorrect posted data"},
		{"password not base64", `{"password":"not base64!"}`, "Unprocessable Entity. Incorrect posted data"},
		{"password not padded", `{"password":"bmV3cGFzcw"}`, "Unprocessable Entity. Incorrect posted data"},
		{"password binary", `{"password":"AAEC"}`, "Unprocessable Entity. Incorrect posted data"},
		{"ipv4 short", `{"setip":"1.2.3"}`, "Unprocessable Entity. Invalid IPv4 format"},
		{"ipv4 octet", `{"setip":"1.2.3.256"}`, "Unprocessable Entity. Invalid IPv4 format"},
		{"ipv6", `{"setip":"2001:db8::1"}`, "Unprocessable Entity. Invalid IPv4 format"},
		{"mapped", `{"setip":"::ffff:1.2.3.4"}`, "Unprocessable Entity. Invalid IPv4 format"},
		{"leading zero", `{"setip":"01.2.3.4"}`, "Unprocessable Entity. Invalid IPv4 format"},
		{"bad ip, good password", `{"setip":"x","password":"bmV3"}`, "Unprocessable Entity. Invalid IPv4 format"},
	} {
		put(103, c.body).wantError(t, c.name, 422, c.msg)
	}
	// 203.0.113.50 is bound to 101.
	put(103, `{"setip":"203.0.113.50"}`).wantError(t, "bound elsewhere", 422, "Unprocessable Entity. IP already binded")
	put(102, `{"setip":"198.18.0.1"}`).wantError(t, "ppr has no bound IP", 422, unprocessable)
	put(101, `{"setip":"203.0.113.50"}`).want(t, "rebinding its own IP", 200, `{"setip":{"success":"IP address updated successfully"}}`)
	put(101, ``).want(t, "no body", 200, `{}`)
	put(101, `null`).want(t, "null body", 200, `{}`)
	put(101, `{"setip":"","password":"","update_list":"false","other":1}`).want(t, "nothing requested", 200, `{}`)

	// Password: base64 in, plain in the service record and in the lines.
	put(101, `{"password":"`+b64("s3cret:with colon")+`"}`).want(t, "password", 200, `{"password":{"success":"Password updated successfully"}}`)
	var sv map[string]any
	ts.do(t, "GET", "/api/service/101", "").decode(t, "service", &sv)
	if sv["password"] != "s3cret:with colon" {
		t.Errorf("password after update: %v", sv["password"])
	}
	ts.do(t, "GET", "/api/iplist/http-auth/txt/101", "").want(t, "lines carry the new password", 200,
		"10.0.0.1:8080@u101:s3cret:with colon\n10.0.0.2:8080@u101:s3cret:with colon\n10.0.0.3:8080@u101:s3cret:with colon\n")

	// update_list: once per interval, 429 with the next time, nothing applied.
	put(101, `{"update_list":true}`).want(t, "first update", 200, `{"update_list":{"success":"IP list updated successfully"}}`)
	ts.clock.Advance(4*time.Minute + 30*time.Second)
	put(101, `{"update_list":"true","setip":"198.18.7.7"}`).wantError(t, "too soon", 429,
		"Too Many Attempts (updateList). Next update possible: 2026-11-21 10:10:00")
	ts.do(t, "GET", "/api/service/101", "").decode(t, "service", &sv)
	if sv["bindedip"] != "203.0.113.50" {
		t.Errorf("refused update changed the bound IP: %v", sv["bindedip"])
	}
	put(102, `{"update_list":"true"}`).want(t, "other service not limited", 200, `{"update_list":{"success":"IP list updated successfully"}}`)
	ts.clock.Advance(5*time.Minute + 29*time.Second)
	put(101, `{"update_list":"true"}`).wantError(t, "one second early", 429,
		"Too Many Attempts (updateList). Next update possible: 2026-11-21 10:10:00")
	ts.clock.Advance(time.Second)
	put(101, `{"update_list":"true","setip":"198.18.7.7"}`).want(t, "after the interval", 200,
		`{"setip":{"success":"IP address updated successfully"},"update_list":{"success":"IP list updated successfully"}}`)
	put(101, `{"update_list":"true"}`).wantError(t, "limit restarts", 429,
		"Too Many Attempts (updateList). Next update possible: 2026-11-21 10:20:00")
	// The old IP is free again.
	put(103, `{"setip":"203.0.113.50"}`).want(t, "freed IP", 200, `{"setip":{"success":"IP address updated successfully"}}`)
}

func TestUpdateListInterval(t *testing.T) {
	ts := newTestSim(t, Config{UpdateListInterval: time.Hour})
	ts.do(t, "PUT", "/api/service/104", `{"update_list":"true"}`).want(t, "first", 200, `{"update_list":{"success":"IP list updated successfully"}}`)
	ts.do(t, "PUT", "/api/service/104", `{"update_list":"true"}`).wantError(t, "second", 429,
		"Too Many Attempts (updateList). Next update possible: 2026-11-21 11:00:00")
}

func TestNetworkStatus(t *testing.T) {
	ts := newTestSim(t, Config{})
	for _, kind := range []string{"errors", "inactive"} {
		ts.do(t, "GET", "/api/networkstatus/"+kind+"/950", "").wantError(t, kind+" orphan", 400, "Unprocessable Entity. ClientID not found")
		ts.do(t, "GET", "/api/networkstatus/"+kind+"/1999", "").wantError(t, kind+" unknown", 422, unprocessableSpace)
		ts.do(t, "GET", "/api/networkstatus/"+kind+"/abc", "").wantError(t, kind+" non-numeric", 422, unprocessableSpace)
	}
	ts.MarkErrored(101, "10.0.0.2", "10.0.0.3")
	ts.MarkErrored(101, "10.0.0.2")
	ts.MarkInactive(102, "192.0.2.22")
	ts.MarkErrored(1999, "10.9.9.9") // unknown service: no effect
	ts.do(t, "GET", "/api/networkstatus/errors/101", "").want(t, "errors", 200, `["10.0.0.2","10.0.0.3"]`)
	ts.do(t, "GET", "/api/networkstatus/inactive/101", "").want(t, "inactive", 200, `[]`)
	ts.do(t, "GET", "/api/networkstatus/inactive/102", "").want(t, "ppr inactive", 200, `["192.0.2.22"]`)
	ts.ClearStatus(101)
	ts.do(t, "GET", "/api/networkstatus/errors/101", "").want(t, "cleared", 200, `[]`)
	ts.do(t, "GET", "/api/networkstatus/inactive/102", "").want(t, "other service kept", 200, `["192.0.2.22"]`)
}

func TestStatsAndRate(t *testing.T) {
	ts := newTestSim(t, Config{})
	for _, ep := range []string{"stats", "rate"} {
		for _, id := range []string{"101", "103", "1999", "950", "x"} {
			ts.do(t, "GET", "/api/"+ep+"/"+id, "").wantError(t, ep+" "+id, 422, unprocessableSpace)
		}
	}
	ts.do(t, "GET", "/api/stats/104", "").want(t, "ppr without stats", 200, `[]`)
	ts.do(t, "GET", "/api/rate/104", "").want(t, "ppr rate", 200, `[{"limit":1024,"rate":0}]`)
	ts.SetUsage(102, 1000.5, 2048)
	ts.SetUsage(104, 12, 100)
	ts.do(t, "GET", "/api/rate/102", "").want(t, "rate after SetUsage", 200, `[{"limit":2048,"rate":1000.5}]`)
	ts.do(t, "GET", "/api/rate/104", "").want(t, "rate after SetUsage", 200, `[{"limit":100,"rate":12}]`)
	ts.clock.Advance(24 * time.Hour)
	ts.do(t, "GET", "/api/stats/102", "").want(t, "stats follow the clock", 200,
		`[{"date":"2026-11-20","rate":120},{"date":"2026-11-21","rate":80.25},{"date":"2026-11-22","rate":1000.5}]`)
}

func TestSticky(t *testing.T) {
	ts := newTestSim(t, Config{})

	// List.
	ts.do(t, "GET", "/api/sticky/list/1999", "").wantError(t, "unknown", 422, "Service not found")
	ts.do(t, "GET", "/api/sticky/list/101", "").want(t, "fpr", 200, `[]`)
	ts.do(t, "GET", "/api/sticky/list/104", "").want(t, "no sessions", 200, `[]`)
	ts.SetLayout(Layout{StickyShape: StickyWrapped})
	ts.do(t, "GET", "/api/sticky/list/102", "").want(t, "wrapped", 200,
		`{"sessions":[{"host":"gw1.sim.example","session_id":"s1","port":"10001","exit_ip":"198.51.100.1","ttl":5},{"host":"gw1.sim.example","session_id":"s2","port":"10002","exit_ip":"198.51.100.2","ttl":5}]}`)
	ts.do(t, "GET", "/api/sticky/list/104", "").want(t, "wrapped, no sessions", 200, `{"sessions":[]}`)
	ts.do(t, "GET", "/api/sticky/list/103", "").want(t, "wrapped, fpr", 200, `[]`)
	ts.SetLayout(Layout{})

	// Rotate.
	ts.do(t, "GET", "/api/sticky/rotate/102/gw1.sim.example/nope", "").wantError(t, "unknown session", 422, unprocessable)
	ts.do(t, "GET", "/api/sticky/rotate/102/gw2.sim.example/s1", "").wantError(t, "wrong server", 422, unprocessable)
	ts.do(t, "GET", "/api/sticky/rotate/101/gw1.sim.example/s1", "").wantError(t, "fpr", 422, unprocessable)
	ts.do(t, "GET", "/api/sticky/rotate/1999/gw1.sim.example/s1", "").wantError(t, "unknown service", 422, unprocessable)
	ts.do(t, "GET", "/api/sticky/rotate/102/gw1.sim.example/s2", "").want(t, "rotate", 200,
		`{"success":true,"server":"gw1.sim.example","session":"s2","ip":"198.51.100.3"}`)
	ts.do(t, "GET", "/api/sticky/rotate/102/gw1.sim.example/s2", "").want(t, "rotate again", 200,
		`{"success":true,"server":"gw1.sim.example","session":"s2","ip":"198.51.100.4"}`)
	if got := fmt.Sprint(ts.Sessions(102)); got != "[{gw1.sim.example s1 10001 10001 2087 198.51.100.1 5} {gw1.sim.example s2 10002 10002 2087 198.51.100.4 5}]" {
		t.Errorf("sessions after rotation: %s", got)
	}

	// Hook.
	var calls []string
	ts.RotateHook(func(service int, server, session string) (int, string) {
		calls = append(calls, fmt.Sprint(service, server, session))
		if session == "s1" {
			return 0, ""
		}
		return 500, `{"error":"gateway busy"}`
	})
	ts.do(t, "GET", "/api/sticky/rotate/102/gw1.sim.example/s2", "").wantError(t, "hooked", 500, "gateway busy")
	ts.do(t, "GET", "/api/sticky/rotate/102/gw1.sim.example/s1", "").want(t, "hook passes", 200,
		`{"success":true,"server":"gw1.sim.example","session":"s1","ip":"198.51.100.5"}`)
	ts.RotateHook(nil)
	if fmt.Sprint(calls) != "[102gw1.sim.examples2 102gw1.sim.examples1]" {
		t.Errorf("hook calls: %v", calls)
	}
	if s := ts.Sessions(102); s[1].ExitIP != "198.51.100.4" {
		t.Errorf("hooked rotation changed the session: %+v", s)
	}

	// Change TTL.
	for _, ttl := range []string{"0", "4", "16", "x", "-1", "60"} {
		ts.do(t, "GET", "/api/sticky/changettl/102/"+ttl, "").wantError(t, "ttl "+ttl, 422, unprocessableSpace)
		ts.do(t, "GET", "/api/sticky/changettl/101/"+ttl, "").wantError(t, "fpr ttl "+ttl, 422, unprocessableSpace)
	}
	ts.do(t, "GET", "/api/sticky/changettl/1999/5", "").wantError(t, "unknown service", 422, unprocessableSpace)
	for _, ttl := range []int{1, 2, 3, 5, 10, 15} {
		ts.do(t, "GET", fmt.Sprintf("/api/sticky/changettl/102/%d", ttl), "").want(t, fmt.Sprint("ttl ", ttl), 200, `{"success":"TTL changed"}`)
		for _, s := range ts.Sessions(102) {
			if s.TTL != ttl {
				t.Errorf("ttl %d: session %+v", ttl, s)
			}
		}
	}
	a := ts.do(t, "GET", "/api/sticky/changettl/101/5", "")
	a.want(t, "fpr", 200, "")
	ts.do(t, "GET", "/api/sticky/changettl/104/5", "").want(t, "ppr without sessions", 200, `{"success":"TTL changed"}`)

	// Reset all.
	ts.do(t, "GET", "/api/sticky/resetall/1999", "").wantError(t, "unknown", 422, unprocessable)
	ts.do(t, "GET", "/api/sticky/resetall/101", "").want(t, "fpr", 200, `[]`)
	ts.do(t, "GET", "/api/sticky/resetall/102", "").want(t, "reset", 200, `{"success":true,"reset":2}`)
	if got := fmt.Sprint(ts.Sessions(102)); got != "[{gw1.sim.example s1 10001 10001 2087 198.51.100.6 15} {gw1.sim.example s2 10002 10002 2087 198.51.100.7 15}]" {
		t.Errorf("sessions after reset: %s", got)
	}

	// Inactive ppr: list [], rotate 422, changettl empty, resetall [].
	ts.SetServiceStatus(102, "Suspended")
	ts.do(t, "GET", "/api/sticky/list/102", "").want(t, "suspended list", 200, `[]`)
	ts.do(t, "GET", "/api/sticky/rotate/102/gw1.sim.example/s1", "").wantError(t, "suspended rotate", 422, unprocessable)
	ts.do(t, "GET", "/api/sticky/changettl/102/5", "").want(t, "suspended ttl", 200, "")
	ts.do(t, "GET", "/api/sticky/resetall/102", "").want(t, "suspended reset", 200, `[]`)
	if got := ts.Sessions(102); got[0].TTL != 15 || got[0].ExitIP != "198.51.100.6" {
		t.Errorf("inactive service's sessions changed: %+v", got)
	}
	ts.SetServiceStatus(102, "Active")

	// SetStickySessions, and a session on another gateway.
	ts.SetStickySessions(104, []Session{{Server: "127.0.0.1", Session: "a-1", Port: 3128, ExitIP: "192.0.2.99", TTL: 2}})
	ts.do(t, "GET", "/api/sticky/list/104", "").want(t, "set sessions", 200,
		`[{"server":"127.0.0.1","session":"a-1","port":3128,"ip":"192.0.2.99","ttl":2}]`)
	ts.do(t, "GET", "/api/sticky/rotate/104/127.0.0.1/a-1", "").want(t, "rotate set session", 200,
		`{"success":true,"server":"127.0.0.1","session":"a-1","ip":"198.51.100.8"}`)
	if ts.Sessions(1999) != nil {
		t.Error("sessions of an unknown service")
	}
}

func TestExitIPsWrap(t *testing.T) {
	ts := newTestSim(t, Config{})
	var last string
	for range 254 {
		var r struct{ IP string }
		ts.do(t, "GET", "/api/sticky/rotate/102/gw1.sim.example/s1", "").decode(t, "rotate", &r)
		if !strings.HasPrefix(r.IP, "198.51.100.") || r.IP == "198.51.100.0" || r.IP == "198.51.100.255" {
			t.Fatalf("exit IP %q out of range", r.IP)
		}
		last = r.IP
	}
	// 3..254 then 1, 2, 3, ...: 254 rotations end on .2.
	if last != "198.51.100.2" {
		t.Errorf("last exit IP %s", last)
	}
	if n := ts.Requests("/api/sticky/rotate/{id}/{server}/{session}"); n != 254 {
		t.Errorf("rotate count %d", n)
	}
}
