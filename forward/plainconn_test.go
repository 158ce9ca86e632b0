package forward

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/proxyd/proxyd/pool"
)

// scriptedUpstream is an HTTP upstream proxy that answers each request on a
// connection with answer(n, req), n counting requests over all connections.
// answer returns the raw bytes to write and whether to close afterwards.
type scriptedUpstream struct {
	addr    string
	conns   atomic.Int64
	closed  atomic.Int64 // connections the upstream closed
	reqs    atomic.Int64
	mu      sync.Mutex
	seen    []string // request lines
	headers []http.Header
}

func startScripted(t *testing.T, answer func(n int64, req *http.Request, c net.Conn) (raw string, close bool)) *scriptedUpstream {
	su := &scriptedUpstream{}
	su.addr = startTCP(t, "tcp", "127.0.0.1:0", func(c net.Conn) {
		su.conns.Add(1)
		defer su.closed.Add(1)
		defer c.Close()
		br := bufio.NewReader(c)
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			su.mu.Lock()
			su.seen = append(su.seen, req.Method+" "+req.RequestURI)
			su.headers = append(su.headers, req.Header)
			su.mu.Unlock()
			n := su.reqs.Add(1)
			raw, closeAfter := answer(n, req, c)
			if _, err := io.WriteString(c, raw); err != nil || closeAfter {
				return
			}
			_, _ = io.Copy(io.Discard, req.Body)
		}
	})
	return su
}

func (su *scriptedUpstream) upstream() *pool.Upstream {
	return &pool.Upstream{Service: 1, Protocol: pool.HTTP, Address: su.addr}
}

// hasSilentIdle reports whether an idle connection has nothing to read.
func (pcs *plainConns) hasSilentIdle() bool {
	pcs.mu.Lock()
	defer pcs.mu.Unlock()
	for _, list := range pcs.idle {
		for _, pc := range list {
			if peerSilent(pc.rc) {
				return true
			}
		}
	}
	return false
}

func okAnswer(body string) string {
	return fmt.Sprintf("HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
}

// send makes a request through c and returns the answer's status and body.
func send(t *testing.T, c *http.Client, method, url string, body io.Reader) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, body)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func getBody(t *testing.T, c *http.Client, url string) (int, string) {
	t.Helper()
	return send(t, c, http.MethodGet, url, nil)
}

func failures(p *fakePool) []report {
	var out []report
	for _, r := range p.Reports() {
		if r.res != pool.Success {
			out = append(out, r)
		}
	}
	return out
}

// A kept upstream connection that the upstream closed while idle is
// replaced without a failure for the client or the upstream's record.
func TestPlainStaleConnectionReplaced(t *testing.T) {
	if !canAwaitPeer {
		t.Skip("proxyd cannot peek at a socket on this system: a kept connection's close shows only on use")
	}
	checkLeaks(t)
	su := startScripted(t, func(n int64, _ *http.Request, _ net.Conn) (string, bool) {
		// The first answer keeps the connection open, then the upstream
		// closes it without saying so (as idle timeouts do).
		return okAnswer(fmt.Sprint("answer-", n)), true
	})
	p := newFakePool(su.upstream())
	tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "http"; c.AllowDestinations = loopbackAllowed }), p)
	c := tl.httpClient(t, "", "")
	for i := 1; i <= 3; i++ {
		// The upstream closed the previous connection, and its FIN reached
		// the kept connection's socket.
		waitFor(t, 5*time.Second, func() bool { return su.closed.Load() >= int64(i-1) && !tl.plain.hasSilentIdle() }, "upstream close seen")
		method, body := http.MethodGet, io.Reader(nil)
		if i == 3 { // a request that cannot be sent twice must not meet the dead connection
			method, body = http.MethodPost, strings.NewReader("body")
		}
		if code, b := send(t, c, method, "http://example.test/", body); code != 200 || b != fmt.Sprint("answer-", i) {
			t.Fatalf("request %d: %d %q", i, code, b)
		}
	}
	if f := failures(p); len(f) != 0 {
		t.Errorf("failures reported for a connection closed while idle: %v", f)
	}
	p.waitBalanced(t)
}

// The same, when the close races the request: the connection passes the
// idle check and fails on use; a repeatable request goes again at once.
func TestPlainStaleConnectionRace(t *testing.T) {
	checkLeaks(t)
	su := startScripted(t, func(n int64, req *http.Request, c net.Conn) (string, bool) {
		if n == 2 {
			return "", true // the kept connection dies with the second request on it
		}
		return okAnswer("fine"), false
	})
	p := newFakePool(su.upstream())
	tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "http"; c.AllowDestinations = loopbackAllowed }), p)
	c := tl.httpClient(t, "", "")
	for i := range 2 {
		if code, body := getBody(t, c, "http://example.test/x"); code != 200 || body != "fine" {
			t.Fatalf("request %d: %d %q", i, code, body)
		}
	}
	if n := su.conns.Load(); n != 2 {
		t.Errorf("upstream connections: %d, want 2", n)
	}
	if f := failures(p); len(f) != 0 {
		t.Errorf("failures reported: %v", f)
	}
	p.waitBalanced(t)
}

// An answer left unread (a 407's body, which proxyd drops) closes its
// connection: the next answer must not start in the middle of it.
func TestPlainUnreadAnswerNotReused(t *testing.T) {
	checkLeaks(t)
	denied := strings.Repeat("d", 256<<10)
	su := startScripted(t, func(n int64, _ *http.Request, _ net.Conn) (string, bool) {
		if n == 1 {
			return fmt.Sprintf("HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: %d\r\n\r\n%s", len(denied), denied), false
		}
		return okAnswer("fine"), false
	})
	p := newFakePool(su.upstream())
	tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "http"; c.AllowDestinations = loopbackAllowed }), p)
	c := tl.httpClient(t, "", "")
	if code, _ := getBody(t, c, "http://example.test/"); code != http.StatusBadGateway {
		t.Errorf("upstream answering 407: %d, want 502", code)
	}
	if code, body := getBody(t, c, "http://example.test/"); code != 200 || body != "fine" {
		t.Errorf("next request: %d %q", code, body)
	}
	p.waitBalanced(t)
}

// A request that cannot be sent twice (POST) is not sent again on a fresh
// connection by the connection layer (the attempt loop's retry rules decide),
// and the upstream is not blamed for a kept connection closed under it.
func TestPlainStaleConnectionPOST(t *testing.T) {
	checkLeaks(t)
	var posts atomic.Int64
	su := startScripted(t, func(n int64, req *http.Request, c net.Conn) (string, bool) {
		if req.Method == http.MethodPost {
			if posts.Add(1) == 1 {
				_, _ = io.Copy(io.Discard, req.Body)
				return "", true // takes the body, then dies
			}
		}
		return okAnswer("fine"), false
	})
	p := newFakePool(su.upstream())
	tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "http"; c.AllowDestinations = loopbackAllowed }), p)
	c := tl.httpClient(t, "", "")
	if code, _ := getBody(t, c, "http://example.test/"); code != 200 {
		t.Fatal(code)
	}
	if code, _ := send(t, c, http.MethodPost, "http://example.test/", strings.NewReader("once")); code != http.StatusBadGateway {
		t.Errorf("POST whose upstream died after taking the body: %d, want 502", code)
	}
	if n := posts.Load(); n != 1 {
		t.Errorf("upstream saw the POST %d times, want 1", n)
	}
	// A kept connection closed under a request is no verdict on the upstream.
	if f := failures(p); len(f) != 1 || f[0].res != pool.Canceled {
		t.Errorf("reports %v, want one without verdict", f)
	}
	p.waitBalanced(t)
}

// An upstream that writes more than its answer does not get that connection
// used again: the extra bytes would be read as the next answer.
func TestPlainUnsolicitedBytes(t *testing.T) {
	checkLeaks(t)
	su := startScripted(t, func(n int64, _ *http.Request, _ net.Conn) (string, bool) {
		return okAnswer(fmt.Sprint("answer-", n)) + "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nbogus", false
	})
	tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "http"; c.AllowDestinations = loopbackAllowed }), newFakePool(su.upstream()))
	c := tl.httpClient(t, "", "")
	for i := 1; i <= 3; i++ {
		// The extra bytes come in the same write as the answer.
		if code, body := getBody(t, c, "http://example.test/"); code != 200 || body != fmt.Sprint("answer-", i) {
			t.Fatalf("request %d: %d %q", i, code, body)
		}
	}
	if n := su.conns.Load(); n != 3 {
		t.Errorf("upstream connections: %d, want 3 (none reused after unsolicited bytes)", n)
	}
}

// Informational answers (103 Early Hints) are skipped; the final answer
// reaches the client and the connection is kept.
func TestPlainInformationalAnswers(t *testing.T) {
	checkLeaks(t)
	su := startScripted(t, func(n int64, _ *http.Request, _ net.Conn) (string, bool) {
		return "HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n" + okAnswer("final"), false
	})
	tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "http"; c.AllowDestinations = loopbackAllowed }), newFakePool(su.upstream()))
	c := tl.httpClient(t, "", "")
	for range 2 {
		if code, body := getBody(t, c, "http://example.test/"); code != 200 || body != "final" {
			t.Fatalf("%d %q", code, body)
		}
	}
	if n := su.conns.Load(); n != 1 {
		t.Errorf("upstream connections: %d, want 1", n)
	}
}

// An answer head past 1 MiB is cut: the client gets a 502, the upstream is
// blamed, and proxyd did not buffer it all.
func TestPlainHugeHead(t *testing.T) {
	checkLeaks(t)
	big := strings.Repeat("X-Filler: "+strings.Repeat("a", 1000)+"\r\n", 2000) // ~2 MB
	su := startScripted(t, func(int64, *http.Request, net.Conn) (string, bool) {
		return "HTTP/1.1 200 OK\r\n" + big + "Content-Length: 0\r\n\r\n", true
	})
	p := newFakePool(su.upstream())
	tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "http"; c.AllowDestinations = loopbackAllowed }), p)
	code, body := getBody(t, tl.httpClient(t, "", ""), "http://example.test/")
	if code != http.StatusBadGateway || body != textBadGateway {
		t.Errorf("huge head: %d %q", code, body)
	}
	if f := failures(p); len(f) != 1 || !f[0].res.UpstreamFault() {
		t.Errorf("reports %v, want one upstream fault", f)
	}
}

// An upstream that answers before it read the body (413 here) gets its
// answer to the client at once, and the connection is not used again while
// the body was not taken.
func TestPlainEarlyAnswer(t *testing.T) {
	checkLeaks(t)
	su := startScripted(t, func(_ int64, req *http.Request, c net.Conn) (string, bool) {
		if req.Method == http.MethodPost {
			return "HTTP/1.1 413 Content Too Large\r\nContent-Length: 3\r\n\r\nbig", true
		}
		return okAnswer("fine"), false
	})
	p := newFakePool(su.upstream())
	tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "http"; c.AllowDestinations = loopbackAllowed }), p)
	c := tl.httpClient(t, "", "")
	// A body the upstream never reads, larger than the socket buffers,
	// sent by a client that keeps it coming slowly.
	pr, pw := io.Pipe()
	go func() {
		chunk := make([]byte, 64<<10)
		for range 64 {
			if _, err := pw.Write(chunk); err != nil {
				return
			}
		}
		_ = pw.Close()
	}()
	start := time.Now()
	code, b := send(t, c, http.MethodPost, "http://example.test/upload", pr)
	_ = pr.Close()
	if code != 413 || b != "big" {
		t.Errorf("early answer: %d %q", code, b)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("early answer took %v", d)
	}
	if code, body := getBody(t, c, "http://example.test/"); code != 200 || body != "fine" {
		t.Errorf("next request: %d %q", code, body)
	}
	p.waitBalanced(t)
}

// A client that leaves in the middle of an answer gets what the upstream
// sent so far at once, and its upstream connection does not stay in the idle
// set with the rest of the answer unread: proxyd closes it and sends nothing
// more on it.
func TestPlainClientLeavesMidAnswer(t *testing.T) {
	checkLeaks(t)
	var after atomic.Int64 // bytes proxyd sent on the cut connection
	slowDone := make(chan struct{})
	su := startScripted(t, func(n int64, req *http.Request, c net.Conn) (string, bool) {
		if req.URL.Path == "/slow" {
			defer close(slowDone)
			_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\npartial")
			_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
			m, _ := io.Copy(io.Discard, c) // until proxyd closes it
			after.Store(m)
			return "", true
		}
		return okAnswer("fine"), false
	})
	p := newFakePool(su.upstream())
	tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "http"; c.AllowDestinations = loopbackAllowed }), p)
	c := tl.httpClient(t, "", "")
	start := time.Now()
	resp, err := c.Get("http://example.test/slow")
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 7)
	if _, err := io.ReadFull(resp.Body, buf); err != nil || string(buf) != "partial" {
		t.Fatalf("partial body: %q %v", buf, err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("the first bytes of the answer took %v: held in a buffer", d)
	}
	_ = resp.Body.Close() // the client leaves
	c.Transport.(*http.Transport).CloseIdleConnections()
	if code, body := getBody(t, c, "http://example.test/"); code != 200 || body != "fine" {
		t.Errorf("next request: %d %q", code, body)
	}
	select {
	case <-slowDone:
	case <-time.After(5 * time.Second):
		t.Fatal("proxyd kept the upstream connection of an answer its client left")
	}
	if m := after.Load(); m != 0 {
		t.Errorf("proxyd sent %d bytes on the upstream connection of an unfinished answer", m)
	}
	p.waitBalanced(t)
}

// A streamed answer reaches the client piece by piece: each chunk arrives
// before the upstream sends the next one (it waits for the client to have it).
func TestPlainStreamedAnswer(t *testing.T) {
	checkLeaks(t)
	got := make(chan struct{}, 1)
	su := startScripted(t, func(_ int64, _ *http.Request, c net.Conn) (string, bool) {
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
		for i := range 3 {
			fmt.Fprintf(c, "6\r\nevent%d\r\n", i)
			select {
			case <-got:
			case <-time.After(5 * time.Second):
				return "", true // the client never saw it: the test fails below
			}
		}
		return "0\r\n\r\n", false
	})
	tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "http"; c.AllowDestinations = loopbackAllowed }), newFakePool(su.upstream()))
	resp, err := tl.httpClient(t, "", "").Get("http://example.test/stream")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	buf := make([]byte, 6)
	for i := range 3 {
		start := time.Now()
		if _, err := io.ReadFull(resp.Body, buf); err != nil || string(buf) != fmt.Sprint("event", i) {
			t.Fatalf("chunk %d: %q %v", i, buf, err)
		}
		if d := time.Since(start); d > 2*time.Second {
			t.Errorf("chunk %d took %v: held in a buffer", i, d)
		}
		got <- struct{}{}
	}
	if rest, err := io.ReadAll(resp.Body); err != nil || len(rest) != 0 {
		t.Errorf("end of stream: %q %v", rest, err)
	}
}

// An upstream that refuses a large upload at once (413, then closes, as
// servers do) gets its answer to the client, and is not blamed.
func TestPlainEarlyAnswerThenClose(t *testing.T) {
	checkLeaks(t)
	su := startScripted(t, func(int64, *http.Request, net.Conn) (string, bool) {
		return "HTTP/1.1 413 Content Too Large\r\nConnection: close\r\nContent-Length: 3\r\n\r\nbig", true
	})
	p := newFakePool(su.upstream())
	tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "http"; c.AllowDestinations = loopbackAllowed }), p)
	c := tl.httpClient(t, "", "")
	body := make([]byte, 4<<20)
	for i := range 10 {
		if code, b := send(t, c, http.MethodPost, "http://example.test/upload", bytes.NewReader(body)); code != 413 || b != "big" {
			t.Errorf("upload %d: %d %q", i, code, b)
		}
	}
	if f := failures(p); len(f) != 0 {
		t.Errorf("failures reported: %v", f)
	}
	p.waitBalanced(t)
}

// "Expect: 100-continue": the body waits for the upstream's go-ahead, so an
// upstream that refuses the upload at once costs the client no upload.
func TestPlainExpectContinue(t *testing.T) {
	checkLeaks(t)
	su := startScripted(t, func(int64, *http.Request, net.Conn) (string, bool) {
		// Answers without asking for the body.
		return "HTTP/1.1 401 Unauthorized\r\nContent-Length: 2\r\nConnection: close\r\n\r\nno", true
	})
	tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "http"; c.AllowDestinations = loopbackAllowed }), newFakePool(su.upstream()))
	conn, err := net.Dial("tcp", tl.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(conn, "PUT http://example.test/big HTTP/1.1\r\nHost: example.test\r\nExpect: 100-continue\r\nContent-Length: 100000000\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 401 {
		t.Errorf("first answer %d, want the upstream's 401 (no 100 Continue before the upstream asked)", resp.StatusCode)
	}
}

// A client uploading slower than the answer timeout: the wait for the
// upstream's answer starts when the body is through.
func TestPlainSlowUpload(t *testing.T) {
	checkLeaks(t)
	su := startScripted(t, func(_ int64, req *http.Request, _ net.Conn) (string, bool) {
		_, _ = io.Copy(io.Discard, req.Body)
		return okAnswer("fine"), false
	})
	p := newFakePool(su.upstream())
	tl := startListener(t, testConfig(func(c *Config) {
		c.Protocol = "http"
		c.AllowDestinations = loopbackAllowed
		c.ResponseTimeout = 300 * time.Millisecond
	}), p)
	pr, pw := io.Pipe()
	go func() {
		tick := time.NewTicker(100 * time.Millisecond) // the upload's pace, not a wait for a condition
		defer tick.Stop()
		for range 8 {
			<-tick.C
			if _, err := pw.Write([]byte("x")); err != nil {
				return
			}
		}
		_ = pw.Close()
	}()
	resp, err := tl.httpClient(t, "", "").Post("http://example.test/", "text/plain", pr)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("slow upload: %d", resp.StatusCode)
	}
	if f := failures(p); len(f) != 0 {
		t.Errorf("failures reported: %v", f)
	}
}

// proxyd adds no User-Agent of its own to a request that has none.
func TestPlainNoUserAgentAdded(t *testing.T) {
	checkLeaks(t)
	su := startScripted(t, func(int64, *http.Request, net.Conn) (string, bool) { return okAnswer("fine"), false })
	tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "http"; c.AllowDestinations = loopbackAllowed }), newFakePool(su.upstream()))
	conn, err := net.Dial("tcp", tl.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(conn, "GET http://example.test/ HTTP/1.1\r\nHost: example.test\r\n\r\n")
	if resp, err := http.ReadResponse(bufio.NewReader(conn), nil); err != nil || resp.StatusCode != 200 {
		t.Fatalf("%v %v", resp, err)
	}
	su.mu.Lock()
	defer su.mu.Unlock()
	if ua, ok := su.headers[0]["User-Agent"]; ok {
		t.Errorf("upstream got User-Agent %q", ua)
	}
}

// An upstream that stops taking a body and never answers does not hold the
// client: the request may wait on the upstream side for ResponseTimeout at
// a time, then the client gets 504 and nobody is blamed (no other upstream
// answered anything meanwhile). Also through Transport (a request with
// "Expect: 100-continue").
func TestPlainBodyStall(t *testing.T) {
	for _, expect := range []bool{false, true} {
		t.Run(fmt.Sprint("expect=", expect), func(t *testing.T) {
			checkLeaks(t)
			release := make(chan struct{})
			su := startScripted(t, func(int64, *http.Request, net.Conn) (string, bool) {
				<-release // reads the head only, then nothing
				return "", true
			})
			defer close(release)
			p := newFakePool(su.upstream())
			tl := startListener(t, testConfig(func(c *Config) {
				c.Protocol = "http"
				c.AllowDestinations = loopbackAllowed
				c.ResponseTimeout = 300 * time.Millisecond
			}), p)
			req, _ := http.NewRequest("POST", "http://example.test/", bytes.NewReader(make([]byte, 32<<20)))
			if expect {
				req.Header.Set("Expect", "100-continue")
			}
			start := time.Now()
			hc := tl.httpClient(t, "", "")
			resp, err := hc.Do(req)
			if err == nil {
				_ = resp.Body.Close()
				if resp.StatusCode != http.StatusGatewayTimeout {
					t.Errorf("stalled upload: %d, want 504", resp.StatusCode)
				}
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("stalled upload held the client %v", d)
			}
			if f := failures(p); len(f) != 1 || f[0].res != pool.DestinationError {
				t.Errorf("reports %v, want one destination_error", f)
			}
			hc.CloseIdleConnections()
			waitFor(t, 5*time.Second, func() bool { return len(tl.obs.Closeds()) == 1 }, "closed")
			if o := tl.obs.Closeds()[0].o; o != OutcomeDestinationError {
				t.Errorf("outcome %s, want destination_error", o)
			}
		})
	}
}

// A request that may have had its effect (a POST without body) is not sent
// again when the kept connection it went out on dies before an answer.
func TestPlainStaleNotSentTwice(t *testing.T) {
	checkLeaks(t)
	var posts atomic.Int64
	su := startScripted(t, func(_ int64, req *http.Request, _ net.Conn) (string, bool) {
		if req.Method == http.MethodPost && posts.Add(1) == 1 {
			return "", true // took it, died
		}
		return okAnswer("fine"), false
	})
	p := newFakePool(su.upstream())
	tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "http"; c.AllowDestinations = loopbackAllowed }), p)
	c := tl.httpClient(t, "", "")
	if code, _ := getBody(t, c, "http://example.test/"); code != 200 {
		t.Fatal(code)
	}
	code, _ := send(t, c, http.MethodPost, "http://example.test/charge", http.NoBody)
	if n := posts.Load(); n != 1 {
		t.Errorf("POST sent %d times, want 1", n)
	}
	if code != http.StatusBadGateway {
		t.Errorf("status %d, want 502", code)
	}
	p.waitBalanced(t)
}

// Idle upstream connections are kept up to a number per upstream and in
// all, and closed after the idle timeout.
func TestPlainIdleLimits(t *testing.T) {
	checkLeaks(t)
	// Six requests at once over two upstreams: six connections, three to
	// each; two kept per upstream would be four, three in all are kept.
	const n = 6
	release := make(chan struct{})
	var started sync.WaitGroup
	started.Add(n)
	var seen atomic.Int64
	answer := func(int64, *http.Request, net.Conn) (string, bool) {
		if seen.Add(1) <= n { // the first n wait until all n are in
			started.Done()
			<-release
		}
		return okAnswer("slow"), false
	}
	a, b := startScripted(t, answer), startScripted(t, answer)
	tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "http"; c.AllowDestinations = loopbackAllowed }),
		newFakePool(a.upstream(), &pool.Upstream{Service: 2, Protocol: pool.HTTP, Address: b.addr}))
	pcs := tl.plain
	pcs.mu.Lock()
	pcs.maxIdlePerKey, pcs.maxIdle, pcs.idleTimeout = 2, 3, time.Hour
	pcs.mu.Unlock()
	idle := func() int { pcs.mu.Lock(); defer pcs.mu.Unlock(); return pcs.n }
	getsHeldTogether(t, tl, n, &started, release)
	waitFor(t, 5*time.Second, func() bool { return a.closed.Load()+b.closed.Load() == n-3 }, "all but three closed")
	if got := idle(); got != 3 {
		t.Errorf("idle connections %d, want 3", got)
	}

	// Kept connections are closed after the idle timeout.
	pcs.mu.Lock()
	pcs.idleTimeout = 100 * time.Millisecond
	pcs.mu.Unlock()
	if code, _ := getBody(t, tl.httpClient(t, "", ""), "http://example.test/"); code != 200 {
		t.Fatal(code)
	}
	waitFor(t, 5*time.Second, func() bool { return a.closed.Load()+b.closed.Load() == n-2 }, "the connection used again closed after the idle timeout")
}

// A kept connection's idle timer is not moved at each reuse; when it runs,
// a connection used again in the meantime stays for the rest of its own
// idle time, and is closed once that has passed.
func TestPlainIdleTimerCountsFromLastUse(t *testing.T) {
	const timeout = 400 * time.Millisecond
	for attempt := 1; ; attempt++ {
		ok := func() bool {
			pcs := newPlainConns(nil, nil, 0)
			pcs.idleTimeout = timeout
			ours, theirs := net.Pipe()
			defer theirs.Close()
			pc := &plainConn{pcs: pcs, key: "k", conn: ours, br: bufio.NewReader(ours)}
			closed := make(chan time.Time, 1)
			go func() {
				_, _ = io.Copy(io.Discard, theirs)
				closed <- time.Now()
			}()
			idleSince := func() time.Time { pcs.mu.Lock(); defer pcs.mu.Unlock(); return pc.idleSince }

			pcs.put(pc)
			armed := idleSince()
			time.Sleep(timeout * 5 / 8)
			if pcs.get("k") != pc {
				t.Fatal("connection idle for less than the timeout was not kept")
			}
			pcs.put(pc) // the timer still runs for the first put
			used := idleSince()
			for time.Since(armed) < timeout*5/4 { // past the first put's timeout
				time.Sleep(timeout / 8)
			}
			got := pcs.get("k")
			if time.Since(used) >= timeout {
				return false // this machine was too slow to tell; try again
			}
			if got != pc {
				t.Fatalf("connection used %v ago was closed at the timeout of an earlier use", time.Since(used))
			}
			pcs.put(pc)
			used = idleSince()
			select {
			case at := <-closed:
				if idle := at.Sub(used); idle < timeout {
					t.Fatalf("closed after %v idle, want at least %v", idle, timeout)
				}
			case <-time.After(10 * timeout):
				t.Fatal("idle connection not closed after its timeout")
			}
			return true
		}()
		if ok {
			return
		}
		if attempt == 3 {
			t.Fatal("the machine was too slow to run the timing in three attempts")
		}
	}
}

// However many kept connections the upstream closed under it, a request
// goes out at most twice (maxSends): once on a kept connection that turns
// out closed, once more on a new one.
func TestPlainStaleResendOnce(t *testing.T) {
	checkLeaks(t)
	const kept = 3
	var (
		mu     sync.Mutex
		served = map[net.Conn]bool{}
		dying  atomic.Bool
		gets   atomic.Int64
	)
	release := make(chan struct{})
	var arrived sync.WaitGroup
	arrived.Add(kept)
	su := startScripted(t, func(n int64, req *http.Request, c net.Conn) (string, bool) {
		if n <= kept { // the first ones wait for each other: kept connections
			arrived.Done()
			<-release
			mu.Lock()
			served[c] = true
			mu.Unlock()
			return okAnswer("first"), false
		}
		gets.Add(1)
		mu.Lock()
		again := served[c]
		mu.Unlock()
		if dying.Load() && again {
			return "", true // took the request on a kept connection, closed it
		}
		return okAnswer("fine"), false
	})
	p := newFakePool(su.upstream())
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
	getsHeldTogether(t, tl, kept, &arrived, release)
	waitFor(t, 5*time.Second, func() bool {
		tl.plain.mu.Lock()
		defer tl.plain.mu.Unlock()
		return tl.plain.n == kept
	}, "three kept connections")
	dying.Store(true)
	code, body := getBody(t, tl.httpClient(t, "", ""), "http://example.test/x")
	// Twice exactly: once on a kept connection, which the upstream closed,
	// and once more on a new one.
	if n := gets.Load(); n != maxSends {
		t.Errorf("upstream received the request %d times, want %d", n, maxSends)
	}
	if code != http.StatusOK || body != "fine" {
		t.Errorf("answer %d %q, want 200 from a new connection", code, body)
	}
	p.waitBalanced(t)
	if f := failures(p); len(f) != 0 {
		t.Errorf("failures reported: %v", f)
	}
}

// A hedge and a resend over a new connection share the request's two
// sends: a kept connection that dies under the request after the hedge
// went out is not resent, and the hedge's answer wins.
func TestPlainStaleAfterHedgeNotResent(t *testing.T) {
	checkLeaks(t)
	var xs atomic.Int64
	script := func(name string, x func(c net.Conn, again bool) (string, bool)) *scriptedUpstream {
		var mu sync.Mutex
		served := map[net.Conn]bool{}
		return startScripted(t, func(_ int64, req *http.Request, c net.Conn) (string, bool) {
			mu.Lock()
			again := served[c]
			served[c] = true
			mu.Unlock()
			if req.URL.Path != "/x" {
				return okAnswer(name), false
			}
			xs.Add(1)
			return x(c, again)
		})
	}
	hedgeDelay := 100 * time.Millisecond
	hedgeIn, aDied := make(chan struct{}), make(chan struct{})
	var hedgeOnce, diedOnce sync.Once
	wait := func(ch chan struct{}) {
		select {
		case <-ch:
		case <-time.After(5 * time.Second):
		}
	}
	a := script("a", func(c net.Conn, again bool) (string, bool) {
		if again { // the kept connection: dies once the hedge is out
			wait(hedgeIn)
			diedOnce.Do(func() { close(aDied) })
			return "", true
		}
		return okAnswer("a"), false // a new connection (a resend) would answer
	})
	b := script("b", func(net.Conn, bool) (string, bool) {
		hedgeOnce.Do(func() { close(hedgeIn) })
		wait(aDied)
		// Time for a resend to a, had there been one, to get its answer
		// first: the pace of this upstream, not a wait for a condition.
		time.Sleep(hedgeDelay)
		return okAnswer("fine"), false
	})
	p := newFakePool(a.upstream(), &pool.Upstream{Service: 2, Protocol: pool.HTTP, Address: b.addr})
	tl := startListener(t, testConfig(func(c *Config) {
		c.AllowDestinations = loopbackAllowed
		c.HedgeDelay = hedgeDelay
	}), p)
	hc := tl.httpClient(t, "", "")
	for _, want := range []string{"a", "b"} { // a kept connection to each
		if code, body := getBody(t, hc, "http://example.test/warm"); code != 200 || body != want {
			t.Fatalf("warm-up: %d %q, want %q", code, body, want)
		}
	}
	code, body := getBody(t, hc, "http://example.test/x")
	if code != http.StatusOK || body != "fine" {
		t.Errorf("answer %d %q, want the hedge's", code, body)
	}
	if n := xs.Load(); n != maxSends {
		t.Errorf("the request went out %d times, want %d (first and hedge)", n, maxSends)
	}
	if f := failures(p); len(f) != 1 || f[0].res != pool.Canceled {
		t.Errorf("reports %v, want one without verdict (the dead kept connection)", f)
	}
	p.waitBalanced(t)
}

// getsHeldTogether sends n GETs at once through tl, each from its own
// client, and returns when all were answered. The upstream holds each one
// until all n arrived (counted down on arrived) and release is closed, so
// that n upstream connections are open at the same time.
func getsHeldTogether(t *testing.T, tl *testListener, n int, arrived *sync.WaitGroup, release chan struct{}) {
	t.Helper()
	errs := make(chan error, n)
	for range n {
		go func() {
			resp, err := tl.httpClient(t, "", "").Get("http://example.test/")
			if err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				err = resp.Body.Close()
			}
			errs <- err
		}()
	}
	all := make(chan struct{})
	go func() { arrived.Wait(); close(all) }()
	select {
	case <-all:
	case err := <-errs:
		close(release)
		t.Fatalf("a GET ended before all %d arrived: %v", n, err)
	case <-time.After(5 * time.Second):
		close(release)
		t.Fatalf("not all %d GETs reached the upstream in 5s", n)
	}
	close(release)
	for range n {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
}

// An answer whose body stalls halfway is bounded by idle_timeout, as an
// idle tunnel is: the client gets what came and then the end of its
// connection, and the upstream is released, instead of both waiting for
// as long as the origin keeps the connection open.
func TestStalledAnswerBodyEndsAtIdleTimeout(t *testing.T) {
	checkLeaks(t)
	stalled := make(chan net.Conn, 1)
	origin := startTCP(t, "tcp", "127.0.0.1:0", func(c net.Conn) {
		br := bufio.NewReader(c)
		if _, err := http.ReadRequest(br); err != nil {
			return
		}
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nhello")
		stalled <- c
		_, _ = io.Copy(io.Discard, br) // and nothing more, until the test ends
	})
	u := newHTTPUpstream(t, "", "", nil)
	// The test upstream relays the body as it comes: it waits for the
	// origin, which holds its connection until the test ends.
	t.Cleanup(func() {
		select {
		case c := <-stalled:
			_ = c.Close()
		default:
		}
	})
	p := newFakePool(u.upstream(1))
	const idle = 400 * time.Millisecond
	tl := startListener(t, testConfig(func(c *Config) {
		c.AllowDestinations = loopbackAllowed
		c.IdleTimeout = idle
		c.ResponseTimeout = time.Minute
	}), p)
	expectCutBody(t, tl.addr, "http://"+origin+"/", "hello", idle)
	p.waitBalanced(t)
}

// expectCutBody asks the listener at addr for url, whose answer's body
// stalls after want: the client must get want and then the end of its
// connection within a few times idle (not its own 10 s deadline).
func expectCutBody(t *testing.T, addr, url, want string, idle time.Duration) {
	t.Helper()
	c, br := dialRaw(t, addr)
	host := strings.TrimPrefix(strings.TrimPrefix(url, "http://"), "https://")
	host, _, _ = strings.Cut(host, "/")
	_, _ = io.WriteString(c, "GET "+url+" HTTP/1.1\r\nHost: "+host+"\r\n\r\n")
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodGet})
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("answer: %v %v", resp, err)
	}
	start := time.Now()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	body, err := io.ReadAll(resp.Body)
	if took := time.Since(start); string(body) != want || err == nil || isTimeout(err) || took > 5*idle {
		t.Errorf("body %q, %v after %s; want the %q that came, then the end of the connection within about %s", body, err, took, want, idle)
	}
}

// The bound on a stalled answer body is on silence, not on the answer's
// length: after one wait, bytes that were already there when the deadline
// of that wait passed (the upstream stayed ahead of a slow client) are
// read, not cut.
func TestAnswerBodyReadAfterAnOldDeadline(t *testing.T) {
	up, proxySide := tcpPair(t)
	var rc syscall.RawConn
	if sc, ok := proxySide.(syscall.Conn); ok {
		rc, _ = sc.SyscallConn()
	}
	const silence = 200 * time.Millisecond
	h := &headLimit{r: proxySide, rc: rc, n: -1, idle: func() {}, silence: silence, ctx: context.Background()}
	go func() {
		time.Sleep(50 * time.Millisecond) // the pace of the upstream, not a wait for a condition
		_, _ = up.Write([]byte("a"))
	}()
	buf := make([]byte, 64<<10)
	if n, err := h.Read(buf); err != nil || n != 1 {
		t.Fatalf("first read: %d, %v", n, err)
	}
	// More comes while proxyd is busy with its client, past the deadline
	// its first wait set.
	if _, err := up.Write(bytes.Repeat([]byte("b"), 1000)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * silence) // the client's pace, not a wait for a condition
	if n, err := h.Read(buf); err != nil || n != 1000 {
		t.Fatalf("read past the old deadline: %d, %v; want the 1000 bytes waiting", n, err)
	}
	// And a real silence still ends the read.
	start := time.Now()
	if _, err := h.Read(buf); !isTimeout(err) || time.Since(start) > 10*silence {
		t.Errorf("silent upstream: %v after %s, want a timeout after %s", err, time.Since(start), silence)
	}
}
