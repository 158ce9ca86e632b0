package forward

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/proxyd/proxyd/forward/socks5"
	"github.com/proxyd/proxyd/pool"
)

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

// initHTTP sets up what the HTTP listener's plain requests go through.
func (l *Listener) initHTTP() {
	l.transports = newTransportCache(l)
	l.plain = newPlainConns(l.dialer, l.spawn, l.cfg.IdleTimeout)
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

// refuseConn answers a request with an error that ends its connection,
// and closes the connection after a lingering close.
func (l *Listener) refuseConn(c net.Conn, status int, text, header string) {
	_ = c.SetWriteDeadline(time.Now().Add(l.cfg.HeaderTimeout))
	writeRawError(c, status, text, header)
	lingerClose(c)
}

// lingerWait bounds how long a refused client may keep sending before its
// connection closes.
const lingerWait = 2 * time.Second

// lingerClose closes c's sending side, drains what the client still sends
// until it closes its side too or lingerWait passed, then closes c: closing
// with unread bytes (a CONNECT's early TLS hello, a body the answer came
// before) would send a reset, which can throw the answer away before the
// client reads it.
func lingerClose(c net.Conn) {
	if cw, ok := c.(closeWriter); ok {
		_ = cw.CloseWrite()
	}
	_ = c.SetReadDeadline(time.Now().Add(lingerWait))
	_, _ = io.Copy(io.Discard, c)
	_ = c.Close()
}

// serveConnect opens a tunnel for CONNECT. It keeps the bytes the client sent right
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
	pending := bufferedCopy(br)
	w := l.watchOpening(cc, len(pending) > 0)
	upc, up, retries, fail := l.openTunnel(w.ctx, key, socks5.Addr{Host: host, Port: port})
	w.stop()
	cc.retries.Add(int32(retries))
	if fail == nil && w.left() {
		cc.setOutcome(OutcomeClientError)
		l.abandon(cc, upc, up, key)
		return
	}
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
		l.abandon(cc, upc, up, key)
		return
	}
	cc.setOutcome(OutcomeOK)
	l.startRelay(cc, upc, up, key, pending)
}

// abandon undoes a tunnel that will not be relayed; key is its pick's.
func (l *Listener) abandon(cc *clientConn, upc net.Conn, up *pool.Upstream, key string) {
	_ = upc.Close()
	l.release(up, key)
	_ = cc.Close()
}

// startRelay takes over a set-up tunnel: it moves the bytes already read on
// either side, then relays in two goroutines the listener owns, and the last
// of them to end closes both conns, releases the upstream and reports the
// connection. The caller's goroutine returns at once, so that an idle tunnel
// holds no handler stack or request buffers. The write deadline the
// caller's answer was bounded by still bounds the first of those bytes;
// the relay's writes then have none while both directions run: a tunnel
// whose client neither reads nor sends ends at idle_timeout by its read
// deadlines, and one whose client keeps sending without reading stays
// while it sends. Once one direction is over (a half-close), the other
// ends after an idle_timeout in which it moved nothing (watchLast).
func (l *Listener) startRelay(cc *clientConn, upc net.Conn, up *pool.Upstream, key string, pending []byte) {
	if !l.trackUpstream(upc) {
		cc.setOutcome(OutcomeClientError)
		l.abandon(cc, upc, up, key)
		return
	}
	done := func() {
		l.untrackUpstream(upc)
		l.abandon(cc, upc, up, key)
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
		// Already counted when they were read from the client.
		if _, err := raw.Write(pending); err != nil {
			done()
			return
		}
	}
	_ = cc.SetWriteDeadline(time.Time{})
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

// idleBody is the body of an origin's answer read straight from conn, which
// is not kept: each read is bounded by idle_timeout (a destination that
// stalls its body ends the answer; the client has what came before, which
// is flushed before a read that may wait), and Close closes conn instead
// of reading the rest.
type idleBody struct {
	io.Reader
	conn  net.Conn
	idle  time.Duration
	flush func()
}

func (b *idleBody) Read(p []byte) (int, error) {
	b.flush()
	_ = b.conn.SetReadDeadline(time.Now().Add(b.idle))
	return b.Reader.Read(p)
}

func (b *idleBody) Close() error { return b.conn.Close() }

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
// after a 101 a relay that ends when either side closes. It reports whether
// the connection may carry another request (no upgrade happened).
//
// Its client waits for the 101 as a tunnel's does for its answer, and is
// watched as one (openWatch) until the origin's answer came: a client that
// hangs up meanwhile ends the set-up. One that sent more than its request
// (a body, or early bytes) is there, and is not watched.
func (hc *httpConn) serveUpgrade(req *http.Request, body *requestBody, key string, dest socks5.Addr) bool {
	l, cc := hc.l, hc.cc
	if req.URL.Scheme != "http" {
		cc.setOutcome(OutcomeClientError)
		return hc.answerError(req, body, http.StatusBadRequest, textBadRequest)
	}
	w := l.watchOpening(cc, body != nil || hc.br.Buffered() > 0)
	upc, up, retries, fail := l.openTunnel(w.ctx, key, dest)
	cc.retries.Add(int32(retries))
	if fail != nil {
		w.stop()
		cc.setOutcome(fail.outcome)
		return hc.answerError(req, body, fail.status, fail.text)
	}
	fail2 := func(o Outcome) {
		_ = upc.Close()
		l.release(up, key)
		cc.setOutcome(o)
	}
	out := req.Clone(hc.ctx)
	out.RequestURI = ""
	stripHop(out.Header, true)
	// The tunnel is open, so the upstream did its part: the origin's answer
	// is a plain request's answer head, bounded by response_timeout, and
	// its absence or garbage is the destination's.
	_ = upc.SetDeadline(time.Now().Add(l.cfg.ResponseTimeout))
	stop := context.AfterFunc(w.ctx, func() { _ = upc.SetDeadline(time.Unix(1, 0)) })
	var resp *http.Response
	br := bufio.NewReader(upc)
	err := w.ctx.Err() // a client that left as the tunnel opened: nothing goes to the origin
	if err == nil {
		err = out.Write(upc)
	}
	if err == nil {
		resp, err = http.ReadResponse(br, out)
	}
	stop()
	// The client left, or the listener closed, before the answer: whatever
	// the origin said, nobody is there to take it.
	ended := w.ctx.Err() != nil
	w.stop()
	if ended {
		fail2(OutcomeClientError)
		_ = cc.Close()
		return false
	}
	if err != nil {
		fail2(OutcomeDestinationError)
		if isTimeout(err) {
			return hc.answerError(req, body, http.StatusGatewayTimeout, textTimeout)
		}
		return hc.answerError(req, body, http.StatusBadGateway, textBadGateway)
	}
	_ = upc.SetDeadline(time.Time{})
	if resp.StatusCode != http.StatusSwitchingProtocols {
		// No upgrade: pass the answer on, as a plain request's (its
		// outcome too; a client that stalls the copy makes it the
		// client's), and close this origin connection.
		stripHop(resp.Header, false)
		cc.setOutcome(answerOutcome(resp.StatusCode))
		resp.Body = &idleBody{Reader: resp.Body, conn: upc, idle: l.cfg.IdleTimeout, flush: hc.flush}
		keep := hc.writeAnswer(req, body, resp)
		l.release(up, key) // writeAnswer closed upc
		return keep
	}
	pending := bufferedCopy(hc.br)
	stripHop(resp.Header, true)
	resp.Body = nil
	_ = cc.SetWriteDeadline(time.Now().Add(l.cfg.HeaderTimeout))
	if err := resp.Write(cc); err != nil {
		cc.setOutcome(OutcomeClientError)
		l.abandon(cc, upc, up, key)
		return false
	}
	upc = withPrefix(upc, br)
	cc.setOutcome(OutcomeOK)
	l.startRelay(cc, upc, up, key, pending)
	return false
}
