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
	up, down  int64        // bytes each way, written by their pump
	remaining atomic.Int32 // pumps still running
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
// BENCHMARKS.md, "Small savers"). Else the other direction, which writes to
// src, is the tunnel's last, and no read deadline of this one will end it
// if src's reader stalls: the write it may be in gets idle_timeout from
// now, and its pump bounds each later one itself (write).
func (t *tunnel) halfClose(dst, src net.Conn) {
	if t.remaining.Load() == 1 {
		return
	}
	if cw, ok := dst.(closeWriter); ok {
		_ = cw.CloseWrite()
		_ = src.SetWriteDeadline(time.Now().Add(t.idle))
	} else {
		t.closeBoth()
	}
}

// write writes p to dst. While the other direction runs, a reader that
// stalls is its business (its read deadline finds this one idle, see
// stillActive). Once it is over, each write has idle_timeout to make
// progress, and goes on for as long as it does.
func (t *tunnel) write(dst net.Conn, p []byte) (int, error) {
	if t.remaining.Load() != 1 {
		return dst.Write(p)
	}
	n := 0
	for {
		_ = dst.SetWriteDeadline(time.Now().Add(t.idle))
		m, err := dst.Write(p[n:])
		n += m
		if err == nil || m == 0 || !isTimeout(err) {
			return n, err
		}
	}
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
			w, werr := t.write(dst, buf[:r])
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
		if t.stillActive(err) {
			continue
		}
		t.closeBoth()
		return n
	}
}

// stillActive reports, after a read deadline fired on a direction's
// source, whether the other direction moved data within IdleTimeout; then
// the direction waits on, its deadline moved out again by the next arm.
func (t *tunnel) stillActive(err error) bool {
	if !isTimeout(err) {
		return false
	}
	return time.Since(time.Unix(0, t.lastSeen.Load())) < t.idle
}
