package forward

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/proxyd/proxyd/forward/socks5"
	"github.com/proxyd/proxyd/pool"
)

// Plain "http://" requests go over upstream connections of our own instead
// of through http.Transport: the handler's goroutine writes the request and
// reads the answer itself. Transport hands every request to a writer
// goroutine and every answer back from a reader goroutine, and each
// hand-off that wakes a thread costs: the same proxyd sending plain requests
// through Transport spent 228 instead of 192 µs of CPU per keep-alive
// request at concurrency 1, 85 instead of 65 at 32 (BENCHMARKS.md).
// A request with a body has its body written by a goroutine of its own, so
// that an early answer (413, 407, ...) is read while the body still flows.
// "https://" requests in absolute form, which need TLS, stay on Transport.

const (
	plainIdlePerKey  = 128
	plainIdleTotal   = 512
	plainIdleTimeout = 90 * time.Second
	maxResponseHead  = 1 << 20
	maxBodyWriteWait = 50 * time.Millisecond
)

var (
	errHeadTooLarge  = errors.New("response head too large")
	errUnexpected1xx = errors.New("unexpected informational response")
	// errStaleConn: a kept connection failed before any byte of the answer
	// came back; the upstream had closed it while it was idle.
	errStaleConn      = errors.New("kept upstream connection was closed")
	errListenerClosed = errors.New("listener closed")
)

// replayable reports whether a request may be sent again after a kept
// connection turned out closed: no body, and an idempotent method.
func replayable(req *http.Request) bool {
	return (req.Body == nil || req.Body == http.NoBody) && idempotent(req.Method)
}

// plainConns keeps idle upstream connections for plain requests, per
// upstream and credential and, through a SOCKS5 upstream, per destination.
type plainConns struct {
	d      *dialer
	spawn  func(func()) bool // runs body writers; false once the listener is closed
	mu     sync.Mutex
	idle   map[string][]*plainConn // most recently used last
	n      int
	closed bool
	// Idle connections kept, per key and in all, and for how long.
	maxIdlePerKey, maxIdle int
	idleTimeout            time.Duration
	// bodySilence (idle_timeout) is the longest an answer's body may go
	// without a byte; 0: unbounded.
	bodySilence time.Duration
}

func newPlainConns(d *dialer, spawn func(func()) bool, bodySilence time.Duration) *plainConns {
	return &plainConns{
		d: d, spawn: spawn, idle: make(map[string][]*plainConn),
		maxIdlePerKey: plainIdlePerKey, maxIdle: plainIdleTotal, idleTimeout: plainIdleTimeout,
		bodySilence: bodySilence,
	}
}

// plainConn is one upstream connection for plain requests.
type plainConn struct {
	pcs  *plainConns
	key  string
	conn net.Conn
	rc   syscall.RawConn // conn's socket, nil without one
	head *headLimit
	br   *bufio.Reader
	bw   *bufio.Writer
	// The idle timer is not moved at every put: a timer reset per request
	// can wake a thread (BENCHMARKS.md). It runs at due (zero: not set), at
	// most idleTimeout after the put that set it, and closes the connection
	// if it has been idle since idleSince for idleTimeout, or comes back for
	// the rest. due and idleSince are guarded by pcs.mu.
	timer     *time.Timer
	due       time.Time
	idleSince time.Time
}

// roundTrip sends req (whose header is ready for the upstream) and returns
// the answer's head; its body gives the connection back when read to the
// end and closed. Dial failures are recorded in ctx's attemptInfo. The
// caller took the request's send; resend takes another, for going out once
// more after a kept connection the upstream had closed turned out dead.
func (pcs *plainConns) roundTrip(ctx context.Context, u *pool.Upstream, req *http.Request, resend func() bool) (*http.Response, error) {
	host, port, err := splitHostPort(req.URL.Host, 80)
	if err != nil {
		return nil, err
	}
	key := u.ID() + "\x00" + u.Username + "\x00" + u.Password
	if u.Protocol == pool.SOCKS5 {
		key += "\x00" + net.JoinHostPort(host, strconv.Itoa(int(port)))
	}
	pc := pcs.get(key)
	resp, err := pcs.send(ctx, pc, u, key, req, host, port)
	// A replayable request goes once more, when a send is left, over a new
	// connection: another kept one may have been closed alike.
	if pc != nil && errors.Is(err, errStaleConn) && replayable(req) && ctx.Err() == nil && resend() {
		return pcs.send(ctx, nil, u, key, req, host, port)
	}
	return resp, err
}

// send writes req on pc, or on a new connection when pc is nil.
func (pcs *plainConns) send(ctx context.Context, pc *plainConn, u *pool.Upstream, key string, req *http.Request, host string, port uint16) (*http.Response, error) {
	reused := pc != nil
	if !reused {
		var err error
		if pc, err = pcs.dial(ctx, u, key, socks5.Addr{Host: host, Port: port}); err != nil {
			return nil, err
		}
	}
	return pc.roundTrip(ctx, req, u.Protocol != pool.SOCKS5, reused)
}

func (pcs *plainConns) dial(ctx context.Context, u *pool.Upstream, key string, dest socks5.Addr) (*plainConn, error) {
	var (
		c    net.Conn
		took time.Duration
		derr *attemptError
	)
	if u.Protocol == pool.SOCKS5 {
		c, took, derr = pcs.d.tunnel(ctx, u, dest)
	} else {
		start := time.Now()
		c, derr = pcs.d.dialTCP(ctx, u)
		took = time.Since(start)
	}
	recordDial(ctx, derr, took)
	if derr != nil {
		return nil, derr
	}
	pc := &plainConn{pcs: pcs, key: key, conn: c}
	if sc, ok := c.(syscall.Conn); ok {
		pc.rc, _ = sc.SyscallConn()
	}
	pc.head = &headLimit{r: c, rc: pc.rc, n: -1, silence: pcs.bodySilence}
	pc.br = bufio.NewReaderSize(pc.head, 4<<10)
	pc.bw = bufio.NewWriterSize(c, 4<<10)
	return pc, nil
}

// get takes the most recently used live idle connection for key, or nil.
func (pcs *plainConns) get(key string) *plainConn {
	pcs.mu.Lock()
	defer pcs.mu.Unlock()
	list := pcs.idle[key]
	defer func() {
		if len(list) == 0 {
			delete(pcs.idle, key)
		} else {
			pcs.idle[key] = list
		}
	}()
	for len(list) > 0 {
		pc := list[len(list)-1]
		list[len(list)-1] = nil
		list = list[:len(list)-1]
		pcs.n--
		if time.Since(pc.idleSince) >= pcs.idleTimeout || !peerSilent(pc.rc) {
			pc.close() // expired before its timer came, or the upstream closed or spoke
			continue
		}
		return pc
	}
	return nil
}

// put keeps pc for the next request, or closes it.
func (pcs *plainConns) put(pc *plainConn) {
	if pc.br.Buffered() > 0 { // the upstream sent more than its answer
		pc.close()
		return
	}
	pcs.mu.Lock()
	defer pcs.mu.Unlock()
	if pcs.closed || pcs.n >= pcs.maxIdle || len(pcs.idle[pc.key]) >= pcs.maxIdlePerKey {
		pc.close()
		return
	}
	pcs.idle[pc.key] = append(pcs.idle[pc.key], pc)
	pcs.n++
	pc.idleSince = time.Now()
	if expiry := pc.idleSince.Add(pcs.idleTimeout); pc.due.IsZero() || pc.due.After(expiry) {
		pc.arm(expiry)
	}
}

// arm sets pc's idle timer to run at due; pcs.mu is held.
func (pc *plainConn) arm(due time.Time) {
	pc.due = due
	if pc.timer == nil {
		pc.timer = time.AfterFunc(time.Until(due), func() { pc.pcs.expire(pc) })
	} else {
		pc.timer.Reset(time.Until(due))
	}
}

// expire runs on pc's idle timer: it closes pc if pc is idle and has been
// for idleTimeout, sets the timer again for the rest if pc is idle for
// less, and leaves a connection in use for its next put to arm.
func (pcs *plainConns) expire(pc *plainConn) {
	pcs.mu.Lock()
	pc.due = time.Time{}
	list := pcs.idle[pc.key]
	i := slices.Index(list, pc)
	if i < 0 {
		pcs.mu.Unlock()
		return
	}
	if expiry := pc.idleSince.Add(pcs.idleTimeout); time.Now().Before(expiry) {
		pc.arm(expiry)
		pcs.mu.Unlock()
		return
	}
	list = slices.Delete(list, i, i+1)
	pcs.n--
	if len(list) == 0 {
		delete(pcs.idle, pc.key)
	} else {
		pcs.idle[pc.key] = list
	}
	pcs.mu.Unlock()
	_ = pc.conn.Close()
}

// close closes pc for good and stops its idle timer, which would otherwise
// keep pc (and its buffers) until it runs.
func (pc *plainConn) close() {
	if pc.timer != nil {
		pc.timer.Stop()
	}
	_ = pc.conn.Close()
}

// close closes the idle connections; connections in use are closed when
// their answer is done.
func (pcs *plainConns) close() {
	pcs.mu.Lock()
	defer pcs.mu.Unlock()
	pcs.closed = true
	for k, list := range pcs.idle {
		for _, pc := range list {
			pc.close()
		}
		delete(pcs.idle, k)
	}
	pcs.n = 0
}

// roundTrip writes req and reads the answer's head. Cancelling ctx cuts the
// connection until the body is closed. A failure of a kept connection before
// any byte of the answer came back is errStaleConn wrapping the cause.
func (pc *plainConn) roundTrip(ctx context.Context, req *http.Request, proxyForm, reused bool) (*http.Response, error) {
	stop := context.AfterFunc(ctx, func() { _ = pc.conn.SetDeadline(time.Unix(1, 0)) })
	fail := func(err error) (*http.Response, error) {
		stop()
		pc.close()
		if ctx.Err() != nil {
			return nil, context.Cause(ctx)
		}
		if reused && pc.head.n == maxResponseHead && !isTimeout(err) && err != errListenerClosed {
			err = &staleError{err} // nothing came back
		}
		return nil, err
	}
	write := func() error {
		var err error
		if proxyForm {
			err = req.WriteProxy(pc.bw)
		} else {
			err = req.Write(pc.bw)
		}
		if err == nil {
			err = pc.bw.Flush()
		}
		return err
	}
	pc.head.n = maxResponseHead
	var wrote chan error
	if req.Body == nil || req.Body == http.NoBody {
		if err := write(); err != nil {
			return fail(err)
		}
	} else {
		wrote = make(chan error, 1)
		body := &clientBody{ReadCloser: req.Body}
		req.Body = body
		if !pc.pcs.spawn(func() {
			err := write()
			if err != nil && body.failed.Load() {
				// The upstream waits for the rest of a body that will not
				// come: end the attempt. (When writing to the upstream
				// failed, its answer may still be there to read.)
				pc.close()
			}
			wrote <- err
		}) {
			return fail(errListenerClosed)
		}
	}
	resp, err := readHead(pc.br, req)
	if err != nil {
		return fail(err)
	}
	pc.head.n, pc.head.ctx = -1, ctx
	resp.Body = &plainBody{rc: resp.Body, pc: pc, stop: stop, wrote: wrote, keep: !resp.Close, eof: resp.Body == http.NoBody}
	return resp, nil
}

// clientBody notes whether reading the client's request body failed.
type clientBody struct {
	io.ReadCloser
	failed atomic.Bool
}

func (b *clientBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil && err != io.EOF {
		b.failed.Store(true)
	}
	return n, err
}

type staleError struct{ err error }

func (e *staleError) Error() string        { return errStaleConn.Error() + ": " + e.err.Error() }
func (e *staleError) Unwrap() error        { return e.err }
func (e *staleError) Is(target error) bool { return target == errStaleConn }

// readHead reads a final answer, skipping informational ones (103 Early
// Hints and the like); 101 cannot answer a plain request.
func readHead(br *bufio.Reader, req *http.Request) (*http.Response, error) {
	for range 8 {
		resp, err := http.ReadResponse(br, req)
		if err != nil {
			return nil, err
		}
		if resp.StatusCode >= 200 {
			return resp, nil
		}
		if resp.StatusCode == http.StatusSwitchingProtocols {
			break
		}
	}
	return nil, errUnexpected1xx
}

// plainBody is an answer's body on a plainConn: read to its end and closed,
// it gives the connection back for the next request; closed early, it
// closes the connection (draining could take long).
type plainBody struct {
	rc   io.ReadCloser
	pc   *plainConn
	stop func() bool
	// wrote delivers the body writer's end (nil for a request without body).
	wrote chan error
	keep  bool // the upstream did not ask to close
	eof   bool
	once  sync.Once
}

func (b *plainBody) Read(p []byte) (int, error) {
	n, err := b.rc.Read(p)
	if err == io.EOF {
		b.eof = true
	}
	return n, err
}

func (b *plainBody) Close() error {
	b.once.Do(func() {
		b.pc.head.idle, b.pc.head.ctx = nil, nil
		if b.eof && b.keep && b.written() && b.stop() {
			_ = b.rc.Close()
			_ = b.pc.conn.SetReadDeadline(time.Time{}) // the body's, if it had to wait
			b.pc.pcs.put(b.pc)
			return
		}
		b.stop()
		b.pc.close()
	})
	return nil
}

// written reports whether the request's body went out whole.
func (b *plainBody) written() bool {
	if b.wrote == nil {
		return true
	}
	select {
	case err := <-b.wrote:
		return err == nil
	default:
	}
	// The answer is complete: the writer is done or about to say so. One
	// still writing after a short while (an upstream that answered without
	// reading the body) leaves a connection that cannot be reused.
	wait := time.NewTimer(maxBodyWriteWait)
	defer wait.Stop()
	select {
	case err := <-b.wrote:
		return err == nil
	case <-wait.C:
		return false
	}
}

// headLimit bounds what an answer's head may take (n >= 0), or reads a
// body (n < 0) with no byte limit. Reading a body, it calls idle before it
// waits for the upstream: the client gets what it was sent so far instead
// of having it sit in a buffer (streamed answers, long polls); and it
// waits at most silence (idle_timeout) for the next byte, as an idle
// tunnel does, unless ctx (the request's) ended.
type headLimit struct {
	r       net.Conn
	rc      syscall.RawConn // r's socket, nil without one
	n       int64
	idle    func()
	silence time.Duration
	ctx     context.Context // while a body is read
}

func (h *headLimit) Read(p []byte) (int, error) {
	if h.n < 0 {
		if h.idle != nil {
			n, empty, err := tryRead(h.rc, p)
			stale := err != nil && isTimeout(err) && h.ctx != nil && h.ctx.Err() == nil
			if !empty && !stale {
				return n, err
			}
			// Nothing there yet, or the deadline of an earlier wait ran
			// out since (the upstream stayed ahead): wait afresh.
			h.idle()
		}
		if h.silence > 0 && h.ctx != nil {
			_ = h.r.SetReadDeadline(time.Now().Add(h.silence))
			if h.ctx.Err() != nil {
				// Cancelled meanwhile: the deadline in the past that the
				// cancellation set must stand.
				_ = h.r.SetReadDeadline(time.Unix(1, 0))
			}
		}
		return h.r.Read(p)
	}
	if h.n == 0 {
		return 0, errHeadTooLarge
	}
	if int64(len(p)) > h.n {
		p = p[:h.n]
	}
	n, err := h.r.Read(p)
	h.n -= int64(n)
	return n, err
}
