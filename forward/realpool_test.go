package forward

import (
	"context"
	"net/http"
	"testing"

	"github.com/proxyd/proxyd/pool"
)

// *pool.Pool is what cmd/proxyd hands to NewListener.
var _ Pool = (*pool.Pool)(nil)

// TestWithRealPool runs a listener on the real pool: a dead upstream is
// skipped and reported, and a sticky key stays on its upstream.
func TestWithRealPool(t *testing.T) {
	checkLeaks(t)
	origin, _ := startOrigin(t, http.HandlerFunc(echoHandler))
	echo := startTCP(t, "tcp", "127.0.0.1:0", echoServe)
	a, b := newHTTPUpstream(t, "", "", nil), newHTTPUpstream(t, "", "", nil)
	dead := pool.Upstream{Service: 1, Protocol: pool.HTTP, Address: deadAddr(t)}
	p, err := pool.New(pool.DefaultConfig(), pool.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = p.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	p.SetListeners([]pool.ListenerSlice{{Name: "web"}})
	p.Update([]pool.Upstream{dead, *a.upstream(2), *b.upstream(3)})

	tl := startListener(t, testConfig(func(c *Config) { c.Name = "web"; c.AllowDestinations = loopbackAllowed }), p)
	for range 6 {
		c, br, resp := rawConnect(t, tl.addr, echo, "")
		if resp.StatusCode != 200 {
			t.Fatalf("CONNECT: %d", resp.StatusCode)
		}
		bigTransfer(t, c, br, 100)
	}
	// A sticky key stays on one upstream.
	hc := tl.httpClient(t, "session-pin", "x")
	before := len(a.Targets()) + len(b.Targets())
	for range 4 {
		req, _ := http.NewRequest("GET", "http://"+origin+"/", nil)
		getEcho(t, hc, req)
	}
	na, nb := len(a.Targets()), len(b.Targets())
	if na+nb-before != 4 {
		t.Errorf("%d requests reached the upstreams, want 4", na+nb-before)
	}
	var counts []int
	for _, u := range []*httpUpstream{a, b} {
		n := 0
		for _, tg := range u.Targets() {
			if tg == "http://"+origin+"/" {
				n++
			}
		}
		counts = append(counts, n)
	}
	if counts[0]*counts[1] != 0 || counts[0]+counts[1] != 4 {
		t.Errorf("sticky key spread over upstreams: %v", counts)
	}
	hc.Transport.(*http.Transport).CloseIdleConnections()
	for _, u := range p.Explain().Upstreams {
		if u.Address == dead.Address && u.Failures == 0 {
			t.Errorf("dead upstream has no failures: %+v", u)
		}
		if u.InFlight != 0 {
			t.Logf("in flight %+v", u)
		}
	}
}
