package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/html"

	"github.com/proxyd/proxyd/agent"
	"github.com/proxyd/proxyd/pool"
)

var statusPNG = flag.String("status-png", "", "write a screenshot of the status page to this file (e.g. ../../docs/status.png)")

// hostileProduct is a product name a provider could send; the page must
// show it as text.
const hostileProduct = `<img src=x onerror=alert(1)>`

// Secrets that must never reach the page.
const (
	canaryAPIToken        = "canary-api-token-3f9a"
	canaryServicePassword = "canary-service-pw-77c2"
)

// TestStatusPageEscapes renders the page from made-up data: provider
// strings are escaped wherever they appear, nothing outside the template
// is loaded, and the page refreshes itself.
func TestStatusPageEscapes(t *testing.T) {
	until := time.Date(2026, 11, 21, 10, 0, 42, 0, time.UTC)
	now := until.Add(-42 * time.Second)
	ex := pool.Explanation{
		Updated:   now.Add(-time.Minute),
		Listeners: []pool.ListenerExplanation{{Name: "http", Usable: 1, Total: 2}, {Name: "socks", Usable: 0, Total: 1, Panic: true}},
		Upstreams: []pool.UpstreamExplanation{
			{ID: "101/http/192.0.2.1:8080", Service: 101, Kind: pool.FPR, Protocol: pool.HTTP, Address: "192.0.2.1:8080", State: pool.Ejected,
				Reason: "dial_refused", Failures: 7, ConsecutiveFailures: 3, Ejections: 1, EjectedUntil: &until},
			{ID: "102/http/gw.example:9000/s1", Service: 102, Kind: pool.PPR, Protocol: pool.HTTP, Address: "gw.example:9000", Session: "s1",
				State: pool.Healthy, ExitIP: "198.51.100.7", InFlight: 2},
		},
		Unserved: []pool.UnservedExplanation{
			{Service: 102, Server: "gw.example", Session: "s9", ExitIP: "198.51.100.9", ExitErrored: true, Rotating: true},
			{Service: 104, Server: "gw.example", Session: "<s10>", ExitIP: "198.51.100.10"},
		},
	}
	snap := agent.Snapshot{
		AccountKnown: true, CreditKnown: true, Credit: 12.5, InvoicesKnown: true, UnpaidInvoices: 2, UnpaidUSD: 30,
		Services: []agent.ServiceState{
			{ID: 101, Record: agent.Service{ProductName: "Static <b>US</b>", ProductType: "fpr", Status: "Active", Password: canaryServicePassword}},
			{ID: 102, Record: agent.Service{ProductName: hostileProduct, ProductType: "ppr", Status: "Active"}, HasUsage: true, Rate: 256, Limit: 1024},
		},
		Accounts: []agent.ServiceItem{{ServiceID: 103, ProductName: `"quoted" & <i>`, Status: "Suspended"}},
	}
	events := []pool.Event{{Time: now.Add(-5 * time.Second), Kind: pool.EventListUpdateFailed, Service: 101, Reason: `provider said <script>alert(2)</script>`}}
	// The lists are three hours old while the pool took a poll a minute
	// ago; service 102 is held at its quota (quota_headroom below 25 %).
	page := buildStatusPage(statusInput{pool: ex, snap: snap, events: events,
		fetched: now.Add(-3 * time.Hour), atQuota: func(id int) bool { return id == 102 }}, now)
	var b bytes.Buffer
	if err := statusTemplate.Execute(&b, page); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, bad := range []string{"<img", "<script", "<b>US", "<i>", canaryServicePassword} {
		if strings.Contains(out, bad) {
			t.Errorf("the page holds %q", bad)
		}
	}
	for _, want := range []string{
		"&lt;img src=x onerror=alert(1)&gt;", "&lt;script&gt;alert(2)&lt;/script&gt;", "&#34;quoted&#34; &amp; &lt;i&gt;",
		`<meta http-equiv="refresh" content="5">`, "in 42s", `id="usage-102"`, "256 of 1024 (25%)", "$12.50", "PANIC", "2 unpaid invoices ($30.00)",
		`class="state state-ejected"`, "(not served)",
		"pool updated 2026-11-21T09:59:00Z (1m0s ago)", "IP lists fetched 2026-11-21T07:00:00Z (3h0m0s ago)",
		`<span class="usage-text over">256 of 1024 (25%)</span>`,
		// Sessions no upstream stands for: with their service's group, or
		// in a group of their own.
		`<tr class="unserved" data-session="s9"><td>s9</td><td><code>gw.example</code></td><td><code>198.51.100.9</code></td><td><span class="over">yes</span></td><td>yes</td></tr>`,
		"1 healthy, 1 unserved session</small>", `id="service-104"`, "<small>ppr · 1 unserved session</small>", `data-session="&lt;s10&gt;"`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("the page lacks %q", want)
		}
	}
	for _, outside := range []string{"http://", "https://", "//cdn", "<script", "<link", "@import"} {
		if strings.Contains(out, outside) {
			t.Errorf("the page refers to %q", outside)
		}
	}
}

// requireChromium returns the path of headless Chromium. Missing, it skips
// the test, or fails it under CI=true.
func requireChromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("chromium is required under CI=true (apt-get install chromium)")
	}
	t.Skip("chromium not found (apt-get install chromium); CI=true makes this a failure")
	return ""
}

// chromium runs headless Chromium with its own profile under t.TempDir(),
// bounded by a minute; the whole process group is killed when the run ends
// or times out, so no renderer outlives the test.
func chromium(t *testing.T, bin string, args ...string) ([]byte, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	all := append([]string{"--headless", "--disable-gpu", "--no-sandbox", "--no-proxy-server",
		"--no-first-run", "--disable-extensions", "--hide-scrollbars", "--user-data-dir=" + t.TempDir()}, args...)
	cmd := exec.CommandContext(ctx, bin, all...)
	ownProcessGroup(cmd)
	cmd.Cancel = func() error { return killProcessGroup(cmd) }
	cmd.WaitDelay = 5 * time.Second
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if cmd.Process != nil {
		killProcessGroup(cmd) // helpers left behind, if any
	}
	if err != nil {
		return nil, errors.Join(err, errors.New(tail(stderr.String(), 2000)))
	}
	return stdout.Bytes(), nil
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// screenshot writes a PNG of the page at 1280x900 to file, making its
// directory if needed. Chromium exits 0 even when it could not write the
// file, so its presence is checked.
func screenshot(t *testing.T, bin, pageURL, file string) error {
	t.Helper()
	file, err := filepath.Abs(file)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(file), 0o755); err != nil {
		return err
	}
	os.Remove(file)
	if _, err := chromium(t, bin, "--window-size=1280,900", "--screenshot="+file, pageURL); err != nil {
		return err
	}
	_, err = os.Stat(file)
	return err
}

// rewritingProvider stands between the daemon and the simulated provider
// and gives service 102 a hostile product name, and every service record a
// canary password, as a provider could.
func rewritingProvider(t *testing.T, simURL string) string {
	t.Helper()
	target, err := url.Parse(simURL)
	if err != nil {
		t.Fatal(err)
	}
	rp := httputil.NewSingleHostReverseProxy(target)
	rp.ModifyResponse = func(resp *http.Response) error {
		if !strings.HasPrefix(resp.Request.URL.Path, "/api/service") {
			return nil
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return err
		}
		var v any
		if json.Unmarshal(b, &v) == nil {
			rewriteServices(v)
			b, _ = json.Marshal(v)
		}
		resp.Body = io.NopCloser(bytes.NewReader(b))
		resp.ContentLength = int64(len(b))
		resp.Header.Set("Content-Length", strconv.Itoa(len(b)))
		return nil
	}
	srv := httptest.NewServer(rp)
	t.Cleanup(srv.Close)
	return srv.URL
}

func rewriteServices(v any) {
	switch v := v.(type) {
	case map[string]any:
		if _, ok := v["product_name"]; ok && strings.TrimSpace(jsonText(v["service_id"])) == strconv.Itoa(demoPPR) {
			v["product_name"] = hostileProduct
		}
		if _, ok := v["password"]; ok {
			v["password"] = canaryServicePassword
		}
		for _, x := range v {
			rewriteServices(x)
		}
	case []any:
		for _, x := range v {
			rewriteServices(x)
		}
	}
}

func jsonText(v any) string {
	switch v := v.(type) {
	case string:
		return v
	case float64:
		return strconv.FormatFloat(v, 'f', -1, 64)
	}
	return ""
}

// statusDaemon starts a daemon against the demo world with upstreams in
// several states: one on the provider's errored list, one on its inactive
// list, one ejected (for an hour) after its proxy stopped, and the ppr service at 700 of
// its 1024 usage limit. mutate, if not nil, changes the config further.
func statusDaemon(t *testing.T, w *demoWorld, mutate func(*config)) (e *e2e, errored string) {
	t.Helper()
	w.sim.SetUsage(demoPPR, 700, 1024)
	e = startDaemon(t, w, t.TempDir(), func(c *config) {
		// The ejection outlasts the test: the demo's 10 s (8 s with its
		// jitter) ended while a loaded machine started Chromium, and the
		// page then showed "probing" where /pool had said "ejected".
		c.Pool.EjectBase, c.Pool.EjectMax = time.Hour, time.Hour
		if mutate != nil {
			mutate(c)
		}
	})
	e.waitReady()
	bad := w.fprHTTP[0]
	w.sim.MarkErrored(demoFPR, hostOf(bad.Addr()))
	w.sim.MarkInactive(demoFPR, hostOf(w.fprSOCKS[2].Addr()))
	e.pollOnce(agent.LoopStatus)
	dead := w.fprSOCKS[1]
	dead.Down()
	waitFor(t, "the stopped SOCKS5 upstream ejected", 30*time.Second, func() bool {
		e.get("socks", "")
		for _, u := range e.poolState().Upstreams {
			if u.Address == dead.Addr() && u.State == pool.Ejected {
				return true
			}
		}
		return false
	})
	for _, u := range e.poolState().Upstreams {
		if u.Address == bad.Addr() && u.Protocol == pool.HTTP {
			errored = u.ID
		}
	}
	return e, errored
}

// TestStatusPageChromium renders the status page of a real daemon in
// headless Chromium and reads the DOM it built: every upstream with its
// address and state, an errored upstream's provider_error, the usage bar
// of the ppr service, a hostile product name as text, and no secret.
func TestStatusPageChromium(t *testing.T) {
	bin := requireChromium(t)
	w := newWorld(t)
	provider := rewritingProvider(t, w.simURL)
	e, erroredID := statusDaemon(t, w, func(c *config) {
		c.API.BaseURL = provider
		c.API.Token = canaryAPIToken // in the config, though the environment's token is the one used
	})
	pageURL := "http://" + e.d.adminAddr() + "/"
	// Registered after the daemon's cleanup, so it runs first: the page is
	// still served when a failed test takes its picture.
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		file := filepath.Join(t.ArtifactDir(), "status.png")
		if err := screenshot(t, bin, pageURL, file); err != nil {
			t.Logf("screenshot of the failed page: %v", err)
			return
		}
		t.Logf("screenshot of the failed page: %s (kept with go test -artifacts)", file)
	})
	e.d.events.Record(pool.Event{Kind: pool.EventListUpdateFailed, Service: demoFPR, Reason: `provider said <script>alert(2)</script>`})

	ex := e.poolState()
	dom, err := chromium(t, bin, "--dump-dom", pageURL)
	if err != nil {
		t.Fatalf("chromium --dump-dom: %v", err)
	}
	doc, err := html.Parse(bytes.NewReader(dom))
	if err != nil {
		t.Fatalf("parsing the DOM: %v", err)
	}

	rows := map[string]*html.Node{}
	for _, tr := range findAll(doc, func(n *html.Node) bool { return n.Data == "tr" && hasClass(n, "upstream") }) {
		rows[attr(tr, "data-id")] = tr
	}
	if len(ex.Upstreams) < 10 {
		t.Errorf("/pool has %d upstreams, want the demo's 10 or more", len(ex.Upstreams))
	}
	for _, u := range ex.Upstreams {
		tr := rows[u.ID]
		if tr == nil {
			t.Errorf("upstream %s is not on the page", u.ID)
			continue
		}
		if addr := textOf(first(tr, func(n *html.Node) bool { return hasClass(n, "address") })); addr != u.Address {
			t.Errorf("upstream %s shows address %q, want %q", u.ID, addr, u.Address)
		}
		if st := textOf(first(tr, func(n *html.Node) bool { return hasClass(n, "state") })); st != string(u.State) {
			t.Errorf("upstream %s shows state %q, want %q", u.ID, st, u.State)
		}
	}
	if tr := rows[erroredID]; erroredID == "" || tr == nil || attr(tr, "data-state") != string(pool.ProviderError) {
		t.Errorf("the errored upstream %q is not shown as provider_error", erroredID)
	}
	ejected := first(doc, func(n *html.Node) bool {
		return hasClass(n, "upstream") && attr(n, "data-state") == string(pool.Ejected)
	})
	if first(ejected, func(n *html.Node) bool { return hasClass(n, "countdown") }) == nil {
		t.Error("no ejected upstream with its ejection countdown")
	}

	meter := first(doc, func(n *html.Node) bool { return n.Data == "meter" && attr(n, "id") == "usage-102" })
	if meter == nil {
		t.Error("no usage bar (meter#usage-102) for the ppr service")
	} else if attr(meter, "value") != "700" || attr(meter, "max") != "1024" {
		t.Errorf("usage bar value=%q max=%q, want 700 of 1024", attr(meter, "value"), attr(meter, "max"))
	}

	account := first(doc, func(n *html.Node) bool { return attr(n, "id") == "account-102" })
	if got := textOf(first(account, func(n *html.Node) bool { return hasClass(n, "product") })); got != hostileProduct {
		t.Errorf("service 102's product shows as %q, want the provider's name as text", got)
	}
	if n := first(doc, func(n *html.Node) bool {
		for _, a := range n.Attr {
			if strings.HasPrefix(strings.ToLower(a.Key), "on") {
				return true
			}
		}
		return n.Data == "script"
	}); n != nil {
		t.Errorf("the DOM has an element <%s %v> from provider data", n.Data, n.Attr)
	}
	if n := first(doc, func(n *html.Node) bool { return n.Data == "img" }); n != nil {
		t.Errorf("the DOM has an <img> %v", n.Attr)
	}
	for _, id := range []string{"listeners", "account", "upstreams", "events", "credit"} {
		if first(doc, func(n *html.Node) bool { return attr(n, "id") == id }) == nil {
			t.Errorf("no #%s on the page", id)
		}
	}
	if first(doc, func(n *html.Node) bool {
		return hasClass(n, "event") && attr(n, "data-kind") == string(pool.EventListUpdateFailed)
	}) == nil {
		t.Error("the recorded event is not among the last events")
	}

	// No secret in the DOM, nor in the page as served.
	_, raw := e.admin("/")
	for _, secret := range []string{canaryAPIToken, canaryServicePassword, "sim-token", "pw-101-sim", "pw-102-sim"} {
		if bytes.Contains(dom, []byte(secret)) || strings.Contains(raw, secret) {
			t.Errorf("the page holds the secret %q", secret)
		}
	}
}

// TestStatusPageScreenshot writes the picture of the page the README shows
// (go test -run TestStatusPageScreenshot -status-png ../../docs/status.png):
// the demo world with upstreams in several states. Without -status-png it
// does nothing.
func TestStatusPageScreenshot(t *testing.T) {
	if *statusPNG == "" {
		t.Skip("no -status-png file")
	}
	bin := requireChromium(t)
	w := newWorld(t)
	e, _ := statusDaemon(t, w, nil)
	if err := screenshot(t, bin, "http://"+e.d.adminAddr()+"/", *statusPNG); err != nil {
		t.Fatalf("screenshot: %v", err)
	}
	st, err := os.Stat(*statusPNG)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("wrote %s (%d bytes)", *statusPNG, st.Size())
	if st.Size() > 200<<10 {
		t.Errorf("%s is %d bytes, over 200 KB", *statusPNG, st.Size())
	}
}

func findAll(n *html.Node, match func(*html.Node) bool) []*html.Node {
	var out []*html.Node
	var walk func(*html.Node)
	walk = func(n *html.Node) {
		if n.Type == html.ElementNode && match(n) {
			out = append(out, n)
		}
		for c := n.FirstChild; c != nil; c = c.NextSibling {
			walk(c)
		}
	}
	if n != nil {
		walk(n)
	}
	return out
}

func first(n *html.Node, match func(*html.Node) bool) *html.Node {
	if all := findAll(n, match); len(all) > 0 {
		return all[0]
	}
	return nil
}

func attr(n *html.Node, key string) string {
	if n == nil {
		return ""
	}
	for _, a := range n.Attr {
		if a.Key == key {
			return a.Val
		}
	}
	return ""
}

func hasClass(n *html.Node, class string) bool {
	return n.Type == html.ElementNode && slices.Contains(strings.Fields(attr(n, "class")), class)
}

// textOf is the text content of n, trimmed.
func textOf(n *html.Node) string {
	if n == nil {
		return ""
	}
	var b strings.Builder
	var walk func(*html.Node)
	walk = func(n *html.Node) {
		if n.Type == html.TextNode {
			b.WriteString(n.Data)
		}
		for c := n.FirstChild; c != nil; c = c.NextSibling {
			walk(c)
		}
	}
	walk(n)
	return strings.TrimSpace(b.String())
}

// TestStatusPageFilters: the page takes /pool's filters.
func TestStatusPageFilters(t *testing.T) {
	w := newWorld(t)
	e := startDaemon(t, w, t.TempDir(), nil)
	e.waitReady()
	code, body := e.admin("/?service=102&listener=http&state=")
	if code != 200 {
		t.Fatalf("GET /?service=102&listener=http: %d %s", code, body)
	}
	if !strings.Contains(body, `id="service-102"`) || strings.Contains(body, `id="service-101"`) {
		t.Error("?service=102 shows other services' upstreams, or not its own")
	}
	if strings.Contains(body, `data-listener="socks"`) || !strings.Contains(body, `data-listener="http"`) {
		t.Error("?listener=http shows other listeners, or not its own")
	}
	if strings.Contains(body, `data-id="102/socks5/`) || !strings.Contains(body, `data-id="102/http/`) {
		t.Error("?listener=http shows SOCKS5 upstreams, or not the HTTP ones")
	}
	if !strings.Contains(body, `<option selected>102</option>`) {
		t.Error("the filter form does not show the service in force")
	}
	// The form offers every service, the filtered-out ones too (filtering
	// must not touch the unfiltered view the choices come from).
	if !strings.Contains(body, `<option>101</option>`) || strings.Contains(body, `<option>0</option>`) {
		t.Errorf("the service choices under ?service=102: %s", grepLines(body, "<option"))
	}
	for q, want := range map[string]int{"?state=bogus": 400, "?service=x": 400, "?listener=nope": 404, "/nothing": 404} {
		path := "/" + q
		if strings.HasPrefix(q, "/") {
			path = q
		}
		if code, _ := e.admin(path); code != want {
			t.Errorf("GET %s: %d, want %d", path, code, want)
		}
	}
}
