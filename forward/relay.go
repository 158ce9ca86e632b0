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
	client, up := rawOf(cc), rawOf(upstream)
	if !l.spawn(func() { t.up = t.pump(upstream, cc.Conn, up, client); finish() }) {
		t.closeBoth()
		done()
		return
	}
	if !l.spawn(func() { t.down = t.pump(cc.Conn, upstream, client, up); finish() }) {
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
// When src has a socket of its own (srcIO), the direction reads it with non-blocking reads
// inside src's read-readiness wait: a read that returns data goes straight
// to dst, so while data keeps coming the direction moves it read after read
// without parking; the first read that would block gives the buffer back to
// its pool before parking, so an idle direction holds no buffer. While a
// backlog lasts between two sockets, the direction splices instead
// (splice_linux.go). Writes go through dstIO when dst has one. A src without
// a socket of its own (a wrapper) is read through a pooled buffer under a
// read deadline.
func (t *tunnel) pump(dst, src net.Conn, dstIO, srcIO *rawIO) int64 {
	if srcIO == nil {
		return t.pumpBuffered(dst, src)
	}
	d := newDirection(t, dst, src, dstIO, srcIO)
	defer d.putBuf()
	for {
		d.deadline.arm()
		d.r, d.rerr = 0, nil
		err := srcIO.rc.Read(d.fill)
		if err == nil && d.rerr != nil {
			err = d.rerr
		}
		if err == nil && d.r <= 0 {
			err = io.EOF
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				t.halfClose(dst)
				return d.n
			}
			if t.stillActive(src, err) {
				d.deadline.last = time.Time{}
				continue
			}
			t.closeBoth()
			return d.n
		}
		if !d.forward() {
			return d.n
		}
	}
}

// direction is the state of one pump, kept on the heap: an idle tunnel's
// two goroutines park inside pump, and with pump's frame small the
// runtime shrinks their stacks back to the minimum (2 KiB), which is most
// of what an idle tunnel costs.
type direction struct {
	t                    *tunnel
	dst                  net.Conn
	out                  io.Writer
	spliceFrom, spliceTo syscall.RawConn
	deadline             readDeadline
	fill                 func(fd uintptr) bool // the read, inside src's readiness wait
	bp                   *[]byte
	r                    int // bytes read, -1 on error
	rerr                 error
	n                    int64 // bytes moved
}

//go:noinline
func newDirection(t *tunnel, dst, src net.Conn, dstIO, srcIO *rawIO) *direction {
	d := &direction{t: t, dst: dst, out: dst, deadline: readDeadline{conn: src, idle: t.idle}}
	if dstIO != nil {
		d.out = dstIO
		d.spliceFrom, d.spliceTo = srcIO.rc, dstIO.rc
	}
	d.fill = d.read
	return d
}

func (d *direction) read(fd uintptr) bool {
	if d.bp == nil {
		d.bp = relayBufs.Get().(*[]byte)
	}
	n, errno := rawRead(fd, *d.bp)
	if errno == syscall.EAGAIN {
		d.putBuf()
		return false
	}
	d.r = n
	if errno != 0 {
		d.r, d.rerr = -1, errno
	}
	return true
}

func (d *direction) putBuf() {
	if d.bp != nil {
		d.t.putBuf(d.bp)
		d.bp = nil
	}
}

// forward writes what was read to dst, then moves to a large buffer or
// splices when the read showed a backlog. It reports whether the direction
// goes on.
//
//go:noinline
func (d *direction) forward() bool {
	t := d.t
	w, err := d.out.Write((*d.bp)[:d.r])
	d.n += int64(w)
	if err != nil {
		t.closeBoth()
		return false
	}
	t.touch()
	switch {
	case d.r < len(*d.bp):
	case d.r < relayLargeBufSize:
		d.bp = t.grow(d.bp)
	case d.spliceFrom != nil && d.spliceTo != nil:
		// More than a large buffer was waiting: a backlog.
		moved, res := t.spliceBacklog(d.spliceTo, d.spliceFrom, d.bp, &d.deadline)
		d.n += moved
		if res == spliceNoPipe {
			d.spliceFrom = nil // no pipes to be had: copy from now on
			return true
		}
		d.bp = nil // the large buffer went back with the ration
		switch res {
		case spliceEOF:
			t.halfClose(d.dst)
			return false
		case spliceFailed:
			t.closeBoth()
			return false
		}
	}
	return true
}

// spliceBacklog splices a direction's backlog through a pipe from the
// listener's cache; the direction's large buffer goes back to its pool and
// its ration passes to the pipe until the backlog is gone. It is kept out of
// pump so that pump's frame stays small: an idle tunnel's two goroutines
// park inside pump, and their stacks are most of what it costs.
//
//go:noinline
func (t *tunnel) spliceBacklog(dst, src syscall.RawConn, large *[]byte, deadline *readDeadline) (int64, spliceResult) {
	p := t.pipes.get()
	if p == nil {
		return 0, spliceNoPipe
	}
	relayLargeBufs.Put(large)
	moved, res := t.splice(dst, src, p, deadline)
	t.pipes.put(p)
	t.large.Add(-1)
	return moved, res
}

// readDeadline keeps a direction's read deadline IdleTimeout ahead, moving
// it at most once a second.
type readDeadline struct {
	conn net.Conn
	idle time.Duration
	last time.Time // when it was last moved
}

//go:noinline
func (d *readDeadline) arm() {
	if now := time.Now(); now.Sub(d.last) > time.Second {
		_ = d.conn.SetReadDeadline(now.Add(d.idle))
		d.last = now
	}
}

// spliceResult says why a direction stopped splicing.
type spliceResult int

const (
	spliceCaughtUp spliceResult = iota // the backlog is gone: copy again
	spliceEOF                          // src sent its last byte
	spliceFailed                       // a read or write failed: close the tunnel
	spliceNoPipe                       // no pipe could be had: nothing moved
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
