package main

import (
	"errors"
	"log/slog"
	"net"
	"sync"
	"time"
)

// acceptor owns a bound socket and hands its connections to whichever
// handoff listener is current. A reload that changes a listener's settings
// but not its address swaps the handoff listener; the socket stays open, so
// no connection waiting in its backlog is reset, and no second socket (and
// no SO_REUSEPORT) is needed.
type acceptor struct {
	ln      net.Listener
	log     *slog.Logger
	mu      sync.Mutex
	cur     *handoffListener
	closing bool
	done    chan struct{}
}

func newAcceptor(ln net.Listener, log *slog.Logger) *acceptor {
	a := &acceptor{ln: ln, log: log, done: make(chan struct{})}
	go a.run()
	return a
}

// attach makes a fresh handoff listener current and returns it; the one it
// replaces stops accepting (its Serve returns) but keeps its connections.
func (a *acceptor) attach() *handoffListener {
	h := &handoffListener{addr: a.ln.Addr(), conns: make(chan net.Conn), closed: make(chan struct{})}
	a.mu.Lock()
	old := a.cur
	a.cur = h
	a.mu.Unlock()
	if old != nil {
		old.Close()
	}
	return h
}

func (a *acceptor) current() *handoffListener {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.cur
}

// close stops accepting on the socket and waits for the accept loop.
func (a *acceptor) close() {
	a.mu.Lock()
	a.closing = true
	a.mu.Unlock()
	a.ln.Close()
	<-a.done
}

func (a *acceptor) run() {
	defer close(a.done)
	var backoff time.Duration
	for {
		c, err := a.ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() || isTemporary(err) {
				// Out of file descriptors and the like: wait, as net/http does.
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				time.Sleep(backoff)
				continue
			}
			a.mu.Lock()
			closing, h := a.closing, a.cur
			a.mu.Unlock()
			if !closing {
				a.log.Error("listener stopped accepting", "address", a.ln.Addr().String(), "err", err)
			}
			if h != nil {
				h.Close()
			}
			return
		}
		backoff = 0
		for {
			h := a.current()
			if h != nil && h.deliver(c) {
				break
			}
			// If h was replaced while we held c, give c to the new one;
			// if it was closed (or none is attached yet), nobody serves c.
			if a.current() == h {
				c.Close()
				break
			}
		}
	}
}

func isTemporary(err error) bool {
	t, ok := err.(interface{ Temporary() bool })
	return ok && t.Temporary()
}

// handoffListener is the net.Listener a forward.Listener serves on.
type handoffListener struct {
	addr   net.Addr
	conns  chan net.Conn
	once   sync.Once
	closed chan struct{}
}

func (h *handoffListener) deliver(c net.Conn) bool {
	select {
	case h.conns <- c:
		return true
	case <-h.closed:
		return false
	}
}

func (h *handoffListener) Accept() (net.Conn, error) {
	select {
	case c := <-h.conns:
		return c, nil
	case <-h.closed:
		return nil, net.ErrClosed
	}
}

func (h *handoffListener) Close() error {
	h.once.Do(func() { close(h.closed) })
	return nil
}

func (h *handoffListener) Addr() net.Addr { return h.addr }
