package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/proxyd/proxyd/pool"
)

// cmdPool is `proxyd pool`: the live pool of a running daemon from its
// admin /pool endpoint, or with -events its event log from /events, as a
// table or JSON.
func cmdPool(ctx context.Context, args []string, io stdio) int {
	fs := flag.NewFlagSet("pool", flag.ContinueOnError)
	fs.SetOutput(io.err)
	admin := fs.String("admin", defaultConfig().Admin.Address, "admin address of the daemon")
	asJSON := fs.Bool("json", false, "print the endpoint's JSON")
	events := fs.Bool("events", false, "print the event log (/events), newest first, instead of the pool")
	service := fs.String("service", "", "only this service ID")
	state := fs.String("state", "", "only upstreams in this state (not with -events)")
	listener := fs.String("listener", "", "only this listener's upstreams (not with -events)")
	upstream := fs.String("upstream", "", "with -events: only events of this upstream ID (as /pool names it)")
	kind := fs.String("kind", "", "with -events: only events of this kind")
	token := fs.String("token", "", "token of an admin address that wants one (default $PROXYD_ADMIN_TOKEN)")
	if code, ok := parseFlags(fs, args, io); !ok {
		return code
	}
	if *token == "" {
		*token = io.getenv("PROXYD_ADMIN_TOKEN")
	}
	path, filters := "/pool", map[string]string{"service": *service, "state": *state, "listener": *listener}
	if *events {
		if *state != "" || *listener != "" {
			fmt.Fprintln(io.err, "proxyd pool: -state and -listener filter the pool, not -events")
			return 2
		}
		path, filters = "/events", map[string]string{"service": *service, "upstream": *upstream, "kind": *kind}
	} else if *upstream != "" || *kind != "" {
		fmt.Fprintln(io.err, "proxyd pool: -upstream and -kind need -events")
		return 2
	}
	body, code := fetchAdmin(ctx, io, *admin, path, filters, *token)
	if code != 0 {
		return code
	}
	if *asJSON {
		io.out.Write(ensureNewline(body))
		return 0
	}
	var err error
	if *events {
		var ev eventsAnswer
		if err = json.Unmarshal(body, &ev); err != nil {
			err = fmt.Errorf("decoding /events: %w", err)
		} else {
			err = renderEvents(io.out, ev, time.Now())
		}
	} else {
		var ans poolAnswer
		if err = json.Unmarshal(body, &ans); err != nil {
			err = fmt.Errorf("decoding /pool: %w", err)
		} else if err = renderPool(io.out, ans.Explanation, time.Now()); err == nil && ans.Account != nil {
			err = renderAccount(io.out, *ans.Account)
		}
	}
	if err != nil {
		fmt.Fprintf(io.err, "proxyd pool: %v\n", err)
		return 1
	}
	return 0
}

// fetchAdmin GETs path with the non-empty filters as its query from the
// admin address; code is the exit code when it is not 0.
func fetchAdmin(ctx context.Context, io stdio, admin, path string, filters map[string]string, token string) (body []byte, code int) {
	target := admin
	if !strings.Contains(target, "://") {
		target = "http://" + target
	}
	target += path
	q := url.Values{}
	for k, v := range filters {
		if v != "" {
			q.Set(k, v)
		}
	}
	if len(q) > 0 {
		target += "?" + q.Encode()
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		fmt.Fprintf(io.err, "proxyd pool: %v\n", err)
		return nil, 2
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := (&http.Client{Transport: &http.Transport{Proxy: nil}}).Do(req)
	if err != nil {
		fmt.Fprintf(io.err, "proxyd pool: is proxyd running with its admin server on %s? %v\n", admin, err)
		return nil, 1
	}
	defer resp.Body.Close()
	body, err = readAllLimit(resp.Body, 64<<20)
	if err != nil {
		fmt.Fprintf(io.err, "proxyd pool: %v\n", err)
		return nil, 1
	}
	if resp.StatusCode != http.StatusOK {
		fmt.Fprintf(io.err, "proxyd pool: %s: %s\n", resp.Status, strings.TrimSpace(string(body)))
		return nil, 1
	}
	return body, 0
}

func readAllLimit(r io.Reader, n int64) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(r, n+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > n {
		return nil, fmt.Errorf("answer larger than %d bytes", n)
	}
	return b, nil
}

// renderPool writes the listeners, then every upstream with its state and
// the reason for it.
func renderPool(w io.Writer, ex pool.Explanation, now time.Time) error {
	lt := table{head: []string{"LISTENER", "USABLE", "TOTAL", "PANIC"}}
	for _, l := range ex.Listeners {
		panic := "no"
		if l.Panic {
			panic = "YES"
		}
		lt.add(l.Name, l.Usable, l.Total, panic)
	}
	if err := lt.write(w); err != nil {
		return err
	}
	fmt.Fprintln(w)
	ut := table{head: []string{"UPSTREAM", "STATE", "REASON", "FAILURES", "CONSEC", "EJECTIONS", "EJECTED UNTIL", "IN-FLIGHT", "EXIT IP"}}
	counts := map[pool.State]int{}
	for _, u := range ex.Upstreams {
		until := "-"
		if u.EjectedUntil != nil && !u.EjectedUntil.IsZero() {
			until = u.EjectedUntil.UTC().Format(time.RFC3339)
			if d := u.EjectedUntil.Sub(now); d > 0 {
				until += fmt.Sprintf(" (in %s)", d.Round(time.Second))
			}
		}
		ut.add(u.ID, string(u.State), u.Reason, u.Failures, u.ConsecutiveFailures, u.Ejections, until, u.InFlight, u.ExitIP)
		counts[u.State]++
	}
	if err := ut.write(w); err != nil {
		return err
	}
	var sum []string
	for _, s := range pool.States() {
		if counts[s] > 0 {
			sum = append(sum, fmt.Sprintf("%d %s", counts[s], s))
		}
	}
	updated := "never"
	if !ex.Updated.IsZero() {
		updated = ex.Updated.UTC().Format(time.RFC3339)
	}
	fmt.Fprintf(w, "\n%d upstreams (%s); pool updated %s\n", len(ex.Upstreams), strings.Join(sum, ", "), updated)
	if len(ex.Unserved) == 0 {
		return nil
	}
	// Sessions the provider lists that no IP list gives a port for: no
	// connection goes through them, but an errored exit IP is rotated.
	st := table{head: []string{"UNSERVED SESSION", "SERVICE", "SERVER", "EXIT IP", "EXIT ERRORED", "ROTATING"}}
	for _, u := range ex.Unserved {
		st.add(u.Session, u.Service, u.Server, u.ExitIP, yesNo(u.ExitErrored), yesNo(u.Rotating))
	}
	fmt.Fprintln(w)
	if err := st.write(w); err != nil {
		return err
	}
	fmt.Fprintf(w, "\n%s no upstream stands for (no connection goes through them; an errored exit IP is rotated)\n", count(len(ex.Unserved), "sticky session"))
	return nil
}

// count is "1 event", "2 events": n and the noun, plural unless n is 1.
func count(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return strconv.Itoa(n) + " " + noun + "s"
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// renderEvents writes the event log, newest first as /events gives it.
func renderEvents(w io.Writer, ev eventsAnswer, now time.Time) error {
	t := table{head: []string{"TIME", "AGO", "KIND", "UPSTREAM", "SERVICE", "REASON"}}
	for _, e := range ev.Events {
		service := "-"
		if e.Service != 0 {
			service = strconv.Itoa(e.Service)
		}
		t.add(e.Time.UTC().Format(time.RFC3339), ago(now, e.Time), string(e.Kind), e.Upstream, service, e.Reason)
	}
	if err := t.write(w); err != nil {
		return err
	}
	fmt.Fprintf(w, "\n%s\n", count(len(ev.Events), "event"))
	return nil
}

// poolAnswer is GET /pool: the pool's explanation and, once the account is
// known, its standing (an unpaid invoice is how services get suspended, which
// takes their upstreams away).
type poolAnswer struct {
	pool.Explanation
	Account *accountSummary `json:"account,omitempty"`
}

// accountSummary holds what has been read of the account: the credit and
// the invoices come from two endpoints, and a part not read yet (its
// endpoint failing so far) is left out rather than shown as 0.
type accountSummary struct {
	CreditUSD      *float64 `json:"credit_usd,omitempty"`
	UnpaidInvoices *int     `json:"unpaid_invoices,omitempty"`
	UnpaidUSD      *float64 `json:"unpaid_usd,omitempty"`
}

// renderAccount is the summary line of the account under the pool table.
func renderAccount(w io.Writer, a accountSummary) error {
	credit := "credit not read yet"
	if a.CreditUSD != nil {
		credit = fmt.Sprintf("credit %.2f USD", *a.CreditUSD)
	}
	var err error
	switch {
	case a.UnpaidInvoices == nil:
		_, err = fmt.Fprintf(w, "account: %s; invoices not read yet\n", credit)
	case *a.UnpaidInvoices == 0:
		_, err = fmt.Fprintf(w, "account: %s; no unpaid invoice\n", credit)
	default:
		_, err = fmt.Fprintf(w, "account: %s; %s (%.2f USD): pay before the provider suspends services\n",
			credit, count(*a.UnpaidInvoices, "unpaid invoice"), *a.UnpaidUSD)
	}
	return err
}
