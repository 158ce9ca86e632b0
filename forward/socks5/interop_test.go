package socks5

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/proxy"
)

// testServer is a small SOCKS5 server built from ReadRequest and
// WriteReply: it serves CONNECT by dialing the destination directly and
// relaying. Domain names are looked up only in names (never resolved), so a
// test can prove that a name went through unresolved.
type testServer struct {
	t     testing.TB
	ln    net.Listener
	cfg   ServerConfig
	names map[string]string // domain → IP literal

	wg       sync.WaitGroup
	outcomes chan outcome // one per ReadRequest, in order

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
}

// outcome is what ReadRequest returned for one connection.
type outcome struct {
	req *Request
	err error
}

func startTestServer(t testing.TB, cfg ServerConfig, names map[string]string) *testServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &testServer{t: t, ln: ln, cfg: cfg, names: names, conns: map[net.Conn]struct{}{}, outcomes: make(chan outcome, 64)}
	s.wg.Add(1)
	go s.acceptLoop()
	t.Cleanup(func() {
		ln.Close()
		s.mu.Lock()
		s.closed = true
		for c := range s.conns {
			c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
	})
	return s
}

func (s *testServer) addr() string { return s.ln.Addr().String() }

// track registers c to be closed at cleanup, or closes it at once when
// cleanup has begun.
func (s *testServer) track(c net.Conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		c.Close()
		return
	}
	s.conns[c] = struct{}{}
}

// next waits for the outcome of the next handshake the server read.
func (s *testServer) next(t testing.TB) outcome {
	t.Helper()
	select {
	case o := <-s.outcomes:
		return o
	case <-time.After(testDeadline):
		t.Fatal("the server read no handshake in time")
		return outcome{}
	}
}

func (s *testServer) acceptLoop() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.track(c)
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer c.Close()
			s.handle(c)
		}()
	}
}

func (s *testServer) handle(c net.Conn) {
	c.SetDeadline(time.Now().Add(testDeadline))
	req, err := ReadRequest(c, s.cfg)
	select {
	case s.outcomes <- outcome{req, err}:
	default:
		s.t.Error("test server: too many handshakes")
	}
	var rerr *RequestError
	if errors.As(err, &rerr) {
		WriteReply(c, rerr.Reply, Addr{})
		return
	}
	if err != nil {
		return
	}
	host := req.Dest.Host
	if req.Dest.IsDomain() {
		ip, ok := s.names[host]
		if !ok {
			WriteReply(c, ReplyHostUnreachable, Addr{})
			return
		}
		host = ip
	}
	up, err := net.DialTimeout("tcp", net.JoinHostPort(host, strconv.Itoa(int(req.Dest.Port))), testDeadline)
	if err != nil {
		WriteReply(c, ReplyConnectionRefused, Addr{})
		return
	}
	s.track(up)
	defer up.Close()
	la := up.LocalAddr().(*net.TCPAddr)
	if err := WriteReply(c, ReplySucceeded, Addr{la.IP.String(), uint16(la.Port)}); err != nil {
		return
	}
	c.SetDeadline(time.Time{})
	var wg sync.WaitGroup
	wg.Add(2)
	pipe := func(dst, src net.Conn) {
		defer wg.Done()
		io.Copy(dst, src)
		dst.(*net.TCPConn).CloseWrite()
	}
	go pipe(up, c)
	go pipe(c, up)
	wg.Wait()
}

// startOrigin returns an HTTP origin on loopback that names the host it was
// asked for.
func startOrigin(t testing.TB) (*httptest.Server, string) {
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "hello from origin, host "+r.Host)
	}))
	t.Cleanup(origin.Close)
	_, port, _ := net.SplitHostPort(origin.Listener.Addr().String())
	return origin, port
}

var aliceOnly = ServerConfig{RequireAuth: true, Authenticate: func(u, p string) bool {
	return u == "alice" && p == "s3cret"
}}

func httpGetThrough(t *testing.T, d proxy.Dialer, url string) (string, error) {
	t.Helper()
	tr := &http.Transport{
		DialContext: d.(proxy.ContextDialer).DialContext,
		Proxy:       nil,
	}
	t.Cleanup(tr.CloseIdleConnections)
	ctx, cancel := context.WithTimeout(context.Background(), testDeadline)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", url, nil)
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

func TestInteropXNetProxy(t *testing.T) {
	_, port := startOrigin(t)
	names := map[string]string{"origin.test": "127.0.0.1"}
	cases := []struct {
		name     string
		cfg      ServerConfig
		auth     *proxy.Auth
		url      string
		wantDest Addr
		wantUser string
		wantErr  error
	}{
		{name: "no auth, domain", url: "http://origin.test:" + port + "/",
			wantDest: Addr{"origin.test", mustPort(port)}},
		{name: "no auth, ipv4", url: "http://127.0.0.1:" + port + "/",
			wantDest: Addr{"127.0.0.1", mustPort(port)}},
		{name: "optional auth reads the session key", auth: &proxy.Auth{User: "session-abc", Password: "x"},
			url: "http://origin.test:" + port + "/", wantDest: Addr{"origin.test", mustPort(port)}, wantUser: "session-abc"},
		{name: "required auth", cfg: aliceOnly, auth: &proxy.Auth{User: "alice", Password: "s3cret"},
			url: "http://origin.test:" + port + "/", wantDest: Addr{"origin.test", mustPort(port)}, wantUser: "alice"},
		{name: "wrong password", cfg: aliceOnly, auth: &proxy.Auth{User: "alice", Password: "nope"},
			url: "http://origin.test:" + port + "/", wantErr: ErrAuthFailed},
		{name: "no credentials where required", cfg: aliceOnly,
			url: "http://origin.test:" + port + "/", wantErr: ErrNoAcceptableMethod},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := startTestServer(t, c.cfg, names)
			d, err := proxy.SOCKS5("tcp", s.addr(), c.auth, proxy.Direct)
			if err != nil {
				t.Fatal(err)
			}
			body, err := httpGetThrough(t, d, c.url)
			o := s.next(t)
			if c.wantErr != nil {
				if err == nil {
					t.Fatalf("GET succeeded, want failure")
				}
				if !errors.Is(o.err, c.wantErr) {
					t.Fatalf("server error %v, want %v", o.err, c.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("GET: %v (server error %v)", err, o.err)
			}
			if !strings.HasPrefix(body, "hello from origin") {
				t.Fatalf("body = %q", body)
			}
			if o.req == nil || o.req.Dest != c.wantDest || o.req.Username != c.wantUser {
				t.Fatalf("server saw %+v, want dest %v user %q", o.req, c.wantDest, c.wantUser)
			}
		})
	}
}

func mustPort(s string) uint16 {
	p, err := strconv.ParseUint(s, 10, 16)
	if err != nil {
		panic(err)
	}
	return uint16(p)
}

// needCurl returns curl's path, skipping when it is missing unless CI=true.
func needCurl(t *testing.T) string {
	p, err := exec.LookPath("curl")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("curl is required under CI=true: %v", err)
		}
		t.Skipf("curl not installed: %v", err)
	}
	return p
}

func TestInteropCurl(t *testing.T) {
	curl := needCurl(t)
	_, port := startOrigin(t)
	names := map[string]string{"origin.test": "127.0.0.1"}
	url := "http://origin.test:" + port + "/"
	cases := []struct {
		name     string
		cfg      ServerConfig
		args     func(proxyAddr string) []string
		wantUser string
		wantErr  error
	}{
		{name: "socks5-hostname", args: func(p string) []string { return []string{"--socks5-hostname", p} }},
		{name: "socks5h with user/pass", cfg: aliceOnly, wantUser: "alice",
			args: func(p string) []string { return []string{"--proxy", "socks5h://alice:s3cret@" + p} }},
		{name: "socks5h with session key, auth optional", wantUser: "session-k.1_x",
			args: func(p string) []string { return []string{"--proxy", "socks5h://session-k.1_x:any@" + p} }},
		{name: "socks5h wrong password", cfg: aliceOnly, wantErr: ErrAuthFailed,
			args: func(p string) []string { return []string{"--proxy", "socks5h://alice:wrong@" + p} }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := startTestServer(t, c.cfg, names)
			ctx, cancel := context.WithTimeout(context.Background(), testDeadline)
			defer cancel()
			args := append([]string{"-sS", "--max-time", "8", "--noproxy", ""}, c.args(s.addr())...)
			cmd := exec.CommandContext(ctx, curl, append(args, url)...)
			cmd.Env = []string{"PATH=" + os.Getenv("PATH")} // no proxy settings from the environment
			out, err := cmd.CombinedOutput()
			o := s.next(t)
			if c.wantErr != nil {
				if err == nil {
					t.Fatalf("curl succeeded: %s", out)
				}
				if !errors.Is(o.err, c.wantErr) {
					t.Fatalf("server error %v, want %v (curl: %s)", o.err, c.wantErr, out)
				}
				return
			}
			if err != nil {
				t.Fatalf("curl: %v: %s (server error %v)", err, out, o.err)
			}
			if want := "hello from origin, host origin.test:" + port; string(out) != want {
				t.Fatalf("curl printed %q, want %q", out, want)
			}
			if o.req == nil || o.req.Dest != (Addr{"origin.test", mustPort(port)}) || o.req.Username != c.wantUser {
				t.Fatalf("server saw %+v, want origin.test unresolved, user %q", o.req, c.wantUser)
			}
		})
	}
}

// Our client through our server: the relay carries bytes both ways, and the
// reply code the server chose reaches the client as a typed error.
func TestInteropOwnClientOwnServer(t *testing.T) {
	_, port := startOrigin(t)
	s := startTestServer(t, ServerConfig{}, map[string]string{"origin.test": "127.0.0.1"})
	dial := func() net.Conn {
		c, err := net.DialTimeout("tcp", s.addr(), testDeadline)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		c.SetDeadline(time.Now().Add(testDeadline))
		return c
	}

	for _, c := range []struct {
		name       string
		client     Client
		user, pass string
	}{
		{"no auth", Client{}, "", ""},
		{"auth", Client{}, "session-1", "x"},
		{"pipelined no auth", Client{Pipeline: true}, "", ""},
		{"pipelined auth", Client{Pipeline: true}, "session-1", "x"},
	} {
		conn := dial()
		if _, err := c.client.Handshake(conn, Addr{"origin.test", mustPort(port)}, c.user, c.pass); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		io.WriteString(conn, "GET / HTTP/1.0\r\nHost: origin.test\r\n\r\n")
		b, _ := io.ReadAll(conn)
		if !strings.Contains(string(b), "hello from origin") {
			t.Fatalf("%s: response %q", c.name, b)
		}
		if o := s.next(t); o.err != nil || o.req.Username != c.user {
			t.Fatalf("%s: server read %+v, %v", c.name, o.req, o.err)
		}
	}

	var re *ReplyError
	_, err := ClientHandshake(dial(), Addr{"unknown.test", 80}, "", "")
	if !errors.As(err, &re) || re.Code != ReplyHostUnreachable || !re.DestinationFault() {
		t.Fatalf("unknown name: err = %v, want host unreachable", err)
	}
}
