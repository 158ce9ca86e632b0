package forward

import (
	"bytes"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// requireTool skips when path is missing, except under CI=true where a
// missing tool fails the test.
func requireTool(t *testing.T, path string) {
	t.Helper()
	if _, err := os.Stat(path); err != nil {
		skipOrFail(t, "%s not installed: %v", path, err)
	}
}

// skipOrFail skips a test this machine cannot run, except under CI=true,
// where the test must run: there it fails.
func skipOrFail(t *testing.T, format string, args ...any) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("under CI=true: "+format, args...)
	}
	t.Skipf(format, args...)
}

// TestCurl drives both listeners with curl: plain, CONNECT tunnel, SOCKS5
// with a host name, with local credentials.
func TestCurl(t *testing.T) {
	checkLeaks(t)
	curl, err := exec.LookPath("curl")
	if err != nil {
		requireTool(t, "/usr/bin/curl")
		curl = "/usr/bin/curl"
	}
	origin, _ := startOrigin(t, http.HandlerFunc(echoHandler))
	_, port, _ := net.SplitHostPort(origin)
	n := names{"only-upstream.test": "127.0.0.1"}
	up := newHTTPUpstream(t, "", "", n)
	sup := newSOCKSUpstream(t, "", "", n)
	users := []User{{Name: "alice", Password: "pw"}}
	tl := startListener(t, testConfig(func(c *Config) { c.AllowDestinations = loopbackAllowed; c.Users = users }), newFakePool(up.upstream(1)))
	stl := startListener(t, testConfig(func(c *Config) { c.Protocol = "socks5"; c.AllowDestinations = loopbackAllowed; c.Users = users }), newFakePool(sup.upstream(2)))
	run := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(curl, append([]string{"-sS", "--max-time", "10", "--noproxy", ""}, args...)...)
		cmd.Env = []string{"PATH=/usr/bin:/bin"}
		var out, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &stderr
		if err := cmd.Run(); err != nil {
			t.Fatalf("curl %q: %v: %s", args, err, stderr.String())
		}
		return out.String()
	}
	url := "http://only-upstream.test:" + port + "/curl"
	for _, args := range [][]string{
		{"-x", "http://" + tl.addr, "-U", "alice-session-c1:pw", url},
		{"-p", "-x", "http://" + tl.addr, "-U", "alice:pw", url},
		{"--data-binary", "@-", "-H", "Transfer-Encoding: chunked", "-x", "http://" + tl.addr, "-U", "alice:pw", url},
		{"-x", "socks5h://alice-session-c2:pw@" + stl.addr, url},
	} {
		out := run(args...)
		if !strings.Contains(out, `"URI":"/curl"`) {
			t.Errorf("curl %q: %s", args, out)
		}
	}
	// A 2 MiB upload with Expect: 100-continue.
	f := filepath.Join(t.TempDir(), "upload")
	if err := os.WriteFile(f, bytes.Repeat([]byte("0123456789abcdef"), 128<<10), 0o600); err != nil {
		t.Fatal(err)
	}
	out := run("-H", "Expect: 100-continue", "--data-binary", "@"+f, "-x", "http://"+tl.addr, "-U", "alice:pw", url)
	if !strings.Contains(out, `"BodyLen":2097152`) {
		t.Errorf("upload: %s", out)
	}
	// 407 without credentials.
	if out := run("-o", os.DevNull, "-w", "%{http_code}", "-x", "http://"+tl.addr, url); out != "407" {
		t.Errorf("without credentials: %s", out)
	}
}
