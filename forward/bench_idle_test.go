package forward

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/proxyd/proxyd/forward/socks5"
	"github.com/proxyd/proxyd/pool"
)

// The idle-tunnel benchmark holds thousands of tunnels. The open-file limit
// is per process, so the clients and the upstream run in a child process
// (this test binary re-executed as TestIdleTunnelHelper) and proxyd alone in
// this one: its RSS growth after a GC, divided by the tunnels, is the cost of
// an idle tunnel.

const idleHelperEnv = "FORWARD_IDLE_HELPER"

func rssBytes(t testing.TB) int64 {
	b, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b))
	pages, _ := strconv.ParseInt(f[1], 10, 64)
	return pages * int64(os.Getpagesize())
}

func BenchmarkIdleTunnels(b *testing.B) {
	n := 9000
	if s := os.Getenv("FORWARD_IDLE_TUNNELS"); s != "" {
		n, _ = strconv.Atoi(s)
	}
	for _, protocol := range []pool.Protocol{pool.HTTP, pool.SOCKS5} {
		b.Run(fmt.Sprintf("%s/tunnels=%d", protocol, n), func(b *testing.B) {
			for range b.N {
				benchIdle(b, protocol, n)
			}
		})
	}
}

func benchIdle(b *testing.B, protocol pool.Protocol, n int) {
	cmd := exec.Command(os.Args[0], "-test.run=^TestIdleTunnelHelper$", "-test.v")
	cmd.Env = append(os.Environ(), idleHelperEnv+"=1", "FORWARD_IDLE_N="+strconv.Itoa(n), "FORWARD_IDLE_PROTOCOL="+string(protocol))
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	defer func() { _ = stdin.Close(); _ = cmd.Wait() }()
	lines := bufio.NewScanner(stdout)
	next := func(prefix string) string {
		for lines.Scan() {
			if v, ok := strings.CutPrefix(lines.Text(), prefix); ok {
				return v
			}
		}
		b.Fatalf("helper ended before %q", prefix)
		return ""
	}
	upAddr := next("UPSTREAM ")
	up := &pool.Upstream{Service: 1, Protocol: protocol, Address: upAddr}
	cfg := testConfig(func(c *Config) { c.Protocol = string(protocol); c.MaxConnections = n + 100 })
	addr := benchListener(b, cfg, newFakePool(up))

	debug.FreeOSMemory()
	rss0, fd0, g0 := rssBytes(b), countFDs(b), runtime.NumGoroutine()
	var ms0 runtime.MemStats
	runtime.ReadMemStats(&ms0)
	start := time.Now()
	fmt.Fprintf(stdin, "%s\n", addr)
	next("READY")
	setup := time.Since(start)
	debug.FreeOSMemory()
	rss1, fd1, g1 := rssBytes(b), countFDs(b), runtime.NumGoroutine()
	var ms1 runtime.MemStats
	runtime.ReadMemStats(&ms1)
	b.ReportMetric(float64(rss1-rss0)/float64(n)/1024, "KB-RSS/tunnel")
	b.ReportMetric(float64((ms1.HeapInuse+ms1.StackInuse)-(ms0.HeapInuse+ms0.StackInuse))/float64(n)/1024, "KB-heap+stack/tunnel")
	b.ReportMetric(float64(ms1.StackInuse-ms0.StackInuse)/float64(n)/1024, "KB-stack/tunnel")
	b.ReportMetric(float64(fd1-fd0)/float64(n), "fds/tunnel")
	b.ReportMetric(float64(g1-g0)/float64(n), "goroutines/tunnel")
	b.ReportMetric(float64(n)/setup.Seconds(), "setups/s")
}

// TestIdleTunnelHelper is the child side of BenchmarkIdleTunnels: an
// upstream that answers CONNECT or SOCKS5 and then holds the connection,
// and N clients holding tunnels through proxyd.
func TestIdleTunnelHelper(t *testing.T) {
	if os.Getenv(idleHelperEnv) != "1" {
		t.Skip("child process of BenchmarkIdleTunnels")
	}
	n, _ := strconv.Atoi(os.Getenv("FORWARD_IDLE_N"))
	protocol := pool.Protocol(os.Getenv("FORWARD_IDLE_PROTOCOL"))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var held []net.Conn
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				if protocol == pool.SOCKS5 {
					if _, err := socks5.ReadRequest(c, socks5.ServerConfig{}); err != nil {
						_ = c.Close()
						return
					}
					_ = socks5.WriteReply(c, socks5.ReplySucceeded, socks5.Addr{Host: "192.0.2.1", Port: 80})
				} else {
					br := bufio.NewReader(c)
					if _, err := http.ReadRequest(br); err != nil {
						_ = c.Close()
						return
					}
					_, _ = io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n")
				}
				// Echo one byte, then hold the connection idle.
				var one [1]byte
				if _, err := io.ReadFull(c, one[:]); err == nil {
					_, _ = c.Write(one[:])
				}
				mu.Lock()
				held = append(held, c)
				mu.Unlock()
			}()
		}
	}()
	fmt.Printf("UPSTREAM %s\n", ln.Addr())
	in := bufio.NewScanner(os.Stdin)
	if !in.Scan() {
		t.Fatal("no proxy address")
	}
	proxyAddr := in.Text()
	var wg sync.WaitGroup
	conns := make([]net.Conn, n)
	sem := make(chan struct{}, 64)
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			c, r, err := tunnelVia(protocol, proxyAddr, "192.0.2.1:80")
			if err != nil {
				errs <- err
				return
			}
			if _, err := c.Write([]byte{1}); err != nil {
				errs <- err
				return
			}
			var one [1]byte
			if _, err := io.ReadFull(r, one[:]); err != nil {
				errs <- err
				return
			}
			conns[i] = c
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	fmt.Println("READY")
	// Hold until the parent closes stdin.
	_, _ = io.Copy(io.Discard, os.Stdin)
	for _, c := range conns {
		_ = c.Close()
	}
	_ = ln.Close()
	mu.Lock()
	for _, c := range held {
		_ = c.Close()
	}
	mu.Unlock()
}
