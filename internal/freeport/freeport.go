// Package freeport finds free TCP ports on 127.0.0.1 for tests of programs
// that take a port number rather than a listener: `proxyd demo` and
// `proxyd run` on addresses from the command line or a config file, Squid,
// Dante.
//
// The usual way, listening on port 0 and closing, hands out a port from the
// kernel's ephemeral range. Every other test process running at the same
// time (go test runs packages in parallel) draws its listeners and the
// source ports of its outgoing connections from that same range, so between
// the close and the program's bind another process can take the port; CI
// saw exactly that as "bind: address already in use". Ports here come from
// below the ephemeral range, where only explicit binds land, and a process
// never hands out the same port twice.
package freeport

import (
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// lowest is the bottom of the range picked from; below it live the
// well-known and registered ports that installed services bind.
const lowest = 20000

var (
	mu     sync.Mutex
	issued = map[int]bool{}
)

// Port returns a TCP port on 127.0.0.1 that was free a moment ago and lies
// outside the ephemeral range, or fails the test.
func Port(t testing.TB) int {
	t.Helper()
	mu.Lock()
	defer mu.Unlock()
	if top, ok := below(); ok {
		for range 200 {
			p := lowest + rand.IntN(top-lowest)
			if issued[p] {
				continue
			}
			ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
			if err != nil {
				continue
			}
			ln.Close()
			issued[p] = true
			return p
		}
		// Falling back to the kernel's pick would bring the race back unseen.
		t.Fatalf("freeport: no free port in 200 tries below the ephemeral range [%d, %d)", lowest, top)
	}
	// No range to stay out of (not Linux, or an unusual range): the kernel's pick.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	p := ln.Addr().(*net.TCPAddr).Port
	issued[p] = true
	return p
}

// Addr is Port as "127.0.0.1:port".
func Addr(t testing.TB) string {
	t.Helper()
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(Port(t)))
}

// below returns the first port of the ephemeral range, and whether the
// ports from lowest up to it are enough to pick from.
func below() (top int, ok bool) {
	top = ephemeralStart()
	return top, top > lowest+1000
}

// ephemeralStart is the first port of Linux's ephemeral range, or 0 when
// it cannot be read.
func ephemeralStart() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return 0
	}
	n, err := strconv.Atoi(f[0])
	if err != nil {
		return 0
	}
	return n
}
