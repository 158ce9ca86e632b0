package forward

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/proxyd/proxyd/pool"
)

// proxyd speaks TLS itself only for an "https://" request in absolute form.
// It verifies the destination's certificate (the system's roots, or
// Config.RootCAs); a certificate that does not hold is the destination's
// failure: 502, the upstream not blamed, no other upstream tried. A trusted
// destination's answer streams to the client as it comes.
func TestHTTPSAbsoluteForm(t *testing.T) {
	upstreamKinds(t, nil, func(t *testing.T, up *pool.Upstream, _ func() []string) {
		release := make(chan struct{})
		origin := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/stream" {
				_, _ = io.WriteString(w, "first\n")
				w.(http.Flusher).Flush()
				<-release
				_, _ = io.WriteString(w, "second\n")
				return
			}
			_, _ = io.WriteString(w, "hello")
		}))
		t.Cleanup(origin.Close)
		host := strings.TrimPrefix(origin.URL, "https://")
		other := newHTTPUpstream(t, "", "", nil).upstream(3)

		t.Run("untrusted certificate", func(t *testing.T) {
			p := newFakePool(up, other)
			tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed }), p)
			resp := rawRequest(t, tl.addr, "GET "+origin.URL+"/ HTTP/1.1\r\nHost: "+host+"\r\n\r\n")
			if resp == nil || resp.StatusCode != http.StatusBadGateway {
				t.Fatalf("response %+v, want 502", resp)
			}
			p.waitBalanced(t)
			if got := p.Reports(); len(got) != 1 || got[0].res != pool.DestinationError {
				t.Errorf("reports %v, want one destination_error (no other upstream tried)", got)
			}
		})

		// A destination that takes the connection and never answers the
		// TLS handshake: the tunnel to it opened, so its silence is its
		// own, not the upstream's, whichever kind carried it.
		t.Run("silent destination", func(t *testing.T) {
			mute := startTCP(t, "tcp", "127.0.0.1:0", func(c net.Conn) { _, _ = io.Copy(io.Discard, c) })
			p := newFakePool(up, other)
			tl := startListener(t, testConfig(func(c *Config) {
				c.AllowDestinations = loopbackAllowed
				c.HandshakeTimeout = 300 * time.Millisecond
			}), p)
			resp := rawRequest(t, tl.addr, "GET https://"+mute+"/ HTTP/1.1\r\nHost: "+mute+"\r\n\r\n")
			if resp == nil || resp.StatusCode != http.StatusBadGateway {
				t.Fatalf("response %+v, want 502", resp)
			}
			p.waitBalanced(t)
			if got := p.Reports(); len(got) != 1 || got[0].res != pool.DestinationError {
				t.Errorf("reports %v, want one destination_error (no other upstream tried)", got)
			}
		})

		roots := x509.NewCertPool()
		roots.AddCert(origin.Certificate())
		t.Run("trusted", func(t *testing.T) {
			p := newFakePool(up)
			tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed; c.RootCAs = roots }), p)
			resp := rawRequest(t, tl.addr, "GET "+origin.URL+"/ HTTP/1.1\r\nHost: "+host+"\r\n\r\n")
			if resp == nil || resp.StatusCode != 200 {
				t.Fatalf("response %+v", resp)
			}
			if b, _ := io.ReadAll(resp.Body); string(b) != "hello" {
				t.Errorf("body %q", b)
			}

			// The first part arrives while the origin still holds the rest.
			c, err := net.Dial("tcp", tl.addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(5 * time.Second))
			_, _ = io.WriteString(c, "GET "+origin.URL+"/stream HTTP/1.1\r\nHost: "+host+"\r\n\r\n")
			sresp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				close(release)
				t.Fatalf("no answer head while the origin streams: %v", err)
			}
			br := bufio.NewReader(sresp.Body)
			line, err := br.ReadString('\n')
			close(release)
			if err != nil || line != "first\n" {
				t.Fatalf("first part %q, %v: held back until the answer ends", line, err)
			}
			if rest, err := io.ReadAll(br); err != nil || string(rest) != "second\n" {
				t.Errorf("rest %q, %v", rest, err)
			}
			p.waitBalanced(t)
			for _, r := range p.Reports() {
				if r.res != pool.Success {
					t.Errorf("report %v", r)
				}
			}
		})
	})
}

// proxyd never takes proxy settings from its environment (net/http's
// defaults do): with HTTP_PROXY, HTTPS_PROXY and ALL_PROXY
// pointing at a trap, plain, https:// and CONNECT requests for a named
// destination go through the upstream, and the trap sees no connection. The
// requests run in a child process started with that environment, since
// net/http reads it once per process.
func TestNoProxyFromEnvironment(t *testing.T) {
	if os.Getenv("FORWARD_ENV_CHILD") != "" {
		envProxyChild(t)
		return
	}
	checkLeaks(t)
	var trapped atomic.Int64
	trap := startTCP(t, "tcp", "127.0.0.1:0", func(net.Conn) { trapped.Add(1) })
	cmd := exec.Command(os.Args[0], "-test.run=^TestNoProxyFromEnvironment$", "-test.v")
	cmd.Env = append(os.Environ(), "FORWARD_ENV_CHILD=1",
		"HTTP_PROXY=http://"+trap, "http_proxy=http://"+trap,
		"HTTPS_PROXY=http://"+trap, "https_proxy=http://"+trap,
		"ALL_PROXY=socks5://"+trap, "all_proxy=socks5://"+trap,
		"NO_PROXY=", "no_proxy=")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestNoProxyFromEnvironment") {
		t.Fatalf("child: %v\n%s", err, out)
	}
	if n := trapped.Load(); n != 0 {
		t.Errorf("%d connections reached the environment's proxy", n)
	}
}

func envProxyChild(t *testing.T) {
	n := names{"example.com": "127.0.0.1"} // in httptest's certificate
	origin := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "hello")
	}))
	t.Cleanup(origin.Close)
	_, port, _ := net.SplitHostPort(strings.TrimPrefix(origin.URL, "https://"))
	plain, _ := startOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "hello")
	}))
	_, plainPort, _ := net.SplitHostPort(plain)
	roots := x509.NewCertPool()
	roots.AddCert(origin.Certificate())
	for _, up := range []*pool.Upstream{newHTTPUpstream(t, "", "", n).upstream(1), newSOCKSUpstream(t, "", "", n).upstream(2)} {
		tl := startListener(t, testConfig(func(c *Config) { c.RootCAs = roots }), newFakePool(up))
		tr := &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: tl.addr}), TLSClientConfig: &tls.Config{RootCAs: roots}}
		t.Cleanup(tr.CloseIdleConnections)
		c := &http.Client{Transport: tr} // https:// goes by CONNECT
		for _, u := range []string{"http://example.com:" + plainPort + "/", "https://example.com:" + port + "/"} {
			if code, body := getBody(t, c, u); code != 200 || body != "hello" {
				t.Errorf("%s via %s: %d %q", u, up.Protocol, code, body)
			}
		}
		resp := rawRequest(t, tl.addr, "GET https://example.com:"+port+"/ HTTP/1.1\r\nHost: example.com:"+port+"\r\n\r\n")
		if resp == nil || resp.StatusCode != 200 {
			t.Errorf("https:// in absolute form via %s: %+v", up.Protocol, resp)
		}
	}
}

// An HTTP upstream that never answers the CONNECT of an "https://"
// request is held to handshake_timeout, as a CONNECT client's tunnel is
// (not to net/http's own minute), blamed, and the next upstream serves.
func TestHTTPSAbsoluteFormSilentUpstream(t *testing.T) {
	checkLeaks(t)
	origin := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "hello")
	}))
	t.Cleanup(origin.Close)
	roots := x509.NewCertPool()
	roots.AddCert(origin.Certificate())
	hung := newHTTPUpstream(t, "", "", nil)
	hung.mode.Store(int32(modeHang))
	good := newHTTPUpstream(t, "", "", nil).upstream(2)
	p := newFakePool(hung.upstream(1), good)
	tl := startListener(t, testConfig(func(c *Config) {
		c.AllowDestinations = loopbackAllowed
		c.RootCAs = roots
		c.HandshakeTimeout = 300 * time.Millisecond
		c.HedgeDelay = 0
	}), p)
	host := strings.TrimPrefix(origin.URL, "https://")
	start := time.Now()
	resp := rawRequest(t, tl.addr, "GET "+origin.URL+"/ HTTP/1.1\r\nHost: "+host+"\r\n\r\n")
	if resp == nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("response %+v, want 200 through the second upstream", resp)
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("answered after %s; handshake_timeout is 300ms", took)
	}
	_, _ = io.ReadAll(resp.Body)
	p.waitBalanced(t)
	want := []report{{hung.upstream(1).ID(), pool.HandshakeTimeout}, {good.ID(), pool.Success}}
	if r := p.Reports(); !slices.Equal(r, want) {
		t.Errorf("reports %+v, want %+v", r, want)
	}
}

// An "https://" answer whose body stalls halfway ends at idle_timeout, as
// one on proxyd's own connections does (TestStalledAnswerBodyEndsAtIdleTimeout).
func TestHTTPSAnswerBodyStallEndsAtIdleTimeout(t *testing.T) {
	checkLeaks(t)
	release := make(chan struct{})
	origin := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "100")
		_, _ = io.WriteString(w, "hello")
		w.(http.Flusher).Flush()
		select { // and nothing more, until the test ends
		case <-release:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(origin.Close)
	t.Cleanup(func() { close(release) })
	roots := x509.NewCertPool()
	roots.AddCert(origin.Certificate())
	u := newHTTPUpstream(t, "", "", nil)
	p := newFakePool(u.upstream(1))
	const idle = 400 * time.Millisecond
	tl := startListener(t, testConfig(func(c *Config) {
		c.AllowDestinations = loopbackAllowed
		c.RootCAs = roots
		c.IdleTimeout = idle
	}), p)
	expectCutBody(t, tl.addr, origin.URL+"/", "hello", idle)
	p.waitBalanced(t)
}
