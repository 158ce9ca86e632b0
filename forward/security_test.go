package forward

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/textproto"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/proxy"

	"github.com/proxyd/proxyd/forward/socks5"
	"github.com/proxyd/proxyd/pool"
)

// rawRequest sends raw bytes to addr and returns the response (nil if the
// connection ended without one).
func rawRequest(t *testing.T, addr, raw string) *http.Response {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, raw); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return nil
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body = io.NopCloser(strings.NewReader(string(b)))
	return resp
}

// strippedHeaders are the client's headers that must reach neither the
// upstream nor the destination, and those proxyd must not add.
var strippedHeaders = []string{"Proxy-Authorization", "Connection", "X-Hop", "Keep-Alive", "Te", "Trailer",
	"Proxy-Connection", "Upgrade", "Via", "X-Forwarded-For", "Forwarded"}

// headerProbe is a plain request to origin carrying the local user's
// Proxy-Authorization and every kind of hop-by-hop header.
func headerProbe(origin string) string {
	return "GET http://" + origin + "/h HTTP/1.1\r\nHost: " + origin + "\r\n" +
		"Proxy-Authorization: " + basicHeader("alice-session-k9", "s3cret") + "\r\n" +
		"Connection: X-Hop, keep-alive\r\nX-Hop: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\n" +
		"Trailer: X-T\r\nProxy-Connection: keep-alive\r\nUpgrade: foo/1\r\nX-Keep: yes\r\n\r\n"
}

func TestHeadersStripped(t *testing.T) {
	upstreamKinds(t, nil, func(t *testing.T, up *pool.Upstream, _ func() []string) {
		origin, _ := startOrigin(t, http.HandlerFunc(echoHandler))
		tl := startListener(t, testConfig(func(c *Config) {
			c.AllowDestinations = loopbackAllowed
			c.Users = []User{{Name: "alice", Password: "s3cret"}}
		}), newFakePool(up))
		resp := rawRequest(t, tl.addr, headerProbe(origin))
		if resp == nil || resp.StatusCode != 200 {
			t.Fatalf("response %+v", resp)
		}
		var e echoed
		if err := json.NewDecoder(resp.Body).Decode(&e); err != nil {
			t.Fatal(err)
		}
		for _, h := range strippedHeaders {
			if v, ok := e.Header[h]; ok {
				t.Errorf("origin saw %s: %q", h, v)
			}
		}
		if e.Header.Get("X-Keep") != "yes" {
			t.Errorf("end-to-end header lost: %v", e.Header)
		}
		for _, h := range []string{"Via", "X-Forwarded-For", "Forwarded", "Proxy-Connection", "Keep-Alive"} {
			if v := resp.Header.Get(h); v != "" {
				t.Errorf("client saw %s: %q", h, v)
			}
		}
	})
}

// An HTTP upstream takes Proxy-Authorization off before the origin sees the
// request, so the origin cannot tell whose credentials went upstream: the
// upstream itself must see its own (none when it has none), and none of the
// hop-by-hop headers.
func TestHeadersStrippedAtUpstream(t *testing.T) {
	checkLeaks(t)
	origin, _ := startOrigin(t, http.HandlerFunc(echoHandler))
	for _, creds := range [][2]string{{"upuser", "up:pass"}, {"", ""}} {
		u := newHTTPUpstream(t, creds[0], creds[1], nil)
		up := u.upstream(1)
		tl := startListener(t, testConfig(func(c *Config) {
			c.AllowDestinations = loopbackAllowed
			c.Users = []User{{Name: "alice", Password: "s3cret"}}
		}), newFakePool(up))
		if resp := rawRequest(t, tl.addr, headerProbe(origin)); resp == nil || resp.StatusCode != 200 {
			t.Fatalf("upstream user %q: response %+v", creds[0], resp)
		}
		got := u.Headers()
		if len(got) != 1 {
			t.Fatalf("upstream user %q: saw %d plain requests, want 1", creds[0], len(got))
		}
		h := got[0]
		var want []string
		if a := basicAuth(up); a != "" {
			want = []string{a}
		}
		if v := h.Values("Proxy-Authorization"); !slices.Equal(v, want) {
			t.Errorf("upstream user %q: saw Proxy-Authorization %q, want %q", creds[0], v, want)
		}
		for _, name := range strippedHeaders {
			if v, ok := h[name]; ok && name != "Proxy-Authorization" {
				t.Errorf("upstream user %q: saw %s: %q", creds[0], name, v)
			}
		}
		if h.Get("X-Keep") != "yes" {
			t.Errorf("upstream user %q: end-to-end header lost: %v", creds[0], h)
		}
	}
}

func TestLocalUsers(t *testing.T) {
	checkLeaks(t)
	echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
	up := newHTTPUpstream(t, "", "", nil)
	p := newFakePool(up.upstream(1))
	cfg := testConfig(func(c *Config) {
		c.AllowDestinations = loopbackAllowed
		c.Users = []User{{Name: "alice", Password: "s3cret"}, {Name: "bob", Password: "pw"}}
	})
	tl := startListener(t, cfg, p)
	for _, tc := range []struct {
		auth string
		code int
		key  string
	}{
		{"", 407, ""},
		{basicHeader("alice", "wrong"), 407, ""},
		{basicHeader("carol", "s3cret"), 407, ""},
		{basicHeader("alice-session-bad!key", "s3cret"), 407, ""},
		{basicHeader("session-k", "s3cret"), 407, ""}, // no user name: not a local user
		{"Bearer xyz", 407, ""},
		{basicHeader("alice", "s3cret"), 200, ""},
		{basicHeader("alice-session-k.1_x", "s3cret"), 200, "alice\x00k.1_x"},
		{basicHeader("bob-session-k.1_x", "pw"), 200, "bob\x00k.1_x"},
	} {
		extra := ""
		if tc.auth != "" {
			extra = "Proxy-Authorization: " + tc.auth + "\r\n"
		}
		c, _, resp := rawConnect(t, tl.addr, echo, extra)
		if resp.StatusCode != tc.code {
			t.Errorf("%q: %d, want %d", tc.auth, resp.StatusCode, tc.code)
		}
		if tc.code == 407 && resp.Header.Get("Proxy-Authenticate") != `Basic realm="proxyd"` {
			t.Errorf("%q: challenge %q", tc.auth, resp.Header.Get("Proxy-Authenticate"))
		}
		_ = c.Close()
		if tc.code == 200 {
			picks := p.Picks()
			if k := picks[len(picks)-1].Key; k != tc.key {
				t.Errorf("%q: key %q, want %q", tc.auth, k, tc.key)
			}
		}
	}
	// SOCKS5: username/password required, and checked.
	stl := startListener(t, testConfig(func(c *Config) { c.Protocol = "socks5"; c.AllowDestinations = loopbackAllowed; c.Users = cfg.Users }), p)
	for _, tc := range []struct {
		auth *proxy.Auth
		ok   bool
	}{
		{nil, false},
		{&proxy.Auth{User: "alice", Password: "no"}, false},
		{&proxy.Auth{User: "alice-session-s1", Password: "s3cret"}, true},
	} {
		d, _ := proxy.SOCKS5("tcp", stl.addr, tc.auth, proxy.Direct)
		c, err := d.Dial("tcp", echo)
		if (err == nil) != tc.ok {
			t.Errorf("socks %+v: err %v", tc.auth, err)
		}
		if c != nil {
			_ = c.Close()
		}
	}
	picks := p.Picks()
	if k := picks[len(picks)-1].Key; k != "alice\x00s1" {
		t.Errorf("socks key %q", k)
	}
}

// TestRefusedDestinations: literal loopback, private, link-local,
// unspecified destinations, their mapped forms, numeric host names and
// proxyd's own address never reach an upstream.
func TestRefusedDestinations(t *testing.T) {
	checkLeaks(t)
	p := newFakePool()
	p.PickFunc = func(_ context.Context, req pool.Request) (*pool.Upstream, error) {
		t.Errorf("a refused destination reached Pick: %+v", req)
		return nil, fmt.Errorf("no")
	}
	hosts := []string{
		"127.0.0.1", "127.1.2.3", "[::1]", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254",
		"[fe80::1]", "0.0.0.0", "[::]", "[::ffff:127.0.0.1]", "[::ffff:10.0.0.1]", "[::ffff:169.254.169.254]",
		"[fc00::1]", "[64:ff9b::7f00:1]", "[2002:7f00:1::]", "[::127.0.0.1]", "localhost", "LOCALHOST.", "a.localhost",
		"2130706433", "0x7f.1", "127.1", "017700000001", "[fe80::1%25eth0]",
	}
	tl := startListener(t, testConfig(nil), p)
	stl := startListener(t, testConfig(func(c *Config) { c.Protocol = "socks5" }), p)
	for _, h := range hosts {
		target := h + ":80"
		_, _, resp := rawConnect(t, tl.addr, target, "")
		if resp.StatusCode != 403 && resp.StatusCode != 400 {
			t.Errorf("CONNECT %s: %d", target, resp.StatusCode)
		}
		resp = rawRequest(t, tl.addr, "GET http://"+target+"/ HTTP/1.1\r\nHost: "+target+"\r\n\r\n")
		if resp == nil || resp.StatusCode != 403 && resp.StatusCode != 400 {
			t.Errorf("GET %s: %+v", target, resp)
		}
		sh := strings.TrimSuffix(strings.TrimPrefix(h, "["), "]")
		if strings.Contains(sh, "%") {
			continue // not sendable in SOCKS
		}
		if code := socksDialCode(t, stl.addr, net.JoinHostPort(sh, "80")); code != socks5.ReplyNotAllowed && code != socks5.ReplyAddressNotSupported {
			t.Errorf("SOCKS %s: reply %#x", sh, code)
		}
	}
	// A public address is not refused (the pool is asked).
	if err := tl.dest.check("93.184.216.34", 80); err != nil {
		t.Errorf("public address refused: %v", err)
	}
	if err := tl.dest.check("example.com", 443); err != nil {
		t.Errorf("host name refused: %v", err)
	}
}

// TestOwnAddressRefused: even with loopback allowed, proxyd's own listening
// address is refused (a request loop).
func TestOwnAddressRefused(t *testing.T) {
	checkLeaks(t)
	p := newFakePool()
	p.PickFunc = func(context.Context, pool.Request) (*pool.Upstream, error) {
		t.Error("own address reached Pick")
		return nil, fmt.Errorf("no")
	}
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
	_, _, resp := rawConnect(t, tl.addr, tl.addr, "")
	if resp.StatusCode != 403 {
		t.Errorf("CONNECT to own address: %d", resp.StatusCode)
	}
	_, port, _ := net.SplitHostPort(tl.addr)
	_, _, resp = rawConnect(t, tl.addr, "[::ffff:127.0.0.1]:"+port, "")
	if resp.StatusCode != 403 {
		t.Errorf("CONNECT to own address, mapped: %d", resp.StatusCode)
	}
}

// framingOrigin records the raw head of every request it gets.
type framingOrigin struct {
	mu    sync.Mutex
	heads []textproto.MIMEHeader // with the request line under ":line"
	addr  string
}

func newFramingOrigin(t *testing.T) *framingOrigin {
	o := &framingOrigin{}
	o.addr = startTCP(t, "tcp", "127.0.0.1:0", func(c net.Conn) {
		br := bufio.NewReader(c)
		tp := textproto.NewReader(br)
		for {
			line, err := tp.ReadLine()
			if err != nil {
				return
			}
			h, err := tp.ReadMIMEHeader()
			if err != nil {
				return
			}
			h[":line"] = []string{line}
			o.mu.Lock()
			o.heads = append(o.heads, h)
			o.mu.Unlock()
			var body io.Reader = strings.NewReader("")
			chunked := strings.EqualFold(h.Get("Transfer-Encoding"), "chunked")
			if chunked {
				body = httputil.NewChunkedReader(br)
			} else if n, err := strconv.ParseInt(h.Get("Content-Length"), 10, 64); err == nil {
				body = io.LimitReader(br, n)
			}
			if _, err := io.Copy(io.Discard, body); err != nil {
				return
			}
			if chunked { // the trailer section ends with an empty line
				if _, err := tp.ReadMIMEHeader(); err != nil {
					return
				}
			}
			if _, err := io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"); err != nil {
				return
			}
		}
	})
	return o
}

// Heads returns the heads of requests for path.
func (o *framingOrigin) Heads(path string) []textproto.MIMEHeader {
	o.mu.Lock()
	defer o.mu.Unlock()
	var out []textproto.MIMEHeader
	for _, h := range o.heads {
		if strings.Contains(h[":line"][0], " "+path+" ") {
			out = append(out, h)
		}
	}
	return out
}

func TestFramingCorpus(t *testing.T) {
	upstreamKinds(t, nil, func(t *testing.T, up *pool.Upstream, _ func() []string) {
		o := newFramingOrigin(t)
		p := newFakePool(up)
		tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
		start := "POST http://" + o.addr + "/CASE HTTP/1.1\r\nHost: " + o.addr + "\r\n"
		corpus := map[string]string{
			"cl+te":          start + "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
			"te+cl":          start + "Transfer-Encoding: chunked\r\nContent-Length: 50\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
			"cl-dup-same":    start + "Content-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
			"cl-conflict":    start + "Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
			"cl-list":        start + "Content-Length: 5, 6\r\n\r\nhello!",
			"cl-plus":        start + "Content-Length: +5\r\n\r\nhello",
			"te-identity":    start + "Transfer-Encoding: identity, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
			"te-xchunked":    start + "Transfer-Encoding: xchunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
			"te-dup":         start + "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
			"chunk-bad-size": start + "Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
			"chunk-overflow": start + "Transfer-Encoding: chunked\r\n\r\nffffffffffffffffffff\r\nhello\r\n0\r\n\r\n",
			"chunk-neg":      start + "Transfer-Encoding: chunked\r\n\r\n-5\r\nhello\r\n0\r\n\r\n",
			"bare-lf":        strings.ReplaceAll(start+"Content-Length: 5\r\n\r\nhello", "\r\n", "\n"),
			"bare-lf-chunk":  start + "Transfer-Encoding: chunked\r\n\r\n5\nhello\n0\n\n",
			"space-colon":    start + "Content-Length : 5\r\n\r\nhello",
			"obs-fold":       start + "Content-Length: 5\r\nX-A: a\r\n b\r\n\r\nhello",
		}
		for name, raw := range corpus {
			raw = strings.Replace(raw, "/CASE", "/"+name, 1)
			resp := rawRequest(t, tl.addr, raw)
			status := 0
			if resp != nil {
				status = resp.StatusCode
			}
			heads := o.Heads("/" + name)
			for _, h := range heads {
				if h.Get("Content-Length") != "" && h.Get("Transfer-Encoding") != "" {
					t.Errorf("%s: origin got both framings: %v", name, h)
				}
				if len(h.Values("Content-Length")) > 1 || len(h.Values("Transfer-Encoding")) > 1 {
					t.Errorf("%s: origin got duplicate framing headers: %v", name, h)
				}
			}
			if len(heads) == 0 && status != 400 && status != 501 {
				t.Errorf("%s: refused with %d, want 400", name, status)
			}
			if len(heads) > 0 && status != 200 && status != 400 {
				t.Errorf("%s: forwarded, answered %d", name, status)
			}
			t.Logf("%-15s status %d, forwarded %d", name, status, len(heads))
		}
		p.waitBalanced(t)
		for _, r := range p.Reports() {
			if r.res.UpstreamFault() {
				t.Errorf("a client's broken framing blamed the upstream: %+v", r)
			}
		}
	})
}

func TestSlowHeaders(t *testing.T) {
	checkLeaks(t)
	origin, _ := startOrigin(t, http.HandlerFunc(echoHandler))
	up := newHTTPUpstream(t, "", "", nil)
	const timeout = 500 * time.Millisecond
	for _, proto := range []string{"http", "socks5"} {
		tl := startListener(t, testConfig(func(c *Config) { c.Protocol = proto; c.AllowDestinations = loopbackAllowed; c.HeaderTimeout = timeout }), newFakePool(up.upstream(1)))
		var slow []net.Conn
		for range 20 {
			c, err := net.Dial("tcp", tl.addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if proto == "http" {
				_, _ = io.WriteString(c, "GET http://"+origin+"/ HTTP/1.1\r\nHost: ")
			} else {
				_, _ = c.Write([]byte{5})
			}
			slow = append(slow, c)
		}
		start := time.Now()
		// A normal request keeps its latency meanwhile.
		if proto == "http" {
			req, _ := http.NewRequest("GET", "http://"+origin+"/", nil)
			getEcho(t, tl.httpClient(t, "", ""), req)
		} else {
			d, _ := proxy.SOCKS5("tcp", tl.addr, nil, proxy.Direct)
			c, err := d.Dial("tcp", origin)
			if err != nil {
				t.Fatal(err)
			}
			_ = c.Close()
		}
		if d := time.Since(start); d > timeout {
			t.Errorf("%s: normal request took %s with slow clients around", proto, d)
		}
		for _, c := range slow {
			_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
			_, err := io.Copy(io.Discard, c)
			if err != nil {
				t.Errorf("%s: slow client not cut: %v", proto, err)
			}
		}
		if d := time.Since(start); d < timeout/2 || d > 4*timeout {
			t.Errorf("%s: slow clients cut after %s, want about %s", proto, d, timeout)
		}
	}
}

func TestConnectionCap(t *testing.T) {
	checkLeaks(t)
	echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
	up := newHTTPUpstream(t, "", "", nil)
	const limit = 3
	for _, proto := range []string{"http", "socks5"} {
		tl := startListener(t, testConfig(func(c *Config) { c.Protocol = proto; c.AllowDestinations = loopbackAllowed; c.MaxConnections = limit }), newFakePool(up.upstream(1)))
		var held []net.Conn
		for range limit {
			c, err := net.Dial("tcp", tl.addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			held = append(held, c)
		}
		waitFor(t, 5*time.Second, func() bool { return tl.ActiveConns() == limit }, "connections held")
		// Over the cap: answered at once, and more of them do not stall accept.
		for range 10 {
			if proto == "http" {
				resp := rawRequest(t, tl.addr, "GET http://"+echo+"/ HTTP/1.1\r\nHost: x\r\n\r\n")
				if resp == nil || resp.StatusCode != 503 {
					t.Fatalf("over cap: %+v", resp)
				}
			} else if code := socksDialCode(t, tl.addr, echo); code != socks5.ReplyGeneralFailure {
				t.Fatalf("over cap: socks reply %#x", code)
			}
		}
		if n := tl.ActiveConns(); n != limit {
			t.Errorf("active %d", n)
		}
		_ = held[0].Close()
		waitFor(t, 5*time.Second, func() bool { return tl.ActiveConns() == limit-1 }, "one slot free")
		if proto == "http" {
			c, br, resp := rawConnect(t, tl.addr, echo, "")
			if resp.StatusCode != 200 {
				t.Fatalf("under cap again: %d", resp.StatusCode)
			}
			bigTransfer(t, c, br, 100)
		} else if code := socksDialCode(t, tl.addr, echo); code != 0 {
			t.Fatalf("under cap again: %#x", code)
		}
	}
}

func TestClientAllowList(t *testing.T) {
	checkLeaks(t)
	up := newHTTPUpstream(t, "", "", nil)
	tl := startListener(t, testConfig(func(c *Config) { c.Allow = []Network{MustParseNetwork("10.0.0.0/8")} }), newFakePool(up.upstream(1)))
	if resp := rawRequest(t, tl.addr, "GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n"); resp != nil {
		t.Errorf("client outside the allow-list answered %d", resp.StatusCode)
	}
	waitFor(t, 5*time.Second, func() bool { return len(tl.obs.Closeds()) == 1 }, "closed")
	if o := tl.obs.Closeds()[0].o; o != OutcomeDenied {
		t.Errorf("outcome %s", o)
	}
}
