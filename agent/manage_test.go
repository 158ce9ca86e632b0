package agent

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/proxyd/proxyd/agent/providersim"
	"github.com/proxyd/proxyd/internal/syncbuf"
)

// fakeClock is a settable clock shared by the poller and the simulator.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) Now() time.Time          { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *fakeClock) Advance(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }

// newFakeClock returns a fakeClock at the tests' epoch, 2026-11-21 10:00
// UTC, for PollConfig.Now (and the simulator's Config.Now).
func newFakeClock() *fakeClock {
	return &fakeClock{t: time.Date(2026, 11, 21, 10, 0, 0, 0, time.UTC)}
}

// eventLog collects the poller's events.
type eventLog struct {
	mu     sync.Mutex
	events []Event
	onAdd  func(Event) // when set, called with each event as the poller sends it
}

func (l *eventLog) add(e Event) {
	l.mu.Lock()
	l.events = append(l.events, e)
	f := l.onAdd
	l.mu.Unlock()
	if f != nil {
		f(e)
	}
}

// kinds lists "kind/result" of every event so far.
func (l *eventLog) kinds() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, e := range l.events {
		out = append(out, e.Kind+"/"+e.Result)
	}
	return out
}

// newManagedPoller serves fpr service 101 (10.0.0.1-3) over HTTP with
// list updates at share 0.5 held for 10m, the simulator allowing one update
// per interval, both on one fake clock.
func newManagedPoller(t *testing.T, interval time.Duration) (*Poller, *providersim.Sim, *fakeClock, *eventLog) {
	t.Helper()
	clock := newFakeClock()
	p, sim, events := managedPoller(t, clock, interval, nil)
	return p, sim, clock, events
}

// managedPoller is newManagedPoller on clock, with intercept (when not
// nil) answering the requests it takes before the simulator does (see
// interceptClient).
func managedPoller(t *testing.T, clock *fakeClock, interval time.Duration, intercept func(http.ResponseWriter, *http.Request) bool) (*Poller, *providersim.Sim, *eventLog) {
	t.Helper()
	sim := providersim.New(providersim.Config{Now: clock.Now, UpdateListInterval: interval})
	if intercept == nil {
		intercept = func(http.ResponseWriter, *http.Request) bool { return false }
	}
	c := interceptClient(t, sim, 5*time.Second, intercept)
	events := &eventLog{}
	cfg := pollConfig(func(c *PollConfig) {
		c.Services, c.Draws = []int{101}, drawn("http")
		c.Manage = ManageConfig{UpdateListShare: 0.5, UpdateListAfter: 10 * time.Minute}
		c.OnEvent = events.add
		c.Now = clock.Now
	})
	p, err := NewPoller(c, cfg, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	pollAll(t, p)
	return p, sim, events
}

func statusRound(t *testing.T, p *Poller) {
	t.Helper()
	if err := p.PollOnce(context.Background(), LoopStatus); err != nil {
		t.Fatal(err)
	}
}

// The request goes out once the share has held for update_list_after, not
// before, and the new list is in the snapshot when the round returns.
func TestManageRequestsListWhenShareHeld(t *testing.T) {
	p, sim, clock, events := newManagedPoller(t, time.Minute)
	statusRound(t, p)
	if got := events.kinds(); len(got) != 0 {
		t.Fatalf("events with no errored IPs: %v", got)
	}
	// One of three is below the share: nothing, however long.
	sim.MarkErrored(101, "10.0.0.1")
	statusRound(t, p)
	clock.Advance(time.Hour)
	statusRound(t, p)
	if got := events.kinds(); len(got) != 0 {
		t.Fatalf("events below the share: %v", got)
	}
	// Two of three (errored and inactive together) reach it now.
	sim.MarkInactive(101, "10.0.0.2")
	statusRound(t, p)
	clock.Advance(10*time.Minute - time.Second)
	statusRound(t, p)
	if got := events.kinds(); len(got) != 0 {
		t.Fatalf("request before update_list_after: %v", got)
	}
	fresh := []providersim.Entry{{Host: "10.0.9.1", Port: 8080, Login: "u", Password: "p"}, {Host: "10.0.9.2", Port: 8080, Login: "u", Password: "p"}, {Host: "10.0.9.3", Port: 8080, Login: "u", Password: "p"}}
	sim.SetEntries(101, "http-auth", fresh)
	listsBefore := sim.Requests(RouteIPList)
	// list_updated comes before the new list is in: what the new list
	// changes in the pool follows its cause in the event log.
	var atEvent []Entry
	events.onAdd = func(e Event) {
		if e.Kind == EventListUpdated {
			atEvent = serviceByID(p.Snapshot(), 101).Lists["http-auth"]
		}
	}
	clock.Advance(time.Second)
	statusRound(t, p)
	if len(atEvent) == 0 || atEvent[0].Host != "10.0.0.1" {
		t.Errorf("the list when list_updated was sent: %+v, want the old one", atEvent)
	}
	if got, want := events.kinds(), []string{EventListUpdateRequested + "/", EventListUpdated + "/" + ResultOK}; !slices.Equal(got, want) {
		t.Fatalf("events %v, want %v", got, want)
	}
	if sim.Requests(RouteIPList) != listsBefore+1 {
		t.Errorf("the new list was fetched %d times, want once", sim.Requests(RouteIPList)-listsBefore)
	}
	st := serviceByID(p.Snapshot(), 101)
	if got := st.Lists["http-auth"]; len(got) != 3 || got[0].Host != "10.0.9.1" {
		t.Errorf("list after the update: %+v", got)
	}
	if e := events.events[1]; e.Service != 101 || e.Reason == "" {
		t.Errorf("event %+v", e)
	}
	// The new IPs are not errored: the share is gone, no further request.
	clock.Advance(time.Hour)
	statusRound(t, p)
	if got := events.kinds(); len(got) != 2 {
		t.Errorf("events after the update: %v", got)
	}
}

// A 2xx answer to the list update whose body is not the documented object
// (a bare true, a plain-text "OK") still means the provider replaced the
// list: the new one is fetched at once, and it is no failure.
func TestManageUnreadableSuccessIsSuccess(t *testing.T) {
	for _, body := range []string{"true", "OK", `"IP list updated successfully"`} {
		t.Run(body, func(t *testing.T) {
			clock := newFakeClock()
			var sim *providersim.Sim
			p, sim, events := managedPoller(t, clock, time.Minute, func(w http.ResponseWriter, r *http.Request) bool {
				if r.Method != http.MethodPut {
					return false
				}
				rec := httptest.NewRecorder()
				sim.ServeHTTP(rec, r) // the provider does the update
				if rec.Code != http.StatusOK {
					t.Errorf("the simulator answered the update with %d: %s", rec.Code, rec.Body)
				}
				w.Write([]byte(body))
				return true
			})
			sim.MarkErrored(101, "10.0.0.1")
			sim.MarkInactive(101, "10.0.0.2")
			statusRound(t, p)
			sim.SetEntries(101, "http-auth", []providersim.Entry{{Host: "10.0.9.1", Port: 8080, Login: "u", Password: "p"},
				{Host: "10.0.9.2", Port: 8080, Login: "u", Password: "p"}, {Host: "10.0.9.3", Port: 8080, Login: "u", Password: "p"}})
			clock.Advance(10 * time.Minute)
			statusRound(t, p)
			if got, want := events.kinds(), []string{EventListUpdateRequested + "/", EventListUpdated + "/" + ResultOK}; !slices.Equal(got, want) {
				t.Fatalf("events %v, want %v", got, want)
			}
			if got := serviceByID(p.Snapshot(), 101).Lists["http-auth"]; len(got) != 3 || got[0].Host != "10.0.9.1" {
				t.Errorf("list after the update: %+v", got)
			}
		})
	}
}

// A 429 defers the next request until the time it names (and never more
// than once per update_list_after); errors are reported too.
func TestManageHonoursRateLimit(t *testing.T) {
	p, sim, clock, events := newManagedPoller(t, time.Hour)
	sim.MarkErrored(101, "10.0.0.1", "10.0.0.2", "10.0.0.3")
	statusRound(t, p) // the share is reached at 10:00
	clock.Advance(10 * time.Minute)
	statusRound(t, p) // 10:10: request, accepted; the simulator allows the next at 11:10
	want := []string{EventListUpdateRequested + "/", EventListUpdated + "/" + ResultOK}
	if got := events.kinds(); !slices.Equal(got, want) {
		t.Fatalf("events %v, want %v", got, want)
	}
	clock.Advance(5 * time.Minute)
	statusRound(t, p) // 10:15: within update_list_after of the request
	if got := events.kinds(); !slices.Equal(got, want) {
		t.Fatalf("request within update_list_after: %v", got)
	}
	clock.Advance(5 * time.Minute)
	statusRound(t, p) // 10:20: requested, 429 until 11:10
	want = append(want, EventListUpdateRequested+"/", EventListUpdateFailed+"/"+ResultRateLimited)
	if got := events.kinds(); !slices.Equal(got, want) {
		t.Fatalf("events %v, want %v", got, want)
	}
	for range 4 { // 10:30 .. 11:00: deferred by the 429, though update_list_after passed
		clock.Advance(10 * time.Minute)
		statusRound(t, p)
	}
	clock.Advance(9*time.Minute + 59*time.Second)
	statusRound(t, p) // 11:09:59
	if got := events.kinds(); !slices.Equal(got, want) {
		t.Fatalf("request before the 429's time: %v", got)
	}
	clock.Advance(time.Second)
	statusRound(t, p) // 11:10
	want = append(want, EventListUpdateRequested+"/", EventListUpdated+"/"+ResultOK)
	if got := events.kinds(); !slices.Equal(got, want) {
		t.Fatalf("events %v, want %v", got, want)
	}

	// A failed request is reported and waits update_list_after.
	clock.Advance(2 * time.Hour)
	sim.FailNext(1, http.StatusInternalServerError, `{"error":"boom"}`)
	p.manageLists(context.Background()) // what ends a status round: the PUT is the next request
	want = append(want, EventListUpdateRequested+"/", EventListUpdateFailed+"/"+ResultError)
	if got := events.kinds(); !slices.Equal(got, want) {
		t.Fatalf("events %v, want %v", got, want)
	}
	clock.Advance(10*time.Minute - time.Second)
	statusRound(t, p) // within update_list_after of the failed request
	if got := events.kinds(); !slices.Equal(got, want) {
		t.Fatalf("events %v, want %v", got, want)
	}
	clock.Advance(time.Second)
	statusRound(t, p)
	want = append(want, EventListUpdateRequested+"/", EventListUpdated+"/"+ResultOK)
	if got := events.kinds(); !slices.Equal(got, want) {
		t.Fatalf("events %v, want %v", got, want)
	}
}

// The wait a 429 imposes is at least 1s and at most 1h, whatever time it
// names, read as UTC; a time beyond the hour is logged as the poll loops
// log it. The same message in a 200 answer (the action's own "error") is
// the same rate limit.
func TestManageRateLimitBounds(t *testing.T) {
	now := time.Date(2026, 11, 21, 10, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name  string
		next  string // the 429's time; "" for none
		want  time.Time
		in200 bool // said as {"update_list": {"error": ...}} in a 200 answer
	}{
		{"named time", "2026-11-21 10:30:00", now.Add(30 * time.Minute), false},
		{"in the past", "2026-11-21 09:00:00", now.Add(time.Second), false},
		{"none", "", now.Add(time.Second), false},
		{"far away", "2026-11-22 10:00:00", now.Add(time.Hour), false},
		{"named time in a 200", "2026-11-21 10:30:00", now.Add(30 * time.Minute), true},
		{"none in a 200", "", now.Add(time.Second), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				msg := "Too Many Attempts (updateList)."
				if tc.next != "" {
					msg += " Next update possible: " + tc.next
				}
				if tc.in200 {
					fmt.Fprintf(w, `{"update_list":{"error":%q}}`, msg)
					return
				}
				w.WriteHeader(http.StatusTooManyRequests)
				fmt.Fprintf(w, `{"error":%q}`, msg)
			}))
			defer srv.Close()
			c, err := New(clientConfig(srv.URL, "t", 5*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			events := &eventLog{}
			var logBuf syncbuf.Buffer
			p, err := NewPoller(c, pollConfig(func(c *PollConfig) {
				c.Manage = ManageConfig{UpdateListShare: 1, UpdateListAfter: time.Minute}
				c.OnEvent = events.add
				c.Now = func() time.Time { return now }
			}), nil, slog.New(slog.NewTextHandler(&logBuf, nil)))
			if err != nil {
				t.Fatal(err)
			}
			p.manage[1] = &manageState{}
			p.requestList(context.Background(), c, 0, 1)
			if got := p.manage[1].nextAllowed; !got.Equal(tc.want) {
				t.Errorf("next allowed %v, want %v", got, tc.want)
			}
			if got := events.kinds(); !slices.Equal(got, []string{EventListUpdateRequested + "/", EventListUpdateFailed + "/" + ResultRateLimited}) {
				t.Errorf("events %v", got)
			}
			capped := strings.Contains(logBuf.String(), "beyond the longest wait")
			if want := tc.name == "far away"; capped != want ||
				want && !strings.Contains(logBuf.String(), "next_allowed=2026-11-22T10:00:00.000Z longest_wait=1h0m0s") {
				t.Errorf("capped logged %v, want %v:\n%s", capped, want, logBuf.String())
			}
		})
	}
}

// Manage off (share 0) never requests anything.
func TestManageOff(t *testing.T) {
	p, sim, clock, events := newManagedPoller(t, time.Minute)
	_, cfg, _ := p.current()
	cfg.Manage.UpdateListShare = 0
	c, _, _ := p.current()
	if err := p.Reconfigure(c, cfg, false); err != nil {
		t.Fatal(err)
	}
	sim.MarkErrored(101, "10.0.0.1", "10.0.0.2", "10.0.0.3")
	for range 5 {
		statusRound(t, p)
		clock.Advance(time.Hour)
	}
	if got := events.kinds(); len(got) != 0 {
		t.Errorf("events with [manage] off: %v", got)
	}
}

// The status loop's heartbeat keeps beating while it renews a list and
// polls the new one, each answer within the API timeout: the daemon's
// watchdog (Alive with the API timeout + 10s) must not see it stuck. Here
// each slow answer takes 500ms and the status loop must beat at least
// every 800ms, through a PUT and two list fetches. (Only its heartbeat is
// read: the other loops do not run here.)
func TestManageStatusLoopBeatsWhilePollingNewList(t *testing.T) {
	sim := providersim.New(providersim.Config{})
	var slow atomic.Bool
	c := interceptClient(t, sim, 2*time.Second, func(w http.ResponseWriter, r *http.Request) bool {
		if slow.Load() && (r.Method == http.MethodPut || strings.HasPrefix(r.URL.Path, "/api/iplist/")) {
			time.Sleep(500 * time.Millisecond)
		}
		return false
	})
	p, err := NewPoller(c, pollConfig(func(c *PollConfig) {
		c.Services = []int{101}
		c.Manage = ManageConfig{UpdateListShare: 0.5, UpdateListAfter: time.Minute}
	}), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	sim.MarkErrored(101, "10.0.0.1", "10.0.0.2", "10.0.0.3")
	pollAll(t, p)
	// The share has held for longer than update_list_after.
	p.mu.Lock()
	p.manage[101].heldSince = p.now().Add(-time.Hour)
	p.mu.Unlock()
	slow.Store(true)
	puts := sim.Requests(RouteService)
	done := make(chan error, 1)
	go func() { done <- p.PollOnce(context.Background(), LoopStatus) }()
	const maxAge = 800 * time.Millisecond
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	var stuck time.Duration
	for {
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
			if stuck > 0 {
				t.Errorf("the status loop did not beat for more than %v, about %v in all, in one round", maxAge, stuck)
			}
			if sim.Requests(RouteService) == puts {
				t.Error("no list update was requested: the test proved nothing")
			}
			return
		case <-tick.C:
			if time.Since(time.Unix(0, p.beats[LoopStatus].Load())) > maxAge {
				stuck += 20 * time.Millisecond
			}
		}
	}
}

// countKind counts the events of one kind.
func countKind(events *eventLog, kind string) int {
	n := 0
	for _, k := range events.kinds() {
		if strings.HasPrefix(k, kind+"/") {
			n++
		}
	}
	return n
}

// A 429's time holds across a reload that lands while the request is in
// flight; only a new provider starts afresh.
func TestManageRateLimitKeptAcrossReload(t *testing.T) {
	clock := newFakeClock()
	var p *Poller
	var reloadDuringPut atomic.Bool
	var reloads atomic.Int32
	var sim *providersim.Sim
	var events *eventLog
	p, sim, events = managedPoller(t, clock, time.Hour, func(w http.ResponseWriter, r *http.Request) bool {
		if r.Method == http.MethodPut && reloadDuringPut.Load() {
			c, cfg, _ := p.current()
			cfg.IPList = 11 * time.Minute // a [poll] change
			if err := p.Reconfigure(c, cfg, false); err != nil {
				t.Error(err)
			}
			reloads.Add(1)
		}
		return false
	})
	sim.MarkErrored(101, "10.0.0.1", "10.0.0.2", "10.0.0.3")
	statusRound(t, p) // 10:00: the share is reached
	clock.Advance(10 * time.Minute)
	statusRound(t, p) // 10:10: requested and done; the simulator allows the next at 11:10
	clock.Advance(10 * time.Minute)
	reloadDuringPut.Store(true)
	statusRound(t, p) // 10:20: 429 until 11:10, a reload meanwhile
	reloadDuringPut.Store(false)
	if n := countKind(events, EventListUpdateFailed); n != 1 || reloads.Load() != 1 {
		t.Fatalf("events %v, %d reloads: want one refused request with a reload during it", events.kinds(), reloads.Load())
	}
	for range 4 { // 10:30 .. 11:00
		clock.Advance(10 * time.Minute)
		statusRound(t, p)
	}
	if n := countKind(events, EventListUpdateRequested); n != 2 {
		t.Errorf("%d requests by 11:00, want 2 (none within the 429's window): %v", n, events.kinds())
	}
	clock.Advance(10 * time.Minute)
	statusRound(t, p) // 11:10
	if n := countKind(events, EventListUpdated); n != 2 {
		t.Errorf("after the 429's time: events %v, want a second update", events.kinds())
	}
}

// The poll of the new list after an update is the lists loop's: a 429 the
// lists had got holds it back, and a 429 it gets holds back the loop.
func TestManageNewListPollHonoursRateLimit(t *testing.T) {
	clock := newFakeClock()
	var limited atomic.Bool
	var lists atomic.Int32
	p, sim, events := managedPoller(t, clock, time.Hour, func(w http.ResponseWriter, r *http.Request) bool {
		if !strings.HasPrefix(r.URL.Path, "/api/iplist/") {
			return false
		}
		lists.Add(1)
		if !limited.Load() {
			return false
		}
		// On the test's clock (the client reads seconds on the real one).
		w.Header().Set("Retry-After", clock.Now().Add(10*time.Minute).Format(http.TimeFormat))
		w.WriteHeader(http.StatusTooManyRequests)
		_, _ = w.Write([]byte(`{"error":"Too Many Attempts"}`))
		return true
	})
	sim.MarkErrored(101, "10.0.0.1", "10.0.0.2", "10.0.0.3")
	statusRound(t, p) // 10:00
	clock.Advance(10 * time.Minute)
	limited.Store(true)
	before := lists.Load()
	statusRound(t, p) // 10:10: the update is done; the new list's poll gets a 429 for 10 min
	if lists.Load() != before+1 || countKind(events, EventListUpdated) != 1 {
		t.Fatalf("%d list requests after the update, events %v; want one and the update", lists.Load()-before, events.kinds())
	}
	for range 9 { // the lists loop, kicked or due, within the 429's time
		clock.Advance(time.Minute)
		_ = p.round(context.Background(), LoopLists, true)
	}
	if n := lists.Load() - before - 1; n != 0 {
		t.Errorf("%d list requests within the 429's 10 minutes", n)
	}
	limited.Store(false)
	clock.Advance(time.Minute + time.Second)
	_ = p.round(context.Background(), LoopLists, true)
	if n := lists.Load() - before - 1; n != 1 {
		t.Errorf("%d list requests once the 429's time passed, want 1", n)
	}

	// The lists are under a 429 when the next update goes out: its poll
	// waits for the loop.
	limited.Store(true)
	clock.Advance(time.Hour) // update allowed again, lists due
	_ = p.round(context.Background(), LoopLists, true)
	before = lists.Load() // the loop's request, refused until 10 min from now
	statusRound(t, p)
	if countKind(events, EventListUpdated) != 2 || lists.Load() != before {
		t.Errorf("events %v, %d list requests; want the update and none within the 429's time", events.kinds(), lists.Load()-before)
	}
}

// With the feature off the share is not watched: turned on again, or to a
// higher share, by a reload, the wait counts from the first round that
// sees the share held, not from a time the clock kept from before. A
// lower share was reached when the higher one was.
func TestManageClockStartsAfterReload(t *testing.T) {
	t.Run("off and on", func(t *testing.T) {
		p, sim, clock, events := newManagedPoller(t, time.Minute)
		sim.MarkErrored(101, "10.0.0.1", "10.0.0.2", "10.0.0.3")
		statusRound(t, p) // 10:00: the share is reached
		clock.Advance(5 * time.Minute)
		reconfigureManage(t, p, 0) // 10:05: off
		statusRound(t, p)
		clock.Advance(40 * time.Minute)
		reconfigureManage(t, p, 0.5) // 10:45: on
		statusRound(t, p)
		wantRequestAfter(t, p, clock, events)
	})
	t.Run("share lowered", func(t *testing.T) {
		p, sim, clock, events := newManagedPoller(t, time.Minute)
		sim.MarkErrored(101, "10.0.0.1", "10.0.0.2", "10.0.0.3")
		statusRound(t, p) // 10:00: 0.5 reached, and so 0.3
		clock.Advance(5 * time.Minute)
		reconfigureManage(t, p, 0.3)
		statusRound(t, p)
		clock.Advance(5 * time.Minute)
		statusRound(t, p) // 10:10
		if n := countKind(events, EventListUpdateRequested); n != 1 {
			t.Errorf("events %v: want a request at 10:10, when 0.3 had held for update_list_after", events.kinds())
		}
	})
	t.Run("share raised", func(t *testing.T) {
		p, sim, clock, events := newManagedPoller(t, time.Minute)
		reconfigureManage(t, p, 0.3)
		sim.MarkErrored(101, "10.0.0.1")
		statusRound(t, p) // 10:00: 1 of 3 holds 0.3
		clock.Advance(8 * time.Minute)
		reconfigureManage(t, p, 0.6)
		sim.MarkErrored(101, "10.0.0.1", "10.0.0.2", "10.0.0.3")
		statusRound(t, p) // 10:08: 0.6 reached
		wantRequestAfter(t, p, clock, events)
	})
}

// wantRequestAfter checks that no list update goes out before
// update_list_after (10m) from now, and that one goes out then.
func wantRequestAfter(t *testing.T, p *Poller, clock *fakeClock, events *eventLog) {
	t.Helper()
	clock.Advance(10*time.Minute - time.Second)
	statusRound(t, p)
	if got := events.kinds(); len(got) != 0 {
		t.Fatalf("request before update_list_after had passed: %v", got)
	}
	clock.Advance(time.Second)
	statusRound(t, p)
	if n := countKind(events, EventListUpdateRequested); n != 1 {
		t.Errorf("events %v: want one request once update_list_after had passed", events.kinds())
	}
}

// reconfigureManage reloads p with update_list_share set to share.
func reconfigureManage(t *testing.T, p *Poller, share float64) {
	t.Helper()
	c, cfg, _ := p.current()
	cfg.Manage.UpdateListShare = share
	if err := p.Reconfigure(c, cfg, false); err != nil {
		t.Fatal(err)
	}
}

// When the poll of the new list fails, the lists loop is woken to retry
// it at its backoff, not at the end of the wait it was sleeping (up to
// ip_list) while the pool keeps the replaced IPs.
func TestManageFailedNewListPollWakesListsLoop(t *testing.T) {
	clock := newFakeClock()
	var failLists atomic.Bool
	p, sim, events := managedPoller(t, clock, time.Hour, func(w http.ResponseWriter, r *http.Request) bool {
		if failLists.Load() && strings.HasPrefix(r.URL.Path, "/api/iplist/") {
			w.WriteHeader(http.StatusInternalServerError)
			return true
		}
		return false
	})
	sim.MarkErrored(101, "10.0.0.1", "10.0.0.2", "10.0.0.3")
	statusRound(t, p)
	clock.Advance(10 * time.Minute)
	select {
	case <-p.kicks[LoopLists]: // whatever woke it before
	default:
	}
	failLists.Store(true)
	statusRound(t, p) // the update, then the new list's poll fails
	if countKind(events, EventListUpdated) != 1 {
		t.Fatalf("events %v, want the update", events.kinds())
	}
	select {
	case <-p.kicks[LoopLists]:
	default:
		t.Errorf("the lists loop was not woken after the new list's poll failed")
	}
	p.mu.Lock()
	failures, next := 0, time.Time{}
	if c := p.clocks[LoopLists][unit{service: 101}]; c != nil {
		failures, next = c.failures, c.next
	}
	p.mu.Unlock()
	if failures != 1 || next.Sub(clock.Now()) > time.Minute {
		t.Errorf("lists clock after the failed poll: %d failures, next in %s; want one failure and a retry within the backoff", failures, next.Sub(clock.Now()))
	}
}
