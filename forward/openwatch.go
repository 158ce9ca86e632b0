package forward

import (
	"context"
	"sync"
	"syscall"
	"time"
)

// openWatch ends a tunnel's attempts when its client hangs up while they
// run. A CONNECT, SOCKS5 or WebSocket upgrade client sends nothing while it
// waits for its answer, which may take retry_timeout and a handshake (and
// for an upgrade the origin's 101 after them); one that gives up
// meanwhile should not leave proxyd dialing and handshaking for nobody (an
// upstream connection opened for no one still costs the upstream, and a
// rotating service may bill it). As with a plain request (clientWatch),
// nothing is watched for the first watchAfter, which most set-ups take
// less than; then a goroutine waits until the client's socket is readable,
// without reading from it. An end of stream or a reset ends the attempts,
// which are then nobody's failure, and the connection is the client's
// (client_error). Bytes end the watch and stay queued for the relay: a
// client that starts its TLS handshake before the answer is still there.
type openWatch struct {
	ctx    context.Context // what the attempts run under
	cancel context.CancelCauseFunc
	l      *Listener
	cc     *clientConn
	rc     syscall.RawConn // the client's socket
	timer  *time.Timer

	mu   sync.Mutex
	over bool          // stop was called
	done chan struct{} // closed when a started watch's wait ended
}

// watchOpening starts the watch of a client whose tunnel is being opened;
// its ctx ends with the listener's or when the client hangs up. early
// says that the client already sent bytes for the tunnel (they wait in a
// reader): it is there, and an end of stream after them is a half-close,
// so nothing is watched. The client's read deadline must be clear, as it
// is after its request is read, and nothing else may read from it until
// stop, which the caller must call before it answers the client.
func (l *Listener) watchOpening(cc *clientConn, early bool) *openWatch {
	w := &openWatch{l: l, cc: cc}
	w.ctx, w.cancel = context.WithCancelCause(l.ctx)
	if sc, ok := cc.Conn.(syscall.Conn); ok && canAwaitPeer && !early {
		if rc, err := sc.SyscallConn(); err == nil {
			w.rc = rc
			w.timer = time.AfterFunc(watchAfter, w.start)
		}
	}
	return w
}

func (w *openWatch) start() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.over {
		return
	}
	done := make(chan struct{})
	if w.l.spawn(func() {
		defer close(done)
		if peerGone(w.rc) {
			w.cancel(errClientLeft)
		}
	}) {
		w.done = done
	}
}

// left reports whether the client hung up while the attempts ran; a tunnel
// opened all the same is abandoned (it was opened for nobody).
func (w *openWatch) left() bool { return context.Cause(w.ctx) == errClientLeft }

// stop ends the watch once the attempts are over: a watch still waiting is
// woken by a read deadline in the past, which is cleared after it.
func (w *openWatch) stop() {
	if w.timer != nil {
		w.timer.Stop()
	}
	w.mu.Lock()
	w.over = true
	done := w.done
	w.mu.Unlock()
	if done != nil {
		_ = w.cc.SetReadDeadline(time.Unix(1, 0))
		<-done
		_ = w.cc.SetReadDeadline(time.Time{})
	}
	w.cancel(nil)
}
