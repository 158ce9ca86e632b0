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

	"github.com/proxyd/proxyd/forward/socks5"
	"github.com/proxyd/proxyd/pool"
)

type ctxKey int

const attemptKey ctxKey = iota // *attemptInfo of a plain attempt

// attemptInfo is what a transport's dialer learned during one attempt.
type attemptInfo struct {
	mu       sync.Mutex
	dialErr  *attemptError
	dialed   bool
	dialTook time.Duration
	// https: the request is an "https://" one, which goes through a
	// tunnel to the destination whatever the upstream's protocol.
	https bool
}

// errSendsUsed: the request went out as often as it may (maxSends).
var errSendsUsed = errors.New("request sent as often as it may be")

// upstreamClock is a plain request's response_timeout: it ends the
// request's attempts when the upstream side keeps proxyd waiting too long,
// for the answer's head or to take the next piece of a request body. It
// does not run while proxyd waits for the client's body (pause/resume
// around each read of it), so a slow upload is not the upstream's delay;
// each resume gives the upstream side the whole time again.
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

// recordDial notes in ctx's attemptInfo how dialing went.
func recordDial(ctx context.Context, derr *attemptError, took time.Duration) {
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

func (i *attemptInfo) get() (*attemptError, bool, time.Duration) {
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
		MaxResponseHeaderBytes: 1 << 20,
		ForceAttemptHTTP2:      false,
	}
	// A tunnel to the destination through u, made as a CONNECT or SOCKS5
	// client's is (dialer.tunnel: handshake_timeout, whose fault a failure
	// is): for every request through a SOCKS5 upstream, and for "https://"
	// ones through an HTTP upstream; Transport speaks TLS through it.
	tunnel := func(ctx context.Context, _, addr string) (net.Conn, error) {
		host, port, err := splitHostPort(addr, 0)
		if err != nil {
			return nil, err
		}
		c, took, derr := d.tunnel(ctx, u, socks5.Addr{Host: host, Port: port})
		recordDial(ctx, derr, took)
		if derr != nil {
			return nil, derr
		}
		return c, nil
	}
	tr.DialContext = tunnel
	if u.Protocol != pool.SOCKS5 {
		// "http://" requests (those with Expect: 100-continue) go to the
		// upstream in absolute form.
		pu := &url.URL{Scheme: "http", Host: u.Address}
		tr.Proxy = func(r *http.Request) (*url.URL, error) {
			if r.URL.Scheme == "https" {
				return nil, nil // through tunnel
			}
			return pu, nil
		}
		tr.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
			// A connection to the upstream itself only for an "http://"
			// request: the dial's context carries its request's values.
			if info, _ := ctx.Value(attemptKey).(*attemptInfo); info == nil || info.https || addr != u.Address {
				return tunnel(ctx, network, addr)
			}
			start := time.Now()
			c, derr := d.dialTCP(ctx, u)
			recordDial(ctx, derr, time.Since(start))
			if derr != nil {
				return nil, derr
			}
			return c, nil
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
	bad      atomic.Bool // reading the client's body failed or stalled: the client's fault
	cur      *bodyAttempt
	j        *job // whose response clock pauses while the client is waited for
}

// bodyAttempt is one attempt's view of the client's body. Its reads pause
// the request's response clock: waiting for the client is not the
// upstream's delay. (A client that sends nothing for idle_timeout fails
// the request: requestBody's bound.)
type bodyAttempt struct {
	rb   *replayBody
	dead atomic.Bool
}

var errAttemptOver = errors.New("request attempt over")

func (a *bodyAttempt) Read(p []byte) (int, error) {
	rb := a.rb
	rb.inflight.Add(1)
	defer rb.inflight.Add(-1)
	if a.dead.Load() {
		return 0, errAttemptOver
	}
	clock := rb.j.clock
	clock.pause()
	n, err := rb.rc.Read(p)
	clock.resume()
	rb.read.Add(int64(n))
	if err != nil && err != io.EOF {
		rb.bad.Store(true)
	}
	return n, err
}

// Close does not close the client's body: it belongs to the connection,
// and a retry may still need it.
func (a *bodyAttempt) Close() error { return nil }

// again ends the current attempt's view of the body and reports whether the
// body can go to another attempt (nothing of it was consumed).
func (rb *replayBody) again() bool {
	if rb.cur != nil {
		rb.cur.dead.Store(true)
	}
	return rb.inflight.Load() == 0 && rb.read.Load() == 0 && !rb.bad.Load()
}

// next returns a fresh view of the body for an attempt.
func (rb *replayBody) next() *bodyAttempt {
	if rb.cur != nil {
		rb.cur.dead.Store(true)
	}
	rb.cur = &bodyAttempt{rb: rb}
	return rb.cur
}

// flushingBody is an answer's body on Transport (TLS to the destination, or
// "Expect: 100-continue"). It flushes what the client was given so far
// before each read, since it cannot tell whether the read will wait:
// otherwise a streamed answer would sit in the answer's buffer until that
// fills. A plainBody flushes only before a read that would wait
// (headLimit.idle). A read that gets no byte for idle_timeout calls off
// its attempt (stall), which ends the read: the bound headLimit puts on
// the bodies of proxyd's own connections.
type flushingBody struct {
	io.ReadCloser
	flush func()
	stall *time.Timer // stopped; runs idle_timeout after a read starts
	idle  time.Duration
}

func (b *flushingBody) Read(p []byte) (int, error) {
	b.flush()
	b.stall.Reset(b.idle)
	n, err := b.ReadCloser.Read(p)
	b.stall.Stop()
	return n, err
}

func (b *flushingBody) Close() error {
	b.stall.Stop()
	return b.ReadCloser.Close()
}

// errBodyStalled: an answer's body got no byte for idle_timeout.
var errBodyStalled = errors.New("answer body stalled past idle_timeout")

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

func errorResponse(req *http.Request, status int, text string) *http.Response {
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

// resendable reports whether a request may be sent again while its first
// send is still in flight: GET, HEAD, OPTIONS or TRACE, or a request
// carrying Idempotency-Key (net/http's replay rule, without the older
// X-Idempotency-Key it also takes: a hedge is a deliberate second send),
// and without a body (which proxyd does not keep).
func resendable(req *http.Request) bool {
	if req.Body != nil && req.Body != http.NoBody {
		return false
	}
	switch req.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	_, key := req.Header["Idempotency-Key"]
	return key
}

// roundTrip sends one plain request through the attempt loop under ctx
// (the client connection's) and returns the answer to write: the
// destination's, or proxyd's own when no attempt succeeded. flush passes
// on what the client was given so far; a streamed answer calls it before
// it waits for more.
func (l *Listener) roundTrip(ctx context.Context, cc *clientConn, req *http.Request, key string, flush func()) *http.Response {
	// req's hop-by-hop headers are gone already.
	j := &job{key: key, plain: true, hedge: resendable(req), scheme: req.URL.Scheme, resendStale: idempotent(req.Method)}
	var rb *replayBody
	if req.Body != nil && req.Body != http.NoBody {
		rb = &replayBody{rc: req.Body, j: j}
		j.again = rb.again
	}
	j.do = func(ctx context.Context, up *pool.Upstream) tryResult { return l.plainAttempt(ctx, j, req, rb, up) }
	w, a, retries := l.run(ctx, j)
	cc.retries.Add(int32(retries))
	if w == nil {
		cc.setOutcome(a.outcome)
		return errorResponse(req, a.status, a.text)
	}
	resp := w.res.resp
	stripHop(resp.Header, false)
	if pb, ok := resp.Body.(*plainBody); ok {
		pb.pc.head.idle = flush
	} else {
		stall := time.AfterFunc(time.Hour, func() { w.cancel(errBodyStalled) })
		stall.Stop()
		resp.Body = &flushingBody{ReadCloser: resp.Body, flush: flush, stall: stall, idle: l.cfg.IdleTimeout}
	}
	resp.Body = &releaseBody{ReadCloser: resp.Body, release: func() {
		w.cancel(nil)
		l.release(w.up, key)
	}}
	cc.setOutcome(answerOutcome(resp.StatusCode))
	return resp
}

// plainAttempt sends req through up and waits for the answer's head.
func (l *Listener) plainAttempt(ctx context.Context, j *job, req *http.Request, rb *replayBody, up *pool.Upstream) tryResult {
	info := &attemptInfo{https: req.URL.Scheme == "https"}
	actx := context.WithValue(ctx, attemptKey, info)
	out := req.WithContext(actx)
	if rb != nil {
		out.Body = rb.next()
	}
	out.Header = req.Header.Clone()
	// The client's "Connection: close" (or HTTP/1.0 without keep-alive)
	// is about its own connection: the upstream connection stays open for
	// the next request.
	out.Close = false
	if _, ok := out.Header["User-Agent"]; !ok {
		out.Header["User-Agent"] = []string{""} // or Go would name itself
	}
	viaProxy := relaysHead(up, req.URL.Scheme)
	if viaProxy {
		if a := basicAuth(up); a != "" {
			out.Header.Set("Proxy-Authorization", a)
		}
	}
	var (
		resp *http.Response
		err  error
	)
	// Our own connections, but for TLS to the destination and for
	// "Expect: 100-continue", where Transport holds the body back until
	// the upstream asks for it.
	// The send is taken before a connection is: none is dialed for a
	// request that may not go out, and one whose latest write did not
	// happen or cannot have reached the destination gives it back below.
	took := j.send()
	switch {
	case !took:
		err = errSendsUsed
	case out.URL.Scheme == "http" && out.Header.Get("Expect") == "":
		resp, err = l.plain.roundTrip(actx, up, out, j.send)
	default:
		// One send per RoundTrip: a request Transport replays itself over
		// a new connection after a kept one failed is not counted.
		resp, err = l.transports.get(up).RoundTrip(out)
	}
	// took is dial + handshake (the pool's latency average): known only
	// when this attempt dialed. On a kept connection the wait is for the
	// destination's answer, which says nothing of the upstream.
	r := tryResult{err: err, tunneled: !viaProxy}
	sent := false // the request may have reached the destination
	aerr, dialed, dialTook := info.get()
	if dialed {
		r.took, r.dialed = dialTook, true
	}
	switch {
	case err == nil && viaProxy && (resp.StatusCode == http.StatusProxyAuthRequired ||
		squidOwnAnswer(resp.StatusCode, resp.Header.Get("X-Squid-Error"))):
		// The upstream's own answer, not the destination's: that attempt's
		// failure, not a win.
		pa := proxyAnswer(resp)
		_ = resp.Body.Close()
		r.h, r.err = pa.h, pa.err
		sent = resp.StatusCode != http.StatusProxyAuthRequired
	case err == nil:
		r.h.what, r.resp, sent = wAnswered, resp, true
	case errors.Is(err, errSendsUsed):
		r.h.what = wCalledOff // the hedge, or a resend, went out instead
	case rb != nil && rb.bad.Load():
		r.h.what = wClientGone // the client's body broke, was cut or stalled
	case errors.Is(err, errStaleConn):
		r.h.what, sent = wStale, true // a kept connection the other side closed while idle
	case errors.Is(err, errListenerClosed):
		r.h.what = wClientGone
	case aerr != nil:
		r.h = aerr.h // before anything was sent
	case ctx.Err() != nil:
		r.h.what, sent = wClientGone, true // or the loop's reason, which settle puts in
	case tlsFailure(err):
		// The upstream carried the connection; the destination's TLS did
		// not hold (an untrusted or wrong certificate, no TLS at all).
		r.h.what = wTLS
	case up.Protocol == pool.SOCKS5 || info.https:
		// A tunnel to the destination carried the request (its
		// handshake's failures are aerr's): what broke after it was open,
		// a TLS handshake that timed out included, is the destination's.
		r.h.what, sent = wDestinationGone, true
	default:
		r.h.what, sent = wNoAnswer, true // no or malformed answer
	}
	if took && !sent {
		j.unsend()
	}
	return r
}
