package socks5

import (
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// testDeadline bounds every network step of a test.
const testDeadline = 10 * time.Second

// loopbackPair returns both ends of a real TCP connection over 127.0.0.1,
// with deadlines set; both are closed at cleanup.
func loopbackPair(t testing.TB) (client, server net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	type res struct {
		c   net.Conn
		err error
	}
	ch := make(chan res, 1)
	go func() {
		c, err := ln.Accept()
		ch <- res{c, err}
	}()
	client, err = net.DialTimeout("tcp", ln.Addr().String(), testDeadline)
	r := <-ch // Accept returns once the dial completed or the listener closes (deferred)
	if err != nil {
		t.Fatal(err)
	}
	if r.err != nil {
		client.Close()
		t.Fatal(r.err)
	}
	server = r.c
	dl := time.Now().Add(testDeadline)
	client.SetDeadline(dl)
	server.SetDeadline(dl)
	t.Cleanup(func() {
		client.Close()
		server.Close()
	})
	return client, server
}

// goOwned runs f in a goroutine that is waited for at cleanup (after the
// cleanups registered later, which close the connections f may block on).
func goOwned(t testing.TB, f func()) {
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait)
	wg.Add(1)
	go func() {
		defer wg.Done()
		f()
	}()
}

// readAllUntilEOF reads c until EOF or error and returns what came.
func readAllUntilEOF(c net.Conn) []byte {
	b, _ := io.ReadAll(c)
	return b
}

func timeNowPlus(ms int) time.Time { return time.Now().Add(time.Duration(ms) * time.Millisecond) }
