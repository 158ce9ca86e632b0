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
// write deadline) IdleTimeout ahead, moving it at most once a second (or
// every half IdleTimeout, when that is shorter): each move is a timer
// update, and bulk transfers come back here many times a second. The
// deadline is never less than half IdleTimeout ahead when a read or write
// starts.
type idleDeadline struct {
	conn  net.Conn
	idle  time.Duration
	write bool
	last  time.Time // when it was last moved
}

func (d *idleDeadline) arm() {
	if now := time.Now(); now.Sub(d.last) > min(time.Second, d.idle/2) {
		if d.write {
			_ = d.conn.SetWriteDeadline(now.Add(d.idle))
		} else {
			_ = d.conn.SetReadDeadline(now.Add(d.idle))
		}
		d.last = now
	}
}

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
			t.halfClose(dst)
			return n
		}
		if t.stillActive(src, err) {
			deadline.last = time.Time{}
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
