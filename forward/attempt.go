package forward

import (
	"context"
	"errors"
	"net"
	"time"

	"github.com/proxyd/proxyd/forward/socks5"
	"github.com/proxyd/proxyd/pool"
)

// tunnelFailure is why no tunnel could be opened.
type tunnelFailure struct {
	outcome Outcome
	last    *dialError // the last attempt's failure; nil when none was tried
}

// httpStatus is what an HTTP client is told.
func (f *tunnelFailure) httpStatus() int {
	if f.last != nil && f.last.result == pool.DestinationError && f.last.status == 504 {
		return 504
	}
	return 502
}

// socksReply is what a SOCKS client is told.
func (f *tunnelFailure) socksReply() byte {
	if f.last != nil && f.last.result == pool.DestinationError && f.last.reply != 0 {
		return f.last.reply
	}
	return socks5.ReplyGeneralFailure
}

// budget returns a context bounding all attempts of one connection.
func (l *Listener) budget(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeoutCause(ctx, l.cfg.RetryTimeout, errAttemptTimeout)
}

// openTunnel picks upstreams and opens a tunnel to dest through the first
// that works, trying up to Retries more after upstream faults. On success
// the caller owns conn and must call l.pool.Release(u) when done.
func (l *Listener) openTunnel(ctx context.Context, key string, dest socks5.Addr) (conn net.Conn, u *pool.Upstream, retries int, fail *tunnelFailure) {
	ctx, cancel := l.budget(ctx)
	defer cancel()
	req := pool.Request{Listener: l.cfg.Name, Key: key}
	fail = &tunnelFailure{outcome: OutcomeNoUpstream}
	for attempt := 0; attempt <= l.cfg.Retries; attempt++ {
		if ctx.Err() != nil {
			break
		}
		up, err := l.pool.Pick(ctx, req)
		if err != nil || up == nil {
			break
		}
		start := time.Now()
		c, derr := l.dialer.tunnel(ctx, up, dest)
		took := time.Since(start)
		if derr == nil {
			l.pool.Report(up, pool.Success, took)
			l.obs.Dialed(up.Protocol, took)
			return c, up, attempt, nil
		}
		l.pool.Report(up, derr.result, took)
		l.pool.Release(up)
		fail.last = derr
		fail.outcome = OutcomeUpstreamError
		retries = attempt
		if derr.result == pool.Canceled {
			fail.outcome = OutcomeClientError
			break
		}
		if !derr.result.UpstreamFault() {
			break // the destination failed: another upstream would not help
		}
		l.log.Debug("upstream attempt failed", "upstream", up.ID(), "result", derr.result.String(), "err", derr.err)
		req.Avoid = append(req.Avoid, up.ID())
	}
	if ctx.Err() != nil && errors.Is(context.Cause(ctx), errAttemptTimeout) && fail.outcome == OutcomeNoUpstream {
		fail.outcome = OutcomeUpstreamError
	}
	return nil, nil, retries, fail
}
