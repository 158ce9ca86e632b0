package syncbuf

import (
	"strings"
	"sync"
	"testing"
)

// Writers and a reader at once (go test -race checks the locking); every
// write arrives whole.
func TestConcurrentWriteAndString(t *testing.T) {
	var b Buffer
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 100 {
				b.Write([]byte("line\n"))
			}
		}()
	}
	for range 100 {
		_ = b.String()
	}
	wg.Wait()
	if got := strings.Count(b.String(), "line\n"); got != 400 {
		t.Fatalf("%d lines, want 400", got)
	}
}
