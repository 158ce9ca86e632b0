package forward

import (
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"time"
)

// Listener protocols.
const (
	ProtocolHTTP   = "http"
	ProtocolSOCKS5 = "socks5"
)

// Defaults applied by NewListener to zero fields of Config.
const (
	DefaultHeaderTimeout    = 10 * time.Second
	DefaultDialTimeout      = 5 * time.Second
	DefaultHandshakeTimeout = 10 * time.Second
	DefaultIdleTimeout      = 5 * time.Minute
	DefaultRetryBudget      = 15 * time.Second
	DefaultResponseTimeout  = 60 * time.Second
	DefaultRetries          = 2
	DefaultMaxConns         = 4096
)

// User is a local proxy user of one listener.
type User struct {
	Name     string
	Password string
}

// Config is one local listener. Zero values mean the documented defaults.
type Config struct {
	// Name is the listener's name; it selects the pool slice (pool.Request.Listener).
	Name string
	// Protocol is "http" (HTTP proxy with CONNECT) or "socks5".
	Protocol string
	// Address is where the listener binds (host:port). Default "127.0.0.1:8080"
	// for http, "127.0.0.1:1080" for socks5.
	Address string

	// Users, when set, are required: HTTP clients without valid credentials get
	// 407, SOCKS5 clients must use RFC 1929 username/password.
	Users []User
	// Allow lists the client networks that may connect; empty means any
	// (which on a non-loopback address requires Users).
	Allow []netip.Prefix
	// AllowDestinations are exceptions to the refused destinations
	// (loopback, link-local, private, unspecified, proxyd's own addresses).
	AllowDestinations []netip.Prefix

	HeaderTimeout    time.Duration // reading a request head or SOCKS handshake; default 10s
	DialTimeout      time.Duration // TCP connect to an upstream; default 5s
	HandshakeTimeout time.Duration // CONNECT/SOCKS answer of an upstream; default 10s
	IdleTimeout      time.Duration // idle tunnel or keep-alive client connection; default 5m
	// RetryBudget bounds the time of all attempts of one connection or
	// request (dials, handshakes and, for a plain request without body, the
	// wait for the answer's head); default 15s.
	RetryBudget time.Duration
	// ResponseTimeout bounds how long a plain request with a body may wait
	// on the upstream: for the answer's head, or to take the next piece of
	// the body (time spent waiting for the client's body does not count);
	// default 60s.
	ResponseTimeout time.Duration

	// Retries is how many more upstreams are tried after the first fails
	// (before any byte reached the client). Default 2; negative means none.
	Retries int
	// MaxConns caps the open client connections; past it clients get 503 or
	// SOCKS reply 0x01. Default 4096.
	MaxConns int
	// SourceAddr, when valid, is the local address outbound connections use.
	SourceAddr netip.Addr
	// RootCAs are the certificate authorities proxyd trusts where it speaks
	// TLS itself (an "https://" request in absolute form); nil means the
	// system's. Verification is never turned off.
	RootCAs *x509.CertPool
}

// withDefaults returns c with zero fields set to their defaults.
func (c Config) withDefaults() Config {
	if c.Protocol == "" {
		c.Protocol = ProtocolHTTP
	}
	if c.Address == "" {
		if c.Protocol == ProtocolSOCKS5 {
			c.Address = "127.0.0.1:1080"
		} else {
			c.Address = "127.0.0.1:8080"
		}
	}
	if c.Name == "" {
		c.Name = c.Protocol
	}
	setDur := func(d *time.Duration, def time.Duration) {
		if *d == 0 {
			*d = def
		}
	}
	setDur(&c.HeaderTimeout, DefaultHeaderTimeout)
	setDur(&c.DialTimeout, DefaultDialTimeout)
	setDur(&c.HandshakeTimeout, DefaultHandshakeTimeout)
	setDur(&c.IdleTimeout, DefaultIdleTimeout)
	setDur(&c.RetryBudget, DefaultRetryBudget)
	setDur(&c.ResponseTimeout, DefaultResponseTimeout)
	if c.Retries == 0 {
		c.Retries = DefaultRetries
	} else if c.Retries < 0 {
		c.Retries = 0
	}
	if c.MaxConns == 0 {
		c.MaxConns = DefaultMaxConns
	}
	return c
}

// Validate reports the first problem with c (after defaults), naming the field.
func (c Config) Validate() error {
	c = c.withDefaults()
	if c.Protocol != ProtocolHTTP && c.Protocol != ProtocolSOCKS5 {
		return fmt.Errorf("protocol: %q is neither %q nor %q", c.Protocol, ProtocolHTTP, ProtocolSOCKS5)
	}
	host, _, err := net.SplitHostPort(c.Address)
	if err != nil {
		return fmt.Errorf("address: %w", err)
	}
	for i, u := range c.Users {
		if u.Name == "" {
			return fmt.Errorf("users[%d].name: empty", i)
		}
		if len(u.Name) > 255 || len(u.Password) > 255 {
			return fmt.Errorf("users[%d]: name and password must be at most 255 bytes (RFC 1929)", i)
		}
		if strings.ContainsAny(u.Name, ":\x00") {
			return fmt.Errorf("users[%d].name: must not contain ':' or NUL", i)
		}
		for j := range i {
			if c.Users[j].Name == u.Name {
				return fmt.Errorf("users[%d].name: %q listed twice", i, u.Name)
			}
		}
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"header_timeout", c.HeaderTimeout}, {"dial_timeout", c.DialTimeout},
		{"handshake_timeout", c.HandshakeTimeout}, {"idle_timeout", c.IdleTimeout},
		{"retry_budget", c.RetryBudget}, {"response_timeout", c.ResponseTimeout},
	} {
		if d.v < 0 {
			return fmt.Errorf("%s: negative duration %s", d.name, d.v)
		}
	}
	if c.MaxConns < 0 {
		return errors.New("max_conns: negative")
	}
	if !IsLoopbackHost(host) && len(c.Users) == 0 && len(c.Allow) == 0 {
		return fmt.Errorf("address: %q is not loopback; set users or allow (a client allow-list)", c.Address)
	}
	return nil
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
