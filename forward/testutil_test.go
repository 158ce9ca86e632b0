package forward

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/proxyd/proxyd/forward/socks5"
	"github.com/proxyd/proxyd/pool"
)

// ---- leak checks ----

// checkLeaks records goroutine and fd counts now and, at cleanup (after
// every cleanup registered later), waits for them to return to that baseline.
func checkLeaks(t *testing.T) {
	t.Helper()
	// Start the network poller first: it keeps its own fds for good.
	if ln, err := net.Listen("tcp", "127.0.0.1:0"); err == nil {
		_ = ln.Close()
	}
	g0, f0 := runtime.NumGoroutine(), countFDs(t)
	t.Cleanup(func() {
		deadline := time.Now().Add(5 * time.Second)
		var g, f int
		for {
			// The runtime caches splice pipes in a sync.Pool and closes
			// them from finalizers: collect them before counting fds.
			runtime.GC()
			g, f = runtime.NumGoroutine(), countFDs(t)
			if g <= g0 && f <= f0 {
				return
			}
			if time.Now().After(deadline) {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		buf := make([]byte, 1<<20)
		n := runtime.Stack(buf, true)
		t.Errorf("leak: goroutines %d (baseline %d), fds %d (baseline %d)\n%s", g, g0, f, f0, buf[:n])
	})
}

// ---- fake pool ----

type report struct {
	id  string
	res pool.Result
}

// fakePool hands out its upstreams round-robin, skipping avoided ones, and
// records every Report and Release; it counts the picks of each listener
// and key that are not released yet, so that a Release with another
// Request than its Pick's shows.
type fakePool struct {
	PickFunc func(ctx context.Context, req pool.Request) (*pool.Upstream, error)

	mu       sync.Mutex
	ups      []*pool.Upstream
	next     int
	picks    []pool.Request
	reports  []report
	tooks    []time.Duration // the durations reported, in the order of reports
	released int
	picked   int
	open     map[[2]string]int // listener and key → picks not released
}

func newFakePool(ups ...*pool.Upstream) *fakePool { return &fakePool{ups: ups} }

func (p *fakePool) Pick(ctx context.Context, req pool.Request) (*pool.Upstream, error) {
	if p.PickFunc != nil {
		u, err := p.PickFunc(ctx, req)
		if err == nil {
			p.mu.Lock()
			p.picked++
			p.picks = append(p.picks, req)
			p.hold(req)
			p.mu.Unlock()
		}
		return u, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for range p.ups {
		u := p.ups[p.next%len(p.ups)]
		p.next++
		avoided := false
		for _, id := range req.Avoid {
			avoided = avoided || id == u.ID()
		}
		if !avoided {
			p.picked++
			req.Avoid = append([]string(nil), req.Avoid...)
			p.picks = append(p.picks, req)
			p.hold(req)
			return u, nil
		}
	}
	return nil, errors.New("no usable upstream")
}

func (p *fakePool) Report(u *pool.Upstream, r pool.Result, took time.Duration) {
	p.mu.Lock()
	p.reports = append(p.reports, report{u.ID(), r})
	p.tooks = append(p.tooks, took)
	p.mu.Unlock()
}

func (p *fakePool) Tooks() []time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]time.Duration(nil), p.tooks...)
}

func (p *fakePool) hold(req pool.Request) {
	if p.open == nil {
		p.open = make(map[[2]string]int)
	}
	p.open[[2]string{req.Listener, req.Key}]++
}

func (p *fakePool) Release(_ *pool.Upstream, req pool.Request) {
	p.mu.Lock()
	p.released++
	k := [2]string{req.Listener, req.Key}
	if p.open[k]--; p.open[k] == 0 {
		delete(p.open, k)
	}
	p.mu.Unlock()
}

func (p *fakePool) Reports() []report {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]report(nil), p.reports...)
}

func (p *fakePool) Picks() []pool.Request {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]pool.Request(nil), p.picks...)
}

// balanced waits until every pick was reported and released.
func (p *fakePool) waitBalanced(t *testing.T) {
	t.Helper()
	waitFor(t, 5*time.Second, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.picked == p.released && len(p.reports) == p.picked && len(p.open) == 0
	}, "pool picks/reports/releases balanced, each release with its pick's listener and key")
}

func waitFor(t testing.TB, d time.Duration, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// ---- observer ----

type closedRec struct {
	o        Outcome
	up, down int64
	retries  int
}

type testObserver struct {
	mu       sync.Mutex
	opened   int
	closed   []closedRec
	dialed   int
	hedged   int
	requests []Outcome
	// onClosed (under mu) runs in each Closed call.
	onClosed func()
}

func (o *testObserver) Opened() { o.mu.Lock(); o.opened++; o.mu.Unlock() }
func (o *testObserver) Closed(oc Outcome, up, down int64, retries int) {
	o.mu.Lock()
	o.closed = append(o.closed, closedRec{oc, up, down, retries})
	f := o.onClosed
	o.mu.Unlock()
	if f != nil {
		f()
	}
}
func (o *testObserver) Dialed(pool.Protocol, time.Duration) { o.mu.Lock(); o.dialed++; o.mu.Unlock() }
func (o *testObserver) Hedged()                             { o.mu.Lock(); o.hedged++; o.mu.Unlock() }
func (o *testObserver) Requested(oc Outcome) {
	o.mu.Lock()
	o.requests = append(o.requests, oc)
	o.mu.Unlock()
}

func (o *testObserver) Requests() []Outcome {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]Outcome(nil), o.requests...)
}

func (o *testObserver) Closeds() []closedRec {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]closedRec(nil), o.closed...)
}

// ---- resolver shared by the test upstreams ----

// names maps host names only the test upstreams can resolve.
type names map[string]string

func (n names) dial(ctx context.Context, addr string) (net.Conn, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	if ip, ok := n[host]; ok {
		addr = net.JoinHostPort(ip, port)
	} else if _, err := netip.ParseAddr(host); err != nil {
		return nil, fmt.Errorf("test upstream cannot resolve %q", host)
	}
	var d net.Dialer
	return d.DialContext(ctx, "tcp", addr)
}

// ---- test HTTP upstream proxy ----

type upstreamMode int

const (
	modeOK upstreamMode = iota
	modeHang
	mode407
	mode502
	modeCloseAtOnce
	mode500
	modeBanner // answer CONNECT and the destination's first bytes in one write
	// modeReadPerMessage (SOCKS5): read each handshake message with one
	// read and ignore what came behind it, so bytes pipelined behind the
	// greeting are lost.
	modeReadPerMessage
)

// httpUpstream is a small HTTP proxy: CONNECT and absolute-URI requests,
// with basic auth when user is set.
type httpUpstream struct {
	t          testing.TB
	ln         net.Listener
	user, pass string
	mode       atomic.Int32
	names      names

	mu       sync.Mutex
	targets  []string      // CONNECT targets and absolute URIs received
	headers  []http.Header // headers of plain requests received
	peers    []string      // remote addresses of accepted connections
	accepted atomic.Int64

	wg    sync.WaitGroup
	conns sync.Map // net.Conn → struct{}
	tr    *http.Transport
}

func newHTTPUpstream(t testing.TB, user, pass string, n names) *httpUpstream {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u := &httpUpstream{t: t, ln: ln, user: user, pass: pass, names: n}
	u.tr = &http.Transport{DialContext: func(ctx context.Context, _, addr string) (net.Conn, error) { return n.dial(ctx, addr) }}
	u.wg.Add(1)
	go u.accept()
	t.Cleanup(u.close)
	return u
}

func (u *httpUpstream) upstream(service int) *pool.Upstream {
	return &pool.Upstream{Service: service, Protocol: pool.HTTP, Address: u.ln.Addr().String(), Username: u.user, Password: u.pass}
}

func (u *httpUpstream) close() {
	_ = u.ln.Close()
	u.conns.Range(func(k, _ any) bool { _ = k.(net.Conn).Close(); return true })
	u.wg.Wait()
	u.tr.CloseIdleConnections()
}

func (u *httpUpstream) Targets() []string {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]string(nil), u.targets...)
}

func (u *httpUpstream) Headers() []http.Header {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]http.Header(nil), u.headers...)
}

func (u *httpUpstream) accept() {
	defer u.wg.Done()
	for {
		c, err := u.ln.Accept()
		if err != nil {
			return
		}
		u.accepted.Add(1)
		u.mu.Lock()
		u.peers = append(u.peers, c.RemoteAddr().String())
		u.mu.Unlock()
		u.conns.Store(c, struct{}{})
		u.wg.Add(1)
		go func() {
			defer u.wg.Done()
			defer u.conns.Delete(c)
			defer c.Close()
			u.serveConn(c)
		}()
	}
}

func (u *httpUpstream) serveConn(c net.Conn) {
	switch upstreamMode(u.mode.Load()) {
	case modeHang:
		_, _ = io.Copy(io.Discard, c) // until closed
		return
	case modeCloseAtOnce:
		return
	}
	br := bufio.NewReader(c)
	for {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		target := req.RequestURI
		u.mu.Lock()
		u.targets = append(u.targets, target)
		u.mu.Unlock()
		if !u.authorized(req) || upstreamMode(u.mode.Load()) == mode407 {
			_, _ = io.WriteString(c, "HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=\"up\"\r\nContent-Length: 0\r\n\r\n")
			if req.Method == http.MethodConnect {
				return
			}
			_, _ = io.Copy(io.Discard, req.Body)
			continue
		}
		if upstreamMode(u.mode.Load()) == mode500 {
			_, _ = io.WriteString(c, "HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
			return
		}
		if req.Method == http.MethodConnect {
			u.serveConnect(c, br, target)
			return
		}
		if !u.servePlain(c, req) {
			return
		}
	}
}

func (u *httpUpstream) authorized(req *http.Request) bool {
	if u.user == "" {
		return true
	}
	want := "Basic " + base64.StdEncoding.EncodeToString([]byte(u.user+":"+u.pass))
	return req.Header.Get("Proxy-Authorization") == want
}

func (u *httpUpstream) serveConnect(c net.Conn, br *bufio.Reader, target string) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	dc, err := u.names.dial(ctx, target)
	if err != nil || upstreamMode(u.mode.Load()) == mode502 {
		_, _ = io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
		if dc != nil {
			_ = dc.Close()
		}
		return
	}
	defer dc.Close()
	u.conns.Store(dc, struct{}{})
	defer u.conns.Delete(dc)
	if upstreamMode(u.mode.Load()) == modeBanner {
		// Read what the destination sends first and pass it with the 200.
		_ = dc.SetReadDeadline(time.Now().Add(2 * time.Second))
		b := make([]byte, 512)
		n, _ := dc.Read(b)
		_ = dc.SetReadDeadline(time.Time{})
		_, _ = c.Write(append([]byte("HTTP/1.1 200 Connection established\r\n\r\n"), b[:n]...))
	} else {
		_, _ = io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n")
	}
	if n := br.Buffered(); n > 0 {
		b, _ := br.Peek(n)
		_, _ = dc.Write(b)
	}
	pipe(c, dc)
}

// plainCopy copies through a buffer: io.Copy between TCP conns would splice
// through pipes that the runtime caches, which the fd leak checks would count.
func plainCopy(dst io.Writer, src io.Reader) (int64, error) {
	return io.CopyBuffer(struct{ io.Writer }{dst}, struct{ io.Reader }{src}, make([]byte, 32<<10))
}

// pipe copies both ways with half-close until both directions end.
func pipe(a, b net.Conn) {
	done := make(chan struct{})
	go func() {
		_, _ = plainCopy(b, a)
		if cw, ok := b.(closeWriter); ok {
			_ = cw.CloseWrite()
		}
		close(done)
	}()
	_, _ = plainCopy(a, b)
	if cw, ok := a.(closeWriter); ok {
		_ = cw.CloseWrite()
	}
	<-done
}

func (u *httpUpstream) servePlain(c net.Conn, req *http.Request) bool {
	u.mu.Lock()
	u.headers = append(u.headers, req.Header.Clone())
	u.mu.Unlock()
	if upstreamMode(u.mode.Load()) == mode502 {
		_, _ = io.Copy(io.Discard, req.Body)
		_, _ = io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
		return true
	}
	req.RequestURI = ""
	req.Header.Del("Proxy-Authorization")
	resp, err := u.tr.RoundTrip(req)
	if err != nil {
		_, _ = io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
		return false // the request stream may be broken
	}
	defer resp.Body.Close()
	return resp.Write(c) == nil
}

// ---- test SOCKS5 upstream ----

type socksUpstream struct {
	ln         net.Listener
	user, pass string
	names      names
	reply      atomic.Int32 // non-zero: answer every request with this code
	mode       atomic.Int32
	mu         sync.Mutex
	targets    []string
	firsts     []int // per connection, the bytes its first read found
	accepted   atomic.Int64
	wg         sync.WaitGroup
	conns      sync.Map
}

func newSOCKSUpstream(t testing.TB, user, pass string, n names) *socksUpstream {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &socksUpstream{ln: ln, user: user, pass: pass, names: n}
	s.wg.Add(1)
	go s.accept()
	t.Cleanup(func() {
		_ = ln.Close()
		s.conns.Range(func(k, _ any) bool { _ = k.(net.Conn).Close(); return true })
		s.wg.Wait()
	})
	return s
}

func (s *socksUpstream) upstream(service int) *pool.Upstream {
	return &pool.Upstream{Service: service, Protocol: pool.SOCKS5, Address: s.ln.Addr().String(), Username: s.user, Password: s.pass}
}

func (s *socksUpstream) Targets() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.targets...)
}

func (s *socksUpstream) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.accepted.Add(1)
		s.conns.Store(c, struct{}{})
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer s.conns.Delete(c)
			defer c.Close()
			s.serveConn(c)
		}()
	}
}

// Firsts is, per connection in the order accepted, how many bytes the
// upstream's first read found: the greeting alone (3 or 4 bytes) or, from
// a pipelining client, everything up to the request.
func (s *socksUpstream) Firsts() []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]int(nil), s.firsts...)
}

func (s *socksUpstream) serveConn(c net.Conn) {
	switch upstreamMode(s.mode.Load()) {
	case modeHang:
		_, _ = io.Copy(io.Discard, c)
		return
	case modeCloseAtOnce:
		return
	case modeReadPerMessage:
		if req := s.readPerMessage(c); req != nil {
			s.serveRequest(c, req)
		}
		return
	}
	cfg := socks5.ServerConfig{RequireAuth: s.user != ""}
	if s.user != "" {
		cfg.Authenticate = func(u, p string) bool { return u == s.user && p == s.pass }
	}
	br := bufio.NewReaderSize(c, 1024)
	if _, err := br.Peek(1); err != nil {
		return
	}
	s.mu.Lock()
	s.firsts = append(s.firsts, br.Buffered())
	s.mu.Unlock()
	req, err := socks5.ReadRequest(struct {
		io.Reader
		io.Writer
	}{br, c}, cfg)
	if err != nil || br.Buffered() > 0 { // nothing of the tunnel comes before the reply
		return
	}
	s.serveRequest(c, req)
}

// readPerMessage is the handshake of a server that reads each message with
// one read into a buffer and uses only the message: what a client
// pipelined behind the greeting is lost, and it waits for credentials that
// already came.
func (s *socksUpstream) readPerMessage(c net.Conn) *socks5.Request {
	b := make([]byte, 512)
	n, err := c.Read(b)
	if err != nil || n < 3 || b[0] != socks5.VersionSOCKS5 || n < 2+int(b[1]) {
		return nil
	}
	s.mu.Lock()
	s.firsts = append(s.firsts, n)
	s.mu.Unlock()
	if !bytes.Contains(b[2:2+int(b[1])], []byte{socks5.MethodUserPass}) {
		_, _ = c.Write([]byte{socks5.VersionSOCKS5, socks5.MethodNoAcceptable})
		return nil
	}
	_, _ = c.Write([]byte{socks5.VersionSOCKS5, socks5.MethodUserPass})
	if n, err = c.Read(b); err != nil || n < 2 || n < 3+int(b[1]) || n < 3+int(b[1])+int(b[2+int(b[1])]) {
		return nil
	}
	user, pass := string(b[2:2+int(b[1])]), string(b[3+int(b[1]):3+int(b[1])+int(b[2+int(b[1])])])
	if user != s.user || pass != s.pass {
		_, _ = c.Write([]byte{socks5.VersionUserPass, 1})
		return nil
	}
	_, _ = c.Write([]byte{socks5.VersionUserPass, socks5.UserPassSucceeded})
	if n, err = c.Read(b); err != nil {
		return nil
	}
	// The request, parsed by ReadRequest behind a no-auth greeting of its own.
	req, err := socks5.ReadRequest(struct {
		io.Reader
		io.Writer
	}{io.MultiReader(bytes.NewReader([]byte{socks5.VersionSOCKS5, 1, socks5.MethodNoAuth}), bytes.NewReader(b[:n])), io.Discard}, socks5.ServerConfig{})
	if err != nil {
		return nil
	}
	return req
}

// serveRequest answers req (read from c) and relays its tunnel.
func (s *socksUpstream) serveRequest(c net.Conn, req *socks5.Request) {
	s.mu.Lock()
	s.targets = append(s.targets, req.Dest.String())
	s.mu.Unlock()
	if r := s.reply.Load(); r != 0 {
		_ = socks5.WriteReply(c, byte(r), socks5.Addr{})
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	dc, err := s.names.dial(ctx, req.Dest.String())
	if err != nil {
		_ = socks5.WriteReply(c, socks5.ReplyHostUnreachable, socks5.Addr{})
		return
	}
	defer dc.Close()
	s.conns.Store(dc, struct{}{})
	defer s.conns.Delete(dc)
	var reply bytes.Buffer
	_ = socks5.WriteReply(&reply, socks5.ReplySucceeded, socks5.Addr{Host: "127.0.0.1", Port: 1})
	if upstreamMode(s.mode.Load()) == modeBanner {
		// The reply and the destination's first bytes in one write.
		buf := make([]byte, 512)
		_ = dc.SetReadDeadline(time.Now().Add(2 * time.Second))
		n, _ := dc.Read(buf)
		_ = dc.SetReadDeadline(time.Time{})
		reply.Write(buf[:n])
	}
	if _, err := c.Write(reply.Bytes()); err != nil {
		return
	}
	pipe(c, dc)
}

// ---- origins ----

// startOrigin runs an HTTP origin on loopback.
func startOrigin(t testing.TB, h http.Handler) (addr string, conns *atomic.Int64) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	conns = new(atomic.Int64)
	srv := &http.Server{Handler: h, ConnState: func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close(); <-done })
	return ln.Addr().String(), conns
}

// startTCP runs a raw TCP server calling serve for each connection.
func startTCP(t testing.TB, network, addr string, serve func(net.Conn)) string {
	t.Helper()
	ln, err := net.Listen(network, addr)
	if err != nil {
		if network == "tcp6" { // IPv6 loopback is off in some containers
			t.Skipf("listening on %s %s: %v", network, addr, err)
		}
		t.Fatalf("listening on %s %s: %v", network, addr, err)
	}
	var wg sync.WaitGroup
	var conns sync.Map
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Store(c, struct{}{})
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer conns.Delete(c)
				defer c.Close()
				serve(c)
			}()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		conns.Range(func(k, _ any) bool { _ = k.(net.Conn).Close(); return true })
		wg.Wait()
	})
	return ln.Addr().String()
}

// echoServe echoes everything and half-closes at EOF.
func echoServe(c net.Conn) {
	_, _ = plainCopy(c, c)
	if cw, ok := c.(closeWriter); ok {
		_ = cw.CloseWrite()
	}
}

// tcpPair is a connected pair of loopback TCP connections, closed when the
// test ends.
func tcpPair(t *testing.T) (dialed, accepted net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	dialed, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = dialed.Close() })
	accepted, err = ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = accepted.Close() })
	return dialed, accepted
}

// ---- proxyd listener under test ----

var loopbackAllowed = []Network{MustParseNetwork("127.0.0.0/8"), MustParseNetwork("::1")}

// testConfig is DefaultConfig for an HTTP listener on 127.0.0.1:0 named
// after its protocol, with set applied.
func testConfig(set func(c *Config)) Config {
	c := DefaultConfig()
	c.Protocol, c.Address = ProtocolHTTP, "127.0.0.1:0"
	if set != nil {
		set(&c)
	}
	if c.Name == "" {
		c.Name = c.Protocol
	}
	return c
}

type testListener struct {
	*Listener
	addr string
	obs  *testObserver
}

// startListener serves cfg on 127.0.0.1:0 until the test ends.
func startListener(t *testing.T, cfg Config, p Pool) *testListener {
	t.Helper()
	return startSuccessor(t, cfg, p, nil)
}

// startSuccessor is startListener for the successor of prev (see
// Listener.Succeed), or of none when prev is nil.
func startSuccessor(t *testing.T, cfg Config, p Pool, prev *Listener) *testListener {
	t.Helper()
	if cfg.Address == "" {
		cfg.Address = "127.0.0.1:0"
	}
	obs := &testObserver{}
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	if testing.Verbose() && os.Getenv("FORWARD_DEBUG") != "" {
		logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	l, err := NewListener(cfg, p, obs, logger)
	if err != nil {
		t.Fatal(err)
	}
	if prev != nil {
		l.Succeed(prev)
	}
	ln, err := Listen(context.Background(), cfg.Address)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- l.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = l.Shutdown(ctx)
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Serve: %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Errorf("Serve did not return after Shutdown")
		}
	})
	return &testListener{Listener: l, addr: ln.Addr().String(), obs: obs}
}

// shutdownAsync runs Shutdown with a 5 s deadline in a goroutine and
// delivers its result.
func (tl *testListener) shutdownAsync() <-chan error {
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		done <- tl.Shutdown(ctx)
	}()
	return done
}

// wantClientLeft checks what a client that left mid-request leaves behind:
// one attempt reported canceled (no verdict on the upstream), and the
// connection counted as the client's failure.
func (tl *testListener) wantClientLeft(t *testing.T, p *fakePool) {
	t.Helper()
	p.waitBalanced(t)
	if got := p.Reports(); len(got) != 1 || got[0].res != pool.Canceled {
		t.Errorf("reports %+v, want one canceled (no verdict)", got)
	}
	waitFor(t, 5*time.Second, func() bool { return len(tl.obs.Closeds()) == 1 }, "the connection reported")
	if o := tl.obs.Closeds()[0].o; o != OutcomeClientError {
		t.Errorf("outcome %s, want client_error", o)
	}
}

// httpClient is a net/http client using the listener as its proxy.
func (tl *testListener) httpClient(t testing.TB, user, pass string) *http.Client {
	t.Helper()
	pu := &url.URL{Scheme: "http", Host: tl.addr}
	if user != "" {
		pu.User = url.UserPassword(user, pass)
	}
	tr := &http.Transport{Proxy: http.ProxyURL(pu), DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 20 * time.Second}
}

// dialRaw opens a client connection to addr, closed when the test ends,
// with a deadline for the whole exchange.
func dialRaw(t testing.TB, addr string) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	return c, bufio.NewReader(c)
}

// rawConnect opens a CONNECT tunnel by hand and returns the conn after the 200.
func rawConnect(t testing.TB, proxyAddr, target string, extra string) (net.Conn, *bufio.Reader, *http.Response) {
	t.Helper()
	c, br := dialRaw(t, proxyAddr)
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n%s\r\n", target, target, extra)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		t.Fatalf("reading CONNECT answer: %v", err)
	}
	return c, br, resp
}

func basicHeader(user, pass string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+pass))
}

func containsFold(list []string, s string) bool {
	for _, v := range list {
		if strings.EqualFold(v, s) {
			return true
		}
	}
	return false
}
