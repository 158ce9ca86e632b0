package forward

import (
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// A direction that moves bulk data between two TCP sockets passes it
// through a kernel pipe (splice(2)): the pages the bytes arrived in go on to
// the other socket without being copied into proxyd and out again. With 16
// bulk tunnels at once on 2 cores that halved proxyd's CPU per byte
// (BENCHMARKS.md). At the pace of one stream that proxyd keeps up with,
// reads are 32–128 KiB, and there splicing costs everyone more than copying:
// the client gets the bytes in the upstream's small pieces and the upstream
// cannot reuse its send pages while they travel on. So a direction splices
// only while it has a backlog (a read filled a large buffer, and each splice
// keeps moving at least spliceMin), and gives the pipe back as soon as the
// backlog is gone: an idle direction holds no pipe.
const (
	pipeSize       = 1 << 20
	spliceMin      = 256 << 10
	maxCachedPipes = 16 // per listener
)

// splicePipe is a kernel pipe holding n bytes on their way to the destination.
type splicePipe struct {
	r, w int
	n    int
}

func newPipe() *splicePipe {
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		return nil
	}
	p := &splicePipe{r: fds[0], w: fds[1]}
	// Fails past the user's pipe-page limit (fs.pipe-user-pages-soft)
	// unless proxyd runs with CAP_SYS_RESOURCE; the direction then copies.
	if _, err := unix.FcntlInt(uintptr(p.w), unix.F_SETPIPE_SZ, pipeSize); err != nil {
		p.close()
		return nil
	}
	return p
}

func (p *splicePipe) close() {
	_ = unix.Close(p.r)
	_ = unix.Close(p.w)
}

// pipeCache keeps a listener's empty pipes for the next bulk transfer; the
// listener closes them when it closes.
type pipeCache struct {
	mu     sync.Mutex
	free   []*splicePipe
	closed bool
}

// get returns an empty pipe, or nil when none can be made.
func (c *pipeCache) get() *splicePipe {
	c.mu.Lock()
	if n := len(c.free); n > 0 {
		p := c.free[n-1]
		c.free = c.free[:n-1]
		c.mu.Unlock()
		return p
	}
	c.mu.Unlock()
	return newPipe()
}

// put keeps an empty pipe; a pipe still holding bytes (a transfer that
// ended in an error) is closed.
func (c *pipeCache) put(p *splicePipe) {
	c.mu.Lock()
	if p.n == 0 && !c.closed && len(c.free) < maxCachedPipes {
		c.free = append(c.free, p)
		p = nil
	}
	c.mu.Unlock()
	if p != nil {
		p.close()
	}
}

func (c *pipeCache) close() {
	c.mu.Lock()
	free := c.free
	c.free, c.closed = nil, true
	c.mu.Unlock()
	for _, p := range free {
		p.close()
	}
}

// splice moves src to dst through p while src has a backlog. It never waits
// for src: when src has less than spliceMin queued it returns, and the pump
// goes back to waiting on src without holding p. It waits for dst as a
// write would, and keeps src's idle deadline current.
func (t *tunnel) splice(dst, src syscall.RawConn, p *splicePipe, deadline *readDeadline) (int64, spliceResult) {
	var n int64
	for {
		deadline.arm()
		var (
			in    int64
			errno error
		)
		if err := src.Read(func(fd uintptr) bool {
			in, errno = spliceEINTR(int(fd), p.w, pipeSize)
			return true
		}); err != nil {
			return n, spliceFailed
		}
		switch {
		case errno == syscall.EAGAIN:
			return n, spliceCaughtUp
		case errno != nil:
			return n, spliceFailed
		case in == 0:
			return n, spliceEOF
		}
		p.n = int(in)
		if err := dst.Write(func(fd uintptr) bool {
			for p.n > 0 {
				out, e := spliceEINTR(p.r, int(fd), p.n)
				if e == syscall.EAGAIN {
					return false
				}
				if e != nil {
					errno = e
					return true
				}
				p.n -= int(out)
				n += out
			}
			return true
		}); err != nil || errno != nil {
			return n, spliceFailed
		}
		t.spliced.Add(in)
		t.touch()
		if in < spliceMin {
			return n, spliceCaughtUp
		}
	}
}

// spliceEINTR splices n bytes (again on EINTR) with a raw system call, as
// rawRead reads: the call never waits (the sockets and the pipe are
// non-blocking), and through the scheduler's system-call path a splice of a
// whole backlog was long enough for the runtime's monitor to hand the
// processor to another thread each time.
func spliceEINTR(from, to, n int) (int64, error) {
	for {
		r1, _, e := syscall.RawSyscall6(unix.SYS_SPLICE, uintptr(from), 0, uintptr(to), 0, uintptr(n), unix.SPLICE_F_MOVE|unix.SPLICE_F_NONBLOCK)
		switch e {
		case 0:
			return int64(r1), nil
		case syscall.EINTR:
		default:
			return 0, e
		}
	}
}
