package forward

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/proxyd/proxyd/forward/socks5"
	"github.com/proxyd/proxyd/pool"
)

// blackholeAddr returns a loopback address whose accept queue is full, so
// that a new connect is never answered (its SYNs are dropped). The raw
// socket (SOCK_CLOEXEC) and the dropped SYNs are Linux's, so the test of
// the dial timeout is built on Linux only.
func blackholeAddr(t *testing.T) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, _ := syscall.Getsockname(fd)
	addr := fmt.Sprintf("127.0.0.1:%d", sa.(*syscall.SockaddrInet4).Port)
	for range 8 { // fill the accept queue
		c, err := net.DialTimeout("tcp", addr, 100*time.Millisecond)
		if err != nil {
			return addr
		}
		t.Cleanup(func() { _ = c.Close() })
	}
	skipOrFail(t, "could not fill the accept queue of %s", addr)
	return ""
}

// TestDialTimeout: an upstream that never answers the TCP connect is a
// dial timeout, and the next upstream serves.
func TestDialTimeout(t *testing.T) {
	checkLeaks(t)
	echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
	bad := &pool.Upstream{Service: 9, Protocol: pool.HTTP, Address: blackholeAddr(t)}
	good := newHTTPUpstream(t, "", "", nil).upstream(1)
	p := newFakePool(bad, good)
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed; c.DialTimeout = 300 * time.Millisecond }), p)
	start := time.Now()
	c, br, resp := rawConnect(t, tl.addr, echo, "")
	if resp.StatusCode != 200 {
		t.Fatalf("CONNECT: %d", resp.StatusCode)
	}
	if d := time.Since(start); d < 250*time.Millisecond || d > 3*time.Second {
		t.Errorf("took %s", d)
	}
	bigTransfer(t, c, br, 100)
	p.waitBalanced(t)
	if r := p.Reports(); len(r) != 2 || r[0].res != pool.DialTimeout || r[1].res != pool.Success {
		t.Errorf("reports %+v", r)
	}
}

// A destination that never answers the upstream's TCP connect (its SYNs
// are dropped) keeps an HTTP upstream from answering CONNECT, and a SOCKS5
// upstream (which answered the greeting) from replying, until their own
// connect timeouts, past proxyd's handshake_timeout. When two upstreams
// were silent on the request (at handshake_timeout, or cut by the budget
// after a quarter of it) and none answered it, the destination is the slow
// one: no upstream is blamed, and the client gets a timeout counted as the
// destination's. An upstream silent while a later one answers is blamed,
// and so is a lone silent one (a budget cut after a shorter wait tells
// nothing).
func TestUnreachableDestinationBlamesNoUpstream(t *testing.T) {
	checkLeaks(t)
	black := blackholeAddr(t)
	echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
	for _, tc := range []struct {
		name             string
		proto            pool.Protocol
		hung             int // the first upstreams hang (take the request and never answer)
		dest             string
		handshake, retry time.Duration
		want             []pool.Result // per upstream, in order; the rest are not tried
		status           int           // for an HTTP client; a SOCKS5 client gets 0x06 for 504
		outcome          Outcome
	}{
		{"http, three silent", pool.HTTP, 0, black, 300 * time.Millisecond, 5 * time.Second,
			[]pool.Result{pool.DestinationError, pool.DestinationError, pool.DestinationError}, 504, OutcomeDestinationError},
		{"socks5, three silent", pool.SOCKS5, 0, black, 300 * time.Millisecond, 5 * time.Second,
			[]pool.Result{pool.DestinationError, pool.DestinationError, pool.DestinationError}, 504, OutcomeDestinationError},
		{"http, the second cut by the budget", pool.HTTP, 0, black, 400 * time.Millisecond, 750 * time.Millisecond,
			[]pool.Result{pool.DestinationError, pool.Canceled}, 504, OutcomeDestinationError},
		// The defaults' ratio (10 s and 15 s): the second has a half.
		{"http, the second cut by the budget at the defaults' ratio", pool.HTTP, 0, black, 400 * time.Millisecond, 600 * time.Millisecond,
			[]pool.Result{pool.DestinationError, pool.Canceled}, 504, OutcomeDestinationError},
		{"http, the second cut at once", pool.HTTP, 0, black, 400 * time.Millisecond, 430 * time.Millisecond,
			[]pool.Result{pool.HandshakeTimeout, pool.Canceled}, 502, OutcomeUpstreamError},
		{"http, two hung then one that answers", pool.HTTP, 2, echo, 300 * time.Millisecond, 5 * time.Second,
			[]pool.Result{pool.HandshakeTimeout, pool.HandshakeTimeout, pool.Success}, 200, OutcomeOK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var ups []*pool.Upstream
			var accepted []func() int64
			for i := 1; i <= 3; i++ {
				if tc.proto == pool.SOCKS5 {
					s := newSOCKSUpstream(t, "u", "p", nil)
					ups = append(ups, s.upstream(i))
					accepted = append(accepted, s.accepted.Load)
				} else {
					h := newHTTPUpstream(t, "", "", nil)
					if i <= tc.hung {
						h.mode.Store(int32(modeHang))
					}
					ups = append(ups, h.upstream(i))
					accepted = append(accepted, h.accepted.Load)
				}
			}
			p := newFakePool(ups...)
			client := "http"
			if tc.proto == pool.SOCKS5 {
				client = "socks5"
			}
			tl := startListener(t, testConfig(func(c *Config) {
				c.Protocol = client
				c.AllowDestinations = loopbackAllowed
				c.HandshakeTimeout = tc.handshake
				c.RetryTimeout = tc.retry
				c.Retries = 2
			}), p)
			start := time.Now()
			c, br := askTunnel(t, client, tl.addr, tc.dest)
			if client == "http" {
				resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
				if err != nil || resp.StatusCode != tc.status {
					t.Errorf("CONNECT: %v %v, want %d", resp, err, tc.status)
				}
			} else {
				var reply [2]byte
				if _, err := io.ReadFull(br, reply[:]); err != nil || reply[1] != 0 {
					t.Fatalf("method selection %v %v", reply, err)
				}
				if _, err := io.ReadFull(br, reply[:]); err != nil || reply[1] != socks5.ReplyTTLExpired {
					t.Errorf("reply %#x, %v; want %#x", reply[1], err, socks5.ReplyTTLExpired)
				}
			}
			if took := time.Since(start); took > min(tc.retry, 3*tc.handshake)+time.Second {
				t.Errorf("answered after %s", took)
			}
			_ = c.Close()
			p.waitBalanced(t)
			var want []report
			for i, r := range tc.want {
				want = append(want, report{ups[i].ID(), r})
			}
			byID := func(a, b report) int { return strings.Compare(a.id, b.id) }
			slices.SortFunc(want, byID)
			if r := slices.SortedFunc(slices.Values(p.Reports()), byID); !slices.Equal(r, want) {
				t.Errorf("reports %+v, want %+v", r, want)
			}
			for i := len(tc.want); i < len(ups); i++ {
				if n := accepted[i](); n != 0 {
					t.Errorf("upstream %d was tried (%d connections)", i+1, n)
				}
			}
			waitFor(t, 5*time.Second, func() bool { return len(tl.obs.Closeds()) == 1 }, "the connection counted")
			if o := tl.obs.Closeds()[0].o; o != tc.outcome {
				t.Errorf("outcome %s, want %s", o, tc.outcome)
			}
		})
	}
}

// A client that half-closes in the middle of a download it reads slowly
// (a large chunk queued for it when it does) keeps its tunnel while it
// takes bytes: the last direction is watched for progress (the bytes the
// reader acknowledges), not bounded by a deadline. Its receive buffer is
// small from the start, so that what it reads is what moves on the wire.
func TestHalfCloseMidDownloadSlowReaderKeepsTunnel(t *testing.T) {
	checkLeaks(t)
	for _, halfClose := range []bool{true, false} {
		t.Run(fmt.Sprintf("halfClose=%v", halfClose), func(t *testing.T) { slowReaderKeepsTunnel(t, halfClose) })
	}
}

// slowReaderKeepsTunnel: also with both directions running, a slow reader
// of a large queue (one splice that outlasts idle_timeout) is progress.
func slowReaderKeepsTunnel(t *testing.T, halfClose bool) {
	flood := floodOrigin(t)
	const idle = time.Second
	p := newFakePool(newHTTPUpstream(t, "", "", nil).upstream(1))
	tl := startListener(t, testConfig(func(c *Config) {
		c.Protocol = ProtocolSOCKS5
		c.AllowDestinations = loopbackAllowed
		c.IdleTimeout = idle
	}), p)
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		return rc.Control(func(fd uintptr) { _ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
	}}
	c, err := d.Dial("tcp", tl.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	host, port, _ := splitHostPort(flood, 0)
	if _, err := socks5.ClientHandshake(c, socks5.Addr{Host: host, Port: port}, "", ""); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	start := time.Now()
	halfClosed := false
	// 40 KB/s, a read every 100 ms, for 4 idle_timeouts; half-closed after 1.
	for time.Since(start) < 4*idle {
		if halfClose && !halfClosed && time.Since(start) > idle {
			_ = c.(*net.TCPConn).CloseWrite()
			halfClosed = true
		}
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.ReadFull(c, buf); err != nil {
			t.Fatalf("the slowly reading client's download was cut after %s: %v", time.Since(start), err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if tl.ActiveConns() == 0 {
		t.Errorf("the tunnel of a client reading 40 KB/s ended after its half-close (idle_timeout %s)", idle)
	}
}
