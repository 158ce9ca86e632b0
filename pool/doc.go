// Package pool is proxyd's upstream set (DESIGN.md §2, §5, §7): which
// upstream carries each client connection, and what the daemon learns from
// the outcome.
//
// It combines the provider's view of its network (errored and inactive IPs,
// usage quota) with passive health: upstream failures eject an upstream for
// an exponentially growing, jittered time, after which one trial connection
// decides; a cap per listener slice keeps ejection from emptying it (panic
// mode). Strategies (round-robin, random, least-conn, latency) are pure
// functions over an immutable snapshot that Pick reads through an atomic
// pointer; per-upstream state is atomics. Sticky keys live in a bounded,
// sharded table; a failing ppr sticky session is rotated through a Rotator.
//
// Left out: dialing and relaying (forward), talking to the provider (agent,
// which implements Rotator), metrics (which read Explain or Listeners at
// scrape time).
package pool
