// Package providersim is an in-memory simulator of the proxy provider's API
// (the reseller API of FineProxy and Proxy5, version 1.0.2: clients,
// products, services, billing, IP lists, network status, usage and sticky
// sessions under /api/): all 20 endpoints, HTTP Basic authentication
// with the exact error bodies of the specification, and a small stateful
// world (clients, products, services, credit, invoices, IP lists, network
// status, usage and sticky sessions) seeded by New.
//
// It exists so that the API client of package agent and `proxyd demo` run
// against an independent implementation: providersim never imports package
// agent and encodes its own JSON. Where the specification is silent the
// simulator picks one plausible answer (documented on the handlers) and,
// for IP lists and sticky sessions, serves several layouts chosen by
// Layout, so that parsers can be tested against each of them.
//
// Rotating (ppr) gateways serve HTTP and SOCKS5 on different ports of one
// host, as the provider's do, and the provider does not publish its sticky
// session record. The default world is the layout believed most likely:
// ppr lists of IPs, records naming the gateway by host name (StickyGateway,
// which LookupHost resolves to StickyGatewayAddr) with one port, the
// session's HTTP port. Layout.PPRHosts switches to lists that name the
// gateway by host name, Layout.StickyPorts to records carrying a port per
// protocol or none. StartGateway runs such a gateway for real, an HTTP and
// a SOCKS5 Proxy on one IP.
//
// Tests steer it through controls (FailNext, SetLatency, MarkErrored,
// SetEntries, ...) that are safe to call while requests are served.
//
// Choices where the specification is silent (each handler documents its
// own): every endpoint, changettl included, requires authentication (rule
// on Sim.authenticate); services OrphanServiceMin..OrphanServiceMax belong
// to a vanished client and reach the 400 "ClientID not found" form of
// endpoints 8, 9 and 15; unknown services get 422 "Unprocessable Entity"
// (with a trailing space on 2, 3, 8, 9 and 19, as the real provider
// does), unknown invoices []; update_list is accepted once per
// Config.UpdateListInterval per service and the 429 time is UTC; the
// password of PUT must be padded standard base64 of printable text; money
// is exact to the cent; exit IPs of sticky sessions count up in
// 198.51.100.0/24.
//
// Left out: persistence, real billing rules, service status transitions
// other than those set by the controls, and anything over TLS (wrap the
// handler in httptest.NewTLSServer for that).
package providersim

import (
	"context"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"
)

// Config configures a Sim. The zero value is usable: every field has a
// documented default.
type Config struct {
	// Token is the dashboard API token accepted verbatim in
	// "Authorization: Basic <Token>". Default "sim-token".
	Token string
	// Login and Password are accepted as base64(Login + ":" + Password).
	// Defaults "demo@example.com" and "demo-password".
	Login    string
	Password string
	// Layout selects the IP list and sticky list layouts. The zero value is
	// LayoutDefault; unknown names fall back to the defaults (see
	// Layout.Validate to reject them instead).
	Layout Layout
	// Now is the clock used for the update_list rate limit, the 429
	// next-update time, dates of the seeded world, orders and stats.
	// Default time.Now.
	Now func() time.Time
	// UpdateListInterval is the minimum time between two accepted
	// update_list requests of one service. Default 10 minutes.
	UpdateListInterval time.Duration
}

// Defaults of Config.
const (
	DefaultToken              = "sim-token"
	DefaultLogin              = "demo@example.com"
	DefaultPassword           = "demo-password"
	DefaultUpdateListInterval = 10 * time.Minute
)

// Validate reports a Config that New would have to repair: unknown layout
// names, or credentials that could never be sent in a valid header.
func (c Config) Validate() error {
	if strings.ContainsAny(c.Token, " \t\r\n") {
		return errors.New("validating providersim config: token contains white space")
	}
	if strings.Contains(c.Login, ":") {
		return errors.New("validating providersim config: login contains a colon")
	}
	if c.UpdateListInterval < 0 {
		return errors.New("validating providersim config: update_list interval is negative")
	}
	if err := c.Layout.Validate(); err != nil {
		return fmt.Errorf("validating providersim config: %w", err)
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.Token == "" {
		c.Token = DefaultToken
	}
	if c.Login == "" {
		c.Login = DefaultLogin
	}
	if c.Password == "" {
		c.Password = DefaultPassword
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.UpdateListInterval <= 0 {
		c.UpdateListInterval = DefaultUpdateListInterval
	}
	return c
}

// Entry is one line of an IP list. Host is written without brackets; IPv6
// hosts are bracketed when the layout joins host and port.
type Entry struct {
	Host     string
	Port     int
	Login    string
	Password string
}

// Session is one sticky session of a ppr service. Which of its ports its
// record carries is up to Layout.StickyPorts: Port alone (the default),
// HTTPPort and SOCKSPort as "http_port" and "socks_port" or as a "ports"
// object, or none. Zero per-protocol ports are left out of the record.
type Session struct {
	Server    string // gateway host name (or IP), the {server} of rotate
	Session   string // session ID, the {session} of rotate
	Port      int    // the record's one "port"
	HTTPPort  int    // the session's HTTP port on the gateway; 0: none
	SOCKSPort int    // the session's SOCKS5 port on the gateway; 0: none
	ExitIP    string // current exit IP
	TTL       int    // minutes
}

// Sim is the simulated provider. Create it with New; it is an http.Handler
// serving the whole API under /api/.
type Sim struct {
	cfg Config
	mux *http.ServeMux

	mu         sync.Mutex
	layout     Layout
	latency    time.Duration
	failLeft   int
	failStatus int
	failBody   string
	requests   map[string]int
	rotateHook func(service int, server, session string) (int, string)
	w          *world
}

// New returns a simulator seeded with the default world (see world.go).
// Config fields left zero get their defaults.
func New(cfg Config) *Sim {
	cfg = cfg.withDefaults()
	s := &Sim{
		cfg:      cfg,
		layout:   cfg.Layout.withDefaults(),
		requests: make(map[string]int),
		w:        newWorld(cfg.Now()),
	}
	s.mux = s.routes()
	return s
}

// ServeHTTP serves the API. Every request is counted by route template,
// delayed by the configured latency, authenticated, then either answered by
// a pending FailNext or routed to its endpoint.
func (s *Sim) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, pattern := s.mux.Handler(r)
	route := routeTemplate(pattern)

	s.mu.Lock()
	if route != "" {
		s.requests[route]++
		s.requests[r.Method+" "+route]++
	}
	latency := s.latency
	s.mu.Unlock()

	if latency > 0 && !sleepCtx(r.Context(), latency) {
		return // the client has gone; nobody reads an answer
	}

	if status, body := s.authenticate(r.Header.Get("Authorization")); status != 0 {
		writeText(w, status, body)
		return
	}

	s.mu.Lock()
	if s.failLeft > 0 {
		s.failLeft--
		status, body := s.failStatus, s.failBody
		s.mu.Unlock()
		writeRaw(w, status, body)
		return
	}
	s.mu.Unlock()

	s.mux.ServeHTTP(w, r)
}

// routeTemplate turns a ServeMux pattern ("GET /api/x/{id}") into the route
// template counted by Requests ("/api/x/{id}").
func routeTemplate(pattern string) string {
	if _, path, ok := strings.Cut(pattern, " "); ok {
		return path
	}
	return pattern
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// Authentication error bodies of the provider's API (text/plain), byte-exact.
const (
	BodyUnauthenticated          = "Unauthenticated"
	BodyInvalidAuthorizationHead = "Invalid Authorization header"
	BodyInvalidCredentialsFormat = "Invalid credentials format"
)

// authenticate returns a non-zero status and the text body when the
// Authorization header is refused. The rule:
//
//   - no header: 401 Unauthenticated;
//   - not "Basic <credential>" with one non-empty credential (other scheme,
//     no credential, white space inside it): 400 Invalid Authorization header;
//   - the credential equal to the token: accepted;
//   - the credential is strict standard base64 of printable text: with a
//     colon it is login:password (accepted when both match, else 401);
//     without a colon: 400 Invalid credentials format;
//   - anything else (not base64, or base64 of binary data): 401.
func (s *Sim) authenticate(header string) (int, string) {
	if header == "" {
		return http.StatusUnauthorized, BodyUnauthenticated
	}
	scheme, cred, ok := strings.Cut(header, " ")
	cred = strings.TrimSpace(cred)
	if !ok || !strings.EqualFold(scheme, "Basic") || cred == "" || strings.ContainsAny(cred, " \t") {
		return http.StatusBadRequest, BodyInvalidAuthorizationHead
	}
	if subtle.ConstantTimeCompare([]byte(cred), []byte(s.cfg.Token)) == 1 {
		return 0, ""
	}
	raw, err := base64.StdEncoding.Strict().DecodeString(cred)
	if err != nil || !printable(raw) {
		return http.StatusUnauthorized, BodyUnauthenticated
	}
	login, password, ok := strings.Cut(string(raw), ":")
	if !ok {
		return http.StatusBadRequest, BodyInvalidCredentialsFormat
	}
	loginOK := subtle.ConstantTimeCompare([]byte(login), []byte(s.cfg.Login)) == 1
	passOK := subtle.ConstantTimeCompare([]byte(password), []byte(s.cfg.Password)) == 1
	if loginOK && passOK {
		return 0, ""
	}
	return http.StatusUnauthorized, BodyUnauthenticated
}

func printable(b []byte) bool {
	if len(b) == 0 || !utf8.Valid(b) {
		return false
	}
	for _, r := range string(b) {
		if !unicode.IsPrint(r) {
			return false
		}
	}
	return true
}

func writeText(w http.ResponseWriter, status int, body string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write([]byte(body))
}

// writeRaw answers body verbatim, labelled JSON when it looks like JSON.
func writeRaw(w http.ResponseWriter, status int, body string) {
	trimmed := strings.TrimSpace(body)
	if strings.HasPrefix(trimmed, "{") || strings.HasPrefix(trimmed, "[") {
		w.Header().Set("Content-Type", "application/json")
	} else {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	}
	w.WriteHeader(status)
	_, _ = w.Write([]byte(body))
}

// Controls. All are safe for concurrent use with serving. Controls naming
// a service that does not exist do nothing.

// SetLayout changes the IP list and sticky list layouts for later requests.
func (s *Sim) SetLayout(l Layout) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.layout = l.withDefaults()
}

// SetEntries replaces the IP list of type typ ("http-auth", "http-ip",
// "socks-ip", "ppr-http", "ppr-socks") of a service. Entries of http-ip and
// socks-ip are served without credentials whatever they carry.
func (s *Sim) SetEntries(id int, typ string, entries []Entry) {
	s.withService(id, func(sv *service) { sv.lists[typ] = slices.Clone(entries) })
}

// MarkErrored adds IPs to the networkstatus/errors list of a service.
func (s *Sim) MarkErrored(id int, ips ...string) {
	s.withService(id, func(sv *service) { sv.errored = addUnique(sv.errored, ips) })
}

// MarkInactive adds IPs to the networkstatus/inactive list of a service.
func (s *Sim) MarkInactive(id int, ips ...string) {
	s.withService(id, func(sv *service) { sv.inactive = addUnique(sv.inactive, ips) })
}

// SetGateway makes LookupHost resolve the gateway host name to addrs (no
// addresses: the name no longer resolves). Names are compared
// case-insensitively. Under Layout.PPRHosts "name", ppr list entries on one
// of addrs are written with the name instead.
func (s *Sim) SetGateway(name string, addrs ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	name = strings.ToLower(name)
	if len(addrs) == 0 {
		delete(s.w.gateways, name)
		return
	}
	s.w.gateways[name] = slices.Clone(addrs)
}

// LookupHost is the simulated DNS of the provider's gateway host names,
// with the signature of net.Resolver.LookupHost so that a test can hand it
// to the code that resolves a sticky record's server: the addresses set by
// SetGateway (StickyGateway resolves to StickyGatewayAddr in the default
// world), an IP literal itself, and for any other name a *net.DNSError
// with IsNotFound.
func (s *Sim) LookupHost(ctx context.Context, host string) ([]string, error) {
	if err := ctx.Err(); err != nil {
		return nil, &net.DNSError{Err: err.Error(), Name: host, IsTimeout: true}
	}
	if a, err := netip.ParseAddr(strings.Trim(host, "[]")); err == nil {
		return []string{a.String()}, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if addrs, ok := s.w.gateways[strings.ToLower(strings.TrimSuffix(host, "."))]; ok {
		return slices.Clone(addrs), nil
	}
	return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
}

// ClearStatus empties both network status lists of a service.
func (s *Sim) ClearStatus(id int) {
	s.withService(id, func(sv *service) { sv.errored, sv.inactive = nil, nil })
}

// SetUsage sets what /api/rate answers for a service and today's entry of
// /api/stats (when the service has stats).
func (s *Sim) SetUsage(id int, rate, limit float64) {
	s.withService(id, func(sv *service) {
		sv.usageRate, sv.usageLimit, sv.noUsage = rate, limit, false
		if n := len(sv.stats); n > 0 {
			sv.stats[n-1] = rate
		}
	})
}

// ClearUsage makes /api/rate answer an empty array for a service, as the
// provider may for one it has no figures for; SetUsage gives it figures
// again.
func (s *Sim) ClearUsage(id int) {
	s.withService(id, func(sv *service) { sv.noUsage = true })
}

// SetProductType changes a service's product type ("fpr" or "ppr"), as an
// upgrade or downgrade to another product does; the list endpoints then
// answer for the new type, and /api/rate only for "ppr".
func (s *Sim) SetProductType(id int, typ string) {
	s.withService(id, func(sv *service) { sv.typ = typ })
}

// SetServiceStatus sets the status of a service (Active, Pending,
// Suspended, Terminated, Cancelled, Fraud; other strings are served as
// given).
func (s *Sim) SetServiceStatus(id int, status string) {
	s.withService(id, func(sv *service) { sv.status = status })
}

// SetStickySessions replaces the sticky sessions of a service.
func (s *Sim) SetStickySessions(id int, sessions []Session) {
	s.withService(id, func(sv *service) { sv.sessions = slices.Clone(sessions) })
}

// Sessions returns a copy of the current sticky sessions of a service,
// after any rotation, reset or TTL change.
func (s *Sim) Sessions(id int) []Session {
	var out []Session
	s.withService(id, func(sv *service) { out = slices.Clone(sv.sessions) })
	return out
}

// withService runs f on a service under the lock; nothing happens for a
// service that does not exist.
func (s *Sim) withService(id int, f func(*service)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if sv := s.w.services[id]; sv != nil {
		f(sv)
	}
}

// FailNext makes the next n requests (any route, after authentication)
// answer status with body verbatim, labelled application/json when body
// starts with { or [, text/plain otherwise. n <= 0 cancels a pending
// failure.
func (s *Sim) FailNext(n int, status int, body string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failLeft, s.failStatus, s.failBody = max(n, 0), status, body
}

// SetLatency delays every answer by d. A request whose context ends during
// the delay gets no answer.
func (s *Sim) SetLatency(d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.latency = d
}

// Requests returns how many requests matched a route template, counted on
// arrival whatever their answer (auth errors and FailNext included). The
// template is the path of the spec ("/api/iplist/{typel}/{formatl}/{id}"),
// optionally prefixed by a method ("POST /api/product/{pid}") to count one
// method only.
func (s *Sim) Requests(route string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.requests[route]
}

// Credit returns the account credit in USD.
func (s *Sim) Credit() float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return float64(s.w.creditCents) / 100
}

// RotateHook installs an override for /api/sticky/rotate answers. The hook
// runs for every authenticated rotate request, outside the simulator's
// lock; a non-zero status answers that status with body verbatim (as
// FailNext does) and leaves the sessions alone, status 0 lets the request
// be handled normally. nil removes the hook.
func (s *Sim) RotateHook(hook func(service int, server, session string) (status int, body string)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.rotateHook = hook
}

func addUnique(list, add []string) []string {
	for _, ip := range add {
		if !slices.Contains(list, ip) {
			list = append(list, ip)
		}
	}
	return list
}

// SetCredit sets the account credit in USD (rounded to cents).
func (s *Sim) SetCredit(usd float64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.w.creditCents = int64(math.Round(usd * 100))
}
