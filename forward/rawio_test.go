package forward

import (
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"
)

// rawConn behaves as the net.Conn it wraps: data both ways, deadlines as
// timeouts, EOF at the peer's close, errors for a closed connection.
func TestRawConn(t *testing.T) {
	peer, s := tcpPair(t)
	c := withRawIO(s)
	if _, ok := c.(*rawConn); !ok {
		t.Fatalf("withRawIO(%T) = %T", s, c)
	}
	defer c.Close()

	big := make([]byte, 8<<20) // more than the socket buffers: the write waits for the reader
	for i := range big {
		big[i] = byte(i)
	}
	done := make(chan error, 1)
	go func() {
		got := make([]byte, len(big))
		_, err := io.ReadFull(peer, got)
		if err == nil && string(got) != string(big) {
			err = errors.New("data differs")
		}
		done <- err
	}()
	if n, err := c.Write(big); n != len(big) || err != nil {
		t.Fatalf("Write: %d %v", n, err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	if _, err := peer.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 16)
	if n, err := c.Read(buf); err != nil || string(buf[:n]) != "hello" {
		t.Fatalf("Read: %q %v", buf[:n], err)
	}
	if n, err := c.Read(buf[:0]); n != 0 || err != nil {
		t.Errorf("empty Read: %d %v", n, err)
	}

	_ = c.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	_, err := c.Read(buf)
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("Read past the deadline: %v", err)
	}
	_ = c.SetReadDeadline(time.Time{})

	_ = peer.Close()
	if n, err := c.Read(buf); n != 0 || err != io.EOF {
		t.Errorf("Read after the peer closed: %d %v", n, err)
	}
	_ = c.Close()
	_, err = c.Read(buf)
	var oe *net.OpError
	if !errors.Is(err, net.ErrClosed) || !errors.As(err, &oe) || oe.Op != "read" {
		t.Errorf("Read after Close: %v", err)
	}
	if _, err := c.Write(buf); !errors.Is(err, net.ErrClosed) {
		t.Errorf("Write after Close: %v", err)
	}
}

// A write to a connection the peer reset is an error naming the system call.
func TestRawConnReset(t *testing.T) {
	peer, s := tcpPair(t)
	c := withRawIO(s)
	defer c.Close()
	_ = peer.(*net.TCPConn).SetLinger(0)
	_ = peer.Close() // RST
	// Writes are taken until the reset has been processed (at once on an
	// idle machine, later when the kernel defers it).
	var werr error
	deadline := time.Now().Add(5 * time.Second)
	for werr == nil && time.Now().Before(deadline) {
		if _, werr = c.Write([]byte("x")); werr == nil {
			time.Sleep(time.Millisecond)
		}
	}
	var se *os.SyscallError
	if !errors.As(werr, &se) {
		t.Errorf("write after reset: %v", werr)
	}
}

// tcpPair is a connected pair of loopback TCP connections, closed when the
// test ends.
func tcpPair(t *testing.T) (dialed, accepted net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	dialed, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = dialed.Close() })
	accepted, err = ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = accepted.Close() })
	return dialed, accepted
}
