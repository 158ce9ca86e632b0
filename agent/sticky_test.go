package agent

import (
	"context"
	"encoding/json"
	"net/http"
	"reflect"
	"testing"
)

var stickyLayouts = []struct {
	name string
	body string
	want []StickySession
}{
	{"array", `[{"server":"gw1.sim.example","session":"s1","port":10001,"ip":"198.51.100.7","ttl":5},{"server":"gw1.sim.example","session":"s2","port":"10002","ip":"198.51.100.8","ttl":"5"}]`,
		[]StickySession{{Server: "gw1.sim.example", Session: "s1", Port: 10001, ExitIP: "198.51.100.7", TTL: 5}, {Server: "gw1.sim.example", Session: "s2", Port: 10002, ExitIP: "198.51.100.8", TTL: 5}}},
	{"wrapped sessions", `{"sessions":[{"host":"gw1.sim.example","session_id":"s1","port":"10001","exit_ip":"198.51.100.7","ttl":5}]}`,
		[]StickySession{{Server: "gw1.sim.example", Session: "s1", Port: 10001, ExitIP: "198.51.100.7", TTL: 5}}},
	{"wrapped data camel case", `{"status":"ok","data":[{"gateway":"gw2","sessionId":42,"exitIp":"2001:db8::7","current_ip":"ignored"}]}`,
		[]StickySession{{Server: "gw2", Session: "42", ExitIP: "2001:db8::7", Extra: map[string]json.RawMessage{"current_ip": json.RawMessage(`"ignored"`)}}}},
	{"wrapped list id synonyms", `{"list":[{"server":"gw3:9000","id":"abc","currentIp":"203.0.113.1","country":"DE"}]}`,
		[]StickySession{{Server: "gw3", Session: "abc", Port: 9000, ExitIP: "203.0.113.1", Extra: map[string]json.RawMessage{"country": json.RawMessage(`"DE"`)}}}},
	{"keyed by session", `{"s9":{"server":"gw1","port":10009},"s8":{"server":"gw1","port":10008}}`,
		[]StickySession{{Server: "gw1", Session: "s8", Port: 10008}, {Server: "gw1", Session: "s9", Port: 10009}}},
	{"wrapped, keyed by session", `{"sessions":{"s9":{"server":"gw1","port":10009},"s8":{"server":"gw1","port":10008}}}`,
		[]StickySession{{Server: "gw1", Session: "s8", Port: 10008}, {Server: "gw1", Session: "s9", Port: 10009}}},
	{"wrapped, keyed by session, beside metadata", `{"meta":{"page":1},"sessions":{"s9":{"server":"gw1","port":10009}}}`,
		[]StickySession{{Server: "gw1", Session: "s9", Port: 10009}}},
	{"keyed by session beside a count", `{"total":1,"s7":{"server":"gw1","port":10007}}`,
		[]StickySession{{Server: "gw1", Session: "s7", Port: 10007}}},
	{"single record", `{"server":"gw1","session":"only"}`, []StickySession{{Server: "gw1", Session: "only"}}},
	{"strings", `["s1","s2"]`, []StickySession{{Session: "s1"}, {Session: "s2"}}},
	{"bad port kept in extra", `[{"server":"gw1","session":"s1","port":"n/a"}]`,
		[]StickySession{{Server: "gw1", Session: "s1", Extra: map[string]json.RawMessage{"port": json.RawMessage(`"n/a"`)}}}},
	{"empty array", `[]`, nil},
	{"empty object", `{}`, nil},
	{"null", `null`, nil},
	{"empty body", ``, nil},
}

func TestParseStickyList(t *testing.T) {
	for _, tc := range stickyLayouts {
		l, err := ParseStickyList([]byte(tc.body))
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if string(l.Raw) != tc.body {
			t.Errorf("%s: Raw = %q", tc.name, l.Raw)
		}
		if !reflect.DeepEqual(l.Sessions, tc.want) && (len(l.Sessions) != 0 || len(tc.want) != 0) {
			t.Errorf("%s: Sessions =\n%+v\nwant\n%+v", tc.name, l.Sessions, tc.want)
		}
	}
	for _, bad := range []string{`<html>`, `[1,2]`, `{"a":1}`, `"text"`} {
		l, err := ParseStickyList([]byte(bad))
		if err == nil || l == nil || string(l.Raw) != bad {
			t.Errorf("%q: list %+v, err %v; want an error with Raw kept", bad, l, err)
		}
	}
}

func TestStickyEndpoints(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		body string
		want string
	}{
		{`{"success":true,"ip":"198.51.100.9"}`, "198.51.100.9"},
		{`{"session":{"server":"gw1","exit_ip":"198.51.100.10"}}`, "198.51.100.10"},
		{`{"result":{"new_ip":"2001:db8::9"}}`, "2001:db8::9"},
		{`"198.51.100.11"`, "198.51.100.11"},
		{`198.51.100.12`, "198.51.100.12"},
		{`{"ip":"not an ip","exitIp":"198.51.100.13"}`, "198.51.100.13"},
		{`{"success":"rotated"}`, ""},
		{``, ""},
		{`[]`, ""},
		{`<html>`, ""},
	} {
		srv, rec := serve(t, 200, tc.body)
		c := newTestClient(t, srv.URL)
		res, err := c.StickyRotate(ctx, 102, "gw1.sim.example", "s1")
		if err != nil || res.ExitIP != tc.want || string(res.Raw) != tc.body {
			t.Errorf("rotate %q: %+v, %v; want ExitIP %q", tc.body, res, err, tc.want)
		}
		if r, _ := rec.last(); r.URL.Path != "/api/sticky/rotate/102/gw1.sim.example/s1" || r.Method != http.MethodGet {
			t.Errorf("rotate request %s %s", r.Method, r.URL.Path)
		}
	}
	srv, rec := serve(t, 200, ``)
	c := newTestClient(t, srv.URL)
	if res, err := c.StickyChangeTTL(ctx, 102, 10); err != nil || len(res.Raw) != 0 {
		t.Errorf("changettl: %+v, %v", res, err)
	}
	if r, _ := rec.last(); r.URL.Path != "/api/sticky/changettl/102/10" {
		t.Errorf("changettl path %s", r.URL.Path)
	}
	if res, err := c.StickyResetAll(ctx, 102); err != nil || res == nil {
		t.Errorf("resetall: %+v, %v", res, err)
	}
	if r, _ := rec.last(); r.URL.Path != "/api/sticky/resetall/102" {
		t.Errorf("resetall path %s", r.URL.Path)
	}
	if _, err := c.StickyRotate(ctx, 102, "", "s1"); err == nil {
		t.Error("rotate with an empty server succeeded")
	}
}
