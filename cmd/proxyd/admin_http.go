package main

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/proxyd/proxyd/agent"
	"github.com/proxyd/proxyd/pool"
)

// adminHandler is everything the admin address answers:
//
//	GET /         the status page for people (HTML)
//	GET /events   the pool's event log (JSON), newest first
//	GET /pool     the live pool (JSON)
//	GET /metrics  Prometheus text format
//	GET /healthz  200 while the process runs
//	GET /readyz   200 when every listener accepts and has a usable upstream
//
// behind the admin access rules, which hold for every answer:
//
//   - The Host header must name the admin's own address or a loopback name
//     (localhost, 127.0.0.1, [::1]), with or without a port; anything else
//     gets 403. A page on another site that rebinds its DNS name to this
//     address sends its own name as Host, so it cannot read the answers.
//   - When token is set, every endpoint but /healthz (kept open for
//     liveness checks) wants it, either as "Authorization: Bearer TOKEN" or,
//     so that a browser can open the status page, as the password of HTTP
//     Basic with any user name. A 401 carries
//     `WWW-Authenticate: Basic realm="proxyd"`.
//   - Every answer is sent with "Cache-Control: no-store", nosniff, and a
//     Content-Security-Policy that forbids loading anything from elsewhere.
//
// adminAddr is the configured admin address (host:port); its host is the
// admin's own name. No answer ever holds a password or token.
func (d *daemon) adminHandler(token, adminAddr string) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", d.serveStatus)
	mux.HandleFunc("GET /events", d.serveEvents)
	mux.HandleFunc("GET /pool", d.servePool)
	mux.Handle("GET /metrics", d.metrics.Handler())
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		if ok, why := d.readiness(); !ok {
			http.Error(w, why, http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	})
	return &adminAccess{next: mux, hosts: newHostCheck(adminAddr), token: tokenDigest(token)}
}

// adminContentSecurityPolicy allows nothing from anywhere but the page's
// own inline style: no scripts, no frames, no outside loads.
const adminContentSecurityPolicy = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; " +
	"base-uri 'none'; form-action 'self'; frame-ancestors 'none'"

// adminAccess applies the admin access rules (see adminHandler) in front of
// every endpoint.
type adminAccess struct {
	next  http.Handler
	hosts hostCheck
	token *[sha256.Size]byte // nil: no token
}

func (a *adminAccess) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Cache-Control", "no-store")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Content-Security-Policy", adminContentSecurityPolicy)
	h.Set("Referrer-Policy", "no-referrer")
	if !a.hosts.allowed(r.Host) {
		http.Error(w, "forbidden: the Host header names neither this admin address nor a loopback name", http.StatusForbidden)
		return
	}
	if a.token != nil && r.URL.Path != "/healthz" && !a.authorized(r) {
		h.Set("WWW-Authenticate", `Basic realm="proxyd"`)
		http.Error(w, "unauthorized", http.StatusUnauthorized)
		return
	}
	a.next.ServeHTTP(w, r)
}

// authorized reports whether r carries the token as Bearer or as the Basic
// password. Both sides are hashed before the constant-time compare, so
// neither the content nor the length of the token leaks through timing.
func (a *adminAccess) authorized(r *http.Request) bool {
	auth := r.Header.Get("Authorization")
	scheme, cred, _ := strings.Cut(auth, " ")
	var given string
	switch {
	case strings.EqualFold(scheme, "Bearer"):
		given = strings.TrimSpace(cred)
	case strings.EqualFold(scheme, "Basic"):
		raw, err := base64.StdEncoding.DecodeString(strings.TrimSpace(cred))
		if err != nil {
			return false
		}
		_, pass, ok := strings.Cut(string(raw), ":")
		if !ok {
			return false
		}
		given = pass
	default:
		return false
	}
	got := sha256.Sum256([]byte(given))
	return subtle.ConstantTimeCompare(got[:], a.token[:]) == 1
}

func tokenDigest(token string) *[sha256.Size]byte {
	if token == "" {
		return nil
	}
	sum := sha256.Sum256([]byte(token))
	return &sum
}

// hostCheck holds the names a request's Host header may carry: the
// loopback names and the admin's own host. The port is not compared: a
// tunnel (ssh -L 8000:127.0.0.1:9900) legitimately changes it, and a page
// using DNS rebinding is told apart by its name, which is never one of ours.
type hostCheck struct {
	names map[string]bool
	// anyIP: the admin listens on every address (0.0.0.0 or ::), so a
	// literal IP is one of its own addresses or at least not a rebound
	// name: a browser only sends the name it resolved.
	anyIP bool
}

func newHostCheck(adminAddr string) hostCheck {
	c := hostCheck{names: map[string]bool{"localhost": true, "127.0.0.1": true, "::1": true}}
	host, _, err := net.SplitHostPort(adminAddr)
	if err != nil {
		host = adminAddr
	}
	host = normalHost(host)
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		c.anyIP = true
	} else {
		c.names[host] = true
	}
	return c
}

// normalHost lowercases a host name and drops brackets and a trailing dot.
func normalHost(h string) string {
	h = strings.TrimSuffix(strings.TrimPrefix(h, "["), "]")
	return strings.TrimSuffix(strings.ToLower(h), ".")
}

func (c hostCheck) allowed(hostHeader string) bool {
	host := hostHeader
	if h, _, err := net.SplitHostPort(hostHeader); err == nil {
		host = h
	}
	host = normalHost(host)
	if host == "" {
		return false
	}
	if c.names[host] {
		return true
	}
	return c.anyIP && net.ParseIP(host) != nil
}

// poolFilter is the query of /pool and of the status page:
// ?service=ID&state=STATE&listener=NAME, each optional.
type poolFilter struct {
	service  int
	state    pool.State
	listener string
}

// parsePoolFilter reads the filter; the error is the 400 answer's text.
func parsePoolFilter(r *http.Request) (poolFilter, error) {
	var f poolFilter
	q := r.URL.Query()
	if s := q.Get("service"); s != "" {
		id, err := strconv.Atoi(s)
		if err != nil || id <= 0 {
			return f, fmt.Errorf("service must be a positive number, got %q", s)
		}
		f.service = id
	}
	if s := q.Get("state"); s != "" {
		if !slices.Contains(pool.States(), pool.State(s)) {
			return f, fmt.Errorf("unknown state %q", s)
		}
		f.state = pool.State(s)
	}
	f.listener = q.Get("listener")
	return f, nil
}

// filterPool narrows ex to the filter, on copies of its lists (the caller
// may still read ex's); ok is false for an unknown listener. The sessions
// no upstream stands for have no state and serve no listener: a state or
// listener filter leaves them out.
func (d *daemon) filterPool(ex pool.Explanation, f poolFilter) (pool.Explanation, bool) {
	ex.Upstreams, ex.Unserved, ex.Listeners = slices.Clone(ex.Upstreams), slices.Clone(ex.Unserved), slices.Clone(ex.Listeners)
	if f.service != 0 {
		ex.Upstreams = slices.DeleteFunc(ex.Upstreams, func(u pool.UpstreamExplanation) bool { return u.Service != f.service })
		ex.Unserved = slices.DeleteFunc(ex.Unserved, func(u pool.UnservedExplanation) bool { return u.Service != f.service })
	}
	if f.state != "" || f.listener != "" {
		ex.Unserved = nil
	}
	if f.state != "" {
		ex.Upstreams = slices.DeleteFunc(ex.Upstreams, func(u pool.UpstreamExplanation) bool { return u.State != f.state })
	}
	if f.listener != "" {
		d.mu.Lock()
		lc, ok := d.cfg.listenerNamed(f.listener)
		d.mu.Unlock()
		if !ok {
			return ex, false
		}
		slice := listenerSlices([]listenerConfig{lc})[0]
		ex.Upstreams = slices.DeleteFunc(ex.Upstreams, func(u pool.UpstreamExplanation) bool { return !slice.Covers(u.Service, u.Kind, u.Protocol) })
		ex.Listeners = slices.DeleteFunc(ex.Listeners, func(l pool.ListenerExplanation) bool { return l.Name != f.listener })
	}
	if ex.Upstreams == nil {
		ex.Upstreams = []pool.UpstreamExplanation{}
	}
	if ex.Unserved == nil {
		ex.Unserved = []pool.UnservedExplanation{}
	}
	if ex.Listeners == nil {
		ex.Listeners = []pool.ListenerExplanation{}
	}
	return ex, true
}

// servePool answers GET /pool?service=ID&state=STATE&listener=NAME.
func (d *daemon) servePool(w http.ResponseWriter, r *http.Request) {
	f, err := parsePoolFilter(r)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	ex, ok := d.filterPool(d.pool.Explain(), f)
	if !ok {
		http.Error(w, "unknown listener", http.StatusNotFound)
		return
	}
	ans := poolAnswer{Explanation: ex}
	ans.Account = summarizeAccount(d.poller.Snapshot())
	writeJSON(w, ans)
}

// summarizeAccount is /pool's account part: what has been read of it, nil
// before anything has.
func summarizeAccount(snap agent.Snapshot) *accountSummary {
	if !snap.CreditKnown && !snap.InvoicesKnown {
		return nil
	}
	a := &accountSummary{}
	if snap.CreditKnown {
		a.CreditUSD = &snap.Credit
	}
	if snap.InvoicesKnown {
		a.UnpaidInvoices, a.UnpaidUSD = &snap.UnpaidInvoices, &snap.UnpaidUSD
	}
	return a
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(v)
}

// eventsAnswer is the JSON of GET /events, also read by `proxyd pool -events`.
type eventsAnswer struct {
	Events []eventJSON `json:"events"`
}

type eventJSON struct {
	Time     time.Time      `json:"time"` // RFC 3339, UTC
	Kind     pool.EventKind `json:"kind"`
	Upstream string         `json:"upstream"` // as in /pool, or ""
	Service  int            `json:"service"`  // or 0
	Reason   string         `json:"reason"`
}

// parseEventFilter reads ?upstream=ID&service=ID&kind=KIND; the error is
// the 400 answer's text. An unknown kind is an error, not an empty list,
// so that a typo is not mistaken for a quiet pool.
func parseEventFilter(r *http.Request) (pool.EventFilter, error) {
	q := r.URL.Query()
	f := pool.EventFilter{Upstream: q.Get("upstream"), Kind: pool.EventKind(q.Get("kind"))}
	if s := q.Get("service"); s != "" {
		id, err := strconv.Atoi(s)
		if err != nil || id <= 0 {
			return f, fmt.Errorf("service must be a positive number, got %q", s)
		}
		f.Service = id
	}
	if f.Kind != "" && !slices.Contains(pool.EventKinds(), f.Kind) {
		return f, fmt.Errorf("unknown kind %q", f.Kind)
	}
	return f, nil
}

// serveEvents answers GET /events?upstream=ID&service=ID&kind=KIND: the
// event log (the last 500 events), newest first.
func (d *daemon) serveEvents(w http.ResponseWriter, r *http.Request) {
	f, err := parseEventFilter(r)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	evs := d.events.Events(f)
	out := eventsAnswer{Events: make([]eventJSON, 0, len(evs))}
	for _, e := range evs {
		out.Events = append(out.Events, eventJSON{Time: e.Time.UTC(), Kind: e.Kind, Upstream: e.Upstream, Service: e.Service, Reason: e.Reason})
	}
	writeJSON(w, out)
}
