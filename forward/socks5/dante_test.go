//go:build linux

package socks5

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/proxyd/proxyd/internal/freeport"
	"github.com/proxyd/proxyd/internal/syncbuf"
)

const dantedPath = "/usr/sbin/danted"

// startDante runs Debian's Dante server in the foreground on a free
// loopback port, with method none, CONNECT allowed from loopback to
// anywhere except 127.0.0.2 (blocked, to get reply 0x02). It is killed and
// reaped at cleanup. Missing danted skips, unless CI=true.
func startDante(t *testing.T) string {
	t.Helper()
	if _, err := os.Stat(dantedPath); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("Dante is required under CI=true: %v", err)
		}
		t.Skipf("Dante not installed: %v", err)
	}
	port := freeport.Port(t)
	dir := t.TempDir()
	var users string
	if os.Geteuid() == 0 {
		// As root Dante insists on named users for its privilege switches.
		users = "user.privileged: root\nuser.unprivileged: nobody\n"
	}
	conf := fmt.Sprintf(`logoutput: stderr
internal: 127.0.0.1 port = %d
external: 127.0.0.1
clientmethod: none
socksmethod: none
%s
client pass {
	from: 127.0.0.0/8 to: 0.0.0.0/0
}
socks block {
	from: 0.0.0.0/0 to: 127.0.0.2/32
}
socks pass {
	from: 127.0.0.0/8 to: 0.0.0.0/0
	command: connect
	protocol: tcp
}
`, port, users)
	confPath := filepath.Join(dir, "danted.conf")
	if err := os.WriteFile(confPath, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	// danted's mother does not wait for its children when it ends; as a
	// subreaper this test process inherits them and reaps them at cleanup
	// instead of leaving zombies to PID 1. (Process-wide, harmless in a test.)
	const prSetChildSubreaper = 36 // linux/prctl.h
	if _, _, errno := syscall.RawSyscall(syscall.SYS_PRCTL, prSetChildSubreaper, 1, 0); errno != 0 {
		t.Logf("prctl(PR_SET_CHILD_SUBREAPER): %v", errno)
	}
	// Foreground is danted's default (-D would daemonize); -N 1: one server
	// process. Its own process group lets cleanup end the children it forks.
	cmd := exec.Command(dantedPath, "-f", confPath, "-N", "1", "-p", filepath.Join(dir, "danted.pid"))
	var stderr syncbuf.Buffer
	cmd.Stdout, cmd.Stderr = &stderr, &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting danted: %v", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		// The mother process ends its children on SIGTERM.
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(5 * time.Second):
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-exited
		}
		// Children of danted in its group that outlived it: end and reap them.
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		for {
			if _, err := syscall.Wait4(-cmd.Process.Pid, nil, 0, nil); err != nil && err != syscall.EINTR {
				break // ECHILD: none left
			}
		}
	})

	addr := fmt.Sprintf("127.0.0.1:%d", port)
	deadline := time.Now().Add(testDeadline)
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			return addr
		}
		select {
		case err := <-exited:
			exited <- err // for cleanup
			t.Fatalf("danted exited before accepting: %v\n%s", err, stderr.String())
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("danted did not accept on %s in time:\n%s", addr, stderr.String())
		}
	}
}

func TestInteropDante(t *testing.T) {
	dante := startDante(t)
	_, port := startOrigin(t)
	dial := func(t *testing.T) net.Conn {
		c, err := net.DialTimeout("tcp", dante, testDeadline)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		c.SetDeadline(time.Now().Add(testDeadline))
		return c
	}
	get := func(t *testing.T, c net.Conn) {
		io.WriteString(c, "GET / HTTP/1.0\r\nHost: origin.test\r\n\r\n")
		b, err := io.ReadAll(c)
		if err != nil || !strings.Contains(string(b), "hello from origin, host origin.test") {
			t.Fatalf("response %q, %v", b, err)
		}
	}

	okCases := []struct {
		name       string
		client     Client
		dest       Addr
		user, pass string
	}{
		{"ipv4", Client{}, Addr{"127.0.0.1", mustPort(port)}, "", ""},
		{"domain resolved by dante", Client{}, Addr{"localhost", mustPort(port)}, "", ""},
		{"credentials offered, none selected", Client{}, Addr{"127.0.0.1", mustPort(port)}, "session-x", "p"},
		{"pipelined", Client{Pipeline: true}, Addr{"localhost", mustPort(port)}, "", ""},
	}
	for _, c := range okCases {
		t.Run(c.name, func(t *testing.T) {
			conn := dial(t)
			bound, err := c.client.Handshake(conn, c.dest, c.user, c.pass)
			if err != nil {
				t.Fatal(err)
			}
			if bound.Host != "127.0.0.1" || bound.Port == 0 {
				t.Errorf("bound = %v, want 127.0.0.1:port", bound)
			}
			get(t, conn)
		})
	}

	failCases := []struct {
		name string
		dest Addr
		code byte
	}{
		{"refused port", Addr{"127.0.0.1", uint16(freeport.Port(t))}, ReplyConnectionRefused},
		{"blocked by rule", Addr{"127.0.0.2", mustPort(port)}, ReplyNotAllowed},
	}
	for _, c := range failCases {
		t.Run(c.name, func(t *testing.T) {
			_, err := ClientHandshake(dial(t), c.dest, "", "")
			var re *ReplyError
			if !errors.As(err, &re) {
				t.Fatalf("err = %v, want *ReplyError", err)
			}
			if re.Code != c.code || !re.DestinationFault() {
				t.Fatalf("reply %v (destination fault %v), want %s", re, re.DestinationFault(), ReplyText(c.code))
			}
		})
	}
}
