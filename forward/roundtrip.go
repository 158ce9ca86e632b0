package forward

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/elazarl/goproxy"
	"github.com/proxyd/proxyd/forward/socks5"
	"github.com/proxyd/proxyd/pool"
)

const attemptKey ctxKey = 100

// attemptInfo is what a transport's dialer learned during one attempt.
type attemptInfo struct {
	mu       sync.Mutex
	dialErr  *dialError
	dialed   bool
	dialTook time.Duration
}

// upstreamClock ends an attempt when the upstream keeps proxyd waiting too
// long: for the answer's head, or to take the next piece of a request body.
// It does not run while proxyd waits for the client's body (pause/resume
// around each read of it), so a slow upload is not the upstream's delay;
// each resume gives the upstream the whole time again.
type upstreamClock struct {
	mu      sync.Mutex
	d       time.Duration
	expire  func()
	t       *time.Timer
	paused  bool
	stopped bool
	fired   bool
}

func newUpstreamClock(d time.Duration, expire func()) *upstreamClock {
	c := &upstreamClock{d: d, expire: expire}
	c.t = time.AfterFunc(d, c.fire)
	return c
}

func (c *upstreamClock) fire() {
	c.mu.Lock()
	if c.paused || c.stopped {
		c.mu.Unlock()
		return
	}
	c.fired = true
	c.mu.Unlock()
	c.expire()
}

func (c *upstreamClock) pause() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.paused = true
	c.t.Stop()
}

func (c *upstreamClock) resume() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.paused && !c.stopped && !c.fired {
		c.paused = false
		c.t.Reset(c.d)
	}
}

// stop reports whether the clock had not run out.
func (c *upstreamClock) stop() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.stopped = true
	c.t.Stop()
	return !c.fired
}

func recordDial(ctx context.Context, derr *dialError, took time.Duration) {
	info, _ := ctx.Value(attemptKey).(*attemptInfo)
	if info == nil {
		return
	}
	info.mu.Lock()
	defer info.mu.Unlock()
	if derr != nil {
		info.dialErr = derr
		return
	}
	info.dialed = true
	info.dialTook = took
}

func (i *attemptInfo) get() (*dialError, bool, time.Duration) {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.dialErr, i.dialed, i.dialTook
}

// maxTransports bounds the per-upstream transports kept with idle connections.
const maxTransports = 1024

// transportCache keeps one http.Transport per upstream (and credential), so
// that plain requests reuse upstream connections.
type transportCache struct {
	l  *Listener
	mu sync.Mutex
	m  map[string]*http.Transport
}

func newTransportCache(l *Listener) *transportCache {
	return &transportCache{l: l, m: make(map[string]*http.Transport)}
}

func (tc *transportCache) get(u *pool.Upstream) *http.Transport {
	k := u.ID() + "\x00" + u.Username + "\x00" + u.Password
	tc.mu.Lock()
	defer tc.mu.Unlock()
	if tr, ok := tc.m[k]; ok {
		return tr
	}
	if len(tc.m) >= maxTransports {
		for old, tr := range tc.m { // evict one arbitrary entry
			tr.CloseIdleConnections()
			delete(tc.m, old)
			break
		}
	}
	tr := tc.newTransport(u)
	tc.m[k] = tr
	return tr
}

func (tc *transportCache) closeIdle() {
	tc.mu.Lock()
	defer tc.mu.Unlock()
	for k, tr := range tc.m {
		tr.CloseIdleConnections()
		delete(tc.m, k)
	}
}

func (tc *transportCache) newTransport(u *pool.Upstream) *http.Transport {
	d := tc.l.dialer
	tr := &http.Transport{
		Proxy:                  nil, // never from the environment
		TLSClientConfig:        &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: tc.l.cfg.RootCAs},
		TLSHandshakeTimeout:    d.handshakeTimeout,
		DisableCompression:     true, // the client's Accept-Encoding goes through as sent
		MaxIdleConns:           512,
		MaxIdleConnsPerHost:    128,
		IdleConnTimeout:        90 * time.Second,
		ExpectContinueTimeout:  time.Second,
		ResponseHeaderTimeout:  tc.l.cfg.ResponseTimeout,
		MaxResponseHeaderBytes: 1 << 20,
		ForceAttemptHTTP2:      false,
	}
	switch u.Protocol {
	case pool.SOCKS5:
		tr.DialContext = func(ctx context.Context, _, addr string) (net.Conn, error) {
			host, port, err := splitHostPort(addr, 0)
			if err != nil {
				return nil, err
			}
			start := time.Now()
			c, derr := d.tunnel(ctx, u, socks5.Addr{Host: host, Port: port})
			recordDial(ctx, derr, time.Since(start))
			if derr != nil {
				return nil, derr
			}
			return c, nil
		}
	default:
		pu := &url.URL{Scheme: "http", Host: u.Address}
		tr.Proxy = func(*http.Request) (*url.URL, error) { return pu, nil }
		if a := basicAuth(u); a != "" {
			tr.ProxyConnectHeader = http.Header{"Proxy-Authorization": {a}}
		}
		tr.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
			start := time.Now()
			c, derr := d.dialTCP(ctx, u)
			recordDial(ctx, derr, time.Since(start))
			if derr != nil {
				return nil, derr
			}
			return c, nil
		}
		tr.OnProxyConnectResponse = func(ctx context.Context, _ *url.URL, _ *http.Request, resp *http.Response) error {
			var derr *dialError
			switch s := resp.StatusCode; {
			case s >= 200 && s < 300:
				return nil
			case s == http.StatusProxyAuthRequired:
				derr = &dialError{result: pool.AuthRejected, status: s, err: errors.New("upstream answered 407")}
			case s == http.StatusBadGateway || s == http.StatusGatewayTimeout:
				derr = &dialError{result: pool.DestinationError, status: s, err: errors.New("upstream answered " + strconv.Itoa(s))}
			default:
				derr = &dialError{result: pool.ProxyError, status: s, err: errors.New("upstream answered " + strconv.Itoa(s))}
			}
			recordDial(ctx, derr, 0)
			return derr
		}
	}
	return tr
}

// idempotent reports whether sending a request twice has the effect of
// sending it once (RFC 9110 §9.2.2).
func idempotent(method string) bool {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace, http.MethodPut, http.MethodDelete:
		return true
	}
	return false
}

// replayBody lets a request body be handed to another attempt as long as the
// failed attempt read none of it.
type replayBody struct {
	rc       io.ReadCloser
	read     atomic.Int64
	inflight atomic.Int32
	bad      atomic.Bool // reading the client's body failed: the client's fault
	cur      *bodyAttempt
}

// bodyAttempt is one attempt's view of the client's body. Its reads pause
// the attempt's clock: waiting for the client is not the upstream's delay.
type bodyAttempt struct {
	rb    *replayBody
	clock *upstreamClock
	dead  atomic.Bool
}

var (
	errAttemptOver = errors.New("request attempt over")
	errHeadTimeout = errors.New("no response head in time")
)

func (a *bodyAttempt) Read(p []byte) (int, error) {
	rb := a.rb
	rb.inflight.Add(1)
	defer rb.inflight.Add(-1)
	if a.dead.Load() {
		return 0, errAttemptOver
	}
	a.clock.pause()
	n, err := rb.rc.Read(p)
	a.clock.resume()
	rb.read.Add(int64(n))
	if err != nil && err != io.EOF {
		rb.bad.Store(true)
	}
	return n, err
}

// Close does not close the client's body: the server does, and a retry may
// still need it.
func (a *bodyAttempt) Close() error { return nil }

// next ends the current attempt's view of the body and returns a fresh one
// (whose clock the caller sets before use), or nil when bytes were already
// consumed (the request cannot be replayed).
func (rb *replayBody) next() *bodyAttempt {
	if rb.cur != nil {
		rb.cur.dead.Store(true)
		if rb.inflight.Load() > 0 || rb.read.Load() > 0 {
			return nil
		}
	}
	rb.cur = &bodyAttempt{rb: rb}
	return rb.cur
}

// flushingBody is an answer's body on Transport (TLS to the destination, or
// "Expect: 100-continue"). It flushes what the client was given so far
// before each read, since it cannot tell whether the read will wait:
// otherwise a streamed answer would sit in the response's buffer until that
// fills (goproxy flushes event streams only). A plainBody flushes only
// before a read that would wait (headLimit.idle).
type flushingBody struct {
	io.ReadCloser
	flush func() error
}

func (b *flushingBody) Read(p []byte) (int, error) {
	_ = b.flush()
	return b.ReadCloser.Read(p)
}

// tlsFailure reports whether err is the destination's TLS failing: its
// certificate not verified, a TLS alert, or no TLS at all.
func tlsFailure(err error) bool {
	var (
		verify *tls.CertificateVerificationError
		alert  tls.AlertError
		record tls.RecordHeaderError
	)
	return errors.As(err, &verify) || errors.As(err, &alert) || errors.As(err, &record)
}

// releaseBody releases the upstream when the response body is done.
type releaseBody struct {
	io.ReadCloser
	once    sync.Once
	release func()
}

func (b *releaseBody) Close() error {
	err := b.ReadCloser.Close()
	b.once.Do(b.release)
	return err
}

func errorResponse(req *http.Request, status int) *http.Response {
	text := textBadGateway
	switch status {
	case http.StatusGatewayTimeout:
		text = textTimeout
	case http.StatusBadRequest:
		text = textBadRequest
	}
	return &http.Response{
		Status:        strconv.Itoa(status) + " " + http.StatusText(status),
		StatusCode:    status,
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        http.Header{"Content-Type": {"text/plain; charset=utf-8"}, "Content-Length": {strconv.Itoa(len(text))}},
		Body:          io.NopCloser(strings.NewReader(text)),
		ContentLength: int64(len(text)),
		Request:       req,
	}
}

// roundTrip sends one plain request through upstreams picked from the pool,
// trying others before any answer reached the client while the request can
// still be sent again. It never returns an error: goproxy would put its text
// in the body.
func (l *Listener) roundTrip(req *http.Request, _ *goproxy.ProxyCtx) (*http.Response, error) {
	ctx := req.Context()
	cc, _ := ctx.Value(connKey).(*clientConn)
	key, _ := ctx.Value(keyKey).(string)
	// req's hop-by-hop headers went in serveHTTP, before goproxy.
	var rb *replayBody
	if req.Body != nil && req.Body != http.NoBody {
		rb = &replayBody{rc: req.Body}
	}
	preq := pool.Request{Listener: l.cfg.Name, Key: key}
	start := time.Now()
	outcome := OutcomeNoUpstream
	status := http.StatusBadGateway
	attempt := 0
	defer func() {
		if cc != nil {
			cc.retries.Add(int32(attempt))
		}
	}()
	for ; attempt <= l.cfg.Retries; attempt++ {
		if attempt > 0 && time.Since(start) >= l.cfg.RetryTimeout {
			break
		}
		var body *bodyAttempt
		if rb != nil {
			if body = rb.next(); body == nil {
				break // part of the body went to the failed attempt
			}
		}
		up, err := l.pool.Pick(ctx, preq)
		if err != nil || up == nil {
			break
		}
		// Wait on the upstream up to ResponseTimeout at a time (see
		// upstreamClock), but for a request without body (which another
		// upstream could take) only as long as the retry budget lasts: an
		// upstream that accepts and never answers must not hold the client
		// past the bounded time.
		headWait := l.cfg.ResponseTimeout
		if rb == nil {
			headWait = min(headWait, max(l.cfg.RetryTimeout-time.Since(start), time.Millisecond))
		}
		info := &attemptInfo{}
		actx, cancelAttempt := context.WithCancelCause(context.WithValue(ctx, attemptKey, info))
		clock := newUpstreamClock(headWait, func() { cancelAttempt(errHeadTimeout) })
		out := req.WithContext(actx)
		if body != nil {
			body.clock = clock
			out.Body = body
		}
		out.Header = req.Header.Clone()
		// The client's "Connection: close" (or HTTP/1.0 without keep-alive)
		// is about its own connection: the upstream connection stays open
		// for the next request.
		out.Close = false
		if _, ok := out.Header["User-Agent"]; !ok {
			out.Header["User-Agent"] = []string{""} // or Go would name itself
		}
		if up.Protocol != pool.SOCKS5 && req.URL.Scheme == "http" {
			if a := basicAuth(up); a != "" {
				out.Header.Set("Proxy-Authorization", a)
			}
		}
		t0 := time.Now()
		var resp *http.Response
		// Our own connections, but for TLS to the destination and for
		// "Expect: 100-continue", where Transport holds the body back until
		// the upstream asks for it. The attempt's clock covers both.
		if out.URL.Scheme == "http" && out.Header.Get("Expect") == "" {
			resp, err = l.plain.roundTrip(actx, up, out)
		} else {
			resp, err = l.transports.get(up).RoundTrip(out)
		}
		took := time.Since(t0)
		if !clock.stop() && err == nil {
			_ = resp.Body.Close() // the head came just as the wait ended
			resp, err = nil, errHeadTimeout
		}
		derr, dialed, dialTook := info.get()
		var res pool.Result
		stale := errors.Is(err, errStaleConn)
		switch {
		case err == nil && up.Protocol != pool.SOCKS5 && resp.StatusCode == http.StatusProxyAuthRequired:
			_ = resp.Body.Close()
			res = pool.AuthRejected
		case err == nil:
			res = pool.Success
		case rb != nil && rb.bad.Load():
			res = pool.Canceled // the client's body was broken or cut: no verdict on the upstream
			status = http.StatusBadRequest
		case stale, errors.Is(err, errListenerClosed):
			// A kept connection the other side closed while idle, or the
			// listener closing: no verdict on the upstream.
			res = pool.Canceled
		case derr != nil:
			res = derr.result
		case ctx.Err() != nil:
			res = pool.Canceled
		case tlsFailure(err):
			// The upstream carried the connection; the destination's TLS
			// did not hold (an untrusted or wrong certificate, no TLS at
			// all). Another upstream would reach the same destination.
			res = pool.DestinationError
		default:
			res = pool.HandshakeTimeout // no or malformed answer
		}
		if res == pool.Success {
			if dialed {
				took = dialTook
				l.obs.Dialed(up.Protocol, dialTook)
			}
			l.pool.Report(up, pool.Success, took)
			stripHop(resp.Header, false)
			if w, ok := ctx.Value(writerKey).(http.ResponseWriter); ok {
				flush := http.NewResponseController(w).Flush
				if pb, ok := resp.Body.(*plainBody); ok {
					pb.pc.head.idle = func() { _ = flush() }
				} else {
					resp.Body = &flushingBody{ReadCloser: resp.Body, flush: flush}
				}
			}
			resp.Body = &releaseBody{ReadCloser: resp.Body, release: func() {
				cancelAttempt(nil)
				l.pool.Release(up)
			}}
			if cc != nil {
				cc.setOutcome(OutcomeOK)
			}
			return resp, nil
		}
		if dialed {
			took = dialTook
		}
		cancelAttempt(nil)
		l.log.Debug("plain request attempt failed", "upstream", up.ID(), "result", res.String(), "err", err)
		l.pool.Report(up, res, took)
		l.pool.Release(up)
		outcome = OutcomeUpstreamError
		if stale && idempotent(req.Method) {
			continue // again, if the body can still be sent
		}
		if stale {
			break // the upstream may have acted on it: not sent twice
		}
		if res == pool.Canceled {
			outcome = OutcomeClientError
			break
		}
		if !res.UpstreamFault() {
			if derr != nil && derr.status == http.StatusGatewayTimeout {
				status = http.StatusGatewayTimeout
			}
			break
		}
		preq.Avoid = append(preq.Avoid, up.ID())
	}
	if attempt > l.cfg.Retries {
		attempt = l.cfg.Retries
	}
	if cc != nil {
		cc.setOutcome(outcome)
	}
	return errorResponse(req, status), nil
}
