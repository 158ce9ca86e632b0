package forward

import (
	"bytes"
	"io"
	"net"
	"runtime"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// What is Linux's in the relay: the keep-alive options of its sockets
// (TCP_KEEPIDLE), their receive queues (SIOCINQ) and the pipes of its
// splices (splice_linux.go).

// Clients on this machine get no TCP keep-alive (Listen leaves it off and
// Serve turns it on only for other machines); upstream connections get
// keep-alive.
func TestLocalClientSocketOptions(t *testing.T) {
	checkLeaks(t)
	u := newHTTPUpstream(t, "", "", nil)
	echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
	tl := startListener(t, testConfig(func(c *Config) { c.Protocol = "http"; c.AllowDestinations = loopbackAllowed }), newFakePool(u.upstream(1)))
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
	var keepAlive int
	_ = rc.Control(func(fd uintptr) {
		keepAlive, _ = syscall.GetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_KEEPALIVE)
	})
	if keepAlive != 0 {
		t.Errorf("SO_KEEPALIVE %d on a loopback client's connection", keepAlive)
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
	urc, err := ups[0].(syscall.Conn).SyscallConn()
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

// A backlog between two TCP sockets moves byte for byte, and once it is
// gone the direction, waiting for more, holds no pipe: the process has the
// file descriptors it had before the pump started, while the tunnel stays
// open.
func TestRelayIdleDirectionHoldsNoPipe(t *testing.T) {
	checkLeaks(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	// proxyd's side of the upstream connection gets a receive window large
	// enough to queue the whole first burst before the pump starts.
	d := net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		return c.Control(func(fd uintptr) {
			_ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 8<<20)
		})
	}}
	src, err := d.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = src.Close() })
	origin, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = origin.Close() })
	dst, client := tcpPair(t)

	const burst = 6 << 20
	data := make([]byte, 2*burst)
	for i := range data {
		data[i] = byte(i*7 + i>>11)
	}
	if _, err := origin.Write(data[:burst]); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, func() bool { return queued(t, src) == burst }, "the burst queued at proxyd's side")

	fds := countFDs(t)
	tu := &tunnel{idle: time.Minute, a: dst, b: src}
	tu.remaining.Store(2)
	pumped := make(chan int64, 1)
	go func() { pumped <- tu.pump(dst, src) }()

	got := make([]byte, len(data))
	if _, err := io.ReadFull(client, got[:burst]); err != nil {
		t.Fatal(err)
	}
	// The runtime keeps spare pipes in a sync.Pool, closed once collected.
	waitFor(t, 5*time.Second, func() bool {
		runtime.GC()
		return countFDs(t) == fds
	}, "no pipe held by the idle direction")

	if _, err := origin.Write(data[burst:]); err != nil {
		t.Fatal(err)
	}
	_ = origin.Close()
	if _, err := io.ReadFull(client, got[burst:]); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Fatal("the bytes arrived changed")
	}
	if n := <-pumped; n != int64(len(data)) {
		t.Fatalf("pump counted %d bytes, want %d", n, len(data))
	}
	// The EOF was passed on.
	if n, err := client.Read(got[:1]); n != 0 || err != io.EOF {
		t.Fatalf("after the last byte: %d, %v; want EOF", n, err)
	}
}

// queued returns the bytes waiting in c's receive queue.
func queued(t *testing.T, c net.Conn) int {
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var n int
	_ = rc.Control(func(fd uintptr) { n, _ = unix.IoctlGetInt(int(fd), unix.SIOCINQ) })
	return n
}

// TCP urgent data in a tunnel does not stall its direction: a splice stops
// at the urgent mark and moves nothing, and the pump then reads past it.
// The urgent byte itself is dropped, as by any relay that reads (no
// SO_OOBINLINE); the bytes around it arrive, and so does the EOF.
func TestRelayUrgentData(t *testing.T) {
	checkLeaks(t)
	origin, src := tcpPair(t)
	dst, client := tcpPair(t)
	rc, err := origin.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var serr error
	// The last byte of a MSG_OOB send is the urgent one.
	if err := rc.Control(func(fd uintptr) { serr = syscall.Sendto(int(fd), []byte("abcX"), syscall.MSG_OOB, nil) }); err != nil || serr != nil {
		t.Fatalf("sending urgent data: %v %v", err, serr)
	}
	if _, err := origin.Write([]byte("def")); err != nil {
		t.Fatal(err)
	}
	_ = origin.(*net.TCPConn).CloseWrite()

	tu := &tunnel{idle: time.Minute, a: dst, b: src}
	tu.remaining.Store(2)
	pumped := make(chan int64, 1)
	go func() { pumped <- tu.pump(dst, src) }()
	defer func() {
		tu.closeBoth() // ends a pump stuck at the mark
		<-pumped
	}()

	_ = client.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, err := io.ReadAll(client)
	if err != nil || string(got) != "abcdef" {
		t.Fatalf("client got %q, %v; want \"abcdef\" and EOF", got, err)
	}
}

// A buffered copy of a direction's queue (a TLS upstream, urgent data)
// counts each write as the tunnel's progress, not only its end: the
// queue may be megabytes, and watchLast must see a slow reader take them.
func TestBufferedCopyTouchesEachWrite(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	tu := &tunnel{idle: time.Minute}
	var touches []int64
	done := make(chan struct{})
	go func() { // a reader taking 32 KiB at a time, noting the tunnel's last touch
		defer close(done)
		buf := make([]byte, 32<<10)
		for {
			if _, err := io.ReadFull(b, buf); err != nil {
				return
			}
			touches = append(touches, tu.lastSeen.Load())
		}
	}()
	src := io.LimitedReader{R: bytes.NewReader(make([]byte, 4*copyBufSize)), N: 4 * copyBufSize}
	if n, err := tu.copyBuffered(a, &src); err != nil || n != 4*copyBufSize {
		t.Fatalf("copied %d, %v", n, err)
	}
	a.Close()
	<-done
	// The reader notes the last touch as each write ends: all but the
	// first of its notes follow a write that touched.
	seen := 0
	for _, v := range touches {
		if v != 0 {
			seen++
		}
	}
	if seen < 2 {
		t.Errorf("touches seen by the reader: %v, want one per write", touches)
	}
}
