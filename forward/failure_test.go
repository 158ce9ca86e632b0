package forward

import (
	"bufio"
	"bytes"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/net/proxy"

	"github.com/proxyd/proxyd/forward/socks5"
	"github.com/proxyd/proxyd/internal/freeport"
	"github.com/proxyd/proxyd/pool"
)

// deadAddr returns an address where nothing listens.
func deadAddr(t *testing.T) string { return freeport.Addr(t) }

// faultyUpstream builds an upstream of the given kind showing fault.
func faultyUpstream(t *testing.T, kind pool.Protocol, fault string) *pool.Upstream {
	if fault == "refuse" {
		return &pool.Upstream{Service: 9, Protocol: kind, Address: deadAddr(t)}
	}
	mode := map[string]upstreamMode{"hang": modeHang, "407": mode407, "close": modeCloseAtOnce, "500": mode500}[fault]
	if kind == pool.SOCKS5 {
		s := newSOCKSUpstream(t, "u", "p", nil)
		switch fault {
		case "407":
			return &pool.Upstream{Service: 9, Protocol: pool.SOCKS5, Address: s.ln.Addr().String(), Username: "u", Password: "wrong"}
		case "500":
			s.reply.Store(socks5.ReplyGeneralFailure)
		default:
			s.mode.Store(int32(mode))
		}
		return s.upstream(9)
	}
	u := newHTTPUpstream(t, "u", "p", nil)
	u.mode.Store(int32(mode))
	return u.upstream(9)
}

var faultClass = map[string]pool.Result{
	"refuse": pool.DialRefused,
	"hang":   pool.HandshakeTimeout,
	"407":    pool.AuthRejected,
	"close":  pool.HandshakeTimeout,
	"500":    pool.ProxyError,
}

// TestFailover: a faulty upstream is reported with its class and the client
// succeeds through the next one, on every path.
func TestFailover(t *testing.T) {
	for _, kind := range []pool.Protocol{pool.HTTP, pool.SOCKS5} {
		for _, fault := range []string{"refuse", "hang", "407", "close", "500"} {
			t.Run(string(kind)+"/"+fault, func(t *testing.T) {
				checkLeaks(t)
				echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
				origin, _ := startOrigin(t, http.HandlerFunc(echoHandler))
				bad := faultyUpstream(t, kind, fault)
				var good *pool.Upstream
				if kind == pool.SOCKS5 {
					good = newSOCKSUpstream(t, "", "", nil).upstream(1)
				} else {
					good = newHTTPUpstream(t, "", "", nil).upstream(1)
				}
				// Short timeouts only where the fault is a hang: the machine may be busy.
				// A plain request through a silent HTTP upstream is told
				// from a slow destination by a hedge through the next one.
				hs, hedge := 10*time.Second, 2*time.Second
				if fault == "hang" {
					hs, hedge = time.Second, 200*time.Millisecond
				}
				cfg := testConfig(func(c *Config) {
					c.AllowDestinations = loopbackAllowed
					c.HandshakeTimeout = hs
					c.HedgeDelay = hedge
				})
				check := func(t *testing.T, p *fakePool) {
					t.Helper()
					p.waitBalanced(t)
					r := p.Reports()
					if len(r) != 2 || r[0] != (report{bad.ID(), faultClass[fault]}) || r[1] != (report{good.ID(), pool.Success}) {
						t.Errorf("reports %+v, want %s then ok", r, faultClass[fault])
					}
					if picks := p.Picks(); len(picks) == 2 && (len(picks[1].Avoid) != 1 || picks[1].Avoid[0] != bad.ID()) {
						t.Errorf("second pick avoids %q", picks[1].Avoid)
					}
				}
				t.Run("connect", func(t *testing.T) {
					p := newFakePool(bad, good)
					tl := startListener(t, cfg, p)
					c, br, resp := rawConnect(t, tl.addr, echo, "")
					if resp.StatusCode != 200 {
						t.Fatalf("CONNECT: %d", resp.StatusCode)
					}
					bigTransfer(t, c, br, 1000)
					check(t, p)
					waitFor(t, 5*time.Second, func() bool { return len(tl.obs.Closeds()) == 1 }, "closed")
					if cl := tl.obs.Closeds()[0]; cl.o != OutcomeOK || cl.retries != 1 {
						t.Errorf("observer: %+v", cl)
					}
				})
				t.Run("socks", func(t *testing.T) {
					p := newFakePool(bad, good)
					scfg := cfg
					scfg.Protocol = "socks5"
					tl := startListener(t, scfg, p)
					d, _ := proxy.SOCKS5("tcp", tl.addr, nil, proxy.Direct)
					c, err := d.Dial("tcp", echo)
					if err != nil {
						t.Fatal(err)
					}
					bigTransfer(t, c, c, 1000)
					_ = c.Close()
					check(t, p)
				})
				t.Run("plain", func(t *testing.T) {
					if kind == pool.HTTP && fault == "500" {
						t.Skip("a 500 to a plain request may be the origin's own answer: passed on, not a fault")
					}
					p := newFakePool(bad, good)
					tl := startListener(t, cfg, p)
					req, _ := http.NewRequest("GET", "http://"+origin+"/", nil)
					if e := getEcho(t, tl.httpClient(t, "", ""), req); e.Method != "GET" {
						t.Errorf("method %s", e.Method)
					}
					check(t, p)
					if fault != "refuse" {
						return
					}
					// Nothing of the body was sent: retried too.
					p2 := newFakePool(bad, good)
					tl2 := startListener(t, cfg, p2)
					req, _ = http.NewRequest("POST", "http://"+origin+"/", strings.NewReader("body"))
					if e := getEcho(t, tl2.httpClient(t, "", ""), req); e.BodyLen != 4 {
						t.Errorf("body %d", e.BodyLen)
					}
					check(t, p2)
				})
			})
		}
	}
}

// TestDestinationUnreachable: the upstream's 502 (or SOCKS 0x04) blames the
// destination, is passed on, and nothing is retried.
func TestDestinationUnreachable(t *testing.T) {
	checkLeaks(t)
	dest := deadAddr(t)
	for _, kind := range []pool.Protocol{pool.HTTP, pool.SOCKS5} {
		var up, other *pool.Upstream
		if kind == pool.HTTP {
			up, other = newHTTPUpstream(t, "", "", nil).upstream(1), newHTTPUpstream(t, "", "", nil).upstream(2)
		} else {
			up, other = newSOCKSUpstream(t, "", "", nil).upstream(1), newSOCKSUpstream(t, "", "", nil).upstream(2)
		}
		p := newFakePool(up, other)
		tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
		_, _, resp := rawConnect(t, tl.addr, dest, "")
		if resp.StatusCode != 502 {
			t.Errorf("%s: CONNECT to unreachable: %d, want 502", kind, resp.StatusCode)
		}
		p.waitBalanced(t)
		if r := p.Reports(); len(r) != 1 || r[0].res != pool.DestinationError {
			t.Errorf("%s: reports %+v, want one destination_error", kind, r)
		}
		sp := newFakePool(up, other)
		stl := startListener(t, testConfig(func(c *Config) { c.Protocol = "socks5"; c.AllowDestinations = loopbackAllowed }), sp)
		code := socksDialCode(t, stl.addr, dest)
		want := byte(socks5.ReplyHostUnreachable)
		if code != want {
			t.Errorf("%s: socks reply %#x, want %#x", kind, code, want)
		}
		sp.waitBalanced(t)
		if r := sp.Reports(); len(r) != 1 || r[0].res != pool.DestinationError {
			t.Errorf("%s: socks reports %+v", kind, r)
		}
	}
}

// socksDialCode makes a SOCKS5 CONNECT and returns the reply code.
func socksDialCode(t *testing.T, proxyAddr, dest string) byte {
	t.Helper()
	c, err := net.Dial("tcp", proxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	host, port, _ := splitHostPort(dest, 0)
	_, err = socks5.ClientHandshake(c, socks5.Addr{Host: host, Port: port}, "", "")
	if err == nil {
		return 0
	}
	var re *socks5.ReplyError
	if errors.As(err, &re) {
		return re.Code
	}
	t.Fatalf("socks handshake: %v", err)
	return 0
}

// TestSOCKSReplyCodes: every SOCKS reply code of an upstream is classified,
// and the client gets the same code when the destination is at fault.
func TestSOCKSReplyCodes(t *testing.T) {
	checkLeaks(t)
	s := newSOCKSUpstream(t, "", "", nil)
	dest := "127.0.0.1:9"
	for code := byte(1); code <= 9; code++ {
		s.reply.Store(int32(code))
		p := newFakePool(s.upstream(1))
		tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "socks5"; c.AllowDestinations = loopbackAllowed; c.Retries = 0 }), p)
		got := socksDialCode(t, tl.addr, dest)
		wantRes, wantCode := pool.ProxyError, byte(socks5.ReplyGeneralFailure)
		if code >= 2 && code <= 6 {
			wantRes, wantCode = pool.DestinationError, code
		}
		if got != wantCode {
			t.Errorf("upstream %#x: client got %#x, want %#x", code, got, wantCode)
		}
		p.waitBalanced(t)
		if r := p.Reports(); len(r) != 1 || r[0].res != wantRes {
			t.Errorf("upstream %#x: reports %+v, want %s", code, r, wantRes)
		}
	}
}

// TestAllUpstreamsDead: a fast, clear answer within the bound.
func TestAllUpstreamsDead(t *testing.T) {
	checkLeaks(t)
	hang := newHTTPUpstream(t, "", "", nil)
	hang.mode.Store(int32(modeHang))
	ups := []*pool.Upstream{
		{Service: 1, Protocol: pool.HTTP, Address: deadAddr(t)},
		hang.upstream(2),
		{Service: 3, Protocol: pool.SOCKS5, Address: deadAddr(t)},
		{Service: 4, Protocol: pool.HTTP, Address: deadAddr(t)},
	}
	origin, _ := startOrigin(t, http.HandlerFunc(echoHandler))
	cfg := testConfig(func(c *Config) {
		c.AllowDestinations = loopbackAllowed
		c.HandshakeTimeout = 5 * time.Second
		c.RetryTimeout = 600 * time.Millisecond
	})
	const bound = 2 * time.Second

	p := newFakePool(ups...)
	tl := startListener(t, cfg, p)
	start := time.Now()
	_, _, resp := rawConnect(t, tl.addr, origin, "")
	if resp.StatusCode != 502 || time.Since(start) > bound {
		t.Errorf("CONNECT: %d after %s", resp.StatusCode, time.Since(start))
	}
	if b, _ := io.ReadAll(resp.Body); string(b) != textBadGateway {
		t.Errorf("body %q", b)
	}
	p.waitBalanced(t)

	start = time.Now()
	resp2, err := tl.httpClient(t, "", "").Get("http://" + origin + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp2.Body)
	resp2.Body.Close()
	if resp2.StatusCode != 502 || time.Since(start) > bound || string(body) != textBadGateway {
		t.Errorf("GET: %d %q after %s", resp2.StatusCode, body, time.Since(start))
	}

	scfg := cfg
	scfg.Protocol = "socks5"
	stl := startListener(t, scfg, newFakePool(ups...))
	start = time.Now()
	if code := socksDialCode(t, stl.addr, origin); code != socks5.ReplyGeneralFailure || time.Since(start) > bound {
		t.Errorf("SOCKS: reply %#x after %s", code, time.Since(start))
	}

	// An empty pool: the same answers at once.
	empty := newFakePool()
	etl := startListener(t, cfg, empty)
	_, _, resp = rawConnect(t, etl.addr, origin, "")
	if resp.StatusCode != 502 {
		t.Errorf("empty pool CONNECT: %d", resp.StatusCode)
	}
	waitFor(t, 5*time.Second, func() bool { return len(etl.obs.Closeds()) == 1 }, "closed")
	if o := etl.obs.Closeds()[0].o; o != OutcomeNoUpstream {
		t.Errorf("empty pool outcome %s", o)
	}
}

// TestSOCKSUnsupportedCommands: BIND and UDP ASSOCIATE get "command not
// supported" and never reach the pool.
func TestSOCKSUnsupportedCommands(t *testing.T) {
	checkLeaks(t)
	p := newFakePool()
	p.PickFunc = func(context.Context, pool.Request) (*pool.Upstream, error) {
		t.Error("unsupported command reached Pick")
		return nil, errors.New("no")
	}
	tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "socks5" }), p)
	for _, cmd := range []byte{socks5.CmdBind, socks5.CmdUDPAssociate} {
		c, err := net.Dial("tcp", tl.addr)
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		_, _ = c.Write([]byte{5, 1, 0})
		sel := make([]byte, 2)
		if _, err := io.ReadFull(c, sel); err != nil || sel[1] != 0 {
			t.Fatalf("method selection %v %v", sel, err)
		}
		_, _ = c.Write([]byte{5, cmd, 0, 1, 93, 184, 216, 34, 0, 80})
		reply := make([]byte, 10)
		if _, err := io.ReadFull(c, reply); err != nil || reply[1] != socks5.ReplyCommandNotSupported {
			t.Errorf("command %d: reply %v %v", cmd, reply, err)
		}
		_ = c.Close()
	}
}

// An upstream whose handshake is cut by retry_timeout before its own
// handshake_timeout ran had less time than it is given: nobody is blamed.
// One that stays silent for the whole handshake_timeout is blamed.
func TestRetryBudgetCutIsNoVerdict(t *testing.T) {
	checkLeaks(t)
	origin, _ := startOrigin(t, http.HandlerFunc(echoHandler))
	for _, tc := range []struct {
		name             string
		handshake, retry time.Duration
		want             pool.Result
	}{
		{"budget first", 5 * time.Second, 300 * time.Millisecond, pool.Canceled},
		{"handshake_timeout first", 300 * time.Millisecond, 5 * time.Second, pool.HandshakeTimeout},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hang := newHTTPUpstream(t, "", "", nil)
			hang.mode.Store(int32(modeHang))
			p := newFakePool(hang.upstream(1))
			tl := startListener(t, testConfig(func(c *Config) {
				c.AllowDestinations = loopbackAllowed
				c.HandshakeTimeout = tc.handshake
				c.RetryTimeout = tc.retry
			}), p)
			start := time.Now()
			_, _, resp := rawConnect(t, tl.addr, origin, "")
			if resp.StatusCode != http.StatusBadGateway || time.Since(start) > 3*time.Second {
				t.Errorf("CONNECT: %d after %s, want 502 within 3s", resp.StatusCode, time.Since(start))
			}
			p.waitBalanced(t)
			if r := p.Reports(); len(r) != 1 || r[0].res != tc.want {
				t.Errorf("reports %+v, want one %s", r, tc.want)
			}
		})
	}
}

// A dial cut by retry_timeout well before dial_timeout is no verdict
// either; one that had nearly all of its dial_timeout, or did not time out,
// is the upstream's. (A dial whose context ended counts as a timeout, as it
// did before, whatever its error.)
func TestClassifyDialUnderBudget(t *testing.T) {
	budget := time.Now().Add(-time.Millisecond) // ran out just now
	ctx, cancel := context.WithDeadlineCause(context.Background(), budget, errAttemptTimeout)
	defer cancel()
	<-ctx.Done()
	const bound = 5 * time.Second
	timeout := fmt.Errorf("dial tcp: %w", context.DeadlineExceeded)
	for _, tc := range []struct {
		name string
		had  time.Duration // from the dial's start to the budget's end
		err  error
		want what
	}{
		{"cut after a fifth of dial_timeout", bound / 5, timeout, wBudget},
		{"cut after nearly all of it", bound * 19 / 20, timeout, wDialTimeout},
		{"refused as the budget ran out", bound / 5, syscall.ECONNREFUSED, wDialTimeout},
	} {
		if got := classifyDial(ctx, tc.err, budget.Add(-tc.had), bound).h.what; got != tc.want {
			t.Errorf("%s: %d, want %d", tc.name, got, tc.want)
		}
	}
}

// A client that hangs up while its tunnel is being opened ends the
// attempts: the upstream that has not answered yet is let go at once, not
// at handshake_timeout, and is not blamed, and the connection counts as
// the client's. The same holds for a client that hangs up at once, before
// the watch starts.
func TestClientLeavesWhileTunnelOpens(t *testing.T) {
	if !canAwaitPeer {
		t.Skip("proxyd cannot watch a waiting client's socket on this system")
	}
	checkLeaks(t)
	origin, _ := startOrigin(t, http.HandlerFunc(echoHandler))
	for _, tc := range []struct {
		proto string
		wait  bool // hang up once the upstream has the connection
		reset bool // with a reset instead of an end of stream
	}{{"http", true, false}, {"socks5", true, false}, {"http", false, false}, {"socks5", false, false},
		{"http", true, true}, {"socks5", true, true}} {
		t.Run(fmt.Sprintf("%s wait %v reset %v", tc.proto, tc.wait, tc.reset), func(t *testing.T) {
			hang := newHTTPUpstream(t, "", "", nil)
			hang.mode.Store(int32(modeHang))
			p := newFakePool(hang.upstream(1))
			tl := startListener(t, testConfig(func(c *Config) {
				c.Protocol = tc.proto
				c.AllowDestinations = loopbackAllowed
				c.HandshakeTimeout = 30 * time.Second
				c.RetryTimeout = 30 * time.Second
			}), p)
			c, _ := askTunnel(t, tc.proto, tl.addr, origin)
			if tc.wait {
				waitFor(t, 5*time.Second, func() bool { return hang.accepted.Load() == 1 }, "the upstream's connection")
			}
			if tc.reset {
				_ = c.(*net.TCPConn).SetLinger(0)
			}
			_ = c.Close()
			start := time.Now()
			waitFor(t, 5*time.Second, func() bool { return len(p.Picks()) == 1 }, "the attempt")
			p.waitBalanced(t)
			if took := time.Since(start); took > 3*time.Second {
				t.Errorf("the attempt ended %s after the client left", took)
			}
			if r := p.Reports(); len(r) != 1 || r[0].res != pool.Canceled {
				t.Errorf("reports %+v, want one %s", r, pool.Canceled)
			}
			waitFor(t, 5*time.Second, func() bool { return len(tl.obs.Closeds()) == 1 }, "the connection counted")
			if o := tl.obs.Closeds()[0].o; o != OutcomeClientError {
				t.Errorf("outcome %s, want %s", o, OutcomeClientError)
			}
		})
	}
}

// A client that sends its first bytes before its tunnel is answered (a TLS
// handshake started early) is not taken for one that left: not when the
// bytes come with its request (and it half-closes after them: they are all
// it has to send), nor when they come while the watch waits. The tunnel
// opens and the bytes arrive.
func TestEarlyBytesWhileTunnelOpens(t *testing.T) {
	checkLeaks(t)
	echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
	for _, tc := range []struct {
		proto string
		later bool // the bytes come once the upstream has the CONNECT and the watch has had 2 × watchAfter to start
	}{{"http", false}, {"socks5", false}, {"http", true}, {"socks5", true}} {
		proto := tc.proto
		t.Run(fmt.Sprintf("%s later %v", proto, tc.later), func(t *testing.T) {
			// An upstream that answers CONNECT only after 5 × watchAfter, so
			// that the watch runs while the client's bytes come.
			got := make(chan struct{}, 1) // the upstream has the CONNECT
			slow := startTCP(t, "tcp", "127.0.0.1:0", func(c net.Conn) {
				defer c.Close()
				br := bufio.NewReader(c)
				req, err := http.ReadRequest(br)
				if err != nil {
					return
				}
				select {
				case got <- struct{}{}:
				default:
				}
				dst, err := net.Dial("tcp", req.RequestURI)
				if err != nil {
					return
				}
				defer dst.Close()
				time.Sleep(5 * watchAfter)
				if _, err := io.WriteString(c, "HTTP/1.1 200 OK\r\n\r\n"); err != nil {
					return
				}
				go func() {
					_, _ = io.Copy(dst, br)
					_ = dst.(*net.TCPConn).CloseWrite()
				}()
				_, _ = io.Copy(c, dst)
			})
			p := newFakePool(&pool.Upstream{Service: 1, Protocol: pool.HTTP, Address: slow})
			tl := startListener(t, testConfig(func(c *Config) {
				c.Protocol = proto
				c.AllowDestinations = loopbackAllowed
			}), p)
			c, br := askTunnel(t, proto, tl.addr, echo)
			if tc.later {
				<-got
				// Not a wait for a condition: the watch starts watchAfter
				// into the attempt and shows no sign of it. The checks hold
				// either way; the wait (the upstream answers after 5 ×
				// watchAfter) makes the watch's path the likely one.
				time.Sleep(2 * watchAfter)
			}
			if _, err := io.WriteString(c, "early"); err != nil {
				t.Fatal(err)
			}
			if !tc.later {
				_ = c.(*net.TCPConn).CloseWrite()
			}
			if proto == "http" {
				resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
				if err != nil || resp.StatusCode != http.StatusOK {
					t.Fatalf("CONNECT answer %v, %v", resp, err)
				}
			} else {
				var head [12]byte // method choice, then a reply with an IPv4 address
				if _, err := io.ReadFull(br, head[:]); err != nil || head[1] != 0 || head[3] != socks5.ReplySucceeded {
					t.Fatalf("SOCKS5 answers %v, %v", head, err)
				}
			}
			echoed := make([]byte, len("early"))
			if _, err := io.ReadFull(br, echoed); err != nil || string(echoed) != "early" {
				t.Fatalf("echoed %q, %v; want the early bytes", echoed, err)
			}
			if !tc.later {
				<-got
			}
			_ = c.Close()
			p.waitBalanced(t)
			if r := p.Reports(); len(r) != 1 || r[0].res != pool.Success {
				t.Errorf("reports %+v, want one success", r)
			}
		})
	}
}

// A client that hangs up while its pick waits (a sticky session's rotation
// in flight) ends the wait, and the connection is the client's, not one
// without an upstream.
func TestClientLeavesWhilePickWaits(t *testing.T) {
	if !canAwaitPeer {
		t.Skip("proxyd cannot watch a waiting client's socket on this system")
	}
	checkLeaks(t)
	origin, _ := startOrigin(t, http.HandlerFunc(echoHandler))
	for _, proto := range []string{"http", "socks5"} {
		t.Run(proto, func(t *testing.T) {
			waiting := make(chan struct{}, 1)
			p := newFakePool()
			p.PickFunc = func(ctx context.Context, _ pool.Request) (*pool.Upstream, error) {
				waiting <- struct{}{}
				<-ctx.Done()
				return nil, context.Cause(ctx)
			}
			tl := startListener(t, testConfig(func(c *Config) {
				c.Protocol = proto
				c.AllowDestinations = loopbackAllowed
				c.RetryTimeout = 30 * time.Second
			}), p)
			c, _ := askTunnel(t, proto, tl.addr, origin)
			<-waiting
			_ = c.Close()
			waitFor(t, 3*time.Second, func() bool { return len(tl.obs.Closeds()) == 1 }, "the connection counted")
			if o := tl.obs.Closeds()[0].o; o != OutcomeClientError {
				t.Errorf("outcome %s, want %s", o, OutcomeClientError)
			}
		})
	}
}

// askTunnel asks the listener at addr (proto "http" or "socks5") for a
// tunnel to dest, an IPv4 address, without waiting for the answer; for
// SOCKS5 the greeting (no authentication) and the request go in one write,
// which proxyd's server takes.
func askTunnel(t *testing.T, proto, addr, dest string) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, br := dialRaw(t, addr)
	if proto == "http" {
		fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", dest, dest)
		return c, br
	}
	host, port, _ := splitHostPort(dest, 0)
	req := append([]byte{5, 1, 0, 5, 1, 0, 1}, net.ParseIP(host).To4()...)
	if _, err := c.Write(append(req, byte(port>>8), byte(port))); err != nil {
		t.Fatal(err)
	}
	return c, br
}

// A WebSocket client that hangs up while its upgrade is being set up ends
// the set-up, as a tunnel's client does: while its pick waits, while the
// upstream has not answered (the upstream is let go at once, not at
// handshake_timeout, and is not blamed), and while the origin's answer to
// the upgrade is awaited through the tunnel (whose connection closes at
// once, and which proved the upstream). The connection counts as the
// client's.
func TestClientLeavesWhileUpgradeOpens(t *testing.T) {
	if !canAwaitPeer {
		t.Skip("proxyd cannot watch a waiting client's socket on this system")
	}
	checkLeaks(t)
	for _, tc := range []struct {
		stage string // what is under way when the client leaves: "pick", "handshake" or "origin"
		reset bool   // hang up with a reset instead of an end of stream
	}{{"pick", false}, {"handshake", false}, {"handshake", true}, {"origin", false}, {"origin", true}} {
		t.Run(fmt.Sprintf("%s reset %v", tc.stage, tc.reset), func(t *testing.T) {
			// An origin that reads the upgrade and never answers it.
			reached := make(chan struct{}, 1) // the origin has the upgrade
			ended := make(chan struct{}, 1)   // and its connection ended
			origin := startTCP(t, "tcp", "127.0.0.1:0", func(c net.Conn) {
				br := bufio.NewReader(c)
				if _, err := http.ReadRequest(br); err != nil {
					return
				}
				reached <- struct{}{}
				_, _ = io.Copy(io.Discard, br)
				ended <- struct{}{}
			})
			up := newHTTPUpstream(t, "", "", nil)
			if tc.stage == "handshake" {
				up.mode.Store(int32(modeHang))
			}
			p := newFakePool(up.upstream(1))
			picking := make(chan struct{}, 1)
			if tc.stage == "pick" {
				p.PickFunc = func(ctx context.Context, _ pool.Request) (*pool.Upstream, error) {
					picking <- struct{}{}
					<-ctx.Done()
					return nil, context.Cause(ctx)
				}
			}
			tl := startListener(t, testConfig(func(c *Config) {
				c.AllowDestinations = loopbackAllowed
				c.HandshakeTimeout = 30 * time.Second
				c.RetryTimeout = 30 * time.Second
			}), p)
			c := askUpgrade(t, tl.addr, origin)
			switch tc.stage {
			case "pick":
				awaitSignal(t, picking, "the pick")
			case "handshake":
				waitFor(t, 5*time.Second, func() bool { return up.accepted.Load() == 1 }, "the upstream's connection")
			case "origin":
				awaitSignal(t, reached, "the upgrade at the origin")
			}
			if tc.reset {
				_ = c.(*net.TCPConn).SetLinger(0)
			}
			_ = c.Close()
			start := time.Now()
			waitFor(t, 5*time.Second, func() bool { return len(tl.obs.Closeds()) == 1 }, "the connection counted")
			if o := tl.obs.Closeds()[0].o; o != OutcomeClientError {
				t.Errorf("outcome %s, want %s", o, OutcomeClientError)
			}
			want := []report(nil)
			switch tc.stage {
			case "handshake":
				want = []report{{up.upstream(1).ID(), pool.Canceled}}
			case "origin":
				want = []report{{up.upstream(1).ID(), pool.Success}}
				awaitSignal(t, ended, "the origin's connection to end")
			}
			p.waitBalanced(t)
			if took := time.Since(start); took > 3*time.Second {
				t.Errorf("the set-up ended %s after the client left", took)
			}
			if r := p.Reports(); !slices.Equal(r, want) {
				t.Errorf("reports %+v, want %+v", r, want)
			}
		})
	}
}

// An upgrade whose 101 comes after its client's watch started is relayed
// as any: the watch ends before the answer, and the client's bytes go
// through.
func TestUpgradeAnsweredWhileWatched(t *testing.T) {
	checkLeaks(t)
	origin := startTCP(t, "tcp", "127.0.0.1:0", func(c net.Conn) {
		br := bufio.NewReader(c)
		if _, err := http.ReadRequest(br); err != nil {
			return
		}
		// Not a wait for a condition: the answer comes late enough that
		// the client's watch (after watchAfter) is the likely path.
		time.Sleep(5 * watchAfter)
		_, _ = io.WriteString(c, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
		_, _ = plainCopy(c, br)
	})
	p := newFakePool(newHTTPUpstream(t, "", "", nil).upstream(1))
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
	c := askUpgrade(t, tl.addr, origin)
	br := bufio.NewReader(c)
	if resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodGet}); err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade: %v, %v", resp, err)
	}
	if _, err := io.WriteString(c, "ping"); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4)
	if _, err := io.ReadFull(br, got); err != nil || string(got) != "ping" {
		t.Fatalf("echoed %q, %v", got, err)
	}
	_ = c.Close()
	waitFor(t, 5*time.Second, func() bool { return len(tl.obs.Closeds()) == 1 }, "the connection counted")
	if o := tl.obs.Closeds()[0].o; o != OutcomeOK {
		t.Errorf("outcome %s, want %s", o, OutcomeOK)
	}
	p.waitBalanced(t)
}

// askUpgrade sends the HTTP listener at addr a WebSocket upgrade to dest
// without waiting for the answer.
// It asks with a sticky key, so that every way its set-up ends releases
// with its pick's key (the fake pool's waitBalanced checks it).
func askUpgrade(t *testing.T, addr, dest string) net.Conn {
	t.Helper()
	c, _ := dialRaw(t, addr)
	fmt.Fprintf(c, "GET http://%s/ws HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"+
		"Proxy-Authorization: %s\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
		dest, dest, basicHeader("session-ws", "x"))
	return c
}

// awaitSignal waits up to 5 s for a value on ch.
func awaitSignal(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(5 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
}

// An upstream that stands for a ppr sticky session is reported at once when
// it is silent (its failure asks for the session's rotation before the
// next pick), and is no witness of a silent destination.
func TestSilentSessionUpstreamReportedAtOnce(t *testing.T) {
	checkLeaks(t)
	echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
	var ups []*pool.Upstream
	for i := 1; i <= 2; i++ {
		h := newHTTPUpstream(t, "", "", nil)
		h.mode.Store(int32(modeHang))
		ups = append(ups, h.upstream(i))
	}
	ups[0].Kind, ups[0].Server, ups[0].Session = pool.PPR, "gw.example.net", "s1"
	p := newFakePool(ups...)
	tl := startListener(t, testConfig(func(c *Config) {
		c.AllowDestinations = loopbackAllowed
		c.HandshakeTimeout = 300 * time.Millisecond
		c.RetryTimeout = 5 * time.Second
		c.Retries = 1
	}), p)
	_, _, resp := rawConnect(t, tl.addr, echo, "")
	if resp.StatusCode != http.StatusBadGateway {
		t.Errorf("CONNECT: %d, want 502", resp.StatusCode)
	}
	p.waitBalanced(t)
	want := []report{{ups[0].ID(), pool.HandshakeTimeout}, {ups[1].ID(), pool.HandshakeTimeout}}
	if r := p.Reports(); !slices.Equal(r, want) {
		t.Errorf("reports %+v, want %+v in this order", r, want)
	}
}

// An upstream silent on a tunnel's request is not blamed when the next
// upstream says that the destination failed (its CONNECT answer is 502):
// that is the destination's silence too.
func TestSilentThenDestinationErrorBlamesNoUpstream(t *testing.T) {
	checkLeaks(t)
	echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
	hung := newHTTPUpstream(t, "", "", nil)
	hung.mode.Store(int32(modeHang))
	says502 := newHTTPUpstream(t, "", "", nil)
	says502.mode.Store(int32(mode502))
	p := newFakePool(hung.upstream(1), says502.upstream(2))
	tl := startListener(t, testConfig(func(c *Config) {
		c.AllowDestinations = loopbackAllowed
		c.HandshakeTimeout = 300 * time.Millisecond
		c.RetryTimeout = 5 * time.Second
	}), p)
	_, _, resp := rawConnect(t, tl.addr, echo, "")
	if resp.StatusCode != http.StatusBadGateway {
		t.Errorf("CONNECT: %d, want 502", resp.StatusCode)
	}
	p.waitBalanced(t)
	want := []report{{says502.upstream(2).ID(), pool.DestinationError}, {hung.upstream(1).ID(), pool.DestinationError}}
	if r := p.Reports(); !slices.Equal(r, want) {
		t.Errorf("reports %+v, want %+v", r, want)
	}
	waitFor(t, 5*time.Second, func() bool { return len(tl.obs.Closeds()) == 1 }, "the connection counted")
	if o := tl.obs.Closeds()[0].o; o != OutcomeDestinationError {
		t.Errorf("outcome %s, want %s", o, OutcomeDestinationError)
	}
}

// A plain request's 502, 503 or 504 is passed on as it came and blames
// nobody (through an HTTP upstream it may be the upstream's, speaking for
// the destination), but it counts as destination_error, as a CONNECT's 502
// does, whichever the upstream's protocol; another status of the
// destination's counts as ok.
func TestPlainGatewayAnswerCountsAsDestinationError(t *testing.T) {
	checkLeaks(t)
	origin, _ := startOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/503" {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusInternalServerError)
	}))
	for _, tc := range []struct {
		name    string
		socks   bool
		mode    upstreamMode
		path    string
		status  int
		outcome Outcome
	}{
		{"the upstream's 502", false, mode502, "/", http.StatusBadGateway, OutcomeDestinationError},
		{"the destination's 503 through an HTTP upstream", false, modeOK, "/503", http.StatusServiceUnavailable, OutcomeDestinationError},
		{"the destination's 503 through a SOCKS5 upstream", true, modeOK, "/503", http.StatusServiceUnavailable, OutcomeDestinationError},
		{"the destination's 500", false, modeOK, "/", http.StatusInternalServerError, OutcomeOK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var u *pool.Upstream
			if tc.socks {
				u = newSOCKSUpstream(t, "u", "p", nil).upstream(1)
			} else {
				up := newHTTPUpstream(t, "", "", nil)
				up.mode.Store(int32(tc.mode))
				u = up.upstream(1)
			}
			p := newFakePool(u)
			tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
			client := tl.httpClient(t, "", "")
			resp, err := client.Get("http://" + origin + tc.path)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != tc.status {
				t.Errorf("status %d, want %d", resp.StatusCode, tc.status)
			}
			p.waitBalanced(t)
			if r := p.Reports(); !slices.Equal(r, []report{{u.ID(), pool.Success}}) {
				t.Errorf("reports %+v, want the upstream's success alone", r)
			}
			client.Transport.(*http.Transport).CloseIdleConnections() // the connection ends and is counted
			waitFor(t, 5*time.Second, func() bool { return len(tl.obs.Closeds()) == 1 }, "the connection counted")
			if o := tl.obs.Closeds()[0].o; o != tc.outcome {
				t.Errorf("outcome %s, want %s", o, tc.outcome)
			}
		})
	}
}

// The duration reported with a success feeds the pool's dial + handshake
// latency average: on a kept upstream connection nothing was dialed, and
// the wait for the answer is the destination's, not the upstream's.
func TestKeptConnectionReportsNoLatency(t *testing.T) {
	checkLeaks(t)
	const slow = 400 * time.Millisecond
	origin, _ := startOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			time.Sleep(slow)
		}
		_, _ = w.Write([]byte("ok"))
	}))
	up := newHTTPUpstream(t, "", "", nil)
	p := newFakePool(up.upstream(1))
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed; c.HedgeDelay = 0 }), p)
	hc := tl.httpClient(t, "", "")
	getBody(t, hc, "http://"+origin+"/fast") // dials the upstream
	getBody(t, hc, "http://"+origin+"/slow") // on the kept connection
	p.waitBalanced(t)
	tooks := p.Tooks()
	if len(tooks) != 2 || tooks[0] <= 0 || tooks[0] >= slow || tooks[1] != 0 {
		t.Errorf("durations reported %v, want the first dial's, then none", tooks)
	}
	if a := up.accepted.Load(); a != 1 {
		t.Errorf("the upstream accepted %d connections, want 1 (the second request on the kept one)", a)
	}
}

// Which plain answers through an HTTP upstream are the upstream's own: X-Squid-Error
// on an error status, or on the redirect of a deny_info; not on a destination's success.
func TestSquidOwnAnswer(t *testing.T) {
	for _, tc := range []struct {
		status int
		v      string
		own    bool
	}{
		{503, "ERR_CONNECT_FAIL 111", true}, {403, "ERR_ACCESS_DENIED 0", true}, {404, "ERR_INVALID_URL 0", true},
		{302, "403 Access Denied", true}, {307, "403 access denied", true},
		{200, "ERR_INVALID_URL 0", false}, {302, "ERR_INVALID_URL 0", false}, {301, "", false}, {500, "", false},
	} {
		if got := squidOwnAnswer(tc.status, tc.v); got != tc.own {
			t.Errorf("squidOwnAnswer(%d, %q) = %v, want %v", tc.status, tc.v, got, tc.own)
		}
	}
}

// An HTTP upstream that refuses a plain request with a deny_info redirect
// (Squid: 302 with "X-Squid-Error: 403 Access Denied") refused it itself:
// its failure, and the request goes through the next upstream.
func TestSquidDenyRedirectIsTheUpstreams(t *testing.T) {
	checkLeaks(t)
	origin, _ := startOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "the site's page")
	}))
	denying := startTCP(t, "tcp", "127.0.0.1:0", func(c net.Conn) {
		br := bufio.NewReader(c)
		for {
			if _, err := http.ReadRequest(br); err != nil {
				return
			}
			_, _ = io.WriteString(c, "HTTP/1.1 302 Found\r\nLocation: http://blocked.example/\r\n"+
				"X-Squid-Error: 403 Access Denied\r\nContent-Length: 0\r\n\r\n")
		}
	})
	u1 := &pool.Upstream{Service: 1, Protocol: pool.HTTP, Address: denying}
	u2 := newHTTPUpstream(t, "", "", nil).upstream(2)
	p := newFakePool(u1, u2)
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
	resp := rawRequest(t, tl.addr, "GET http://"+origin+"/ HTTP/1.1\r\nHost: "+origin+"\r\nConnection: close\r\n\r\n")
	if resp == nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("answer %+v, want the destination's 200 through the second upstream", resp)
	}
	resp.Body.Close()
	p.waitBalanced(t)
	if r, want := p.Reports(), []report{{u1.ID(), pool.ProxyError}, {u2.ID(), pool.Success}}; !slices.Equal(r, want) {
		t.Errorf("reports %+v, want %+v", r, want)
	}
}

// X-Squid-Error marks an HTTP upstream's own error page, which Squid sends
// with a 4xx or 5xx status only. A destination's successful answer that
// carries the header (a site behind a Squid of its own) is the
// destination's: passed on, and the upstream's success.
func TestDestinationSquidHeaderOnSuccessPasses(t *testing.T) {
	checkLeaks(t)
	origin, _ := startOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Squid-Error", "ERR_INVALID_URL 0") // left over by the site's own proxy
		_, _ = io.WriteString(w, "the site's page")
	}))
	u := newHTTPUpstream(t, "", "", nil).upstream(1)
	p := newFakePool(u, newHTTPUpstream(t, "", "", nil).upstream(2))
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
	resp, err := tl.httpClient(t, "", "").Get("http://" + origin + "/x")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(b) != "the site's page" {
		t.Errorf("client got %d %q, want the destination's 200", resp.StatusCode, b)
	}
	p.waitBalanced(t)
	if r := p.Reports(); len(r) != 1 || r[0].res != pool.Success {
		t.Errorf("reports %+v, want one success", r)
	}
}

// A plain request carried by a tunnel the upstream opened (a SOCKS5
// upstream, here over a kept connection; CONNECT for an "https://"
// request) whose destination answers after response_timeout is the
// destination's: the upstream answered when it opened the tunnel, so
// other upstreams answering meanwhile do not make it silent.
func TestTunneledSlowDestinationBlamesNoUpstream(t *testing.T) {
	checkLeaks(t)
	arrived := make(chan struct{}, 1)
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			arrived <- struct{}{}
			<-r.Context().Done() // past response_timeout: proxyd gives up first
			return
		}
		_, _ = io.WriteString(w, "ok")
	})
	plainOrigin, _ := startOrigin(t, handler)
	tlsOrigin := httptest.NewTLSServer(handler)
	t.Cleanup(tlsOrigin.Close)
	roots := x509.NewCertPool()
	roots.AddCert(tlsOrigin.Certificate())
	for _, tc := range []struct {
		name string
		up   func(i int) *pool.Upstream
		base string
	}{
		{"SOCKS5 kept connection", func(i int) *pool.Upstream { return newSOCKSUpstream(t, "", "", nil).upstream(i) }, "http://" + plainOrigin},
		{"CONNECT for https", func(i int) *pool.Upstream { return newHTTPUpstream(t, "", "", nil).upstream(i) }, tlsOrigin.URL},
	} {
		t.Run(tc.name, func(t *testing.T) {
			u1, u2 := tc.up(1), tc.up(2)
			p := newFakePool(u1, u2) // round-robin: u1, u2, u1, u2
			tl := startListener(t, testConfig(func(c *Config) {
				c.AllowDestinations = loopbackAllowed
				c.RootCAs = roots
				c.ResponseTimeout = 500 * time.Millisecond
			}), p)
			get := func(path string) int {
				t.Helper()
				host := strings.TrimPrefix(strings.TrimPrefix(tc.base, "http://"), "https://")
				resp := rawRequest(t, tl.addr, "GET "+tc.base+path+" HTTP/1.1\r\nHost: "+host+"\r\nConnection: close\r\n\r\n")
				if resp == nil {
					t.Fatalf("GET %s: no answer", path)
				}
				_, _ = io.ReadAll(resp.Body)
				resp.Body.Close()
				return resp.StatusCode
			}
			get("/fast") // u1 dials (and keeps the connection where it can)
			get("/fast") // u2
			slow := make(chan int, 1)
			go func() { slow <- get("/slow") }() // u1
			awaitSignal(t, arrived, "the slow request at the destination")
			get("/fast") // u2 answers while u1's head is awaited
			if code := <-slow; code != http.StatusGatewayTimeout {
				t.Errorf("slow request: %d, want 504", code)
			}
			p.waitBalanced(t)
			for _, r := range p.Reports() {
				if r.res != pool.Success && r.res != pool.DestinationError {
					t.Errorf("report %s %s: a slow destination behind a tunnel blamed on the upstream", r.id, r.res)
				}
			}
		})
	}
}

// An https:// request goes through a CONNECT tunnel even through an HTTP
// upstream: the tunnel's answer proved the upstream, so a slow head is the
// destination's, and the request is not hedged (a hedge that answered
// first would blame the upstream for the destination's pace).
func TestHTTPSRequestIsNotHedged(t *testing.T) {
	checkLeaks(t)
	var hits atomic.Int32
	origin := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if hits.Add(1) == 1 {
			time.Sleep(time.Second) // the first request is slow, any later one fast
		}
		_, _ = io.WriteString(w, "ok")
	}))
	t.Cleanup(origin.Close)
	roots := x509.NewCertPool()
	roots.AddCert(origin.Certificate())
	u1, u2 := newHTTPUpstream(t, "", "", nil).upstream(1), newHTTPUpstream(t, "", "", nil).upstream(2)
	p := newFakePool(u1, u2)
	tl := startListener(t, testConfig(func(c *Config) {
		c.AllowDestinations = loopbackAllowed
		c.RootCAs = roots
		c.HedgeDelay = 100 * time.Millisecond
		c.ResponseTimeout = 10 * time.Second
	}), p)
	host := strings.TrimPrefix(origin.URL, "https://")
	resp := rawRequest(t, tl.addr, "GET "+origin.URL+"/ HTTP/1.1\r\nHost: "+host+"\r\nConnection: close\r\n\r\n")
	if resp == nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("answer %+v, want 200", resp)
	}
	resp.Body.Close()
	p.waitBalanced(t)
	if n := hits.Load(); n != 1 {
		t.Errorf("the destination got %d requests, want 1 (no hedge)", n)
	}
	if r := p.Reports(); len(r) != 1 || r[0].res != pool.Success {
		t.Errorf("reports %+v, want one success", r)
	}
}

// A tunnel whose client half-closed and then stalls its reading, while
// the destination keeps sending, ends at idle_timeout: once one direction
// is over, nothing else would end it. (That a half-closed client that
// reads, however slowly, keeps it is TestHalfCloseMidDownloadSlowReader-
// KeepsTunnel's, on Linux, where its receive buffer can be kept small from
// the start: one set after the connection opened may already hold more
// than such a reader drains within idle_timeout, and the test could not
// tell a cut tunnel from a full buffer.)
func TestHalfClosedTunnelStalledReaderEnds(t *testing.T) {
	checkLeaks(t)
	flood := floodOrigin(t)
	p := newFakePool(newHTTPUpstream(t, "", "", nil).upstream(1))
	tl := startListener(t, testConfig(func(c *Config) {
		c.Protocol = ProtocolSOCKS5
		c.AllowDestinations = loopbackAllowed
		c.IdleTimeout = 300 * time.Millisecond
	}), p)
	c, err := socksDial(tl.addr, flood)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.(*net.TCPConn).SetReadBuffer(4096)
	_ = c.(*net.TCPConn).CloseWrite() // done sending; never reads
	waitFor(t, 10*time.Second, func() bool { return tl.ActiveConns() == 0 }, "the stalled half-closed tunnel to end")
}

// A SOCKS5 failure reply to a client that sent bytes right behind its
// request (a TLS hello, say) ends with a lingering close, not a reset that
// could throw the reply away before the client reads it.
func TestSOCKSRefusalClosesWithoutReset(t *testing.T) {
	checkLeaks(t)
	tl := startListener(t, testConfig(func(c *Config) { c.Protocol = ProtocolSOCKS5 }), newFakePool()) // loopback refused
	c, err := net.Dial("tcp", tl.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	req := []byte{5, 1, 0, 5, 1, 0, 1, 127, 0, 0, 1, 0, 80} // greeting, then CONNECT 127.0.0.1:80
	early := bytes.Repeat([]byte{0x16}, 64<<10)             // sent before any reply
	if _, err := c.Write(append(req, early...)); err != nil {
		t.Fatal(err)
	}
	_ = c.(*net.TCPConn).CloseWrite()
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatalf("reading the refusal: %v (got % x)", err, got)
	}
	if len(got) < 4 || got[0] != 5 || got[1] != 0 || got[2] != 5 || got[3] != socks5.ReplyNotAllowed {
		t.Errorf("answer % x, want the method choice and reply 0x02", got)
	}
}

// floodOrigin writes to every connection without end, reading nothing.
func floodOrigin(t *testing.T) string {
	return startTCP(t, "tcp", "127.0.0.1:0", func(c net.Conn) {
		buf := make([]byte, 64<<10)
		for {
			if _, err := c.Write(buf); err != nil {
				return
			}
		}
	})
}
