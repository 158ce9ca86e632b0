package main

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/proxyd/proxyd/agent/providersim"
	"github.com/proxyd/proxyd/internal/freeport"
)

// sd_notify and the CLOCK_MONOTONIC it is stamped with are systemd's, so
// Linux's (notify_linux.go).

// notifySocket collects sd_notify datagrams.
type notifySocket struct {
	conn  *net.UnixConn
	msgs  chan string
	pings atomic.Int64
}

func newNotifySocket(t *testing.T) (*notifySocket, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "notify.sock")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	n := &notifySocket{conn: conn, msgs: make(chan string, 64)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 4096)
		for {
			k, err := conn.Read(buf)
			if err != nil {
				close(n.msgs)
				return
			}
			n.msgs <- string(buf[:k])
		}
	}()
	t.Cleanup(func() { conn.Close(); <-done })
	return n, path
}

// expect waits for the next datagram other than a watchdog ping and checks
// it starts with want; watchdog pings are counted.
func (n *notifySocket) expect(t *testing.T, want string) string {
	t.Helper()
	timeout := time.After(15 * time.Second)
	for {
		select {
		case m := <-n.msgs:
			if m == "WATCHDOG=1" && want != m {
				n.pings.Add(1)
				continue
			}
			if !strings.HasPrefix(m, want) {
				t.Fatalf("sd_notify: got %q, want %q", m, want)
			}
			return m
		case <-timeout:
			t.Fatalf("sd_notify: no %q within 15s", want)
		}
	}
}

func writeConfig(t *testing.T, path string, w *demoWorld, state string, listeners ...[2]string) {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "[api]\nbase_url = %q\nservices = [101, 102]\n\n", w.simURL)
	fmt.Fprintf(&b, "[poll]\nnetwork_status = \"1s\"\nusage = \"1s\"\nmax_backoff = \"2s\"\n\n")
	fmt.Fprintf(&b, "[state]\ndir = %q\n\n[admin]\naddress = \"\"\n\n[shutdown]\ndrain_timeout = \"20s\"\n\n", state)
	for _, l := range listeners {
		fmt.Fprintf(&b, "[[listener]]\nname = %q\nprotocol = \"http\"\naddress = %q\nallow_destinations = [\"127.0.0.0/8\"]\n\n", l[0], l[1])
	}
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
}

// slowOrigin accepts one connection, waits for a "go" line, then sends size
// bytes and closes.
func slowOrigin(t *testing.T, size int) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		br := bufio.NewReader(c)
		if _, err := br.ReadString('\n'); err != nil {
			return
		}
		c.Write(bytes.Repeat([]byte("x"), size))
	}()
	t.Cleanup(func() { ln.Close(); <-done })
	return ln.Addr().String()
}

// TestDaemonSignals runs the real binary: sd_notify READY=1, SIGHUP with a
// good config (a new listener) and with bad ones, then SIGTERM while a
// tunnel is open: the tunnel finishes its transfer and proxyd exits 0.
func TestDaemonSignals(t *testing.T) {
	bin := proxydBinary(t)
	w := newWorld(t)
	notify, sock := newNotifySocket(t)
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "config.toml")
	httpAddr := freeport.Addr(t)
	writeConfig(t, cfgPath, w, filepath.Join(dir, "state"), [2]string{"http", httpAddr})

	cmd, stderr, exited := runBinary(t, bin, cfgPath, "PROXYD_API_TOKEN="+providersim.DefaultToken, "NOTIFY_SOCKET="+sock,
		"WATCHDOG_USEC=400000") // pings every 200ms while the loops are alive
	notify.expect(t, "READY=1")
	notify.expect(t, "WATCHDOG=1") // and again: the pings go on
	notify.expect(t, "WATCHDOG=1")

	through := func(addr string) error {
		c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{Proxy: http.ProxyURL(mustURL("http://" + addr)), DisableKeepAlives: true}}
		var err error
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			var resp *http.Response
			resp, err = c.Get("http://" + w.origin + "/")
			if err == nil {
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode == 200 {
					return nil
				}
				err = fmt.Errorf("status %d", resp.StatusCode)
			}
			time.Sleep(50 * time.Millisecond)
		}
		return err
	}
	if err := through(httpAddr); err != nil {
		t.Fatalf("first request: %v", err)
	}
	// An API outage must not stop the watchdog pings: they follow the
	// loops' heartbeats, not successful polls.
	// The status and usage loops poll every second; for 2.5s they fail.
	before := w.sim.Requests("/api/networkstatus/errors/{id}")
	w.sim.FailNext(1<<30, 500, "down")
	for range 12 { // one every 200ms
		notify.expect(t, "WATCHDOG=1")
	}
	if w.sim.Requests("/api/networkstatus/errors/{id}") == before {
		t.Error("no poll ran during the outage: the test proves nothing")
	}

	// An open tunnel that must survive reloads and a drain.
	const size = 4 << 20
	originAddr := slowOrigin(t, size)
	tunnel, err := net.Dial("tcp", httpAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer tunnel.Close()
	fmt.Fprintf(tunnel, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", originAddr, originAddr)
	br := bufio.NewReader(tunnel)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("CONNECT: %v %v", resp, err)
	}

	// SIGHUP with a good config: a second listener appears.
	second := freeport.Addr(t)
	writeConfig(t, cfgPath, w, filepath.Join(dir, "state"), [2]string{"http", httpAddr}, [2]string{"extra", second})
	sent := clockMonotonicUsec(t)
	cmd.Process.Signal(syscall.SIGHUP)
	m := notify.expect(t, "RELOADING=1")
	// The clock systemd compares with: CLOCK_MONOTONIC in microseconds,
	// read by the daemon between the signal and the message.
	got, ok := monotonicField(m)
	now := clockMonotonicUsec(t)
	if !ok || got < sent || got > now {
		t.Errorf("RELOADING=1 with MONOTONIC_USEC %d (found %v), want between %d and %d: %q", got, ok, sent, now, m)
	}
	notify.expect(t, "READY=1")
	if err := through(second); err != nil {
		t.Fatalf("new listener after reload: %v", err)
	}

	// SIGHUP with bad configs: logged, the old config kept.
	for _, bad := range []string{"[api\nbroken", "[api]\nbase_url = \"http://x\"\ntokn = \"typo\"\n"} {
		os.WriteFile(cfgPath, []byte(bad), 0o644)
		cmd.Process.Signal(syscall.SIGHUP)
		notify.expect(t, "RELOADING=1")
		notify.expect(t, "READY=1")
		if err := through(httpAddr); err != nil {
			t.Fatalf("after a bad reload: %v", err)
		}
		if err := through(second); err != nil {
			t.Fatalf("after a bad reload, the second listener: %v", err)
		}
	}
	waitFor(t, "the reload errors in the log", 5*time.Second, func() bool {
		return strings.Contains(stderr.String(), "reload refused") && strings.Contains(stderr.String(), "tokn: unknown key")
	})

	// SIGTERM with the tunnel open: stop accepting, let it finish.
	cmd.Process.Signal(syscall.SIGTERM)
	m = notify.expect(t, "STOPPING=1")
	// The unit's TimeoutStopSec (45s) would cut a longer drain_timeout:
	// the stop asks systemd for the drain (20s here) and the margin.
	if want := "EXTEND_TIMEOUT_USEC=30000000"; !slices.Contains(strings.Split(m, "\n"), want) {
		t.Errorf("STOPPING=1 without %s: %q", want, m)
	}
	waitFor(t, "the listener to stop accepting", 5*time.Second, func() bool {
		c, err := net.DialTimeout("tcp", httpAddr, time.Second)
		if err != nil {
			return true
		}
		c.Close()
		return false
	})
	// The drain is no stuck loop: the watchdog pings go on through it.
	notify.expect(t, "WATCHDOG=1")
	notify.expect(t, "WATCHDOG=1")
	fmt.Fprintf(tunnel, "go\n")
	n, err := io.Copy(io.Discard, br)
	if err != nil || n != size {
		t.Fatalf("tunnel transfer after SIGTERM: %d of %d bytes, %v", n, size, err)
	}
	tunnel.Close() // the client's half: the tunnel is over
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("proxyd exited with %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("proxyd did not exit after the tunnel closed")
	}
}

// monotonicField is the MONOTONIC_USEC value of an sd_notify message.
func monotonicField(m string) (int64, bool) {
	for _, line := range strings.Split(m, "\n") {
		if v, ok := strings.CutPrefix(line, "MONOTONIC_USEC="); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}

// clockMonotonicUsec reads CLOCK_MONOTONIC in microseconds on its own, so
// that the test does not trust the daemon's monotonicUsec.
func clockMonotonicUsec(t *testing.T) int64 {
	t.Helper()
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		t.Fatal(err)
	}
	return int64(ts.Sec)*1_000_000 + int64(ts.Nsec)/1_000
}

// Once STOPPING=1 is sent, READY=1 is not: a reload that SIGTERM overtook
// ends without telling systemd the service runs again.
func TestNotifierNoReadyAfterStopping(t *testing.T) {
	sock, path := newNotifySocket(t)
	n := newNotifier(func(k string) string { return map[string]string{"NOTIFY_SOCKET": path}[k] })
	if err := n.reloading(); err != nil {
		t.Fatal(err)
	}
	sock.expect(t, "RELOADING=1")
	if err := n.stopping(time.Second); err != nil {
		t.Fatal(err)
	}
	sock.expect(t, "STOPPING=1")
	if err := n.ready(); err != nil {
		t.Fatal(err)
	}
	if err := n.send("STATUS=after"); err != nil { // a datagram known to follow
		t.Fatal(err)
	}
	if m := sock.expect(t, ""); m != "STATUS=after" {
		t.Errorf("after STOPPING=1: %q", m)
	}
}

// A notify socket nobody reads fills up, and then a datagram to it waits
// for room; the notifier gives up after its bound and says whose fault it
// is, so READY=1 cannot hold a reload nor STOPPING=1 a drain.
func TestNotifierSendIsBounded(t *testing.T) {
	path := filepath.Join(t.TempDir(), "notify.sock")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close() // never read
	n := newNotifier(func(k string) string { return map[string]string{"NOTIFY_SOCKET": path}[k] })
	n.timeout = 200 * time.Millisecond
	for i := 0; i < 1<<17; i++ {
		start := time.Now()
		err := n.send("STATUS=filling")
		if took := time.Since(start); took > n.timeout+2*time.Second {
			t.Fatalf("send %d took %s, bound %s", i, took, n.timeout)
		}
		if err == nil {
			continue
		}
		if !strings.Contains(err.Error(), "took nothing within 200ms (systemd is not reading it)") {
			t.Fatalf("send %d: %v", i, err)
		}
		if err := n.stopping(time.Second); err == nil {
			t.Fatal("STOPPING=1 to a full socket: no error")
		}
		return
	}
	t.Fatal("the notify socket never filled")
}
