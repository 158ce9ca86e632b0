package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"strings"

	"github.com/proxyd/proxyd/agent"
	"github.com/proxyd/proxyd/forward"
	"github.com/proxyd/proxyd/pool"
)

// This file maps the file format onto each package's own Config.

func poolConfig(c poolSection) pool.Config {
	return pool.Config{
		Strategy:         c.Strategy,
		FailureThreshold: c.FailureThreshold,
		EjectBase:        c.EjectBase.D(),
		EjectMax:         c.EjectMax.D(),
		MaxEjectedShare:  float64(c.MaxEjectedPercent) / 100,
		LatencyTolerance: c.LatencyTolerance,
		StickyIdle:       c.StickyIdle.D(),
		StickyMax:        c.StickyMax,
		RotateInterval:   c.RotateInterval.D(),
		RotateWait:       c.RotateWait.D(),
		ProbeInterval:    c.ProbeInterval.D(),
		ProbeBudget:      c.ProbeBudget,
	}
}

// poolUpstream is the pool's upstream for one the agent derived, unchanged.
// The state file's savedUpstream has the same fields and converts to
// agent.UpstreamSpec.
func poolUpstream(u agent.UpstreamSpec) pool.Upstream {
	return pool.Upstream{
		Service: u.Service, Kind: pool.Kind(u.Kind), Protocol: pool.Protocol(u.Protocol),
		Address: u.Address, Username: u.Username, Password: u.Password,
		Server: u.Server, Session: u.Session, ExitIP: u.ExitIP,
	}
}

// upstream is how the listener's upstreams are dialed: its own protocol
// unless set.
func (l listenerConfig) upstream() string { return cmp.Or(l.Upstream, l.Protocol) }

func listenerSlices(ls []listenerConfig) []pool.ListenerSlice {
	out := make([]pool.ListenerSlice, len(ls))
	for i, l := range ls {
		out[i] = pool.ListenerSlice{Name: l.Name, Services: l.Services, Kind: pool.Kind(l.Kind), Protocol: pool.Protocol(l.upstream())}
	}
	return out
}

func forwardConfig(l listenerConfig) (forward.Config, error) {
	fc := forward.Config{
		Name:             l.Name,
		Protocol:         l.Protocol,
		Address:          l.Address,
		HeaderTimeout:    l.HeaderTimeout.D(),
		DialTimeout:      l.DialTimeout.D(),
		HandshakeTimeout: l.HandshakeTimeout.D(),
		IdleTimeout:      l.IdleTimeout.D(),
		RetryBudget:      l.RetryTimeout.D(),
		Retries:          l.Retries,
		MaxConns:         l.MaxConnections,
	}
	if l.Retries == 0 {
		fc.Retries = -1 // forward reads 0 as its default
	}
	for _, u := range l.User {
		fc.Users = append(fc.Users, forward.User{Name: u.Name, Password: u.Password})
	}
	for _, a := range l.Allow {
		p, err := parsePrefix(a)
		if err != nil {
			return fc, err
		}
		fc.Allow = append(fc.Allow, p)
	}
	for _, a := range l.AllowDestinations {
		p, err := parsePrefix(a)
		if err != nil {
			return fc, err
		}
		fc.AllowDestinations = append(fc.AllowDestinations, p)
	}
	if l.SourceAddress != "" {
		a, err := netip.ParseAddr(l.SourceAddress)
		if err != nil {
			return fc, err
		}
		fc.SourceAddr = a
	}
	return fc, nil
}

func pollConfig(c config) agent.PollConfig {
	pc := agent.PollConfig{
		Services:      c.API.Services,
		IPList:        c.Poll.IPList.D(),
		NetworkStatus: c.Poll.NetworkStatus.D(),
		Usage:         c.Poll.Usage.D(),
		Account:       c.Poll.Account.D(),
		Jitter:        c.Poll.Jitter,
		MaxBackoff:    c.Poll.MaxBackoff.D(),
	}
	for _, l := range c.Listener {
		if up := l.upstream(); !slices.Contains(pc.Protocols, up) {
			pc.Protocols = append(pc.Protocols, up)
		}
	}
	return pc
}

// wireProblems asks each package to validate its part of a config that
// passed the file-level checks, and names the key of each problem.
func wireProblems(c *config) configErrors {
	var errs configErrors
	if err := poolConfig(c.Pool).Validate(); err != nil {
		errs = append(errs, keyError{Key: "pool", Msg: err.Error()})
	}
	if err := pollConfig(*c).Validate(); err != nil {
		errs = append(errs, keyError{Key: "poll", Msg: err.Error()})
	}
	for i, l := range c.Listener {
		fc, err := forwardConfig(l)
		if err == nil {
			err = fc.Validate()
		}
		if err != nil {
			errs = append(errs, keyError{Key: fmt.Sprintf("listener[%d]", i), Msg: err.Error()})
		}
	}
	return errs
}

// newLogger builds the daemon's logger; its level can change on reload
// through the returned LevelVar (the format needs a restart).
func newLogger(c logConfig, w io.Writer) (*slog.Logger, *slog.LevelVar) {
	level := new(slog.LevelVar)
	level.Set(logLevel(c.Level))
	opts := &slog.HandlerOptions{Level: level}
	if c.Format == "json" {
		return slog.New(slog.NewJSONHandler(w, opts)), level
	}
	return slog.New(slog.NewTextHandler(w, opts)), level
}

func logLevel(s string) slog.Level {
	switch strings.ToLower(s) {
	case "debug":
		return slog.LevelDebug
	case "warn":
		return slog.LevelWarn
	case "error":
		return slog.LevelError
	}
	return slog.LevelInfo
}

// tcpProber is the active probe of ejected upstreams: a TCP connect and, for
// SOCKS5, the method greeting. It reaches no destination, so probing costs
// the provider's pool nothing but a connection. Its bound is ctx's deadline,
// which the pool sets (pool.Config.ProbeTimeout).
type tcpProber struct{}

func (tcpProber) Probe(ctx context.Context, u *pool.Upstream) pool.Result {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", u.Address)
	if err != nil {
		if ctx.Err() != nil {
			return pool.DialTimeout
		}
		return pool.DialRefused
	}
	defer c.Close()
	if u.Protocol != pool.SOCKS5 {
		return pool.Success
	}
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	if _, err := c.Write([]byte{5, 2, 0, 2}); err != nil {
		return pool.HandshakeTimeout
	}
	var reply [2]byte
	if _, err := io.ReadFull(c, reply[:]); err != nil || reply[0] != 5 {
		return pool.HandshakeTimeout
	}
	if reply[1] == 0xff {
		return pool.AuthRejected
	}
	return pool.Success
}
