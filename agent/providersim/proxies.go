package providersim

import (
	"bufio"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/proxyd/proxyd/forward/socks5"
)

// Proxy is one of the simulated provider's proxy servers: a small HTTP proxy
// (CONNECT and absolute-URI requests, Basic Proxy-Authorization) or a SOCKS5
// proxy (RFC 1929 username/password) on a loopback port, so that the IP lists
// of a Sim can point at something that really relays. It is for `proxyd demo`
// and tests, not for production traffic.
//
// A proxy of one protocol refuses the other: an "http" proxy whose client
// opens with a SOCKS greeting (a first byte that cannot start an HTTP
// request method), or a "socks5" proxy whose client opens with anything but
// the SOCKS5 version byte, counts a protocol error (ProtocolErrors) and
// closes the connection, as a real gateway port would fail such a client.
//
// So that a destination can tell which proxy carried a connection, a proxy
// listening on a specific IP dials destinations from that IP (one on
// 127.0.1.5 connects from 127.0.1.5), unless the proxy is on a loopback IP
// and the destination is not (a loopback source cannot reach it).
type Proxy struct {
	Protocol string // "http", "socks5" or "any" (both on one port, told apart by the first byte)
	Name     string // the name it was started with; in the X-Sim-Upstream response header of plain HTTP

	user, pass string
	ln         net.Listener
	addr       string
	source     net.IP // the listen IP destinations are dialed from; nil: any

	accepted       atomic.Int64
	protocolErrors atomic.Int64

	mu sync.Mutex
	// conns are every connection the proxy holds, its clients' and the
	// ones it opened to destinations, so that Down can end them all.
	conns map[net.Conn]struct{}
	down  bool
	// stopDials cancels the dials to destinations in progress (Down).
	stopDials context.Context
	cancel    context.CancelFunc
	wg        sync.WaitGroup
}

// StartProxy listens on addr (e.g. "127.0.0.1:0") and serves protocol
// "http", "socks5" or "any" with the given credentials (empty user: no
// auth).
func StartProxy(protocol, addr, name, user, pass string) (*Proxy, error) {
	if protocol != "http" && protocol != "socks5" && protocol != "any" {
		return nil, errors.New("providersim: proxy protocol must be http, socks5 or any")
	}
	p := &Proxy{Protocol: protocol, Name: name, user: user, pass: pass, conns: map[net.Conn]struct{}{}}
	if err := p.listen(addr); err != nil {
		return nil, err
	}
	return p, nil
}

func (p *Proxy) listen(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	p.mu.Lock()
	p.ln, p.addr, p.down = ln, ln.Addr().String(), false
	p.stopDials, p.cancel = context.WithCancel(context.Background())
	p.mu.Unlock()
	// Set before the first connection is served, and only while no
	// connection is (StartProxy, or Up after Down has waited for them).
	p.source = nil
	if a, ok := ln.Addr().(*net.TCPAddr); ok && !a.IP.IsUnspecified() {
		p.source = a.IP
	}
	p.wg.Add(1)
	go p.accept(ln)
	return nil
}

// Addr is the host:port the proxy listens on.
func (p *Proxy) Addr() string { return p.addr }

// Down stops the proxy and cuts its connections, as if the server died; Up
// brings it back on the same address. It returns once every connection the
// proxy served or opened is closed: those to destinations as well (a plain
// request waiting for a silent origin ends with them), and dials in
// progress are cancelled.
func (p *Proxy) Down() {
	p.mu.Lock()
	if p.down {
		p.mu.Unlock()
		return
	}
	p.down = true
	ln := p.ln
	p.cancel()
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	ln.Close()
	p.wg.Wait()
}

// Up restarts a proxy that is Down.
func (p *Proxy) Up() error {
	p.mu.Lock()
	down := p.down
	p.mu.Unlock()
	if !down {
		return nil
	}
	return p.listen(p.addr)
}

// Host is the IP the proxy listens on, without the port.
func (p *Proxy) Host() string {
	h, _, _ := net.SplitHostPort(p.addr)
	return h
}

// Entry is the IP list line naming this proxy with the given credentials.
func (p *Proxy) Entry(login, password string) Entry {
	a, _ := netip.ParseAddrPort(p.addr) // a listener's own address always parses
	return Entry{Host: a.Addr().String(), Port: int(a.Port()), Login: login, Password: password}
}

// Accepted counts the connections the proxy accepted so far.
func (p *Proxy) Accepted() int64 { return p.accepted.Load() }

// ProtocolErrors counts the connections that opened in the other protocol
// (a SOCKS greeting to an "http" proxy, HTTP to a "socks5" one) and were
// closed unanswered.
func (p *Proxy) ProtocolErrors() int64 { return p.protocolErrors.Load() }

// Close stops the proxy for good.
func (p *Proxy) Close() { p.Down() }

func (p *Proxy) track(c net.Conn, add bool) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if add {
		if p.down {
			return false
		}
		p.conns[c] = struct{}{}
	} else {
		delete(p.conns, c)
	}
	return true
}

func (p *Proxy) accept(ln net.Listener) {
	defer p.wg.Done()
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		p.accepted.Add(1)
		if !p.track(c, true) {
			c.Close()
			continue
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			defer p.track(c, false)
			defer c.Close()
			br := bufio.NewReader(c)
			c.SetReadDeadline(time.Now().Add(60 * time.Second))
			first, err := br.Peek(1)
			if err != nil {
				return // closed, or silent: a dial-only probe is no protocol error
			}
			socks := first[0] == socks5Version
			switch {
			case p.Protocol == "socks5" && !socks, p.Protocol == "http" && !httpMethodByte(first[0]):
				p.protocolErrors.Add(1)
				return
			}
			if socks {
				p.serveSOCKS(c, br)
			} else {
				p.serveHTTP(c, br)
			}
		}()
	}
}

const socks5Version = 5

// httpMethodByte reports whether b can start an HTTP request: methods are
// tokens, and every method in use starts with an upper-case letter.
func httpMethodByte(b byte) bool { return b >= 'A' && b <= 'Z' }

// errDown is a dial refused because the proxy went down.
var errDown = errors.New("providersim: proxy is down")

// dial connects to a destination, from the proxy's own IP when it has one
// that can reach the destination. The connection is tracked so that Down
// closes it; release it with p.hangUp.
func (p *Proxy) dial(hostport string) (net.Conn, error) {
	d := net.Dialer{Timeout: 5 * time.Second}
	if p.source != nil {
		host, _, _ := net.SplitHostPort(hostport)
		ip := net.ParseIP(host)
		if !p.source.IsLoopback() || (ip != nil && ip.IsLoopback()) || strings.EqualFold(host, "localhost") {
			d.LocalAddr = &net.TCPAddr{IP: p.source}
		}
	}
	p.mu.Lock()
	ctx := p.stopDials
	p.mu.Unlock()
	up, err := d.DialContext(ctx, "tcp", hostport)
	if err != nil {
		return nil, err
	}
	if !p.track(up, true) {
		up.Close()
		return nil, errDown
	}
	return up, nil
}

// hangUp closes a connection dial opened and stops tracking it.
func (p *Proxy) hangUp(up net.Conn) {
	p.track(up, false)
	up.Close()
}

func (p *Proxy) serveSOCKS(c net.Conn, br *bufio.Reader) {
	c.SetDeadline(time.Now().Add(10 * time.Second))
	cfg := socks5.ServerConfig{RequireAuth: p.user != ""}
	if p.user != "" {
		cfg.Authenticate = func(u, pw string) bool { return u == p.user && pw == p.pass }
	}
	req, err := socks5.ReadRequest(struct {
		io.Reader
		io.Writer
	}{br, c}, cfg)
	if err != nil {
		var re *socks5.RequestError
		if errors.As(err, &re) {
			socks5.WriteReply(c, re.Reply, socks5.Addr{})
		}
		return
	}
	up, err := p.dial(req.Dest.String())
	if err != nil {
		socks5.WriteReply(c, socks5.ReplyConnectionRefused, socks5.Addr{})
		return
	}
	defer p.hangUp(up)
	if err := socks5.WriteReply(c, socks5.ReplySucceeded, socks5.Addr{}); err != nil {
		return
	}
	c.SetDeadline(time.Time{})
	pipe(c, br, up)
}

func (p *Proxy) authorized(h http.Header) bool {
	if p.user == "" {
		return true
	}
	v := h.Get("Proxy-Authorization")
	b, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(v, "Basic "))
	return err == nil && strings.HasPrefix(v, "Basic ") && string(b) == p.user+":"+p.pass
}

func (p *Proxy) serveHTTP(c net.Conn, br *bufio.Reader) {
	for {
		c.SetReadDeadline(time.Now().Add(60 * time.Second))
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		c.SetReadDeadline(time.Time{})
		if !p.authorized(req.Header) {
			io.WriteString(c, "HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=\"sim\"\r\nContent-Length: 0\r\n\r\n")
			if req.Body != nil {
				io.Copy(io.Discard, req.Body)
			}
			continue
		}
		if req.Method == http.MethodConnect {
			up, err := p.dial(req.Host)
			if err != nil {
				io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
				return
			}
			defer p.hangUp(up)
			io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n")
			pipe(c, br, up)
			return
		}
		if !p.forward(c, req) {
			return
		}
	}
}

// forward relays one absolute-URI request on a fresh origin connection.
func (p *Proxy) forward(c net.Conn, req *http.Request) bool {
	if req.URL.Host == "" {
		io.WriteString(c, "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
		return false
	}
	host := req.URL.Host
	if req.URL.Port() == "" {
		host = net.JoinHostPort(req.URL.Hostname(), "80")
	}
	up, err := p.dial(host)
	if err != nil {
		io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
		return false
	}
	defer p.hangUp(up)
	req.Header.Del("Proxy-Authorization")
	req.Header.Del("Proxy-Connection")
	req.RequestURI = ""
	if err := req.Write(up); err != nil {
		return false
	}
	resp, err := http.ReadResponse(bufio.NewReader(up), req)
	if err != nil {
		io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
		return false
	}
	defer resp.Body.Close()
	if p.Name != "" {
		resp.Header.Set("X-Sim-Upstream", p.Name)
	}
	if err := resp.Write(c); err != nil {
		return false
	}
	return !resp.Close && !req.Close
}

// pipe relays between the client c, read through br so that bytes it sent
// after its request go first, and up, until both directions end.
func pipe(c net.Conn, br *bufio.Reader, up net.Conn) {
	done := make(chan struct{}, 2)
	cp := func(dst net.Conn, src io.Reader) {
		if _, err := io.Copy(dst, src); err != nil {
			// Not an end of stream: a connection was closed (Down) or
			// failed. Close both, or the other direction would wait on a
			// peer that may never close its side.
			c.Close()
			up.Close()
		} else if tc, ok := dst.(*net.TCPConn); ok {
			tc.CloseWrite()
		}
		done <- struct{}{}
	}
	go cp(up, br)
	go cp(c, up)
	<-done
	<-done
}

// Gateway is a pair of proxies on one IP, an HTTP one and a SOCKS5 one on
// ports of their own, as the provider's rotating gateways serve each
// protocol on its own port. Both carry the gateway's name.
type Gateway struct {
	HTTP  *Proxy
	SOCKS *Proxy
}

// StartGateway starts a gateway pair on ip (e.g. "127.0.3.1"), each proxy
// on a free port, with the given credentials (empty user: no auth).
func StartGateway(ip, name, user, pass string) (*Gateway, error) {
	hp, err := StartProxy("http", net.JoinHostPort(ip, "0"), name, user, pass)
	if err != nil {
		return nil, fmt.Errorf("starting the HTTP proxy of gateway %s: %w", name, err)
	}
	sp, err := StartProxy("socks5", net.JoinHostPort(ip, "0"), name, user, pass)
	if err != nil {
		hp.Close()
		return nil, fmt.Errorf("starting the SOCKS5 proxy of gateway %s: %w", name, err)
	}
	return &Gateway{HTTP: hp, SOCKS: sp}, nil
}

// Name is the name the gateway was started with.
func (g *Gateway) Name() string { return g.HTTP.Name }

// Host is the IP both proxies listen on.
func (g *Gateway) Host() string { return g.HTTP.Host() }

// Session is a sticky session on this gateway: the gateway's IP as its
// server, its HTTP port as the record's one port, and both ports per
// protocol.
func (g *Gateway) Session(id, exitIP string, ttl int) Session {
	h, s := g.HTTP.Entry("", ""), g.SOCKS.Entry("", "")
	return Session{Server: h.Host, Session: id, Port: h.Port, HTTPPort: h.Port, SOCKSPort: s.Port, ExitIP: exitIP, TTL: ttl}
}

// ProtocolErrors sums the protocol errors of both proxies.
func (g *Gateway) ProtocolErrors() int64 { return g.HTTP.ProtocolErrors() + g.SOCKS.ProtocolErrors() }

// Accepted sums the connections both proxies accepted.
func (g *Gateway) Accepted() int64 { return g.HTTP.Accepted() + g.SOCKS.Accepted() }

// Down takes both proxies down; Up brings both back on their addresses.
func (g *Gateway) Down() {
	g.HTTP.Down()
	g.SOCKS.Down()
}

// Up restarts both proxies of a gateway that is Down.
func (g *Gateway) Up() error {
	return errors.Join(g.HTTP.Up(), g.SOCKS.Up())
}

// Close stops both proxies for good.
func (g *Gateway) Close() {
	g.HTTP.Close()
	g.SOCKS.Close()
}
