//go:build unix

package forward

import (
	"io"
	"syscall"
	"testing"
	"time"
)

// tryRead answers at once: empty while nothing is queued, the bytes once
// they are, EOF after the peer's close.
func TestTryRead(t *testing.T) {
	peer, c := tcpPair(t)
	rc, err := c.(syscall.Conn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	p := make([]byte, 16)
	if n, empty, err := tryRead(rc, p); !empty || n != 0 || err != nil {
		t.Fatalf("nothing queued: %d, %v, %v; want empty", n, empty, err)
	}
	if _, err := peer.Write([]byte("abc")); err != nil {
		t.Fatal(err)
	}
	var got []byte
	waitFor(t, 5*time.Second, func() bool {
		n, empty, err := tryRead(rc, p)
		if err != nil {
			t.Fatal(err)
		}
		if !empty {
			got = append(got, p[:n]...)
		}
		return len(got) == 3
	}, "the bytes read")
	if string(got) != "abc" {
		t.Fatalf("read %q", got)
	}
	_ = peer.Close()
	waitFor(t, 5*time.Second, func() bool {
		_, empty, err := tryRead(rc, p)
		if !empty && err != io.EOF {
			t.Fatalf("after the peer's close: %v", err)
		}
		return err == io.EOF
	}, "EOF")
}
