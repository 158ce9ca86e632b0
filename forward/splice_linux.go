package forward

import (
	"io"
	"net"
	"os"
	"syscall"

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
	deadline := idleDeadline{conn: src, idle: t.idle}
	var n int64
	for {
		deadline.arm()
		w.queued, w.err = 0, nil
		err := rc.Read(w.fn)
		if err == nil {
			err = w.err
		}
		if err != nil {
			if t.stillActive(err, src) {
				continue
			}
			t.closeBoth()
			return n
		}
		if w.queued == 0 {
			t.halfClose(dst, src)
			return n
		}
		w.lr.N = int64(w.queued)
		m, err := t.copyQueued(dst, &w.lr)
		if m == 0 && err == nil {
			// A splice stops at TCP urgent data and moves nothing, while
			// the queue still counts the bytes behind it; a read steps
			// over the urgent byte, as it does for any relay that reads.
			m, err = t.copyBuffered(dst, &w.lr)
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
func (t *tunnel) copyQueued(dst net.Conn, lr *io.LimitedReader) (int64, error) {
	if d, ok := dst.(*net.TCPConn); ok {
		return d.ReadFrom(lr)
	}
	return t.copyBuffered(dst, lr)
}

// copyBuffered copies what lr allows through a pooled buffer (io.Copy
// would allocate one per call, or splice), each write counting as the
// tunnel's progress: the queue it copies may be megabytes, which a slow
// reader takes longer than idle_timeout to take (watchLast).
func (t *tunnel) copyBuffered(dst net.Conn, lr *io.LimitedReader) (int64, error) {
	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	return io.CopyBuffer(touchingWriter{t, dst}, lr, *bp)
}

// touchingWriter is a tunnel's dst whose every write touches the tunnel.
type touchingWriter struct {
	t *tunnel
	w io.Writer
}

func (tw touchingWriter) Write(p []byte) (int, error) {
	n, err := tw.w.Write(p)
	if n > 0 {
		tw.t.touch()
	}
	return n, err
}

// queueWait is the check a direction makes inside src's readiness wait,
// and the reader of what it found, kept on the heap with its function value
// so that a turn allocates nothing.
type queueWait struct {
	fn     func(fd uintptr) bool
	queued int // bytes waiting; 0 with err nil: EOF
	err    error
	lr     io.LimitedReader
}

// peekAll is the most a check counts in one turn; more waits for the next.
const peekAll = 1 << 30

// check reports whether src has something for the direction: bytes queued,
// an EOF or an error. One recv with MSG_PEEK|MSG_TRUNC tells all three: on
// TCP, MSG_TRUNC counts the bytes it would copy without copying them, and
// MSG_PEEK leaves them queued, so it returns the queued count, 0 at EOF, or
// EAGAIN when there is nothing yet. (Before, SIOCINQ counted and a one-byte
// peek told EOF from "nothing yet": two system calls where one does.)
func (w *queueWait) check(fd uintptr) bool {
	for {
		n, _, errno := syscall.Syscall6(unix.SYS_RECVFROM, fd, 0, peekAll,
			syscall.MSG_PEEK|syscall.MSG_TRUNC|syscall.MSG_DONTWAIT, 0, 0)
		switch errno {
		case 0:
			w.queued = int(n)
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			return false
		default:
			w.err = &net.OpError{Op: "read", Net: "tcp", Err: os.NewSyscallError("recvfrom", errno)}
		}
		return true
	}
}

// acked is how many bytes c's peer acknowledged (TCP_INFO), 0 when c is
// no TCP connection or the system does not say: watchLast's measure of a
// reader's progress inside a write that has not returned.
func acked(c net.Conn) uint64 {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return 0
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return 0
	}
	var n uint64
	_ = rc.Control(func(fd uintptr) {
		if info, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
			n = info.Bytes_acked
		}
	})
	return n
}
