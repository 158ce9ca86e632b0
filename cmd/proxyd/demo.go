package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/proxyd/proxyd/agent"
	"github.com/proxyd/proxyd/agent/providersim"
	"github.com/proxyd/proxyd/forward"
)

// demoWorld is everything `proxyd demo` runs besides the daemon: the
// simulated provider, its proxy servers and a small origin.
type demoWorld struct {
	sim      *providersim.Sim
	simURL   string
	origin   string // host:port
	fprHTTP  []*providersim.Proxy
	fprSOCKS []*providersim.Proxy
	gateways []*providersim.Gateway // one per sticky session of demoPPR, each on its own 127.0.3.N
	sessions []*providersim.Proxy   // the gateways' HTTP proxies, in the same order
	names    map[string]string      // upstream IP → the name of the simulated proxy on it
	shared   bool                   // every proxy on 127.0.0.1 (no other loopback address here)
	servers  []*http.Server
	wg       sync.WaitGroup
}

// Demo services: 101 (fpr) and 102 (ppr with two sticky sessions).
const (
	demoFPR = 101
	demoPPR = 102
)

// startDemoWorld brings up the provider side on loopback. Every upstream
// proxy has an address of its own in 127.0.0.0/8 and connects to
// destinations from it, so that the provider's network status, which names
// IPs, can single one out, and the origin can tell which upstream carried a
// request.
//
// The ppr service is laid out as the provider's rotating gateways are
// believed to be: HTTP and SOCKS5 on different ports of one host. Each
// sticky session has a gateway of its own (an HTTP and a SOCKS5 proxy on
// 127.0.3.N); its record names the gateway's IP and its HTTP port, the
// ppr-http list holds every gateway's HTTP port, ppr-socks every SOCKS5
// port, so the daemon must find each session's SOCKS5 port in the lists.
//
// Only Linux answers on all of 127.0.0.0/8 out of the box. Where only
// 127.0.0.1 does (macOS, Windows), shared is set: every proxy listens on
// 127.0.0.1, told apart by its port, the origin cannot name the proxy a
// request came through, and the fault that marks an IP errored is skipped
// (it would take every upstream out at once).
func startDemoWorld(shared bool) (*demoWorld, error) {
	w := &demoWorld{sim: providersim.New(providersim.Config{}), names: map[string]string{}, shared: shared}
	host := func(net, i int) string {
		if shared {
			return "127.0.0.1"
		}
		return fmt.Sprintf("127.0.%d.%d", net, i)
	}
	ok := false
	defer func() {
		if !ok {
			w.close()
		}
	}()
	serve := func(h http.Handler) (string, error) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return "", err
		}
		srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
		w.servers = append(w.servers, srv)
		w.wg.Add(1)
		go func() { defer w.wg.Done(); srv.Serve(ln) }()
		return ln.Addr().String(), nil
	}
	addr, err := serve(w.sim)
	if err != nil {
		return nil, fmt.Errorf("starting the simulated provider: %w", err)
	}
	w.simURL = "http://" + addr
	user, pass := fmt.Sprintf("u%d", demoFPR), fmt.Sprintf("pw-%d-sim", demoFPR)
	var httpEntries, socksEntries []providersim.Entry
	for i := 1; i <= 3; i++ {
		hp, err := providersim.StartProxy("http", host(1, i)+":0", fmt.Sprintf("fpr-http-%d", i), user, pass)
		if err != nil {
			return nil, fmt.Errorf("starting a demo upstream: %w", err)
		}
		w.fprHTTP = append(w.fprHTTP, hp)
		w.names[hp.Host()] = hp.Name
		httpEntries = append(httpEntries, hp.Entry(user, pass))
		sp, err := providersim.StartProxy("socks5", host(2, i)+":0", fmt.Sprintf("fpr-socks-%d", i), user, pass)
		if err != nil {
			return nil, fmt.Errorf("starting a demo upstream: %w", err)
		}
		w.fprSOCKS = append(w.fprSOCKS, sp)
		w.names[sp.Host()] = sp.Name
		socksEntries = append(socksEntries, sp.Entry("", ""))
	}
	w.sim.SetEntries(demoFPR, "http-auth", httpEntries)
	w.sim.SetEntries(demoFPR, "socks-ip", socksEntries)

	puser, ppass := fmt.Sprintf("u%d", demoPPR), fmt.Sprintf("pw-%d-sim", demoPPR)
	var sessions []providersim.Session
	var httpGW, socksGW []providersim.Entry
	for i := 1; i <= 2; i++ {
		g, err := providersim.StartGateway(host(3, i), fmt.Sprintf("ppr-session-s%d", i), puser, ppass)
		if err != nil {
			return nil, fmt.Errorf("starting a demo gateway: %w", err)
		}
		w.gateways = append(w.gateways, g)
		w.sessions = append(w.sessions, g.HTTP)
		w.names[g.Host()] = g.Name()
		httpGW = append(httpGW, g.HTTP.Entry(puser, ppass))
		socksGW = append(socksGW, g.SOCKS.Entry(puser, ppass))
		sessions = append(sessions, g.Session(fmt.Sprintf("s%d", i), fmt.Sprintf("198.51.100.%d", i), 5))
	}
	w.sim.SetEntries(demoPPR, "ppr-http", httpGW)
	w.sim.SetEntries(demoPPR, "ppr-socks", socksGW)
	w.sim.SetStickySessions(demoPPR, sessions)
	w.sim.SetUsage(demoPPR, 120, 1024)

	// The origin comes last: it reads w.names.
	w.origin, err = serve(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(rw, "hello from the demo origin: %s %s%s via %s\n", r.Method, r.Host, r.URL.Path, w.carrier(r.RemoteAddr))
	}))
	if err != nil {
		return nil, fmt.Errorf("starting the demo origin: %w", err)
	}
	ok = true
	return w, nil
}

// loopbackAliases reports whether this system answers on loopback
// addresses other than 127.0.0.1 (Linux does; macOS and Windows do not).
func loopbackAliases() bool {
	ln, err := net.Listen("tcp", "127.0.1.1:0")
	if err != nil {
		return false
	}
	ln.Close()
	return true
}

// carrier names the simulated upstream a request to the origin came
// through, from the address it came from, with the current exit IP when it
// is a ppr session's gateway.
func (w *demoWorld) carrier(remoteAddr string) string {
	if w.shared {
		return "an upstream on 127.0.0.1 (this system has no other loopback address, so the origin cannot tell which: proxyd pool shows the pool)"
	}
	ip, _, _ := net.SplitHostPort(remoteAddr)
	name, ok := w.names[ip]
	if !ok {
		return "no simulated upstream (from " + ip + ")"
	}
	for _, s := range w.sim.Sessions(demoPPR) {
		if s.Server == ip {
			return name + " (exit IP " + s.ExitIP + ")"
		}
	}
	return name
}

func (w *demoWorld) close() {
	for _, s := range w.servers {
		s.Close()
	}
	for _, ps := range [][]*providersim.Proxy{w.fprHTTP, w.fprSOCKS} {
		for _, p := range ps {
			p.Close()
		}
	}
	for _, g := range w.gateways {
		g.Close()
	}
	w.wg.Wait()
}

// faults injects one fault after another, each healing before the next, so
// that `proxyd pool` and the metrics show the pool at work.
func (w *demoWorld) faults(ctx context.Context, every time.Duration, log *slog.Logger) {
	step := 0
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		switch step % 4 {
		case 0:
			if w.shared {
				log.Info("demo: skipping the fault that marks an IP errored: every simulated upstream shares 127.0.0.1 here")
				break
			}
			ip := w.fprHTTP[0].Addr()
			host, _, _ := net.SplitHostPort(ip)
			w.sim.MarkErrored(demoFPR, host)
			log.Info("demo fault: the provider lists an upstream as errored", "ip", host)
		case 1:
			w.sim.ClearStatus(demoFPR)
			w.fprHTTP[1].Down()
			w.fprSOCKS[1].Down()
			log.Info("demo fault: two upstream proxies went down", "http", w.fprHTTP[1].Addr(), "socks", w.fprSOCKS[1].Addr())
		case 2:
			w.fprHTTP[1].Up()
			w.fprSOCKS[1].Up()
			w.gateways[0].Down()
			log.Info("demo fault: the upstream proxies are back; sticky session s1's gateway fails (proxyd rotates it)")
		case 3:
			w.gateways[0].Up()
			log.Info("demo: every fault healed")
		}
		step++
	}
}

// demoConfig is the daemon's config for the demo world.
func demoConfig(w *demoWorld, httpAddr, socksAddr, adminAddr, stateDir string) config {
	cfg := defaultConfig()
	cfg.API.BaseURL = w.simURL
	cfg.API.Services = []int{demoFPR, demoPPR}
	cfg.Poll.IPList = 15 * time.Second
	cfg.Poll.NetworkStatus = 2 * time.Second
	cfg.Poll.Usage = 5 * time.Second
	cfg.Poll.Account = 30 * time.Second
	cfg.Poll.MaxBackoff = 30 * time.Second
	cfg.Pool.EjectBase = 10 * time.Second
	cfg.Pool.EjectMax = time.Minute
	cfg.Pool.RotateInterval = 10 * time.Second
	cfg.State.Dir = stateDir
	cfg.Shutdown.DrainTimeout = 2 * time.Second // Ctrl-C stops the demo at once, open tunnels or not
	cfg.Admin.Address = adminAddr
	cfg.Listener = defaultListeners()
	cfg.Listener[0].Address = httpAddr
	cfg.Listener[1].Address = socksAddr
	for i := range cfg.Listener {
		cfg.Listener[i].Upstream = cfg.Listener[i].Protocol
		// The demo origin lives on loopback, which listeners refuse by default.
		cfg.Listener[i].AllowDestinations = []forward.Network{forward.MustParseNetwork("127.0.0.0/8")}
	}
	return cfg
}

// cmdDemo is `proxyd demo`: the whole system on this machine.
func cmdDemo(ctx context.Context, args []string, io stdio) int {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(io.err)
	httpAddr := fs.String("http", "127.0.0.1:8080", "HTTP proxy listener")
	socksAddr := fs.String("socks", "127.0.0.1:1080", "SOCKS5 listener")
	adminAddr := fs.String("admin", "127.0.0.1:9900", "admin server")
	faultEvery := fs.Duration("faults", 20*time.Second, "time between injected faults (0: none)")
	if code, ok := parseFlags(fs, args, io); !ok {
		return code
	}
	for _, p := range []struct{ flag, addr string }{{"-http", *httpAddr}, {"-socks", *socksAddr}, {"-admin", *adminAddr}} {
		ln, err := net.Listen("tcp", p.addr)
		if err != nil {
			fmt.Fprintf(io.err, "proxyd demo: cannot listen on %s (%s): %v\n", p.addr, p.flag, shortErr(err))
			fmt.Fprintf(io.err, "choose another address, e.g.: %s demo %s 127.0.0.1:%d\n", selfCommand(), p.flag, 20000+portOf(p.addr))
			return 1
		}
		ln.Close()
	}
	w, err := startDemoWorld(!loopbackAliases())
	if err != nil {
		fmt.Fprintf(io.err, "proxyd demo: %v\n", err)
		return 1
	}
	defer w.close()
	if w.shared {
		fmt.Fprintln(io.err, "proxyd demo: this system answers only on 127.0.0.1, so every simulated upstream listens there, told apart by its port; the fault that marks an IP errored is skipped")
	}
	stateDir, err := os.MkdirTemp("", "proxyd-demo-")
	if err != nil {
		fmt.Fprintf(io.err, "proxyd demo: %v\n", err)
		return 1
	}
	defer os.RemoveAll(stateDir)

	logger, _ := newLogger(logConfig{Level: "info", Format: "text"}, io.err)
	cfg := demoConfig(w, *httpAddr, *socksAddr, *adminAddr, filepath.Join(stateDir, "state"))
	env := map[string]string{agent.TokenEnv: providersim.DefaultToken}
	d, err := newDaemon(cfg, daemonOptions{getenv: func(k string) string { return env[k] }, logger: logger})
	if err != nil {
		fmt.Fprintf(io.err, "proxyd demo: %v\n", err)
		return 1
	}
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- d.Run(runCtx) }()
	select {
	case <-d.ready:
	case err := <-done:
		fmt.Fprintf(io.err, "proxyd demo: %v\n", err)
		return 1
	}
	// Print the instructions once they work: when the first polls filled
	// the pool.
	for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); {
		if ok, _ := d.readiness(); ok {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	var fwg sync.WaitGroup
	if *faultEvery > 0 {
		fwg.Add(1)
		go func() { defer fwg.Done(); w.faults(runCtx, *faultEvery, logger) }()
	}
	faults := "No faults are injected (-faults 0)."
	if *faultEvery > 0 {
		faults = fmt.Sprintf("Every %s a fault is injected and healed; watch the pool heal.", *faultEvery)
	}
	self := selfCommand()
	origin := "http://" + w.origin + "/"
	fmt.Fprintf(io.out, `
Status page: http://%s/

proxyd demo is running:
  simulated provider  %s
  fpr service %d     3 HTTP and 3 SOCKS5 upstream proxies
  ppr service %d     2 sticky sessions, each on a gateway with an HTTP and a SOCKS5 port
  proxyd              HTTP %s, SOCKS5 %s, admin %s
The demo origin's answer names the upstream that carried the request, and the exit
IP of a ppr session.
%s Ctrl-C stops everything.

Try, in another terminal:
  curl -x http://%s %s       # run it a few times: the upstream moves
  curl --socks5-hostname %s %s
  curl -x http://session-demo1:x@%s %s       # sticky: the same upstream every time
  %s pool -admin %s
  curl -s http://%s/metrics | grep '^proxyd_connections_total'
  curl -s http://%s/readyz
  PROXYD_API_TOKEN=%s %s api -base-url %s services
  PROXYD_API_TOKEN=%s %s api -base-url %s sticky list %d
`, *adminAddr, w.simURL, demoFPR, demoPPR, *httpAddr, *socksAddr, *adminAddr, faults,
		*httpAddr, origin, *socksAddr, origin, *httpAddr, origin,
		self, *adminAddr, *adminAddr, *adminAddr,
		providersim.DefaultToken, self, w.simURL, providersim.DefaultToken, self, w.simURL, demoPPR)

	err = <-done
	stop()
	fwg.Wait()
	if err != nil {
		fmt.Fprintf(io.err, "proxyd demo: %v\n", err)
		return 1
	}
	fmt.Fprintln(io.out, "proxyd demo stopped")
	return 0
}

// selfCommand is how the user runs this binary again: the path it was
// started as, or `go run ./cmd/proxyd` under go run.
func selfCommand() string {
	exe := os.Args[0]
	if strings.Contains(exe, "go-build") || strings.HasSuffix(filepath.Dir(exe), "/exe") {
		return "go run ./cmd/proxyd"
	}
	return exe
}

func portOf(addr string) int {
	_, p, _ := net.SplitHostPort(addr)
	var n int
	fmt.Sscan(p, &n)
	return n
}

func shortErr(err error) string {
	if errors.Is(err, syscall.EADDRINUSE) {
		return "the address is in use"
	}
	return err.Error()
}
