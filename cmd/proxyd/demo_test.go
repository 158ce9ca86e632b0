package main

import (
	"context"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestDemo runs `proxyd demo` on free ports and follows the first curl
// command it prints, then stops it as Ctrl-C would.
func TestDemo(t *testing.T) {
	httpAddr, socksAddr, adminAddr := freePort(t), freePort(t), freePort(t)
	out := &lockedWriter{w: &strings.Builder{}}
	errOut := &lockedWriter{w: &strings.Builder{}}
	ctx, cancel := context.WithCancel(context.Background())
	code := make(chan int, 1)
	go func() {
		code <- runMain(ctx, []string{"demo", "-http", httpAddr, "-socks", socksAddr, "-admin", adminAddr, "-faults", "300ms"},
			stdio{in: strings.NewReader(""), out: out, err: errOut, getenv: func(string) string { return "" }})
	}()
	defer func() {
		cancel()
		select {
		case c := <-code:
			if c != 0 {
				t.Errorf("demo exited %d: %s", c, errOut.String())
			}
		case <-time.After(40 * time.Second):
			t.Error("demo did not stop")
		}
	}()
	var cmd []string
	waitFor(t, "the demo's instructions", 15*time.Second, func() bool {
		m := regexp.MustCompile(`curl -x http://(\S+) (\S+)`).FindStringSubmatch(out.String())
		cmd = m
		return m != nil
	})
	if cmd[1] != httpAddr {
		t.Fatalf("printed proxy %s, want %s", cmd[1], httpAddr)
	}
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: httpAddr}), DisableKeepAlives: true}}
	// Faults come and go every 300ms; retries before the first byte keep
	// every request served.
	for i := 0; i < 20; i++ {
		resp, err := c.Get(cmd[2])
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(body), "hello from the demo origin") {
			t.Fatalf("request %d: %d %q", i, resp.StatusCode, body)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !strings.Contains(errOut.String(), "demo fault") {
		t.Errorf("no fault was injected:\n%s", errOut.String())
	}
}

func TestDemoPortTaken(t *testing.T) {
	w := newWorld(t) // anything that holds a port
	taken := w.simURL[len("http://"):]
	var out, errb strings.Builder
	rc := runMain(context.Background(), []string{"demo", "-http", taken}, stdio{out: &out, err: &errb, getenv: func(string) string { return "" }})
	if rc != 1 || !strings.Contains(errb.String(), "cannot listen on "+taken+" (-http)") || !strings.Contains(errb.String(), "demo -http 127.0.0.1:") {
		t.Errorf("exit %d: %s", rc, errb.String())
	}
}
