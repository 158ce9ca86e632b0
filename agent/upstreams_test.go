package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/proxyd/proxyd/agent/providersim"
)

// The two layouts of a rotating gateway's lists: naming the gateway by host
// name, or by IP while the session records name the host.
var (
	gwName = "gw.example"
	gwIP   = "192.0.2.21"

	byNameHTTP  = []Entry{{Host: gwName, Port: 3081, Login: "L", Password: "P"}, {Host: gwName, Port: 3082, Login: "L", Password: "P"}}
	byNameSOCKS = []Entry{{Host: gwName, Port: 2087, Login: "L", Password: "P"}}
	byIPHTTP    = []Entry{{Host: gwIP, Port: 3081, Login: "L", Password: "P"}, {Host: gwIP, Port: 3082, Login: "L", Password: "P"}}
	byIPSOCKS   = []Entry{{Host: gwIP, Port: 2087, Login: "L", Password: "P"}}
	// Two SOCKS5 ports on the gateway: no single entry to fall back on.
	byIPSOCKS2 = []Entry{{Host: gwIP, Port: 2087, Login: "L", Password: "P"}, {Host: gwIP, Port: 2088, Login: "L", Password: "P"}}
	resolvedGW = []string{gwIP}
)

// TestMatchSession is a table of every case of the matching rule, in
// both layouts.
func TestMatchSession(t *testing.T) {
	for _, tc := range []struct {
		name      string
		session   StickySession
		proto     string
		entries   []Entry
		resolved  []string
		wantAddr  string
		wantMatch string
	}{
		// 1. A port the record names for the protocol.
		{"record http_port", StickySession{Server: gwName, Ports: map[string]int{"http": 3082, "socks5": 2087}}, "http", byIPHTTP, resolvedGW, gwName + ":3082", MatchRecord},
		{"record socks_port", StickySession{Server: gwName, Ports: map[string]int{"http": 3082, "socks5": 2087}}, "socks5", byIPSOCKS, resolvedGW, gwName + ":2087", MatchRecord},
		{"record port wins over the one port", StickySession{Server: gwName, Port: 3081, Ports: map[string]int{"socks5": 2099}}, "socks5", byNameSOCKS, nil, gwName + ":2099", MatchRecord},
		{"record port not on the list still named", StickySession{Server: gwName, Ports: map[string]int{"http": 4000}}, "http", byNameHTTP, nil, gwName + ":4000", MatchRecord},
		// A record naming only the other protocol's port: this protocol falls to the list rules.
		{"record names only http, socks by single", StickySession{Server: gwName, Ports: map[string]int{"http": 3081}}, "socks5", byNameSOCKS, nil, gwName + ":2087", MatchSingle},

		// 2. The one port in this protocol's list: by name as written
		// (case-insensitively), else by the resolved addresses.
		{"port in list by name", StickySession{Server: gwName, Port: 3082}, "http", byNameHTTP, nil, gwName + ":3082", MatchList},
		{"port in list by name, other case", StickySession{Server: "GW.Example", Port: 3081}, "http", byNameHTTP, nil, gwName + ":3081", MatchList},
		{"port in list by resolved address", StickySession{Server: gwName, Port: 3082}, "http", byIPHTTP, resolvedGW, gwIP + ":3082", MatchList},
		{"port in list, resolution failed", StickySession{Server: gwName, Port: 3082}, "http", byIPHTTP, nil, "", ""},

		// 3. The list's single entry for the server, for a port not in
		// the list or a record without a port.
		{"port not in socks list, single by name", StickySession{Server: gwName, Port: 3081}, "socks5", byNameSOCKS, nil, gwName + ":2087", MatchSingle},
		{"port not in socks list, single by address", StickySession{Server: gwName, Port: 3081}, "socks5", byIPSOCKS, resolvedGW, gwIP + ":2087", MatchSingle},
		{"no port, single", StickySession{Server: gwName}, "socks5", byIPSOCKS, resolvedGW, gwIP + ":2087", MatchSingle},

		// 4. Otherwise no session upstream for the protocol.
		{"no port, two entries", StickySession{Server: gwName}, "http", byNameHTTP, nil, "", ""},
		{"port of the http list is not dialed as socks5", StickySession{Server: gwName, Port: 3081}, "socks5", byIPSOCKS2, resolvedGW, "", ""},
		{"port not in list, two entries", StickySession{Server: gwName, Port: 5555}, "http", byIPHTTP, resolvedGW, "", ""},
		{"server on no list", StickySession{Server: "other.example", Port: 3081}, "http", byNameHTTP, []string{"192.0.2.99"}, "", ""},
		{"no server", StickySession{Port: 3081}, "http", byNameHTTP, nil, "", ""},
		{"empty list", StickySession{Server: gwName, Port: 3081}, "http", nil, resolvedGW, "", ""},
	} {
		addr, e, match := matchSession(tc.session, tc.proto, tc.entries, tc.resolved)
		if addr != tc.wantAddr || match != tc.wantMatch {
			t.Errorf("%s: got %q %q, want %q %q", tc.name, addr, match, tc.wantAddr, tc.wantMatch)
		}
		if match != "" && e.Login != "L" {
			t.Errorf("%s: credentials of the list not used: %+v", tc.name, e)
		}
	}
}

// TestUpstreamsPerProtocol checks the upstreams a service gets in both
// layouts: sessions per protocol as matched, and the list's plain entries
// for a protocol no session matched.
func TestUpstreamsPerProtocol(t *testing.T) {
	type up struct{ proto, addr, session, match string }
	for _, tc := range []struct {
		name     string
		lists    map[string][]Entry
		sessions []StickySession
		resolved map[string][]string
		want     []up
	}{
		{"by name: one port each", map[string][]Entry{"ppr-http": byNameHTTP, "ppr-socks": byNameSOCKS},
			[]StickySession{{Server: gwName, Session: "a", Port: 3081}, {Server: gwName, Session: "b", Port: 3082}}, nil,
			[]up{{"http", gwName + ":3081", "a", "list"}, {"http", gwName + ":3082", "b", "list"},
				{"socks5", gwName + ":2087", "a", "single"}, {"socks5", gwName + ":2087", "b", "single"}}},
		{"by IP: one port each", map[string][]Entry{"ppr-http": byIPHTTP, "ppr-socks": byIPSOCKS},
			[]StickySession{{Server: gwName, Session: "a", Port: 3081}, {Server: gwName, Session: "b", Port: 3082}}, map[string][]string{gwName: resolvedGW},
			[]up{{"http", gwIP + ":3081", "a", "list"}, {"http", gwIP + ":3082", "b", "list"},
				{"socks5", gwIP + ":2087", "a", "single"}, {"socks5", gwIP + ":2087", "b", "single"}}},
		{"by IP: records without ports", map[string][]Entry{"ppr-http": byIPHTTP, "ppr-socks": byIPSOCKS},
			[]StickySession{{Server: gwName, Session: "a"}}, map[string][]string{gwName: resolvedGW},
			[]up{{"http", gwIP + ":3081", "", ""}, {"http", gwIP + ":3082", "", ""}, {"socks5", gwIP + ":2087", "a", "single"}}},
		{"by IP: two SOCKS5 ports, the session's port only in the HTTP list", map[string][]Entry{"ppr-http": byIPHTTP, "ppr-socks": byIPSOCKS2},
			[]StickySession{{Server: gwName, Session: "a", Port: 3081}}, map[string][]string{gwName: resolvedGW},
			[]up{{"http", gwIP + ":3081", "a", "list"}, {"socks5", gwIP + ":2087", "", ""}, {"socks5", gwIP + ":2088", "", ""}}},
		{"record ports", map[string][]Entry{"ppr-http": byIPHTTP, "ppr-socks": byIPSOCKS},
			[]StickySession{{Server: gwName, Session: "a", Ports: map[string]int{"http": 3082, "socks5": 2087}}}, nil,
			[]up{{"http", gwName + ":3082", "a", "record"}, {"socks5", gwName + ":2087", "a", "record"}}},
	} {
		st := ServiceState{ID: 7, Record: Service{ProductType: "ppr", Username: "R", Password: "RP"},
			Lists: tc.lists, Sticky: tc.sessions, Resolved: tc.resolved}
		var got []up
		for _, u := range st.Upstreams() {
			got = append(got, up{u.Protocol, u.Address, u.Session, u.Match})
			if u.Username != "L" || u.Service != 7 || u.Kind != "ppr" {
				t.Errorf("%s: %+v", tc.name, u)
			}
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s:\n got %v\nwant %v", tc.name, got, tc.want)
		}
		if u := st.UnservedSessions(); len(u) != 0 {
			t.Errorf("%s: unserved sessions %v", tc.name, u)
		}
	}
	// A session on no list of a protocol the service fetched is unserved.
	st := ServiceState{Record: Service{ProductType: "ppr"}, Lists: map[string][]Entry{"ppr-http": byIPHTTP},
		Sticky:   []StickySession{{Server: gwName, Session: "a", Port: 3081}, {Server: gwName, Session: "b"}},
		Resolved: map[string][]string{gwName: resolvedGW}}
	if u := st.UnservedSessions(); len(u) != 1 || u[0].Session != "b" {
		t.Errorf("unserved sessions %v, want b", u)
	}
}

// TestSimSessionsMatchLists runs the lists round against the simulator in
// each record and list layout and checks that no port reaches an upstream
// of the other protocol: an HTTP session upstream is on the ppr-http list or
// named by the record for http, a SOCKS5 one likewise.
func TestSimSessionsMatchLists(t *testing.T) {
	for _, hosts := range []string{"", providersim.PPRHostName} {
		for _, ports := range []string{providersim.StickyPortOne, providersim.StickyPortSplit, providersim.StickyPortObject, providersim.StickyPortNone} {
			t.Run(fmt.Sprintf("hosts=%s,ports=%s", hosts, ports), func(t *testing.T) {
				p, sim, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) { c.Services = []int{102} }))
				l := providersim.LayoutDefault
				l.PPRHosts, l.StickyPorts = hosts, ports
				sim.SetLayout(l)
				pollAll(t, p)
				st := serviceByID(p.Snapshot(), 102)
				if st == nil || len(st.Sticky) != 2 {
					t.Fatalf("service 102: %+v", st)
				}
				inList := func(typ, addr string) bool {
					for _, e := range st.Lists[typ] {
						if strings.EqualFold(fmt.Sprintf("%s:%d", e.Host, e.Port), addr) {
							return true
						}
					}
					return false
				}
				sessions := map[string]int{}
				for _, u := range st.Upstreams() {
					typ := map[string]string{"http": "ppr-http", "socks5": "ppr-socks"}[u.Protocol]
					switch u.Match {
					case MatchList, MatchSingle:
						if !inList(typ, u.Address) {
							t.Errorf("%s upstream %s (%s) is not on the %s list %v", u.Protocol, u.Address, u.Match, typ, st.Lists[typ])
						}
					case MatchRecord:
						if ports != providersim.StickyPortSplit && ports != providersim.StickyPortObject {
							t.Errorf("record match without record ports: %+v", u)
						}
					case "":
						if u.Session != "" || !inList(typ, u.Address) {
							t.Errorf("plain upstream not from its list: %+v", u)
						}
					}
					if u.Session != "" {
						sessions[u.Protocol]++
					}
				}
				// Each layout gives both sessions an upstream per protocol,
				// but for records without ports on a gateway with one HTTP
				// port per session: HTTP then serves the plain list.
				wantHTTP := 2
				if ports == providersim.StickyPortNone {
					wantHTTP = 0
				}
				if sessions["http"] != wantHTTP || sessions["socks5"] != 2 {
					t.Errorf("session upstreams per protocol %v, want http %d socks5 2", sessions, wantHTTP)
				}
			})
		}
	}
}

// TestStickyRecordPorts reads per-protocol ports from the record's fields.
func TestStickyRecordPorts(t *testing.T) {
	for _, tc := range []struct {
		body string
		port int
		want map[string]int
	}{
		{`[{"server":"gw","session":"a","port":3081}]`, 3081, nil},
		{`[{"server":"gw","session":"a","http_port":"3081","socks_port":2087}]`, 0, map[string]int{"http": 3081, "socks5": 2087}},
		{`[{"server":"gw","session":"a","httpPort":3081}]`, 0, map[string]int{"http": 3081}},
		{`[{"server":"gw","session":"a","socks5_port":2087,"port":3081}]`, 3081, map[string]int{"socks5": 2087}},
		{`[{"server":"gw","session":"a","ports":{"http":3082,"socks5":"2087","ftp":21}}]`, 0, map[string]int{"http": 3082, "socks5": 2087}},
		{`[{"server":"gw","session":"a","ports":{"HTTP":3082,"socks":2087}}]`, 0, map[string]int{"http": 3082, "socks5": 2087}},
		{`[{"server":"gw","session":"a","ports":[1,2]}]`, 0, nil},
	} {
		l, err := ParseStickyList([]byte(tc.body))
		if err != nil || len(l.Sessions) != 1 {
			t.Fatalf("%s: %v %+v", tc.body, err, l)
		}
		s := l.Sessions[0]
		if s.Port != tc.port || fmt.Sprint(s.Ports) != fmt.Sprint(tc.want) {
			t.Errorf("%s: port %d ports %v, want %d %v", tc.body, s.Port, s.Ports, tc.port, tc.want)
		}
	}
}

// TestResolveHostsOncePerRound checks that each distinct host name, of a
// sticky server or a list entry, is looked up once per lists round and
// IP literals not at all.
func TestResolveHostsOncePerRound(t *testing.T) {
	var asked []string
	p, _, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) {
		c.LookupHost = func(ctx context.Context, host string) ([]string, error) {
			asked = append(asked, host)
			return []string{gwIP}, nil
		}
	}))
	_, cfg, _ := p.current()
	sessions := []StickySession{{Server: gwName}, {Server: gwName}, {Server: "192.0.2.7"}, {Server: "other.example"}}
	lists := map[string][]Entry{"ppr-http": {{Host: gwName}, {Host: "list.example"}, {Host: "192.0.2.8"}}}
	got := p.resolveHosts(context.Background(), LoopLists, cfg, hostNames(sessions, lists), nil)
	if !slices.Equal(asked, []string{gwName, "other.example", "list.example"}) || len(got) != 3 || !slices.Equal(got[gwName], []string{gwIP}) {
		t.Errorf("asked %v, got %v", asked, got)
	}
}

// TestUpstreamsStatusIP: an upstream dialed by host name carries the IP
// the network-status lists name its gateway by; one dialed by IP carries
// none.
func TestUpstreamsStatusIP(t *testing.T) {
	const other = "192.0.2.5" // lower than gwIP
	session := StickySession{Server: gwName, Session: "s1", Ports: map[string]int{"http": 3081, "socks5": 2087}}
	for _, tc := range []struct {
		name     string
		lists    map[string][]Entry
		sticky   []StickySession
		resolved map[string][]string
		want     map[string]string // address → StatusIP, for every upstream
	}{
		{"lists by name", map[string][]Entry{"ppr-http": byNameHTTP, "ppr-socks": byNameSOCKS}, nil,
			map[string][]string{gwName: resolvedGW},
			map[string]string{gwName + ":3081": gwIP, gwName + ":3082": gwIP, gwName + ":2087": gwIP}},
		{"lists by IP", map[string][]Entry{"ppr-http": byIPHTTP, "ppr-socks": byIPSOCKS}, nil,
			map[string][]string{gwName: resolvedGW},
			map[string]string{gwIP + ":3081": "", gwIP + ":3082": "", gwIP + ":2087": ""}},
		{"record ports at the server's name, lists by IP", map[string][]Entry{"ppr-http": byIPHTTP, "ppr-socks": byIPSOCKS},
			[]StickySession{session}, map[string][]string{gwName: resolvedGW},
			map[string]string{gwName + ":3081": gwIP, gwName + ":2087": gwIP}},
		{"several addresses: the one a list names", map[string][]Entry{"ppr-http": byNameHTTP, "ppr-socks": byIPSOCKS}, nil,
			map[string][]string{gwName: {other, gwIP}},
			map[string]string{gwName + ":3081": gwIP, gwName + ":3082": gwIP, gwIP + ":2087": ""}},
		{"several addresses, none listed: the lowest", map[string][]Entry{"ppr-http": byNameHTTP}, nil,
			map[string][]string{gwName: {gwIP, other}},
			map[string]string{gwName + ":3081": other, gwName + ":3082": other}},
		{"name not resolved", map[string][]Entry{"ppr-http": byNameHTTP}, nil,
			map[string][]string{gwName: nil},
			map[string]string{gwName + ":3081": "", gwName + ":3082": ""}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := &ServiceState{ID: 102, Record: Service{ProductType: "ppr"}, Lists: tc.lists, Sticky: tc.sticky, Resolved: tc.resolved}
			got := map[string]string{}
			for _, u := range st.Upstreams() {
				got[u.Address] = u.StatusIP
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Errorf("StatusIP by address %v, want %v", got, tc.want)
			}
		})
	}
}

// TestSimGatewayByNameStatusIP: through the simulator, every upstream
// dialed at the gateway's host name (session ports from the record, or
// lists that name the gateway) carries the IP the errored list names it
// by.
func TestSimGatewayByNameStatusIP(t *testing.T) {
	for _, layout := range []providersim.Layout{
		{StickyPorts: providersim.StickyPortSplit},
		{PPRHosts: providersim.PPRHostName, StickyPorts: providersim.StickyPortOne},
	} {
		t.Run(fmt.Sprintf("hosts=%s,ports=%s", layout.PPRHosts, layout.StickyPorts), func(t *testing.T) {
			p, sim, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) { c.Services = []int{102} }))
			l := providersim.LayoutDefault
			l.PPRHosts, l.StickyPorts = layout.PPRHosts, layout.StickyPorts
			sim.SetLayout(l)
			sim.MarkErrored(102, providersim.StickyGatewayAddr)
			pollAll(t, p)
			st := serviceByID(p.Snapshot(), 102)
			byName := 0
			for _, u := range st.Upstreams() {
				host, _, _ := strings.Cut(u.Address, ":")
				if host != providersim.StickyGateway {
					if u.StatusIP != "" {
						t.Errorf("%s upstream %s dialed by IP has StatusIP %q", u.Protocol, u.Address, u.StatusIP)
					}
					continue
				}
				byName++
				if u.StatusIP != providersim.StickyGatewayAddr || !slices.Contains(st.Errored, u.StatusIP) {
					t.Errorf("%s upstream %s: StatusIP %q, errored %v; want %s", u.Protocol, u.Address, u.StatusIP, st.Errored, providersim.StickyGatewayAddr)
				}
			}
			if byName == 0 {
				t.Error("no upstream dialed at the gateway's name: the test proved nothing")
			}
		})
	}
}

// A failed lookup of a gateway's name keeps the addresses of the last
// good one: the upstreams dialed at the name keep their StatusIP, so an
// errored gateway does not come back into the pool for a round.
func TestSimGatewayLookupFailureKeepsAddresses(t *testing.T) {
	var fail atomic.Bool
	var lookup func(ctx context.Context, host string) ([]string, error)
	p, sim, _ := newPollerForTest(t, pollConfig(func(c *PollConfig) {
		c.Services = []int{102}
		c.LookupHost = func(ctx context.Context, host string) ([]string, error) {
			if fail.Load() {
				return nil, errors.New("lookup " + host + ": server misbehaving")
			}
			return lookup(ctx, host)
		}
	}))
	lookup = sim.LookupHost
	l := providersim.LayoutDefault
	l.PPRHosts, l.StickyPorts = providersim.PPRHostName, providersim.StickyPortOne
	sim.SetLayout(l)
	pollAll(t, p)
	statusIPs := func() (ips []string) {
		st := serviceByID(p.Snapshot(), 102)
		for _, u := range st.Upstreams() {
			if strings.HasPrefix(u.Address, providersim.StickyGateway+":") {
				ips = append(ips, u.StatusIP)
			}
		}
		return ips
	}
	before := statusIPs()
	if len(before) == 0 || slices.Contains(before, "") {
		t.Fatalf("status IPs of the upstreams at the gateway's name: %q; the test proves nothing", before)
	}
	fail.Store(true)
	if err := p.PollOnce(context.Background(), LoopLists); err != nil {
		t.Fatal(err)
	}
	if after := statusIPs(); !slices.Equal(after, before) {
		t.Errorf("after a failed lookup the status IPs are %q, want %q kept", after, before)
	}
	if got := serviceByID(p.Snapshot(), 102).Resolved[providersim.StickyGateway]; !slices.Contains(got, providersim.StickyGatewayAddr) {
		t.Errorf("resolved %v after a failed lookup, want the last good %s", got, providersim.StickyGatewayAddr)
	}
}
