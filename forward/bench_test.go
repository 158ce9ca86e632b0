package forward

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/proxy"

	"github.com/proxyd/proxyd/forward/socks5"
	"github.com/proxyd/proxyd/pool"
)

// Benchmarks compare the same load straight to the same upstream (the
// baseline) with the load through proxyd, in the same run, and report the
// ratio proxied/direct as "ratio". Run with -benchtime=1x or 3x: each
// iteration runs a whole load both ways.

// benchListener serves cfg on loopback for a benchmark.
func benchListener(b *testing.B, cfg Config, p Pool) string {
	b.Helper()
	cfg.Address = "127.0.0.1:0"
	cfg.AllowDestinations = loopbackAllowed
	l, err := NewListener(cfg, p, nil, slog.New(slog.DiscardHandler))
	if err != nil {
		b.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = l.Serve(ln) }()
	b.Cleanup(func() { _ = l.Close(); <-done })
	return ln.Addr().String()
}

// sourceServe writes n bytes then closes: a download.
func sourceServe(n int) func(net.Conn) {
	buf := make([]byte, 256<<10)
	return func(c net.Conn) {
		for left := n; left > 0; {
			w, err := c.Write(buf[:min(left, len(buf))])
			if err != nil {
				return
			}
			left -= w
		}
	}
}

// tunnelVia opens a tunnel to dest through a CONNECT or SOCKS5 proxy.
func tunnelVia(protocol pool.Protocol, proxyAddr, dest string) (net.Conn, io.Reader, error) {
	if protocol == pool.SOCKS5 {
		d, _ := proxy.SOCKS5("tcp", proxyAddr, nil, proxy.Direct)
		c, err := d.Dial("tcp", dest)
		return c, c, err
	}
	c, err := net.Dial("tcp", proxyAddr)
	if err != nil {
		return nil, nil, err
	}
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", dest, dest)
	br := bufio.NewReaderSize(c, 64<<10)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil || resp.StatusCode != 200 {
		_ = c.Close()
		return nil, nil, fmt.Errorf("CONNECT: %v %v", resp, err)
	}
	return c, br, nil
}

func upstreamFor(b *testing.B, protocol pool.Protocol) *pool.Upstream {
	if protocol == pool.SOCKS5 {
		return newSOCKSUpstream(b, "", "", nil).upstream(1)
	}
	return newHTTPUpstream(b, "", "", nil).upstream(1)
}

// timeLoad runs load with c workers each doing ops operations and returns
// the wall time.
func timeLoad(b *testing.B, c, ops int, op func() error) time.Duration {
	b.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, c)
	start := time.Now()
	for range c {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range ops {
				if err := op(); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	d := time.Since(start)
	close(errs)
	for err := range errs {
		b.Fatal(err)
	}
	return d
}

func reportRatio(b *testing.B, direct, proxied time.Duration, unit string, amount float64) {
	b.ReportMetric(amount/direct.Seconds(), unit+"-direct")
	b.ReportMetric(amount/proxied.Seconds(), unit+"-proxyd")
	b.ReportMetric(direct.Seconds()/proxied.Seconds(), "ratio")
}

func BenchmarkTunnelThroughput(b *testing.B) {
	const perStream = 256 << 20
	for _, protocol := range []pool.Protocol{pool.HTTP, pool.SOCKS5} {
		for _, streams := range []int{1, 16} {
			b.Run(fmt.Sprintf("%s/streams=%d", protocol, streams), func(b *testing.B) {
				n := perStream / streams
				src := startTCP(b, "tcp", "127.0.0.1:0", sourceServe(n))
				up := upstreamFor(b, protocol)
				addr := benchListener(b, Config{Protocol: string(protocol)}, newFakePool(up))
				download := func(proxyAddr string) func() error {
					return func() error {
						c, r, err := tunnelVia(protocol, proxyAddr, src)
						if err != nil {
							return err
						}
						defer c.Close()
						got, err := io.Copy(io.Discard, struct{ io.Reader }{r})
						if err == nil && got != int64(n) {
							err = fmt.Errorf("got %d bytes, want %d", got, n)
						}
						return err
					}
				}
				var direct, proxied time.Duration
				for b.Loop() {
					direct += timeLoad(b, streams, 1, download(up.Address))
					proxied += timeLoad(b, streams, 1, download(addr))
				}
				reportRatio(b, direct, proxied, "MB/s", float64(b.N)*float64(perStream)/1e6)
			})
		}
	}
}

func BenchmarkPlainKeepAlive(b *testing.B) {
	for _, c := range []int{1, 32} {
		b.Run(fmt.Sprintf("c=%d", c), func(b *testing.B) {
			benchPlain(b, c, true)
		})
	}
}

func BenchmarkPlainNewConnection(b *testing.B) {
	b.Run("c=32", func(b *testing.B) { benchPlain(b, 32, false) })
}

func benchPlain(b *testing.B, c int, keepAlive bool) {
	body := make([]byte, 1024)
	origin, _ := startOrigin(b, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write(body)
	}))
	up := newHTTPUpstream(b, "", "", nil)
	addr := benchListener(b, Config{}, newFakePool(up.upstream(1)))
	client := func(proxyAddr string) *http.Client {
		tr := &http.Transport{
			Proxy:               http.ProxyURL(&url.URL{Scheme: "http", Host: proxyAddr}),
			DisableKeepAlives:   !keepAlive,
			MaxIdleConnsPerHost: c,
		}
		b.Cleanup(tr.CloseIdleConnections)
		return &http.Client{Transport: tr}
	}
	get := func(hc *http.Client) func() error {
		return func() error {
			resp, err := hc.Get("http://" + origin + "/")
			if err != nil {
				return err
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			return resp.Body.Close()
		}
	}
	ops := 3000 / c
	if !keepAlive {
		ops = 1000 / c
	}
	dc, pc := client(up.ln.Addr().String()), client(addr)
	// Warm both paths (connections, pools).
	timeLoad(b, c, 2, get(dc))
	timeLoad(b, c, 2, get(pc))
	var direct, proxied time.Duration
	for b.Loop() {
		direct += timeLoad(b, c, ops, get(dc))
		proxied += timeLoad(b, c, ops, get(pc))
	}
	reportRatio(b, direct, proxied, "req/s", float64(b.N*ops*c))
}

func BenchmarkTunnelSetup(b *testing.B) {
	for _, protocol := range []pool.Protocol{pool.HTTP, pool.SOCKS5} {
		b.Run(fmt.Sprintf("%s/c=32", protocol), func(b *testing.B) {
			const c = 32
			echo := startTCP(b, "tcp", "127.0.0.1:0", echoServe)
			up := upstreamFor(b, protocol)
			addr := benchListener(b, Config{Protocol: string(protocol)}, newFakePool(up))
			setup := func(proxyAddr string) func() error {
				return func() error {
					conn, r, err := tunnelVia(protocol, proxyAddr, echo)
					if err != nil {
						return err
					}
					defer conn.Close()
					if _, err := conn.Write([]byte{1}); err != nil {
						return err
					}
					var one [1]byte
					_, err = io.ReadFull(r, one[:])
					return err
				}
			}
			const ops = 1500 / c
			var direct, proxied time.Duration
			for b.Loop() {
				direct += timeLoad(b, c, ops, setup(up.Address))
				proxied += timeLoad(b, c, ops, setup(addr))
			}
			reportRatio(b, direct, proxied, "setups/s", float64(b.N*ops*c))
		})
	}
}

var _ = context.Background
var _ = socks5.ReplySucceeded
