package forward

import (
	"errors"
	"io"
	"net"
	"os"
	"syscall"
)

// Sockets are non-blocking, so a read or write system call never waits:
// rawIO makes them as raw system calls inside the runtime's readiness waits
// (syscall.RawConn), which honour deadlines and closing like net.Conn's own.
// Go's net.Conn enters each call through the scheduler's system-call path,
// and the first one after the process was idle wakes the runtime's monitor
// thread: a futex wake-up per request on a lightly loaded proxy, which
// showed as 15% of proxyd's CPU at one request at a time. A raw call skips
// that path; what it costs is that it cannot be preempted while the kernel
// copies (at most one buffer, microseconds).
type rawIO struct {
	rc    syscall.RawConn
	laddr net.Addr
	raddr net.Addr
}

// newRawIO returns nil for a connection without a socket of its own.
// A rawIO is an io.ReadWriter.
func newRawIO(c net.Conn) *rawIO {
	if !rawIOSupported {
		return nil
	}
	sc, ok := c.(syscall.Conn)
	if !ok {
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	return &rawIO{rc: rc, laddr: c.LocalAddr(), raddr: c.RemoteAddr()}
}

func (r *rawIO) Read(p []byte) (int, error) {
	n, _, err := r.read(p, true)
	return n, err
}

// tryRead is Read without the wait: empty reports that nothing was there to
// read yet.
func (r *rawIO) tryRead(p []byte) (n int, empty bool, err error) {
	return r.read(p, false)
}

func (r *rawIO) read(p []byte, wait bool) (int, bool, error) {
	if len(p) == 0 {
		return 0, false, nil
	}
	var (
		n     int
		errno syscall.Errno
	)
	err := r.rc.Read(func(fd uintptr) bool {
		n, errno = rawRead(fd, p)
		return errno != syscall.EAGAIN || !wait
	})
	switch {
	case err != nil:
		return 0, false, asNetOp(err, "read")
	case errno == syscall.EAGAIN:
		return 0, true, nil
	case errno != 0:
		return 0, false, r.opError("read", errno)
	case n == 0:
		return 0, false, io.EOF
	}
	return n, false, nil
}

func (r *rawIO) Write(p []byte) (int, error) {
	var (
		n     int
		errno syscall.Errno
	)
	err := r.rc.Write(func(fd uintptr) bool {
		for n < len(p) {
			w, e := rawWrite(fd, p[n:])
			switch e {
			case 0:
				n += w
			case syscall.EAGAIN:
				return false
			default:
				errno = e
				return true
			}
		}
		return true
	})
	switch {
	case err != nil:
		return n, asNetOp(err, "write")
	case errno != 0:
		return n, r.opError("write", errno)
	}
	return n, nil
}

// asNetOp names a RawConn error ("raw-read": deadline, closed) as the
// net.Conn operation it stands for: net/http, for one, tells a client gone
// from a broken request by Op "read".
func asNetOp(err error, op string) error {
	var oe *net.OpError
	if errors.As(err, &oe) {
		oe.Op = op
	}
	return err
}

func (r *rawIO) opError(op string, errno syscall.Errno) error {
	return &net.OpError{Op: op, Net: "tcp", Source: r.laddr, Addr: r.raddr, Err: os.NewSyscallError(op, errno)}
}

// rawOf returns the rawIO c's reads and writes can go through: the one a
// client connection or a raw-wrapped upstream already has, or a new one;
// nil when c has no socket of its own (a wrapper holding bytes of its own).
func rawOf(c net.Conn) *rawIO {
	switch c := c.(type) {
	case *rawConn:
		return c.io
	case *clientConn:
		r, _ := c.rw.(*rawIO)
		return r
	}
	return newRawIO(c)
}

// rawConn is a net.Conn whose reads and writes go through rawIO.
type rawConn struct {
	net.Conn
	io *rawIO
}

// withRawIO wraps c, or returns it as it is when it has no socket of its own.
func withRawIO(c net.Conn) net.Conn {
	if r := newRawIO(c); r != nil {
		return &rawConn{Conn: c, io: r}
	}
	return c
}

func (c *rawConn) Read(p []byte) (int, error)  { return c.io.Read(p) }
func (c *rawConn) Write(p []byte) (int, error) { return c.io.Write(p) }

// CloseWrite passes a half-close on; a connection that cannot half-close is
// closed, which says the same to its peer.
func (c *rawConn) CloseWrite() error {
	if cw, ok := c.Conn.(closeWriter); ok {
		return cw.CloseWrite()
	}
	return c.Conn.Close()
}

// SyscallConn gives the socket, for readiness checks.
func (c *rawConn) SyscallConn() (syscall.RawConn, error) { return c.io.rc, nil }
