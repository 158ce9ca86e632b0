package providersim

import (
	"bufio"
	"encoding/base64"
	"errors"
	"io"
	"net"
	"net/http"
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
type Proxy struct {
	Protocol string // "http", "socks5" or "any" (both on one port, told apart by the first byte)
	Name     string // shown in the X-Sim-Upstream response header of plain HTTP

	user, pass string
	ln         net.Listener
	addr       string

	accepted atomic.Int64

	mu    sync.Mutex
	conns map[net.Conn]struct{}
	down  bool
	wg    sync.WaitGroup
}

// StartProxy listens on addr (e.g. "127.0.0.1:0") and serves protocol
// "http" or "socks5" with the given credentials (empty user: no auth).
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
	p.mu.Unlock()
	p.wg.Add(1)
	go p.accept(ln)
	return nil
}

// Addr is the host:port the proxy listens on.
func (p *Proxy) Addr() string { return p.addr }

// Down stops the proxy and cuts its connections, as if the server died; Up
// brings it back on the same address.
func (p *Proxy) Down() {
	p.mu.Lock()
	if p.down {
		p.mu.Unlock()
		return
	}
	p.down = true
	ln := p.ln
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

// Accepted counts the connections the proxy accepted so far.
func (p *Proxy) Accepted() int64 { return p.accepted.Load() }

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
			socks := p.Protocol == "socks5"
			if p.Protocol == "any" {
				c.SetReadDeadline(time.Now().Add(10 * time.Second))
				first, err := br.Peek(1)
				if err != nil {
					return
				}
				socks = first[0] == 5
			}
			if socks {
				p.serveSOCKS(c, br)
			} else {
				p.serveHTTP(c, br)
			}
		}()
	}
}

var dialer = net.Dialer{Timeout: 5 * time.Second}

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
	up, err := dialer.Dial("tcp", req.Dest.String())
	if err != nil {
		socks5.WriteReply(c, socks5.ReplyConnectionRefused, socks5.Addr{})
		return
	}
	defer up.Close()
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
			up, err := dialer.Dial("tcp", req.Host)
			if err != nil {
				io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
				return
			}
			defer up.Close()
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
	up, err := dialer.Dial("tcp", host)
	if err != nil {
		io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
		return false
	}
	defer up.Close()
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
