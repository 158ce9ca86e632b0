package forward

import (
	"sync/atomic"
	"testing"
)

// Large relay buffers are rationed per listener and every one taken is
// given back.
func TestRelayLargeBufferRation(t *testing.T) {
	var large atomic.Int64
	tu := &tunnel{large: &large}
	small := relayBufs.Get().(*[]byte)
	got := tu.grow(small)
	if len(*got) != relayLargeBufSize || large.Load() != 1 {
		t.Fatalf("grow under the ration: %d bytes, %d in use", len(*got), large.Load())
	}
	tu.putBuf(got)
	if large.Load() != 0 {
		t.Fatalf("%d large buffers in use after putBuf", large.Load())
	}
	large.Store(maxLargeBufs)
	small = relayBufs.Get().(*[]byte)
	if got := tu.grow(small); got != small || large.Load() != maxLargeBufs {
		t.Fatalf("grow past the ration must keep the small buffer (%d in use)", large.Load())
	}
	tu.putBuf(small)
	if large.Load() != maxLargeBufs {
		t.Fatalf("a small buffer changed the ration: %d", large.Load())
	}
}
