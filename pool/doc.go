// Package pool is proxyd's upstream set: which upstream carries each client
// connection, and what the daemon learns from the outcome.
//
// An upstream is one dialable proxy endpoint; its identity is (service,
// protocol, host:port, session), so a refresh of the set keeps the state of
// upstreams that stay. The pool combines the provider's view of its network
// (errored and inactive IPs, usage against quota_headroom × limit) with
// passive health: only failures of the upstream itself (dial refused or
// timed out, no or malformed handshake answer, authentication rejected,
// other proxy errors) count, and consecutive ones eject an upstream for an
// exponentially growing, jittered time, after which one trial connection
// decides. A cap per listener slice keeps ejection from emptying it: past
// it failing upstreams stay in and the listener is in panic mode.
// Strategies (round-robin, random, least-conn, latency) are pure functions
// over an immutable snapshot that Pick reads through an atomic pointer;
// per-upstream state is atomics. Sticky keys live in a sharded table
// bounded in size and idle time, except that a key with a connection open
// stays; a failing ppr sticky session, or one whose exit IP is errored, is
// rotated through a Rotator, once for all of its upstreams (one per
// protocol it can be dialed with, or none: an UnservedSession).
//
// Config is the [pool] section of the configuration file, and SetConfig
// swaps a new one in while the pool serves. What happens to upstreams
// (added, removed, ejected, readmitted, provider marks, rotations, quota,
// panic) is recorded in an EventLog, the ring behind the admin endpoint
// GET /events.
//
// Left out: dialing and relaying (forward), talking to the provider (agent,
// which implements Rotator), metrics (which read Explain or Listeners at
// scrape time).
package pool
