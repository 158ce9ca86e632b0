package main

import (
	"errors"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"
)

// acceptor owns a bound socket and lets whichever handoff listener is
// current accept on it. A reload that changes a listener's settings but not
// its address attaches a new handoff listener; the socket stays open, so no
// connection waiting in its backlog is reset, and no second socket (and no
// SO_REUSEPORT) is needed.
//
// The current listener's Serve loop calls accept(2) itself: no goroutine in
// between hands connections over, which would cost a goroutine wake-up per
// connection (in the rig, BENCHMARKS.md, tunnel setups went from 0.58 to
// 0.63 of direct over HTTP and from 0.51 to 0.59 over SOCKS5 without that
// goroutine). A handoff listener that is replaced while it waits in
// accept is woken by a read deadline in the past, which attach takes back
// once it has left.
type acceptor struct {
	ln  net.Listener
	log *slog.Logger
	// dl sets ln's accept deadline (nil: ln has none, and a replaced
	// listener waiting in accept leaves at the next connection).
	dl interface{ SetDeadline(time.Time) error }

	mu      sync.Mutex
	cur     *handoffListener
	closing bool
	// kicked is non-nil while attach wakes the listener it replaced: the
	// accept deadline is in the past until it is closed.
	kicked chan struct{}
}

func newAcceptor(ln net.Listener, log *slog.Logger) *acceptor {
	a := &acceptor{ln: ln, log: log}
	a.dl, _ = ln.(interface{ SetDeadline(time.Time) error })
	return a
}

// kickWait bounds how long attach waits for the replaced listener to leave
// accept: it is woken at once, so only a starved process waits at all.
const kickWait = time.Second

// attach makes a fresh handoff listener current and returns it; the one it
// replaces stops accepting (its Serve returns) but keeps its connections.
func (a *acceptor) attach() *handoffListener {
	h := &handoffListener{a: a, addr: a.ln.Addr()}
	a.mu.Lock()
	old := a.cur
	a.cur = h
	a.mu.Unlock()
	if old != nil {
		a.wake(old)
	}
	return h
}

// wake gets h out of the socket's accept, where it would wait for the next
// connection although it is no longer current or closed: a deadline in the
// past wakes it, and is taken back once it has left.
func (a *acceptor) wake(h *handoffListener) {
	a.mu.Lock()
	for a.kicked != nil { // one wake-up at a time
		k := a.kicked
		a.mu.Unlock()
		<-k
		a.mu.Lock()
	}
	if !h.inAccept || a.dl == nil {
		a.mu.Unlock()
		return
	}
	left := make(chan struct{})
	h.left = left
	a.kicked = make(chan struct{})
	_ = a.dl.SetDeadline(time.Unix(1, 0))
	a.mu.Unlock()
	t := time.NewTimer(kickWait)
	select {
	case <-left:
	case <-t.C:
		a.log.Warn("listener did not leave accept in time", "address", h.addr.String(), "waited", kickWait)
	}
	t.Stop()
	a.mu.Lock()
	_ = a.dl.SetDeadline(time.Time{})
	close(a.kicked)
	a.kicked = nil
	a.mu.Unlock()
}

// close stops accepting on the socket.
func (a *acceptor) close() {
	a.mu.Lock()
	a.closing = true
	a.mu.Unlock()
	a.ln.Close()
}

// handoffListener is the net.Listener a forward.Listener serves on: it
// accepts on the acceptor's socket while it is current and not closed.
type handoffListener struct {
	a    *acceptor
	addr net.Addr
	// Guarded by a.mu.
	closed   bool
	inAccept bool          // in the socket's accept
	left     chan struct{} // closed when it leaves accept after a kick
}

// Accept waits for the socket's next connection. Errors the forward
// listener waits out itself (out of file descriptors) come back as they are.
func (h *handoffListener) Accept() (net.Conn, error) {
	a := h.a
	for {
		a.mu.Lock()
		if a.cur != h || h.closed {
			a.mu.Unlock()
			return nil, net.ErrClosed
		}
		if k := a.kicked; k != nil { // the deadline is in the past for now
			a.mu.Unlock()
			<-k
			continue
		}
		h.inAccept = true
		a.mu.Unlock()

		c, err := a.ln.Accept()

		a.mu.Lock()
		h.inAccept = false
		if h.left != nil {
			close(h.left)
			h.left = nil
		}
		closing := a.closing
		a.mu.Unlock()
		switch {
		case err == nil:
			// Accepted just as it was replaced: it still serves this one,
			// and drains it like the rest of its connections.
			return c, nil
		case errors.Is(err, os.ErrDeadlineExceeded):
			continue // woken by attach: ask again whether it is current
		case closing || errors.Is(err, net.ErrClosed) && !h.current():
			return nil, net.ErrClosed
		case errors.Is(err, net.ErrClosed):
			a.log.Error("listener stopped accepting", "address", h.addr.String(), "err", err)
		}
		return nil, err
	}
}

func (h *handoffListener) current() bool {
	h.a.mu.Lock()
	defer h.a.mu.Unlock()
	return h.a.cur == h && !h.closed
}

// Close makes Accept return net.ErrClosed, also to a call waiting in the
// socket's accept.
func (h *handoffListener) Close() error {
	h.a.mu.Lock()
	h.closed = true
	h.a.mu.Unlock()
	h.a.wake(h)
	return nil
}

func (h *handoffListener) Addr() net.Addr { return h.addr }
