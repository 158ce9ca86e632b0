package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/proxyd/proxyd/agent/providersim"
	"github.com/proxyd/proxyd/forward"
	"github.com/proxyd/proxyd/internal/freeport"
	"github.com/proxyd/proxyd/internal/syncbuf"
)

// TestDemo runs `proxyd demo` on free ports and follows the first curl
// command it prints, then stops it as Ctrl-C would.
func TestDemo(t *testing.T) {
	httpAddr, socksAddr, adminAddr := freeport.Addr(t), freeport.Addr(t), freeport.Addr(t)
	out, errOut := runDemo(t, httpAddr, socksAddr, adminAddr, "300ms")
	var cmd []string
	waitFor(t, "the demo's instructions", 15*time.Second, func() bool {
		m := regexp.MustCompile(`curl -x http://(\S+) (\S+)`).FindStringSubmatch(out.String())
		cmd = m
		return m != nil
	})
	if cmd[1] != httpAddr {
		t.Fatalf("printed proxy %s, want %s", cmd[1], httpAddr)
	}
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: httpAddr}), DisableKeepAlives: true}}
	// Faults come and go every 300ms; retries before the first byte keep
	// every request served.
	for i := 0; i < 20; i++ {
		resp, err := c.Get(cmd[2])
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(body), "hello from the demo origin") {
			t.Fatalf("request %d: %d %q", i, resp.StatusCode, body)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !strings.Contains(errOut.String(), "demo fault") {
		t.Errorf("no fault was injected:\n%s", errOut.String())
	}
}

// runDemo runs `proxyd demo` on the given addresses until the test ends,
// then stops it as Ctrl-C would and checks that it exited 0.
func runDemo(t *testing.T, httpAddr, socksAddr, adminAddr, faults string) (out, errOut *syncbuf.Buffer) {
	t.Helper()
	out = &syncbuf.Buffer{}
	errOut = &syncbuf.Buffer{}
	ctx, cancel := context.WithCancel(context.Background())
	code := make(chan int, 1)
	go func() {
		code <- runMain(ctx, []string{"demo", "-http", httpAddr, "-socks", socksAddr, "-admin", adminAddr, "-faults", faults},
			stdio{in: strings.NewReader(""), out: out, err: errOut, getenv: func(string) string { return "" }})
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case c := <-code:
			if c != 0 {
				t.Errorf("demo exited %d: %s", c, errOut.String())
			}
		case <-time.After(40 * time.Second):
			t.Error("demo did not stop")
		}
	})
	return out, errOut
}

func TestDemoPortTaken(t *testing.T) {
	w := newWorld(t) // anything that holds a port
	taken := w.simURL[len("http://"):]
	var out, errb strings.Builder
	rc := runMain(context.Background(), []string{"demo", "-http", taken}, stdio{out: &out, err: &errb, getenv: func(string) string { return "" }})
	if rc != 1 || !strings.Contains(errb.String(), "cannot listen on "+taken+" (-http)") || !strings.Contains(errb.String(), "demo -http 127.0.0.1:") {
		t.Errorf("exit %d: %s", rc, errb.String())
	}
}

// via is the upstream a demo origin answer names ("... via NAME" or "...
// via NAME (exit IP X)"); "" when the body is not such an answer.
func via(body string) string {
	m := regexp.MustCompile(`^hello from the demo origin: .* via (\S+)`).FindStringSubmatch(body)
	if m == nil {
		return ""
	}
	return m[1]
}

// TestDemoShowsUpstreams follows the demo's instructions as a user would:
// the status page's address comes first, two requests with one sticky key
// name the same upstream, eight plain ones name more than one.
func TestDemoShowsUpstreams(t *testing.T) {
	httpAddr, socksAddr, adminAddr := freeport.Addr(t), freeport.Addr(t), freeport.Addr(t)
	out, _ := runDemo(t, httpAddr, socksAddr, adminAddr, "0")
	var sticky []string
	waitFor(t, "the demo's instructions", 15*time.Second, func() bool {
		sticky = regexp.MustCompile(`curl -x http://session-demo1:x@(\S+) (\S+)`).FindStringSubmatch(out.String())
		return sticky != nil
	})
	printed := out.String()
	if first := strings.Fields(printed); len(first) < 3 || first[0] != "Status" || first[2] != "http://"+adminAddr+"/" {
		t.Errorf("the status page's address is not what the demo prints first:\n%s", printed)
	}
	if strings.Contains(printed, "fault is injected") {
		t.Errorf("-faults 0 still promises faults:\n%s", printed)
	}
	plain := regexp.MustCompile(`curl -x http://(\S+) (\S+)`).FindStringSubmatch(printed)
	get := func(proxyURL *url.URL, target string) string {
		t.Helper()
		c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{Proxy: http.ProxyURL(proxyURL), DisableKeepAlives: true}}
		resp, err := c.Get(target)
		if err != nil {
			t.Fatalf("GET %s via %s: %v", target, proxyURL.Redacted(), err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		v := via(string(body))
		if resp.StatusCode != 200 || v == "" || v == "no" {
			t.Fatalf("GET %s via %s: %d %q names no upstream", target, proxyURL.Redacted(), resp.StatusCode, body)
		}
		if strings.HasPrefix(v, "ppr-") && !strings.Contains(string(body), "(exit IP 198.51.100.") {
			t.Errorf("a ppr session's answer without its exit IP: %q", body)
		}
		return v
	}
	stickyURL := &url.URL{Scheme: "http", Host: sticky[1], User: url.UserPassword("session-demo1", "x")}
	first, second := get(stickyURL, sticky[2]), get(stickyURL, sticky[2])
	if first != second {
		t.Errorf("the sticky example moved from %s to %s", first, second)
	}
	seen := map[string]int{}
	for range 8 {
		seen[get(&url.URL{Scheme: "http", Host: plain[1]}, plain[2])]++
	}
	if len(seen) < 2 {
		t.Errorf("eight plain requests all went via %v", seen)
	}
}

// TestDemoGatewaysSpeakOneProtocol sends sticky and plain traffic through
// an HTTP and a SOCKS5 listener fed only by the ppr service, whose gateways
// serve each protocol on its own port: every request is answered through a
// session gateway, the SOCKS5 ports carry the SOCKS5 traffic, and no
// simulated proxy ever receives the other protocol.
func TestDemoGatewaysSpeakOneProtocol(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), func(c *config) {
		for _, p := range []struct{ name, protocol string }{{"ppr-http", "http"}, {"ppr-socks", "socks5"}} {
			l := defaultListener()
			l.Name, l.Protocol, l.Upstream, l.Address, l.Kind = p.name, p.protocol, p.protocol, "127.0.0.1:0", "ppr"
			l.AllowDestinations = []forward.Network{forward.MustParseNetwork("127.0.0.0/8")}
			c.Listener = append(c.Listener, l)
		}
	})
	e.waitReady()
	for _, listener := range []string{"ppr-http", "ppr-socks", "http", "socks"} {
		for _, key := range []string{"", "k1", "k2"} {
			var names []string
			for range 3 {
				body, _, err := e.get(listener, key)
				if err != nil {
					t.Fatalf("GET through %s (key %q): %v", listener, key, err)
				}
				v := via(body)
				if v == "" || v == "no" {
					t.Fatalf("GET through %s (key %q): %q names no upstream", listener, key, body)
				}
				if strings.HasPrefix(listener, "ppr-") && !strings.HasPrefix(v, "ppr-session-") {
					t.Errorf("GET through %s went via %s, not a session gateway", listener, v)
				}
				names = append(names, v)
			}
			if key != "" && (names[0] != names[1] || names[1] != names[2]) {
				t.Errorf("sticky key %s through %s moved: %v", key, listener, names)
			}
		}
	}
	var socksTraffic int64
	for _, g := range w.gateways {
		socksTraffic += g.SOCKS.Accepted()
	}
	if socksTraffic == 0 {
		t.Error("no SOCKS5 connection reached a gateway's SOCKS5 port")
	}
	for _, ps := range [][]*providersim.Proxy{w.fprHTTP, w.fprSOCKS} {
		for _, p := range ps {
			if n := p.ProtocolErrors(); n != 0 {
				t.Errorf("%s (%s on %s) received the other protocol %d times", p.Name, p.Protocol, p.Addr(), n)
			}
		}
	}
	for _, g := range w.gateways {
		for _, p := range []*providersim.Proxy{g.HTTP, g.SOCKS} {
			if n := p.ProtocolErrors(); n != 0 {
				t.Errorf("%s (%s on %s) received the other protocol %d times", p.Name, p.Protocol, p.Addr(), n)
			}
		}
	}
	// Each session stands for one upstream per protocol, on that
	// protocol's port of its gateway.
	ports := map[string]string{}
	for _, g := range w.gateways {
		ports[g.HTTP.Addr()], ports[g.SOCKS.Addr()] = "http", "socks5"
	}
	perProtocol := map[string]int{}
	for _, u := range e.poolState().Upstreams {
		if u.Service != demoPPR || u.Session == "" {
			continue
		}
		if got := ports[u.Address]; got != string(u.Protocol) {
			t.Errorf("session upstream %s dials a %q port", u.ID, got)
		}
		perProtocol[string(u.Protocol)]++
	}
	if perProtocol["http"] != len(w.gateways) || perProtocol["socks5"] != len(w.gateways) {
		t.Errorf("session upstreams per protocol %v, want %d each", perProtocol, len(w.gateways))
	}
}

// TestDemoSharedLoopback is the demo world where only 127.0.0.1 answers
// (macOS, Windows): every upstream on 127.0.0.1, told apart by port, and
// both listeners carry plain and sticky traffic through them; the fault
// that would mark the one IP errored is skipped, saying so.
func TestDemoSharedLoopback(t *testing.T) {
	w, err := startDemoWorld(true)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.close)
	e := startDaemon(t, w, t.TempDir(), nil)
	e.waitReady()
	ports := map[string]bool{}
	for _, u := range e.poolState().Upstreams {
		host, port, _ := net.SplitHostPort(u.Address)
		if host != "127.0.0.1" {
			t.Errorf("upstream %s is not on 127.0.0.1", u.ID)
		}
		ports[string(u.Protocol)+"/"+port] = true
	}
	if len(ports) != len(e.poolState().Upstreams) || len(ports) < 10 {
		t.Errorf("upstreams not told apart by port: %d ports for %d upstreams", len(ports), len(e.poolState().Upstreams))
	}
	for _, l := range []string{"http", "socks"} {
		for _, key := range []string{"", "k1"} {
			if body, _, err := e.get(l, key); err != nil || !strings.Contains(body, "via an upstream on 127.0.0.1") {
				t.Errorf("GET through %s (key %q): %q %v", l, key, body, err)
			}
		}
	}
	logs := &syncbuf.Buffer{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		w.faults(ctx, 10*time.Millisecond, slog.New(slog.NewTextHandler(logs, nil)))
	}()
	waitFor(t, "the first fault step", 5*time.Second, func() bool { return strings.Contains(logs.String(), "skipping") })
	cancel()
	<-done
	if strings.Contains(logs.String(), "lists an upstream as errored") {
		t.Errorf("the errored-IP fault ran on a shared loopback address:\n%s", logs.String())
	}
}

// Ctrl-C stops the demo within its short drain, a tunnel still open.
func TestDemoStopsSoonWithATunnelOpen(t *testing.T) {
	httpAddr, socksAddr, adminAddr := freeport.Addr(t), freeport.Addr(t), freeport.Addr(t)
	out, errOut := &syncbuf.Buffer{}, &syncbuf.Buffer{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	code := make(chan int, 1)
	go func() {
		code <- runMain(ctx, []string{"demo", "-http", httpAddr, "-socks", socksAddr, "-admin", adminAddr},
			stdio{in: strings.NewReader(""), out: out, err: errOut, getenv: func(string) string { return "" }})
	}()
	var origin string
	waitFor(t, "the demo's instructions", 15*time.Second, func() bool {
		m := regexp.MustCompile(`curl -x http://\S+ http://(\S+?)/`).FindStringSubmatch(out.String())
		if m != nil {
			origin = m[1]
		}
		return m != nil
	})
	c, err := net.Dial("tcp", httpAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", origin, origin)
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if resp, err := http.ReadResponse(bufio.NewReader(c), nil); err != nil || resp.StatusCode != 200 {
		t.Fatalf("CONNECT through the demo: %v %v", resp, err)
	}
	start := time.Now()
	cancel() // Ctrl-C
	select {
	case got := <-code:
		if got != 0 {
			t.Errorf("demo exited %d: %s", got, errOut.String())
		}
		if took := time.Since(start); took > 10*time.Second {
			t.Errorf("the demo took %s to stop with a tunnel open", took)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the demo did not stop within 20s with a tunnel open")
	}
}
