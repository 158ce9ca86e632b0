package forward

import (
	"fmt"
	"net"
	"syscall"
	"testing"
	"time"

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
