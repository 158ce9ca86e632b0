package forward

import (
	"errors"
	"io"
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// On Linux, io.Copy between two *net.TCPConn splices: the bytes go from one
// socket through a kernel pipe to the other without being copied into
// proxyd and out again. But a splice that waits for its source holds its
// pipe (two file descriptors) all the while, so a plain io.Copy costs an
// idle tunnel four descriptors more than its two sockets. pumpTCP therefore
// waits for src to be readable first, holding nothing, and then splices
// exactly the bytes queued, which never waits for src.

// pumpTCP is pump for a TCP src: wait until src has bytes (or its EOF),
// then io.Copy exactly those bytes, which splices when dst is TCP too.
func (t *tunnel) pumpTCP(dst net.Conn, src *net.TCPConn) int64 {
	rc, err := src.SyscallConn()
	if err != nil {
		return t.pumpBuffered(dst, src)
	}
	w := &queueWait{lr: io.LimitedReader{R: src}}
	w.fn = w.check
	deadline := readDeadline{conn: src, idle: t.idle}
	var n int64
	for {
		deadline.arm()
		w.queued, w.err = 0, nil
		err := rc.Read(w.fn)
		if err == nil {
			err = w.err
		}
		if err != nil {
			if t.stillActive(src, err) {
				deadline.last = time.Time{}
				continue
			}
			t.closeBoth()
			return n
		}
		if w.queued == 0 {
			t.halfClose(dst)
			return n
		}
		w.lr.N = int64(w.queued)
		m, err := copyQueued(dst, &w.lr)
		if m == 0 && err == nil {
			// A splice stops at TCP urgent data and moves nothing, while
			// the queue still counts the bytes behind it; a read steps
			// over the urgent byte, as it does for any relay that reads.
			m, err = copyBuffered(dst, &w.lr)
		}
		n += m
		t.touch()
		if err != nil {
			t.closeBoth()
			return n
		}
	}
}

// copyQueued copies what lr allows: by splicing when dst is TCP, else
// through a pooled buffer.
func copyQueued(dst net.Conn, lr *io.LimitedReader) (int64, error) {
	if d, ok := dst.(*net.TCPConn); ok {
		return d.ReadFrom(lr)
	}
	return copyBuffered(dst, lr)
}

// copyBuffered copies what lr allows through a pooled buffer (io.Copy
// would allocate one per call, or splice).
func copyBuffered(dst net.Conn, lr *io.LimitedReader) (int64, error) {
	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	return io.CopyBuffer(struct{ io.Writer }{dst}, lr, *bp)
}

// queueWait is the check a direction makes inside src's readiness wait,
// and the reader of what it found, kept on the heap with its function value
// so that a turn allocates nothing.
type queueWait struct {
	fn     func(fd uintptr) bool
	peek   [1]byte
	queued int // bytes waiting; 0 with err nil: EOF
	err    error
	lr     io.LimitedReader
}

// check reports whether src has something for the direction: bytes queued,
// an EOF or an error. SIOCINQ counts the queued bytes; only when it says
// none does a one-byte peek tell EOF and errors from "nothing yet".
func (w *queueWait) check(fd uintptr) bool {
	if q, err := unix.IoctlGetInt(int(fd), unix.SIOCINQ); err == nil && q > 0 {
		w.queued = q
		return true
	}
	for {
		// syscall's Recvfrom, not x/sys/unix's: the latter allocates the
		// sender's address at every call (5 of a tunnel's allocations).
		n, _, err := syscall.Recvfrom(int(fd), w.peek[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		switch {
		case errors.Is(err, syscall.EINTR):
			continue
		case errors.Is(err, syscall.EAGAIN):
			return false
		case err != nil:
			w.err = &net.OpError{Op: "read", Net: "tcp", Err: err}
		case n > 0:
			// SIOCINQ said nothing (urgent data, or a race): move at least
			// the byte seen.
			w.queued = 1
		}
		return true
	}
}
