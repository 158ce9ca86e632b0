package forward

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/proxyd/proxyd/pool"
)

// readAnswer reads one answer to method and its whole body.
func readAnswer(t *testing.T, br *bufio.Reader, method string) (*http.Response, string) {
	t.Helper()
	resp, err := http.ReadResponse(br, &http.Request{Method: method})
	if err != nil {
		t.Fatalf("reading the answer: %v", err)
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading the answer's body: %v", err)
	}
	return resp, string(b)
}

// A client that hangs up while its answer is awaited ends the request's
// attempt: the upstream connection is closed at once, nobody is blamed,
// and the connection counts as the client's failure.
func TestPlainClientHangsUp(t *testing.T) {
	checkLeaks(t)
	su := startScripted(t, func(_ int64, _ *http.Request, c net.Conn) (string, bool) {
		// No answer: wait until proxyd closes the connection.
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, _ = c.Read(make([]byte, 1))
		return "", true
	})
	p := newFakePool(su.upstream())
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
	c, _ := dialRaw(t, tl.addr)
	_, _ = io.WriteString(c, "GET http://example.test/slow HTTP/1.1\r\nHost: example.test\r\n\r\n")
	waitFor(t, 5*time.Second, func() bool { return su.reqs.Load() == 1 }, "the request at the upstream")
	start := time.Now()
	_ = c.Close()
	waitFor(t, 5*time.Second, func() bool { return su.closed.Load() == 1 }, "the upstream connection closed")
	if d := time.Since(start); d > time.Second {
		t.Errorf("the attempt ended %v after the client left", d)
	}
	tl.wantClientLeft(t, p)
}

// Requests a client sends without waiting for the answers are answered in
// order on the same connection, also when the first answer is slow enough
// for the client's connection to be watched.
func TestPlainPipelinedRequests(t *testing.T) {
	checkLeaks(t)
	su := startScripted(t, func(_ int64, req *http.Request, _ net.Conn) (string, bool) {
		if req.URL.Path == "/slow" {
			time.Sleep(3 * watchAfter)
		}
		return okAnswer(req.URL.Path), false
	})
	p := newFakePool(su.upstream())
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
	c, br := dialRaw(t, tl.addr)
	_, _ = io.WriteString(c, "GET http://example.test/slow HTTP/1.1\r\nHost: example.test\r\n\r\n"+
		"GET http://example.test/b HTTP/1.1\r\nHost: example.test\r\n\r\n"+
		"HEAD http://example.test/c HTTP/1.1\r\nHost: example.test\r\n\r\n")
	for _, want := range []string{"/slow", "/b"} {
		if resp, body := readAnswer(t, br, http.MethodGet); resp.StatusCode != 200 || body != want {
			t.Errorf("answer %d %q, want 200 %q", resp.StatusCode, body, want)
		}
	}
	resp, body := readAnswer(t, br, http.MethodHead)
	if resp.StatusCode != 200 || body != "" || resp.ContentLength != 2 {
		t.Errorf("HEAD answer %d, %q, length %d", resp.StatusCode, body, resp.ContentLength)
	}
	p.waitBalanced(t)
	if f := failures(p); len(f) != 0 {
		t.Errorf("failures %+v", f)
	}
}

// An answer is framed for the client: chunked to an HTTP/1.1 client when
// its length is not known, up to the connection's end for an HTTP/1.0
// client, which keeps its connection only for answers of known length and
// only when it asked to.
func TestPlainAnswerFraming(t *testing.T) {
	checkLeaks(t)
	su := startScripted(t, func(_ int64, req *http.Request, _ net.Conn) (string, bool) {
		if req.URL.Path == "/stream" {
			return "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Sum\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\nX-Sum: 5\r\n\r\n", false
		}
		return okAnswer("fixed"), false
	})
	p := newFakePool(su.upstream())
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)

	c, br := dialRaw(t, tl.addr)
	_, _ = io.WriteString(c, "GET http://example.test/stream HTTP/1.1\r\nHost: example.test\r\n\r\n")
	resp, body := readAnswer(t, br, http.MethodGet)
	if body != "abcde" || len(resp.TransferEncoding) != 1 || resp.TransferEncoding[0] != "chunked" || resp.Trailer.Get("X-Sum") != "5" {
		t.Errorf("HTTP/1.1: body %q, transfer encoding %v, trailer %v", body, resp.TransferEncoding, resp.Trailer)
	}
	// The origin sent no Date: proxyd adds one, as an origin server must.
	if d, err := http.ParseTime(resp.Header.Get("Date")); err != nil || time.Since(d) > time.Minute || time.Until(d) > time.Minute {
		t.Errorf("Date %q: %v, want the time of the answer", resp.Header.Get("Date"), err)
	}

	// An HTTP/1.0 client that did not ask to keep its connection.
	c, br = dialRaw(t, tl.addr)
	_, _ = io.WriteString(c, "GET http://example.test/fixed HTTP/1.0\r\n\r\n")
	resp, body = readAnswer(t, br, http.MethodGet)
	if body != "fixed" || !resp.Close {
		t.Errorf("HTTP/1.0 without keep-alive: %q, close %v", body, resp.Close)
	}
	if _, err := br.ReadByte(); err != io.EOF {
		t.Errorf("after an answer to HTTP/1.0 without keep-alive: %v, want the connection's end", err)
	}

	c, br = dialRaw(t, tl.addr)
	_, _ = io.WriteString(c, "GET http://example.test/fixed HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"+
		"GET http://example.test/stream HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
	resp, body = readAnswer(t, br, http.MethodGet)
	if body != "fixed" || resp.Close || resp.Header.Get("Connection") != "keep-alive" {
		t.Errorf("HTTP/1.0, known length: %q, close %v, Connection %q", body, resp.Close, resp.Header.Get("Connection"))
	}
	resp, body = readAnswer(t, br, http.MethodGet)
	if body != "abcde" || !resp.Close || len(resp.TransferEncoding) != 0 {
		t.Errorf("HTTP/1.0, length unknown: %q, close %v, transfer encoding %v", body, resp.Close, resp.TransferEncoding)
	}
	if _, err := br.ReadByte(); err != io.EOF {
		t.Errorf("after a close-delimited answer: %v, want the connection's end", err)
	}
	p.waitBalanced(t)
}

// What net/http's server refused, the listener refuses too: an
// expectation other than 100-continue (417), a header that is not a valid
// token or value (400); neither reaches an upstream.
func TestPlainHeadChecks(t *testing.T) {
	checkLeaks(t)
	su := startScripted(t, func(int64, *http.Request, net.Conn) (string, bool) { return okAnswer("x"), false })
	p := newFakePool(su.upstream())
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
	for _, tc := range []struct {
		head string
		want int
	}{
		{"GET http://example.test/ HTTP/1.1\r\nHost: example.test\r\nExpect: 200-ok\r\n\r\n", http.StatusExpectationFailed},
		{"GET http://example.test/ HTTP/1.1\r\nHost: example.test\r\nX-A: a\x01b\r\n\r\n", http.StatusBadRequest},
		{"GET http://exa mple.test/ HTTP/1.1\r\nHost: example.test\r\n\r\n", http.StatusBadRequest},
	} {
		c, br := dialRaw(t, tl.addr)
		_, _ = io.WriteString(c, tc.head)
		if resp, _ := readAnswer(t, br, http.MethodGet); resp.StatusCode != tc.want {
			t.Errorf("%q: %d, want %d", tc.head, resp.StatusCode, tc.want)
		}
	}
	if n := su.reqs.Load(); n != 0 {
		t.Errorf("%d requests reached the upstream", n)
	}
}

// Shutdown closes a kept-alive connection that waits for its next request,
// and lets one whose request is being served have its answer, marked as
// the connection's last.
func TestShutdownKeptAliveConnections(t *testing.T) {
	checkLeaks(t)
	release := make(chan struct{})
	su := startScripted(t, func(_ int64, req *http.Request, _ net.Conn) (string, bool) {
		if req.URL.Path == "/slow" {
			<-release
		}
		return okAnswer("done"), false
	})
	p := newFakePool(su.upstream())
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
	idle, ibr := dialRaw(t, tl.addr)
	_, _ = io.WriteString(idle, "GET http://example.test/ HTTP/1.1\r\nHost: example.test\r\n\r\n")
	readAnswer(t, ibr, http.MethodGet)
	busy, bbr := dialRaw(t, tl.addr)
	_, _ = io.WriteString(busy, "GET http://example.test/slow HTTP/1.1\r\nHost: example.test\r\n\r\n")
	waitFor(t, 5*time.Second, func() bool { return su.reqs.Load() == 2 }, "the slow request at the upstream")

	done := tl.shutdownAsync()
	if _, err := ibr.ReadByte(); err != io.EOF {
		t.Errorf("idle connection: %v, want it closed", err)
	}
	close(release)
	resp, body := readAnswer(t, bbr, http.MethodGet)
	if body != "done" || !resp.Close {
		t.Errorf("busy connection's answer %q, close %v: want it whole and the last", body, resp.Close)
	}
	if err := <-done; err != nil {
		t.Errorf("Shutdown: %v", err)
	}
}

// An upgrade the origin refuses (no 101) or that cannot be tried gets its
// answer, and the connection goes on serving requests (and is counted when
// it ends).
func TestRefusedUpgradeKeepsConnection(t *testing.T) {
	upstreamKinds(t, nil, func(t *testing.T, up *pool.Upstream, _ func() []string) {
		origin, _ := startOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("Upgrade") != "" {
				http.Error(w, "no", http.StatusForbidden)
				return
			}
			_, _ = io.WriteString(w, "plain")
		}))
		tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), newFakePool(up))
		c, br := dialRaw(t, tl.addr)
		for _, tc := range []struct {
			head string
			want int
		}{
			{"GET http://" + origin + "/ws HTTP/1.1\r\nHost: " + origin + "\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n", http.StatusForbidden},
			{"GET https://" + origin + "/ws HTTP/1.1\r\nHost: " + origin + "\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n", http.StatusBadRequest},
			{"GET http://" + origin + "/ HTTP/1.1\r\nHost: " + origin + "\r\n\r\n", http.StatusOK},
		} {
			_, _ = io.WriteString(c, tc.head)
			if resp, _ := readAnswer(t, br, http.MethodGet); resp.StatusCode != tc.want {
				t.Errorf("%q: %d, want %d", tc.head, resp.StatusCode, tc.want)
			}
		}
		_ = c.Close()
		waitFor(t, 5*time.Second, func() bool { return tl.ActiveConns() == 0 }, "the connection counted closed")
	})
}

// A connection goes on after a body: an empty line a client sends after it
// is skipped (RFC 9112 §2.2), and a small body a refusal left unread is read
// away, as net/http's server did, so that a client answering a 407 with
// credentials can use the same connection.
func TestPlainConnectionAfterBody(t *testing.T) {
	checkLeaks(t)
	su := startScripted(t, func(_ int64, req *http.Request, _ net.Conn) (string, bool) {
		b, _ := io.ReadAll(req.Body)
		return okAnswer(req.Method + " " + string(b)), false
	})
	p := newFakePool(su.upstream())
	tl := startListener(t, testConfig(func(c *Config) {
		c.AllowDestinations = loopbackAllowed
		c.Users = []User{{Name: "alice", Password: "pw"}}
	}), p)
	auth := "Proxy-Authorization: " + basicHeader("alice", "pw") + "\r\n"
	c, br := dialRaw(t, tl.addr)
	_, _ = io.WriteString(c, "POST http://example.test/ HTTP/1.1\r\nHost: example.test\r\nContent-Length: 5\r\n\r\nhello")
	resp, _ := readAnswer(t, br, http.MethodPost)
	if resp.StatusCode != http.StatusProxyAuthRequired || resp.Close || resp.Header.Get("Proxy-Authenticate") != challenge {
		t.Fatalf("without credentials: %d, close %v, challenge %q; want 407 with the challenge on a kept connection",
			resp.StatusCode, resp.Close, resp.Header.Get("Proxy-Authenticate"))
	}
	_, _ = io.WriteString(c, "POST http://example.test/ HTTP/1.1\r\nHost: example.test\r\n"+auth+"Content-Length: 5\r\n\r\nhello\r\n")
	if resp, body := readAnswer(t, br, http.MethodPost); resp.StatusCode != 200 || body != "POST hello" {
		t.Fatalf("with credentials: %d %q", resp.StatusCode, body)
	}
	_, _ = io.WriteString(c, "GET http://example.test/ HTTP/1.1\r\nHost: example.test\r\n"+auth+"\r\n")
	if resp, body := readAnswer(t, br, http.MethodGet); resp.StatusCode != 200 || body != "GET " {
		t.Errorf("after the CRLF: %d %q", resp.StatusCode, body)
	}
	_, _ = io.WriteString(c, "GET http://example.test/ HTTP/2.0\r\nHost: example.test\r\n"+auth+"\r\n")
	if resp, _ := readAnswer(t, br, http.MethodGet); resp.StatusCode != http.StatusHTTPVersionNotSupported {
		t.Errorf("HTTP/2.0 request line: %d, want 505", resp.StatusCode)
	}
	p.waitBalanced(t)
}

// A client that stops reading its answer ends it after idle_timeout, as one
// that stalls its upload does: the connection closes as the client's
// failure and the upstream connection is given back.
func TestPlainClientStopsReading(t *testing.T) {
	checkLeaks(t)
	chunk := make([]byte, 64<<10)
	su := startScripted(t, func(_ int64, _ *http.Request, c net.Conn) (string, bool) {
		// An endless answer: it ends when proxyd closes this connection.
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 1099511627776\r\n\r\n")
		for {
			if _, err := c.Write(chunk); err != nil {
				return "", true
			}
		}
	})
	p := newFakePool(su.upstream())
	tl := startListener(t, testConfig(func(c *Config) {
		c.AllowDestinations = loopbackAllowed
		c.IdleTimeout = 500 * time.Millisecond
	}), p)
	c, _ := dialRaw(t, tl.addr)
	start := time.Now()
	_, _ = io.WriteString(c, "GET http://example.test/big HTTP/1.1\r\nHost: example.test\r\n\r\n")
	// The client reads nothing from here on.
	waitFor(t, 10*time.Second, func() bool { return len(tl.obs.Closeds()) == 1 }, "the connection ended")
	if d := time.Since(start); d < 500*time.Millisecond || d > 5*time.Second {
		t.Errorf("the connection ended after %s, want about idle_timeout (500ms)", d)
	}
	if o := tl.obs.Closeds()[0].o; o != OutcomeClientError {
		t.Errorf("outcome %s, want client_error", o)
	}
	waitFor(t, 5*time.Second, func() bool { return su.closed.Load() == 1 }, "the upstream connection closed")
	p.waitBalanced(t)
}

// A tunnel after an answer on the same connection (an upgrade) is not cut
// by the deadlines that bounded the answers' writes (idle_timeout for the
// plain answer, header_timeout for the 101): bytes keep moving both ways
// for longer than either.
func TestUpgradeOutlivesAnswerDeadline(t *testing.T) {
	checkLeaks(t)
	origin := startTCP(t, "tcp", "127.0.0.1:0", func(c net.Conn) {
		br := bufio.NewReader(c)
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			if req.Header.Get("Upgrade") == "" {
				_, _ = io.WriteString(c, okAnswer("ok"))
				continue
			}
			_, _ = io.WriteString(c, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
			_, _ = plainCopy(c, br)
			return
		}
	})
	u := newHTTPUpstream(t, "", "", nil)
	const idle = 400 * time.Millisecond
	tl := startListener(t, testConfig(func(c *Config) {
		c.AllowDestinations = loopbackAllowed
		c.IdleTimeout = idle
		c.HeaderTimeout = idle / 2
	}), newFakePool(u.upstream(1)))
	c, br := dialRaw(t, tl.addr)
	_, _ = io.WriteString(c, "GET http://"+origin+"/ HTTP/1.1\r\nHost: "+origin+"\r\n\r\n")
	if resp, body := readAnswer(t, br, http.MethodGet); resp.StatusCode != http.StatusOK || body != "ok" {
		t.Fatalf("plain answer: %d %q", resp.StatusCode, body)
	}
	_, _ = io.WriteString(c, "GET http://"+origin+"/up HTTP/1.1\r\nHost: "+origin+"\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
	if resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodGet}); err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade: %v %v", resp, err)
	}
	buf := make([]byte, 4)
	start := time.Now()
	for time.Since(start) < 3*idle {
		if _, err := io.WriteString(c, "ping"); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(br, buf); err != nil || string(buf) != "ping" {
			t.Fatalf("echo after %s of tunnel: %q %v", time.Since(start), buf, err)
		}
		time.Sleep(idle / 8) // the pace of the traffic, not a wait for a condition
	}
	_ = c.Close()
	waitFor(t, 5*time.Second, func() bool { return tl.ActiveConns() == 0 }, "the tunnel closed")
}

// A "100 Continue" late in a kept connection's life goes out: the write
// deadline an earlier answer left on the connection is moved first.
func TestContinueAfterKeptAnswer(t *testing.T) {
	checkLeaks(t)
	const idle = time.Second
	su := startScripted(t, func(_ int64, req *http.Request, c net.Conn) (string, bool) {
		if req.Method == http.MethodPut {
			time.Sleep(idle * 2 / 5) // the upstream's pace before its go-ahead
			_, _ = io.WriteString(c, "HTTP/1.1 100 Continue\r\n\r\n")
			b, _ := io.ReadAll(req.Body)
			return okAnswer("got " + string(b)), false
		}
		return okAnswer("ok"), false
	})
	p := newFakePool(su.upstream())
	tl := startListener(t, testConfig(func(c *Config) {
		c.AllowDestinations = loopbackAllowed
		c.IdleTimeout = idle
	}), p)
	c, br := dialRaw(t, tl.addr)
	_, _ = io.WriteString(c, "GET http://example.test/ HTTP/1.1\r\nHost: example.test\r\n\r\n")
	if resp, body := readAnswer(t, br, http.MethodGet); resp.StatusCode != http.StatusOK || body != "ok" {
		t.Fatalf("GET: %d %q", resp.StatusCode, body)
	}
	time.Sleep(idle * 4 / 5) // the client's pace: late in the kept connection's idle time
	_, _ = io.WriteString(c, "PUT http://example.test/up HTTP/1.1\r\nHost: example.test\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
	line, err := br.ReadString('\n')
	if err != nil || line != "HTTP/1.1 100 Continue\r\n" {
		t.Fatalf("first line after the PUT: %q %v, want the 100 Continue", line, err)
	}
	if blank, _ := br.ReadString('\n'); blank != "\r\n" {
		t.Fatalf("after the 100: %q", blank)
	}
	_, _ = io.WriteString(c, "hello")
	if resp, body := readAnswer(t, br, http.MethodPut); resp.StatusCode != http.StatusOK || body != "got hello" {
		t.Errorf("PUT: %d %q", resp.StatusCode, body)
	}
	p.waitBalanced(t)
}

// An answer that streams slowly to a client that reads it is not cut when
// idle_timeout is under a second: its write deadline moves often enough.
func TestSlowAnswerShortIdleTimeout(t *testing.T) {
	checkLeaks(t)
	const idle = 500 * time.Millisecond
	su := startScripted(t, func(_ int64, _ *http.Request, c net.Conn) (string, bool) {
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 30\r\n\r\n")
		for range 10 {
			if _, err := io.WriteString(c, "abc"); err != nil {
				return "", true
			}
			time.Sleep(idle * 3 / 10) // the origin's pace
		}
		return "", false
	})
	tl := startListener(t, testConfig(func(c *Config) {
		c.AllowDestinations = loopbackAllowed
		c.IdleTimeout = idle
	}), newFakePool(su.upstream()))
	c, br := dialRaw(t, tl.addr)
	_, _ = io.WriteString(c, "GET http://example.test/slow HTTP/1.1\r\nHost: example.test\r\n\r\n")
	if resp, body := readAnswer(t, br, http.MethodGet); resp.StatusCode != http.StatusOK || len(body) != 30 {
		t.Errorf("got %d with %d of 30 bytes", resp.StatusCode, len(body))
	}
}

// Once an upgrade's tunnel is open the upstream has done its part: an
// origin that never answers the upgrade gets 504 after response_timeout
// (not handshake_timeout), one that answers garbage 502, both counted as the
// destination's, and the upstream's one report is its success.
func TestUpgradeOriginFailsIsTheDestinations(t *testing.T) {
	checkLeaks(t)
	for _, tc := range []struct {
		name   string
		answer string // what the origin writes after reading the upgrade; "" for nothing
		status int
	}{{"silent origin", "", http.StatusGatewayTimeout}, {"garbage", "SSH-2.0-nothing-like-http\r\n\r\n", http.StatusBadGateway}} {
		t.Run(tc.name, func(t *testing.T) {
			origin := answeringOrigin(t, tc.answer)
			u := newHTTPUpstream(t, "", "", nil)
			p := newFakePool(u.upstream(1))
			const respTimeout = 300 * time.Millisecond
			tl := startListener(t, testConfig(func(c *Config) {
				c.AllowDestinations = loopbackAllowed
				c.HandshakeTimeout = 30 * time.Second
				c.ResponseTimeout = respTimeout
			}), p)
			start := time.Now()
			c := askUpgrade(t, tl.addr, origin)
			resp, _ := readAnswer(t, bufio.NewReader(c), http.MethodGet)
			if resp.StatusCode != tc.status {
				t.Errorf("status %d, want %d", resp.StatusCode, tc.status)
			}
			if took := time.Since(start); took > 10*respTimeout {
				t.Errorf("answered after %s; response_timeout is %s", took, respTimeout)
			}
			_ = c.Close()
			waitFor(t, 5*time.Second, func() bool { return len(tl.obs.Closeds()) == 1 }, "the connection counted")
			if o := tl.obs.Closeds()[0].o; o != OutcomeDestinationError {
				t.Errorf("outcome %s, want %s", o, OutcomeDestinationError)
			}
			p.waitBalanced(t)
			if r, want := p.Reports(), []report{{u.upstream(1).ID(), pool.Success}}; !slices.Equal(r, want) {
				t.Errorf("reports %+v, want %+v", r, want)
			}
		})
	}
}

// An origin that answers an upgrade without 101 gets its answer passed on
// as a plain request's: a body that stalls is cut after idle_timeout (the
// client has what came before, and the connection ends, since the answer
// is broken), the pick is released, and a 5xx counts as the destination's.
func TestUpgradeRefusedAnswerIsBounded(t *testing.T) {
	checkLeaks(t)
	for _, tc := range []struct {
		name, answer, want string
		outcome            Outcome
	}{
		{"stalled body", "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc", "abc", OutcomeOK},
		{"503", "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy", "busy", OutcomeDestinationError},
	} {
		t.Run(tc.name, func(t *testing.T) {
			origin := answeringOrigin(t, tc.answer)
			u := newHTTPUpstream(t, "", "", nil)
			p := newFakePool(u.upstream(1))
			const idle = 300 * time.Millisecond
			tl := startListener(t, testConfig(func(c *Config) {
				c.AllowDestinations = loopbackAllowed
				c.IdleTimeout = idle
				c.ResponseTimeout = 30 * time.Second
			}), p)
			start := time.Now()
			c := askUpgrade(t, tl.addr, origin)
			defer c.Close()
			br := bufio.NewReader(c)
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatal(err)
			}
			_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
			got, _ := io.ReadAll(resp.Body)
			if string(got) != tc.want {
				t.Errorf("body %q, want %q", got, tc.want)
			}
			if tc.name == "stalled body" {
				if _, err := br.ReadByte(); err != io.EOF {
					t.Errorf("after the stalled body: %v, want the connection closed", err)
				}
				if took := time.Since(start); took > 10*idle {
					t.Errorf("the stalled answer ended after %s; idle_timeout is %s", took, idle)
				}
			}
			_ = c.Close()
			waitFor(t, 5*time.Second, func() bool { return len(tl.obs.Closeds()) == 1 }, "the connection counted")
			if o := tl.obs.Closeds()[0].o; o != tc.outcome {
				t.Errorf("outcome %s, want %s", o, tc.outcome)
			}
			p.waitBalanced(t)
		})
	}
}

// Every plain request on a keep-alive connection is counted with its own
// result (Observer.Requested), while the connection counts once, with its
// last one; a malformed head is a request refused; a CONNECT is none.
func TestEachPlainRequestCounted(t *testing.T) {
	checkLeaks(t)
	origin, _ := startOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") }))
	up := newHTTPUpstream(t, "", "", nil).upstream(1)
	var empty atomic.Bool
	empty.Store(true) // the first request finds no upstream
	p := newFakePool(up)
	p.PickFunc = func(context.Context, pool.Request) (*pool.Upstream, error) {
		if empty.Swap(false) {
			return nil, errors.New("no usable upstream")
		}
		return up, nil
	}
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
	c, br := dialRaw(t, tl.addr)
	for i, want := range []int{http.StatusBadGateway, http.StatusOK} {
		fmt.Fprintf(c, "GET http://%s/ HTTP/1.1\r\nHost: %s\r\n\r\n", origin, origin)
		if resp, _ := readAnswer(t, br, http.MethodGet); resp.StatusCode != want {
			t.Fatalf("request %d: %d, want %d", i, resp.StatusCode, want)
		}
	}
	_ = c.Close()
	waitFor(t, 5*time.Second, func() bool { return len(tl.obs.Closeds()) == 1 }, "the keep-alive connection counted")
	if got := tl.obs.Closeds()[0].o; got != OutcomeOK {
		t.Errorf("the keep-alive connection: %s, want its last request's ok", got)
	}
	bad, _ := dialRaw(t, tl.addr)
	_, _ = io.WriteString(bad, "GET http://x/ HTTP/1.1\r\nHost x\r\n\r\n") // no colon: malformed
	_ = bad.(*net.TCPConn).CloseWrite()                                    // so that the refusal's linger ends at once
	_, _ = io.Copy(io.Discard, bad)
	tun, _, resp := rawConnect(t, tl.addr, origin, "")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("CONNECT: %d", resp.StatusCode)
	}
	_ = tun.Close()
	waitFor(t, 5*time.Second, func() bool { return len(tl.obs.Closeds()) == 3 }, "three connections counted")
	if got, want := tl.obs.Requests(), []Outcome{OutcomeNoUpstream, OutcomeOK, OutcomeClientError}; !slices.Equal(got, want) {
		t.Errorf("requests counted %v, want %v", got, want)
	}
}

// answeringOrigin reads one request, writes answer (raw bytes, "" for
// nothing) and reads on until the other side closes.
func answeringOrigin(t *testing.T, answer string) string {
	return startTCP(t, "tcp", "127.0.0.1:0", func(c net.Conn) {
		br := bufio.NewReader(c)
		if _, err := http.ReadRequest(br); err != nil {
			return
		}
		_, _ = io.WriteString(c, answer)
		_, _ = io.Copy(io.Discard, br)
	})
}
