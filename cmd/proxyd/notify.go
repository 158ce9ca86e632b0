package main

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"time"
)

// notifier speaks the systemd notify protocol (sd_notify(3)) on
// $NOTIFY_SOCKET. Without the variable every call is a no-op, so the daemon
// runs the same outside systemd.
type notifier struct {
	addr    *net.UnixAddr
	timeout time.Duration // bound on one send (notifyTimeout)
	mu      sync.Mutex    // orders READY=1 and STOPPING=1
	stopped bool          // STOPPING=1 was sent: no READY=1 after it (guarded by mu)
}

func newNotifier(getenv func(string) string) *notifier {
	path := getenv("NOTIFY_SOCKET")
	if path == "" {
		return &notifier{}
	}
	if strings.HasPrefix(path, "@") { // abstract namespace
		path = "\x00" + path[1:]
	}
	return &notifier{addr: &net.UnixAddr{Name: path, Net: "unixgram"}, timeout: notifyTimeout}
}

// notifyTimeout bounds one message to systemd. A datagram blocks while
// systemd's notify socket is full (systemd not reading it, a stalled
// manager): without a bound READY=1 would hold a reload and STOPPING=1 the
// drain. When it fires the fault is systemd's, and the daemon goes on.
const notifyTimeout = 2 * time.Second

func (n *notifier) enabled() bool { return n.addr != nil }

// send writes one datagram of newline-separated assignments.
func (n *notifier) send(state ...string) error {
	if n.addr == nil {
		return nil
	}
	conn, err := net.DialUnix("unixgram", nil, n.addr)
	if err != nil {
		return fmt.Errorf("notifying systemd: %w", err)
	}
	defer conn.Close()
	_ = conn.SetWriteDeadline(time.Now().Add(n.timeout))
	if _, err := conn.Write([]byte(strings.Join(state, "\n"))); err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return fmt.Errorf("notifying systemd: $NOTIFY_SOCKET took nothing within %s (systemd is not reading it)", n.timeout)
		}
		return fmt.Errorf("notifying systemd: %w", err)
	}
	return nil
}

// ready is READY=1, unless the service is already stopping: a reload that
// SIGTERM overtook ends its RELOADING=1 this way, and READY=1 after
// STOPPING=1 would tell systemd the service runs again.
func (n *notifier) ready() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.stopped {
		return nil
	}
	return n.send("READY=1")
}

// reloading must carry MONOTONIC_USEC (CLOCK_MONOTONIC) for systemd to
// accept it.
func (n *notifier) reloading() error {
	if !n.enabled() {
		return nil
	}
	usec, err := monotonicUsec()
	if err != nil {
		return fmt.Errorf("reading the monotonic clock: %w", err)
	}
	return n.send("RELOADING=1", fmt.Sprintf("MONOTONIC_USEC=%d", usec))
}

// stopping tells systemd that the service is stopping and will be done
// within the given time. EXTEND_TIMEOUT_USEC lets a drain_timeout longer
// than the unit's TimeoutStopSec run to its end instead of being killed
// (systemd only ever lengthens the stop with it, never shortens it).
func (n *notifier) stopping(within time.Duration) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.stopped = true
	return n.send("STOPPING=1", fmt.Sprintf("EXTEND_TIMEOUT_USEC=%d", within.Microseconds()))
}

func (n *notifier) watchdog() error { return n.send("WATCHDOG=1") }

// watchdogInterval returns half of $WATCHDOG_USEC when the watchdog is on
// for this process, else 0.
func watchdogInterval(getenv func(string) string) time.Duration {
	usec := getenv("WATCHDOG_USEC")
	if usec == "" {
		return 0
	}
	if pid := getenv("WATCHDOG_PID"); pid != "" && pid != fmt.Sprint(os.Getpid()) {
		return 0
	}
	var n int64
	if _, err := fmt.Sscan(usec, &n); err != nil || n <= 0 {
		return 0
	}
	return time.Duration(n) * time.Microsecond / 2
}
