package forward

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"math"
	"net/http"
	"net/http/httputil"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/net/http/httpguts"

	"github.com/proxyd/proxyd/forward/socks5"
)

// The HTTP listener serves each client connection in one goroutine of its
// own, without net/http's server or a proxy library: it reads a request
// head, serves the request (a CONNECT tunnel, a WebSocket upgrade, or a
// plain request through the attempt loop, its answer written back), and
// reads the next head on the same connection until the client or proxyd
// ends it. net/http's server cost every plain request a context, four read
// deadlines and a background-read goroutine started and aborted, and
// goproxy its handler on top; in the rig (BENCHMARKS.md), the same run with
// both builds side by side, serving requests here took proxyd's CPU per
// keep-alive request from 66 to 48 µs at 32 concurrent clients and from 179
// to 125 µs at one (the plain io.Copy forwarder: 50 and 154).
//
// What the server did that a proxy needs is done here: the request head
// is bounded in size (maxHeaderBytes) and time (header_timeout, and
// idle_timeout between requests), a malformed head gets 400 and the
// checks net/http's server adds to http.ReadRequest (host, header names and
// values, expectations), "Expect: 100-continue" gets its 100 when the body
// is first read, an answer is framed for the client's HTTP version, and a
// client that hangs up while its answer is awaited ends its request's
// attempts (clientWatch).

// httpConn is one client connection of the HTTP listener.
type httpConn struct {
	l   *Listener
	cc  *clientConn
	lr  io.LimitedReader // bounds a request head (maxHeaderBytes); a body reads freely
	br  *bufio.Reader
	bw  *bufio.Writer // writes through out
	out answerOut
	// ctx is what the connection's plain requests run under: it ends when
	// the client hangs up (clientWatch) or the listener closes. Made at the
	// first plain request.
	ctx    context.Context
	cancel context.CancelCauseFunc
	watch  clientWatch
	flush  func() // flushes bw: what an answer's streaming calls before it waits
	// unread: a request body was left unread, and an attempt's goroutine
	// may still read it through br, which then does not go back to the pool.
	unread bool
}

// answerOut is where answers to a client are written: each write is
// bounded by idle_timeout, so that a client that stops reading its answer
// ends it, as one that stalls its upload does, and is the client's failure.
type answerOut struct {
	d       idleDeadline
	stalled bool // a write ran into the deadline
}

func (o *answerOut) Write(p []byte) (int, error) {
	o.d.arm()
	n, err := o.d.conn.Write(p)
	if err != nil && isTimeout(err) {
		o.stalled = true
	}
	return n, err
}

// errClientLeft: the client hung up while its answer was awaited.
var errClientLeft = errors.New("client closed its connection")

// headReaders and answerWriters hold the buffers of HTTP connections: a
// tunnel gives them back once it is set up, so that an idle tunnel holds
// none.
var (
	headReaders   = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 4<<10) }}
	answerWriters = sync.Pool{New: func() any { return bufio.NewWriterSize(nil, 4<<10) }}
)

// maxHeaderBytes bounds a request head.
const maxHeaderBytes = 64 << 10

// serveHTTPConn serves a client connection of the HTTP listener, request
// after request.
func (l *Listener) serveHTTPConn(cc *clientConn) {
	hc := &httpConn{l: l, cc: cc}
	hc.lr.R = cc
	hc.br = headReaders.Get().(*bufio.Reader)
	hc.br.Reset(&hc.lr)
	defer hc.release()
	for first := true; ; first = false {
		if !hc.awaitHead(first) {
			_ = cc.Close()
			return
		}
		req, err := http.ReadRequest(hc.br)
		if err == nil {
			err = checkHead(req)
		}
		if err != nil {
			cc.setOutcome(OutcomeClientError)
			var bad badHead
			switch {
			case hc.lr.N == 0:
				l.obs.Requested(OutcomeClientError)
				l.refuseConn(cc, http.StatusRequestHeaderFieldsTooLarge, "request header too large\n", "")
			case errors.As(err, &bad):
				l.obs.Requested(OutcomeClientError)
				l.refuseConn(cc, bad.status, textBadRequest, "")
			case isTimeout(err) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
				_ = cc.Close() // nothing more will come, and nothing was answered
			default:
				l.obs.Requested(OutcomeClientError)
				l.refuseConn(cc, http.StatusBadRequest, textBadRequest, "")
			}
			return
		}
		hc.lr.N = math.MaxInt64
		_ = cc.SetReadDeadline(time.Time{}) // a body's reads set their own
		if req.Method == http.MethodConnect {
			key, ok := l.login(cc, req.Header)
			if !ok {
				l.refuseConn(cc, http.StatusProxyAuthRequired, textAuth, "Proxy-Authenticate: "+challenge+"\r\n")
				return
			}
			l.serveConnect(cc, hc.br, req, key)
			return
		}
		keep := hc.servePlain(req)
		l.obs.Requested(cc.lastOutcome())
		if !keep {
			return
		}
	}
}

// release gives the connection's buffers back and ends its context; the
// connection itself is closed by whoever owns it last (a tunnel's relay).
func (hc *httpConn) release() {
	hc.watch.end()
	if done := hc.watch.running(); done != nil {
		<-done // the connection is closed: its wait ends at once
	}
	if !hc.unread {
		hc.br.Reset(nil)
		headReaders.Put(hc.br)
	}
	if hc.bw != nil {
		hc.bw.Reset(nil)
		answerWriters.Put(hc.bw)
	}
	if hc.cancel != nil {
		hc.cancel(nil)
	}
}

// awaitHead waits for the first bytes of the next request head: the first
// within header_timeout of the accept, the others within idle_timeout of
// the last answer, each head then whole within header_timeout. It reports
// false when none came, or when Shutdown closed the connection while it
// waited (a connection between requests is idle for Shutdown).
func (hc *httpConn) awaitHead(first bool) bool {
	l, cc := hc.l, hc.cc
	cc.idle.Store(true)
	if !first && l.stopping.Load() {
		return false
	}
	wait := l.cfg.IdleTimeout
	if first {
		wait = l.cfg.HeaderTimeout
	}
	_ = cc.SetReadDeadline(time.Now().Add(wait))
	if done := hc.watch.running(); done != nil {
		<-done // a started watch is the wait for the next head (clientWatch)
	}
	hc.lr.N = maxHeaderBytes
	for {
		// Empty lines before a request line are skipped (RFC 9112 §2.2):
		// some clients send CRLF after a body.
		b, err := hc.br.Peek(1)
		if err != nil {
			return false
		}
		if b[0] != '\r' && b[0] != '\n' {
			break
		}
		_, _ = hc.br.Discard(1)
	}
	if !cc.idle.CompareAndSwap(true, false) {
		return false // Shutdown closed it
	}
	if first {
		l.unfresh(cc)
	} else if !headInBuffer(hc.br) {
		_ = cc.SetReadDeadline(time.Now().Add(l.cfg.HeaderTimeout))
	}
	return true
}

// headInBuffer reports whether br holds a whole request head.
func headInBuffer(br *bufio.Reader) bool {
	b, _ := br.Peek(br.Buffered())
	return bytes.Contains(b, []byte("\n\r\n")) || bytes.Contains(b, []byte("\n\n"))
}

// badHead is a request head that http.ReadRequest takes and net/http's
// server refuses.
type badHead struct {
	status int
	why    string
}

func (b badHead) Error() string { return b.why }

// checkHead makes the checks net/http's server adds to http.ReadRequest
// (which takes the Host header out of the header and refuses two of
// them): HTTP/1.x, a valid host, header names and values that are tokens and text,
// and no expectation other than 100-continue. A missing Host header is let
// through: a request in absolute form names its host in the URI, which is
// all that proxyd goes by.
func checkHead(req *http.Request) error {
	if req.ProtoMajor != 1 {
		return badHead{http.StatusHTTPVersionNotSupported, "unsupported HTTP version"}
	}
	if !httpguts.ValidHostHeader(req.Host) {
		return badHead{http.StatusBadRequest, "malformed Host header"}
	}
	// http.ReadRequest refused invalid bytes in names and values already,
	// but lets a name with a space in it through.
	for k := range req.Header {
		if !httpguts.ValidHeaderFieldName(k) {
			return badHead{http.StatusBadRequest, "invalid header name"}
		}
	}
	if e := req.Header["Expect"]; len(e) > 0 && !httpguts.HeaderValuesContainsToken(e, "100-continue") {
		return badHead{http.StatusExpectationFailed, "unsupported expectation"}
	}
	return nil
}

// servePlain serves a request other than CONNECT and reports whether the
// connection may carry the next one.
func (hc *httpConn) servePlain(req *http.Request) bool {
	l, cc := hc.l, hc.cc
	if hc.bw == nil {
		hc.out.d = idleDeadline{conn: cc, idle: l.cfg.IdleTimeout, write: true}
		hc.bw = answerWriters.Get().(*bufio.Writer)
		hc.bw.Reset(&hc.out)
		hc.flush = func() { _ = hc.bw.Flush() }
		hc.ctx, hc.cancel = context.WithCancelCause(l.ctx)
		hc.watch.hc = hc
	}
	var body *requestBody
	if req.Body != http.NoBody && req.Body != nil {
		body = &requestBody{rc: req.Body, hc: hc,
			expect: req.ProtoAtLeast(1, 1) && httpguts.HeaderValuesContainsToken(req.Header["Expect"], "100-continue")}
		req.Body = body
	}
	key, ok := l.login(cc, req.Header)
	if !ok {
		resp := errorResponse(req, http.StatusProxyAuthRequired, textAuth)
		resp.Header["Proxy-Authenticate"] = []string{challenge}
		return hc.writeAnswer(req, body, resp)
	}
	if req.URL.Scheme == "ws" && isUpgrade(req.Header) {
		req.URL.Scheme = "http" // some WebSocket clients name the scheme of the upgrade
	}
	if !req.URL.IsAbs() || req.URL.Host == "" || (req.URL.Scheme != "http" && req.URL.Scheme != "https") {
		cc.setOutcome(OutcomeClientError)
		return hc.answerError(req, body, http.StatusBadRequest, textBadRequest)
	}
	defPort := uint16(80)
	if req.URL.Scheme == "https" {
		defPort = 443
	}
	host, port, err := splitHostPort(req.URL.Host, defPort)
	if err == nil {
		err = l.dest.check(host, port)
	}
	if err != nil {
		o, status, text := refusal(err)
		cc.setOutcome(o)
		return hc.answerError(req, body, status, text)
	}
	// The absolute URI decides; a different Host header would let the
	// origin see another target than the one checked.
	req.Host = req.URL.Host
	if isUpgrade(req.Header) {
		return hc.serveUpgrade(req, body, key, socks5.Addr{Host: host, Port: port})
	}
	stripHop(req.Header, false)
	gen := hc.watch.begin(body == nil)
	if body != nil {
		body.gen = gen
	}
	resp := l.roundTrip(hc.ctx, cc, req, key, hc.flush)
	return hc.writeAnswer(req, body, resp)
}

// answerError answers req with a short text of proxyd's own.
func (hc *httpConn) answerError(req *http.Request, body *requestBody, status int, text string) bool {
	return hc.writeAnswer(req, body, errorResponse(req, status, text))
}

// writeAnswer writes resp to the client, framed for the client's HTTP
// version, closes resp's body, and reports whether the connection may
// carry the next request: the client did not ask to close, proxyd is not
// shutting down, the answer's end is known to the client, and the
// request's body was read to its end (what a client sends after a body it
// was not asked for would be read as the next request).
func (hc *httpConn) writeAnswer(req *http.Request, body *requestBody, resp *http.Response) bool {
	bw := hc.bw
	if body != nil {
		body.discardRest()
		body.answered()
	}
	keep := !req.Close && !hc.l.stopping.Load() && (body == nil || body.done())
	status := resp.StatusCode
	noBody := req.Method == http.MethodHead || status == http.StatusNoContent || status == http.StatusNotModified || status < 200
	chunked := false
	h := resp.Header
	switch {
	case noBody:
	case resp.ContentLength >= 0:
		if _, ok := h["Content-Length"]; !ok {
			h["Content-Length"] = []string{strconv.FormatInt(resp.ContentLength, 10)}
		}
	case req.ProtoAtLeast(1, 1):
		chunked = true
		delete(h, "Content-Length")
	default:
		keep = false // an HTTP/1.0 client reads to the connection's end
		delete(h, "Content-Length")
	}
	_, _ = bw.WriteString("HTTP/1.1 ")
	_, _ = bw.Write(strconv.AppendInt(bw.AvailableBuffer(), int64(status), 10))
	_ = bw.WriteByte(' ')
	if text := http.StatusText(status); text != "" {
		_, _ = bw.WriteString(text)
	} else {
		_, _ = bw.WriteString("status code " + strconv.Itoa(status))
	}
	_, _ = bw.WriteString("\r\n")
	if !keep {
		_, _ = bw.WriteString("Connection: close\r\n")
	} else if !req.ProtoAtLeast(1, 1) {
		_, _ = bw.WriteString("Connection: keep-alive\r\n")
	}
	if chunked {
		_, _ = bw.WriteString("Transfer-Encoding: chunked\r\n")
		if len(resp.Trailer) > 0 {
			names := make([]string, 0, len(resp.Trailer))
			for k := range resp.Trailer {
				names = append(names, k)
			}
			_, _ = bw.WriteString("Trailer: " + strings.Join(names, ", ") + "\r\n")
		}
	}
	_ = h.Write(bw)
	if _, ok := h["Date"]; !ok { // written straight into bw, as net/http's server does
		_, _ = bw.WriteString("Date: ")
		_, _ = bw.Write(time.Now().UTC().AppendFormat(bw.AvailableBuffer(), http.TimeFormat))
		_, _ = bw.WriteString("\r\n")
	}
	_, err := bw.WriteString("\r\n")
	if err == nil && !noBody {
		// Through a buffer of its own, not bw.ReadFrom: the body's reads
		// flush bw before they wait (hc.flush), which must not happen
		// while bw reads into itself.
		buf := copyBufs.Get().(*[]byte)
		src := struct{ io.Reader }{resp.Body}
		if chunked {
			cw := httputil.NewChunkedWriter(bw)
			if _, err = io.CopyBuffer(cw, src, *buf); err == nil {
				_ = cw.Close()
				_ = resp.Trailer.Write(bw)
				_, err = bw.WriteString("\r\n")
			}
		} else {
			var n int64
			n, err = io.CopyBuffer(struct{ io.Writer }{bw}, src, *buf)
			if err == nil && resp.ContentLength >= 0 && n != resp.ContentLength {
				err = io.ErrUnexpectedEOF
			}
		}
		copyBufs.Put(buf)
	}
	// The upstream connection goes back before the client hears the end:
	// its next request may take it.
	_ = resp.Body.Close()
	if err == nil {
		err = bw.Flush()
	}
	hc.watch.end()
	if hc.out.stalled {
		hc.cc.setOutcome(OutcomeClientError)
	}
	if err != nil || !keep {
		// A broken answer leaves the client unable to tell where the next
		// one starts; a closing one lets the client read it first.
		if body != nil && !body.done() {
			hc.unread = true
			lingerClose(hc.cc)
		} else {
			_ = hc.cc.Close()
		}
		return false
	}
	return true
}

// requestBody is a plain request's body as the attempts read it. It sends
// "100 Continue" before its first read when the client asked for it,
// bounds each read by idle_timeout (a client that stalls its upload is the
// client's failure), and notes when it is read to its end, which the
// client's watch waits for. Once the answer is being written it is not
// read any more, as net/http's server did: the connection then closes
// unless the body was read whole, or nobody had read of it and its rest
// was small (discardRest).
type requestBody struct {
	rc      io.ReadCloser
	hc      *httpConn
	gen     uint64 // the request's number in its clientWatch
	mu      sync.Mutex
	expect  bool // the client waits for 100 Continue before it sends the body
	sent    bool // 100 Continue went out
	started bool // an attempt read of it
	over    bool // the answer is being written
	eof     bool
}

var errBodyNotWanted = errors.New("request body not read: the answer came first")

func (b *requestBody) Read(p []byte) (int, error) {
	cc := b.hc.cc
	b.mu.Lock()
	switch {
	case b.eof:
		b.mu.Unlock()
		return 0, io.EOF
	case b.over:
		b.mu.Unlock()
		return 0, errBodyNotWanted
	}
	b.started = true
	if b.expect && !b.sent {
		b.sent = true
		// Through out, whose deadline an earlier answer left: it moves it.
		_, _ = io.WriteString(&b.hc.out, "HTTP/1.1 100 Continue\r\n\r\n")
	}
	// Under mu: once the answer began, its own deadlines (a lingering
	// close) are not moved.
	_ = cc.SetReadDeadline(time.Now().Add(b.hc.l.cfg.IdleTimeout))
	b.mu.Unlock()
	n, err := b.rc.Read(p)
	if err == io.EOF {
		b.mu.Lock()
		if !b.over {
			_ = cc.SetReadDeadline(time.Time{})
		}
		b.eof = true
		b.mu.Unlock()
		b.hc.watch.bodyDone(b.gen)
	}
	return n, err
}

// Close does not close the client's body: its end is what done reports.
func (b *requestBody) Close() error { return nil }

// answered marks the answer's start: no more reads, and a client still
// waiting for 100 Continue gets none.
func (b *requestBody) answered() {
	b.mu.Lock()
	b.over = true
	b.mu.Unlock()
}

// done reports whether the body was read to its end.
func (b *requestBody) done() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.eof
}

// maxDiscard is the most of an unread body read away to keep its
// connection, as net/http's server did.
const maxDiscard = 256 << 10

// discardRest reads the rest of a body no attempt read (the request was
// refused before any was made: a 407, a 403), up to maxDiscard within
// header_timeout, so that the connection can carry the next request.
func (b *requestBody) discardRest() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.started || b.eof || (b.expect && !b.sent) {
		// Being read elsewhere, or through; or the client waits for a
		// 100 Continue and will send nothing.
		return
	}
	_ = b.hc.cc.SetReadDeadline(time.Now().Add(b.hc.l.cfg.HeaderTimeout))
	if _, err := io.CopyN(io.Discard, b.rc, maxDiscard+1); err == io.EOF {
		b.eof = true
		_ = b.hc.cc.SetReadDeadline(time.Time{})
	}
}

// watchAfter is how long a plain request's answer may take before proxyd
// watches its client's connection for a hang-up. Most answers come sooner,
// and watching costs a goroutine and a hand-off per request; a client that
// leaves within it has its request's attempts ended that much later.
const watchAfter = 20 * time.Millisecond

// clientWatch ends a plain request's attempts when its client hangs up:
// once the request's body is read (nothing else reads the client then)
// and its answer has not come within watchAfter, a goroutine waits for the
// client's next bytes. A hang-up (end of stream, reset) cancels the
// connection's context; bytes (a pipelined request) end the watch. The
// watch's wait then doubles as the wait for the next request head, which
// the serving goroutine takes over from it (awaitHead), so it is never cut
// short.
type clientWatch struct {
	hc     *httpConn
	mu     sync.Mutex
	timer  *time.Timer
	gen    uint64 // the request's number on the connection
	active bool   // a request's answer is awaited
	due    bool   // watchAfter passed
	body   bool   // the request's body is read
	done   chan struct{}
}

// begin starts the clock of a request whose body is read (bodyRead) or
// still to be read, and returns the request's number for bodyDone.
func (w *clientWatch) begin(bodyRead bool) uint64 {
	w.mu.Lock()
	w.gen++
	gen := w.gen
	w.active, w.due, w.body, w.done = true, false, bodyRead, nil
	w.mu.Unlock()
	if w.timer == nil {
		w.timer = time.AfterFunc(watchAfter, w.fire)
	} else {
		w.timer.Reset(watchAfter)
	}
	return gen
}

func (w *clientWatch) fire() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.due = true
	w.startLocked()
}

// bodyDone notes that request gen's body was read to its end (a late
// note about an earlier request changes nothing).
func (w *clientWatch) bodyDone(gen uint64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if gen != w.gen {
		return
	}
	w.body = true
	w.startLocked()
}

func (w *clientWatch) startLocked() {
	if !w.active || !w.due || !w.body || w.done != nil {
		return
	}
	done := make(chan struct{})
	hc := w.hc
	if !hc.l.spawn(func() {
		defer close(done)
		if _, err := hc.br.Peek(1); err != nil {
			hc.cancel(errClientLeft)
		}
	}) {
		return
	}
	w.done = done
}

// end stops the watch's clock once the answer is written; a watch that
// started goes on as the wait for the next head.
func (w *clientWatch) end() {
	if w.timer != nil {
		w.timer.Stop()
	}
	w.mu.Lock()
	w.active = false
	w.mu.Unlock()
}

// running returns the channel closed when a started watch's wait ended,
// or nil, and forgets it.
func (w *clientWatch) running() <-chan struct{} {
	w.mu.Lock()
	defer w.mu.Unlock()
	done := w.done
	w.done = nil
	return done
}
