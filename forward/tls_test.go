package forward

import (
	"bufio"
	"crypto/x509"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
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
			tl := startListener(t, Config{AllowDestinations: loopbackAllowed}, p)
			resp := rawRequest(t, tl.addr, "GET "+origin.URL+"/ HTTP/1.1\r\nHost: "+host+"\r\n\r\n")
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
			tl := startListener(t, Config{AllowDestinations: loopbackAllowed, RootCAs: roots}, p)
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
