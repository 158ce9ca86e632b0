package forward

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/elazarl/goproxy"
	"github.com/proxyd/proxyd/forward/socks5"
	"github.com/proxyd/proxyd/pool"
)

type ctxKey int

const connKey ctxKey = iota // *clientConn of the request

// Short fixed answers: nothing from an error, a credential or an upstream
// ever reaches a client's body.
const (
	textBadRequest  = "bad request\n"
	textAuth        = "proxy authentication required\n"
	textRefused     = "destination refused\n"
	textBadGateway  = "bad gateway\n"
	textTimeout     = "gateway timeout\n"
	textUnavailable = "service unavailable\n"
)

// goproxyLogger sends goproxy's own log lines to slog at debug level.
type goproxyLogger struct{ log *slog.Logger }

func (g goproxyLogger) Printf(format string, v ...any) {
	g.log.Debug("goproxy", "msg", fmt.Sprintf(format, v...))
}

var errDirectDial = errors.New("direct dial disabled: every connection goes through the pool")

// initHTTP builds the goproxy server with its unsafe defaults replaced and
// the http.Server in front of it.
func (l *Listener) initHTTP() {
	p := goproxy.NewProxyHttpServer()
	p.Logger = goproxyLogger{l.log}
	p.Verbose = false
	// Never used (every request gets our RoundTripper), but its defaults read
	// the environment's proxy and skip TLS verification: replace them.
	p.Tr = &http.Transport{
		Proxy: nil,
		DialContext: func(context.Context, string, string) (net.Conn, error) {
			return nil, errDirectDial
		},
	}
	p.ConnectDial = func(string, string) (net.Conn, error) { return nil, errDirectDial }
	p.ConnectDialWithReq = nil
	p.ConnectionErrHandler = func(w io.Writer, _ *goproxy.ProxyCtx, _ error) {
		_, _ = io.WriteString(w, "HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain\r\nContent-Length: 12\r\nConnection: close\r\n\r\n"+textBadGateway)
	}
	p.NonproxyHandler = http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		plainError(w, http.StatusBadRequest, textBadRequest)
	})
	p.KeepAcceptEncoding = true // pass the client's choice through untouched
	// serveHTTP strips the hop-by-hop headers (Proxy-Authorization among
	// them) before goproxy sees the request: a second pass finds nothing.
	p.KeepHeader = true
	// roundTrip puts the answer's header fields in the writer itself
	// (handOver): goproxy must keep them.
	p.KeepDestinationHeaders = true
	p.AllowHTTP2 = false
	rt := goproxy.RoundTripperFunc(l.roundTrip)
	p.OnRequest().DoFunc(func(r *http.Request, ctx *goproxy.ProxyCtx) (*http.Request, *http.Response) {
		ctx.RoundTripper = rt
		return r, nil
	})
	l.proxy = p
	l.transports = newTransportCache(l)
	l.plain = newPlainConns(l.dialer, l.spawn)
	l.srv = &http.Server{
		Handler:           http.HandlerFunc(l.serveHTTP),
		ReadHeaderTimeout: l.cfg.HeaderTimeout,
		IdleTimeout:       l.cfg.IdleTimeout,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          log.New(io.Discard, "", 0),
		BaseContext:       func(net.Listener) context.Context { return l.ctx },
		ConnState:         l.trackFresh,
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			return context.WithValue(ctx, connKey, c)
		},
	}
	l.srv.SetKeepAlivesEnabled(true)
}

func plainError(w http.ResponseWriter, code int, text string) {
	h := w.Header()
	h.Set("Content-Type", "text/plain; charset=utf-8")
	h.Set("Content-Length", strconv.Itoa(len(text)))
	w.WriteHeader(code)
	_, _ = io.WriteString(w, text)
}

func (l *Listener) serveHTTP(w http.ResponseWriter, r *http.Request) {
	cc, _ := r.Context().Value(connKey).(*clientConn)
	if cc == nil {
		plainError(w, http.StatusInternalServerError, "internal error\n")
		return
	}
	key, ok := l.login(cc, r.Header)
	if !ok {
		w.Header().Set("Proxy-Authenticate", challenge)
		plainError(w, http.StatusProxyAuthRequired, textAuth)
		return
	}
	if r.Method == http.MethodConnect {
		// A CONNECT after other requests on the connection (a first one
		// never comes here, see serveHTTPConn).
		// The hijacked connection is cc, which the server was given.
		_, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			cc.setOutcome(OutcomeClientError)
			return
		}
		l.serveConnect(cc, brw.Reader, r, key)
		return
	}
	if r.URL.Scheme == "ws" && isUpgrade(r.Header) {
		r.URL.Scheme = "http" // some WebSocket clients name the scheme of the upgrade
	}
	if !r.URL.IsAbs() || r.URL.Host == "" || (r.URL.Scheme != "http" && r.URL.Scheme != "https") {
		cc.setOutcome(OutcomeClientError)
		plainError(w, http.StatusBadRequest, textBadRequest)
		return
	}
	defPort := uint16(80)
	if r.URL.Scheme == "https" {
		defPort = 443
	}
	host, port, err := splitHostPort(r.URL.Host, defPort)
	if err == nil {
		err = l.dest.check(host, port)
	}
	if err != nil {
		l.refuse(w, cc, err)
		return
	}
	if r.Host != "" && r.Host != r.URL.Host {
		// The absolute URI decides; a different Host header would let the
		// origin see another target than the one we checked.
		r.Host = r.URL.Host
	}
	if isUpgrade(r.Header) {
		l.serveUpgrade(w, r, cc, key, socks5.Addr{Host: host, Port: port})
		return
	}
	// Strip here, not in the RoundTripper: goproxy drops Connection before
	// we would see which headers it names.
	stripHop(r.Header, false)
	cc.key, cc.w = key, w
	l.proxy.ServeHTTP(w, r)
	cc.key, cc.w = "", nil
}

func (l *Listener) refuse(w http.ResponseWriter, cc *clientConn, err error) {
	o, status, text := refusal(err)
	cc.setOutcome(o)
	plainError(w, status, text)
}

// refusal is the answer to a destination that failed destPolicy.check or
// could not be parsed.
func refusal(err error) (Outcome, int, string) {
	if errors.Is(err, errRefusedDestination) {
		return OutcomeDenied, http.StatusForbidden, textRefused
	}
	return OutcomeClientError, http.StatusBadRequest, textBadRequest
}

// challenge is the Proxy-Authenticate value of a 407.
const challenge = `Basic realm="proxyd"`

// login checks a request's Proxy-Authorization against the local users and
// returns the request's sticky key; a failed login is the connection's
// outcome (denied).
func (l *Listener) login(cc *clientConn, h http.Header) (key string, ok bool) {
	user, pass, present := "", "", false
	if v := h.Get("Proxy-Authorization"); v != "" {
		user, pass, present = parseBasic(v)
		if !present {
			present = true // a malformed header is a failed login, not none
			user, pass = "\x00", ""
		}
	}
	key, err := l.auth.check(user, pass, present)
	if err != nil {
		cc.setOutcome(OutcomeDenied)
		return "", false
	}
	return key, true
}

// headReaders hold the buffers the first request of a connection is read
// through; they go back once its head is read.
var headReaders = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 4<<10) }}

// serveHTTPConn reads a client's first request head. A CONNECT, nearly
// every first request a proxy gets, is served right here; anything else
// goes to the HTTP server with the bytes read so far, and so does every
// request after it. net/http's server cost every tunnel set-up its own
// buffers, contexts, state hooks and a hijack: 16 % of proxyd's CPU per
// tunnel in the rig (BENCHMARKS.md).
func (l *Listener) serveHTTPConn(cc *clientConn) {
	_ = cc.SetReadDeadline(time.Now().Add(l.cfg.HeaderTimeout))
	lr := &io.LimitedReader{R: cc, N: maxHeaderBytes}
	br := headReaders.Get().(*bufio.Reader)
	br.Reset(lr)
	defer func() {
		br.Reset(nil)
		headReaders.Put(br)
	}()
	if head, err := br.Peek(len("CONNECT ")); err != nil || string(head) != "CONNECT " {
		if err != nil || !wholeHead(br) {
			_ = cc.Close() // nothing usable came within header_timeout
			return
		}
		b, _ := br.Peek(br.Buffered())
		cc.pre = append([]byte(nil), b...)
		_ = cc.SetReadDeadline(time.Time{}) // the server sets its own
		l.handToServer(cc)
		return
	}
	req, err := http.ReadRequest(br)
	l.unfresh(cc)
	if err != nil {
		cc.setOutcome(OutcomeClientError)
		switch {
		case lr.N == 0:
			l.refuseConn(cc, http.StatusRequestHeaderFieldsTooLarge, "request header too large\n", "")
		case isTimeout(err) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
			_ = cc.Close() // nothing more will come
		default:
			l.refuseConn(cc, http.StatusBadRequest, textBadRequest, "")
		}
		return
	}
	_ = cc.SetReadDeadline(time.Time{})
	key, ok := l.login(cc, req.Header)
	if !ok {
		l.refuseConn(cc, http.StatusProxyAuthRequired, textAuth, "Proxy-Authenticate: "+challenge+"\r\n")
		return
	}
	l.serveConnect(cc, br, req, key)
}

// refuseConn answers a request on a connection taken from (or never given
// to) the HTTP server, and closes the connection after a lingering close.
func (l *Listener) refuseConn(c net.Conn, status int, text, header string) {
	_ = c.SetWriteDeadline(time.Now().Add(l.cfg.HeaderTimeout))
	writeRawError(c, status, text, header)
	lingerClose(c)
}

// lingerWait bounds how long a refused client may keep sending before its
// connection closes.
const lingerWait = 2 * time.Second

// lingerClose closes c's sending side, drains what the client still sends
// (up to 64 KiB, within lingerWait), then closes c: closing with unread
// bytes (a CONNECT's early TLS hello, a body) would send a reset, which can
// throw the answer away before the client reads it.
func lingerClose(c net.Conn) {
	if cw, ok := c.(closeWriter); ok {
		_ = cw.CloseWrite()
	}
	_ = c.SetReadDeadline(time.Now().Add(lingerWait))
	_, _ = io.Copy(io.Discard, io.LimitReader(c, 64<<10))
	_ = c.Close()
}

// maxHeaderBytes bounds a request head, as the HTTP server's MaxHeaderBytes.
const maxHeaderBytes = 64 << 10

// wholeHead waits until br holds a whole request head or is full (the
// server reads the rest), so that header_timeout bounds the head's arrival
// once, not once here and again in the server.
func wholeHead(br *bufio.Reader) bool {
	for {
		b, _ := br.Peek(br.Buffered())
		if bytes.Contains(b, []byte("\n\r\n")) || bytes.Contains(b, []byte("\n\n")) || len(b) == br.Size() {
			return true
		}
		if _, err := br.Peek(len(b) + 1); err != nil {
			return false
		}
	}
}

func (l *Listener) unfresh(cc *clientConn) {
	if cc.fresh.CompareAndSwap(true, false) {
		l.fresh.Add(-1)
	}
}

// handToServer lets the HTTP server serve cc from its first request on.
func (l *Listener) handToServer(cc *clientConn) {
	one := &oneConn{c: cc}
	_ = l.srv.Serve(one)
	if !one.taken { // the server is shutting down
		_ = cc.Close()
	}
}

// oneConn is a net.Listener that hands the HTTP server one connection; the
// server's Serve returns when asked for the next.
type oneConn struct {
	c     net.Conn
	taken bool
}

var errServed = errors.New("connection handed to the server")

func (o *oneConn) Accept() (net.Conn, error) {
	if o.taken {
		return nil, errServed
	}
	o.taken = true
	return o.c, nil
}

func (o *oneConn) Close() error   { return nil }
func (o *oneConn) Addr() net.Addr { return o.c.LocalAddr() }

// serveConnect opens a tunnel for CONNECT on a connection taken from the
// server (or never given to it). It keeps the bytes the client sent right
// behind its request (already in br): a client may start its TLS handshake
// without waiting for our 200. An answer other than 200 closes the
// connection.
func (l *Listener) serveConnect(cc *clientConn, br *bufio.Reader, r *http.Request, key string) {
	host, port, err := splitHostPort(r.RequestURI, 0)
	if err == nil {
		err = l.dest.check(host, port)
	}
	if err != nil {
		o, status, text := refusal(err)
		cc.setOutcome(o)
		l.refuseConn(cc, status, text, "")
		return
	}
	var pending []byte
	if n := br.Buffered(); n > 0 {
		b, _ := br.Peek(n)
		pending = append([]byte(nil), b...)
	}
	upc, up, retries, fail := l.openTunnel(l.ctx, key, socks5.Addr{Host: host, Port: port})
	cc.retries.Add(int32(retries))
	// Only the answer's write needs a deadline: nothing is read from the
	// client before the relay.
	_ = cc.SetWriteDeadline(time.Now().Add(l.cfg.HeaderTimeout))
	if fail != nil {
		cc.setOutcome(fail.outcome)
		l.refuseConn(cc, fail.status, fail.text, "")
		return
	}
	if _, err := io.WriteString(cc, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		cc.setOutcome(OutcomeClientError)
		l.abandon(cc, upc, up)
		return
	}
	_ = cc.SetWriteDeadline(time.Time{})
	cc.setOutcome(OutcomeOK)
	l.startRelay(cc, upc, up, pending)
}

// abandon undoes a tunnel that will not be relayed.
func (l *Listener) abandon(cc *clientConn, upc net.Conn, up *pool.Upstream) {
	_ = upc.Close()
	l.pool.Release(up)
	_ = cc.Close()
}

// startRelay takes over a set-up tunnel: it moves the bytes already read on
// either side, then relays in two goroutines the listener owns, and the last
// of them to end closes both conns, releases the upstream and reports the
// connection. The caller's goroutine returns at once, so that an idle tunnel
// holds no handler stack or server buffers.
func (l *Listener) startRelay(cc *clientConn, upc net.Conn, up *pool.Upstream, pending []byte) {
	if !l.trackUpstream(upc) {
		cc.setOutcome(OutcomeClientError)
		l.abandon(cc, upc, up)
		return
	}
	done := func() {
		l.untrackUpstream(upc)
		l.abandon(cc, upc, up)
	}
	raw := upc
	if pc, ok := upc.(*prefixConn); ok {
		if _, err := cc.Write(pc.prefix); err != nil {
			done()
			return
		}
		raw = pc.Conn
	}
	if len(pending) > 0 {
		// Already counted when the server read them from the client.
		if _, err := raw.Write(pending); err != nil {
			done()
			return
		}
	}
	l.relay(cc, raw, done)
}

// writeRawError writes a short answer that closes the connection; header
// holds more header lines, each ending in CRLF.
func writeRawError(w io.Writer, status int, text, header string) {
	_, _ = fmt.Fprintf(w, "HTTP/1.1 %d %s\r\n%sContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
		status, http.StatusText(status), header, len(text), text)
}

// answerOverCap tells a client over the connection cap so, then lets it read
// the answer before the connection closes.
func (l *Listener) answerOverCap(c net.Conn) {
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if l.cfg.Protocol == ProtocolSOCKS5 {
		if _, err := socks5.ReadRequest(c, socks5.ServerConfig{}); err == nil {
			_ = socks5.WriteReply(c, socks5.ReplyGeneralFailure, socks5.Addr{})
		}
		return
	}
	writeRawError(c, http.StatusServiceUnavailable, textUnavailable, "")
	lingerClose(c)
}

// hop-by-hop headers never forwarded in either direction (RFC 9110 §7.6.1),
// plus the proxy credentials.
var hopHeaders = []string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Te", "Trailer",
	"Transfer-Encoding", "Upgrade", "Proxy-Authorization", "Proxy-Authenticate",
}

// stripHop removes hop-by-hop headers, including those Connection names.
// keepUpgrade keeps Connection: Upgrade and Upgrade for a proxied upgrade.
func stripHop(h http.Header, keepUpgrade bool) {
	for _, v := range h["Connection"] {
		for _, f := range strings.Split(v, ",") {
			f = strings.TrimSpace(f)
			if f == "" || keepUpgrade && strings.EqualFold(f, "upgrade") {
				continue
			}
			h.Del(f)
		}
	}
	upg := h.Values("Upgrade")
	for _, k := range hopHeaders {
		h.Del(k)
	}
	if keepUpgrade {
		h["Connection"] = []string{"Upgrade"}
		h["Upgrade"] = upg
	}
}

// isUpgrade reports a request asking for a protocol upgrade.
func isUpgrade(h http.Header) bool {
	if len(h.Values("Upgrade")) == 0 {
		return false
	}
	for _, v := range h.Values("Connection") {
		for _, f := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(f), "upgrade") {
				return true
			}
		}
	}
	return false
}

// serveUpgrade relays a protocol upgrade (WebSocket over plain HTTP): a
// tunnel to the origin through an upstream, the request in origin form, and
// after a 101 a relay that ends when either side closes.
func (l *Listener) serveUpgrade(w http.ResponseWriter, r *http.Request, cc *clientConn, key string, dest socks5.Addr) {
	if r.URL.Scheme != "http" {
		cc.setOutcome(OutcomeClientError)
		plainError(w, http.StatusBadRequest, textBadRequest)
		return
	}
	upc, up, retries, fail := l.openTunnel(r.Context(), key, dest)
	cc.retries.Add(int32(retries))
	if fail != nil {
		cc.setOutcome(fail.outcome)
		plainError(w, fail.status, fail.text)
		return
	}
	fail2 := func(o Outcome) {
		_ = upc.Close()
		l.pool.Release(up)
		cc.setOutcome(o)
	}
	out := r.Clone(r.Context())
	out.RequestURI = ""
	stripHop(out.Header, true)
	_ = upc.SetDeadline(time.Now().Add(l.cfg.HandshakeTimeout))
	stop := context.AfterFunc(r.Context(), func() { _ = upc.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if err := out.Write(upc); err != nil {
		fail2(OutcomeUpstreamError)
		plainError(w, http.StatusBadGateway, textBadGateway)
		return
	}
	br := bufio.NewReader(upc)
	resp, err := http.ReadResponse(br, out)
	if err != nil {
		fail2(OutcomeUpstreamError)
		plainError(w, http.StatusBadGateway, textBadGateway)
		return
	}
	if !stop() {
		fail2(OutcomeClientError)
		return
	}
	_ = upc.SetDeadline(time.Time{})
	if resp.StatusCode != http.StatusSwitchingProtocols {
		// No upgrade: pass the answer on and close this origin connection.
		stripHop(resp.Header, false)
		h := w.Header()
		for k, v := range resp.Header {
			h[k] = v
		}
		w.WriteHeader(resp.StatusCode)
		_, _ = io.Copy(w, resp.Body)
		_ = resp.Body.Close()
		fail2(OutcomeOK)
		return
	}
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		fail2(OutcomeClientError)
		return
	}
	var pending []byte
	if n := brw.Reader.Buffered(); n > 0 {
		b, _ := brw.Reader.Peek(n)
		pending = append([]byte(nil), b...)
	}
	stripHop(resp.Header, true)
	resp.Body = nil
	if err := resp.Write(conn); err != nil {
		cc.setOutcome(OutcomeClientError)
		l.abandon(cc, upc, up)
		return
	}
	if n := br.Buffered(); n > 0 {
		b, _ := br.Peek(n)
		upc = &prefixConn{Conn: upc, prefix: append([]byte(nil), b...)}
	}
	cc.setOutcome(OutcomeOK)
	l.startRelay(cc, upc, up, pending)
}
