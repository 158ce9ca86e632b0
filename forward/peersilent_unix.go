//go:build unix

package forward

import (
	"net"
	"syscall"
)

// peerSilent reports whether an idle connection has nothing to read: a
// closed or reset connection, or one the upstream wrote to unasked, is not
// worth a request. Connections without a socket of their own pass.
func peerSilent(c net.Conn) bool {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return true
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	silent := false
	err = rc.Read(func(fd uintptr) bool {
		var b [1]byte
		_, _, rerr := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		silent = rerr == syscall.EAGAIN
		return true
	})
	return err == nil && silent
}
