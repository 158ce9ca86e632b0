//go:build unix

package forward

import "syscall"

// peerSilent reports whether an idle connection has nothing to read: a
// closed or reset connection, or one the upstream wrote to unasked, is not
// worth a request. rc is the connection's socket, kept from the dial (nil:
// no socket of its own, which passes).
func peerSilent(rc syscall.RawConn) bool {
	if rc == nil {
		return true
	}
	silent := false
	err := rc.Read(func(fd uintptr) bool {
		_, perr := peekByte(fd)
		silent = perr == syscall.EAGAIN
		return true
	})
	return err == nil && silent
}

// canAwaitPeer: peerGone can wait here.
const canAwaitPeer = true

// peerGone waits until a connection has something to read and reports
// whether that is its end (end of stream, reset) rather than bytes, which
// stay queued. A read deadline or a close ends the wait (false).
func peerGone(rc syscall.RawConn) bool {
	gone := false
	err := rc.Read(func(fd uintptr) bool {
		n, perr := peekByte(fd)
		if perr == syscall.EAGAIN {
			return false
		}
		gone = perr != nil || n == 0
		return true
	})
	return err == nil && gone
}

// peekByte peeks at the socket fd without waiting and leaves what it sees
// queued: 1 with bytes there, 0 at the end of stream, EAGAIN with nothing
// yet, or the socket's error.
func peekByte(fd uintptr) (int, error) {
	var b [1]byte
	for {
		n, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		if err != syscall.EINTR {
			return n, err
		}
	}
}
