package forward

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// copyBufSize is the buffer of a direction that cannot splice (a TLS
// upstream, or a system without splice); it comes from a pool.
const copyBufSize = 32 << 10

var copyBufs = sync.Pool{New: func() any { b := make([]byte, copyBufSize); return &b }}

// tunnel relays bytes between a client and an upstream connection.
type tunnel struct {
	idle      time.Duration
	lastSeen  atomic.Int64 // unix nanoseconds of the last byte moved either way
	once      sync.Once
	a, b      net.Conn
	up, down  int64                      // bytes each way, written by their pump
	remaining atomic.Int32               // pumps still running
	watch     atomic.Pointer[time.Timer] // watchLast's, stopped by closeBoth
	closed    atomic.Bool                // closeBoth ran: watchLast's timer goes on no more
	ackedA    atomic.Uint64              // a's (b's) reader's acknowledged bytes at the last look (tookMore)
	ackedB    atomic.Uint64
}

// relay copies between the client and the upstream in two goroutines the
// listener owns, until both directions are done, an error occurs or the
// tunnel is idle for IdleTimeout. The last pump to end closes both conns,
// adds the bytes to cc and calls done. Bytes a wrapper of the upstream
// still holds must have been written to the client before.
func (l *Listener) relay(cc *clientConn, upstream net.Conn, done func()) {
	client := cc.Conn
	t := &tunnel{idle: l.cfg.IdleTimeout, a: client, b: upstream}
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
	if !l.spawn(func() { t.up = t.pump(upstream, client); finish() }) {
		t.closeBoth()
		done()
		return
	}
	if !l.spawn(func() { t.down = t.pump(client, upstream); finish() }) {
		t.closeBoth() // the running pump ends and finishes
		finish()
	}
}

func (t *tunnel) closeBoth() {
	t.once.Do(func() {
		t.closed.Store(true)
		if w := t.watch.Load(); w != nil {
			w.Stop()
		}
		_ = t.a.Close()
		_ = t.b.Close()
	})
}

type closeWriter interface{ CloseWrite() error }

// pump copies src to dst and returns the bytes moved. On EOF it passes the
// half-close on; on any other error it closes both ends so that the other
// direction stops too. Between two TCP sockets it uses the system's fast
// path where there is one (pumpTCP); anything else goes through a pooled
// buffer.
func (t *tunnel) pump(dst, src net.Conn) int64 {
	if s, ok := src.(*net.TCPConn); ok {
		return t.pumpTCP(dst, s)
	}
	return t.pumpBuffered(dst, src)
}

// idleDeadline keeps a connection's read deadline (or, with write, its
// write deadline) IdleTimeout ahead: arm moves it before every read or
// write. Each move is a timer update; moving it at most once a second
// instead showed no gain in the rig on any load, bulk transfers included
// (BENCHMARKS.md, "Small savers").
type idleDeadline struct {
	conn  net.Conn
	idle  time.Duration
	write bool
}

func (d *idleDeadline) arm() {
	if d.write {
		_ = d.conn.SetWriteDeadline(time.Now().Add(d.idle))
	} else {
		_ = d.conn.SetReadDeadline(time.Now().Add(d.idle))
	}
}

func (t *tunnel) touch() { t.lastSeen.Store(time.Now().UnixNano()) }

// halfClose passes an EOF read from src on to dst. When the other
// direction is already over, the close that follows says it: one shutdown
// call fewer per tunnel (about 5 % of a tunnel set-up's CPU in the rig;
// BENCHMARKS.md, "Small savers"). Else the other direction, which writes
// to src, is the tunnel's last, and watchLast bounds it.
func (t *tunnel) halfClose(dst, src net.Conn) {
	if t.remaining.Load() == 1 {
		return
	}
	if cw, ok := dst.(closeWriter); ok {
		_ = cw.CloseWrite()
		t.watchLast(src)
	} else {
		t.closeBoth()
	}
}

// watchLast ends the tunnel once its last direction, which writes to dst,
// has moved nothing for an idle_timeout (it ends within two). While both
// ran, the other's read deadline found a stalled reader (stillActive); now
// nothing would: the direction may wait in a write for good, and a splice
// takes no write deadline without losing the bytes in its pipe, nor one
// that a slow reader, still reading, should not meet. So it is watched
// instead: a byte it read (lastSeen), or a byte dst's reader took (acked,
// where the system says), is progress.
func (t *tunnel) watchLast(dst net.Conn) {
	seen := t.lastSeen.Load()
	t.tookMore(dst) // from now
	t.watch.Store(time.AfterFunc(t.idle, func() {
		if t.closed.Load() {
			return
		}
		s := t.lastSeen.Load()
		if s == seen && !t.tookMore(dst) {
			t.closeBoth()
			return
		}
		seen = s
		if w := t.watch.Load(); w != nil { // nil only if it fired before it was stored
			w.Reset(t.idle)
		}
	}))
}

// pumpBuffered is pump through a pooled buffer under a read deadline.
func (t *tunnel) pumpBuffered(dst, src net.Conn) int64 {
	var n int64
	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	buf := *bp
	deadline := idleDeadline{conn: src, idle: t.idle}
	for {
		deadline.arm()
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
			t.halfClose(dst, src)
			return n
		}
		if t.stillActive(err, src) {
			continue
		}
		t.closeBoth()
		return n
	}
}

// stillActive reports, after a read deadline fired on a direction's
// source src, whether the other direction, which writes to src, moved data
// within IdleTimeout: a byte it read, or one src's reader took since the
// last look (a long splice to a slow reader has not returned, yet moves);
// then the direction waits on, its deadline moved out again by the next
// arm.
func (t *tunnel) stillActive(err error, src net.Conn) bool {
	if !isTimeout(err) {
		return false
	}
	return time.Since(time.Unix(0, t.lastSeen.Load())) < t.idle || t.tookMore(src)
}

// tookMore reports whether c's reader acknowledged bytes since the last
// call for c (acked; never where the system does not say).
func (t *tunnel) tookMore(c net.Conn) bool {
	last := &t.ackedA
	if c == t.b {
		last = &t.ackedB
	}
	a := acked(c)
	return a != 0 && last.Swap(a) != a
}
