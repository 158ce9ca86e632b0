package pool

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"
)

// Strategy names accepted by Config.Strategy.
const (
	RoundRobin = "round-robin"
	Random     = "random"
	LeastConn  = "least-conn"
	Latency    = "latency"
)

// Config holds the pool's health and selection options. The zero value of
// every field means its documented default; Validate rejects the rest.
type Config struct {
	// Strategy picks among usable upstreams: "round-robin" (default),
	// "random", "least-conn" (fewest in-flight connections) or "latency"
	// (lowest moving average of dial + handshake time within a tolerance band).
	Strategy string
	// FailureThreshold is how many consecutive upstream failures eject an
	// upstream. Default 3.
	FailureThreshold int
	// EjectBase is the first ejection's duration; the k-th lasts
	// EjectBase × 2^(k-1), ±20 % jitter, at most EjectMax. Default 30s.
	EjectBase time.Duration
	// EjectMax caps an ejection. Default 5m.
	EjectMax time.Duration
	// MaxEjectedShare is the share (0–1] of a listener slice's usable
	// upstreams that may be ejected at once; past it the slice is in panic
	// mode and failing upstreams stay in. Default 0.5.
	MaxEjectedShare float64
	// LatencyTolerance is the band of the latency strategy: any upstream
	// whose average is within (1+LatencyTolerance) × the best one's is as
	// good as the best, so load does not herd onto one upstream. Default 0.2.
	LatencyTolerance float64
	// StickyIdle is how long an unused sticky key keeps its upstream.
	// Default 30m.
	StickyIdle time.Duration
	// StickyMax is the size of the sticky table; past it the least recently
	// used keys are evicted. Default 100000.
	StickyMax int
	// RotateInterval is the least time between two rotations of one ppr
	// sticky session. Default 30s.
	RotateInterval time.Duration
	// RotateWait bounds how long a pick for a key whose session is rotating
	// waits for the rotation before it uses another upstream for that one
	// connection. Default 5s.
	RotateWait time.Duration
	// RotateTimeout bounds one call of the Rotator. Default 30s.
	RotateTimeout time.Duration
	// ProbeInterval is the period of the active probe of ejected upstreams.
	// Zero (the default) leaves active probing off.
	ProbeInterval time.Duration
	// ProbeBudget is the most probes per minute. Default 10.
	ProbeBudget int
	// ProbeTimeout bounds one probe. Default 10s.
	ProbeTimeout time.Duration
}

// Defaults of Config's zero fields.
const (
	DefaultFailureThreshold = 3
	DefaultEjectBase        = 30 * time.Second
	DefaultEjectMax         = 5 * time.Minute
	DefaultMaxEjectedShare  = 0.5
	DefaultLatencyTolerance = 0.2
	DefaultStickyIdle       = 30 * time.Minute
	DefaultStickyMax        = 100000
	DefaultRotateInterval   = 30 * time.Second
	DefaultRotateWait       = 5 * time.Second
	DefaultRotateTimeout    = 30 * time.Second
	DefaultProbeBudget      = 10
	DefaultProbeTimeout     = 10 * time.Second
)

// Validate reports the first problem of c, naming the option.
func (c Config) Validate() error {
	switch c.Strategy {
	case "", RoundRobin, Random, LeastConn, Latency:
	default:
		return fmt.Errorf("strategy: must be round-robin, random, least-conn or latency, got %q", c.Strategy)
	}
	switch {
	case c.FailureThreshold < 0:
		return fmt.Errorf("failure_threshold: must not be negative, got %d", c.FailureThreshold)
	case c.EjectBase < 0:
		return fmt.Errorf("eject_base: must not be negative, got %s", c.EjectBase)
	case c.EjectMax < 0:
		return fmt.Errorf("eject_max: must not be negative, got %s", c.EjectMax)
	case !(c.MaxEjectedShare >= 0 && c.MaxEjectedShare <= 1): // NaN too
		return fmt.Errorf("max_ejected_share: must be within 0–1, got %g", c.MaxEjectedShare)
	case !(c.LatencyTolerance >= 0): // NaN too
		return fmt.Errorf("latency_tolerance: must not be negative, got %g", c.LatencyTolerance)
	case c.StickyIdle < 0:
		return fmt.Errorf("sticky_idle: must not be negative, got %s", c.StickyIdle)
	case c.StickyMax < 0:
		return fmt.Errorf("sticky_max: must not be negative, got %d", c.StickyMax)
	case c.RotateInterval < 0:
		return fmt.Errorf("rotate_interval: must not be negative, got %s", c.RotateInterval)
	case c.RotateWait < 0:
		return fmt.Errorf("rotate_wait: must not be negative, got %s", c.RotateWait)
	case c.RotateTimeout < 0:
		return fmt.Errorf("rotate_timeout: must not be negative, got %s", c.RotateTimeout)
	case c.ProbeInterval < 0:
		return fmt.Errorf("probe_interval: must not be negative, got %s", c.ProbeInterval)
	case c.ProbeBudget < 0:
		return fmt.Errorf("probe_budget: must not be negative, got %d", c.ProbeBudget)
	case c.ProbeTimeout < 0:
		return fmt.Errorf("probe_timeout: must not be negative, got %s", c.ProbeTimeout)
	}
	d := c.withDefaults()
	if d.EjectMax < d.EjectBase {
		return fmt.Errorf("eject_max: must not be less than eject_base (%s), got %s", d.EjectBase, d.EjectMax)
	}
	return nil
}

// withDefaults returns c with every zero field set to its default.
func (c Config) withDefaults() Config {
	c.Strategy = cmp.Or(c.Strategy, RoundRobin)
	c.FailureThreshold = cmp.Or(c.FailureThreshold, DefaultFailureThreshold)
	c.EjectBase = cmp.Or(c.EjectBase, DefaultEjectBase)
	c.EjectMax = cmp.Or(c.EjectMax, DefaultEjectMax)
	c.MaxEjectedShare = cmp.Or(c.MaxEjectedShare, DefaultMaxEjectedShare)
	c.LatencyTolerance = cmp.Or(c.LatencyTolerance, DefaultLatencyTolerance)
	c.StickyIdle = cmp.Or(c.StickyIdle, DefaultStickyIdle)
	c.StickyMax = cmp.Or(c.StickyMax, DefaultStickyMax)
	c.RotateInterval = cmp.Or(c.RotateInterval, DefaultRotateInterval)
	c.RotateWait = cmp.Or(c.RotateWait, DefaultRotateWait)
	c.RotateTimeout = cmp.Or(c.RotateTimeout, DefaultRotateTimeout)
	c.ProbeBudget = cmp.Or(c.ProbeBudget, DefaultProbeBudget)
	c.ProbeTimeout = cmp.Or(c.ProbeTimeout, DefaultProbeTimeout)
	return c
}

// ListenerSlice names the part of the pool one listener draws from.
type ListenerSlice struct {
	Name     string   // Request.Listener
	Services []int    // services feeding the listener; empty = all
	Kind     Kind     // FPR, PPR or "" for both
	Protocol Protocol // how its upstreams are dialed; "" = either
}

// Covers reports whether an upstream of this service, kind and protocol
// belongs to the slice.
func (s *ListenerSlice) Covers(service int, kind Kind, protocol Protocol) bool {
	if s.Kind != "" && kind != s.Kind {
		return false
	}
	if s.Protocol != "" && protocol != s.Protocol {
		return false
	}
	return len(s.Services) == 0 || slices.Contains(s.Services, service)
}

// Rotator asks the provider for a new exit IP of a ppr sticky session
// (sticky/rotate/{service}/{server}/{session}). The agent implements it.
//
// An error that says the provider refused because the session was rotated
// too recently should match ErrRotateRateLimited with errors.Is, or have a
// method RateLimited() bool returning true; it is counted as "rate_limited".
type Rotator interface {
	Rotate(ctx context.Context, service int, server, session string) (exitIP string, err error)
}

// Prober checks one ejected upstream for the optional active probe: a dial
// and handshake through it, reported as a Result.
type Prober interface {
	Probe(ctx context.Context, u *Upstream) Result
}

// Hooks are told about events, for metrics and the state file. Any may be
// nil. Failure, Ejected and Rotated are called synchronously on the
// connection path and must be quick; Changed is called from Run's goroutine,
// coalesced.
type Hooks struct {
	Failure func(service int, r Result)      // an upstream failure was reported
	Ejected func(service int)                // an upstream was ejected
	Rotated func(service int, result string) // a rotation ended: "ok", "error", or "rate_limited" (by the provider, or held back within RotateInterval)
	Changed func()                           // the set or its state changed
}

// Options are the pool's collaborators. Every field may be left zero.
type Options struct {
	Now     func() time.Time // clock; default time.Now, read on the hot path only through a copy Run refreshes every 100ms
	Rand    func() uint64    // random source, safe for concurrent use; default math/rand/v2
	Rotator Rotator          // nil: ppr sessions are never rotated
	Prober  Prober           // required when Config.ProbeInterval is set
	Hooks   Hooks
	Logger  *slog.Logger // default: discard
}

// Errors returned by the pool.
var (
	// ErrNoUpstream means no upstream of the listener slice is usable now.
	ErrNoUpstream = errors.New("no usable upstream")
	// ErrUnknownListener means Request.Listener names no listener slice.
	ErrUnknownListener = errors.New("unknown listener")
	// ErrRotateRateLimited is what a Rotator's error may wrap when the
	// provider refused a rotation because of its per-session interval.
	ErrRotateRateLimited = errors.New("rotation rate limited")
)
