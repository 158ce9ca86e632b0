package freeport

import (
	"net"
	"strconv"
	"testing"
)

func TestPortIsFreeOutsideTheEphemeralRangeAndNeverRepeated(t *testing.T) {
	top := ephemeralStart()
	seen := map[int]bool{}
	for range 50 {
		p := Port(t)
		if seen[p] {
			t.Fatalf("port %d handed out twice", p)
		}
		seen[p] = true
		if top > lowest+1000 && (p < lowest || p >= top) {
			t.Fatalf("port %d outside [%d, %d)", p, lowest, top)
		}
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			t.Fatalf("port %d not free: %v", p, err)
		}
		ln.Close()
	}
}
