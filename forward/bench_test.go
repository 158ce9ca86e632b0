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
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/proxy"

	"github.com/proxyd/proxyd/pool"
)

// Benchmarks compare the same load straight to the same upstream (the
// baseline) with the load through proxyd, in the same run, and report the
// ratio proxied/direct as "ratio". Each iteration runs a whole load both
// ways; run with -benchtime=10x or more (a single round's ratio moves
// widely on a small VM), 1x for a quick look. The upstreams are the test
// upstreams, which copy through user-space buffers and so make direct
// slower than real upstreams do: these ratios run higher than those of the
// out-of-process rig that BENCHMARKS.md reports, and only the rig compares
// proxyd with a plain io.Copy forwarder.

// benchListener serves cfg on loopback for a benchmark.
func benchListener(b *testing.B, cfg Config, p Pool) string {
	b.Helper()
	cfg.Address = "127.0.0.1:0"
	cfg.AllowDestinations = loopbackAllowed
	l, err := NewListener(cfg, p, nil, slog.New(slog.DiscardHandler))
	if err != nil {
		b.Fatal(err)
	}
	ln, err := Listen(context.Background(), "127.0.0.1:0")
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

// drain reads r to its end through a 64 KiB buffer and returns the bytes
// read. Both throughput loads' clients read this way: how much a client
// takes per read moves every party's CPU cost (the upstream's and proxyd's
// writes wait on it), so the HTTP and SOCKS5 loads read alike. (Until
// November 2026 the SOCKS5 load read 8 KiB per call through io.Discard's
// ReadFrom while the HTTP load read through its 64 KiB bufio.Reader, and
// the SOCKS5 ratios were lower for it.)
func drain(r io.Reader) (int64, error) {
	return io.CopyBuffer(struct{ io.Writer }{io.Discard}, struct{ io.Reader }{r}, make([]byte, 64<<10))
}

func upstreamFor(b testing.TB, protocol pool.Protocol) *pool.Upstream {
	if protocol == pool.SOCKS5 {
		return newSOCKSUpstream(b, "", "", nil).upstream(1)
	}
	return newHTTPUpstream(b, "", "", nil).upstream(1)
}

// timeLoad runs load with c workers each doing ops operations and returns
// the wall time.
func timeLoad(b testing.TB, c, ops int, op func() error) time.Duration {
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

// benchLoad is one load of the benchmarks. serve starts the destination and
// the upstream and returns the upstream and the target the clients use;
// client returns the operation to time against a proxy address (the
// upstream itself for the baseline, proxyd otherwise).
type benchLoad struct {
	name     string
	protocol pool.Protocol // of the listener and the upstream
	c, ops   int           // workers, operations per worker
	unit     string
	amount   float64 // of unit per operation
	serve    func(tb testing.TB) (up *pool.Upstream, target string)
	client   func(tb testing.TB, target string) func(proxyAddr string) func() error
}

func benchLoads() []benchLoad {
	var loads []benchLoad
	const volume = 256 << 20
	for _, protocol := range []pool.Protocol{pool.HTTP, pool.SOCKS5} {
		for _, streams := range []int{1, 16} {
			n := volume / streams
			loads = append(loads, benchLoad{
				name: fmt.Sprintf("throughput/%s/streams=%d", protocol, streams), protocol: protocol,
				c: streams, ops: 1, unit: "MB/s", amount: float64(n) / 1e6,
				serve: func(tb testing.TB) (*pool.Upstream, string) {
					return upstreamFor(tb, protocol), startTCP(tb, "tcp", "127.0.0.1:0", sourceServe(n))
				},
				client: func(_ testing.TB, src string) func(string) func() error {
					return func(proxyAddr string) func() error {
						return func() error {
							c, r, err := tunnelVia(protocol, proxyAddr, src)
							if err != nil {
								return err
							}
							defer c.Close()
							got, err := drain(r)
							if err == nil && got != int64(n) {
								err = fmt.Errorf("got %d bytes, want %d", got, n)
							}
							return err
						}
					}
				},
			})
		}
	}
	for _, c := range []int{1, 32} {
		loads = append(loads, plainLoad(fmt.Sprintf("keepalive/c=%d", c), c, 3000/c, true))
	}
	loads = append(loads, plainLoad("newconn/c=32", 32, 1000/32, false))
	for _, protocol := range []pool.Protocol{pool.HTTP, pool.SOCKS5} {
		loads = append(loads, benchLoad{
			name: fmt.Sprintf("setup/%s/c=32", protocol), protocol: protocol,
			c: 32, ops: 1500 / 32, unit: "setups/s", amount: 1,
			serve: func(tb testing.TB) (*pool.Upstream, string) {
				return upstreamFor(tb, protocol), startTCP(tb, "tcp", "127.0.0.1:0", echoServe)
			},
			client: func(_ testing.TB, echo string) func(string) func() error {
				return func(proxyAddr string) func() error {
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
			},
		})
	}
	return loads
}

func plainLoad(name string, c, ops int, keepAlive bool) benchLoad {
	return benchLoad{
		name: name, protocol: pool.HTTP, c: c, ops: ops, unit: "req/s", amount: 1,
		serve: func(tb testing.TB) (*pool.Upstream, string) {
			body := make([]byte, 1024)
			origin, _ := startOrigin(tb, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				_, _ = w.Write(body)
			}))
			return newHTTPUpstream(tb, "", "", nil).upstream(1), origin
		},
		client: func(tb testing.TB, origin string) func(string) func() error {
			clients := map[string]*http.Client{}
			var mu sync.Mutex
			return func(proxyAddr string) func() error {
				mu.Lock()
				hc := clients[proxyAddr]
				if hc == nil {
					tr := &http.Transport{
						Proxy:               http.ProxyURL(&url.URL{Scheme: "http", Host: proxyAddr}),
						DisableKeepAlives:   !keepAlive,
						MaxIdleConnsPerHost: c,
					}
					tb.Cleanup(tr.CloseIdleConnections)
					hc = &http.Client{Transport: tr}
					clients[proxyAddr] = hc
				}
				mu.Unlock()
				return func() error {
					resp, err := hc.Get("http://" + origin + "/")
					if err != nil {
						return err
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					return resp.Body.Close()
				}
			}
		},
	}
}

// measure warms both paths, then times the load straight to the upstream
// and through proxyd, rounds times each. With cpu set it also adds up the
// CPU time cpu reports over each phase.
func (ld benchLoad) measure(tb testing.TB, op func(string) func() error, upAddr, proxydAddr string, rounds int,
	cpu func() cpuTimes) (direct, proxied time.Duration, cpuDirect, cpuProxied cpuTimes) {
	timeLoad(tb, ld.c, 1, op(upAddr))
	timeLoad(tb, ld.c, 1, op(proxydAddr))
	for range rounds {
		var c0, c1, c2 cpuTimes
		if cpu != nil {
			c0 = cpu()
		}
		direct += timeLoad(tb, ld.c, ld.ops, op(upAddr))
		if cpu != nil {
			c1 = cpu()
		}
		proxied += timeLoad(tb, ld.c, ld.ops, op(proxydAddr))
		if cpu != nil {
			c2 = cpu()
		}
		for i := range c0 {
			cpuDirect[i] += c1[i] - c0[i]
			cpuProxied[i] += c2[i] - c1[i]
		}
	}
	return direct, proxied, cpuDirect, cpuProxied
}

// cpuTimes is the CPU time, in seconds, of the serving child (upstream and
// destination), the load child and proxyd's process.
type cpuTimes [3]float64

// processCPU reads a process's user+system CPU seconds from /proc (in
// clock ticks of 1/100 s, USER_HZ on Linux).
func processCPU(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// Fields after the command name, which may hold spaces: state is
	// field 3 of stat(5), utime 14 and stime 15.
	stat := string(b)
	f := strings.Fields(stat[strings.LastIndexByte(stat, ')')+1:])
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.Atoi(f[11])
	st, _ := strconv.Atoi(f[12])
	return float64(u+st) / 100
}

// BenchmarkInProcess runs load, upstream, destination and proxyd in this
// process.
func BenchmarkInProcess(b *testing.B) {
	for _, ld := range benchLoads() {
		b.Run(ld.name, func(b *testing.B) {
			up, target := ld.serve(b)
			addr := benchListener(b, testConfig(func(c *Config) { c.Protocol = string(ld.protocol) }), newFakePool(up))
			direct, proxied, _, _ := ld.measure(b, ld.client(b, target), up.Address, addr, b.N, nil)
			reportRatio(b, direct, proxied, ld.unit, float64(b.N*ld.c*ld.ops)*ld.amount)
		})
	}
}

// BenchmarkSeparateProcesses runs each party in its own process, as in
// production: the upstream and the destination in one child process, the
// load (the clients) in another, proxyd alone in this one. Both children are
// this test binary re-executed as TestBenchHelper. Besides the ratio it
// reports the CPU seconds all three processes spent in each phase and
// proxyd's own share of the proxied phase: where a ratio comes from.
func BenchmarkSeparateProcesses(b *testing.B) {
	for _, ld := range benchLoads() {
		b.Run(ld.name, func(b *testing.B) {
			server := startHelper(b, "serve", ld.name, b.N)
			upAddr := server.next("UPSTREAM ")
			target := server.next("TARGET ")
			up := &pool.Upstream{Service: 1, Protocol: ld.protocol, Address: upAddr}
			addr := benchListener(b, testConfig(func(c *Config) { c.Protocol = string(ld.protocol) }), newFakePool(up))
			load := startHelper(b, "load", ld.name, b.N)
			fmt.Fprintf(load.stdin, "%s %s %s %d\n", upAddr, target, addr, server.pid)
			var d, p, cpuDirect, cpuProxied, cpuProxyd float64
			if _, err := fmt.Sscan(load.next("RESULT "), &d, &p, &cpuDirect, &cpuProxied, &cpuProxyd); err != nil {
				b.Fatal(err)
			}
			reportRatio(b, time.Duration(d*1e9), time.Duration(p*1e9), ld.unit, float64(b.N*ld.c*ld.ops)*ld.amount)
			b.ReportMetric(cpuDirect, "CPU-s-direct")
			b.ReportMetric(cpuProxied, "CPU-s-proxied")
			b.ReportMetric(cpuProxyd, "CPU-s-proxyd")
		})
	}
}

type helperProc struct {
	tb    testing.TB
	stdin io.WriteCloser
	lines *bufio.Scanner
	pid   int
}

func startHelper(tb testing.TB, role, load string, rounds int) *helperProc {
	cmd := exec.Command(os.Args[0], "-test.run=^TestBenchHelper$")
	cmd.Env = append(os.Environ(), benchHelperEnv+"="+role, "FORWARD_LOAD="+load, "FORWARD_LOAD_ROUNDS="+strconv.Itoa(rounds))
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = stdin.Close(); _ = cmd.Wait() })
	return &helperProc{tb: tb, stdin: stdin, lines: bufio.NewScanner(stdout), pid: cmd.Process.Pid}
}

func (h *helperProc) next(prefix string) string {
	for h.lines.Scan() {
		if v, ok := strings.CutPrefix(h.lines.Text(), prefix); ok {
			return v
		}
	}
	h.tb.Fatalf("helper ended before %q", prefix)
	return ""
}

const benchHelperEnv = "FORWARD_BENCH_HELPER"

// TestBenchHelper is a child of BenchmarkSeparateProcesses: role "serve"
// runs a load's upstream and destination until stdin closes, role "load"
// times its clients straight to the upstream and through proxyd.
func TestBenchHelper(t *testing.T) {
	role := os.Getenv(benchHelperEnv)
	if role == "" {
		t.Skip("child process of BenchmarkSeparateProcesses")
	}
	name := os.Getenv("FORWARD_LOAD")
	rounds, _ := strconv.Atoi(os.Getenv("FORWARD_LOAD_ROUNDS"))
	for _, ld := range benchLoads() {
		if ld.name != name {
			continue
		}
		if role == "serve" {
			up, target := ld.serve(t)
			fmt.Printf("UPSTREAM %s\nTARGET %s\n", up.Address, target)
			_, _ = io.Copy(io.Discard, os.Stdin)
			return
		}
		var (
			upAddr, target, proxydAddr string
			servePID                   int
		)
		if _, err := fmt.Fscan(os.Stdin, &upAddr, &target, &proxydAddr, &servePID); err != nil {
			t.Fatal(err)
		}
		cpu := func() cpuTimes {
			return cpuTimes{processCPU(servePID), processCPU(os.Getpid()), processCPU(os.Getppid())}
		}
		direct, proxied, cd, cp := ld.measure(t, ld.client(t, target), upAddr, proxydAddr, rounds, cpu)
		fmt.Printf("RESULT %f %f %f %f %f\n", direct.Seconds(), proxied.Seconds(),
			cd[0]+cd[1]+cd[2], cp[0]+cp[1]+cp[2], cp[2])
		return
	}
	t.Fatalf("no load %q", name)
}
