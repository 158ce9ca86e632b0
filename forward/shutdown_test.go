package forward

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/proxyd/proxyd/pool"
)

// TestShutdownServesJustAcceptedConnection: a client that connected just
// before Shutdown and sends its request a moment after still gets its
// answer (net/http alone would drop a request it reads after Shutdown began).
func TestShutdownServesJustAcceptedConnection(t *testing.T) {
	upstreamKinds(t, nil, func(t *testing.T, up *pool.Upstream, _ func() []string) {
		origin, _ := startOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "hello") }))
		tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), newFakePool(up))
		c, err := net.Dial("tcp", tl.addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		waitFor(t, 5*time.Second, func() bool { return tl.fresh.Load() == 1 }, "the connection registered as fresh")

		done := tl.shutdownAsync()
		waitFor(t, 5*time.Second, tl.stopping.Load, "Shutdown to begin")

		c.SetDeadline(time.Now().Add(5 * time.Second))
		fmt.Fprintf(c, "GET http://%s/ HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", origin, origin)
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatalf("request sent after Shutdown began: %v", err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || string(body) != "hello" {
			t.Fatalf("answer %d %q", resp.StatusCode, body)
		}
		if err := <-done; err != nil {
			t.Errorf("Shutdown: %v", err)
		}
		if n := tl.fresh.Load(); n != 0 {
			t.Errorf("%d connections still counted fresh", n)
		}
	})
}
