package providersim

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"testing"
	"time"

	"golang.org/x/net/proxy"
)

func TestProxiesRelay(t *testing.T) {
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello %s", r.URL.Path)
	}))
	defer origin.Close()

	hp, err := StartProxy("http", "127.0.0.1:0", "h1", "u", "p")
	if err != nil {
		t.Fatal(err)
	}
	defer hp.Close()
	sp, err := StartProxy("socks5", "127.0.0.1:0", "s1", "u", "p")
	if err != nil {
		t.Fatal(err)
	}
	defer sp.Close()

	get := func(c *http.Client) (string, string, int) {
		resp, err := c.Get(origin.URL + "/x")
		if err != nil {
			return "", "", 0
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return string(b), resp.Header.Get("X-Sim-Upstream"), resp.StatusCode
	}
	good := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: hp.Addr(), User: url.UserPassword("u", "p")})}}
	if body, via, code := get(good); body != "hello /x" || via != "h1" || code != 200 {
		t.Fatalf("http proxy: %q via %q code %d", body, via, code)
	}
	bad := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: hp.Addr(), User: url.UserPassword("u", "wrong")})}}
	if _, _, code := get(bad); code != 407 {
		t.Fatalf("wrong password: code %d, want 407", code)
	}
	d, err := proxy.SOCKS5("tcp", sp.Addr(), &proxy.Auth{User: "u", Password: "p"}, proxy.Direct)
	if err != nil {
		t.Fatal(err)
	}
	socksClient := &http.Client{Transport: &http.Transport{Dial: d.Dial}}
	if body, _, code := get(socksClient); body != "hello /x" || code != 200 {
		t.Fatalf("socks proxy: %q %d", body, code)
	}
	socksClient.CloseIdleConnections()
	good.CloseIdleConnections()

	// "any" serves both protocols on one port.
	ap, err := StartProxy("any", "127.0.0.1:0", "a1", "u", "p")
	if err != nil {
		t.Fatal(err)
	}
	defer ap.Close()
	ad, _ := proxy.SOCKS5("tcp", ap.Addr(), &proxy.Auth{User: "u", Password: "p"}, proxy.Direct)
	for _, c := range []*http.Client{
		{Transport: &http.Transport{Dial: ad.Dial}},
		{Transport: &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: ap.Addr(), User: url.UserPassword("u", "p")})}},
	} {
		if body, _, code := get(c); body != "hello /x" || code != 200 {
			t.Fatalf("any proxy: %q %d", body, code)
		}
		c.CloseIdleConnections()
	}

	hp.Down()
	if _, _, code := get(&http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: hp.Addr(), User: url.UserPassword("u", "p")})}}); code != 0 {
		t.Fatalf("a proxy that is down answered %d", code)
	}
	if err := hp.Up(); err != nil {
		t.Fatal(err)
	}
	c := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: hp.Addr(), User: url.UserPassword("u", "p")})}}
	if body, _, _ := get(c); body != "hello /x" {
		t.Fatalf("after Up: %q", body)
	}
	c.CloseIdleConnections()
}

// Down ends open tunnels even when their destination keeps its side open:
// the demo and the daemon's tests take upstreams down mid-tunnel.
func TestProxyDownEndsOpenTunnels(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	held := make(chan net.Conn, 1)
	go func() {
		if c, err := ln.Accept(); err == nil {
			held <- c // never closed before the test ends, never read
		}
	}()
	hp, err := StartProxy("http", "127.0.0.1:0", "h1", "", "")
	if err != nil {
		t.Fatal(err)
	}
	defer hp.Close()
	c, err := net.Dial("tcp", hp.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %[1]s\r\n\r\n", ln.Addr())
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if resp, err := http.ReadResponse(bufio.NewReader(c), &http.Request{Method: http.MethodConnect}); err != nil || resp.StatusCode != 200 {
		t.Fatalf("CONNECT: %v %v", resp, err)
	}
	var dest net.Conn
	select {
	case dest = <-held:
		defer dest.Close()
	case <-time.After(5 * time.Second):
		t.Fatal("the destination saw no connection")
	}
	down := make(chan struct{})
	go func() { hp.Down(); close(down) }()
	select {
	case <-down:
	case <-time.After(5 * time.Second):
		t.Fatal("Down waits for a tunnel whose destination stays open")
	}
}

// Down ends a plain-HTTP request waiting for an origin that never answers:
// the proxy closes its connection to the origin too, not only the
// client's.
func TestProxyDownEndsRequestWaitingOnSilentOrigin(t *testing.T) {
	origin, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer origin.Close()
	held := make(chan net.Conn, 1)
	go func() {
		if c, err := origin.Accept(); err == nil {
			held <- c // read, never answered
		}
	}()
	hp, err := StartProxy("http", "127.0.0.1:0", "h1", "", "")
	if err != nil {
		t.Fatal(err)
	}
	defer hp.Close()
	c, err := net.Dial("tcp", hp.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "GET http://%s/ HTTP/1.1\r\nHost: %[1]s\r\n\r\n", origin.Addr())
	var dest net.Conn
	select {
	case dest = <-held:
		defer dest.Close()
	case <-time.After(5 * time.Second):
		t.Fatal("the origin saw no connection")
	}
	// The request has reached the origin: the proxy now waits for its
	// answer.
	_ = dest.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := http.ReadRequest(bufio.NewReader(dest)); err != nil {
		t.Fatalf("the origin got no request: %v", err)
	}
	down := make(chan struct{})
	go func() { hp.Down(); close(down) }()
	select {
	case <-down:
	case <-time.After(5 * time.Second):
		t.Fatal("Down waits for a plain request whose origin never answers")
	}
	// The origin sees its connection closed.
	_ = dest.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := dest.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("origin connection after Down: read %d, %v; want EOF", n, err)
	}
}
