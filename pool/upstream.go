package pool

import (
	"strconv"
	"time"
)

// Protocol is how an upstream is dialed.
type Protocol string

const (
	HTTP   Protocol = "http"   // HTTP proxy: CONNECT for tunnels, absolute-URI for plain requests
	SOCKS5 Protocol = "socks5" // SOCKS5 proxy, RFC 1928/1929
)

// Kind is the provider's product type of the service an upstream belongs to.
type Kind string

const (
	FPR Kind = "fpr" // static proxies
	PPR Kind = "ppr" // rotating proxies, optionally with sticky sessions
)

// Upstream is one dialable proxy endpoint: protocol and host:port,
// credentials, the service it belongs to and its product type, and for a
// ppr sticky session the session it stands for. Its exported fields
// are set by whoever builds the upstream set and never change afterwards: a
// changed exit IP or credential comes with the next Update. The pool keeps its
// own mutable health state behind the unexported field, so a *Upstream handed
// out by Pick is the key for Report and Release.
type Upstream struct {
	Service  int
	Kind     Kind
	Protocol Protocol
	Address  string // host:port; IPv6 hosts in brackets
	Username string
	Password string
	Server   string // ppr sticky session: the gateway host name ({server} of rotate)
	Session  string // ppr sticky session id ({session} of rotate)
	ExitIP   string // ppr sticky session: the current exit IP, when known
	// Match says what named this ppr sticky session's port for its
	// protocol: "record" (the session record named a port for the
	// protocol), "list" (the record's one port is in this protocol's IP
	// list), "single" (the list's only entry for the session's server);
	// "" for upstreams that stand for no session. Not part of the ID.
	Match string
	// StatusIP is the IP address by which the provider's network-status
	// lists name this upstream's proxy when Address names it by host name
	// (a rotating gateway); "" when Address's host is what they name. Not
	// part of the ID.
	StatusIP string

	h *host // owned by the pool; nil on upstreams that no pool handed out
	// trial: this pick holds h's one trial connection after an ejection
	// (Pick hands a copy of h's upstream to the pick that claims it), so
	// that only its Report decides, not a late one of a connection picked
	// before the ejection; trialOf is that ejection's number (ejections),
	// so that a trial whose ejection ended otherwise (a late success, a
	// rotation) decides no later one.
	trial   bool
	trialOf int64
}

// UnservedSession is a ppr sticky session that the provider lists but no
// upstream stands for: no IP list vouches for a port of it in any protocol
// dialed. It serves no connection, yet its exit IP is the provider's: when
// it is on the errored list, the pool rotates the session as it does one
// with upstreams (at most once per RotateInterval, the same Rotated hook
// and events; an event with no upstream names the session in its reason).
type UnservedSession struct {
	Service         int
	Server, Session string // the {server} and {session} of sticky/rotate
	ExitIP          string // the current exit IP, when known
}

// ID is the stable identity of an upstream: service/protocol/address, plus
// /session for a ppr sticky session (credentials, exit IP and Match are not
// part of it). A refresh that yields the same ID keeps
// the upstream's state.
func (u *Upstream) ID() string {
	if h := u.h; h != nil && h.cur.Load() == u {
		return h.id // computed once, when the pool first saw the upstream
	}
	// Not the pool's current value (a copy, or replaced by a rotation):
	// its fields may say otherwise.
	var buf [64]byte
	return string(appendID(buf[:0], u))
}

// appendID appends u's ID to b: Update looks IDs up in a reused buffer.
func appendID(b []byte, u *Upstream) []byte {
	b = strconv.AppendInt(b, int64(u.Service), 10)
	b = append(b, '/')
	b = append(b, u.Protocol...)
	b = append(b, '/')
	b = append(b, u.Address...)
	if u.Session != "" {
		b = append(b, '/')
		b = append(b, u.Session...)
	}
	return b
}

// Result is what happened when a connection was tried through an upstream:
// success, a failure of the upstream itself (one of the failure classes
// below, the only outcomes that count toward ejection), or something that
// says nothing about the upstream: what points at the destination, or a
// connection that ended before any verdict.
type Result uint8

const (
	Success          Result = iota // the upstream carried the connection
	DialRefused                    // TCP connect refused or reset
	DialTimeout                    // TCP connect did not complete in time
	HandshakeTimeout               // no or malformed answer to CONNECT / SOCKS in time
	AuthRejected                   // 407, SOCKS auth failure
	ProxyError                     // other CONNECT answers than 2xx/502/504; SOCKS 0x01, 0x07, 0x08
	DestinationError               // the upstream worked, the destination failed (CONNECT 502/504, SOCKS 0x02–0x06)
	Canceled                       // the client left or the daemon stopped before an answer: no verdict
	numResults
)

var resultNames = [numResults]string{
	Success:          "ok",
	DialRefused:      "dial_refused",
	DialTimeout:      "dial_timeout",
	HandshakeTimeout: "handshake_timeout",
	AuthRejected:     "auth_rejected",
	ProxyError:       "proxy_error",
	DestinationError: "destination_error",
	Canceled:         "canceled",
}

// String is the failure class as it appears in metrics and /pool ("dial_refused").
func (r Result) String() string {
	if r < numResults {
		return resultNames[r]
	}
	return "unknown"
}

// UpstreamFault reports whether r counts against the upstream's health.
func (r Result) UpstreamFault() bool { return r >= DialRefused && r <= ProxyError }

// FailureReasons are the label values of proxyd_upstream_failures_total.
func FailureReasons() []string {
	var out []string
	for r := DialRefused; r.UpstreamFault(); r++ {
		out = append(out, r.String())
	}
	return out
}

// State of an upstream as the admin endpoint GET /pool shows it.
type State string

const (
	Healthy          State = "healthy"
	Probing          State = "probing"
	Ejected          State = "ejected"
	Rotating         State = "rotating"
	Draining         State = "draining"
	ProviderError    State = "provider_error"
	ProviderInactive State = "provider_inactive"
	Quota            State = "quota"
)

// States lists every state, in /pool order; metrics pre-create a series for each.
func States() []State {
	return []State{Healthy, Probing, Ejected, Rotating, Draining, ProviderError, ProviderInactive, Quota}
}

// Request asks for an upstream for one connection attempt.
type Request struct {
	Listener string   // the listener slice to draw from (as named in Config.Listeners)
	Key      string   // sticky key, already scoped by local user; "" for none
	Avoid    []string // IDs of upstreams this connection already tried
}

// Explanation is what the admin endpoint GET /pool shows, as JSON. It never
// holds a password or token.
type Explanation struct {
	Updated   time.Time             `json:"updated"`
	Listeners []ListenerExplanation `json:"listeners"`
	Upstreams []UpstreamExplanation `json:"upstreams"`
	Unserved  []UnservedExplanation `json:"unserved_sessions"`
}

// UnservedExplanation is a ppr sticky session the provider lists that no
// upstream stands for (no IP list of its service gives its port): it takes
// no connection, but when its exit IP is on the provider's errored list it
// is rotated as any session is.
type UnservedExplanation struct {
	Service     int    `json:"service"`
	Server      string `json:"server"`
	Session     string `json:"session"`
	ExitIP      string `json:"exit_ip"`
	ExitErrored bool   `json:"exit_errored"` // its exit IP is on the provider's errored list
	Rotating    bool   `json:"rotating"`     // its rotation is under way
}

type ListenerExplanation struct {
	Name   string `json:"name"`
	Usable int    `json:"usable"`
	Total  int    `json:"total"`
	Panic  bool   `json:"panic"`
}

type UpstreamExplanation struct {
	ID                  string     `json:"id"`
	Service             int        `json:"service"`
	Kind                Kind       `json:"kind"`
	Protocol            Protocol   `json:"protocol"`
	Address             string     `json:"address"`
	Server              string     `json:"server"`
	Session             string     `json:"session"`
	ExitIP              string     `json:"exit_ip"`
	Match               string     `json:"match"`
	State               State      `json:"state"`
	Reason              string     `json:"reason"`
	Failures            int64      `json:"failures"`
	ConsecutiveFailures int64      `json:"consecutive_failures"`
	Ejections           int64      `json:"ejections"`
	EjectedUntil        *time.Time `json:"ejected_until"`
	InFlight            int64      `json:"in_flight"`
}
