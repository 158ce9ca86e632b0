//go:build unix

package forward

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/proxyd/proxyd/forward/socks5"
	"github.com/proxyd/proxyd/pool"
)

// fdChildEnv carries the upstream's address to the child process of
// TestAcceptSurvivesFDExhaustion.
const fdChildEnv = "FORWARD_FD_CHILD_UPSTREAM"

// TestAcceptSurvivesFDExhaustion runs both listeners in a child process
// limited to 256 open files, exhausts them with 400 tunnels, releases the
// tunnels, and shows both listeners serving again within 10 s: the accept
// loops back off while descriptors are short and never end.
func TestAcceptSurvivesFDExhaustion(t *testing.T) {
	if os.Getenv(fdChildEnv) != "" {
		t.Skip("in the child process")
	}
	checkLeaks(t)
	echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
	up := newHTTPUpstream(t, "", "", nil)

	cmd := exec.Command(os.Args[0], "-test.run=^TestFDExhaustionChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), fdChildEnv+"="+up.ln.Addr().String())
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// The child's first line names its listeners; the rest of its output
	// (its test log) is kept for failure messages.
	var (
		outMu sync.Mutex
		out   bytes.Buffer
	)
	output := func() string {
		outMu.Lock()
		defer outMu.Unlock()
		return out.String() + stderr.String()
	}
	line := make(chan string, 1)
	exited := make(chan error, 1)
	go func() {
		br := bufio.NewReader(stdout)
		l, _ := br.ReadString('\n')
		line <- strings.TrimSpace(l)
		b := make([]byte, 4096)
		for {
			n, err := br.Read(b)
			outMu.Lock()
			out.Write(b[:n])
			outMu.Unlock()
			if err != nil {
				break
			}
		}
		exited <- cmd.Wait()
	}()
	defer func() {
		_ = stdin.Close() // the child shuts its listeners down and exits
		select {
		case err := <-exited:
			if err != nil {
				t.Errorf("child: %v\n%s", err, output())
			}
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
			t.Errorf("child did not exit\n%s", output())
		}
	}()
	var httpAddr, socksAddr string
	select {
	case l := <-line:
		if _, err := fmt.Sscanf(l, "listening %s %s", &httpAddr, &socksAddr); err != nil {
			t.Fatalf("child said %q: %v\n%s", l, err, output())
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("child did not start\n%s", output())
	}

	connectTunnel := func(deadline time.Duration) (net.Conn, error) {
		c, err := net.DialTimeout("tcp", httpAddr, deadline)
		if err != nil {
			return nil, err
		}
		_ = c.SetDeadline(time.Now().Add(deadline))
		fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", echo, echo)
		resp, err := http.ReadResponse(bufio.NewReader(c), &http.Request{Method: http.MethodConnect})
		if err == nil && resp.StatusCode != 200 {
			err = fmt.Errorf("CONNECT: %d", resp.StatusCode)
		}
		return c, err
	}
	socksTunnel := func(deadline time.Duration) (net.Conn, error) {
		c, err := net.DialTimeout("tcp", socksAddr, deadline)
		if err != nil {
			return nil, err
		}
		_ = c.SetDeadline(time.Now().Add(deadline))
		host, port, _ := splitHostPort(echo, 0)
		_, err = socks5.ClientHandshake(c, socks5.Addr{Host: host, Port: port}, "", "")
		return c, err
	}
	echoes := func(c net.Conn) bool {
		_ = c.SetDeadline(time.Now().Add(2 * time.Second))
		if _, err := io.WriteString(c, "ping"); err != nil {
			return false
		}
		b := make([]byte, 4)
		_, err := io.ReadFull(c, b)
		return err == nil && string(b) == "ping"
	}

	// 400 tunnels at once, half on each listener: far more than 256 files.
	var (
		mu    sync.Mutex
		conns []net.Conn
		ok    int
		wg    sync.WaitGroup
	)
	for i := range 400 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			open := connectTunnel
			if i%2 == 1 {
				open = socksTunnel
			}
			c, err := open(3 * time.Second)
			mu.Lock()
			defer mu.Unlock()
			if c != nil {
				conns = append(conns, c)
			}
			if err == nil {
				ok++
			}
		}()
	}
	wg.Wait()
	t.Logf("%d of 400 tunnels opened under the limit", ok)
	if ok >= 400 {
		t.Errorf("all 400 tunnels opened: the limit was not reached")
	}
	for _, c := range conns {
		_ = c.Close()
	}

	// Both listeners serve again within 10 s.
	for _, l := range []struct {
		name string
		open func(time.Duration) (net.Conn, error)
	}{{"http", connectTunnel}, {"socks5", socksTunnel}} {
		deadline := time.Now().Add(10 * time.Second)
		var lastErr error
		for {
			c, err := l.open(time.Second)
			if err == nil && echoes(c) {
				_ = c.Close()
				break
			}
			if c != nil {
				_ = c.Close()
			}
			lastErr = err
			if time.Now().After(deadline) {
				t.Fatalf("%s listener not serving 10 s after the tunnels were released: %v\n%s", l.name, lastErr, output())
			}
			time.Sleep(100 * time.Millisecond) // the next try, not a wait for a condition we could watch
		}
	}
	select {
	case err := <-exited:
		t.Fatalf("child exited early: %v\n%s", err, output())
	default:
	}
}

// TestFDExhaustionChild is the child process of
// TestAcceptSurvivesFDExhaustion: both listeners, at most 256 open files,
// until stdin closes.
func TestFDExhaustionChild(t *testing.T) {
	upAddr := os.Getenv(fdChildEnv)
	if upAddr == "" {
		t.Skip("run by TestAcceptSurvivesFDExhaustion")
	}
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	lim.Cur = 256
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	p := newFakePool(&pool.Upstream{Service: 1, Protocol: pool.HTTP, Address: upAddr})
	hl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
	sl := startListener(t, testConfig(func(c *Config) { c.Protocol = ProtocolSOCKS5; c.AllowDestinations = loopbackAllowed }), p)
	fmt.Printf("listening %s %s\n", hl.addr, sl.addr)
	_, _ = io.Copy(io.Discard, os.Stdin)
}
