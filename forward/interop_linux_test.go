package forward

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/net/proxy"
	"golang.org/x/net/websocket"

	"github.com/proxyd/proxyd/forward/socks5"
	"github.com/proxyd/proxyd/internal/freeport"
	"github.com/proxyd/proxyd/pool"
)

// Squid and Dante as Debian installs them (/usr/sbin, /usr/lib/squid), run
// as daemons in a process group of their own.

// worldDir is a temp dir the daemons' unprivileged users can read and write.
func worldDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "forward-interop-")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

// startDaemon runs argv in its own process group with output to a log file,
// waits until addr accepts, and kills and reaps the group at cleanup.
func startDaemon(t *testing.T, dir, addr string, argv ...string) {
	t.Helper()
	logf, err := os.Create(filepath.Join(dir, "stdout.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		_ = logf.Close()
		t.Fatalf("starting %s: %v", argv[0], err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(3 * time.Second):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-exited
		}
		_ = logf.Close()
	})
	deadline := time.Now().Add(15 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			_ = c.Close()
			return
		}
		select {
		case <-exited:
			out, _ := os.ReadFile(logf.Name())
			t.Fatalf("%s exited early: %s", argv[0], out)
		default:
		}
		if time.Now().After(deadline) {
			out, _ := os.ReadFile(logf.Name())
			t.Fatalf("%s not ready on %s: %s", argv[0], addr, out)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// apr1Hash hashes a password for htpasswd with openssl.
func apr1Hash(t *testing.T, pass string) string {
	t.Helper()
	out, err := exec.Command("openssl", "passwd", "-apr1", pass).Output()
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("openssl passwd: %v", err)
		}
		t.Skipf("openssl passwd: %v", err)
	}
	return strings.TrimSpace(string(out))
}

// startSquid runs Squid with basic auth on loopback.
func startSquid(t *testing.T, user, pass string) string {
	t.Helper()
	requireTool(t, "/usr/sbin/squid")
	requireTool(t, "/usr/lib/squid/basic_ncsa_auth")
	dir := worldDir(t)
	pw := filepath.Join(dir, "htpasswd")
	if err := os.WriteFile(pw, []byte(user+":"+apr1Hash(t, pass)+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", freeport.Port(t))
	conf := fmt.Sprintf(`http_port %[1]s
pid_filename %[2]s/squid.pid
cache_log %[2]s/cache.log
access_log %[2]s/access.log
coredump_dir %[2]s
netdb_filename none
cache deny all
auth_param basic program /usr/lib/squid/basic_ncsa_auth %[3]s
auth_param basic realm proxyd-test
acl authed proxy_auth REQUIRED
http_access allow authed
http_access deny all
shutdown_lifetime 0 seconds
visible_hostname proxyd-test
`, addr, dir, pw)
	cf := filepath.Join(dir, "squid.conf")
	if err := os.WriteFile(cf, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	startDaemon(t, dir, addr, "/usr/sbin/squid", "-N", "-f", cf)
	return addr
}

// startDante runs Dante (method none) on loopback.
func startDante(t *testing.T) string {
	t.Helper()
	requireTool(t, "/usr/sbin/danted")
	dir := worldDir(t)
	port := freeport.Port(t)
	conf := fmt.Sprintf(`logoutput: %[1]s/danted.log
internal: 127.0.0.1 port = %[2]d
external: 127.0.0.1
socksmethod: none
clientmethod: none
user.privileged: root
user.unprivileged: nobody
client pass {
  from: 127.0.0.0/8 to: 0.0.0.0/0
}
socks pass {
  from: 127.0.0.0/8 to: 0.0.0.0/0
}
`, dir, port)
	cf := filepath.Join(dir, "danted.conf")
	if err := os.WriteFile(cf, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	startDaemon(t, dir, addr, "/usr/sbin/danted", "-f", cf, "-N", "1")
	return addr
}

// interopSuite drives both listeners through one real upstream.
func interopSuite(t *testing.T, up *pool.Upstream) {
	echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
	origin, originConns := startOrigin(t, http.HandlerFunc(echoHandler))
	p := newFakePool(up)
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)

	c, br, resp := rawConnect(t, tl.addr, echo, "")
	if resp.StatusCode != 200 {
		t.Fatalf("CONNECT: %d", resp.StatusCode)
	}
	transfer(t, c, br, 4<<20, up.Protocol != pool.HTTP)
	_ = c.Close()

	hc := tl.httpClient(t, "", "")
	dialed := func() int { tl.obs.mu.Lock(); defer tl.obs.mu.Unlock(); return tl.obs.dialed }
	before := dialed()
	for i := range 3 {
		req, _ := http.NewRequest("POST", fmt.Sprintf("http://%s/n%d", origin, i), strings.NewReader("hello"))
		if e := getEcho(t, hc, req); e.URI != fmt.Sprintf("/n%d", i) || e.BodyLen != 5 {
			t.Errorf("origin saw %+v", e)
		}
	}
	// Keep-alive on the upstream hop: one upstream connection for all three.
	if n := dialed() - before; n != 1 {
		t.Errorf("%d upstream dials for 3 keep-alive requests", n)
	}
	t.Logf("origin connections for 3 requests: %d", originConns.Load())

	stl := startListener(t, testConfig(func(c *Config) { c.Protocol = "socks5"; c.AllowDestinations = loopbackAllowed }), p)
	d, _ := proxy.SOCKS5("tcp", stl.addr, nil, proxy.Direct)
	sc, err := d.Dial("tcp", echo)
	if err != nil {
		t.Fatal(err)
	}
	transfer(t, sc, sc, 4<<20, up.Protocol != pool.HTTP)
	_ = sc.Close()
	hc.Transport.(*http.Transport).CloseIdleConnections()
	p.waitBalanced(t)
	for _, r := range p.Reports() {
		if r.res != pool.Success {
			t.Errorf("report %+v", r)
		}
	}
}

func TestSquidUpstream(t *testing.T) {
	checkLeaks(t)
	addr := startSquid(t, "squser", "s:cret")
	up := &pool.Upstream{Service: 1, Protocol: pool.HTTP, Address: addr, Username: "squser", Password: "s:cret"}
	interopSuite(t, up)

	// A WebSocket through Squid (a CONNECT tunnel to the origin).
	wsOrigin := wsEchoServer(t, "bye")
	wtl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), newFakePool(up))
	ws := dialWS(t, wtl.addr, wsOrigin)
	if err := websocket.Message.Send(ws, "hi"); err != nil {
		t.Fatal(err)
	}
	var msg string
	if err := websocket.Message.Receive(ws, &msg); err != nil || msg != "echo:hi" {
		t.Errorf("websocket through Squid: %q %v", msg, err)
	}
	_ = ws.Close()

	// Wrong credentials: auth_rejected, and the next upstream serves.
	bad := &pool.Upstream{Service: 2, Protocol: pool.HTTP, Address: addr, Username: "squser", Password: "nope"}
	echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
	p := newFakePool(bad, up)
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
	c, br, resp := rawConnect(t, tl.addr, echo, "")
	if resp.StatusCode != 200 {
		t.Fatalf("CONNECT: %d", resp.StatusCode)
	}
	transfer(t, c, br, 1000, false)
	_ = c.Close()
	p.waitBalanced(t)
	if r := p.Reports(); len(r) != 2 || r[0].res != pool.AuthRejected || r[1].res != pool.Success {
		t.Errorf("reports %+v", r)
	}
}

// TestSquidDestinationFailure: Squid's own answer for a destination that
// refuses (503 with X-Squid-Error: ERR_CONNECT_FAIL) is the destination's
// failure: passed on as such on every path, never counted against Squid,
// however often it comes.
func TestSquidDestinationFailure(t *testing.T) {
	checkLeaks(t)
	addr := startSquid(t, "squser", "s:cret")
	up := &pool.Upstream{Service: 1, Protocol: pool.HTTP, Address: addr, Username: "squser", Password: "s:cret"}
	dest := deadAddr(t)
	p := newFakePool(up)
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
	stl := startListener(t, testConfig(func(c *Config) { c.Protocol = "socks5"; c.AllowDestinations = loopbackAllowed }), p)
	hc := tl.httpClient(t, "", "")
	for i := range 4 { // more than the pool's default failure threshold
		_, _, resp := rawConnect(t, tl.addr, dest, "")
		if resp.StatusCode != http.StatusBadGateway {
			t.Errorf("CONNECT %d: %d, want 502", i, resp.StatusCode)
		}
		if code := socksDialCode(t, stl.addr, dest); code != socks5.ReplyConnectionRefused {
			t.Errorf("SOCKS5 %d: reply %#x, want connection refused", i, code)
		}
		if code, body := getBody(t, hc, "http://"+dest+"/"); code != http.StatusBadGateway || body != textBadGateway {
			t.Errorf("GET %d: %d %q, want 502", i, code, body)
		}
	}
	hc.Transport.(*http.Transport).CloseIdleConnections()
	p.waitBalanced(t)
	r := p.Reports()
	if len(r) != 12 {
		t.Errorf("%d reports, want 12", len(r))
	}
	for _, rep := range r {
		if rep.res != pool.DestinationError {
			t.Errorf("report %+v, want destination_error", rep)
		}
	}
	waitFor(t, 5*time.Second, func() bool { return len(tl.obs.Closeds())+len(stl.obs.Closeds()) >= 9 }, "closed")
	for _, cl := range append(tl.obs.Closeds(), stl.obs.Closeds()...) {
		if cl.o != OutcomeDestinationError {
			t.Errorf("outcome %s, want destination_error", cl.o)
		}
	}
}

func TestDanteUpstream(t *testing.T) {
	checkLeaks(t)
	addr := startDante(t)
	up := &pool.Upstream{Service: 1, Protocol: pool.SOCKS5, Address: addr}
	interopSuite(t, up)

	// Unreachable destination: Dante's reply code reaches the client, not blamed.
	p := newFakePool(up)
	stl := startListener(t, testConfig(func(c *Config) { c.Protocol = "socks5"; c.AllowDestinations = loopbackAllowed }), p)
	code := socksDialCode(t, stl.addr, deadAddr(t))
	if code < 2 || code > 6 {
		t.Errorf("reply %#x, want a destination code", code)
	}
	p.waitBalanced(t)
	if r := p.Reports(); len(r) != 1 || r[0].res != pool.DestinationError {
		t.Errorf("reports %+v", r)
	}

	// This Dante takes no credentials: given some, proxyd pipelines, Dante
	// refuses the one method offered (username/password), and the same
	// attempt gets the tunnel one message at a time, offering no-auth too.
	echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
	withCreds := &pool.Upstream{Service: 1, Protocol: pool.SOCKS5, Address: addr, Username: "u", Password: "p"}
	p = newFakePool(withCreds)
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
	for range 2 {
		tc, br, resp := rawConnect(t, tl.addr, echo, "")
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("CONNECT through Dante with credentials: %s", resp.Status)
		}
		_, _ = io.WriteString(tc, "ping")
		b := make([]byte, 4)
		if _, err := io.ReadFull(br, b); err != nil || string(b) != "ping" {
			t.Fatalf("echo through Dante %q, %v", b, err)
		}
		tc.Close()
	}
	p.waitBalanced(t)
	if r := p.Reports(); len(r) != 2 || r[0].res != pool.Success || r[1].res != pool.Success {
		t.Errorf("reports %+v, want two successes", r)
	}

	// Dante keeps what comes behind the greeting: a pipelined handshake
	// without credentials opens the tunnel.
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	host, port, _ := splitHostPort(echo, 0)
	if _, err := (socks5.Client{Pipeline: true}).Handshake(c, socks5.Addr{Host: host, Port: port}, "", ""); err != nil {
		t.Fatalf("pipelined handshake with Dante: %v", err)
	}
	_, _ = io.WriteString(c, "ping")
	b := make([]byte, 4)
	if _, err := io.ReadFull(c, b); err != nil || string(b) != "ping" {
		t.Fatalf("echo through Dante %q, %v", b, err)
	}
}
