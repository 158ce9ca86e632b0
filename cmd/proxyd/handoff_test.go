package main

import (
	"errors"
	"log/slog"
	"net"
	"testing"
	"time"
)

// acceptResult is what one Accept call returned.
type acceptResult struct {
	c   net.Conn
	err error
}

// acceptAsync calls h.Accept in a goroutine, once it is the only thing
// left to do, and delivers the result.
func acceptAsync(h *handoffListener) <-chan acceptResult {
	ch := make(chan acceptResult, 1)
	go func() {
		c, err := h.Accept()
		ch <- acceptResult{c, err}
	}()
	return ch
}

// waitInAccept waits until h is in the socket's accept.
func waitInAccept(t *testing.T, h *handoffListener) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		h.a.mu.Lock()
		in := h.inAccept
		h.a.mu.Unlock()
		if in {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("listener never reached accept")
		}
		time.Sleep(time.Millisecond)
	}
}

// testAcceptor is an acceptor on a fresh loopback socket, closed at the
// test's end (closing it twice is harmless).
func testAcceptor(t *testing.T) (*acceptor, net.Listener) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	a := newAcceptor(ln, slog.New(slog.DiscardHandler))
	t.Cleanup(a.close)
	return a, ln
}

func dialOK(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func recv(t *testing.T, ch <-chan acceptResult, what string) acceptResult {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(5 * time.Second):
		t.Fatalf("%s: Accept did not return", what)
	}
	return acceptResult{}
}

// A listener replaced while it waits in accept leaves at once with
// net.ErrClosed, without taking a connection; the new one accepts the next
// connection, and the socket's accept deadline is back to none.
func TestHandoffAttachWakesReplacedAccept(t *testing.T) {
	a, ln := testAcceptor(t)
	old := a.attach()
	oldCh := acceptAsync(old)
	waitInAccept(t, old)

	start := time.Now()
	cur := a.attach()
	if r := recv(t, oldCh, "replaced listener"); !errors.Is(r.err, net.ErrClosed) || r.c != nil {
		t.Fatalf("replaced listener's Accept = %v, %v; want net.ErrClosed", r.c, r.err)
	}
	if took := time.Since(start); took > kickWait/2 {
		t.Errorf("attach took %v to wake the replaced listener", took)
	}
	if _, err := old.Accept(); !errors.Is(err, net.ErrClosed) {
		t.Errorf("replaced listener accepts again: %v", err)
	}

	// A deadline left in the past would keep this accept from ever
	// taking the connection.
	curCh := acceptAsync(cur)
	waitInAccept(t, cur)
	dialOK(t, ln.Addr().String())
	r := recv(t, curCh, "current listener")
	if r.err != nil {
		t.Fatalf("current listener: %v", r.err)
	}
	r.c.Close()
}

// Closing a handoff listener that waits in accept ends its Accept at once;
// closing the acceptor ends the current one's.
func TestHandoffCloseWakesAccept(t *testing.T) {
	a, ln := testAcceptor(t)
	h := a.attach()
	ch := acceptAsync(h)
	waitInAccept(t, h)
	h.Close()
	if r := recv(t, ch, "closed listener"); !errors.Is(r.err, net.ErrClosed) {
		t.Fatalf("closed listener's Accept = %v; want net.ErrClosed", r.err)
	}

	h2 := a.attach()
	ch2 := acceptAsync(h2)
	waitInAccept(t, h2)
	dialOK(t, ln.Addr().String()) // the socket still accepts after the wake-up
	if r := recv(t, ch2, "next listener"); r.err != nil {
		t.Fatalf("next listener: %v", r.err)
	} else {
		r.c.Close()
	}
	ch2 = acceptAsync(h2)
	waitInAccept(t, h2)
	a.close()
	if r := recv(t, ch2, "listener of a closed acceptor"); !errors.Is(r.err, net.ErrClosed) {
		t.Fatalf("Accept after the acceptor closed = %v; want net.ErrClosed", r.err)
	}
}

// Connections queued in the backlog while listeners are swapped reach
// the current listener: none is reset or left unaccepted.
func TestHandoffSwapKeepsBacklog(t *testing.T) {
	a, ln := testAcceptor(t)
	accepted := make(chan net.Conn, 64)
	serve := func(h *handoffListener) chan struct{} {
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				c, err := h.Accept()
				if err != nil {
					return
				}
				accepted <- c
			}
		}()
		return done
	}
	var dones []chan struct{}
	const n = 40
	for i := range n {
		if i%10 == 0 {
			dones = append(dones, serve(a.attach()))
		}
		dialOK(t, ln.Addr().String())
	}
	for i := range n {
		select {
		case c := <-accepted:
			c.Close()
		case <-time.After(5 * time.Second):
			t.Fatalf("%d of %d connections accepted", i, n)
		}
	}
	for _, d := range dones[:len(dones)-1] {
		select {
		case <-d:
		case <-time.After(5 * time.Second):
			t.Fatal("a replaced listener's serve loop did not end")
		}
	}
}
