package forward

import (
	"net"
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

// A tunnel's client on this machine gets a fixed send buffer instead of
// autotuning's 4 MiB.
func TestLoopbackClientSendBuffer(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	sndbuf := func() int {
		rc, _ := s.(*net.TCPConn).SyscallConn()
		var v int
		_ = rc.Control(func(fd uintptr) { v, _ = syscall.GetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_SNDBUF) })
		return v
	}
	before := sndbuf()
	tuneClientConn(s)
	if got := sndbuf(); got != 2*loopbackSendBuf {
		t.Errorf("send buffer %d (before %d), want %d", got, before, 2*loopbackSendBuf)
	}
}
