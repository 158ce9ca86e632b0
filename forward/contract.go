package forward

import (
	"context"
	"time"

	"github.com/proxyd/proxyd/pool"
)

// Pool is what a listener needs from the upstream set. *pool.Pool satisfies
// it; tests use fakes built from function fields.
//
// Every successful Pick is followed by exactly one Report (the outcome of
// dial + handshake, with the time it took) and exactly one Release with the
// same Request (when the attempt or the connection it carried is over).
type Pool interface {
	Pick(ctx context.Context, req pool.Request) (*pool.Upstream, error)
	Report(u *pool.Upstream, r pool.Result, took time.Duration)
	Release(u *pool.Upstream, req pool.Request)
}

// Outcome is the result class of one client connection, as counted in
// proxyd_connections_total{result}, and of one plain HTTP request
// (proxyd_http_requests_total{result}).
type Outcome uint8

const (
	OutcomeOK               Outcome = iota // relayed
	OutcomeUpstreamError                   // every upstream tried failed
	OutcomeNoUpstream                      // the pool had nothing usable
	OutcomeDenied                          // auth, allow-list, refused destination, connection cap
	OutcomeClientError                     // malformed request, client went away before it was served
	OutcomeDestinationError                // the upstream worked; the destination refused, failed or did not answer in time
	NumOutcomes
)

var outcomeNames = [NumOutcomes]string{"ok", "upstream_error", "no_upstream", "denied", "client_error", "destination_error"}

func (o Outcome) String() string {
	if o < NumOutcomes {
		return outcomeNames[o]
	}
	return "unknown"
}

// Observer is told about every connection of one listener. Implementations
// must be cheap and must not allocate: they sit on the connection path.
// A nil Observer is allowed and means nothing is counted.
type Observer interface {
	Opened()                                       // a client connection was accepted
	Closed(o Outcome, up, down int64, retries int) // it ended; bytes client→upstream (up) and back (down)
	Dialed(p pool.Protocol, took time.Duration)    // a successful dial + handshake through an upstream
	Hedged()                                       // a plain request was also sent through one more upstream
	// Requested: a plain HTTP request (absolute URI, an upgrade included;
	// not CONNECT) was answered, with result o. A keep-alive connection
	// carries many; Closed reports only its last one.
	Requested(o Outcome)
}
