package forward

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// relayBufSize is the copy buffer taken from the pool while a direction
// moves data; an idle direction holds none.
const relayBufSize = 64 << 10

var relayBufs = sync.Pool{New: func() any { b := make([]byte, relayBufSize); return &b }}

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
// adds the bytes to cc and calls done.
func (l *Listener) relay(cc *clientConn, upstream net.Conn, done func()) {
	t := &tunnel{idle: l.cfg.IdleTimeout, a: cc.Conn, b: upstream}
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
// While nothing is queued on src it parks on src's read readiness, holding
// neither a buffer nor a splice pipe. When bytes are queued and both ends
// are TCP, it splices exactly what is queued (the kernel moves it, no copy
// through user space, and the call cannot block on an empty source);
// otherwise it copies through a pooled buffer until src runs dry.
func (t *tunnel) pump(dst, src net.Conn) int64 {
	var rc syscall.RawConn
	if sc, ok := src.(syscall.Conn); ok {
		rc, _ = sc.SyscallConn()
	}
	dtcp, _ := dst.(*net.TCPConn)
	_, stcp := src.(*net.TCPConn)
	canSplice := rc != nil && dtcp != nil && stcp
	var (
		n            int64
		peek         [1]byte
		avail        int
		lr           = &io.LimitedReader{R: src}
		lastDeadline time.Time
	)
	ready := func(fd uintptr) bool {
		if canSplice {
			if v, err := unix.IoctlGetInt(int(fd), unix.SIOCINQ); err == nil && v > 0 {
				avail = v
				return true
			}
		}
		_, _, err := syscall.Recvfrom(int(fd), peek[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		return !errors.Is(err, syscall.EAGAIN)
	}
	for {
		avail = 0
		if rc != nil {
			now := time.Now()
			if now.Sub(lastDeadline) > time.Second {
				_ = src.SetReadDeadline(now.Add(t.idle))
				lastDeadline = now
			}
			if err := rc.Read(ready); err != nil {
				if t.stillActive(src, err) {
					lastDeadline = time.Time{}
					continue
				}
				t.closeBoth()
				return n
			}
		}
		var err error
		if avail > 0 {
			lr.N = int64(avail)
			var w int64
			w, err = dtcp.ReadFrom(lr)
			n += w
			if w > 0 {
				t.lastSeen.Store(time.Now().UnixNano())
			}
		} else {
			err = t.copyBuffered(dst, src, rc == nil, &n)
		}
		if err == nil {
			continue
		}
		if errors.Is(err, io.EOF) {
			if cw, ok := dst.(closeWriter); ok {
				_ = cw.CloseWrite()
			} else {
				t.closeBoth()
			}
			return n
		}
		if t.stillActive(src, err) {
			lastDeadline = time.Time{}
			continue
		}
		t.closeBoth()
		return n
	}
}

// copyBuffered copies through a pooled buffer while reads fill it (or once
// when src cannot be parked on), returning src's error or dst's.
func (t *tunnel) copyBuffered(dst, src net.Conn, noPark bool, n *int64) error {
	bp := relayBufs.Get().(*[]byte)
	defer relayBufs.Put(bp)
	buf := *bp
	for {
		if noPark {
			_ = src.SetReadDeadline(time.Now().Add(t.idle))
		}
		r, err := src.Read(buf)
		if r > 0 {
			t.lastSeen.Store(time.Now().UnixNano())
			w, werr := dst.Write(buf[:r])
			*n += int64(w)
			if werr != nil {
				return werr
			}
		}
		if err != nil || r < len(buf) || noPark {
			return err
		}
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
