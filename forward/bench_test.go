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

// Benchmarks time the same load through three targets in the same run:
// straight to the upstream ("direct", what a client gets without a local
// proxy), through ref (a plain io.Copy forwarder, benchupstream_test.go) and
// through proxyd, all three to the same upstream and destination. They
// report each target's rate, proxyd's over direct's as "ratio" and
// proxyd's over ref's as "ratio-ref" (>= 1: proxyd at least as fast as a
// minimal forwarder). The upstream relays tunnels with io.Copy between TCP
// connections, which splices on Linux, as real upstreams do. Each iteration
// is one round that runs the whole load through every target in turn; run
// with -benchtime=10x or more (a single round's ratio moves widely on a
// small VM), 1x for a quick look. BENCHMARKS.md says how these ratios
// compare with those of the out-of-process rig.

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

// The targets a load is timed through, in their order in a round.
const (
	targetDirect = iota
	targetRef
	targetProxyd
	numTargets
)

var targetNames = [numTargets]string{"direct", "ref", "proxyd"}

// reportRates reports each target's rate (amount of unit in took[target])
// and the ratios of proxyd's rate to direct's and to ref's.
func reportRates(b *testing.B, took [numTargets]time.Duration, unit string, amount float64) {
	for i, name := range targetNames {
		b.ReportMetric(amount/took[i].Seconds(), unit+"-"+name)
	}
	b.ReportMetric(took[targetDirect].Seconds()/took[targetProxyd].Seconds(), "ratio")
	b.ReportMetric(took[targetRef].Seconds()/took[targetProxyd].Seconds(), "ratio-ref")
}

// benchLoad is one load of the benchmarks. dest starts the destination and
// returns its address; client returns the operation to time against a
// proxy address (the upstream itself for the baseline, ref or proxyd).
type benchLoad struct {
	name     string
	protocol pool.Protocol // the proxy protocol the clients speak
	c, ops   int           // workers, operations per worker
	unit     string
	amount   float64 // of unit per operation
	dest     func(tb testing.TB) string
	client   func(tb testing.TB, dest string) func(proxyAddr string) func() error
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
				dest: func(tb testing.TB) string {
					return startTCP(tb, "tcp", "127.0.0.1:0", sourceServe(n))
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
			dest: func(tb testing.TB) string {
				return startTCP(tb, "tcp", "127.0.0.1:0", echoServe)
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
		dest: func(tb testing.TB) string {
			body := make([]byte, 1024)
			origin, _ := startOrigin(tb, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				_, _ = w.Write(body)
			}))
			return origin
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

// measure warms every target, then runs rounds rounds, each timing the
// load through every target in turn (addrs, in target order), and returns
// each target's total time. With cpu set it also adds up the CPU time cpu
// reports over each target's phases.
func (ld benchLoad) measure(tb testing.TB, op func(string) func() error, addrs [numTargets]string, rounds int,
	cpu func() cpuTimes) (took [numTargets]time.Duration, spent [numTargets]cpuTimes) {
	for _, addr := range addrs {
		timeLoad(tb, ld.c, 1, op(addr))
	}
	for range rounds {
		for i, addr := range addrs {
			var before cpuTimes
			if cpu != nil {
				before = cpu()
			}
			took[i] += timeLoad(tb, ld.c, ld.ops, op(addr))
			if cpu != nil {
				after := cpu()
				for p := range after {
					spent[i][p] += after[p] - before[p]
				}
			}
		}
	}
	return took, spent
}

// cpuTimes is the CPU time, in seconds, of each process of
// BenchmarkSeparateProcesses.
type cpuTimes [numProcs]float64

const (
	procUpstream = iota
	procDest
	procLoad // the clients
	procRef
	procProxyd // the benchmark's own process
	numProcs
)

func (c cpuTimes) total() float64 {
	var t float64
	for _, v := range c {
		t += v
	}
	return t
}

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

// BenchmarkInProcess runs load, upstream, destination, ref and proxyd in
// this process.
func BenchmarkInProcess(b *testing.B) {
	for _, ld := range benchLoads() {
		b.Run(ld.name, func(b *testing.B) {
			up := startBenchUpstream(b)
			dest := ld.dest(b)
			ref := startBenchRef(b, up.http)
			addr := benchListener(b, testConfig(func(c *Config) { c.Protocol = string(ld.protocol) }), newFakePool(up.upstream(ld.protocol)))
			took, _ := ld.measure(b, ld.client(b, dest), [numTargets]string{up.of(ld.protocol), ref.of(ld.protocol), addr}, b.N, nil)
			reportRates(b, took, ld.unit, float64(b.N*ld.c*ld.ops)*ld.amount)
		})
	}
}

// BenchmarkSeparateProcesses runs each party in its own process, as in
// production and in the rig: the upstream, the destination, ref and the
// load (the clients) in child processes, proxyd alone in this one. (With
// the upstream and the destination in one process, a request handed
// between them needs no wake-up of another process, which made direct
// faster than a real upstream would.) The children are this test binary
// re-executed as TestBenchHelper. Besides the rates and ratios it reports
// the CPU seconds all five processes spent
// while each target was timed (CPU-s-direct, CPU-s-viaref,
// CPU-s-proxied), ref's and proxyd's own CPU seconds in their phases
// (CPU-s-ref, CPU-s-proxyd: both forwarders did the same work, so these
// compare as CPU per unit) and their quotient, cpu-ratio-ref (<= 1: proxyd
// spent no more than ref).
func BenchmarkSeparateProcesses(b *testing.B) {
	for _, ld := range benchLoads() {
		b.Run(ld.name, func(b *testing.B) {
			upstream := startHelper(b, "upstream", ld.name, b.N)
			up := proxyAddrs{http: upstream.next("UPSTREAM-HTTP "), socks5: upstream.next("UPSTREAM-SOCKS5 ")}
			destination := startHelper(b, "dest", ld.name, b.N)
			dest := destination.next("DEST ")
			ref := startHelper(b, "ref", ld.name, b.N)
			fmt.Fprintln(ref.stdin, up.http)
			refAddrs := proxyAddrs{http: ref.next("REF-HTTP "), socks5: ref.next("REF-SOCKS5 ")}
			addr := benchListener(b, testConfig(func(c *Config) { c.Protocol = string(ld.protocol) }), newFakePool(up.upstream(ld.protocol)))
			load := startHelper(b, "load", ld.name, b.N)
			fmt.Fprintf(load.stdin, "%s %s %s %s %d %d %d\n", up.of(ld.protocol), refAddrs.of(ld.protocol), addr, dest,
				upstream.pid, destination.pid, ref.pid)
			var took [numTargets]float64
			var all [numTargets]float64 // all five processes' CPU in each target's phases
			var cpuRef, cpuProxyd float64
			if _, err := fmt.Sscan(load.next("RESULT "), &took[0], &took[1], &took[2], &all[0], &all[1], &all[2], &cpuRef, &cpuProxyd); err != nil {
				b.Fatal(err)
			}
			var d [numTargets]time.Duration
			for i, s := range took {
				d[i] = time.Duration(s * 1e9)
			}
			reportRates(b, d, ld.unit, float64(b.N*ld.c*ld.ops)*ld.amount)
			b.ReportMetric(all[targetDirect], "CPU-s-direct")
			b.ReportMetric(all[targetRef], "CPU-s-viaref")
			b.ReportMetric(all[targetProxyd], "CPU-s-proxied")
			b.ReportMetric(cpuRef, "CPU-s-ref")
			b.ReportMetric(cpuProxyd, "CPU-s-proxyd")
			b.ReportMetric(cpuProxyd/cpuRef, "cpu-ratio-ref")
		})
	}
}

type helperProc struct {
	tb    testing.TB
	stdin io.WriteCloser
	lines *bufio.Scanner
	pid   int
}

// helperExitTimeout bounds how long a helper may take to end once its
// stdin is closed before it is killed.
const helperExitTimeout = 10 * time.Second

func startHelper(tb testing.TB, role, load string, rounds int) *helperProc {
	cmd := exec.Command(os.Args[0], "-test.run=^TestBenchHelper$")
	cmd.Env = append(os.Environ(), benchHelperEnv+"="+role, "FORWARD_LOAD="+load, "FORWARD_LOAD_ROUNDS="+strconv.Itoa(rounds))
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		_ = stdin.Close() // tells the helper to end
		kill := time.AfterFunc(helperExitTimeout, func() { _ = cmd.Process.Kill() })
		defer kill.Stop()
		_ = cmd.Wait()
	})
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

// TestBenchHelper is a child of BenchmarkSeparateProcesses: role
// "upstream" runs the upstream, "dest" a load's destination, "ref" ref to
// the upstream named on stdin, each until stdin closes; role "load" times
// its clients straight to the upstream, through ref and through proxyd.
func TestBenchHelper(t *testing.T) {
	role := os.Getenv(benchHelperEnv)
	if role == "" {
		t.Skip("child process of BenchmarkSeparateProcesses")
	}
	switch role {
	case "upstream":
		up := startBenchUpstream(t)
		fmt.Printf("UPSTREAM-HTTP %s\nUPSTREAM-SOCKS5 %s\n", up.http, up.socks5)
		_, _ = io.Copy(io.Discard, os.Stdin)
		return
	case "ref":
		var upstreamHTTP string
		if _, err := fmt.Fscanln(os.Stdin, &upstreamHTTP); err != nil {
			t.Fatal(err)
		}
		ref := startBenchRef(t, upstreamHTTP)
		fmt.Printf("REF-HTTP %s\nREF-SOCKS5 %s\n", ref.http, ref.socks5)
		_, _ = io.Copy(io.Discard, os.Stdin)
		return
	}
	name := os.Getenv("FORWARD_LOAD")
	rounds, _ := strconv.Atoi(os.Getenv("FORWARD_LOAD_ROUNDS"))
	for _, ld := range benchLoads() {
		if ld.name != name {
			continue
		}
		if role == "dest" {
			fmt.Printf("DEST %s\n", ld.dest(t))
			_, _ = io.Copy(io.Discard, os.Stdin)
			return
		}
		var (
			addrs                        [numTargets]string
			dest                         string
			upstreamPID, destPID, refPID int
		)
		if _, err := fmt.Fscan(os.Stdin, &addrs[targetDirect], &addrs[targetRef], &addrs[targetProxyd], &dest,
			&upstreamPID, &destPID, &refPID); err != nil {
			t.Fatal(err)
		}
		cpu := func() cpuTimes {
			var c cpuTimes
			c[procUpstream] = processCPU(upstreamPID)
			c[procDest] = processCPU(destPID)
			c[procLoad] = processCPU(os.Getpid())
			c[procRef] = processCPU(refPID)
			c[procProxyd] = processCPU(os.Getppid())
			return c
		}
		took, spent := ld.measure(t, ld.client(t, dest), addrs, rounds, cpu)
		fmt.Printf("RESULT %f %f %f %f %f %f %f %f\n",
			took[targetDirect].Seconds(), took[targetRef].Seconds(), took[targetProxyd].Seconds(),
			spent[targetDirect].total(), spent[targetRef].total(), spent[targetProxyd].total(),
			spent[targetRef][procRef], spent[targetProxyd][procProxyd])
		return
	}
	t.Fatalf("no load %q", name)
}
