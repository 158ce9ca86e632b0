package forward

import (
	"bufio"
	"errors"
	"io"
	"net"
	"time"

	"github.com/proxyd/proxyd/forward/socks5"
)

func (l *Listener) serveSOCKSConn(cc *clientConn) {
	handedOff := false
	defer func() {
		if !handedOff {
			_ = cc.Close()
		}
	}()
	_ = cc.SetDeadline(time.Now().Add(l.cfg.HeaderTimeout))
	var key string
	scfg := socks5.ServerConfig{
		RequireAuth: l.auth.required(),
		Authenticate: func(user, pass string) bool {
			k, err := l.auth.check(user, pass, true)
			key = k
			return err == nil
		},
	}
	// Through a small buffer: a greeting and its methods, or a request and
	// its address, come in one read; what a client sends right behind its
	// request (without waiting for the reply) goes upstream first.
	br := bufio.NewReaderSize(cc, 512)
	req, err := socks5.ReadRequest(struct {
		io.Reader
		io.Writer
	}{br, cc}, scfg)
	if err != nil {
		var re *socks5.RequestError
		switch {
		case errors.As(err, &re):
			cc.setOutcome(OutcomeClientError)
			refuseSOCKS(cc, re.Reply)
		case errors.Is(err, socks5.ErrAuthFailed) || errors.Is(err, socks5.ErrNoAcceptableMethod):
			cc.setOutcome(OutcomeDenied)
		default:
			cc.setOutcome(OutcomeClientError)
		}
		return
	}
	if err := l.dest.check(req.Dest.Host, req.Dest.Port); err != nil {
		reply := byte(socks5.ReplyNotAllowed)
		cc.setOutcome(OutcomeDenied)
		if errors.Is(err, errBadDestination) {
			reply = socks5.ReplyAddressNotSupported
			cc.setOutcome(OutcomeClientError)
		}
		refuseSOCKS(cc, reply)
		return
	}
	// The request is read: the client now waits as long as the attempts
	// may take (they have their own bounds; a client that hangs up ends
	// them), then has HeaderTimeout to take the reply. Nothing is read from
	// it until the relay.
	_ = cc.SetReadDeadline(time.Time{})
	w := l.watchOpening(cc, br.Buffered() > 0)
	upc, up, retries, fail := l.openTunnel(w.ctx, key, req.Dest)
	w.stop()
	cc.retries.Add(int32(retries))
	if fail == nil && w.left() {
		cc.setOutcome(OutcomeClientError)
		l.abandon(cc, upc, up, key)
		return
	}
	_ = cc.SetWriteDeadline(time.Now().Add(l.cfg.HeaderTimeout))
	if fail != nil {
		cc.setOutcome(fail.outcome)
		refuseSOCKS(cc, fail.reply)
		return
	}
	handedOff = true
	if err := socks5.WriteReply(cc, socks5.ReplySucceeded, bindAddr(upc)); err != nil {
		cc.setOutcome(OutcomeClientError)
		l.abandon(cc, upc, up, key)
		return
	}
	cc.setOutcome(OutcomeOK)
	var pending []byte
	if n := br.Buffered(); n > 0 {
		pending, _ = br.Peek(n)
	}
	l.startRelay(cc, upc, up, key, pending)
}

// refuseSOCKS writes a failure reply to a request and closes the
// connection with a lingering close: bytes the client sent behind its
// request, unread, would make the close a reset, which can throw the reply
// away before the client reads it (as for an HTTP refusal, lingerClose).
func refuseSOCKS(cc *clientConn, reply byte) {
	_ = socks5.WriteReply(cc, reply, socks5.Addr{})
	lingerClose(cc)
}

// bindAddr is the address reported to the client: our side of the upstream
// connection (the upstream's own bound address means nothing to the client).
func bindAddr(c net.Conn) socks5.Addr {
	if ta, ok := c.LocalAddr().(*net.TCPAddr); ok {
		ap := ta.AddrPort()
		return socks5.Addr{Host: ap.Addr().Unmap().String(), Port: ap.Port()}
	}
	return socks5.Addr{}
}
