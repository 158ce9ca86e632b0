package providersim

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/proxy"
)

// TestStickyRecordPorts checks what a sticky record says about ports in
// every StickyPorts mode and both shapes.
func TestStickyRecordPorts(t *testing.T) {
	ts := newTestSim(t, Config{})
	ts.SetStickySessions(104, []Session{
		{Server: "gw9.sim.example", Session: "a", Port: 3081, HTTPPort: 3081, SOCKSPort: 2087, ExitIP: "192.0.2.90", TTL: 5},
		{Server: "gw9.sim.example", Session: "b", Port: 3082, HTTPPort: 3082, ExitIP: "192.0.2.91", TTL: 5}, // no SOCKS5 port
	})
	cases := []struct {
		layout Layout
		want   string
	}{
		{Layout{}, `[{"server":"gw9.sim.example","session":"a","port":3081,"ip":"192.0.2.90","ttl":5},{"server":"gw9.sim.example","session":"b","port":3082,"ip":"192.0.2.91","ttl":5}]`},
		{Layout{StickyPorts: StickyPortSplit},
			`[{"server":"gw9.sim.example","session":"a","http_port":3081,"socks_port":2087,"ip":"192.0.2.90","ttl":5},{"server":"gw9.sim.example","session":"b","http_port":3082,"ip":"192.0.2.91","ttl":5}]`},
		{Layout{StickyPorts: StickyPortObject},
			`[{"server":"gw9.sim.example","session":"a","ports":{"http":3081,"socks5":2087},"ip":"192.0.2.90","ttl":5},{"server":"gw9.sim.example","session":"b","ports":{"http":3082},"ip":"192.0.2.91","ttl":5}]`},
		{Layout{StickyPorts: StickyPortNone},
			`[{"server":"gw9.sim.example","session":"a","ip":"192.0.2.90","ttl":5},{"server":"gw9.sim.example","session":"b","ip":"192.0.2.91","ttl":5}]`},
		{Layout{StickyShape: StickyWrapped, StickyPorts: StickyPortSplit},
			`{"sessions":[{"host":"gw9.sim.example","session_id":"a","http_port":"3081","socks_port":"2087","exit_ip":"192.0.2.90","ttl":5},{"host":"gw9.sim.example","session_id":"b","http_port":"3082","exit_ip":"192.0.2.91","ttl":5}]}`},
		{Layout{StickyShape: StickyWrapped, StickyPorts: StickyPortObject},
			`{"sessions":[{"host":"gw9.sim.example","session_id":"a","ports":{"http":"3081","socks5":"2087"},"exit_ip":"192.0.2.90","ttl":5},{"host":"gw9.sim.example","session_id":"b","ports":{"http":"3082"},"exit_ip":"192.0.2.91","ttl":5}]}`},
		{Layout{StickyShape: StickyWrapped, StickyPorts: StickyPortNone},
			`{"sessions":[{"host":"gw9.sim.example","session_id":"a","exit_ip":"192.0.2.90","ttl":5},{"host":"gw9.sim.example","session_id":"b","exit_ip":"192.0.2.91","ttl":5}]}`},
		{Layout{StickyPorts: "bogus"}, // unknown: the default
			`[{"server":"gw9.sim.example","session":"a","port":3081,"ip":"192.0.2.90","ttl":5},{"server":"gw9.sim.example","session":"b","port":3082,"ip":"192.0.2.91","ttl":5}]`},
	}
	for _, c := range cases {
		ts.SetLayout(c.layout)
		ts.do(t, "GET", "/api/sticky/list/104", "").want(t, fmt.Sprintf("%+v", c.layout), 200, c.want)
	}

	// The default world's records name per-protocol ports that are the
	// lists' ports.
	ts.SetLayout(Layout{StickyPorts: StickyPortSplit})
	ts.do(t, "GET", "/api/sticky/list/102", "").want(t, "default world, split", 200,
		`[{"server":"gw1.sim.example","session":"s1","http_port":10001,"socks_port":2087,"ip":"198.51.100.1","ttl":5},{"server":"gw1.sim.example","session":"s2","http_port":10002,"socks_port":2087,"ip":"198.51.100.2","ttl":5}]`)
}

// TestDefaultWorldGateway checks the layout the default world promises:
// lists of IPs apart per protocol, records naming a host that LookupHost
// resolves to the lists' IP, each record's one port in the HTTP list only.
func TestDefaultWorldGateway(t *testing.T) {
	ts := newTestSim(t, Config{})
	addrs, err := ts.LookupHost(context.Background(), StickyGateway)
	if err != nil || !slices.Equal(addrs, []string{StickyGatewayAddr}) {
		t.Fatalf("LookupHost(%s) = %v, %v", StickyGateway, addrs, err)
	}
	entries := func(typ string) []string {
		a := ts.do(t, "GET", "/api/iplist/"+typ+"/txt/102", "")
		var out []string
		for _, l := range strings.Fields(a.body) {
			hp, _, _ := strings.Cut(l, "@")
			out = append(out, hp)
		}
		return out
	}
	httpList, socksList := entries("ppr-http"), entries("ppr-socks")
	for _, s := range ts.Sessions(ServiceRotating) {
		hp := net.JoinHostPort(addrs[0], fmt.Sprint(s.Port))
		if !slices.Contains(httpList, hp) || slices.Contains(socksList, hp) {
			t.Errorf("session %s: port %d should be in ppr-http %v and not in ppr-socks %v", s.Session, s.Port, httpList, socksList)
		}
		if s.HTTPPort != s.Port || s.SOCKSPort == s.HTTPPort || s.SOCKSPort == 0 {
			t.Errorf("session %+v: ports per protocol", s)
		}
	}
	if len(socksList) != 1 || socksList[0] != net.JoinHostPort(StickyGatewayAddr, fmt.Sprint(StickySOCKSPort)) {
		t.Errorf("ppr-socks %v: want the gateway's one SOCKS5 port", socksList)
	}
}

func TestLookupHost(t *testing.T) {
	ts := newTestSim(t, Config{})
	ctx := context.Background()
	for host, want := range map[string][]string{
		"GW1.Sim.Example":  {StickyGatewayAddr},
		"gw1.sim.example.": {StickyGatewayAddr},
		"127.0.3.4":        {"127.0.3.4"},
		"[2001:db8::1]":    {"2001:db8::1"},
	} {
		if got, err := ts.LookupHost(ctx, host); err != nil || !slices.Equal(got, want) {
			t.Errorf("LookupHost(%q) = %v, %v; want %v", host, got, err, want)
		}
	}
	var dnsErr *net.DNSError
	if _, err := ts.LookupHost(ctx, "gw2.sim.example"); !errors.As(err, &dnsErr) || !dnsErr.IsNotFound {
		t.Errorf("unknown name: %v", err)
	}
	ts.SetGateway("GW2.sim.example", "192.0.2.31", "192.0.2.32")
	if got, err := ts.LookupHost(ctx, "gw2.sim.example"); err != nil || !slices.Equal(got, []string{"192.0.2.31", "192.0.2.32"}) {
		t.Errorf("after SetGateway: %v, %v", got, err)
	}
	ts.SetGateway(StickyGateway)
	if _, err := ts.LookupHost(ctx, StickyGateway); !errors.As(err, &dnsErr) || !dnsErr.IsNotFound {
		t.Errorf("removed name: %v", err)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := ts.LookupHost(cancelled, "gw2.sim.example"); err == nil {
		t.Error("LookupHost with a cancelled context succeeded")
	}
}

// TestPPRListsByName checks the other layout: lists that name the gateway
// by host name. Entries on no gateway's address keep their IP, and fpr
// lists are never rewritten.
func TestPPRListsByName(t *testing.T) {
	ts := newTestSim(t, Config{Layout: Layout{PPRHosts: PPRHostName}})
	ts.do(t, "GET", "/api/iplist/ppr-http/txt/102", "").want(t, "ppr-http", 200,
		"gw1.sim.example:10001@u102:pw-102-sim\ngw1.sim.example:10002@u102:pw-102-sim\n")
	ts.do(t, "GET", "/api/iplist/ppr-socks/json/102", "").want(t, "ppr-socks", 200,
		`[{"host":"gw1.sim.example","port":"2087","login":"u102","password":"pw-102-sim"}]`)
	ts.do(t, "GET", "/api/iplist/ppr-socks/txt/104", "").want(t, "other gateway by IP", 200,
		"gw1.sim.example:9000@u104:pw-104-sim\n192.0.2.22:9000@u104:pw-104-sim\n")
	ts.SetEntries(101, "http-ip", []Entry{{Host: StickyGatewayAddr, Port: 8080}})
	ts.do(t, "GET", "/api/iplist/http-ip/txt/101", "").want(t, "fpr list", 200, "192.0.2.21:8080\n")
	// The stored entries are unchanged: the IP layout shows them again.
	ts.SetLayout(Layout{})
	ts.do(t, "GET", "/api/iplist/ppr-socks/txt/102", "").want(t, "by IP again", 200, "192.0.2.21:2087@u102:pw-102-sim\n")
}

func TestLayoutValidateNewFields(t *testing.T) {
	for _, l := range []Layout{{StickyPorts: "both"}, {PPRHosts: "dns"}} {
		if err := (Config{Layout: l}).Validate(); err == nil {
			t.Errorf("%+v: no error", l)
		}
	}
	for _, l := range []Layout{LayoutDefault, {StickyPorts: StickyPortSplit, PPRHosts: PPRHostName}, {StickyPorts: StickyPortObject}, {StickyPorts: StickyPortNone}} {
		if err := (Config{Layout: l}).Validate(); err != nil {
			t.Errorf("%+v: %v", l, err)
		}
	}
}

// sourceEcho is a destination that answers each connection, plain HTTP or
// a tunnelled request alike, with the IP the connection came from.
func sourceEcho(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		io.WriteString(w, host)
	}), ReadHeaderTimeout: 5 * time.Second}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close(); wg.Wait() })
	return ln.Addr().String()
}

func getVia(t *testing.T, tr *http.Transport, target string) (string, http.Header) {
	t.Helper()
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	resp, err := c.Get(target)
	if err != nil {
		t.Fatalf("GET %s: %v", target, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET %s: %d %q %v", target, resp.StatusCode, b, err)
	}
	return string(b), resp.Header
}

// TestGatewayPair starts a gateway on its own loopback IP: HTTP and SOCKS5
// on ports of their own, both relaying from the gateway's IP, each refusing
// the other protocol.
func TestGatewayPair(t *testing.T) {
	dest := sourceEcho(t)
	g, err := StartGateway("127.0.3.7", "gw-test", "u", "p")
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if g.HTTP.Host() != "127.0.3.7" || g.SOCKS.Host() != "127.0.3.7" || g.HTTP.Addr() == g.SOCKS.Addr() {
		t.Fatalf("gateway on %s and %s", g.HTTP.Addr(), g.SOCKS.Addr())
	}
	if g.Name() != "gw-test" || g.HTTP.Name != "gw-test" || g.SOCKS.Name != "gw-test" || g.Host() != "127.0.3.7" {
		t.Fatalf("names %q %q %q, host %s", g.Name(), g.HTTP.Name, g.SOCKS.Name, g.Host())
	}
	s := g.Session("s1", "198.51.100.9", 5)
	he, se := g.HTTP.Entry("", ""), g.SOCKS.Entry("", "")
	if s.Server != "127.0.3.7" || s.Port != he.Port || s.HTTPPort != he.Port || s.SOCKSPort != se.Port || s.ExitIP != "198.51.100.9" || s.TTL != 5 {
		t.Fatalf("session %+v for %s and %s", s, g.HTTP.Addr(), g.SOCKS.Addr())
	}
	if e := g.HTTP.Entry("u", "p"); e.Host != "127.0.3.7" || e.Login != "u" || e.Password != "p" {
		t.Fatalf("entry %+v", e)
	}

	target := "http://" + dest + "/"
	httpProxy := &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: g.HTTP.Addr(), User: url.UserPassword("u", "p")})}
	if src, h := getVia(t, httpProxy, target); src != "127.0.3.7" || h.Get("X-Sim-Upstream") != "gw-test" {
		t.Errorf("plain request via HTTP: destination saw %s, upstream header %q", src, h.Get("X-Sim-Upstream"))
	}
	// CONNECT: the transport tunnels an https:// URL; here a raw CONNECT
	// then a request through the tunnel.
	if src := connectGet(t, g.HTTP.Addr(), dest, "u", "p"); src != "127.0.3.7" {
		t.Errorf("CONNECT via HTTP: destination saw %s", src)
	}
	d, err := proxy.SOCKS5("tcp", g.SOCKS.Addr(), &proxy.Auth{User: "u", Password: "p"}, proxy.Direct)
	if err != nil {
		t.Fatal(err)
	}
	if src, _ := getVia(t, &http.Transport{Dial: d.Dial}, target); src != "127.0.3.7" {
		t.Errorf("via SOCKS5: destination saw %s", src)
	}
	if n := g.ProtocolErrors(); n != 0 {
		t.Fatalf("%d protocol errors after the right protocols", n)
	}
	if n := g.Accepted(); n != 3 {
		t.Errorf("accepted %d connections, want 3", n)
	}

	// The wrong protocol on each port: counted, closed unanswered.
	sd, _ := proxy.SOCKS5("tcp", g.HTTP.Addr(), &proxy.Auth{User: "u", Password: "p"}, proxy.Direct)
	if _, err := sd.Dial("tcp", dest); err == nil {
		t.Error("SOCKS5 to the HTTP port succeeded")
	}
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: g.SOCKS.Addr()})}}
	if resp, err := hc.Get(target); err == nil {
		resp.Body.Close()
		t.Error("HTTP to the SOCKS5 port got an answer")
	}
	waitUntil(t, "both protocol errors counted", func() bool {
		return g.HTTP.ProtocolErrors() == 1 && g.SOCKS.ProtocolErrors() == 1
	})
	if n := g.ProtocolErrors(); n != 2 {
		t.Errorf("gateway protocol errors %d, want 2", n)
	}

	g.Down()
	if _, err := net.DialTimeout("tcp", g.SOCKS.Addr(), time.Second); err == nil {
		t.Error("SOCKS5 port open while the gateway is down")
	}
	if err := g.Up(); err != nil {
		t.Fatal(err)
	}
	if src, _ := getVia(t, &http.Transport{Dial: d.Dial}, target); src != "127.0.3.7" {
		t.Errorf("via SOCKS5 after Up: destination saw %s", src)
	}
}

// connectGet tunnels one plain request to dest through an HTTP proxy's
// CONNECT and returns the body.
func connectGet(t *testing.T, proxyAddr, dest, user, pass string) string {
	t.Helper()
	c, err := net.DialTimeout("tcp", proxyAddr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	req := &http.Request{Method: http.MethodConnect, URL: &url.URL{Opaque: dest}, Host: dest, Header: http.Header{}}
	req.SetBasicAuth(user, pass)
	req.Header.Set("Proxy-Authorization", req.Header.Get("Authorization"))
	req.Header.Del("Authorization")
	if err := req.Write(c); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, req)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("CONNECT: %v %v", resp, err)
	}
	fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", dest)
	resp, err = http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// TestProxyProtocolErrors: every kind of proxy against every opening.
func TestProxyProtocolErrors(t *testing.T) {
	cases := []struct {
		protocol string
		opening  []byte
		errors   int64
	}{
		{"http", []byte{5, 1, 0}, 1},        // SOCKS5 greeting
		{"http", []byte{4, 1, 0, 80}, 1},    // SOCKS4
		{"http", []byte("\x16\x03\x01"), 1}, // TLS
		{"http", []byte("GET / HTTP/1.1\r\n"), 0},
		{"socks5", []byte("GET / HTTP/1.1\r\n"), 1},
		{"socks5", []byte("CONNECT a:1 HTTP/1.1\r\n"), 1},
		{"socks5", []byte{4, 1, 0, 80}, 1},
		{"socks5", []byte{5, 1, 0}, 0},
		{"any", []byte{5, 1, 0}, 0},
		{"any", []byte("GET / HTTP/1.1\r\n"), 0},
		{"http", nil, 0}, // connected and closed: a dial probe
		{"socks5", nil, 0},
	}
	for _, c := range cases {
		p, err := StartProxy(c.protocol, "127.0.0.1:0", "p", "", "")
		if err != nil {
			t.Fatal(err)
		}
		conn, err := net.Dial("tcp", p.Addr())
		if err != nil {
			t.Fatal(err)
		}
		conn.Write(c.opening)
		if c.opening == nil {
			conn.Close()
		} else if c.errors > 0 {
			// A protocol error closes the connection unanswered.
			_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
			if n, err := conn.Read(make([]byte, 1)); n != 0 || err != io.EOF {
				t.Errorf("%s %q: read %d %v, want the proxy to close", c.protocol, c.opening, n, err)
			}
			conn.Close()
		} else {
			conn.Close()
		}
		waitUntil(t, "the connection handled", func() bool { return p.Accepted() == 1 })
		p.Close() // waits for the connection's goroutine
		if got := p.ProtocolErrors(); got != c.errors {
			t.Errorf("%s %q: %d protocol errors, want %d", c.protocol, c.opening, got, c.errors)
		}
	}
}

// waitUntil polls cond for up to five seconds.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
