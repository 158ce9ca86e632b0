package forward

import (
	"net"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
)

// Large relay buffers are rationed per listener and every one taken is
// given back.
func TestRelayLargeBufferRation(t *testing.T) {
	var large atomic.Int64
	tu := &tunnel{large: &large}
	small := relayBufs.Get().(*[]byte)
	got := tu.grow(small)
	if len(*got) != relayLargeBufSize || large.Load() != 1 {
		t.Fatalf("grow under the ration: %d bytes, %d in use", len(*got), large.Load())
	}
	tu.putBuf(got)
	if large.Load() != 0 {
		t.Fatalf("%d large buffers in use after putBuf", large.Load())
	}
	large.Store(maxLargeBufs)
	small = relayBufs.Get().(*[]byte)
	if got := tu.grow(small); got != small || large.Load() != maxLargeBufs {
		t.Fatalf("grow past the ration must keep the small buffer (%d in use)", large.Load())
	}
	tu.putBuf(small)
	if large.Load() != maxLargeBufs {
		t.Fatalf("a small buffer changed the ration: %d", large.Load())
	}
}

// Clients on this machine get no TCP keep-alive (Listen leaves it off and
// Serve turns it on only for other machines), and a tunnel's client the
// fixed send buffer; upstream connections get keep-alive.
func TestLocalClientSocketOptions(t *testing.T) {
	checkLeaks(t)
	u := newHTTPUpstream(t, "", "", nil)
	echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
	tl := startListener(t, Config{Protocol: "http", AllowDestinations: loopbackAllowed}, newFakePool(u.upstream(1)))
	c, br, resp := rawConnect(t, tl.addr, echo, "")
	if resp.StatusCode != 200 {
		t.Fatalf("CONNECT: %d", resp.StatusCode)
	}
	defer c.Close()
	// A byte there and back: the relay runs, so the tunnel is set up.
	if _, err := c.Write([]byte{1}); err != nil {
		t.Fatal(err)
	}
	if _, err := br.ReadByte(); err != nil {
		t.Fatal(err)
	}
	tl.mu.Lock()
	var conns []*clientConn
	for cc := range tl.conns {
		conns = append(conns, cc)
	}
	tl.mu.Unlock()
	if len(conns) != 1 {
		t.Fatalf("%d client connections", len(conns))
	}
	rc, err := conns[0].Conn.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var keepAlive, sndbuf int
	_ = rc.Control(func(fd uintptr) {
		keepAlive, _ = syscall.GetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_KEEPALIVE)
		sndbuf, _ = syscall.GetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_SNDBUF)
	})
	if keepAlive != 0 {
		t.Errorf("SO_KEEPALIVE %d on a loopback client's connection", keepAlive)
	}
	// The kernel doubles what it is asked for, up to twice net.core.wmem_max.
	want := 2 * loopbackSendBuf
	if b, err := os.ReadFile("/proc/sys/net/core/wmem_max"); err == nil {
		if max, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			want = 2 * min(loopbackSendBuf, max)
		}
	}
	if sndbuf != want {
		t.Errorf("SO_SNDBUF %d, want %d", sndbuf, want)
	}

	// The upstream connection: keep-alive after 30 s of silence.
	tl.mu.Lock()
	var ups []net.Conn
	for uc := range tl.upconns {
		ups = append(ups, uc)
	}
	tl.mu.Unlock()
	if len(ups) != 1 {
		t.Fatalf("%d upstream connections", len(ups))
	}
	urc, err := ups[0].(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var upKeepAlive, idle int
	_ = urc.Control(func(fd uintptr) {
		upKeepAlive, _ = syscall.GetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_KEEPALIVE)
		idle, _ = syscall.GetsockoptInt(int(fd), syscall.IPPROTO_TCP, syscall.TCP_KEEPIDLE)
	})
	if upKeepAlive != 1 || idle != 30 {
		t.Errorf("upstream connection: SO_KEEPALIVE %d, TCP_KEEPIDLE %d; want 1, 30", upKeepAlive, idle)
	}
}
