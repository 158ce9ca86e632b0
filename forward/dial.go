package forward

import (
	"bufio"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/proxyd/proxyd/forward/socks5"
	"github.com/proxyd/proxyd/pool"
)

// dialer dials upstreams. It is shared by the CONNECT, upgrade and SOCKS
// paths and by the plain-HTTP transports.
type dialer struct {
	dialTimeout      time.Duration
	handshakeTimeout time.Duration
	net              net.Dialer
	log              *slog.Logger
	pipelining       *pipelineBook // shared with the listener's successors (Succeed)
}

// pipelineBook is what SOCKS5 upstreams with credentials showed of
// pipelined handshakes (see dialer.tunnel), by address: true once one
// worked (or ended in a reply code, which says the request was read),
// false once one failed where one message at a time might not have.
type pipelineBook struct {
	m sync.Map // upstream address → bool
	n atomic.Int64
}

// maxPipelineBook bounds the book (about 100 bytes an entry); upstreams
// past it get one message at a time.
const maxPipelineBook = 1 << 16

// lookup says whether to pipeline the handshake with the upstream at addr,
// and whether that is known to work there.
func (b *pipelineBook) lookup(addr string) (pipeline, works bool) {
	if v, ok := b.m.Load(addr); ok {
		return v.(bool), v.(bool)
	}
	return b.n.Load() < maxPipelineBook, false
}

// record notes what the upstream at addr showed: a success counts only
// where nothing is known yet; a failure is kept for good, also over a
// success. It reports whether the entry changed.
func (b *pipelineBook) record(addr string, works bool) bool {
	v, ok := b.m.Load(addr)
	if !ok {
		if b.n.Load() >= maxPipelineBook {
			return false
		}
		if v, ok = b.m.LoadOrStore(addr, works); !ok {
			b.n.Add(1)
			return true
		}
	}
	return !works && v.(bool) && b.m.CompareAndSwap(addr, true, false)
}

func newDialer(cfg Config, log *slog.Logger) *dialer {
	d := &dialer{dialTimeout: cfg.DialTimeout, handshakeTimeout: cfg.HandshakeTimeout, log: log, pipelining: new(pipelineBook)}
	d.net.Timeout = cfg.DialTimeout
	// Keep-alive probes after 30 s of silence keep NAT mappings of quiet
	// tunnels alive. How soon a dead upstream is given up (probe interval
	// and count) stays with the system: an idle tunnel ends at IdleTimeout
	// first, and leaving them saves two system calls per dial (measured
	// with the loopback rule in Listen: BENCHMARKS.md, "Small savers").
	d.net.KeepAliveConfig = net.KeepAliveConfig{Enable: true, Idle: 30 * time.Second, Interval: -1, Count: -1}
	d.net.LocalAddr = cfg.LocalAddr()
	return d
}

// dialTCP connects to the upstream's address and says what went wrong.
func (d *dialer) dialTCP(ctx context.Context, u *pool.Upstream) (net.Conn, *attemptError) {
	start := time.Now()
	c, err := d.net.DialContext(ctx, "tcp", u.Address)
	if err != nil {
		return nil, classifyDial(ctx, err, start, d.dialTimeout)
	}
	return c, nil
}

// classifyDial says what a dial started at start, bounded by bound
// (dial_timeout), ran into.
func classifyDial(ctx context.Context, err error, start time.Time, bound time.Duration) *attemptError {
	w := wDialRefused
	switch {
	case ctx.Err() != nil && !upstreamTimeout(ctx):
		w = wClientGone
	case localShortage(err):
		w = wLocal
	case isTimeout(err) && cutByBudget(ctx, start, bound):
		w = wBudget
	case isTimeout(err) || ctx.Err() != nil:
		w = wDialTimeout
	}
	return failed(w, fmt.Errorf("dialing upstream: %w", err))
}

// cutByBudget reports whether ctx's deadline (a tunnel's retry_timeout)
// has passed and left a step started at start less than nine tenths of its
// own bound: a step that timed out then was cut short and says nothing
// about its upstream. One that had nearly all of its bound, as the last
// attempt of a budget often has, answers for its silence.
func cutByBudget(ctx context.Context, start time.Time, bound time.Duration) bool {
	dl, ok := ctx.Deadline()
	return ok && dl.Sub(start) < bound*9/10 && !time.Now().Before(dl)
}

// upstreamTimeout reports whether ctx ended because a tunnel's attempts
// took longer than retry_timeout, which is the upstream's fault, unlike a
// client that left.
func upstreamTimeout(ctx context.Context) bool {
	return errors.Is(context.Cause(ctx), errAttemptTimeout)
}

// localShortage reports whether err is this process or machine running out
// of file descriptors or buffers.
func localShortage(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) ||
		errors.Is(err, syscall.ENOBUFS) || errors.Is(err, syscall.ENOMEM)
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, context.DeadlineExceeded) ||
		(errors.As(err, &ne) && ne.Timeout())
}

// tunnel opens a connection to dest through u: TCP to the upstream, then
// CONNECT or the SOCKS5 handshake. On success the returned conn carries the
// destination's bytes (including any the upstream sent right behind its
// answer). took is how long the try that decided took.
//
// A SOCKS5 upstream with credentials gets the greeting, the credentials and
// the request in one write (socks5.Client.Pipeline): two round trips fewer
// per tunnel, which on a remote gateway is most of a tunnel's set-up time.
// RFC 1928 does not promise that a server keeps bytes that come before its
// answer, and a pipelined greeting offers username/password alone. A
// pipelined handshake that fails where one message at a time might not
// have (socks5.ErrPipelineFailed: the upstream closed or answered garbage,
// refused the one method offered, or left the credentials unanswered until
// handshake_timeout) is not blamed: the upstream gets one message at a time
// from then on, the same attempt asks it again so on a new connection
// within what is left of retry_timeout, and the duration reported is that
// try's. Exceptions: a try cut by the client or the listener teaches
// nothing; one cut by retry_timeout is learned but not tried again; and
// where pipelined handshakes have worked before, a silence is the
// upstream's, judged as any.
func (d *dialer) tunnel(ctx context.Context, u *pool.Upstream, dest socks5.Addr) (c net.Conn, took time.Duration, derr *attemptError) {
	pipeline, works := false, false
	if u.Protocol == pool.SOCKS5 && u.Username != "" {
		pipeline, works = d.pipelining.lookup(u.Address)
	}
	start := time.Now()
	c, derr, pipeErr := d.tunnelOnce(ctx, u, dest, pipeline)
	switch {
	case !pipeline:
	case pipeErr == nil:
		if !works && (derr == nil || derr.h.what == wSOCKSReply) {
			d.pipelining.record(u.Address, true)
		}
	case derr.h.what == wClientGone:
	case works && isTimeout(pipeErr):
	default:
		if d.pipelining.record(u.Address, false) {
			d.log.Info("SOCKS5 upstream failed a pipelined handshake; it gets one message at a time from now on",
				"upstream", u.Address, "err", pipeErr)
		}
		if derr.h.what != wBudget {
			start = time.Now()
			c, derr, _ = d.tunnelOnce(ctx, u, dest, false)
		}
	}
	return c, time.Since(start), derr
}

// tunnelOnce is one try of tunnel, on one new connection; pipeErr is a
// pipelined handshake's socks5.ErrPipelineFailed as it came, also when the
// client left or the budget ended before the answer could come.
func (d *dialer) tunnelOnce(ctx context.Context, u *pool.Upstream, dest socks5.Addr, pipeline bool) (_ net.Conn, _ *attemptError, pipeErr error) {
	c, derr := d.dialTCP(ctx, u)
	if derr != nil {
		return nil, derr, nil
	}
	start := time.Now()
	deadline := start.Add(d.handshakeTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	_ = c.SetDeadline(deadline)
	// Abort the handshake when the client leaves or the listener stops.
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Unix(1, 0)) })
	var out net.Conn
	switch u.Protocol {
	case pool.SOCKS5:
		out, derr = socksHandshake(c, u, dest, pipeline)
	default:
		out, derr = connectHandshake(c, u, dest)
	}
	if stop() && derr == nil {
		_ = c.SetDeadline(time.Time{})
		return out, nil, nil
	}
	_ = c.Close()
	if derr != nil && errors.Is(derr.err, socks5.ErrPipelineFailed) {
		pipeErr = derr.err
	}
	if ctx.Err() != nil && !upstreamTimeout(ctx) {
		return nil, failed(wClientGone, context.Cause(ctx)), pipeErr
	}
	if derr == nil || isTimeout(derr.err) && cutByBudget(ctx, start, d.handshakeTimeout) {
		// The budget ran out before handshake_timeout did (or just as the
		// answer came). A request that went unanswered for at least a
		// quarter of handshake_timeout still tells run of a silent
		// destination (a working upstream answers a live one far sooner);
		// a shorter wait tells nothing. At the defaults (10 s, 15 s for all
		// attempts) a second attempt after a silent first has about 5 s.
		unanswered := derr != nil && derr.h.unanswered && time.Since(start) >= d.handshakeTimeout/4
		derr = failed(wBudget, errAttemptTimeout)
		derr.h.unanswered = unanswered
	}
	return nil, derr, pipeErr
}

// socksHandshake reads the upstream's answers through a small buffer: a
// reply and its address come in one read instead of two (with pipeline,
// often all the answers in one), and bytes the destination sent right
// behind the reply are kept for the client.
func socksHandshake(c net.Conn, u *pool.Upstream, dest socks5.Addr, pipeline bool) (net.Conn, *attemptError) {
	br := bufio.NewReaderSize(c, 512)
	_, err := socks5.Client{Pipeline: pipeline}.Handshake(struct {
		io.Reader
		io.Writer
	}{br, c}, dest, u.Username, u.Password)
	if err == nil {
		return withPrefix(c, br), nil
	}
	var re *socks5.ReplyError
	switch {
	case errors.As(err, &re):
		return nil, &attemptError{h: happened{what: wSOCKSReply, reply: re.Code}, err: err}
	case errors.Is(err, socks5.ErrAuthRejected), errors.Is(err, socks5.ErrBadCredentials):
		return nil, failed(wSOCKSAuth, err)
	case errors.Is(err, socks5.ErrBadAddress):
		return nil, failed(wSOCKSAddress, err)
	case isTimeout(err) && errors.Is(err, socks5.ErrAwaitingReply):
		return nil, unanswered(fmt.Errorf("socks5 handshake: %w", err))
	}
	// Malformed, closed early, timed out, reset: no usable answer in time.
	return nil, failed(wNoAnswer, fmt.Errorf("socks5 handshake: %w", err))
}

// basicAuth is the Proxy-Authorization value for an upstream, or "".
func basicAuth(u *pool.Upstream) string {
	if u.Username == "" && u.Password == "" {
		return ""
	}
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(u.Username+":"+u.Password))
}

func connectHandshake(c net.Conn, u *pool.Upstream, dest socks5.Addr) (net.Conn, *attemptError) {
	target := dest.String()
	var b strings.Builder
	b.Grow(128)
	b.WriteString("CONNECT ")
	b.WriteString(target)
	b.WriteString(" HTTP/1.1\r\nHost: ")
	b.WriteString(target)
	b.WriteString("\r\n")
	if a := basicAuth(u); a != "" {
		b.WriteString("Proxy-Authorization: ")
		b.WriteString(a)
		b.WriteString("\r\n")
	}
	b.WriteString("\r\n")
	if _, err := io.WriteString(c, b.String()); err != nil {
		return nil, failed(wNoAnswer, fmt.Errorf("writing CONNECT: %w", err))
	}
	// Through a small buffer, as the SOCKS5 handshake's: bytes the
	// destination sent right behind the answer are kept for the client.
	br := bufio.NewReaderSize(c, 1024)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		err = fmt.Errorf("reading CONNECT answer: %w", err)
		if isTimeout(err) {
			return nil, unanswered(err)
		}
		return nil, failed(wNoAnswer, err)
	}
	if s := resp.StatusCode; s < 200 || s > 299 {
		return nil, proxyAnswer(resp) // keeps nothing that reads br
	}
	return withPrefix(c, br), nil
}

// unanswered is a handshake that timed out awaiting the answer to its
// request, which the upstream took: an HTTP upstream answers CONNECT, and
// a SOCKS5 upstream (having answered the greeting) the request, only once
// it reached the destination, so the silence may be the destination's.
func unanswered(err error) *attemptError {
	return &attemptError{h: happened{what: wNoAnswer, unanswered: true}, err: err}
}

// proxyAnswer is an upstream's own answer that refused a request.
func proxyAnswer(resp *http.Response) *attemptError {
	return &attemptError{
		h:   happened{what: wProxyAnswer, status: resp.StatusCode, squid: resp.Header.Get("X-Squid-Error")},
		err: fmt.Errorf("upstream answered %d", resp.StatusCode),
	}
}

// bufferedCopy is a copy of what br holds already, or nil.
func bufferedCopy(br *bufio.Reader) []byte {
	n := br.Buffered()
	if n == 0 {
		return nil
	}
	b, _ := br.Peek(n)
	return append([]byte(nil), b...)
}

// withPrefix is c, or a prefixConn of c when br, which read c's handshake
// answer, holds bytes the upstream sent right behind it.
func withPrefix(c net.Conn, br *bufio.Reader) net.Conn {
	if b := bufferedCopy(br); b != nil {
		return &prefixConn{Conn: c, prefix: b}
	}
	return c
}

// prefixConn is a connection whose first reads return bytes an upstream sent
// right behind its handshake answer.
type prefixConn struct {
	net.Conn
	prefix []byte
}

func (c *prefixConn) Read(p []byte) (int, error) {
	if len(c.prefix) > 0 {
		n := copy(p, c.prefix)
		c.prefix = c.prefix[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}
