package pool

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
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

// Config is the [pool] section of the configuration file: health and
// selection options. Each field's tag is its key in the file. Start from
// DefaultConfig and change what the file sets: the pool uses the values it
// is given, so a zero is that zero (its meaning is documented per field, or
// Validate refuses it), never a default.
type Config struct {
	// Strategy picks among usable upstreams: "round-robin", "random",
	// "least-conn" (fewest in-flight connections) or "latency" (lowest
	// moving average of dial + handshake time within a tolerance band).
	Strategy string `toml:"strategy"`
	// FailureThreshold is how many consecutive upstream failures eject an
	// upstream. At least 1.
	FailureThreshold int `toml:"failure_threshold"`
	// EjectBase is the first ejection's duration; the k-th lasts
	// EjectBase × 2^(k-1), ±20 % jitter, at most EjectMax. Positive.
	EjectBase time.Duration `toml:"eject_base"`
	// EjectMax caps an ejection; at least EjectBase. A healthy stretch this
	// long after a re-admission also forgets the ejection history.
	EjectMax time.Duration `toml:"eject_max"`
	// MaxEjectedPercent is the percentage (0–100) of a listener slice's
	// usable upstreams (those the provider does not exclude) that may be
	// ejected at once, rounded down; an ejected upstream the provider
	// excludes counts in neither. Past it a failing upstream stays in
	// with its failures counted, and the slice is in panic mode rather
	// than failing every client. The share holds whatever the order of
	// events: when ejected upstreams count again (off the provider's
	// lists, back from draining) or the cap shrinks, the ejections that
	// would end first end at once and those upstreams stay in the same
	// way. A failure reported for an upstream the provider excludes is
	// counted but does not eject it. 0 never ejects: every upstream that
	// reaches FailureThreshold stays in, and its listeners show panic mode
	// while it keeps failing.
	MaxEjectedPercent int `toml:"max_ejected_percent"`
	// LatencyTolerance is the band of the latency strategy: any upstream
	// whose average is within (1+LatencyTolerance) × the best one's is as
	// good as the best, so load does not herd onto one upstream. 0 keeps
	// only the best (and upstreams exactly as fast). Not negative.
	LatencyTolerance float64 `toml:"latency_tolerance"`
	// StickyIdle is how long a sticky key keeps its upstream with no
	// connection of it open and no new one picked. Positive (sticky_max =
	// 0 is how stickiness is turned off).
	StickyIdle time.Duration `toml:"sticky_idle"`
	// StickyMax is the size of the sticky table; past it the least recently
	// used keys with no connection open are evicted. 0 turns stickiness off: a sticky key is
	// accepted and ignored, and each connection takes the strategy's pick.
	StickyMax int `toml:"sticky_max"`
	// RotateInterval is the least time between two rotations of one ppr
	// sticky session. 0: no pause of proxyd's own; a session is rotated
	// again on its next failure once its last rotation ended (the
	// provider's own limit still applies).
	RotateInterval time.Duration `toml:"rotate_interval"`
	// RotateWait bounds how long a pick for a key whose session is rotating
	// waits for the rotation before it uses another upstream for that one
	// connection. 0: such a pick does not wait.
	RotateWait time.Duration `toml:"rotate_wait"`
	// RotateTimeout bounds one rotation request to the provider. Positive.
	RotateTimeout time.Duration `toml:"rotate_timeout"`
	// ProbeInterval is the period of the active probe of ejected upstreams
	// (a dial and handshake through each, so that a recovered upstream
	// returns without waiting for a client's trial connection). 0 leaves
	// active probing off.
	ProbeInterval time.Duration `toml:"probe_interval"`
	// ProbeBudget is the most probes per minute; at least 1 while
	// ProbeInterval is set, unused otherwise.
	ProbeBudget int `toml:"probe_budget"`
	// ProbeTimeout bounds one probe. Positive.
	ProbeTimeout time.Duration `toml:"probe_timeout"`
	// QuotaHeadroom: a ppr service counts as over quota once its usage
	// rate reaches QuotaHeadroom × its limit; it then takes no new
	// connections while another service can serve the listener. 1 leaves
	// it in until the limit itself; 0.8 moves traffic off at 80 %, so that
	// it spills over before the limit. Above 1 keeps it serving past its
	// limit (for a provider that lets usage run over). Positive.
	QuotaHeadroom float64 `toml:"quota_headroom"`
}

// DefaultConfig returns the defaults of every option: what an absent key
// means.
func DefaultConfig() Config {
	return Config{
		Strategy:          RoundRobin,
		FailureThreshold:  3,
		EjectBase:         30 * time.Second,
		EjectMax:          5 * time.Minute,
		MaxEjectedPercent: 50,
		LatencyTolerance:  0.2,
		StickyIdle:        30 * time.Minute,
		StickyMax:         100000,
		RotateInterval:    30 * time.Second,
		RotateWait:        5 * time.Second,
		RotateTimeout:     30 * time.Second,
		ProbeInterval:     0,
		ProbeBudget:       10,
		ProbeTimeout:      10 * time.Second,
		QuotaHeadroom:     1.0,
	}
}

// Validate reports every problem of c, each as an error whose text starts
// with the key as written in the file, joined with errors.Join; nil when
// there is none.
func (c Config) Validate() error {
	var errs []error
	bad := func(key, format string, args ...any) {
		errs = append(errs, fmt.Errorf(key+": "+format, args...))
	}
	switch c.Strategy {
	case RoundRobin, Random, LeastConn, Latency:
	default:
		bad("strategy", "must be round-robin, random, least-conn or latency, got %q", c.Strategy)
	}
	if c.FailureThreshold < 1 {
		bad("failure_threshold", "must be at least 1, got %d", c.FailureThreshold)
	}
	if c.EjectBase <= 0 {
		bad("eject_base", "must be positive, got %s", c.EjectBase)
	}
	switch {
	case c.EjectMax <= 0:
		bad("eject_max", "must be positive, got %s", c.EjectMax)
	case c.EjectBase > 0 && c.EjectMax < c.EjectBase:
		bad("eject_max", "must not be less than eject_base (%s), got %s", c.EjectBase, c.EjectMax)
	}
	if c.MaxEjectedPercent < 0 || c.MaxEjectedPercent > 100 {
		bad("max_ejected_percent", "must be within 0–100, got %d", c.MaxEjectedPercent)
	}
	switch {
	case !(c.LatencyTolerance >= 0): // NaN too
		bad("latency_tolerance", "must not be negative, got %g", c.LatencyTolerance)
	case math.IsInf(c.LatencyTolerance, 0):
		bad("latency_tolerance", "must be finite, got %g", c.LatencyTolerance)
	}
	if c.StickyIdle <= 0 {
		bad("sticky_idle", "must be positive (sticky_max = 0 turns stickiness off), got %s", c.StickyIdle)
	}
	if c.StickyMax < 0 {
		bad("sticky_max", "must not be negative, got %d", c.StickyMax)
	}
	if c.RotateInterval < 0 {
		bad("rotate_interval", "must not be negative, got %s", c.RotateInterval)
	}
	if c.RotateWait < 0 {
		bad("rotate_wait", "must not be negative, got %s", c.RotateWait)
	}
	if c.RotateTimeout <= 0 {
		bad("rotate_timeout", "must be positive, got %s", c.RotateTimeout)
	}
	if c.ProbeInterval < 0 {
		bad("probe_interval", "must not be negative, got %s", c.ProbeInterval)
	}
	switch {
	case c.ProbeBudget < 0:
		bad("probe_budget", "must not be negative, got %d", c.ProbeBudget)
	case c.ProbeBudget == 0 && c.ProbeInterval > 0:
		bad("probe_budget", "must be at least 1 while probe_interval is set, got 0")
	}
	if c.ProbeTimeout <= 0 {
		bad("probe_timeout", "must be positive, got %s", c.ProbeTimeout)
	}
	if !(c.QuotaHeadroom > 0) || math.IsInf(c.QuotaHeadroom, 0) { // NaN too
		bad("quota_headroom", "must be a positive number, got %g", c.QuotaHeadroom)
	}
	return errors.Join(errs...)
}

// ListenerSlice names the part of the pool one listener draws from.
type ListenerSlice struct {
	Name     string   // Request.Listener
	Services []int    // services feeding the listener; empty = all
	Kind     Kind     // FPR, PPR or "" for both
	Protocol Protocol // how its upstreams are dialed; "" = either
	// Retiring: a listener a reload removed or renamed, whose connections
	// still pick under its name. It serves their picks only: it caps no
	// ejection, is in no panic and is not explained (Listeners, Explain).
	Retiring bool
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
// nil. Failure, Ejected and Rotated are called synchronously where the event
// happens (the connection path, an active probe, a rotation) and must be
// quick; Changed is called from Run's goroutine, coalesced.
type Hooks struct {
	Failure func(service int, r Result)      // an upstream failure was reported by a connection or a probe
	Ejected func(service int)                // an upstream was ejected
	Rotated func(service int, result string) // a rotation asked of the provider ended: "ok", "error", or "rate_limited" (the provider refused it for coming too soon)
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
	// Events is the event log the pool records to: upstreams added and
	// removed, ejected and readmitted, provider marks and their clearing,
	// rotations, quota and panic mode. Default: a log of the pool's own,
	// logging each event to Logger.
	Events *EventLog
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
