package forward

import (
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"time"

	"github.com/proxyd/proxyd/forward/socks5"
)

// Listener protocols.
const (
	ProtocolHTTP   = "http"
	ProtocolSOCKS5 = "socks5"
)

// User is a local proxy user of one listener (a [[listener.user]] table).
// Its password is written inline or read from PasswordFile; a Listener
// checks Password alone, so whoever builds one from a file's config reads
// PasswordFile into Password first (the daemon does, at start and at every
// reload).
type User struct {
	Name         string `toml:"name"`
	Password     string `toml:"password,secret"`
	PasswordFile string `toml:"password_file"`
}

// Network is a client or destination network of an allow-list: written
// "10.0.0.0/8", or a bare address "192.0.2.7" for that one address (/32,
// or /128 for IPv6).
type Network struct{ netip.Prefix }

// ParseNetwork parses a network as the file writes it.
func ParseNetwork(s string) (Network, error) {
	var n Network
	err := n.UnmarshalText([]byte(s))
	return n, err
}

// MustParseNetwork is ParseNetwork for constants; it panics on an error.
func MustParseNetwork(s string) Network {
	n, err := ParseNetwork(s)
	if err != nil {
		panic(err)
	}
	return n
}

// UnmarshalText implements encoding.TextUnmarshaler.
func (n *Network) UnmarshalText(b []byte) error {
	s := string(b)
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return fmt.Errorf("must be a network such as \"10.0.0.0/8\" or an IP address, got %q", s)
		}
		n.Prefix = p.Masked()
		return nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil || a.Zone() != "" {
		return fmt.Errorf("must be a network such as \"10.0.0.0/8\" or an IP address, got %q", s)
	}
	n.Prefix = netip.PrefixFrom(a, a.BitLen())
	return nil
}

// MarshalText implements encoding.TextMarshaler: always the prefix form.
func (n Network) MarshalText() ([]byte, error) {
	if !n.IsValid() {
		return []byte{}, nil
	}
	return []byte(n.Prefix.String()), nil
}

// String is the prefix form ("192.0.2.7/32").
func (n Network) String() string { return n.Prefix.String() }

// Config is one local listener: the forwarding keys of a [[listener]]
// table. Start from DefaultConfig: every field is used as it is, zero
// included, with the meaning its comment gives (or refused by Validate).
type Config struct {
	// Name is the listener's name; it selects the pool slice
	// (pool.Request.Listener). Required.
	Name string `toml:"name"`
	// Protocol is "http" (HTTP proxy with CONNECT) or "socks5". Required.
	Protocol string `toml:"protocol"`
	// Address is where the listener binds (host:port). Required.
	Address string `toml:"address"`

	// Users, when set, are required: HTTP clients without valid credentials get
	// 407, SOCKS5 clients must use RFC 1929 username/password. Empty: no
	// local users (credentials optional, read only for a sticky key).
	Users []User `toml:"user"`
	// Allow lists the client networks that may connect; empty means any
	// (which on a non-loopback address requires Users).
	Allow []Network `toml:"allow"`
	// AllowDestinations are exceptions to the refused destinations
	// (loopback, link-local, private, unspecified, proxyd's own addresses).
	// Empty: no exceptions.
	AllowDestinations []Network `toml:"allow_destinations"`

	// HeaderTimeout bounds reading a client's request head or SOCKS5
	// greeting and request; it ends once the request is read. 0 is refused.
	HeaderTimeout time.Duration `toml:"header_timeout"`
	// DialTimeout bounds the TCP connect to an upstream. 0 is refused.
	DialTimeout time.Duration `toml:"dial_timeout"`
	// HandshakeTimeout bounds an upstream's answer to CONNECT or to the
	// SOCKS5 handshake. 0 is refused.
	HandshakeTimeout time.Duration `toml:"handshake_timeout"`
	// IdleTimeout ends a tunnel with no traffic either way (also one half
	// closed, whose remaining reader stalls), a kept-alive client
	// connection between requests, a client that stalls while sending a
	// request body, one that stops reading its answer, and an answer whose
	// body stalls (no byte from the upstream for that long, on proxyd's
	// own connections and through net/http's Transport alike). 0 is
	// refused.
	IdleTimeout time.Duration `toml:"idle_timeout"`
	// Retries is how many more upstreams are tried after one failed before
	// any byte reached the client. 0: no retry. Negative is refused.
	Retries int `toml:"retries"`
	// RetryTimeout bounds the attempts of one connection or request: a
	// tunnel's (CONNECT, SOCKS5) attempts end when it runs out, and a plain
	// request is not tried on another upstream after it. 0 is refused.
	RetryTimeout time.Duration `toml:"retry_timeout"`
	// MaxConnections caps the open client connections; past it clients get
	// 503 or SOCKS reply 0x01. 0 is refused.
	MaxConnections int `toml:"max_connections"`
	// SourceAddress, when set, is the local address outbound connections
	// use. Unset (the zero Addr, written ""): the system chooses.
	SourceAddress netip.Addr `toml:"source_address"`
	// HedgeDelay: after this long without an answer head, a plain request
	// that can be sent again (GET, HEAD, OPTIONS, TRACE or one with an
	// Idempotency-Key, without body, not sticky, not on a ppr upstream,
	// an http:// request through an HTTP upstream, which relays the
	// destination's head itself) also goes through one more upstream; the
	// first answer from the destination wins. 0: hedging off. Negative is
	// refused.
	HedgeDelay time.Duration `toml:"hedge_delay"`
	// ResponseTimeout is the longest a plain request waits for its answer
	// head, counted from when it was first sent (time spent waiting for the
	// client's body does not count); then the client gets 504 and no
	// upstream is blamed, unless its upstream answered nothing at all in
	// that time while the listener's other upstreams answered. It bounds a
	// WebSocket upgrade's wait for the origin's 101 too (504, nobody
	// blamed). 0 is refused.
	ResponseTimeout time.Duration `toml:"response_timeout"`

	// RootCAs are the certificate authorities proxyd trusts where it speaks
	// TLS itself (an "https://" request in absolute form); nil means the
	// system's. Verification is never turned off.
	RootCAs *x509.CertPool `toml:"-"`
}

// DefaultConfig is a listener's configuration before its file keys are
// applied. Name, Protocol and Address have no default here: they are set
// per listener.
func DefaultConfig() Config {
	return Config{
		HeaderTimeout:    10 * time.Second,
		DialTimeout:      5 * time.Second,
		HandshakeTimeout: 10 * time.Second,
		IdleTimeout:      5 * time.Minute,
		Retries:          2,
		RetryTimeout:     15 * time.Second,
		MaxConnections:   4096,
		HedgeDelay:       2 * time.Second,
		ResponseTimeout:  5 * time.Minute,
	}
}

// LocalAddr is the address connections to upstreams are dialed from
// (SourceAddress), for a net.Dialer; nil when the system chooses.
func (c Config) LocalAddr() net.Addr {
	if !c.SourceAddress.IsValid() {
		return nil
	}
	return &net.TCPAddr{IP: c.SourceAddress.AsSlice(), Zone: c.SourceAddress.Zone()}
}

// Validate reports every problem with c, each an error whose text starts
// with the key as the file writes it ("retry_timeout: must be positive,
// got 0s"), joined with errors.Join; nil when there is none.
func (c Config) Validate() error {
	var errs []error
	fail := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if c.Name == "" {
		fail("name: required")
	}
	switch c.Protocol {
	case ProtocolHTTP, ProtocolSOCKS5:
	case "":
		fail("protocol: required")
	default:
		fail("protocol: must be http or socks5, got %q", c.Protocol)
	}
	host, hostOK := "", false
	if c.Address == "" {
		fail("address: required, e.g. \"127.0.0.1:8080\"")
	} else if h, _, err := net.SplitHostPort(c.Address); err != nil {
		fail("address: must be host:port: %v", err)
	} else {
		host, hostOK = h, true
	}
	for i, u := range c.Users {
		switch {
		case u.Name == "":
			fail("user[%d].name: required", i)
		case strings.ContainsAny(u.Name, ":\x00"):
			fail("user[%d].name: must not contain ':' or NUL", i)
		case strings.Contains(u.Name, "-session-") || strings.HasPrefix(u.Name, "session-"):
			// "<user>-session-<key>" must split one way only.
			fail("user[%d].name: must not contain \"-session-\" nor start with \"session-\"", i)
		}
		switch {
		case u.Password == "" && u.PasswordFile == "":
			fail("user[%d].password: required (or password_file)", i)
		case u.Password != "" && u.PasswordFile != "":
			fail("user[%d]: password and password_file are both set", i)
		}
		if len(u.Name) > socks5.MaxCredentialBytes || len(u.Password) > socks5.MaxCredentialBytes {
			fail("user[%d]: name and password must be at most 255 bytes (RFC 1929)", i)
		}
		for j := range i {
			if u.Name != "" && c.Users[j].Name == u.Name {
				fail("user[%d].name: %q listed twice", i, u.Name)
				break
			}
		}
	}
	for _, l := range []struct {
		key  string
		nets []Network
	}{{"allow", c.Allow}, {"allow_destinations", c.AllowDestinations}} {
		for i, n := range l.nets {
			if !n.IsValid() {
				fail("%s[%d]: not a network", l.key, i)
			}
		}
	}
	for _, d := range []struct {
		key string
		v   time.Duration
	}{
		{"header_timeout", c.HeaderTimeout}, {"dial_timeout", c.DialTimeout},
		{"handshake_timeout", c.HandshakeTimeout}, {"idle_timeout", c.IdleTimeout},
		{"retry_timeout", c.RetryTimeout}, {"response_timeout", c.ResponseTimeout},
	} {
		if d.v <= 0 {
			fail("%s: must be positive, got %s", d.key, d.v)
		}
	}
	if c.HedgeDelay < 0 {
		fail("hedge_delay: must not be negative (\"0s\" turns hedging off), got %s", c.HedgeDelay)
	}
	if c.Retries < 0 {
		fail("retries: must not be negative (0 turns retries off), got %d", c.Retries)
	}
	if c.MaxConnections <= 0 {
		fail("max_connections: must be positive, got %d", c.MaxConnections)
	}
	if hostOK && !IsLoopbackHost(host) && len(c.Users) == 0 && len(c.Allow) == 0 {
		fail("address: %s is not a loopback address: configure [[listener.user]] or allow", c.Address)
	}
	return errors.Join(errs...)
}

// IsLoopbackHost reports whether a listen host binds only to loopback.
// An empty host binds to every address and is not loopback.
func IsLoopbackHost(host string) bool {
	if host == "localhost" {
		return true
	}
	a, err := netip.ParseAddr(host)
	return err == nil && a.Unmap().IsLoopback()
}
