package pool

import (
	"context"
	"log/slog"
	"slices"
	"sync"
	"time"
)

// EventKind is what happened, from a closed list: the kinds of the admin
// endpoint GET /events. A new kind is a contract change.
type EventKind string

// The event kinds. Those about one upstream carry its ID; the others carry
// the service (or nothing, for reloads and panic of a listener, whose name
// is in Reason).
const (
	EventAdded               EventKind = "added"                 // an upstream joined the set
	EventRemoved             EventKind = "removed"               // it left the provider's lists
	EventEjected             EventKind = "ejected"               // consecutive failures took it out; Reason is the failure class
	EventReadmitted          EventKind = "readmitted"            // its trial connection succeeded, or (Reason says so) the ejection cap ended its ejection early
	EventProviderError       EventKind = "provider_error"        // on the provider's errored list
	EventProviderInactive    EventKind = "provider_inactive"     // on the provider's inactive list
	EventProviderOK          EventKind = "provider_ok"           // off both lists again
	EventRotated             EventKind = "rotated"               // a ppr sticky session was rotated
	EventRotationFailed      EventKind = "rotation_failed"       // the rotation failed or was rate limited
	EventQuota               EventKind = "quota"                 // a ppr service reached its quota headroom
	EventQuotaOK             EventKind = "quota_ok"              // it went back under
	EventPanic               EventKind = "panic"                 // a listener's slice entered panic mode
	EventPanicOver           EventKind = "panic_over"            // it left panic mode
	EventListUpdateRequested EventKind = "list_update_requested" // proxyd asked the provider for a new IP list
	EventListUpdated         EventKind = "list_updated"          // the provider granted it
	EventListUpdateFailed    EventKind = "list_update_failed"    // it refused or failed; Reason says why
	EventReload              EventKind = "reload"                // a configuration reload took effect
	EventReloadFailed        EventKind = "reload_failed"         // a reload was refused; the running config stays
)

// EventKinds lists every kind, in the order above.
func EventKinds() []EventKind {
	return []EventKind{
		EventAdded, EventRemoved, EventEjected, EventReadmitted,
		EventProviderError, EventProviderInactive, EventProviderOK,
		EventRotated, EventRotationFailed, EventQuota, EventQuotaOK,
		EventPanic, EventPanicOver, EventListUpdateRequested, EventListUpdated,
		EventListUpdateFailed, EventReload, EventReloadFailed,
	}
}

// Event is one entry of the event log.
type Event struct {
	Time     time.Time
	Kind     EventKind
	Upstream string // Upstream.ID() of the upstream concerned, or ""
	Service  int    // its service, or 0
	Reason   string // failure class, list name, listener name, error text …
}

// DefaultEventLogSize is how many events an EventLog keeps by default.
const DefaultEventLogSize = 500

// EventLog is a bounded ring of the last events, newest first when read.
// Record does not allocate: it copies the event into a slot of a ring made
// once, so it may be called on the connection path (ejections happen there).
// Each event is also logged at info level ("event=KIND"), so the journal
// keeps what the ring forgets.
type EventLog struct {
	log *slog.Logger
	now func() time.Time

	mu   sync.Mutex
	ring []Event
	next int  // slot of the next event
	full bool // the ring wrapped at least once
}

// NewEventLog keeps the last size events (DefaultEventLogSize when size is
// not positive). A nil logger logs nothing; a nil now is time.Now.
func NewEventLog(size int, logger *slog.Logger, now func() time.Time) *EventLog {
	if size <= 0 {
		size = DefaultEventLogSize
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if now == nil {
		now = time.Now
	}
	return &EventLog{log: logger, now: now, ring: make([]Event, size)}
}

// Record adds an event; a zero Time is filled with the current time. A nil
// *EventLog records nothing, so collaborators may hold one optionally.
func (l *EventLog) Record(e Event) {
	if l == nil {
		return
	}
	if e.Time.IsZero() {
		e.Time = l.now()
	}
	l.mu.Lock()
	l.ring[l.next] = e
	l.next++
	if l.next == len(l.ring) {
		l.next, l.full = 0, true
	}
	l.mu.Unlock()
	if l.log.Enabled(context.Background(), slog.LevelInfo) {
		l.log.LogAttrs(context.Background(), slog.LevelInfo, "pool event",
			slog.String("event", string(e.Kind)), slog.String("upstream", e.Upstream),
			slog.Int("service", e.Service), slog.String("reason", e.Reason))
	}
}

// EventFilter selects events; a zero field matches any.
type EventFilter struct {
	Upstream string
	Service  int
	Kind     EventKind
}

func (f EventFilter) match(e *Event) bool {
	return (f.Upstream == "" || e.Upstream == f.Upstream) &&
		(f.Service == 0 || e.Service == f.Service) &&
		(f.Kind == "" || e.Kind == f.Kind)
}

// Events returns the recorded events that match f, newest first.
func (l *EventLog) Events(f EventFilter) []Event {
	if l == nil {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	n := l.next
	if l.full {
		n = len(l.ring)
	}
	out := make([]Event, 0, n)
	for i := range n {
		e := &l.ring[(l.next-1-i+len(l.ring))%len(l.ring)]
		if f.match(e) {
			out = append(out, *e)
		}
	}
	return slices.Clip(out)
}
