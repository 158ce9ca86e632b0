package main

import (
	"context"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"time"

	"github.com/proxyd/proxyd/agent"
	"github.com/proxyd/proxyd/pool"
)

// This file composes the packages: what one section means for another.

// poolUpstream is the pool's upstream for one the agent derived, unchanged.
// The state file's savedUpstream has the same fields and converts to
// agent.UpstreamSpec.
func poolUpstream(u agent.UpstreamSpec) pool.Upstream {
	return pool.Upstream{
		Service: u.Service, Kind: pool.Kind(u.Kind), Protocol: pool.Protocol(u.Protocol),
		Address: u.Address, Username: u.Username, Password: u.Password,
		Server: u.Server, Session: u.Session, ExitIP: u.ExitIP, Match: u.Match, StatusIP: u.StatusIP,
	}
}

func listenerSlices(ls []listenerConfig) []pool.ListenerSlice {
	out := make([]pool.ListenerSlice, len(ls))
	for i, l := range ls {
		out[i] = pool.ListenerSlice{Name: l.Name, Services: l.Services, Kind: pool.Kind(l.Kind), Protocol: pool.Protocol(l.Upstream)}
	}
	return out
}

// pollConfig is [poll] with the services of [api]. What the listeners
// draw is added by daemon.pollConfig: a function, which reload plans
// cannot compare, so they compare drawnBy instead.
func pollConfig(c config) agent.PollConfig {
	pc := c.Poll
	pc.Services = c.API.Services
	return pc
}

// draws is agent.PollConfig.Draws for these listeners, by the pool's own
// rule of which upstreams a listener draws (ListenerSlice.Covers): lists
// no listener draws are not fetched.
func draws(ls []pool.ListenerSlice) func(service int, kind, protocol string) bool {
	return func(service int, kind, protocol string) bool {
		for i := range ls {
			if ls[i].Covers(service, pool.Kind(kind), pool.Protocol(protocol)) {
				return true
			}
		}
		return false
	}
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
// which the pool sets (pool.Config.ProbeTimeout), or ctx's cancellation.
// It dials from the source_address of the first listener (in the file's
// order) that dials the upstream, as that listener's connections do: an
// upstream that admits clients by their IP answers the probe as it
// answers them.
type tcpProber struct {
	from atomic.Pointer[[]probeFrom]
}

// probeFrom is one listener's upstreams and the address it dials them from.
type probeFrom struct {
	slice pool.ListenerSlice
	addr  net.Addr
}

// setListeners takes the running listeners, at start and on each reload.
func (p *tcpProber) setListeners(ls []listenerConfig) {
	from := make([]probeFrom, len(ls))
	for i, sl := range listenerSlices(ls) {
		from[i] = probeFrom{sl, ls[i].LocalAddr()}
	}
	p.from.Store(&from)
}

// localAddr is the address to probe u from; nil: the system's choice.
func (p *tcpProber) localAddr(u *pool.Upstream) net.Addr {
	if from := p.from.Load(); from != nil {
		for i := range *from {
			if f := &(*from)[i]; f.slice.Covers(u.Service, u.Kind, u.Protocol) {
				return f.addr
			}
		}
	}
	return nil
}

func (p *tcpProber) Probe(ctx context.Context, u *pool.Upstream) pool.Result {
	d := net.Dialer{LocalAddr: p.localAddr(u)}
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
	// Cancelled (proxyd stopping), it ends at once, not at the deadline.
	defer context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })()
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
