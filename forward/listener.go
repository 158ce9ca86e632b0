// Package forward runs proxyd's local listeners: an HTTP proxy (plain
// requests in absolute-URI form, CONNECT tunnels, WebSocket upgrades) and
// a SOCKS5 server (CONNECT only). The HTTP listener serves each client
// connection itself, request after request (httpconn.go). Each client
// connection is relayed through an upstream picked from the pool by one
// attempt loop (attempt.go), with retries on other upstreams before the
// first byte reaches the client and, for plain requests that can be sent
// again, a hedge through one more upstream when the answer is slow to come; each attempt's outcome is classified (the
// upstream's fault, the destination's, or nobody's) and reported to the
// pool, and each connection's to an Observer. An upstream answers CONNECT
// (or the SOCKS5 request) only once it reached the destination, so its
// silence past handshake_timeout is judged by comparison: not blamed when
// a second upstream was silent on the request too, or one reported that
// the destination failed, and none answered (the destination does not
// answer); blamed otherwise. Upstreams of sticky sessions are blamed at
// once, as their failure asks for a rotation.
//
// Scope: local authentication (users and sticky-session usernames), the
// client allow-list, the refused destinations (loopback, link-local, private,
// unspecified and proxyd's own addresses unless allowed), timeouts, a
// connection cap, relaying with cheap idle tunnels. Left out: choosing
// upstreams (package pool), metrics registration (package metrics), reading
// configuration files (cmd/proxyd). proxyd never terminates TLS for clients
// and never resolves destination host names itself.
package forward

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/proxyd/proxyd/pool"
)

// ErrServing is returned by a second Serve on the same Listener.
var ErrServing = errors.New("forward: listener already serving")

// Listener is one local proxy listener (HTTP or SOCKS5).
type Listener struct {
	cfg    Config
	pool   Pool
	obs    Observer
	log    *slog.Logger
	auth   authenticator
	dest   destPolicy
	dialer *dialer
	// answers: when each upstream last answered (a silent upstream is
	// blamed when others answer).
	answers answerLog

	// HTTP only.
	transports *transportCache
	plain      *plainConns

	// ctx is the parent of every outbound attempt; canceled by Close.
	ctx    context.Context
	cancel context.CancelFunc

	mu      sync.Mutex
	ln      net.Listener
	conns   map[*clientConn]struct{}
	upconns map[net.Conn]struct{} // upstream sides of open tunnels
	// stopping: Shutdown or Close began (set under mu, read without it):
	// accept no more, serve no further request on a kept connection.
	stopping  atomic.Bool
	closed    bool           // Close: no new goroutines
	wg        sync.WaitGroup // goroutines started by spawn
	active    atomic.Int64
	capped    *atomic.Int64 // connections counted against max_connections; shared by Succeed
	fresh     atomic.Int64  // HTTP connections whose first request is not read yet
	accepting chan struct{} // closed when Serve's accept loop ended; nil before Serve
	rejects   atomic.Int64  // cap-rejection goroutines running
}

// NewListener builds a listener; it does not bind (see Serve).
func NewListener(cfg Config, p Pool, obs Observer, logger *slog.Logger) (*Listener, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("validating listener %q: %w", cfg.Name, err)
	}
	for i, u := range cfg.Users {
		if u.Password == "" { // only a password_file: its reader did not run
			return nil, fmt.Errorf("listener %q: user[%d].password_file: not read (a Listener checks the password itself)", cfg.Name, i)
		}
	}
	if p == nil {
		return nil, errors.New("creating listener: nil pool")
	}
	if obs == nil {
		obs = nopObserver{}
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithCancel(context.Background())
	logger = logger.With("listener", cfg.Name)
	l := &Listener{
		cfg:     cfg,
		pool:    p,
		obs:     obs,
		log:     logger,
		auth:    newAuthenticator(cfg.Users),
		dest:    destPolicy{allow: prefixes(cfg.AllowDestinations)},
		dialer:  newDialer(cfg, logger),
		ctx:     ctx,
		cancel:  cancel,
		conns:   make(map[*clientConn]struct{}),
		upconns: make(map[net.Conn]struct{}),
		capped:  new(atomic.Int64),
	}
	if cfg.Protocol == ProtocolHTTP {
		l.initHTTP()
	}
	return l, nil
}

// Succeed makes l the successor of prev, a listener of the same name that
// is being retired with connections still open: those count against l's
// max_connections for as long as they last, so a reload does not lift the
// cap, and l keeps what prev learned of its upstreams' SOCKS5 handshakes.
// Call it before l serves.
func (l *Listener) Succeed(prev *Listener) {
	l.capped = prev.capped
	// What the upstreams showed of pipelined SOCKS5 handshakes stays
	// known: a reload does not make the first tunnels through one that
	// drops early bytes wait handshake_timeout again.
	l.dialer.pipelining = prev.dialer.pipelining
}

type nopObserver struct{}

func (nopObserver) Opened()                             {}
func (nopObserver) Closed(Outcome, int64, int64, int)   {}
func (nopObserver) Dialed(pool.Protocol, time.Duration) {}
func (nopObserver) Hedged()                             {}
func (nopObserver) Requested(Outcome)                   {}

// Addr is the address Serve listens on, or nil before Serve.
func (l *Listener) Addr() net.Addr {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.ln == nil {
		return nil
	}
	return l.ln.Addr()
}

// ActiveConns is the number of open client connections.
func (l *Listener) ActiveConns() int { return int(l.active.Load()) }

// Serve accepts client connections on ln until Shutdown or Close; it then
// returns nil (also when Shutdown or Close came first). ln is closed when
// Serve returns. A Listener serves one net.Listener.
func (l *Listener) Serve(ln net.Listener) error {
	l.mu.Lock()
	if l.stopping.Load() { // shut down before it served: nothing to do
		l.mu.Unlock()
		_ = ln.Close()
		return nil
	}
	if l.ln != nil {
		l.mu.Unlock()
		_ = ln.Close()
		return ErrServing
	}
	l.ln = ln
	l.accepting = make(chan struct{})
	accepting := l.accepting
	l.mu.Unlock()
	defer close(accepting)
	own, err := ownAddrs(ln.Addr())
	if err != nil {
		l.log.Warn("requests to this host's own addresses cannot be refused on this listener", "err", err)
	}
	l.dest.setOwn(own)
	al := &acceptor{Listener: ln, l: l}
	if l.cfg.Protocol == ProtocolHTTP {
		err = l.serveConns(al, l.serveHTTPConn)
	} else {
		err = l.serveConns(al, l.serveSOCKSConn)
	}
	if l.stopping.Load() {
		return nil
	}
	return fmt.Errorf("serving listener %q: %w", l.cfg.Name, err)
}

// serveConns is the accept loop: each client connection is served in a
// goroutine of its own. The acceptor waits out a shortage of file
// descriptors itself; any error that reaches here ends the loop.
func (l *Listener) serveConns(al *acceptor, serve func(*clientConn)) error {
	for {
		c, err := al.Accept()
		if err != nil {
			return err
		}
		cc := c.(*clientConn)
		if l.cfg.Protocol == ProtocolHTTP && cc.fresh.CompareAndSwap(false, true) {
			// No byte of its first request came yet: Shutdown gives it
			// time (freshGrace).
			l.fresh.Add(1)
		}
		if !l.spawn(func() { serve(cc) }) {
			_ = cc.Close()
		}
	}
}

// Shutdown stops accepting at once, waits for open connections to end until
// ctx is done, then closes the rest. It returns ctx's error when it had to
// close connections.
func (l *Listener) Shutdown(ctx context.Context) error {
	l.mu.Lock()
	l.stopping.Store(true)
	ln := l.ln
	accepting := l.accepting
	l.mu.Unlock()
	if ln != nil {
		_ = ln.Close()
	}
	if l.cfg.Protocol == ProtocolHTTP {
		l.awaitFirstRequests(ctx, accepting)
	}
	// HTTP connections between requests close; one serving a request
	// closes after its answer (stopping), a tunnel when it ends.
	err := pollUntil(ctx, 10*time.Millisecond, func() bool {
		l.closeIdle()
		return l.active.Load() == 0
	})
	l.closeAll()
	return err
}

// closeIdle closes the HTTP connections that wait for a request head.
func (l *Listener) closeIdle() {
	var idle []*clientConn
	l.mu.Lock()
	for c := range l.conns {
		if c.idle.CompareAndSwap(true, false) {
			idle = append(idle, c)
		}
	}
	l.mu.Unlock()
	for _, c := range idle {
		_ = c.Close()
	}
}

// freshGrace bounds how long Shutdown waits for just-accepted HTTP
// connections to send their first request.
const freshGrace = 500 * time.Millisecond

// awaitFirstRequests lets the HTTP connections accepted just before
// Shutdown send their first request (up to freshGrace): a client that
// connected a moment before a reload or SIGTERM would otherwise see its
// connection closed unanswered.
func (l *Listener) awaitFirstRequests(ctx context.Context, accepting <-chan struct{}) {
	ctx, cancel := context.WithTimeout(ctx, freshGrace)
	defer cancel()
	if accepting != nil {
		select { // every accepted connection is counted
		case <-accepting:
		case <-ctx.Done():
			return
		}
	}
	_ = pollUntil(ctx, 2*time.Millisecond, func() bool { return l.fresh.Load() == 0 })
}

// pollUntil checks done, first after every, then at twice the last
// interval up to pollCap, until it holds (nil) or ctx ends (ctx's error). A
// drain that a long tunnel keeps open (a listener retired by a reload waits
// for its tunnels to end) thus wakes a few times a second, not a hundred.
func pollUntil(ctx context.Context, every time.Duration, done func() bool) error {
	t := time.NewTimer(every)
	defer t.Stop()
	for !done() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
		every = min(2*every, pollCap)
		t.Reset(every)
	}
	return nil
}

// pollCap is the longest interval between pollUntil's checks.
const pollCap = 100 * time.Millisecond

func (l *Listener) unfresh(cc *clientConn) {
	if cc.fresh.CompareAndSwap(true, false) {
		l.fresh.Add(-1)
	}
}

// Close closes the listener and every connection at once.
func (l *Listener) Close() error {
	l.mu.Lock()
	l.stopping.Store(true)
	ln := l.ln
	l.mu.Unlock()
	if ln != nil {
		_ = ln.Close()
	}
	l.closeAll()
	return nil
}

func (l *Listener) closeAll() {
	l.mu.Lock()
	l.closed = true
	conns := make([]*clientConn, 0, len(l.conns))
	for c := range l.conns {
		conns = append(conns, c)
	}
	ups := make([]net.Conn, 0, len(l.upconns))
	for c := range l.upconns {
		ups = append(ups, c)
	}
	l.mu.Unlock()
	l.cancel()
	for _, c := range conns {
		_ = c.Close()
	}
	for _, c := range ups {
		_ = c.Close()
	}
	l.wg.Wait()
	if l.transports != nil {
		l.transports.closeIdle()
	}
	if l.plain != nil {
		l.plain.close()
	}
}

// spawn runs f in a goroutine the listener waits for, unless it is closed.
func (l *Listener) spawn(f func()) bool {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return false
	}
	l.wg.Add(1)
	l.mu.Unlock()
	go func() {
		defer l.wg.Done()
		f()
	}()
	return true
}

// trackUpstream registers the upstream side of a tunnel so that Close can
// close it; false means the listener is closed and c was closed.
func (l *Listener) trackUpstream(c net.Conn) bool {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		_ = c.Close()
		return false
	}
	l.upconns[c] = struct{}{}
	l.mu.Unlock()
	return true
}

func (l *Listener) untrackUpstream(c net.Conn) {
	l.mu.Lock()
	delete(l.upconns, c)
	l.mu.Unlock()
}

// acceptor applies the allow-list and the connection cap at accept, without
// ever blocking the accept loop on a client.
type acceptor struct {
	net.Listener
	l *Listener
}

func (a *acceptor) Accept() (net.Conn, error) {
	l := a.l
	var backoff time.Duration
	for {
		c, err := a.Listener.Accept()
		if err != nil {
			if !acceptRetryable(err) {
				return nil, err
			}
			// Out of file descriptors (or a timeout): new clients wait in
			// the backlog or are refused while it lasts; the loop keeps
			// going and serves again once descriptors free up.
			if backoff == 0 {
				l.log.Warn("accepting connections", "err", err)
			}
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			t := time.NewTimer(backoff)
			select {
			case <-t.C:
			case <-l.ctx.Done():
				t.Stop()
			}
			continue
		}
		backoff = 0
		l.obs.Opened()
		if !l.clientAllowed(c.RemoteAddr()) {
			_ = c.Close()
			l.obs.Closed(OutcomeDenied, 0, 0, 0)
			continue
		}
		if l.capped.Load() >= int64(l.cfg.MaxConnections) {
			l.rejectOverCap(c)
			continue
		}
		cc := &clientConn{Conn: c, l: l, local: loopbackPeer(c)}
		if !cc.local {
			keepAlive(c)
		}
		l.mu.Lock()
		if l.closed {
			l.mu.Unlock()
			_ = c.Close()
			l.obs.Closed(OutcomeDenied, 0, 0, 0)
			continue
		}
		l.conns[cc] = struct{}{}
		l.active.Add(1)
		l.capped.Add(1)
		l.mu.Unlock()
		return cc, nil
	}
}

// acceptRetryable reports whether an accept error is passing: a shortage of
// file descriptors or kernel memory, or a timeout. A closed listener is not.
func acceptRetryable(err error) bool {
	if errors.Is(err, net.ErrClosed) {
		return false
	}
	if localShortage(err) || errors.Is(err, syscall.ECONNABORTED) {
		return true
	}
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// Listen opens a listening socket for Serve. It leaves TCP keep-alive off
// on accepted connections: Serve turns it on for clients on other machines,
// whose silent end only probes reveal. A client on this machine needs none
// (its end is known at once), which saves four system calls per connection
// (a few per cent of CPU on new connections in the rig; BENCHMARKS.md,
// "Small savers").
func Listen(ctx context.Context, address string) (net.Listener, error) {
	lc := net.ListenConfig{KeepAlive: -1}
	return lc.Listen(ctx, "tcp", address)
}

// loopbackPeer reports whether c's other end is on this machine.
func loopbackPeer(c net.Conn) bool {
	ra, ok := c.RemoteAddr().(*net.TCPAddr)
	return ok && ra.IP.IsLoopback()
}

// keepAlive turns TCP keep-alive on for a client on another machine, with
// Go's default timings (15 s idle and interval, 9 probes).
func keepAlive(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetKeepAliveConfig(net.KeepAliveConfig{Enable: true, Idle: 15 * time.Second, Interval: 15 * time.Second, Count: 9})
	}
}

func (l *Listener) clientAllowed(a net.Addr) bool {
	if len(l.cfg.Allow) == 0 {
		return true
	}
	ta, ok := a.(*net.TCPAddr)
	if !ok {
		return false
	}
	ip, ok := netip.AddrFromSlice(ta.IP)
	if !ok {
		return false
	}
	ip = ip.Unmap()
	for _, p := range l.cfg.Allow {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}

// maxRejecters bounds the goroutines answering clients over the cap; past
// it they are closed without an answer.
const maxRejecters = 64

// rejectOverCap answers a client over the connection cap (503 or SOCKS
// 0x01) in its own short-lived goroutine, so that accept never waits.
func (l *Listener) rejectOverCap(c net.Conn) {
	if l.rejects.Add(1) > maxRejecters || !l.spawn(func() {
		defer l.rejects.Add(-1)
		l.answerOverCap(c)
		_ = c.Close()
		l.obs.Closed(OutcomeDenied, 0, 0, 0)
	}) {
		l.rejects.Add(-1)
		_ = c.Close()
		l.obs.Closed(OutcomeDenied, 0, 0, 0)
	}
}

// clientConn is an accepted client connection: it counts bytes and reports
// the connection's outcome once, when closed.
type clientConn struct {
	net.Conn
	l        *Listener
	once     sync.Once
	up, down atomic.Int64
	retries  atomic.Int32
	outcome  atomic.Int32 // Outcome+1; 0 = nothing served yet
	fresh    atomic.Bool  // HTTP: accepted, no request byte read yet
	idle     atomic.Bool  // HTTP: waiting for a request head (Shutdown closes it)
	closeErr error
	local    bool // the client is on this machine
}

func (c *clientConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.up.Add(int64(n))
	return n, err
}

func (c *clientConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.down.Add(int64(n))
	return n, err
}

// CloseWrite half-closes the client's socket where it can: a lingering
// close sends its FIN before it drains.
func (c *clientConn) CloseWrite() error {
	if cw, ok := c.Conn.(closeWriter); ok {
		return cw.CloseWrite()
	}
	return nil
}

// setOutcome records the outcome of the latest request on the connection.
func (c *clientConn) setOutcome(o Outcome) { c.outcome.Store(int32(o) + 1) }

// lastOutcome is the latest request's outcome; client_error when nothing
// was served.
func (c *clientConn) lastOutcome() Outcome {
	if v := c.outcome.Load(); v > 0 {
		return Outcome(v - 1)
	}
	return OutcomeClientError
}

func (c *clientConn) Close() error {
	c.once.Do(func() {
		c.closeErr = c.Conn.Close()
		l := c.l
		l.unfresh(c)
		l.mu.Lock()
		delete(l.conns, c)
		l.mu.Unlock()
		// Reported before it stops counting as active: once Shutdown sees
		// none active, the observer has every connection's outcome.
		l.obs.Closed(c.lastOutcome(), c.up.Load(), c.down.Load(), int(c.retries.Load()))
		l.active.Add(-1)
		l.capped.Add(-1)
	})
	return c.closeErr
}
