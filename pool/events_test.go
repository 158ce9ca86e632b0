package pool

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/proxyd/proxyd/internal/syncbuf"
)

// wantEvents checks that the events of kind are exactly want, newest first,
// comparing kind, upstream, service and reason.
func wantEvents(t *testing.T, l *EventLog, kind EventKind, want ...Event) {
	t.Helper()
	got := l.Events(EventFilter{Kind: kind})
	strip := func(es []Event) []Event {
		out := make([]Event, len(es))
		for i, e := range es {
			e.Time = time.Time{}
			out[i] = e
		}
		return out
	}
	if !slices.Equal(strip(got), strip(want)) {
		t.Errorf("%s events:\n got  %+v\n want %+v", kind, strip(got), strip(want))
	}
	for i := 1; i < len(got); i++ {
		if got[i].Time.After(got[i-1].Time) {
			t.Errorf("%s events not newest first: %v after %v", kind, got[i].Time, got[i-1].Time)
		}
	}
}

// TestEventsOncePerUpstream: an ejection and its readmission, a provider
// mark and its clearing, a rotation and a failed one, additions and
// removals, each appear once per upstream ID with the right kind, ID,
// service and reason, newest first, and are logged at info level.
func TestEventsOncePerUpstream(t *testing.T) {
	clk := newClock()
	var logged syncbuf.Buffer
	logger := slog.New(slog.NewTextHandler(&logged, nil))
	events := NewEventLog(0, logger, clk.Now)
	var rotateErr error
	var mu sync.Mutex
	rot := &fakeRotator{fn: func(context.Context, string) (string, error) {
		mu.Lock()
		defer mu.Unlock()
		return "203.0.113.50", rotateErr
	}}
	var rs rotations
	p := newTestPool(t, conf(func(c *Config) { c.MaxEjectedPercent = 100 }),
		Options{Now: clk.Now, Rand: midRand, Rotator: rot, Events: events, Hooks: Hooks{Rotated: rs.hook}})
	p.SetListeners([]ListenerSlice{{Name: "http", Protocol: HTTP}, {Name: "socks", Protocol: SOCKS5}})

	// One IP of service 1 carries an HTTP and a SOCKS5 upstream.
	fpr := ups(1, 3)
	both := fpr[0]
	both.Protocol = SOCKS5
	set := append(append(fpr, both), sessions(2, 1, "198.51.100.1")...)
	httpID, socksID, sessionID := fpr[0].ID(), both.ID(), set[4].ID()
	p.Update(set)
	p.Update(set) // a refresh adds nothing
	var added []Event
	for _, u := range slices.Backward(set) {
		added = append(added, Event{Kind: EventAdded, Upstream: u.ID(), Service: u.Service})
	}
	wantEvents(t, events, EventAdded, added...)

	// A provider mark: one event per upstream ID, however often it is set.
	clk.Advance(time.Second)
	for range 3 {
		p.SetProviderStatus(1, []string{"10.1.0.0"}, nil)
	}
	const onErrored = "on the provider's errored list"
	wantEvents(t, events, EventProviderError,
		Event{Kind: EventProviderError, Upstream: socksID, Service: 1, Reason: onErrored},
		Event{Kind: EventProviderError, Upstream: httpID, Service: 1, Reason: onErrored})
	clk.Advance(time.Second)
	p.SetProviderStatus(1, nil, []string{"10.1.0.0"}) // errored → inactive
	p.SetProviderStatus(1, nil, []string{"10.1.0.0"})
	const onInactive = "on the provider's inactive list"
	wantEvents(t, events, EventProviderInactive,
		Event{Kind: EventProviderInactive, Upstream: socksID, Service: 1, Reason: onInactive},
		Event{Kind: EventProviderInactive, Upstream: httpID, Service: 1, Reason: onInactive})
	clk.Advance(time.Second)
	p.SetProviderStatus(1, nil, nil)
	p.SetProviderStatus(1, nil, nil)
	const cleared = "off the provider's errored and inactive lists"
	wantEvents(t, events, EventProviderOK,
		Event{Kind: EventProviderOK, Upstream: socksID, Service: 1, Reason: cleared},
		Event{Kind: EventProviderOK, Upstream: httpID, Service: 1, Reason: cleared})

	// An ejection: once, with the failure class that ejected it; late
	// reports of connections picked before it add nothing.
	clk.Advance(time.Second)
	h := handle(p, fpr[1])
	fail(p, h, 2)
	h.h.inFlight.Add(1)
	p.Report(h, HandshakeTimeout, time.Millisecond)
	p.Release(h, Request{})
	fail(p, h, 3)
	wantEvents(t, events, EventEjected, Event{Kind: EventEjected, Upstream: fpr[1].ID(), Service: 1, Reason: "handshake_timeout"})
	wantEvents(t, events, EventReadmitted)
	clk.Advance(time.Hour)
	u := pickUntil(t, p, Request{Listener: "http"}, fpr[1].ID())
	p.Report(u, Success, time.Millisecond)
	p.Release(u, Request{Listener: "http"})
	wantEvents(t, events, EventReadmitted, Event{Kind: EventReadmitted, Upstream: fpr[1].ID(), Service: 1})

	// A rotation of the ppr session, then one that fails.
	clk.Advance(time.Second)
	fail(p, handle(p, set[4]), 1)
	waitFor(t, "the rotation", func() bool { return len(rs.get()) == 1 })
	wantEvents(t, events, EventRotated, Event{Kind: EventRotated, Upstream: sessionID, Service: 2, Reason: "ok"})
	mu.Lock()
	rotateErr = errors.New("502 from the api")
	mu.Unlock()
	clk.Advance(time.Minute)
	fail(p, handle(p, set[4]), 1)
	waitFor(t, "the rotation", func() bool { return len(rs.get()) == 2 })
	fail(p, handle(p, set[4]), 1) // held back by rotate_interval: no event
	wantEvents(t, events, EventRotationFailed, Event{Kind: EventRotationFailed, Upstream: sessionID, Service: 2, Reason: "error"})
	wantEvents(t, events, EventRotated, Event{Kind: EventRotated, Upstream: sessionID, Service: 2, Reason: "ok"})

	// Removal: once per upstream that leaves.
	clk.Advance(time.Second)
	p.Update(set[1:])
	p.Update(set[1:])
	wantEvents(t, events, EventRemoved, Event{Kind: EventRemoved, Upstream: httpID, Service: 1})

	// All of it newest first, by upstream as well.
	all := events.Events(EventFilter{})
	for i := 1; i < len(all); i++ {
		if all[i].Time.After(all[i-1].Time) {
			t.Errorf("events not newest first at %d: %+v after %+v", i, all[i], all[i-1])
		}
	}
	var kinds []EventKind
	for _, e := range events.Events(EventFilter{Upstream: httpID}) {
		kinds = append(kinds, e.Kind)
	}
	if want := []EventKind{EventRemoved, EventProviderOK, EventProviderInactive, EventProviderError, EventAdded}; !slices.Equal(kinds, want) {
		t.Errorf("events of %s = %v, want %v", httpID, kinds, want)
	}
	// Each is logged at info level.
	out := logged.String()
	for _, want := range []string{
		"level=INFO msg=\"pool event\" event=ejected upstream=1/http/10.1.0.1:8080 service=1 reason=handshake_timeout",
		"event=provider_ok upstream=1/socks5/10.1.0.0:8080 service=1",
		"event=rotation_failed upstream=2/http/198.51.100.1:9000/s0 service=2 reason=error",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("log lacks %q:\n%s", want, out)
		}
	}
	if n := strings.Count(out, "event="); n != len(all) {
		t.Errorf("%d events logged, %d recorded", n, len(all))
	}
}

// TestPanicEvents: a listener enters panic mode once when a failing
// upstream is kept in by the ejection cap, and leaves it once when that
// upstream works again; the other listener records nothing.
func TestPanicEvents(t *testing.T) {
	clk := newClock()
	events := NewEventLog(0, nil, clk.Now)
	p := newTestPool(t, DefaultConfig(), Options{Now: clk.Now, Rand: midRand, Events: events})
	p.SetListeners([]ListenerSlice{{Name: "one", Services: []int{1}}, {Name: "other", Services: []int{2}}})
	set := append(ups(1, 2), ups(2, 2)...)
	p.Update(set)
	a, b := handle(p, set[0]), handle(p, set[1])
	fail(p, a, 3) // 1 of 2 at 50 %: ejected
	wantEvents(t, events, EventPanic)
	fail(p, b, 3) // the second would pass the cap: kept in
	fail(p, b, 3)
	wantEvents(t, events, EventPanic, Event{Kind: EventPanic, Reason: "one"})
	if l := listenerOf(t, p, "one"); !l.Panic {
		t.Errorf("listener one not in panic in /pool: %+v", l)
	}
	clk.Advance(time.Second)
	b.h.inFlight.Add(1)
	p.Report(b, Success, time.Millisecond)
	p.Release(b, Request{})
	wantEvents(t, events, EventPanicOver, Event{Kind: EventPanicOver, Reason: "one"})
	wantEvents(t, events, EventPanic, Event{Kind: EventPanic, Reason: "one"})
	if l := listenerOf(t, p, "one"); l.Panic {
		t.Errorf("listener one still in panic in /pool: %+v", l)
	}
	// A listener that goes away in panic mode ends it.
	fail(p, b, 3)
	wantEvents(t, events, EventPanic, Event{Kind: EventPanic, Reason: "one"}, Event{Kind: EventPanic, Reason: "one"})
	p.SetListeners([]ListenerSlice{{Name: "other", Services: []int{2}}})
	wantEvents(t, events, EventPanicOver, Event{Kind: EventPanicOver, Reason: "one"}, Event{Kind: EventPanicOver, Reason: "one"})
}

// TestEventLogBounded: the ring keeps its size whatever was recorded, and
// the newest events.
func TestEventLogBounded(t *testing.T) {
	l := NewEventLog(500, nil, nil)
	for i := range 100000 {
		l.Record(Event{Kind: EventEjected, Service: i + 1})
	}
	got := l.Events(EventFilter{})
	if len(got) != 500 || cap(got) != 500 {
		t.Fatalf("%d events (cap %d), want 500", len(got), cap(got))
	}
	for i, e := range got {
		if e.Service != 100000-i {
			t.Fatalf("event %d: service %d, want %d", i, e.Service, 100000-i)
		}
	}
	if n := len(l.Events(EventFilter{Service: 99999})); n != 1 {
		t.Errorf("filter by service: %d events", n)
	}
	if n := len(l.Events(EventFilter{Service: 5})); n != 0 {
		t.Errorf("an event the ring forgot: %d", n)
	}
}

// TestEjectionRecordsWithoutAllocation: a Report that ejects an upstream
// records its event (and logs it through a slog text handler) without
// allocating.
func TestEjectionRecordsWithoutAllocation(t *testing.T) {
	clk := newClock()
	var n int
	counting := writerFunc(func(b []byte) (int, error) { n++; return len(b), nil })
	events := NewEventLog(0, slog.New(slog.NewTextHandler(counting, nil)), clk.Now)
	p := newTestPool(t, conf(func(c *Config) { c.MaxEjectedPercent = 100; c.FailureThreshold = 1 }),
		Options{Now: clk.Now, Rand: midRand, Events: events, Hooks: Hooks{Ejected: func(int) {}}})
	p.SetListeners([]ListenerSlice{{Name: "http", Protocol: HTTP}})
	set := ups(1, 4)
	p.Update(set)
	u := handle(p, set[0])
	n = 0 // the lines of the additions
	ejections := 0
	allocs := testing.AllocsPerRun(100, func() {
		u.h.inFlight.Add(1)
		p.Report(u, DialRefused, time.Millisecond) // ejects
		p.Release(u, Request{})
		ejections++
		// Readmit it for the next run (an event too).
		clk.Advance(time.Hour)
		p.readmit(u.h, clk.ns.Load())
	})
	if allocs != 0 && !raceEnabled {
		t.Errorf("a Report that ejects allocates %v times", allocs)
	}
	if got := len(events.Events(EventFilter{Kind: EventEjected})); got != ejections {
		t.Errorf("%d ejected events for %d ejections", got, ejections)
	}
	if n != 2*ejections {
		t.Errorf("%d lines logged for %d ejections and as many readmissions", n, ejections)
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(b []byte) (int, error) { return f(b) }

var _ io.Writer = writerFunc(nil)
