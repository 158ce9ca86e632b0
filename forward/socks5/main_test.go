package socks5

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"
)

// TestMain fails the run when goroutines started by the tests outlive
// them.
func TestMain(m *testing.M) {
	code := m.Run()
	if code == 0 {
		deadline := time.Now().Add(5 * time.Second)
		for {
			leaked := leakedGoroutines()
			if leaked == nil {
				break
			}
			if time.Now().After(deadline) {
				fmt.Fprintf(os.Stderr, "goroutines leaked:\n\n%s\n", strings.Join(leaked, "\n\n"))
				code = 1
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	os.Exit(code)
}

// leakedGoroutines returns the stacks of goroutines other than this one and
// the runtime's own helpers (the signal loop that fuzzing starts).
func leakedGoroutines() []string {
	buf := make([]byte, 1<<20)
	all := strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n")
	var leaked []string
	for _, g := range all[1:] { // the first is this goroutine
		if strings.Contains(g, "os/signal.signal_recv") {
			continue
		}
		leaked = append(leaked, g)
	}
	return leaked
}
