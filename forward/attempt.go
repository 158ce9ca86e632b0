package forward

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/proxyd/proxyd/forward/socks5"
	"github.com/proxyd/proxyd/pool"
)

// Every client connection (CONNECT, SOCKS5, WebSocket upgrade) and every
// plain request goes through one attempt loop, run: pick an upstream, make
// one attempt through it, classify what happened, report it to the pool,
// release the upstream unless it carries the connection, and after a
// failure of the upstream itself try the next one, avoiding those tried,
// within one budget. A plain request that can be sent again is also hedged:
// after hedge_delay without an answer head it goes through one more
// upstream as well, and the first head from the destination wins. The
// paths differ only in how one attempt is made (job.do).

// what is what happened in one attempt, as the attempt saw it. Whose fault
// it was is classify's answer.
type what uint8

const (
	// wAnswered: the tunnel is open, or the answer head came from the destination.
	wAnswered what = iota
	// wDialRefused: the TCP connect to the upstream was refused, reset or unreachable.
	wDialRefused
	// wDialTimeout: the TCP connect to the upstream did not complete in time.
	wDialTimeout
	// wNoAnswer: the upstream's answer did not come in time (handshake),
	// was malformed, or its connection closed first.
	wNoAnswer
	// wProxyAnswer: the upstream answered for itself (status, squid): a
	// CONNECT answer other than 2xx, or a plain answer it generated (407,
	// or one that carries X-Squid-Error).
	wProxyAnswer
	// wSOCKSReply: a SOCKS5 upstream replied with a failure code (reply).
	wSOCKSReply
	// wSOCKSAuth: a SOCKS5 upstream refused proxyd's credentials.
	wSOCKSAuth
	// wSOCKSAddress: a SOCKS5 upstream cannot take the destination's address.
	wSOCKSAddress
	// wTLS: the upstream carried the connection and the destination's TLS
	// failed (an "https://" request in absolute form).
	wTLS
	// wResponseTimeout: a plain request had no answer head within
	// response_timeout.
	wResponseTimeout
	// wSilent: as wResponseTimeout, and the upstream answered nothing at
	// all in that time while other upstreams of the listener answered;
	// only where the upstream itself relays the head (an "http://" request
	// through an HTTP upstream), never through a tunnel it opened.
	wSilent
	// wOutrun: the hedge's head from the destination came within
	// hedge_delay of the hedge being sent, while this attempt had none.
	wOutrun
	// wCalledOff: the other attempt of the request answered first (and
	// this one was not outrun as above).
	wCalledOff
	// wClientGone: the client left, its request body broke or stalled past
	// idle_timeout, or the listener closed.
	wClientGone
	// wStale: a kept upstream connection turned out closed before any byte
	// of the answer came back.
	wStale
	// wLocal: proxyd itself could not open a connection (out of file
	// descriptors or buffers): nobody else's fault.
	wLocal
	// wDestinationGone: a tunnel reached the destination (through a SOCKS5
	// upstream, or CONNECT for an "https://" request), and the destination
	// closed it, reset it, failed its TLS handshake in time or sent no
	// valid answer head: the upstream only carried the bytes.
	wDestinationGone
	// wBudget: a tunnel's attempts ran out of retry_timeout while this one
	// was still within its own bound (dial_timeout, handshake_timeout): the
	// upstream had less time than it is given, so nobody is blamed.
	wBudget
	numWhat
)

// happened is one attempt's account, the input of classify.
type happened struct {
	what   what
	status int    // wProxyAnswer: the upstream's HTTP status
	squid  string // wProxyAnswer: its X-Squid-Error, if any
	reply  byte   // wSOCKSReply: the SOCKS5 reply code
	// unanswered (wNoAnswer, wBudget): the upstream took the request
	// (CONNECT, or SOCKS5 after answering the greeting), which it answers
	// only once it reached the destination, and the answer had not come
	// when handshake_timeout (or the budget, after a quarter of it) ended the
	// attempt. Whose fault that is, run decides by comparison.
	unanswered bool
}

// squidDestinationErrors are the X-Squid-Error values that say the
// destination failed while Squid itself worked: connect, DNS, reading or
// writing, an empty or broken answer, a timeout.
var squidDestinationErrors = []string{
	"ERR_CONNECT_FAIL", "ERR_DNS_FAIL", "ERR_READ_TIMEOUT", "ERR_READ_ERROR",
	"ERR_WRITE_ERROR", "ERR_ZERO_SIZE_OBJECT", "ERR_LIFETIME_EXP", "ERR_CANNOT_FORWARD",
	"ERR_GATEWAY_FAILURE", "ERR_SECURE_CONNECT_FAIL", "ERR_INVALID_RESP",
}

// squidOwnAnswer reports whether a plain answer with status and
// X-Squid-Error value v, through an HTTP upstream, is the upstream's own:
// Squid sends its error pages with a 4xx or 5xx status, and a deny_info
// redirect as a 3xx whose X-Squid-Error is "NNN Access Denied". Any other
// answer carrying the header is a destination's (a site behind a Squid of
// its own). That site's own error pages carry it too, and cannot be told
// from the upstream's.
func squidOwnAnswer(status int, v string) bool {
	switch {
	case v == "":
		return false
	case status >= 400:
		return true
	case status >= 300:
		code, text, _ := strings.Cut(strings.TrimSpace(v), " ")
		_, err := strconv.Atoi(code)
		return len(code) == 3 && err == nil && strings.EqualFold(strings.TrimSpace(text), "Access Denied")
	}
	return false
}

// squidCode is the error name of an X-Squid-Error value ("ERR_CONNECT_FAIL 111").
func squidCode(v string) string {
	code, _, _ := strings.Cut(strings.TrimSpace(v), " ")
	return code
}

func squidDestinationError(v string) bool {
	code := squidCode(v)
	for _, e := range squidDestinationErrors {
		if code == e {
			return true
		}
	}
	return false
}

// classify says whose fault an attempt's outcome was: a pool.Result. Only
// failures of the upstream itself count against it; what points at the
// destination (CONNECT 502/504, a Squid error naming the destination, SOCKS
// replies 0x02–0x06, a TLS failure, a destination that answers slowly or not
// at all) never does, and neither does a client that left or an attempt
// called off.
func classify(h happened) pool.Result {
	switch h.what {
	case wAnswered:
		return pool.Success
	case wDialRefused:
		return pool.DialRefused
	case wDialTimeout:
		return pool.DialTimeout
	case wNoAnswer, wSilent, wOutrun:
		return pool.HandshakeTimeout
	case wProxyAnswer:
		switch {
		case h.status == http.StatusProxyAuthRequired:
			return pool.AuthRejected
		case h.status == http.StatusBadGateway || h.status == http.StatusGatewayTimeout:
			return pool.DestinationError
		case h.status >= 500 && squidDestinationError(h.squid):
			return pool.DestinationError
		}
		return pool.ProxyError
	case wSOCKSReply:
		if h.reply >= socks5.ReplyNotAllowed && h.reply <= socks5.ReplyTTLExpired {
			return pool.DestinationError
		}
		return pool.ProxyError
	case wSOCKSAuth:
		return pool.AuthRejected
	case wSOCKSAddress, wTLS, wResponseTimeout, wDestinationGone:
		return pool.DestinationError
	}
	return pool.Canceled // wCalledOff, wClientGone, wStale, wLocal, wBudget: no verdict
}

// answer is what a client is told when no attempt succeeded, and how its
// connection is counted.
type answer struct {
	outcome Outcome
	status  int    // HTTP status
	text    string // the short body that goes with it
	reply   byte   // SOCKS5 reply code
}

// answerNoUpstream is the answer when the pool had nothing to try.
var answerNoUpstream = answer{OutcomeNoUpstream, http.StatusBadGateway, textBadGateway, socks5.ReplyGeneralFailure}

// answerFor maps the failed attempt that decides (h, classified as r) to
// what the client gets: the one place that turns a failure into a status
// and a SOCKS reply.
func answerFor(h happened, r pool.Result) answer {
	timeout := h.what == wResponseTimeout || h.what == wSilent || h.status == http.StatusGatewayTimeout ||
		h.what == wSOCKSReply && h.reply == socks5.ReplyTTLExpired ||
		squidCode(h.squid) == "ERR_READ_TIMEOUT" || squidCode(h.squid) == "ERR_LIFETIME_EXP"
	switch {
	case h.what == wClientGone:
		return answer{OutcomeClientError, http.StatusBadRequest, textBadRequest, socks5.ReplyGeneralFailure}
	case h.what == wLocal:
		return answer{OutcomeUpstreamError, http.StatusServiceUnavailable, textUnavailable, socks5.ReplyGeneralFailure}
	case r == pool.DestinationError:
		a := answer{OutcomeDestinationError, http.StatusBadGateway, textBadGateway, socks5.ReplyHostUnreachable}
		switch {
		case h.what == wSOCKSReply:
			a.reply = h.reply
		case h.what == wSOCKSAddress:
			a.reply = socks5.ReplyAddressNotSupported
		case squidCode(h.squid) == "ERR_CONNECT_FAIL":
			a.reply = socks5.ReplyConnectionRefused
		}
		if timeout || h.unanswered {
			a.status, a.text = http.StatusGatewayTimeout, textTimeout
			if h.what != wSOCKSReply {
				a.reply = socks5.ReplyTTLExpired
			}
		}
		return a
	case timeout: // an upstream blamed for its silence: still the answer of a timeout
		return answer{OutcomeUpstreamError, http.StatusGatewayTimeout, textTimeout, socks5.ReplyTTLExpired}
	}
	return answer{OutcomeUpstreamError, http.StatusBadGateway, textBadGateway, socks5.ReplyGeneralFailure}
}

// attemptError is why one attempt failed: what happened and the error
// behind it (for the debug log).
type attemptError struct {
	h   happened
	err error
}

func (e *attemptError) Error() string {
	return classify(e.h).String() + ": " + e.err.Error()
}
func (e *attemptError) Unwrap() error { return e.err }

func failed(w what, err error) *attemptError { return &attemptError{h: happened{what: w}, err: err} }

// Why the loop ends an attempt it no longer needs (the context's cause).
var (
	// errAttemptTimeout: the budget of a tunnel's attempts (retry_timeout) ran out.
	errAttemptTimeout = errors.New("retry budget exhausted")
	// errResponseTimeout: a plain request had no answer head within response_timeout.
	errResponseTimeout = errors.New("no response head in time")
	// errOutrun: the hedge's destination head came within hedge_delay.
	errOutrun = errors.New("outrun by a hedge that answered at once")
	// errCalledOff: the other attempt of the request answered first.
	errCalledOff = errors.New("the other attempt answered first")
)

// loopCause maps the cause of a plain attempt's ended context to what
// happened, or false when the loop did not end it (the client left, the
// listener closed; a tunnel's budget is the attempt's own to classify).
func loopCause(ctx context.Context) (what, bool) {
	switch cause := context.Cause(ctx); {
	case errors.Is(cause, errResponseTimeout):
		return wResponseTimeout, true
	case errors.Is(cause, errOutrun):
		return wOutrun, true
	case errors.Is(cause, errCalledOff):
		return wCalledOff, true
	}
	return wClientGone, false
}

// tryResult is what one attempt hands back to the loop.
type tryResult struct {
	h    happened
	err  error          // the failure behind h, for the debug log
	conn net.Conn       // a tunnel: the connection to the destination
	resp *http.Response // a plain request: the answer (its body still to read)
	// took is how long the attempt took (dial and handshake when it dialed).
	took   time.Duration
	dialed bool // a new upstream connection was opened and answered
	// tunneled: a plain request went through a tunnel to the destination
	// (a SOCKS5 upstream, or CONNECT for "https://"), which the upstream
	// answered when it opened it: a head that does not come is the
	// destination's, whatever other upstreams answered meanwhile.
	tunneled bool
}

// discard frees what a result holds: it lost, or failed late.
func (r *tryResult) discard() {
	if r.conn != nil {
		_ = r.conn.Close()
		r.conn = nil
	}
	if r.resp != nil {
		_ = r.resp.Body.Close()
		r.resp = nil
	}
}

// job is one thing the loop gets through an upstream: a tunnel to a
// destination, or a plain request's answer head.
type job struct {
	key string
	// do makes one attempt through up. It returns when the attempt has its
	// answer or failed, and soon after ctx ends.
	do func(ctx context.Context, up *pool.Upstream) tryResult
	// plain: the request's answer head is awaited up to response_timeout,
	// counted from the first send, on clock (which the job pauses while it
	// waits for its client's body); without plain, the attempts are bounded
	// by retry_timeout.
	plain bool
	clock *upstreamClock
	// again reports whether the job may still be sent after a failed
	// attempt (nothing of a request body consumed); nil means yes.
	again func() bool
	// hedge: the job can be sent again while an attempt is in flight.
	hedge bool
	// scheme is a plain request's URL scheme (relaysHead).
	scheme string
	// resendStale: the job may go out again after a kept connection closed
	// under it (an idempotent request).
	resendStale bool
	// sends counts the times the job went out to a destination (send).
	sends atomic.Int32
}

// maxSends: a destination receives one request at most twice, retries,
// the hedge and a resend over a replaced kept connection counted together.
const maxSends = 2

// send takes one of the job's sends just before it goes out; false when
// they are used up, and it must not go out.
func (j *job) send() bool {
	for {
		n := j.sends.Load()
		if n >= maxSends {
			return false
		}
		if j.sends.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// unsend gives back a send whose request cannot have reached the
// destination (refused by the upstream itself, or never written).
func (j *job) unsend() { j.sends.Add(-1) }

// try is one attempt in flight.
type try struct {
	up     *pool.Upstream
	ctx    context.Context
	cancel context.CancelCauseFunc
	start  time.Time
	hedge  bool
	res    tryResult
	result pool.Result
}

// loop is the state of one run.
type loop struct {
	l    *Listener
	j    *job
	base context.Context // the parent of picks and attempts
	req  pool.Request

	mu       sync.Mutex
	winner   *try
	inflight []*try
	expired  bool // a plain request's response_timeout ran out
	hedge    *try // the hedge, once sent

	// pending are the attempts whose upstream took the request and did not
	// answer it within handshake_timeout (happened.unanswered), not yet
	// reported: the upstream's silence, or the destination's? What the
	// other attempts meet tells (run). silent holds the addresses of every
	// upstream silent so (the pending ones, and those the budget cut after
	// a fair wait). Upstreams that stand for a sticky session are left
	// out (several share a gateway's address, and their failure asks for
	// a rotation at once).
	pending []*try
	silent  map[string]bool
	// destFailed: an attempt's upstream reported the destination failed
	// (CONNECT 502/504, SOCKS5 0x02–0x06, …): a witness as good as a
	// second silence.
	destFailed bool
}

// run gets j through an upstream. On success the winner's upstream is not
// released and its context not ended: the caller releases the upstream and
// cancels the context when the connection or answer is done. Otherwise a is
// what the client is told. retries counts the attempts made after a failure.
func (l *Listener) run(ctx context.Context, j *job) (win *try, a answer, retries int) {
	if !j.plain {
		var stop context.CancelFunc
		ctx, stop = context.WithTimeoutCause(ctx, l.cfg.RetryTimeout, errAttemptTimeout)
		defer stop()
	}
	lp := &loop{l: l, j: j, base: ctx, req: l.request(j.key)}
	start := time.Now()
	a = answerNoUpstream
	var attempts int
	var last *try // the attempt that decided the answer
	for !lp.over() {
		up, err := l.pool.Pick(ctx, lp.req)
		if err != nil || up == nil {
			break
		}
		if attempts > 0 {
			retries++
		}
		attempts++
		t, _ := lp.begin(up, false)
		if j.plain && j.clock == nil { // the first send starts the response clock
			j.clock = newUpstreamClock(l.cfg.ResponseTimeout, lp.expire)
			defer j.clock.stop()
		}
		var (
			timer  *time.Timer
			hedged chan struct{} // closed when the hedge timer's work is over
		)
		if j.hedge && j.sends.Load() == 0 && l.cfg.HedgeDelay > 0 && hedgeable(up, j) {
			hedged = make(chan struct{})
			timer = time.AfterFunc(l.cfg.HedgeDelay, func() { lp.sendHedge(t, hedged) })
		}
		t.res = j.do(t.ctx, up)
		if timer != nil && timer.Stop() {
			hedged = nil // it never ran
		}
		lp.settle(t)
		round := []*try{t}
		if hedged != nil {
			<-hedged // the hedge was sent and settled, or given up
			if h := lp.hedge; h != nil {
				round = append(round, h)
			}
			lp.hedge = nil
		}
		if w := lp.winner; w != nil {
			// The destination answered through another upstream at
			// once: those that did not were silent.
			lp.judge(pool.HandshakeTimeout)
			l.pool.Report(w.up, pool.Success, w.res.took)
			if w.res.dialed {
				l.obs.Dialed(w.up.Protocol, w.res.took)
			}
			return w, answer{}, retries
		}
		// The failure that decides the client's answer: the last one that
		// says something about an upstream or the destination.
		decisive := t
		again := true
		for _, f := range round {
			if f.result != pool.Canceled {
				decisive = f
			}
			switch {
			case f.res.h.what == wStale:
				again = again && j.resendStale
			case !f.result.UpstreamFault():
				again = false // the destination failed, or the client left: no other upstream helps
			}
			lp.destFailed = lp.destFailed || f.result == pool.DestinationError
			lp.req.Avoid = append(lp.req.Avoid, f.up.ID())
		}
		last = decisive
		a = answerFor(decisive.res.h, decisive.result)
		if !again || attempts > l.cfg.Retries || j.sends.Load() >= maxSends || time.Since(start) >= l.cfg.RetryTimeout ||
			(j.again != nil && !j.again()) {
			break
		}
	}
	// Upstreams that took the request and did not answer it, and that no
	// winner showed to be silent: when two upstreams were silent on it, or
	// another said the destination failed, the destination is the slow one
	// and none is blamed; else each is, as handshake_timeout says.
	silent := pool.HandshakeTimeout
	if len(lp.silent) >= 2 || lp.destFailed {
		silent = pool.DestinationError
	}
	if p := lp.judge(silent); p != nil && last != nil && last.res.h.unanswered {
		a = answerFor(p.res.h, p.result)
	}
	switch {
	case attempts == 0 && errors.Is(context.Cause(ctx), errAttemptTimeout):
		a = answerFor(happened{what: wNoAnswer}, pool.HandshakeTimeout) // the pick waited out the budget
	case ctx.Err() != nil && !upstreamTimeout(ctx):
		// The client left or the listener closed while a pick waited (a
		// sticky session's rotation) or between attempts: whatever the
		// last attempt said, that ended it.
		a = answerFor(happened{what: wClientGone}, pool.Canceled)
	}
	return nil, a, retries
}

// over reports whether no attempt may start any more.
func (lp *loop) over() bool {
	lp.mu.Lock()
	defer lp.mu.Unlock()
	return lp.expired || lp.base.Err() != nil
}

// expire runs when a plain request's response_timeout ran out: every
// attempt in flight ends, and no other starts.
func (lp *loop) expire() {
	lp.mu.Lock()
	defer lp.mu.Unlock()
	lp.expired = true
	for _, t := range lp.inflight {
		t.cancel(errResponseTimeout)
	}
}

// hedgeable reports whether job j's request through up may be hedged: not
// sticky (a hedge through another upstream would change the exit IP the
// client pinned), not on a rotating (ppr) service, which bills by request
// or traffic, and only where the upstream relays the answer head itself
// (through a tunnel, the tunnel's answer already proved the upstream, and
// a silent head is the destination's).
func hedgeable(up *pool.Upstream, j *job) bool {
	return j.key == "" && up.Kind != pool.PPR && relaysHead(up, j.scheme)
}

// relaysHead reports whether a plain request with URL scheme goes to the
// destination through up as a proxy request, whose answer head up relays
// (http:// through an HTTP upstream), rather than through a tunnel up
// opens (a SOCKS5 upstream; CONNECT for https://), which up answers
// itself before the destination says anything.
func relaysHead(up *pool.Upstream, scheme string) bool {
	return up.Protocol == pool.HTTP && scheme == "http"
}

// begin starts an attempt through up. live is false when the job was over
// before it began (the attempt is born cancelled and sends nothing).
func (lp *loop) begin(up *pool.Upstream, hedge bool) (t *try, live bool) {
	t = &try{up: up, start: time.Now(), hedge: hedge}
	t.ctx, t.cancel = context.WithCancelCause(lp.base)
	lp.mu.Lock()
	defer lp.mu.Unlock()
	lp.inflight = append(lp.inflight, t)
	switch {
	case lp.expired:
		t.cancel(errResponseTimeout)
	case lp.winner != nil: // a hedge sent just as the first attempt answered
		t.cancel(errCalledOff)
	default:
		return t, true
	}
	return t, false
}

// sendHedge runs on the hedge timer: first has no answer head after
// hedge_delay, so the job also goes through one more upstream, in a
// goroutine the loop waits for (done is closed when it is settled, or at
// once when no hedge is sent).
func (lp *loop) sendHedge(first *try, done chan struct{}) {
	l := lp.l
	lp.mu.Lock()
	over := lp.winner != nil || lp.expired || first.ctx.Err() != nil || lp.j.sends.Load() >= maxSends
	req := lp.req
	lp.mu.Unlock()
	if over {
		close(done)
		return
	}
	req.Avoid = append(append([]string(nil), req.Avoid...), first.up.ID())
	up, err := l.pool.Pick(lp.base, req)
	if err != nil || up == nil {
		close(done)
		return
	}
	if !hedgeable(up, lp.j) {
		l.pool.Report(up, pool.Canceled, 0)
		l.pool.Release(up, req)
		close(done)
		return
	}
	h, live := lp.begin(up, true)
	lp.hedge = h // read by the loop after done is closed
	if live {
		l.obs.Hedged()
	}
	go func() {
		defer close(done)
		h.res = lp.j.do(h.ctx, up)
		lp.settle(h)
	}()
}

// settle takes an attempt's result: the first answer claims the win and
// calls the others off; what lost or failed is classified, reported to the
// pool and released. The winner is reported by run, after the attempts it
// called off.
func (lp *loop) settle(t *try) {
	l := lp.l
	r := &t.res
	lp.mu.Lock()
	// Called off, or response_timeout, just as the answer came: read under
	// the lock that expire and the winner cancel under.
	_, ended := loopCause(t.ctx)
	if r.h.what == wAnswered && gatewayAnswer(t, r) && len(lp.inflight) > 1 {
		// Through an HTTP upstream a 502, 503 or 504 may be the upstream's
		// own failure: it does not win the race while another attempt may
		// still bring the destination's answer, and blames nobody.
		r.discard()
		r.h = happened{what: wCalledOff}
	}
	if r.h.what == wAnswered {
		if lp.winner == nil && !ended {
			lp.winner = t
			cause := errCalledOff
			if t.hedge && time.Since(t.start) <= l.cfg.HedgeDelay {
				cause = errOutrun
			}
			for _, o := range lp.inflight {
				if o != t {
					o.cancel(cause)
				}
			}
		} else {
			r.discard() // answered just after the other
			w, _ := loopCause(t.ctx)
			r.h = happened{what: w}
		}
	}
	for i, o := range lp.inflight {
		if o == t {
			lp.inflight = append(lp.inflight[:i], lp.inflight[i+1:]...)
			break
		}
	}
	won := lp.winner == t
	lp.mu.Unlock()
	if r.dialed && t.up.Protocol == pool.SOCKS5 {
		// Its SOCKS5 reply opened the connection: the upstream answered.
		l.answers.note(t.up.ID())
	}
	if r.h.what != wAnswered && r.h.what != wCalledOff {
		// An attempt the loop ended says why the loop ended it.
		if w, ok := loopCause(t.ctx); ok && t.ctx.Err() != nil {
			r.h = happened{what: w}
		}
		if r.h.what == wResponseTimeout && !r.tunneled && l.answers.silent(t.up.ID(), t.start) {
			r.h.what = wSilent
		}
	}
	t.result = classify(r.h)
	if answeredSomething(r.h.what) {
		l.answers.note(t.up.ID())
	}
	if won {
		return
	}
	t.cancel(nil)
	if r.h.unanswered && t.up.Session == "" {
		lp.mu.Lock()
		if lp.silent == nil {
			lp.silent = make(map[string]bool)
		}
		lp.silent[t.up.Address] = true
		pending := r.h.what == wNoAnswer
		if pending {
			lp.pending = append(lp.pending, t) // reported by judge
		}
		lp.mu.Unlock()
		if pending {
			return
		}
	}
	lp.report(t)
}

// report reports a failed attempt to the pool and releases its upstream.
func (lp *loop) report(t *try) {
	lp.l.log.Debug("upstream attempt failed", "upstream", t.up.ID(), "result", t.result.String(), "hedge", t.hedge, "err", t.res.err)
	lp.l.pool.Report(t.up, t.result, t.res.took)
	lp.l.pool.Release(t.up, lp.req)
}

// judge reports the pending attempts with result r, and returns the last
// of them (nil when none was pending).
func (lp *loop) judge(r pool.Result) (last *try) {
	lp.mu.Lock()
	pending := lp.pending
	lp.pending = nil
	lp.mu.Unlock()
	for _, t := range pending {
		t.result = r
		lp.report(t)
		last = t
	}
	return last
}

// gatewayAnswer reports whether an answer head through an HTTP upstream is
// a 502, 503 or 504, which the upstream may have generated itself.
func gatewayAnswer(t *try, r *tryResult) bool {
	return t.up.Protocol == pool.HTTP && r.resp != nil && failureStatus(r.resp.StatusCode)
}

// answerOutcome is how a connection whose request got a destination's
// answer with status is counted. A 502, 503 or 504: the destination
// failed, or an HTTP upstream could not get its answer (which of the two,
// the answer does not always say). Nobody is blamed, as for a CONNECT's
// 502; but the connection did not reach a working destination.
func answerOutcome(status int) Outcome {
	if failureStatus(status) {
		return OutcomeDestinationError
	}
	return OutcomeOK
}

// failureStatus reports whether an answer's status says that the
// destination (or a gateway on its behalf) could not answer: 502, 503, 504.
func failureStatus(code int) bool {
	switch code {
	case http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}

// answeredSomething reports whether the upstream said anything at all.
func answeredSomething(w what) bool {
	switch w {
	case wAnswered, wProxyAnswer, wSOCKSReply, wSOCKSAuth, wSOCKSAddress, wTLS:
		return true
	}
	return false
}

// answerLog remembers when each upstream of a listener last answered
// anything: a request through an upstream that answered nothing during the
// whole response_timeout, while other upstreams of the listener answered
// other requests, blames that upstream.
type answerLog struct {
	mu   sync.Mutex
	last map[string]time.Time
}

// maxAnswerLog bounds the upstreams remembered; past it, entries older
// than forgetAnswers go.
const (
	maxAnswerLog  = 4096
	forgetAnswers = time.Hour
)

func (a *answerLog) note(id string) {
	now := time.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.last == nil {
		a.last = make(map[string]time.Time)
	}
	if _, ok := a.last[id]; !ok && len(a.last) >= maxAnswerLog {
		for k, t := range a.last {
			if now.Sub(t) > forgetAnswers {
				delete(a.last, k)
			}
		}
	}
	a.last[id] = now
}

// silent reports whether id answered nothing since since while another
// upstream did.
func (a *answerLog) silent(id string, since time.Time) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if t, ok := a.last[id]; ok && !t.Before(since) {
		return false
	}
	for k, t := range a.last {
		if k != id && !t.Before(since) {
			return true
		}
	}
	return false
}

// request is the pool's Request for a pick of this listener with key, as
// the pick's Release takes it again.
func (l *Listener) request(key string) pool.Request {
	return pool.Request{Listener: l.cfg.Name, Key: key}
}

// release ends a pick made with key (see Pool).
func (l *Listener) release(u *pool.Upstream, key string) {
	l.pool.Release(u, l.request(key))
}

// openTunnel opens a tunnel to dest through the first upstream that works.
// On success the caller owns conn and must call l.release(u, key) when done;
// otherwise fail is what the client is told.
func (l *Listener) openTunnel(ctx context.Context, key string, dest socks5.Addr) (conn net.Conn, u *pool.Upstream, retries int, fail *answer) {
	j := &job{key: key, do: func(ctx context.Context, up *pool.Upstream) tryResult {
		c, took, aerr := l.dialer.tunnel(ctx, up, dest)
		r := tryResult{conn: c, took: took, dialed: aerr == nil}
		if aerr != nil {
			r.h, r.err = aerr.h, aerr.err
		}
		return r
	}}
	w, a, retries := l.run(ctx, j)
	if w == nil {
		return nil, nil, retries, &a
	}
	w.cancel(nil) // the tunnel is open: nothing of the attempt's context is left in use
	return w.res.conn, w.up, retries, nil
}
