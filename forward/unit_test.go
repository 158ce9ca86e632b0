package forward

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/net/proxy"

	"github.com/proxyd/proxyd/pool"
)

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		cfg  Config
		want string // substring of the error; "" for valid
	}{
		{testConfig(nil), ""},
		{testConfig(func(c *Config) { c.Protocol = "socks5"; c.Address = "[::1]:1080" }), ""},
		{testConfig(func(c *Config) { c.Address = "localhost:8080" }), ""},
		{testConfig(func(c *Config) { c.Protocol = "socks4" }), `protocol: must be http or socks5, got "socks4"`},
		{testConfig(func(c *Config) { c.Address = "nonsense" }), "address:"},
		{testConfig(func(c *Config) { c.Address = "0.0.0.0:8080" }), "address: 0.0.0.0:8080 is not a loopback address: configure [[listener.user]] or allow"},
		{testConfig(func(c *Config) { c.Address = ":8080" }), "is not a loopback address"},
		{testConfig(func(c *Config) { c.Address = "192.0.2.1:8080"; c.Users = []User{{Name: "a", Password: "b"}} }), ""},
		{testConfig(func(c *Config) { c.Address = "0.0.0.0:8080"; c.Allow = []Network{MustParseNetwork("10.0.0.0/8")} }), ""},
		{testConfig(func(c *Config) { c.Users = []User{{Name: "", Password: "b"}} }), "user[0].name: required"},
		{testConfig(func(c *Config) { c.Users = []User{{Name: "a", Password: ""}} }), "user[0].password: required"},
		{testConfig(func(c *Config) { c.Users = []User{{Name: "a-session-b", Password: "p"}} }), `user[0].name: must not contain "-session-"`},
		{testConfig(func(c *Config) { c.Users = []User{{Name: "session-b", Password: "p"}} }), `nor start with "session-"`},
		{testConfig(func(c *Config) { c.Users = []User{{Name: "a:b", Password: "b"}} }), "user[0].name: must not contain"},
		{testConfig(func(c *Config) { c.Users = []User{{Name: "a", Password: "b"}, {Name: "a", Password: "c"}} }), `user[1].name: "a" listed twice`},
		{testConfig(func(c *Config) { c.Users = []User{{Name: "a", Password: strings.Repeat("x", 256)}} }), "at most 255 bytes"},
		{testConfig(func(c *Config) { c.Users = []User{{Name: "a", PasswordFile: "/etc/proxyd/a"}} }), ""},
		{testConfig(func(c *Config) { c.Users = []User{{Name: "a", Password: "b", PasswordFile: "/etc/proxyd/a"}} }), "user[0]: password and password_file are both set"},
		{testConfig(func(c *Config) { c.DialTimeout = -time.Second }), "dial_timeout: must be positive, got -1s"},
		{testConfig(func(c *Config) { c.MaxConnections = -1 }), "max_connections: must be positive, got -1"},
		// Zero is a value: where it has no meaning it is refused, naming the key.
		{testConfig(func(c *Config) { c.HeaderTimeout = 0 }), "header_timeout: must be positive, got 0s"},
		{testConfig(func(c *Config) { c.DialTimeout = 0 }), "dial_timeout: must be positive, got 0s"},
		{testConfig(func(c *Config) { c.HandshakeTimeout = 0 }), "handshake_timeout: must be positive, got 0s"},
		{testConfig(func(c *Config) { c.IdleTimeout = 0 }), "idle_timeout: must be positive, got 0s"},
		{testConfig(func(c *Config) { c.RetryTimeout = 0 }), "retry_timeout: must be positive, got 0s"},
		{testConfig(func(c *Config) { c.ResponseTimeout = 0 }), "response_timeout: must be positive, got 0s"},
		{testConfig(func(c *Config) { c.MaxConnections = 0 }), "max_connections: must be positive, got 0"},
		{testConfig(func(c *Config) { c.Retries = -1 }), "retries: must not be negative"},
		{testConfig(func(c *Config) { c.HedgeDelay = -time.Second }), "hedge_delay: must not be negative"},
		{func() Config { c := testConfig(nil); c.Name = ""; return c }(), "name: required"},
		{testConfig(func(c *Config) { c.Protocol = "" }), "protocol: required"},
		{testConfig(func(c *Config) { c.Address = "" }), "address: required"},
		{testConfig(func(c *Config) { c.AllowDestinations = []Network{{}} }), "allow_destinations[0]: not a network"},
		// Where zero has a meaning it is kept: no retries, no hedging.
		{testConfig(func(c *Config) { c.Retries = 0; c.HedgeDelay = 0 }), ""},
	} {
		err := tc.cfg.Validate()
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%+v: got %v, want %q", tc.cfg, err, tc.want)
		}
	}
	if _, err := NewListener(testConfig(func(c *Config) { c.Address = "0.0.0.0:1" }), newFakePool(), nil, nil); err == nil {
		t.Error("NewListener accepted an open non-loopback listener")
	}
	// A user whose password is only a file's name would let an empty
	// password in: the file is its reader's (the daemon's) to read first.
	if _, err := NewListener(testConfig(func(c *Config) { c.Users = []User{{Name: "a", PasswordFile: "/etc/proxyd/a"}} }), newFakePool(), nil, nil); err == nil ||
		!strings.Contains(err.Error(), "user[0].password_file: not read") {
		t.Errorf("NewListener with an unread password_file: %v", err)
	}
	d := DefaultConfig()
	if d.HeaderTimeout != 10*time.Second || d.DialTimeout != 5*time.Second || d.HandshakeTimeout != 10*time.Second ||
		d.IdleTimeout != 5*time.Minute || d.Retries != 2 || d.MaxConnections != 4096 || d.RetryTimeout != 15*time.Second ||
		d.HedgeDelay != 2*time.Second || d.ResponseTimeout != 5*time.Minute {
		t.Errorf("defaults %+v", d)
	}
}

// TestConfigValidateAll: every problem is reported, each as its own error
// that starts with the key as the file writes it.
func TestConfigValidateAll(t *testing.T) {
	c := DefaultConfig()
	c.Name, c.Protocol, c.Address = "web", "socks4", "127.0.0.1:1"
	c.RetryTimeout, c.MaxConnections = 0, 0
	err := c.Validate()
	j, ok := err.(interface{ Unwrap() []error })
	if !ok {
		t.Fatalf("Validate: %v is not a joined error", err)
	}
	var got []string
	for _, e := range j.Unwrap() {
		got = append(got, e.Error())
	}
	want := []string{`protocol: must be http or socks5, got "socks4"`, "retry_timeout: must be positive, got 0s", "max_connections: must be positive, got 0"}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("problems %q, want %q", got, want)
	}
}

// TestNetworkText: allow-list entries are read as a network or a bare
// address, and written back in prefix form.
func TestNetworkText(t *testing.T) {
	for _, tc := range []struct{ in, want, err string }{
		{"10.0.0.0/8", "10.0.0.0/8", ""},
		{"10.1.2.3/8", "10.0.0.0/8", ""},
		{"192.0.2.7", "192.0.2.7/32", ""},
		{"2001:db8::1", "2001:db8::1/128", ""},
		{"2001:db8::/32", "2001:db8::/32", ""},
		{"nonsense", "", `must be a network such as "10.0.0.0/8" or an IP address, got "nonsense"`},
		{"10.0.0.0/33", "", "must be a network"},
		{"fe80::1%eth0", "", "must be a network"},
	} {
		var n Network
		err := n.UnmarshalText([]byte(tc.in))
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: got %v, want error %q", tc.in, err, tc.err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%q: %v", tc.in, err)
			continue
		}
		b, _ := n.MarshalText()
		if string(b) != tc.want {
			t.Errorf("%q: got %q, want %q", tc.in, b, tc.want)
		}
	}
}

func TestParseUsername(t *testing.T) {
	for _, tc := range []struct {
		in, user, key string
		ok            bool
	}{
		{"", "", "", true},
		{"alice", "alice", "", true},
		{"session-abc", "", "abc", true},
		{"alice-session-abc", "alice", "abc", true},
		{"alice-session-a-session-b", "", "", false}, // key after the first -session- has '-'
		{"a-b-session-K_9.x", "a-b", "K_9.x", true},
		{"session-", "", "", false},
		{"alice-session-", "", "", false},
		{"session-" + strings.Repeat("k", 64), "", strings.Repeat("k", 64), true},
		{"session-" + strings.Repeat("k", 65), "", "", false},
		{"session-a b", "", "", false},
		{"session-é", "", "", false},
	} {
		user, key, ok := parseUsername(tc.in)
		if user != tc.user || key != tc.key || ok != tc.ok {
			t.Errorf("%q: (%q, %q, %v), want (%q, %q, %v)", tc.in, user, key, ok, tc.user, tc.key, tc.ok)
		}
	}
}

func FuzzParseUsername(f *testing.F) {
	for _, s := range []string{"", "alice", "session-abc", "a-session-b", "session-", "x-session-\x00"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		user, key, ok := parseUsername(s)
		if !ok {
			return
		}
		if key != "" && !validKey(key) {
			t.Fatalf("%q: invalid key %q accepted", s, key)
		}
		if key == "" && user != s {
			t.Fatalf("%q: no key but user %q", s, user)
		}
		if key != "" && user != "" && user+"-session-"+key != s {
			t.Fatalf("%q: user %q key %q do not make it up", s, user, key)
		}
	})
}

func FuzzDestCheck(f *testing.F) {
	for _, s := range []string{"127.0.0.1", "::1", "example.com", "0x7f.1", "::ffff:10.0.0.1", "fe80::1%eth0", "a.localhost"} {
		f.Add(s)
	}
	p := &destPolicy{}
	f.Fuzz(func(t *testing.T, host string) {
		err := p.check(host, 80)
		if err != nil {
			return
		}
		// Anything allowed is a public IP literal or a plain DNS name.
		if a, perr := netip.ParseAddr(host); perr == nil {
			a = a.Unmap()
			if a.IsLoopback() || a.IsPrivate() || a.IsLinkLocalUnicast() || a.IsUnspecified() {
				t.Fatalf("%q allowed", host)
			}
		}
	})
}

// TestShutdown: Shutdown stops accepting at once, lets an open tunnel run
// until ctx ends, then closes both of its ends; Serve returns nil.
func TestShutdown(t *testing.T) {
	checkLeaks(t)
	echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
	up := newHTTPUpstream(t, "", "", nil)
	p := newFakePool(up.upstream(1))
	l, err := NewListener(testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- l.Serve(ln) }()
	addr := ln.Addr().String()
	c, br, resp := rawConnect(t, addr, echo, "")
	if resp.StatusCode != 200 {
		t.Fatalf("CONNECT: %d", resp.StatusCode)
	}
	// An idle keep-alive client is closed at once by Shutdown.
	hc, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer hc.Close()
	waitFor(t, 5*time.Second, func() bool { return l.ActiveConns() == 2 }, "two clients")

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	shut := make(chan error, 1)
	start := time.Now()
	go func() { shut <- l.Shutdown(ctx) }()
	// Not accepting any more.
	waitFor(t, 5*time.Second, func() bool {
		nc, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			_ = nc.Close()
		}
		return err != nil
	}, "listener closed")
	// The tunnel still works while draining.
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(br, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("tunnel during drain: %q %v", buf, err)
	}
	if err := <-shut; !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Shutdown: %v, want deadline exceeded", err)
	}
	if d := time.Since(start); d < 250*time.Millisecond || d > 3*time.Second {
		t.Errorf("Shutdown took %s", d)
	}
	// Both ends were closed.
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := br.ReadByte(); err == nil {
		t.Error("tunnel still open after Shutdown")
	}
	if err := <-served; err != nil {
		t.Errorf("Serve: %v", err)
	}
	if n := l.ActiveConns(); n != 0 {
		t.Errorf("active %d", n)
	}
	p.waitBalanced(t)
}

// TestIdleTunnel: a tunnel idle both ways is closed after IdleTimeout; one
// where only one direction moves stays open.
func TestIdleTunnel(t *testing.T) {
	checkLeaks(t)
	// The origin sends a byte every 100ms and never reads.
	ticker := startTCP(t, "tcp", "127.0.0.1:0", func(c net.Conn) {
		for range 8 {
			if _, err := c.Write([]byte{'t'}); err != nil {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	})
	echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
	up := newSOCKSUpstream(t, "", "", nil)
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed; c.IdleTimeout = 300 * time.Millisecond }), newFakePool(up.upstream(1)))

	c, br, _ := rawConnect(t, tl.addr, ticker, "")
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	got := 0
	for {
		if _, err := br.ReadByte(); err != nil {
			break
		}
		got++
	}
	if got != 8 {
		t.Errorf("one-way tunnel got %d ticks, want 8 (closed while active?)", got)
	}

	c2, br2, _ := rawConnect(t, tl.addr, echo, "")
	start := time.Now()
	_ = c2.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := br2.ReadByte(); err == nil || time.Since(start) > 2*time.Second || time.Since(start) < 250*time.Millisecond {
		t.Errorf("idle tunnel: %v after %s", err, time.Since(start))
	}
}

// TestUpstreamDialReported: Observer.Dialed is told about every dial, and the
// client's retries and bytes are counted.
func TestObserverCounts(t *testing.T) {
	checkLeaks(t)
	origin, _ := startOrigin(t, http.HandlerFunc(echoHandler))
	up := newHTTPUpstream(t, "", "", nil)
	dead := &pool.Upstream{Service: 7, Protocol: pool.HTTP, Address: deadAddr(t)}
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), newFakePool(dead, up.upstream(1)))
	hc := tl.httpClient(t, "", "")
	req, _ := http.NewRequest("GET", "http://"+origin+"/", nil)
	getEcho(t, hc, req)
	hc.Transport.(*http.Transport).CloseIdleConnections()
	waitFor(t, 5*time.Second, func() bool { return len(tl.obs.Closeds()) == 1 }, "closed")
	cl := tl.obs.Closeds()[0]
	if cl.o != OutcomeOK || cl.retries != 1 || cl.up < 30 || cl.down < 100 {
		t.Errorf("closed %+v", cl)
	}
	tl.obs.mu.Lock()
	defer tl.obs.mu.Unlock()
	if tl.obs.dialed != 1 || tl.obs.opened != 1 {
		t.Errorf("dialed %d opened %d", tl.obs.dialed, tl.obs.opened)
	}
}

// TestSourceAddr: outbound connections leave from the configured address.
func TestSourceAddr(t *testing.T) {
	checkLeaks(t)
	echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
	origin, _ := startOrigin(t, http.HandlerFunc(echoHandler))
	up := newHTTPUpstream(t, "", "", nil)
	src := netip.MustParseAddr("127.0.0.2")
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed; c.SourceAddress = src }), newFakePool(up.upstream(1)))
	c, br, resp := rawConnect(t, tl.addr, echo, "")
	if resp.StatusCode != 200 {
		t.Fatalf("CONNECT: %d", resp.StatusCode)
	}
	bigTransfer(t, c, br, 10)
	req, _ := http.NewRequest("GET", "http://"+origin+"/", nil)
	getEcho(t, tl.httpClient(t, "", ""), req)
	up.mu.Lock()
	defer up.mu.Unlock()
	if len(up.peers) != 2 {
		t.Fatalf("upstream connections %q", up.peers)
	}
	for _, p := range up.peers {
		if ap := netip.MustParseAddrPort(p); ap.Addr() != src {
			t.Errorf("upstream saw a connection from %s, want %s", p, src)
		}
	}
}

// TestCloseUnderLoad: Close while tunnels, plain requests and handshakes are
// in flight ends everything, with no goroutine or fd left.
func TestCloseUnderLoad(t *testing.T) {
	checkLeaks(t)
	echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
	origin, _ := startOrigin(t, http.HandlerFunc(echoHandler))
	up := newHTTPUpstream(t, "", "", nil)
	sup := newSOCKSUpstream(t, "", "", nil)
	for _, proto := range []string{"http", "socks5"} {
		p := newFakePool(up.upstream(1), sup.upstream(2))
		l, err := NewListener(testConfig(func(c *Config) { c.Protocol = proto; c.AllowDestinations = loopbackAllowed }), p, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		served := make(chan error, 1)
		go func() { served <- l.Serve(ln) }()
		addr := ln.Addr().String()
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for i := range 24 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					select {
					case <-stop:
						return
					default:
					}
					var c net.Conn
					var err error
					switch {
					case proto == "socks5":
						d, _ := proxy.SOCKS5("tcp", addr, nil, proxy.Direct)
						c, err = d.Dial("tcp", echo)
					case i%2 == 0:
						c, _, err = tunnelVia(pool.HTTP, addr, echo)
					default:
						tr := &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: addr})}
						resp, gerr := (&http.Client{Transport: tr, Timeout: 5 * time.Second}).Get("http://" + origin + "/")
						if gerr == nil {
							_, _ = io.Copy(io.Discard, resp.Body)
							_ = resp.Body.Close()
						}
						tr.CloseIdleConnections()
						continue
					}
					if err != nil {
						continue
					}
					_ = c.SetDeadline(time.Now().Add(5 * time.Second))
					_, _ = c.Write([]byte("x"))
					_, _ = io.Copy(io.Discard, c) // until proxyd closes it
					_ = c.Close()
				}
			}()
		}
		waitFor(t, 5*time.Second, func() bool { return l.ActiveConns() >= 12 }, "load running")
		if err := l.Close(); err != nil {
			t.Fatal(err)
		}
		close(stop)
		wg.Wait()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
		if n := l.ActiveConns(); n != 0 {
			t.Errorf("%s: %d connections after Close", proto, n)
		}
		p.waitBalanced(t)
	}
}

// TestBeginAfterTheEnd: an attempt begun once the job is over (a winner
// answered, or response_timeout ran out, between the hedge timer's check
// and its begin) is born cancelled and reported not live, so the hedge it
// would have been is not counted as sent.
func TestBeginAfterTheEnd(t *testing.T) {
	up := &pool.Upstream{}
	for _, tc := range []struct {
		name  string
		set   func(*loop)
		live  bool
		cause error
	}{
		{"open", func(*loop) {}, true, nil},
		{"won", func(lp *loop) { lp.winner = &try{} }, false, errCalledOff},
		{"expired", func(lp *loop) { lp.expired = true }, false, errResponseTimeout},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lp := &loop{base: context.Background()}
			tc.set(lp)
			tr, live := lp.begin(up, true)
			defer tr.cancel(nil)
			if live != tc.live || context.Cause(tr.ctx) != tc.cause {
				t.Errorf("begin: live %v, cause %v; want %v, %v", live, context.Cause(tr.ctx), tc.live, tc.cause)
			}
			if len(lp.inflight) != 1 || lp.inflight[0] != tr {
				t.Errorf("inflight %v, want the attempt (settle releases it)", lp.inflight)
			}
		})
	}
}

// TestOwnAddrs: a listener on one address owns that address; one on the
// unspecified address owns every interface address; when the interfaces
// cannot be listed (a netlink socket forbidden), the error says so instead
// of an empty list passing for "nothing of ours".
func TestOwnAddrs(t *testing.T) {
	one, err := ownAddrs(&net.TCPAddr{IP: net.IPv4(192, 0, 2, 7), Port: 8080})
	if err != nil || len(one) != 1 || one[0] != netip.MustParseAddrPort("192.0.2.7:8080") {
		t.Errorf("ownAddrs(192.0.2.7:8080) = %v, %v", one, err)
	}
	all, err := ownAddrs(&net.TCPAddr{IP: net.IPv4zero, Port: 8080})
	if err != nil || !slices.Contains(all, netip.MustParseAddrPort("127.0.0.1:8080")) {
		t.Errorf("ownAddrs(0.0.0.0:8080) = %v, %v; want the interfaces' addresses", all, err)
	}
	defer func(f func() ([]net.Addr, error)) { interfaceAddrs = f }(interfaceAddrs)
	interfaceAddrs = func() ([]net.Addr, error) { return nil, syscall.EAFNOSUPPORT }
	if got, err := ownAddrs(&net.TCPAddr{IP: net.IPv4zero, Port: 8080}); !errors.Is(err, syscall.EAFNOSUPPORT) {
		t.Errorf("ownAddrs without netlink = %v, %v; want the error", got, err)
	}
}

// TestClosedReportedWhileActive: a connection's outcome reaches the
// observer before it stops counting as active, so once Shutdown finds no
// connection active, the observer has every outcome (the daemon then drops
// a retired listener's series without losing a count).
func TestClosedReportedWhileActive(t *testing.T) {
	checkLeaks(t)
	tl := startListener(t, testConfig(nil), newFakePool())
	var activeAtClose atomic.Int64
	activeAtClose.Store(-1)
	tl.obs.mu.Lock()
	tl.obs.onClosed = func() { activeAtClose.Store(int64(tl.ActiveConns())) }
	tl.obs.mu.Unlock()
	c, err := net.Dial("tcp", tl.addr)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, func() bool { return tl.ActiveConns() == 1 }, "the connection counted")
	c.Close()
	waitFor(t, 5*time.Second, func() bool { return len(tl.obs.Closeds()) == 1 }, "closed")
	if got := activeAtClose.Load(); got != 1 {
		t.Errorf("active connections when the close was reported: %d, want 1 (still counted)", got)
	}
}
