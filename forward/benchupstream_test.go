package forward

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/proxyd/proxyd/forward/socks5"
	"github.com/proxyd/proxyd/pool"
)

// The benchmarks' upstream and their reference forwarder, ref. Both relay
// tunnels as Squid, Dante, the provider's gateways and the external rig do:
// io.Copy between two *net.TCPConn each way, which splices on Linux, so
// that no byte passes through user memory. The test upstreams of
// testutil_test.go copy through 32 KiB buffers instead (splicing would
// leave pipes in the runtime's cache that the tests' fd-leak checks count);
// a direct baseline through them is slower than through a real upstream and
// flatters proxyd. The benchmarks check no leaks, so they use these.
//
// The two share their serving code and differ in how they open a tunnel and
// where plain requests go: the upstream dials the destination and sends
// plain requests to the origin, ref opens a CONNECT tunnel through the
// upstream (for its SOCKS5 listener too, as the rig's ref does) and sends
// plain requests through the upstream with one pooled keep-alive
// http.Transport. Neither asks for credentials: proxyd's listeners in the
// benchmarks use none, and checking them would only add the same work to
// every target.

const (
	// benchHandshakeTimeout bounds a dial, a request head and a SOCKS5 or
	// CONNECT handshake.
	benchHandshakeTimeout = 10 * time.Second
	// benchIdleTimeout bounds the wait for a kept connection's next request,
	// as Squid's client_idle_pconn_timeout does (2 minutes by default).
	// Tunnels have no idle bound: the listeners' cleanup closes them.
	benchIdleTimeout = 2 * time.Minute
	// benchMaxIdle is how many kept connections a forwarder's transport
	// holds per host: more than any load's concurrency, so that plain
	// requests never pay a new connection onward.
	benchMaxIdle = 1024
)

// proxyAddrs are the addresses of a forwarder's HTTP and SOCKS5 listeners.
type proxyAddrs struct{ http, socks5 string }

// of is the address of the listener that speaks protocol.
func (a proxyAddrs) of(protocol pool.Protocol) string {
	if protocol == pool.SOCKS5 {
		return a.socks5
	}
	return a.http
}

// upstream is the pool entry that sends proxyd's protocol listener to a.
func (a proxyAddrs) upstream(protocol pool.Protocol) *pool.Upstream {
	return &pool.Upstream{Service: 1, Protocol: protocol, Address: a.of(protocol)}
}

// startBenchUpstream runs the benchmarks' upstream on loopback until the
// benchmark ends.
func startBenchUpstream(tb testing.TB) proxyAddrs {
	tr := &http.Transport{MaxIdleConnsPerHost: benchMaxIdle, DisableCompression: true}
	tb.Cleanup(tr.CloseIdleConnections)
	return startForwarder(tb, dialDirect, tr)
}

// startBenchRef runs ref, a plain forwarder to the upstream's HTTP listener
// at upstreamHTTP, on loopback until the benchmark ends: the bar a careful
// minimal Go forwarder sets on the same machine.
func startBenchRef(tb testing.TB, upstreamHTTP string) proxyAddrs {
	tr := &http.Transport{
		Proxy:               http.ProxyURL(&url.URL{Scheme: "http", Host: upstreamHTTP}),
		MaxIdleConnsPerHost: benchMaxIdle,
		DisableCompression:  true,
	}
	tb.Cleanup(tr.CloseIdleConnections)
	return startForwarder(tb, connectVia(upstreamHTTP), tr)
}

// tunnelDialer opens a tunnel to dest and returns it with the bytes of the
// tunnel that came along with the handshake.
type tunnelDialer func(dest string) (conn *net.TCPConn, early []byte, err error)

// startForwarder serves an HTTP and a SOCKS5 listener that open tunnels with
// dial and send plain requests through tr. startTCP closes the listeners
// and every connection, and waits for their handlers, at cleanup (before
// the transport's cleanup, registered earlier, closes its kept connections).
func startForwarder(tb testing.TB, dial tunnelDialer, tr http.RoundTripper) proxyAddrs {
	return proxyAddrs{
		http:   startTCP(tb, "tcp", "127.0.0.1:0", func(c net.Conn) { serveProxyHTTP(c.(*net.TCPConn), dial, tr) }),
		socks5: startTCP(tb, "tcp", "127.0.0.1:0", func(c net.Conn) { serveProxySOCKS5(c.(*net.TCPConn), dial) }),
	}
}

// dialDirect connects to dest itself: the upstream's tunnelDialer.
func dialDirect(dest string) (*net.TCPConn, []byte, error) {
	c, err := net.DialTimeout("tcp", dest, benchHandshakeTimeout)
	if err != nil {
		return nil, nil, err
	}
	return c.(*net.TCPConn), nil, nil
}

// connectVia opens tunnels through the HTTP proxy at proxyAddr with CONNECT:
// ref's tunnelDialer.
func connectVia(proxyAddr string) tunnelDialer {
	return func(dest string) (*net.TCPConn, []byte, error) {
		c, _, err := dialDirect(proxyAddr)
		if err != nil {
			return nil, nil, err
		}
		_ = c.SetDeadline(time.Now().Add(benchHandshakeTimeout))
		br := bufio.NewReader(c)
		_, err = fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", dest, dest)
		var resp *http.Response
		if err == nil {
			resp, err = http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
		}
		if err == nil && resp.StatusCode != http.StatusOK {
			err = fmt.Errorf("CONNECT %s: %s", dest, resp.Status)
		}
		if err != nil {
			_ = c.Close()
			return nil, nil, err
		}
		_ = c.SetDeadline(time.Time{})
		// A destination that speaks first can have its bytes in the same
		// segment as the answer's head.
		early, _ := br.Peek(br.Buffered())
		return c, early, nil
	}
}

// serveProxyHTTP serves one client connection of an HTTP proxy: a CONNECT
// becomes a tunnel, absolute-URI requests are forwarded through tr, as
// many as the client sends on the connection.
func serveProxyHTTP(c *net.TCPConn, dial tunnelDialer, tr http.RoundTripper) {
	br := bufio.NewReader(c)
	bw := bufio.NewWriter(c)
	for {
		_ = c.SetReadDeadline(time.Now().Add(benchIdleTimeout))
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		_ = c.SetReadDeadline(time.Time{})
		if req.Method != http.MethodConnect {
			if !forwardPlain(bw, req, tr) {
				return
			}
			continue
		}
		d, early, err := dial(req.RequestURI)
		if err != nil {
			writeRawError(c, http.StatusBadGateway, "", "")
			return
		}
		// What the client sent after its head belongs to the tunnel.
		ahead, _ := br.Peek(br.Buffered())
		err = writeAll(c, append([]byte("HTTP/1.1 200 Connection established\r\n\r\n"), early...))
		if err == nil {
			err = writeAll(d, ahead)
		}
		if err != nil {
			_ = d.Close()
			return
		}
		spliceRelay(c, d)
		return
	}
}

// forwardPlain forwards an absolute-URI request through tr and writes the
// answer to bw. It reports whether the client connection stays open. The
// connection onward is kept whether or not the client keeps its own, as
// Squid keeps its server connections.
func forwardPlain(bw *bufio.Writer, req *http.Request, tr http.RoundTripper) bool {
	closeAfter := req.Close
	req.RequestURI = ""
	req.Close = false
	stripHop(req.Header, false)
	resp, err := tr.RoundTrip(req)
	if err != nil {
		writeRawError(bw, http.StatusBadGateway, "", "")
		_ = bw.Flush()
		return false
	}
	defer resp.Body.Close()
	stripHop(resp.Header, false)
	resp.Close = closeAfter
	return resp.Write(bw) == nil && bw.Flush() == nil && !closeAfter
}

// writeAll writes b unless it is empty: an empty write is still a system
// call, and most tunnels have nothing to pass on at their start.
func writeAll(w io.Writer, b []byte) error {
	if len(b) == 0 {
		return nil
	}
	_, err := w.Write(b)
	return err
}

// serveProxySOCKS5 serves one client connection of a SOCKS5 proxy without
// authentication: CONNECT only.
func serveProxySOCKS5(c *net.TCPConn, dial tunnelDialer) {
	_ = c.SetDeadline(time.Now().Add(benchHandshakeTimeout))
	req, err := socks5.ReadRequest(c, socks5.ServerConfig{})
	if err != nil {
		if rerr := (*socks5.RequestError)(nil); errors.As(err, &rerr) {
			_ = socks5.WriteReply(c, rerr.Reply, socks5.Addr{})
		}
		return
	}
	d, early, err := dial(req.Dest.String())
	if err != nil {
		_ = socks5.WriteReply(c, socks5.ReplyHostUnreachable, socks5.Addr{})
		return
	}
	bound := d.LocalAddr().(*net.TCPAddr)
	err = socks5.WriteReply(c, socks5.ReplySucceeded, socks5.Addr{Host: bound.IP.String(), Port: uint16(bound.Port)})
	if err == nil {
		err = writeAll(c, early)
	}
	if err != nil {
		_ = d.Close()
		return
	}
	_ = c.SetDeadline(time.Time{})
	spliceRelay(c, d)
}

// spliceRelay copies both ways between a and b with io.Copy, which splices
// between two *net.TCPConn on Linux, until both directions are over. A
// direction's EOF is passed on with CloseWrite while the other keeps
// flowing; an error closes both, which ends the other direction too.
func spliceRelay(a, b *net.TCPConn) {
	var once sync.Once
	closeBoth := func() { once.Do(func() { _ = a.Close(); _ = b.Close() }) }
	defer closeBoth()
	copyHalf := func(dst, src *net.TCPConn) {
		if _, err := io.Copy(dst, src); err != nil {
			closeBoth()
			return
		}
		_ = dst.CloseWrite()
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		copyHalf(b, a)
	}()
	copyHalf(a, b)
	<-done
}
