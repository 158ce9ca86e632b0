package forward

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/proxy"
	"golang.org/x/net/websocket"

	"github.com/proxyd/proxyd/pool"
)

// echoHeaders answers with the request's method, URI, headers and a digest
// of its body as JSON.
type echoed struct {
	Method           string
	URI              string
	Host             string
	Header           http.Header
	BodyLen          int64
	BodySHA          string
	TransferEncoding []string
}

func echoHandler(w http.ResponseWriter, r *http.Request) {
	h := sha256.New()
	n, _ := io.Copy(h, r.Body)
	e := echoed{Method: r.Method, URI: r.RequestURI, Host: r.Host, Header: r.Header, BodyLen: n,
		BodySHA: hex.EncodeToString(h.Sum(nil)), TransferEncoding: r.TransferEncoding}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(e)
}

func getEcho(t *testing.T, c *http.Client, req *http.Request) echoed {
	t.Helper()
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", req.Method, req.URL, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("%s %s: status %d %q", req.Method, req.URL, resp.StatusCode, b)
	}
	var e echoed
	if err := json.NewDecoder(resp.Body).Decode(&e); err != nil {
		t.Fatal(err)
	}
	return e
}

// upstreamKinds runs f against an HTTP and a SOCKS5 upstream.
func upstreamKinds(t *testing.T, n names, f func(t *testing.T, up *pool.Upstream, targets func() []string)) {
	t.Run("http-upstream", func(t *testing.T) {
		checkLeaks(t)
		u := newHTTPUpstream(t, "upuser", "up:pass", n)
		f(t, u.upstream(1), u.Targets)
	})
	t.Run("socks5-upstream", func(t *testing.T) {
		checkLeaks(t)
		u := newSOCKSUpstream(t, "upuser", "up:pass", n)
		f(t, u.upstream(2), u.Targets)
	})
}

func TestHTTPPlainRequests(t *testing.T) {
	upstreamKinds(t, nil, func(t *testing.T, up *pool.Upstream, targets func() []string) {
		origin, originConns := startOrigin(t, http.HandlerFunc(echoHandler))
		p := newFakePool(up)
		tl := startListener(t, testConfig(func(c *Config) { c.Name = "web"; c.Protocol = "http"; c.AllowDestinations = loopbackAllowed }), p)
		c := tl.httpClient(t, "session-abc", "x")

		for _, m := range []string{"GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"} {
			var body io.Reader
			if m == "POST" || m == "PUT" {
				body = strings.NewReader("payload-" + m)
			}
			req, _ := http.NewRequest(m, "http://"+origin+"/path?q="+m, body)
			e := getEcho(t, c, req)
			if e.Method != m || e.URI != "/path?q="+m {
				t.Errorf("%s: origin saw %s %s", m, e.Method, e.URI)
			}
			if body != nil && e.BodyLen != int64(len("payload-"+m)) {
				t.Errorf("%s: body length %d", m, e.BodyLen)
			}
		}
		// keep-alive on both hops: one client connection, one origin connection.
		tl.obs.mu.Lock()
		opened, dialed := tl.obs.opened, tl.obs.dialed
		tl.obs.mu.Unlock()
		if opened != 1 {
			t.Errorf("client connections to proxyd: %d, want 1", opened)
		}
		if dialed != 1 {
			t.Errorf("upstream dials: %d, want 1 (upstream connection reused)", dialed)
		}
		if n := originConns.Load(); n != 1 {
			t.Errorf("origin connections: %d, want 1 (upstream connection reused)", n)
		}
		if up.Protocol == pool.HTTP {
			for _, tg := range targets() {
				if !strings.HasPrefix(tg, "http://"+origin+"/") {
					t.Errorf("upstream got %q, want absolute URI", tg)
				}
			}
		}
		for _, r := range p.Picks() {
			if r.Listener != "web" || r.Key != "session-abc\x00abc" && r.Key != "\x00abc" {
				t.Errorf("pick request %+v", r)
			}
		}
		c.Transport.(*http.Transport).CloseIdleConnections()
		waitFor(t, 5*time.Second, func() bool { return tl.ActiveConns() == 0 }, "client connection closed")
		p.waitBalanced(t)
	})
}

// TestUpstreamConnReusedAcrossClientConns: a client that closes its
// connection after each request (Connection: close, or HTTP/1.0) does not
// make proxyd close the upstream connection: its Connection header is about
// its own hop.
func TestUpstreamConnReusedAcrossClientConns(t *testing.T) {
	upstreamKinds(t, nil, func(t *testing.T, up *pool.Upstream, _ func() []string) {
		origin, originConns := startOrigin(t, http.HandlerFunc(echoHandler))
		tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "http"; c.AllowDestinations = loopbackAllowed }), newFakePool(up))
		c := tl.httpClient(t, "", "")
		c.Transport.(*http.Transport).DisableKeepAlives = true
		const n = 5
		for range n {
			req, _ := http.NewRequest("GET", "http://"+origin+"/", nil)
			if e := getEcho(t, c, req); e.Method != "GET" {
				t.Fatalf("origin saw %+v", e)
			}
		}
		// HTTP/1.0 without keep-alive, by hand.
		conn, err := net.Dial("tcp", tl.addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
		fmt.Fprintf(conn, "GET http://%s/old HTTP/1.0\r\n\r\n", origin)
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("HTTP/1.0 request: %v %v", resp, err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)

		tl.obs.mu.Lock()
		opened, dialed := tl.obs.opened, tl.obs.dialed
		tl.obs.mu.Unlock()
		if opened != n+1 {
			t.Errorf("client connections to proxyd: %d, want %d", opened, n+1)
		}
		if dialed != 1 {
			t.Errorf("upstream dials: %d, want 1 (one upstream connection for every client connection)", dialed)
		}
		if got := originConns.Load(); got != 1 {
			t.Errorf("origin connections: %d, want 1", got)
		}
	})
}

func TestHTTPChunkedUpload(t *testing.T) {
	upstreamKinds(t, nil, func(t *testing.T, up *pool.Upstream, _ func() []string) {
		origin, _ := startOrigin(t, http.HandlerFunc(echoHandler))
		p := newFakePool(up)
		tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
		c := tl.httpClient(t, "", "")
		data := make([]byte, 3<<20+17)
		_, _ = rand.Read(data)
		pr, pw := io.Pipe()
		go func() {
			for b := data; len(b) > 0; {
				n := min(len(b), 100_000)
				_, _ = pw.Write(b[:n])
				b = b[n:]
			}
			_ = pw.Close()
		}()
		req, _ := http.NewRequest("POST", "http://"+origin+"/upload", pr)
		e := getEcho(t, c, req)
		sum := sha256.Sum256(data)
		if e.BodyLen != int64(len(data)) || e.BodySHA != hex.EncodeToString(sum[:]) {
			t.Errorf("origin got %d bytes sha %s", e.BodyLen, e.BodySHA)
		}
		if len(e.TransferEncoding) != 1 || e.TransferEncoding[0] != "chunked" {
			t.Errorf("origin saw transfer encoding %v", e.TransferEncoding)
		}
		p.waitBalanced(t)
	})
}

// bigTransfer sends n random bytes through c to an echo server and checks
// that the same bytes come back, both directions at once.
func bigTransfer(t *testing.T, c net.Conn, r io.Reader, n int) {
	t.Helper()
	transfer(t, c, r, n, true)
}

// transfer is bigTransfer, optionally without the half-close (Squid ends a
// whole tunnel on a half-close) and then reading exactly n bytes.
func transfer(t *testing.T, c net.Conn, r io.Reader, n int, halfClose bool) {
	t.Helper()
	data := make([]byte, n)
	_, _ = rand.Read(data)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_, _ = c.Write(data)
		if cw, ok := c.(closeWriter); ok && halfClose {
			_ = cw.CloseWrite()
		}
	}()
	var got []byte
	var err error
	if halfClose {
		got, err = io.ReadAll(r)
	} else {
		got = make([]byte, n)
		_, err = io.ReadFull(r, got)
	}
	wg.Wait()
	if err != nil {
		t.Fatalf("reading echo: %v (after %d bytes)", err, len(got))
	}
	if !bytes.Equal(got, data) {
		t.Fatalf("echo differs: got %d bytes, want %d", len(got), len(data))
	}
}

func TestConnect16MiB(t *testing.T) {
	upstreamKinds(t, nil, func(t *testing.T, up *pool.Upstream, _ func() []string) {
		echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
		p := newFakePool(up)
		tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
		// A sticky key, so that the tunnel's release is checked against
		// its pick's key (waitBalanced).
		c, br, resp := rawConnect(t, tl.addr, echo, "Proxy-Authorization: "+basicHeader("session-big", "x")+"\r\n")
		if resp.StatusCode != 200 {
			t.Fatalf("CONNECT: %d", resp.StatusCode)
		}
		if picks := p.Picks(); len(picks) == 0 || picks[0].Key == "" {
			t.Fatalf("the tunnel's pick had no key: %+v", picks)
		}
		bigTransfer(t, c, br, 16<<20)
		_ = c.Close()
		waitFor(t, 5*time.Second, func() bool { return tl.ActiveConns() == 0 }, "tunnel closed")
		p.waitBalanced(t)
		cl := tl.obs.Closeds()
		if len(cl) != 1 || cl[0].o != OutcomeOK || cl[0].up < 16<<20 || cl[0].down < 16<<20 {
			t.Errorf("observer: %+v", cl)
		}
	})
}

// TestConnectEarlyBytes shows why the CONNECT relay keeps the bytes the
// server's buffered reader already holds: a client that sends its first
// bytes in the same write as the CONNECT request (TLS false start, or any
// client not waiting for the 200) would otherwise lose them.
func TestConnectEarlyBytes(t *testing.T) {
	upstreamKinds(t, nil, func(t *testing.T, up *pool.Upstream, _ func() []string) {
		echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
		tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), newFakePool(up))
		c, err := net.Dial("tcp", tl.addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		connectEarly(t, c, c, echo)
	})
}

// connectEarly sends a CONNECT to an echo destination with bytes right
// behind it, and checks that the 200 comes back followed by their echo.
func connectEarly(t *testing.T, w io.Writer, r io.Reader, echo string) {
	t.Helper()
	early := "early bytes right behind the request"
	fmt.Fprintf(w, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n%s", echo, echo, early)
	want := "HTTP/1.1 200 Connection established\r\n\r\n" + early
	got := make([]byte, len(want))
	if _, err := io.ReadFull(r, got); err != nil {
		t.Fatalf("reading: %v (got %q)", err, got)
	}
	if string(got) != want {
		t.Fatalf("got %q, want %q", got, want)
	}
}

// A connection's first request is read before the HTTP server sees it (a
// CONNECT is served without it). A plain first request that comes in
// pieces still reaches the server whole, a CONNECT after plain requests on
// the same connection still opens a tunnel with the bytes behind it, and a
// first CONNECT is answered and counted like any other.
func TestConnectAfterPlainRequests(t *testing.T) {
	checkLeaks(t)
	origin, _ := startOrigin(t, http.HandlerFunc(echoHandler))
	echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
	up := newHTTPUpstream(t, "", "", nil)
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), newFakePool(up.upstream(1)))
	c, err := net.Dial("tcp", tl.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReader(c)
	get := func(pieces ...string) {
		t.Helper()
		for _, p := range pieces {
			if _, err := io.WriteString(c, p); err != nil {
				t.Fatal(err)
			}
			time.Sleep(20 * time.Millisecond) // let each piece arrive alone
		}
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("reading the answer: %v", err)
		}
		body, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), `"URI":"/a"`) {
			t.Fatalf("answer %d %q", resp.StatusCode, body)
		}
	}
	req := "GET http://" + origin + "/a HTTP/1.1\r\nHost: " + origin + "\r\n\r\n"
	get(req[:3], req[3:20], req[20:])
	get(req)
	connectEarly(t, c, br, echo)
	_ = c.Close()

	// A first CONNECT to a refused destination, with a TLS hello's worth of
	// bytes behind it that proxyd never relays: the 403 arrives and the
	// outcome counts. (proxyd drains those bytes before it closes, since a
	// close with unread bytes sends a reset that can overtake the answer on
	// a real network; over loopback the answer arrives first either way, so
	// this does not tell the drain from a plain close.)
	rc, err := net.Dial("tcp", tl.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	_ = rc.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(rc, "CONNECT 10.1.2.3:443 HTTP/1.1\r\nHost: 10.1.2.3:443\r\n\r\n%s", strings.Repeat("h", 16<<10))
	resp, err := http.ReadResponse(bufio.NewReader(rc), &http.Request{Method: http.MethodConnect})
	if err != nil {
		t.Fatalf("answer to a refused CONNECT: %v", err)
	}
	if resp.StatusCode != http.StatusForbidden || !resp.Close {
		t.Errorf("CONNECT to a refused destination: %d, close %v", resp.StatusCode, resp.Close)
	}
	_ = rc.Close()
	waitFor(t, 5*time.Second, func() bool { return len(tl.obs.Closeds()) == 2 }, "both connections closed")
	outcomes := map[Outcome]int{}
	for _, r := range tl.obs.Closeds() {
		outcomes[r.o]++
	}
	if outcomes[OutcomeOK] != 1 || outcomes[OutcomeDenied] != 1 {
		t.Errorf("outcomes %v, want one ok and one denied", outcomes)
	}
}

func TestSOCKS5Client(t *testing.T) {
	upstreamKinds(t, nil, func(t *testing.T, up *pool.Upstream, _ func() []string) {
		echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
		origin, _ := startOrigin(t, http.HandlerFunc(echoHandler))
		p := newFakePool(up)
		tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "socks5"; c.AllowDestinations = loopbackAllowed }), p)
		d, err := proxy.SOCKS5("tcp", tl.addr, &proxy.Auth{User: "session-k1", Password: "x"}, proxy.Direct)
		if err != nil {
			t.Fatal(err)
		}
		c, err := d.Dial("tcp", echo)
		if err != nil {
			t.Fatal(err)
		}
		bigTransfer(t, c, c, 16<<20)
		_ = c.Close()

		// HTTP through the SOCKS5 listener.
		tr := &http.Transport{Dial: d.Dial}
		defer tr.CloseIdleConnections()
		hc := &http.Client{Transport: tr}
		req, _ := http.NewRequest("GET", "http://"+origin+"/x", nil)
		if e := getEcho(t, hc, req); e.URI != "/x" {
			t.Errorf("origin saw %q", e.URI)
		}
		tr.CloseIdleConnections()
		waitFor(t, 5*time.Second, func() bool { return tl.ActiveConns() == 0 }, "connections closed")
		p.waitBalanced(t)
		for _, r := range p.Picks() {
			if r.Key != "\x00k1" {
				t.Errorf("sticky key %q, want \\x00k1", r.Key)
			}
		}
	})
}

// TestUpstreamResolvesNames: a host name goes to the upstream unresolved.
func TestUpstreamResolvesNames(t *testing.T) {
	echoAddr := ""
	n := names{"only-upstream.test": "127.0.0.1"}
	upstreamKinds(t, n, func(t *testing.T, up *pool.Upstream, targets func() []string) {
		echoAddr = startTCP(t, "tcp", "127.0.0.1:0", echoServe)
		_, port, _ := net.SplitHostPort(echoAddr)
		origin, _ := startOrigin(t, http.HandlerFunc(echoHandler))
		_, oport, _ := net.SplitHostPort(origin)
		dest := "only-upstream.test:" + port
		for _, proto := range []string{"http", "socks5"} {
			tl := startListener(t, testConfig(func(c *Config) { c.Protocol = proto }), newFakePool(up))
			var c net.Conn
			if proto == "http" {
				var resp *http.Response
				var br io.Reader
				c, br, resp = rawConnect(t, tl.addr, dest, "")
				if resp.StatusCode != 200 {
					t.Fatalf("CONNECT: %d", resp.StatusCode)
				}
				bigTransfer(t, c, br, 1000)
			} else {
				d, _ := proxy.SOCKS5("tcp", tl.addr, nil, proxy.Direct)
				var err error
				if c, err = d.Dial("tcp", dest); err != nil {
					t.Fatal(err)
				}
				bigTransfer(t, c, c, 1000)
			}
			_ = c.Close()
		}
		// plain HTTP too
		tl := startListener(t, testConfig(nil), newFakePool(up))
		req, _ := http.NewRequest("GET", "http://only-upstream.test:"+oport+"/n", nil)
		if e := getEcho(t, tl.httpClient(t, "", ""), req); e.Host != "only-upstream.test:"+oport {
			t.Errorf("origin saw Host %q", e.Host)
		}
		found := 0
		for _, tg := range targets() {
			if strings.Contains(tg, "only-upstream.test") {
				found++
			}
		}
		if found < 2 {
			t.Errorf("upstream targets %q: want the name unresolved", targets())
		}
	})
}

func TestIPv6LiteralDestination(t *testing.T) {
	upstreamKinds(t, nil, func(t *testing.T, up *pool.Upstream, targets func() []string) {
		echo := startTCP(t, "tcp6", "[::1]:0", echoServe)
		tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), newFakePool(up))
		c, br, resp := rawConnect(t, tl.addr, echo, "")
		if resp.StatusCode != 200 {
			t.Fatalf("CONNECT %s: %d", echo, resp.StatusCode)
		}
		bigTransfer(t, c, br, 5000)
		stl := startListener(t, testConfig(func(c *Config) { c.Protocol = "socks5"; c.AllowDestinations = loopbackAllowed }), newFakePool(up))
		d, _ := proxy.SOCKS5("tcp", stl.addr, nil, proxy.Direct)
		sc, err := d.Dial("tcp", echo)
		if err != nil {
			t.Fatal(err)
		}
		bigTransfer(t, sc, sc, 5000)
		_ = sc.Close()
		if tg := targets(); len(tg) < 2 || !containsFold(tg, echo) {
			t.Errorf("upstream targets %q, want %q", tg, echo)
		}
	})
}

func wsEchoServer(t *testing.T, closeAfter string) string {
	h := websocket.Handler(func(ws *websocket.Conn) {
		for {
			var msg string
			if err := websocket.Message.Receive(ws, &msg); err != nil {
				return
			}
			if err := websocket.Message.Send(ws, "echo:"+msg); err != nil {
				return
			}
			if msg == closeAfter {
				_ = ws.Close()
				return
			}
		}
	})
	addr, _ := startOrigin(t, h)
	return addr
}

// dialWS opens a WebSocket through the HTTP proxy (absolute-URI upgrade).
func dialWS(t *testing.T, proxyAddr, origin string) *websocket.Conn {
	t.Helper()
	cfg, err := websocket.NewConfig("ws://"+origin+"/ws", "http://"+origin)
	if err != nil {
		t.Fatal(err)
	}
	// Absolute-URI form, as a client speaking to a proxy must send.
	cfg.Location = &url.URL{Scheme: "ws", Host: origin, Opaque: "//" + origin + "/ws"}
	c, err := net.Dial("tcp", proxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	ws, err := websocket.NewClient(cfg, c)
	if err != nil {
		_ = c.Close()
		t.Fatalf("websocket handshake through proxy: %v", err)
	}
	return ws
}

func TestWebSocketUpgrade(t *testing.T) {
	upstreamKinds(t, nil, func(t *testing.T, up *pool.Upstream, _ func() []string) {
		origin := wsEchoServer(t, "bye")
		tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), newFakePool(up))
		exchange := func(ws *websocket.Conn, msg string) {
			t.Helper()
			if err := websocket.Message.Send(ws, msg); err != nil {
				t.Fatal(err)
			}
			var got string
			if err := websocket.Message.Receive(ws, &got); err != nil || got != "echo:"+msg {
				t.Fatalf("receive: %q %v", got, err)
			}
		}
		t.Run("client-closes", func(t *testing.T) {
			ws := dialWS(t, tl.addr, origin)
			exchange(ws, "hello")
			exchange(ws, strings.Repeat("x", 100_000))
			_ = ws.Close()
			waitFor(t, 5*time.Second, func() bool { return tl.ActiveConns() == 0 }, "proxy closed both sides")
		})
		t.Run("origin-closes", func(t *testing.T) {
			ws := dialWS(t, tl.addr, origin)
			defer ws.Close()
			exchange(ws, "bye")
			// The origin closed: the client must see the end, not hang.
			var msg string
			err := websocket.Message.Receive(ws, &msg)
			if err == nil {
				t.Fatalf("expected end of stream, got %q", msg)
			}
			if strings.Contains(err.Error(), "timeout") {
				t.Fatalf("client hung after origin closed: %v", err)
			}
			_ = ws.Close() // as any client does on end of stream
			waitFor(t, 5*time.Second, func() bool { return tl.ActiveConns() == 0 }, "proxy closed both sides")
		})
	})
}

// TestConnectUpstreamSendsEarly: bytes an HTTP upstream sends right behind
// its 200 (a server-first protocol's banner) reach the client.
func TestConnectUpstreamSendsEarly(t *testing.T) {
	checkLeaks(t)
	banner := startTCP(t, "tcp", "127.0.0.1:0", func(c net.Conn) {
		_, _ = io.WriteString(c, "220 banner\r\n")
		echoServe(c)
	})
	hu := newHTTPUpstream(t, "", "", nil)
	hu.mode.Store(int32(modeBanner))
	su := newSOCKSUpstream(t, "", "", nil)
	su.mode.Store(int32(modeBanner))
	for _, tc := range []struct {
		proto string
		up    *pool.Upstream
	}{{"http", hu.upstream(1)}, {"socks5", hu.upstream(1)}, {"http", su.upstream(1)}, {"socks5", su.upstream(1)}} {
		proto := tc.proto
		tl := startListener(t, testConfig(func(c *Config) { c.Protocol = proto; c.AllowDestinations = loopbackAllowed }), newFakePool(tc.up))
		var c net.Conn
		var r io.Reader
		if proto == "http" {
			var resp *http.Response
			var br *bufio.Reader
			c, br, resp = rawConnect(t, tl.addr, banner, "")
			if resp.StatusCode != 200 {
				t.Fatalf("CONNECT: %d", resp.StatusCode)
			}
			r = br
		} else {
			d, _ := proxy.SOCKS5("tcp", tl.addr, nil, proxy.Direct)
			var err error
			if c, err = d.Dial("tcp", banner); err != nil {
				t.Fatal(err)
			}
			r = c
		}
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		got := make([]byte, len("220 banner\r\n"))
		if _, err := io.ReadFull(r, got); err != nil || string(got) != "220 banner\r\n" {
			t.Fatalf("%s via %s: banner %q %v", proto, tc.up.Protocol, got, err)
		}
		bigTransfer(t, c, r, 10000)
		_ = c.Close()
	}
}

// TestSOCKSClientSendsEarly: a SOCKS5 client that sends its greeting, its
// request and its first bytes at once (without waiting for the answers) has
// those bytes reach the destination.
func TestSOCKSClientSendsEarly(t *testing.T) {
	upstreamKinds(t, nil, func(t *testing.T, up *pool.Upstream, _ func() []string) {
		echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
		tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "socks5"; c.AllowDestinations = loopbackAllowed }), newFakePool(up))
		c, err := net.Dial("tcp", tl.addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		ap := netip.MustParseAddrPort(echo)
		ip := ap.Addr().As4()
		msg := []byte{5, 1, 0, 5, 1, 0, 1, ip[0], ip[1], ip[2], ip[3], byte(ap.Port() >> 8), byte(ap.Port())}
		msg = append(msg, "early bytes"...)
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
		head := make([]byte, 2+10)
		if _, err := io.ReadFull(c, head); err != nil || head[1] != 0 || head[3] != 0 {
			t.Fatalf("answers % x %v", head, err)
		}
		got := make([]byte, len("early bytes"))
		if _, err := io.ReadFull(c, got); err != nil || string(got) != "early bytes" {
			t.Fatalf("echo of the early bytes: %q %v", got, err)
		}
	})
}

// TestManyTunnelsPingPong: many tunnels exchanging small messages at once;
// a relay that lost a wake-up would leave one of them hanging.
func TestManyTunnelsPingPong(t *testing.T) {
	checkLeaks(t)
	echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
	up := newSOCKSUpstream(t, "", "", nil)
	tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "socks5"; c.AllowDestinations = loopbackAllowed }), newFakePool(up.upstream(1)))
	d, _ := proxy.SOCKS5("tcp", tl.addr, nil, proxy.Direct)
	const tunnels, rounds = 150, 30
	var wg sync.WaitGroup
	errs := make(chan error, tunnels)
	for i := range tunnels {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := d.Dial("tcp", echo)
			if err != nil {
				errs <- err
				return
			}
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(15 * time.Second))
			buf := make([]byte, 1+i%3)
			for r := range rounds {
				msg := bytes.Repeat([]byte{byte(r)}, len(buf))
				if _, err := c.Write(msg); err != nil {
					errs <- err
					return
				}
				if _, err := io.ReadFull(c, buf); err != nil || !bytes.Equal(buf, msg) {
					errs <- fmt.Errorf("tunnel %d round %d: %q %v", i, r, buf, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}
