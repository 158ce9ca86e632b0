package forward

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/proxyd/proxyd/forward/socks5"
	"github.com/proxyd/proxyd/pool"
)

// TestClassify: every class of failure, row by row: whose fault it is
// (pool.Result) and what the client is told (outcome, HTTP status, SOCKS5
// reply). Only the upstream's own failures count against it; what points at
// the destination, a client that left or an attempt called off never does.
func TestClassify(t *testing.T) {
	const (
		upErr   = OutcomeUpstreamError
		destErr = OutcomeDestinationError
	)
	for _, tc := range []struct {
		name    string
		h       happened
		res     pool.Result
		outcome Outcome // the rest is not checked for a success
		status  int
		reply   byte
	}{
		{"tunnel open or destination's head", happened{what: wAnswered}, pool.Success, 0, 0, 0},
		{"dial refused", happened{what: wDialRefused}, pool.DialRefused, upErr, 502, socks5.ReplyGeneralFailure},
		{"dial timeout", happened{what: wDialTimeout}, pool.DialTimeout, upErr, 502, socks5.ReplyGeneralFailure},
		{"no or malformed answer in time", happened{what: wNoAnswer}, pool.HandshakeTimeout, upErr, 502, socks5.ReplyGeneralFailure},
		{"CONNECT 407", happened{what: wProxyAnswer, status: 407}, pool.AuthRejected, upErr, 502, socks5.ReplyGeneralFailure},
		{"CONNECT 403", happened{what: wProxyAnswer, status: 403}, pool.ProxyError, upErr, 502, socks5.ReplyGeneralFailure},
		{"CONNECT 500", happened{what: wProxyAnswer, status: 500}, pool.ProxyError, upErr, 502, socks5.ReplyGeneralFailure},
		{"CONNECT 503 without a destination error", happened{what: wProxyAnswer, status: 503}, pool.ProxyError, upErr, 502, socks5.ReplyGeneralFailure},
		{"Squid 403 access denied", happened{what: wProxyAnswer, status: 403, squid: "ERR_ACCESS_DENIED 0"}, pool.ProxyError, upErr, 502, socks5.ReplyGeneralFailure},
		{"Squid 503 for its own trouble", happened{what: wProxyAnswer, status: 503, squid: "ERR_SHUTTING_DOWN 0"}, pool.ProxyError, upErr, 502, socks5.ReplyGeneralFailure},
		{"CONNECT 502", happened{what: wProxyAnswer, status: 502}, pool.DestinationError, destErr, 502, socks5.ReplyHostUnreachable},
		{"CONNECT 504", happened{what: wProxyAnswer, status: 504}, pool.DestinationError, destErr, 504, socks5.ReplyTTLExpired},
		{"Squid 503 connect failed", happened{what: wProxyAnswer, status: 503, squid: "ERR_CONNECT_FAIL 111"}, pool.DestinationError, destErr, 502, socks5.ReplyConnectionRefused},
		{"Squid 503 DNS failed", happened{what: wProxyAnswer, status: 503, squid: "ERR_DNS_FAIL 0"}, pool.DestinationError, destErr, 502, socks5.ReplyHostUnreachable},
		{"Squid 504 read timeout", happened{what: wProxyAnswer, status: 504, squid: "ERR_READ_TIMEOUT 0"}, pool.DestinationError, destErr, 504, socks5.ReplyTTLExpired},
		{"Squid 503 read timeout", happened{what: wProxyAnswer, status: 503, squid: "ERR_READ_TIMEOUT 0"}, pool.DestinationError, destErr, 504, socks5.ReplyTTLExpired},
		{"Squid 502 invalid answer", happened{what: wProxyAnswer, status: 502, squid: "ERR_INVALID_RESP 0"}, pool.DestinationError, destErr, 502, socks5.ReplyHostUnreachable},
		{"SOCKS 0x01", happened{what: wSOCKSReply, reply: 0x01}, pool.ProxyError, upErr, 502, socks5.ReplyGeneralFailure},
		{"SOCKS 0x02", happened{what: wSOCKSReply, reply: 0x02}, pool.DestinationError, destErr, 502, 0x02},
		{"SOCKS 0x03", happened{what: wSOCKSReply, reply: 0x03}, pool.DestinationError, destErr, 502, 0x03},
		{"SOCKS 0x04", happened{what: wSOCKSReply, reply: 0x04}, pool.DestinationError, destErr, 502, 0x04},
		{"SOCKS 0x05", happened{what: wSOCKSReply, reply: 0x05}, pool.DestinationError, destErr, 502, 0x05},
		{"SOCKS 0x06", happened{what: wSOCKSReply, reply: 0x06}, pool.DestinationError, destErr, 504, 0x06},
		{"SOCKS 0x07", happened{what: wSOCKSReply, reply: 0x07}, pool.ProxyError, upErr, 502, socks5.ReplyGeneralFailure},
		{"SOCKS 0x08", happened{what: wSOCKSReply, reply: 0x08}, pool.ProxyError, upErr, 502, socks5.ReplyGeneralFailure},
		{"SOCKS unassigned 0x09", happened{what: wSOCKSReply, reply: 0x09}, pool.ProxyError, upErr, 502, socks5.ReplyGeneralFailure},
		{"SOCKS auth refused", happened{what: wSOCKSAuth}, pool.AuthRejected, upErr, 502, socks5.ReplyGeneralFailure},
		{"SOCKS address type refused", happened{what: wSOCKSAddress}, pool.DestinationError, destErr, 502, socks5.ReplyAddressNotSupported},
		{"destination TLS failed", happened{what: wTLS}, pool.DestinationError, destErr, 502, socks5.ReplyHostUnreachable},
		{"no head within response_timeout", happened{what: wResponseTimeout}, pool.DestinationError, destErr, 504, socks5.ReplyTTLExpired},
		{"silent while others answered", happened{what: wSilent}, pool.HandshakeTimeout, upErr, 504, socks5.ReplyTTLExpired},
		{"outrun by a fast hedge", happened{what: wOutrun}, pool.HandshakeTimeout, upErr, 502, socks5.ReplyGeneralFailure},
		{"called off: the other attempt answered", happened{what: wCalledOff}, pool.Canceled, upErr, 502, socks5.ReplyGeneralFailure},
		{"client left, body broke or stalled", happened{what: wClientGone}, pool.Canceled, OutcomeClientError, 400, socks5.ReplyGeneralFailure},
		{"kept connection closed under the request", happened{what: wStale}, pool.Canceled, upErr, 502, socks5.ReplyGeneralFailure},
		{"out of file descriptors here", happened{what: wLocal}, pool.Canceled, upErr, 503, socks5.ReplyGeneralFailure},
		{"destination closed the open tunnel", happened{what: wDestinationGone}, pool.DestinationError, destErr, 502, socks5.ReplyHostUnreachable},
		{"cut by retry_timeout within its own bound", happened{what: wBudget}, pool.Canceled, upErr, 502, socks5.ReplyGeneralFailure},
	} {
		res := classify(tc.h)
		if res != tc.res {
			t.Errorf("%s: classify %s, want %s", tc.name, res, tc.res)
		}
		if res == pool.Success {
			continue
		}
		a := answerFor(tc.h, res)
		if a.outcome != tc.outcome || a.status != tc.status || a.reply != tc.reply {
			t.Errorf("%s: client gets %s %d %#x, want %s %d %#x", tc.name, a.outcome, a.status, a.reply, tc.outcome, tc.status, tc.reply)
		}
		if a.text == "" {
			t.Errorf("%s: no text for %d", tc.name, a.status)
		}
	}
	// Every kind of happening has a row above.
	seen := map[what]bool{}
	for w := what(0); w < numWhat; w++ {
		seen[w] = false
	}
	for _, w := range []what{wAnswered, wDialRefused, wDialTimeout, wNoAnswer, wProxyAnswer, wSOCKSReply, wSOCKSAuth,
		wSOCKSAddress, wTLS, wResponseTimeout, wSilent, wOutrun, wCalledOff, wClientGone, wStale, wLocal, wDestinationGone, wBudget} {
		seen[w] = true
	}
	for w, ok := range seen {
		if !ok {
			t.Errorf("what %d has no row", w)
		}
	}
}

// TestAnswerLog: an upstream is silent when it answered nothing since a
// time while another upstream of the listener answered.
func TestAnswerLog(t *testing.T) {
	var a answerLog
	t0 := time.Now()
	if a.silent("a", t0) {
		t.Error("nobody answered: not silent")
	}
	a.note("a")
	if a.silent("a", t0) || a.silent("b", time.Now().Add(time.Second)) {
		t.Error("silent without another's answer")
	}
	if !a.silent("b", t0) {
		t.Error("b answered nothing while a answered: silent")
	}
}

// openConns counts an upstream's connections from proxyd still open.
func openConns(m *sync.Map) int {
	n := 0
	m.Range(func(any, any) bool { n++; return true })
	return n
}

// TestHedge: a plain GET whose first upstream says nothing is hedged through
// the next after hedge_delay; the hedge's answer is streamed to the client,
// the first attempt's connection is closed, and the first upstream is
// blamed (the hedge's head came within hedge_delay).
func TestHedge(t *testing.T) {
	checkLeaks(t)
	more := make(chan struct{})
	var hits atomic.Int64
	origin, _ := startOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		_, _ = io.WriteString(w, "first\n")
		w.(http.Flusher).Flush()
		select {
		case <-more:
		case <-r.Context().Done():
			return
		}
		_, _ = io.WriteString(w, "second\n")
	}))
	silent := newHTTPUpstream(t, "", "", nil)
	silent.mode.Store(int32(modeHang))
	good := newHTTPUpstream(t, "", "", nil)
	p := newFakePool(silent.upstream(1), good.upstream(2))
	tl := startListener(t, testConfig(func(c *Config) {
		c.AllowDestinations = loopbackAllowed
		c.HedgeDelay = 300 * time.Millisecond
	}), p)
	hc := tl.httpClient(t, "", "")
	start := time.Now()
	resp, err := hc.Get("http://" + origin + "/")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if d := time.Since(start); resp.StatusCode != 200 || d < 300*time.Millisecond {
		t.Fatalf("status %d after %s, want 200 after the hedge delay", resp.StatusCode, d)
	}
	br := bufio.NewReader(resp.Body)
	if line, err := br.ReadString('\n'); line != "first\n" {
		t.Fatalf("first line %q %v: the answer is not streamed", line, err)
	}
	waitFor(t, 5*time.Second, func() bool { return openConns(&silent.conns) == 0 }, "the first attempt's connection closed")
	close(more)
	if rest, _ := io.ReadAll(br); string(rest) != "second\n" {
		t.Errorf("rest %q", rest)
	}
	_ = resp.Body.Close()
	hc.Transport.(*http.Transport).CloseIdleConnections()
	p.waitBalanced(t)
	if r := p.Reports(); len(r) != 2 || r[0] != (report{silent.upstream(1).ID(), pool.HandshakeTimeout}) ||
		r[1] != (report{good.upstream(2).ID(), pool.Success}) {
		t.Errorf("reports %+v, want the silent one handshake_timeout, then ok", r)
	}
	if n := hits.Load(); n != 1 {
		t.Errorf("origin got %d requests, want 1", n)
	}
	tl.obs.mu.Lock()
	hedged := tl.obs.hedged
	tl.obs.mu.Unlock()
	if hedged != 1 {
		t.Errorf("hedged %d, want 1", hedged)
	}
}

// TestHedgeBlame: whose fault a hedged request is. A hedge cancelled
// because the first attempt answered is never blamed, and neither is a
// first attempt when the hedge's head took longer than hedge_delay.
func TestHedgeBlame(t *testing.T) {
	const hedge = 200 * time.Millisecond
	t.Run("first answers", func(t *testing.T) {
		checkLeaks(t)
		var hits atomic.Int64
		origin, _ := startOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			n := hits.Add(1)
			d := 600 * time.Millisecond // the first request; the hedge's would answer later
			if n > 1 {
				d = 1500 * time.Millisecond
			}
			select {
			case <-time.After(d):
			case <-r.Context().Done():
				return
			}
			_, _ = io.WriteString(w, "ok")
		}))
		a, b := newHTTPUpstream(t, "", "", nil), newHTTPUpstream(t, "", "", nil)
		if r := hedgedGet(t, origin, hedge, a.upstream(1), b.upstream(2)); len(r) != 2 || r[0] != (report{b.upstream(2).ID(), pool.Canceled}) ||
			r[1] != (report{a.upstream(1).ID(), pool.Success}) {
			t.Errorf("reports %+v, want the hedge canceled, then the first ok", r)
		}
		if n := hits.Load(); n != 2 {
			t.Errorf("origin got %d requests, want 2 (the first and the hedge)", n)
		}
	})
	t.Run("slow hedge", func(t *testing.T) {
		checkLeaks(t)
		origin, _ := startOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			select {
			case <-time.After(3 * hedge):
			case <-r.Context().Done():
				return
			}
			_, _ = io.WriteString(w, "ok")
		}))
		silent := newHTTPUpstream(t, "", "", nil)
		silent.mode.Store(int32(modeHang))
		good := newHTTPUpstream(t, "", "", nil)
		if r := hedgedGet(t, origin, hedge, silent.upstream(1), good.upstream(2)); len(r) != 2 || r[0] != (report{silent.upstream(1).ID(), pool.Canceled}) ||
			r[1] != (report{good.upstream(2).ID(), pool.Success}) {
			t.Errorf("reports %+v, want the first canceled (not blamed), then the hedge ok", r)
		}
	})
}

// hedgedGet sends one GET to origin through a listener over ups with
// hedge_delay hedge, requires the destination's "ok", and returns what the
// pool was told once every pick is released.
func hedgedGet(t *testing.T, origin string, hedge time.Duration, ups ...*pool.Upstream) []report {
	t.Helper()
	p := newFakePool(ups...)
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed; c.HedgeDelay = hedge }), p)
	hc := tl.httpClient(t, "", "")
	if code, body := getBody(t, hc, "http://"+origin+"/"); code != 200 || body != "ok" {
		t.Fatalf("%d %q, want the destination's ok", code, body)
	}
	hc.Transport.(*http.Transport).CloseIdleConnections()
	p.waitBalanced(t)
	return p.Reports()
}

// TestHedgeOnlyWhereAllowed: no hedge for a request with a body, a sticky
// key, a ppr upstream, or with hedge_delay "0s"; an Idempotency-Key (not
// X-Idempotency-Key) makes a request without body hedgeable.
func TestHedgeOnlyWhereAllowed(t *testing.T) {
	checkLeaks(t)
	origin, _ := startOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		select {
		case <-time.After(400 * time.Millisecond):
		case <-r.Context().Done():
			return
		}
		_, _ = io.WriteString(w, "ok")
	}))
	a, b := newHTTPUpstream(t, "", "", nil), newHTTPUpstream(t, "", "", nil)
	sa := newSOCKSUpstream(t, "", "", nil)
	ppr := *a.upstream(3)
	ppr.Kind = pool.PPR
	pprSecond := *b.upstream(4) // a hedge's own pick is checked too
	pprSecond.Kind = pool.PPR
	for _, tc := range []struct {
		name   string
		hedge  time.Duration
		ups    []*pool.Upstream
		user   string
		method string
		body   string
		header string
		want   int
	}{
		{"GET", 100 * time.Millisecond, []*pool.Upstream{a.upstream(1), b.upstream(2)}, "", "GET", "", "", 1},
		{"POST with body", 100 * time.Millisecond, []*pool.Upstream{a.upstream(1), b.upstream(2)}, "", "POST", "x", "", 0},
		{"POST without body", 100 * time.Millisecond, []*pool.Upstream{a.upstream(1), b.upstream(2)}, "", "POST", "", "", 0},
		{"POST with Idempotency-Key", 100 * time.Millisecond, []*pool.Upstream{a.upstream(1), b.upstream(2)}, "", "POST", "", "Idempotency-Key", 1},
		// Only the header DESIGN names: net/http also replays on the older
		// X-Idempotency-Key, but a hedge is a deliberate second send.
		{"POST with X-Idempotency-Key", 100 * time.Millisecond, []*pool.Upstream{a.upstream(1), b.upstream(2)}, "", "POST", "", "X-Idempotency-Key", 0},
		{"sticky", 100 * time.Millisecond, []*pool.Upstream{a.upstream(1), b.upstream(2)}, "session-k1", "GET", "", "", 0},
		{"ppr", 100 * time.Millisecond, []*pool.Upstream{&ppr, b.upstream(2)}, "", "GET", "", "", 0},
		{"ppr as the hedge's pick", 100 * time.Millisecond, []*pool.Upstream{a.upstream(1), &pprSecond}, "", "GET", "", "", 0},
		{"GET with a body", 100 * time.Millisecond, []*pool.Upstream{a.upstream(1), b.upstream(2)}, "", "GET", "x", "", 0},
		{"through a SOCKS5 upstream", 100 * time.Millisecond, []*pool.Upstream{sa.upstream(5), b.upstream(2)}, "", "GET", "", "", 0},
		{"off", 0, []*pool.Upstream{a.upstream(1), b.upstream(2)}, "", "GET", "", "", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newFakePool(tc.ups...)
			tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed; c.HedgeDelay = tc.hedge }), p)
			hc := tl.httpClient(t, tc.user, "x")
			var body io.Reader
			if tc.body != "" {
				body = strings.NewReader(tc.body)
			}
			req, _ := http.NewRequest(tc.method, "http://"+origin+"/", body)
			if tc.header != "" {
				req.Header.Set(tc.header, "k-1")
			}
			resp, err := hc.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Errorf("status %d", resp.StatusCode)
			}
			hc.Transport.(*http.Transport).CloseIdleConnections()
			p.waitBalanced(t)
			tl.obs.mu.Lock()
			hedged := tl.obs.hedged
			tl.obs.mu.Unlock()
			if hedged != tc.want {
				t.Errorf("hedged %d, want %d", hedged, tc.want)
			}
			for _, f := range failures(p) {
				// A pick given back unused (the hedge's ppr pick) is
				// reported without verdict; anything else is a failure.
				if tc.want == 0 && (f.res != pool.Canceled || f.id != pprSecond.ID()) {
					t.Errorf("failure %v", f)
				}
			}
		})
	}
}

// delayedRelay forwards connections to addr, each after a delay: an
// upstream that answers late.
func delayedRelay(t *testing.T, addr string, delay time.Duration) string {
	return startTCP(t, "tcp", "127.0.0.1:0", func(c net.Conn) {
		tm := time.NewTimer(delay)
		defer tm.Stop()
		<-tm.C
		up, err := net.Dial("tcp", addr)
		if err != nil {
			return
		}
		defer up.Close()
		done := make(chan struct{})
		go func() {
			_, _ = plainCopy(up, c)
			if cw, ok := up.(closeWriter); ok {
				_ = cw.CloseWrite()
			}
			close(done)
		}()
		_, _ = plainCopy(c, up)
		if cw, ok := c.(closeWriter); ok {
			_ = cw.CloseWrite()
		}
		<-done
	})
}

// TestTimeContract runs the end-to-end checks of the time contract, which
// take as long as the contract's defaults (a 20 s destination, a 10 s
// handshake timeout); they run at the same time (not t.Parallel, which
// -parallel would limit to the number of cores).
func TestTimeContract(t *testing.T) {
	if testing.Short() {
		t.Skip("takes 20 s")
	}
	checkLeaks(t)
	var wg sync.WaitGroup
	defer wg.Wait()
	run := func(name string, f func(t *testing.T)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t.Run(name, f)
		}()
	}
	longClient := func(tl *testListener) *http.Client {
		c := tl.httpClient(t, "", "")
		c.Timeout = time.Minute
		return c
	}
	slowOrigin := func(t *testing.T, d time.Duration) (string, *atomic.Int64) {
		var hits atomic.Int64
		origin, _ := startOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			hits.Add(1)
			tm := time.NewTimer(d)
			defer tm.Stop()
			select {
			case <-tm.C:
			case <-r.Context().Done():
				return
			}
			_, _ = io.WriteString(w, "slow but fine")
		}))
		return origin, &hits
	}
	noFaults := func(t *testing.T, p *fakePool) {
		t.Helper()
		for _, r := range p.Reports() {
			if r.res.UpstreamFault() {
				t.Errorf("upstream blamed: %+v", r)
			}
		}
	}

	// A destination that takes 20 s: the request succeeds as it would
	// without proxyd, reaches the destination at most twice, and blames
	// nobody.
	run("slow destination", func(t *testing.T) {
		origin, hits := slowOrigin(t, 20*time.Second)
		ups := []*pool.Upstream{newHTTPUpstream(t, "", "", nil).upstream(1), newHTTPUpstream(t, "", "", nil).upstream(2), newHTTPUpstream(t, "", "", nil).upstream(3)}
		p := newFakePool(ups...)
		tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
		hc := longClient(tl)
		start := time.Now()
		code, body := getBody(t, hc, "http://"+origin+"/")
		if code != 200 || body != "slow but fine" {
			t.Errorf("%d %q after %s", code, body, time.Since(start))
		}
		if n := hits.Load(); n > 2 {
			t.Errorf("destination received the request %d times, want at most 2", n)
		}
		hc.Transport.(*http.Transport).CloseIdleConnections()
		p.waitBalanced(t)
		noFaults(t, p)
	})

	// Nothing within response_timeout: 504 in time, nobody blamed,
	// destination_error counted.
	run("response timeout", func(t *testing.T) {
		origin, _ := slowOrigin(t, 20*time.Second)
		ups := []*pool.Upstream{newHTTPUpstream(t, "", "", nil).upstream(1), newHTTPUpstream(t, "", "", nil).upstream(2)}
		p := newFakePool(ups...)
		tl := startListener(t, testConfig(func(c *Config) {
			c.AllowDestinations = loopbackAllowed
			c.ResponseTimeout = 3 * time.Second
		}), p)
		hc := longClient(tl)
		start := time.Now()
		code, body := getBody(t, hc, "http://"+origin+"/")
		d := time.Since(start)
		if code != http.StatusGatewayTimeout || body != textTimeout || d < 3*time.Second || d > 5*time.Second {
			t.Errorf("%d %q after %s, want 504 after 3s", code, body, d)
		}
		hc.Transport.(*http.Transport).CloseIdleConnections()
		p.waitBalanced(t)
		noFaults(t, p)
		waitFor(t, 5*time.Second, func() bool { return len(tl.obs.Closeds()) == 1 }, "closed")
		if o := tl.obs.Closeds()[0].o; o != OutcomeDestinationError {
			t.Errorf("outcome %s, want destination_error", o)
		}
	})

	// One of three upstreams accepts and never answers: every plain GET
	// succeeds within 8 s, and every SOCKS5 tunnel opens.
	run("hung upstream", func(t *testing.T) {
		origin, _ := startOrigin(t, http.HandlerFunc(echoHandler))
		echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
		hung := newHTTPUpstream(t, "", "", nil)
		hung.mode.Store(int32(modeHang))
		ups := []*pool.Upstream{hung.upstream(1), newHTTPUpstream(t, "", "", nil).upstream(2), newHTTPUpstream(t, "", "", nil).upstream(3)}
		p := newFakePool(ups...)
		tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
		hc := longClient(tl)
		get := func(i int) error {
			start := time.Now()
			req, _ := http.NewRequest("GET", fmt.Sprintf("http://%s/r%d", origin, i), nil)
			resp, err := hc.Do(req)
			if err != nil {
				return err
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			if d := time.Since(start); resp.StatusCode != 200 || d > 8*time.Second {
				return fmt.Errorf("GET %d: %d after %s", i, resp.StatusCode, d)
			}
			return nil
		}
		for i := range 12 {
			if err := get(i); err != nil {
				t.Error(err)
			}
		}
		errs := make(chan error, 12)
		for i := range 6 {
			go func() { errs <- get(12 + i) }()
		}
		sp := newFakePool(ups...)
		stl := startListener(t, testConfig(func(c *Config) { c.Protocol = "socks5"; c.AllowDestinations = loopbackAllowed }), sp)
		for i := range 6 {
			go func() {
				c, err := socksDial(stl.addr, echo)
				if err != nil {
					errs <- fmt.Errorf("SOCKS5 tunnel %d: %w", i, err)
					return
				}
				defer c.Close()
				msg := fmt.Sprintf("tunnel %d", i)
				_ = c.SetDeadline(time.Now().Add(10 * time.Second))
				buf := make([]byte, len(msg))
				if _, err := io.WriteString(c, msg); err != nil {
					errs <- err
					return
				}
				if _, err := io.ReadFull(c, buf); err != nil || string(buf) != msg {
					errs <- fmt.Errorf("SOCKS5 tunnel %d echo %q %v", i, buf, err)
					return
				}
				errs <- nil
			}()
		}
		for range 12 {
			if err := <-errs; err != nil {
				t.Error(err)
			}
		}
		hc.Transport.(*http.Transport).CloseIdleConnections()
		p.waitBalanced(t)
		sp.waitBalanced(t)
		for _, r := range append(p.Reports(), sp.Reports()...) {
			if r.res.UpstreamFault() && r.id != hung.upstream(1).ID() {
				t.Errorf("a working upstream blamed: %+v", r)
			}
		}
	})

	// A tunnel that opens after 11 s (a silent upstream's handshake
	// timeout, then a slow one) still gets its answer: the client's header
	// deadline ended when its request was read.
	for _, proto := range []string{ProtocolSOCKS5, ProtocolHTTP} {
		run("late tunnel "+proto, func(t *testing.T) {
			echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
			hung := newHTTPUpstream(t, "", "", nil)
			hung.mode.Store(int32(modeHang))
			slow := &pool.Upstream{Service: 2, Protocol: pool.HTTP, Address: delayedRelay(t, newHTTPUpstream(t, "", "", nil).ln.Addr().String(), time.Second)}
			p := newFakePool(hung.upstream(1), slow)
			tl := startListener(t, testConfig(func(c *Config) { c.Protocol = proto; c.AllowDestinations = loopbackAllowed }), p)
			start := time.Now()
			var c net.Conn
			var r io.Reader
			if proto == ProtocolSOCKS5 {
				sc, err := socksDial(tl.addr, echo)
				if err != nil {
					t.Fatalf("SOCKS5 after %s: %v", time.Since(start), err)
				}
				c, r = sc, sc
			} else {
				hc, br, resp := rawConnect(t, tl.addr, echo, "")
				if resp.StatusCode != 200 {
					t.Fatalf("CONNECT: %d after %s", resp.StatusCode, time.Since(start))
				}
				c, r = hc, br
			}
			defer c.Close()
			if d := time.Since(start); d < 11*time.Second {
				t.Errorf("opened after %s; the test wants 11 s or more", d)
			}
			bigTransfer(t, c, r, 10)
			p.waitBalanced(t)
		})
	}
}

// socksDial opens a SOCKS5 tunnel to dest through proxyAddr, waiting for
// the reply as long as it takes (up to a minute).
func socksDial(proxyAddr, dest string) (net.Conn, error) {
	c, err := net.Dial("tcp", proxyAddr)
	if err != nil {
		return nil, err
	}
	_ = c.SetDeadline(time.Now().Add(time.Minute))
	host, port, err := splitHostPort(dest, 0)
	if err != nil {
		_ = c.Close()
		return nil, err
	}
	if _, err := socks5.ClientHandshake(c, socks5.Addr{Host: host, Port: port}, "", ""); err != nil {
		_ = c.Close()
		return nil, err
	}
	_ = c.SetDeadline(time.Time{})
	return c, nil
}

// TestClientUploadStall: a client that stops sending its request body is
// bounded by idle_timeout and is the client's failure: no upstream blamed,
// client_error counted, and no 504 (the response clock does not run while
// the client is waited for).
func TestClientUploadStall(t *testing.T) {
	checkLeaks(t)
	su := startScripted(t, func(_ int64, req *http.Request, _ net.Conn) (string, bool) {
		if _, err := io.Copy(io.Discard, req.Body); err != nil {
			return "", true
		}
		return okAnswer("fine"), false
	})
	p := newFakePool(su.upstream())
	tl := startListener(t, testConfig(func(c *Config) {
		c.AllowDestinations = loopbackAllowed
		c.IdleTimeout = 500 * time.Millisecond
		c.ResponseTimeout = 300 * time.Millisecond
	}), p)
	c, err := net.Dial("tcp", tl.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	start := time.Now()
	fmt.Fprintf(c, "POST http://example.test/upload HTTP/1.1\r\nHost: example.test\r\nContent-Length: 100\r\n\r\n0123456789")
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	d := time.Since(start)
	if err == nil {
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Errorf("stalled upload: %d, want 400", resp.StatusCode)
		}
	}
	if d < 500*time.Millisecond || d > 5*time.Second {
		t.Errorf("stalled upload ended after %s, want about idle_timeout (500ms)", d)
	}
	_ = c.Close()
	tl.wantClientLeft(t, p)
}

// TestSilentUpstreamBlamed: a request that cannot be hedged (it has a body)
// through an upstream that answers nothing within response_timeout, while
// another upstream of the listener answers other requests, gets 504 and
// blames its upstream; without such answers elsewhere nobody is blamed.
func TestSilentUpstreamBlamed(t *testing.T) {
	checkLeaks(t)
	origin, _ := startOrigin(t, http.HandlerFunc(echoHandler))
	for _, others := range []bool{true, false} {
		t.Run(fmt.Sprint("others answer=", others), func(t *testing.T) {
			hung := newHTTPUpstream(t, "", "", nil)
			hung.mode.Store(int32(modeHang))
			good := newHTTPUpstream(t, "", "", nil)
			p := newFakePool(hung.upstream(1), good.upstream(2))
			tl := startListener(t, testConfig(func(c *Config) {
				c.AllowDestinations = loopbackAllowed
				c.ResponseTimeout = time.Second
			}), p)
			hc := tl.httpClient(t, "", "")
			done := statusAsync(func() (*http.Response, error) {
				return hc.Post("http://"+origin+"/upload", "text/plain", strings.NewReader("payload"))
			})
			if others {
				// Once the POST is on the silent upstream, a GET goes
				// through the other one and is answered.
				waitFor(t, 5*time.Second, func() bool { return len(p.Picks()) == 1 }, "the POST picked")
				req, _ := http.NewRequest("GET", "http://"+origin+"/", nil)
				getEcho(t, tl.httpClient(t, "", ""), req)
			}
			if code := <-done; code != http.StatusGatewayTimeout {
				t.Errorf("POST: %d, want 504", code)
			}
			hc.Transport.(*http.Transport).CloseIdleConnections()
			p.waitBalanced(t)
			want := pool.DestinationError
			if others {
				want = pool.HandshakeTimeout
			}
			var got []report
			for _, r := range p.Reports() {
				if r.id == hung.upstream(1).ID() {
					got = append(got, r)
				}
			}
			if len(got) != 1 || got[0].res != want {
				t.Errorf("silent upstream's reports %+v, want %s", got, want)
			}
		})
	}
}

// statusAsync sends a request in a goroutine and delivers its answer's
// status code (0: no answer).
func statusAsync(send func() (*http.Response, error)) <-chan int {
	done := make(chan int, 1)
	go func() {
		resp, err := send()
		if err != nil {
			done <- 0
			return
		}
		_ = resp.Body.Close()
		done <- resp.StatusCode
	}()
	return done
}

// TestHedgeGatewayAnswerDoesNotWin: a 502 from the hedge's HTTP upstream
// may be that upstream's own failure, so it does not win the race while the
// first attempt may still bring the destination's answer, and it blames
// nobody; the destination's answer through the first upstream wins.
func TestHedgeGatewayAnswerDoesNotWin(t *testing.T) {
	checkLeaks(t)
	const hedge = 200 * time.Millisecond
	origin, _ := startOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-time.After(3 * hedge):
		case <-r.Context().Done():
			return
		}
		_, _ = io.WriteString(w, "ok")
	}))
	first := newHTTPUpstream(t, "", "", nil)
	failing := newHTTPUpstream(t, "", "", nil)
	failing.mode.Store(int32(mode502)) // answers 502 itself, at once
	if r := hedgedGet(t, origin, hedge, first.upstream(1), failing.upstream(2)); len(r) != 2 || r[0] != (report{failing.upstream(2).ID(), pool.Canceled}) ||
		r[1] != (report{first.upstream(1).ID(), pool.Success}) {
		t.Errorf("reports %+v, want the 502 hedge without verdict, then the first ok", r)
	}
}

// TestSlowDestinationThroughSOCKS5: through a SOCKS5 upstream the reply to
// the connect proved the upstream, so a plain request whose destination
// does not answer within response_timeout blames nobody, even while other
// upstreams of the listener answer other requests.
func TestSlowDestinationThroughSOCKS5(t *testing.T) {
	checkLeaks(t)
	origin, _ := startOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			select {
			case <-time.After(3 * time.Second):
			case <-r.Context().Done():
				return
			}
		}
		echoHandler(w, r)
	}))
	socks := newSOCKSUpstream(t, "", "", nil)
	good := newHTTPUpstream(t, "", "", nil)
	p := newFakePool(socks.upstream(1), good.upstream(2))
	tl := startListener(t, testConfig(func(c *Config) {
		c.AllowDestinations = loopbackAllowed
		c.ResponseTimeout = time.Second
	}), p)
	hc := tl.httpClient(t, "", "")
	done := statusAsync(func() (*http.Response, error) { return hc.Get("http://" + origin + "/slow") })
	waitFor(t, 5*time.Second, func() bool { return len(p.Picks()) == 1 }, "the slow GET picked")
	req, _ := http.NewRequest("GET", "http://"+origin+"/", nil)
	getEcho(t, tl.httpClient(t, "", ""), req) // another upstream answers meanwhile
	if code := <-done; code != http.StatusGatewayTimeout {
		t.Errorf("slow GET: %d, want 504", code)
	}
	hc.Transport.(*http.Transport).CloseIdleConnections()
	p.waitBalanced(t)
	for _, r := range p.Reports() {
		if r.id == socks.upstream(1).ID() && r.res != pool.DestinationError {
			t.Errorf("the SOCKS5 upstream was reported %s, want destination_error", r.res)
		}
	}
}

// TestDestinationClosesThroughSOCKS5: a destination that reads a plain
// request and closes without answering, through a SOCKS5 upstream whose
// tunnel was open, is the destination's failure: no upstream is blamed and
// the request is not sent again.
func TestDestinationClosesThroughSOCKS5(t *testing.T) {
	checkLeaks(t)
	var hits atomic.Int64
	dest := startTCP(t, "tcp", "127.0.0.1:0", func(c net.Conn) {
		hits.Add(1)
		_, _ = http.ReadRequest(bufio.NewReader(c)) // read it, then close without a word
	})
	a, b := newSOCKSUpstream(t, "", "", nil), newSOCKSUpstream(t, "", "", nil)
	p := newFakePool(a.upstream(1), b.upstream(2))
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
	hc := tl.httpClient(t, "", "")
	resp, err := hc.Get("http://" + dest + "/")
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusBadGateway {
		t.Errorf("status %d, want 502", resp.StatusCode)
	}
	hc.Transport.(*http.Transport).CloseIdleConnections()
	p.waitBalanced(t)
	if r := p.Reports(); len(r) != 1 || r[0] != (report{a.upstream(1).ID(), pool.DestinationError}) {
		t.Errorf("reports %+v, want one destination_error", r)
	}
	if n := hits.Load(); n != 1 {
		t.Errorf("destination got %d requests, want 1", n)
	}
}

// TestSOCKSUpstreamPipelining: a SOCKS5 upstream with credentials gets the
// greeting, the credentials and the request in one write (the upstream's
// first read finds all 18 bytes). One that reads each message with one
// read loses what came behind the greeting and waits: after
// handshake_timeout the same attempt asks it again one message at a time
// (its first read finds the 4-byte greeting alone), the tunnel opens, the
// upstream is not blamed, the latency reported is the second try's, and
// later tunnels through it, also after a reload, are not pipelined (see
// TestDanteUpstream for an upstream that refuses the one method a pipelined
// greeting offers). Without credentials nothing is pipelined.
func TestSOCKSUpstreamPipelining(t *testing.T) {
	const handshake = time.Second
	const pipelined, greeting, greetingNoAuth = 3 + 5 + 10, 4, 3
	tunnel := func(t *testing.T, tl *testListener, echo string) time.Duration {
		t.Helper()
		start := time.Now()
		c, br, resp := rawConnect(t, tl.addr, echo, "")
		defer c.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("CONNECT: %s", resp.Status)
		}
		took := time.Since(start)
		_, _ = io.WriteString(c, "ping")
		b := make([]byte, 4)
		if _, err := io.ReadFull(br, b); err != nil || string(b) != "ping" {
			t.Fatalf("echo %q, %v", b, err)
		}
		return took
	}
	// config is the listener's, with retry_timeout when retry is not 0.
	config := func(retry time.Duration) Config {
		return testConfig(func(c *Config) {
			c.AllowDestinations = loopbackAllowed
			c.HandshakeTimeout = handshake
			if retry != 0 {
				c.RetryTimeout = retry
			}
		})
	}
	type setting struct {
		user, pass string // the upstream's
		mode       upstreamMode
		retry      time.Duration // retry_timeout, 0: the default
	}
	setup := func(t *testing.T, s setting) (*socksUpstream, *pool.Upstream, *fakePool, *testListener, string) {
		checkLeaks(t)
		echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
		up := newSOCKSUpstream(t, s.user, s.pass, nil)
		up.mode.Store(int32(s.mode))
		pu := up.upstream(1)
		pu.Username, pu.Password = "u", "p" // what proxyd sends, taken or not
		p := newFakePool(pu)
		tl := startListener(t, config(s.retry), p)
		return up, pu, p, tl, echo
	}
	// noTunnel checks that a tunnel through tl does not open.
	noTunnel := func(t *testing.T, tl *testListener, echo, why string) {
		t.Helper()
		c, _, resp := rawConnect(t, tl.addr, echo, "")
		c.Close()
		if resp.StatusCode == http.StatusOK {
			t.Fatal("the tunnel opened " + why)
		}
	}
	wantSuccesses := func(t *testing.T, p *fakePool, pu *pool.Upstream, n int) {
		t.Helper()
		p.waitBalanced(t)
		r := p.Reports()
		if len(r) != n {
			t.Fatalf("reports %+v, want %d successes", r, n)
		}
		for _, x := range r {
			if x != (report{pu.ID(), pool.Success}) {
				t.Fatalf("reports %+v, want %d successes", r, n)
			}
		}
		for _, d := range p.Tooks() {
			if d >= handshake {
				t.Errorf("reported durations %v: one holds the failed pipelined try", p.Tooks())
			}
		}
	}

	t.Run("upstream keeps what came early", func(t *testing.T) {
		up, pu, p, tl, echo := setup(t, setting{user: "u", pass: "p"})
		tunnel(t, tl, echo)
		tunnel(t, tl, echo)
		if got := up.Firsts(); !slices.Equal(got, []int{pipelined, pipelined}) {
			t.Errorf("first reads %v, want the whole handshake in each", got)
		}
		wantSuccesses(t, p, pu, 2)
	})

	t.Run("upstream drops what came early", func(t *testing.T) {
		up, pu, p, tl, echo := setup(t, setting{user: "u", pass: "p", mode: modeReadPerMessage})
		if took := tunnel(t, tl, echo); took < handshake {
			t.Errorf("first tunnel opened after %s, before handshake_timeout: was it pipelined?", took)
		}
		if got := up.Firsts(); !slices.Equal(got, []int{pipelined, greeting}) {
			t.Fatalf("first reads %v, want a pipelined try, then the greeting alone", got)
		}
		tunnel(t, tl, echo)
		if got := up.Firsts(); !slices.Equal(got, []int{pipelined, greeting, greeting}) {
			t.Errorf("first reads %v, want the later tunnel one message at a time", got)
		}
		wantSuccesses(t, p, pu, 2)

		// A reload's successor knows it too.
		next := startSuccessor(t, config(0), p, tl.Listener)
		tunnel(t, next, echo)
		if got := up.Firsts(); !slices.Equal(got, []int{pipelined, greeting, greeting, greeting}) {
			t.Errorf("first reads %v, want the successor's tunnel one message at a time", got)
		}
	})

	t.Run("retry_timeout ends before handshake_timeout", func(t *testing.T) {
		up, pu, p, tl, echo := setup(t, setting{user: "u", pass: "p", mode: modeReadPerMessage, retry: handshake / 3})
		noTunnel(t, tl, echo, "(was it pipelined?)")
		p.waitBalanced(t)
		if r := p.Reports(); len(r) != 1 || r[0] != (report{pu.ID(), pool.Canceled}) {
			t.Fatalf("reports %+v, want one without verdict (the budget ended first)", r)
		}
		// Learned all the same: the next tunnel is not pipelined, and opens.
		tunnel(t, tl, echo)
		if got := up.Firsts(); !slices.Equal(got, []int{pipelined, greeting}) {
			t.Errorf("first reads %v, want a cut pipelined try, then the greeting alone", got)
		}
	})

	t.Run("silent where pipelining worked before", func(t *testing.T) {
		// A silence after a pipelined handshake worked with the upstream
		// is the upstream's: judged as any, not tried again.
		up, pu, p, tl, echo := setup(t, setting{user: "u", pass: "p"})
		tunnel(t, tl, echo)
		up.mode.Store(int32(modeReadPerMessage))
		before := up.accepted.Load()
		noTunnel(t, tl, echo, "through a silent upstream")
		if n := up.accepted.Load() - before; n != 1 {
			t.Errorf("the failed tunnel made %d connections to the upstream, want 1 (no retry)", n)
		}
		p.waitBalanced(t)
		if r := p.Reports(); len(r) != 2 || r[1] != (report{pu.ID(), pool.HandshakeTimeout}) {
			t.Fatalf("reports %+v, want a success, then handshake_timeout", r)
		}
		if got := up.Firsts(); !slices.Equal(got, []int{pipelined, pipelined}) {
			t.Errorf("first reads %v, want two pipelined handshakes and no retry", got)
		}
	})

	t.Run("closes at once where pipelining worked before", func(t *testing.T) {
		// A quick failure that may be the pipeline's is tried again one
		// message at a time even where pipelining worked, and the upstream
		// keeps getting one message at a time.
		up, pu, p, tl, echo := setup(t, setting{user: "u", pass: "p"})
		tunnel(t, tl, echo)
		up.mode.Store(int32(modeCloseAtOnce))
		before := up.accepted.Load()
		noTunnel(t, tl, echo, "through an upstream that closes")
		if n := up.accepted.Load() - before; n != 2 {
			t.Errorf("the failed tunnel made %d connections to the upstream, want 2 (pipelined, then one message at a time)", n)
		}
		if pipeline, _ := tl.dialer.pipelining.lookup(pu.Address); pipeline {
			t.Error("the upstream still gets pipelined handshakes")
		}
		up.mode.Store(int32(modeOK))
		tunnel(t, tl, echo)
		if got := up.Firsts(); !slices.Equal(got, []int{pipelined, greeting}) {
			t.Errorf("first reads %v, want a pipelined tunnel, then one message at a time", got)
		}
		p.waitBalanced(t)
		if r := p.Reports(); len(r) != 3 || r[1] != (report{pu.ID(), pool.HandshakeTimeout}) {
			t.Errorf("reports %+v, want the failure judged on the try one message at a time", r)
		}
	})

	t.Run("listener closes during a pipelined try", func(t *testing.T) {
		// A try cut by proxyd itself teaches nothing: the successor's
		// next tunnel is pipelined again.
		up, pu, p, tl, echo := setup(t, setting{user: "u", pass: "p", mode: modeReadPerMessage})
		c, _ := dialRaw(t, tl.addr)
		defer c.Close()
		fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", echo, echo)
		waitFor(t, 5*time.Second, func() bool { return len(up.Firsts()) == 1 }, "the pipelined try reached the upstream")
		_ = tl.Close()
		p.waitBalanced(t)
		if r := p.Reports(); len(r) != 1 || r[0] != (report{pu.ID(), pool.Canceled}) {
			t.Fatalf("reports %+v, want one without verdict", r)
		}
		next := startSuccessor(t, config(0), p, tl.Listener)
		tunnel(t, next, echo)
		if got := up.Firsts(); !slices.Equal(got, []int{pipelined, pipelined, greeting}) {
			t.Errorf("first reads %v, want the next tunnel pipelined, then one message at a time", got)
		}
	})

	t.Run("no credentials", func(t *testing.T) {
		up, pu, p, tl, echo := setup(t, setting{})
		pu.Username, pu.Password = "", ""
		tunnel(t, tl, echo)
		if got := up.Firsts(); !slices.Equal(got, []int{greetingNoAuth}) {
			t.Errorf("first reads %v, want the greeting alone", got)
		}
		wantSuccesses(t, p, pu, 1)
	})
}
