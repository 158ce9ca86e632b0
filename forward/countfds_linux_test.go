package forward

import (
	"os"
	"testing"
)

// countFDs returns the number of file descriptors the process has open.
func countFDs(t testing.TB) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatalf("reading fds: %v", err)
	}
	return len(ents)
}
