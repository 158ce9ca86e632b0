package forward

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// A direction that wakes up reads into a small pooled buffer; once a read
// fills it, the direction is moving bulk data and switches to a large one,
// so that each read and write moves as much as the sockets hold (one wake-up
// of the reader on the other side per large write). Both go back to their
// pool as soon as a read would block: an idle direction holds neither.
//
// Large buffers are rationed per listener (maxLargeBufs), so that thousands
// of bulk transfers at once cannot take gigabytes: past the ration a
// direction keeps its small buffer.
const (
	relayBufSize      = 64 << 10
	relayLargeBufSize = 1 << 20
	maxLargeBufs      = 128 // per listener: at most 128 MiB in large buffers
)

var (
	relayBufs      = sync.Pool{New: func() any { b := make([]byte, relayBufSize); return &b }}
	relayLargeBufs = sync.Pool{New: func() any { b := make([]byte, relayLargeBufSize); return &b }}
)

// putBuf returns a relay buffer to its pool (and a large one to the ration).
func (t *tunnel) putBuf(bp *[]byte) {
	if len(*bp) == relayLargeBufSize {
		relayLargeBufs.Put(bp)
		t.large.Add(-1)
	} else {
		relayBufs.Put(bp)
	}
}

// grow swaps a small buffer for a large one if the ration allows.
func (t *tunnel) grow(bp *[]byte) *[]byte {
	if t.large.Add(1) > maxLargeBufs {
		t.large.Add(-1)
		return bp
	}
	relayBufs.Put(bp)
	return relayLargeBufs.Get().(*[]byte)
}

// loopbackSendBuf caps the send buffer toward a client on this machine
// (the kernel doubles it, to 512 KiB where net.core.wmem_max allows). Autotuning grows it to 4 MiB, which a
// peer a few microseconds away never needs: the bytes only wait longer,
// out of the CPU caches, and a slow local reader pins more memory. With
// 16 bulk tunnels at once on 2 cores it moved proxied/direct throughput
// from 0.72 to 0.79 on average (BENCHMARKS.md). Remote clients keep
// autotuning, which their round-trip times need.
const loopbackSendBuf = 256 << 10

// tunnel relays bytes between a client and an upstream connection.
type tunnel struct {
	large     *atomic.Int64 // the listener's large buffers and pipes in use
	pipes     *pipeCache
	idle      time.Duration
	lastSeen  atomic.Int64 // unix nanoseconds of the last byte moved either way
	once      sync.Once
	a, b      net.Conn
	up, down  int64        // bytes each way, written by their pump
	remaining atomic.Int32 // pumps still running
	spliced   atomic.Int64 // bytes moved without copying them through proxyd
}

// relay copies between the client and the upstream in two goroutines the
// listener owns, until both directions are done, an error occurs or the
// tunnel is idle for IdleTimeout. The last pump to end closes both conns,
// adds the bytes to cc and calls done.
func (l *Listener) relay(cc *clientConn, upstream net.Conn, done func()) {
	if tc, ok := cc.Conn.(*net.TCPConn); ok && cc.local {
		_ = tc.SetWriteBuffer(loopbackSendBuf)
	}
	t := &tunnel{idle: l.cfg.IdleTimeout, a: cc.Conn, b: upstream, large: &l.largeBufs, pipes: &l.pipes}
	t.lastSeen.Store(time.Now().UnixNano())
	t.remaining.Store(2)
	finish := func() {
		if t.remaining.Add(-1) == 0 {
			t.closeBoth()
			cc.up.Add(t.up)
			cc.down.Add(t.down)
			done()
		}
	}
	if !l.spawn(func() { t.up = t.pump(upstream, cc.Conn); finish() }) {
		t.closeBoth()
		done()
		return
	}
	if !l.spawn(func() { t.down = t.pump(cc.Conn, upstream); finish() }) {
		t.closeBoth() // the running pump ends and finishes
		finish()
	}
}

func (t *tunnel) closeBoth() {
	t.once.Do(func() {
		_ = t.a.Close()
		_ = t.b.Close()
	})
}

type closeWriter interface{ CloseWrite() error }

// pump copies src to dst. On EOF it passes the half-close on; on any other
// error it closes both ends so that the other direction stops too.
//
// When src is a raw socket, the direction reads it with non-blocking reads
// inside src's read-readiness wait: a read that returns data goes straight
// to dst, so while data keeps coming the direction moves it read after read
// without parking; the first read that would block gives the buffer back to
// its pool before parking, so an idle direction holds no buffer. While a
// backlog lasts between two TCP sockets, the direction splices instead
// (splice_linux.go). A src without a raw socket (a wrapper) is read through a
// pooled buffer under a read deadline.
func (t *tunnel) pump(dst, src net.Conn) int64 {
	var rc syscall.RawConn
	if sc, ok := src.(syscall.Conn); ok {
		rc, _ = sc.SyscallConn()
	}
	if rc == nil {
		return t.pumpBuffered(dst, src)
	}
	var (
		n            int64
		bp           *[]byte
		r            int
		rerr         error
		lastDeadline time.Time
	)
	defer func() {
		if bp != nil {
			t.putBuf(bp)
		}
	}()
	armRead := func() {
		if now := time.Now(); now.Sub(lastDeadline) > time.Second {
			_ = src.SetReadDeadline(now.Add(t.idle))
			lastDeadline = now
		}
	}
	spliceFrom, spliceTo := socketOf(src), socketOf(dst)
	var out io.Writer = dst
	if spliceTo != nil {
		out = &rawIO{rc: spliceTo, laddr: dst.LocalAddr(), raddr: dst.RemoteAddr()}
	}
	fill := func(fd uintptr) bool {
		if bp == nil {
			bp = relayBufs.Get().(*[]byte)
		}
		n, errno := rawRead(fd, *bp)
		if errno == syscall.EAGAIN {
			t.putBuf(bp)
			bp = nil
			return false
		}
		r = n
		if errno != 0 {
			r, rerr = -1, errno
		}
		return true
	}
	for {
		armRead()
		r, rerr = 0, nil
		err := rc.Read(fill)
		if err == nil && rerr != nil {
			err = rerr
		}
		if err == nil && r <= 0 {
			err = io.EOF
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				t.halfClose(dst)
				return n
			}
			if t.stillActive(src, err) {
				lastDeadline = time.Time{}
				continue
			}
			t.closeBoth()
			return n
		}
		w, err := out.Write((*bp)[:r])
		n += int64(w)
		if err != nil {
			t.closeBoth()
			return n
		}
		t.touch()
		switch {
		case r < len(*bp):
		case r < relayLargeBufSize:
			bp = t.grow(bp)
		case spliceFrom != nil && spliceTo != nil:
			// More than a large buffer was waiting: a backlog.
			p := t.pipes.get()
			if p == nil {
				spliceFrom = nil // no pipes to be had: copy from now on
				break
			}
			relayLargeBufs.Put(bp) // the direction's large-buffer ration passes to the pipe
			bp = nil
			moved, res := t.splice(spliceTo, spliceFrom, p, armRead)
			n += moved
			t.pipes.put(p)
			t.large.Add(-1)
			switch res {
			case spliceEOF:
				t.halfClose(dst)
				return n
			case spliceFailed:
				t.closeBoth()
				return n
			}
		}
	}
}

// spliceResult says why a direction stopped splicing.
type spliceResult int

const (
	spliceCaughtUp spliceResult = iota // the backlog is gone: copy again
	spliceEOF                          // src sent its last byte
	spliceFailed                       // a read or write failed: close the tunnel
)

func (t *tunnel) touch() { t.lastSeen.Store(time.Now().UnixNano()) }

// halfClose passes an EOF on to dst. When the other direction is already
// over, the close that follows says it: one shutdown call fewer per tunnel.
func (t *tunnel) halfClose(dst net.Conn) {
	if t.remaining.Load() == 1 {
		return
	}
	if cw, ok := dst.(closeWriter); ok {
		_ = cw.CloseWrite()
	} else {
		t.closeBoth()
	}
}

// pumpBuffered is pump for a src without a raw socket: it reads through a
// pooled buffer under a read deadline.
func (t *tunnel) pumpBuffered(dst, src net.Conn) int64 {
	var n int64
	bp := relayBufs.Get().(*[]byte)
	defer relayBufs.Put(bp)
	buf := *bp
	for {
		_ = src.SetReadDeadline(time.Now().Add(t.idle))
		r, err := src.Read(buf)
		if r > 0 {
			t.touch()
			w, werr := dst.Write(buf[:r])
			n += int64(w)
			if werr != nil {
				t.closeBoth()
				return n
			}
		}
		if err == nil {
			continue
		}
		if errors.Is(err, io.EOF) {
			t.halfClose(dst)
			return n
		}
		if t.stillActive(src, err) {
			continue
		}
		t.closeBoth()
		return n
	}
}

// stillActive reports, after a read deadline fired on src, whether the other
// direction moved data recently; then the deadline is pushed out.
func (t *tunnel) stillActive(src net.Conn, err error) bool {
	if !isTimeout(err) {
		return false
	}
	last := time.Unix(0, t.lastSeen.Load())
	if time.Since(last) >= t.idle {
		return false
	}
	_ = src.SetReadDeadline(last.Add(t.idle))
	return true
}
