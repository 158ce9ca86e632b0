package freeport

import (
	"net"
	"runtime"
	"strconv"
	"testing"
)

func TestPortIsFreeOutsideTheEphemeralRangeAndNeverRepeated(t *testing.T) {
	top, ok := below()
	if runtime.GOOS == "linux" && !ok {
		// Then Port would hand out the kernel's picks, the race it exists to avoid.
		t.Fatalf("ephemeral range start %d: not read, or too low to stay below", top)
	}
	seen := map[int]bool{}
	for range 50 {
		p := Port(t)
		if seen[p] {
			t.Fatalf("port %d handed out twice", p)
		}
		seen[p] = true
		if ok && (p < lowest || p >= top) {
			t.Fatalf("port %d outside [%d, %d)", p, lowest, top)
		}
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			t.Fatalf("port %d not free: %v", p, err)
		}
		ln.Close()
	}
}
