//go:build unix

package forward

import (
	"errors"
	"io"
	"net"
	"os"
	"syscall"
)

// A read that must not wait: a connection's socket is non-blocking, so a
// read made inside its readiness check (syscall.RawConn.Read with a
// function that always reports done) answers at once.

// tryRead reads what c has queued now. empty reports that nothing was there
// yet (or that c has no socket to ask); then the caller reads c as usual.
func tryRead(rc syscall.RawConn, p []byte) (n int, empty bool, err error) {
	if rc == nil || len(p) == 0 {
		return 0, true, nil
	}
	var rerr error
	err = rc.Read(func(fd uintptr) bool {
		for {
			n, rerr = syscall.Read(int(fd), p)
			if !errors.Is(rerr, syscall.EINTR) {
				return true
			}
		}
	})
	switch {
	case err != nil:
		return 0, false, err
	case errors.Is(rerr, syscall.EAGAIN):
		return 0, true, nil
	case rerr != nil:
		return 0, false, &net.OpError{Op: "read", Net: "tcp", Err: os.NewSyscallError("read", rerr)}
	case n == 0:
		return 0, false, io.EOF
	}
	return n, false, nil
}
