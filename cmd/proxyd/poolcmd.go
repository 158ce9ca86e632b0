package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/proxyd/proxyd/pool"
)

// cmdPool is `proxyd pool`: the live pool of a running daemon from its
// admin /pool endpoint, as tables or JSON.
func cmdPool(ctx context.Context, args []string, io stdio) int {
	fs := flag.NewFlagSet("pool", flag.ContinueOnError)
	fs.SetOutput(io.err)
	admin := fs.String("admin", defaultConfig().Admin.Address, "admin address of the daemon")
	asJSON := fs.Bool("json", false, "print /pool's JSON")
	service := fs.String("service", "", "only this service ID")
	state := fs.String("state", "", "only upstreams in this state")
	listener := fs.String("listener", "", "only this listener's upstreams")
	token := fs.String("token", "", "bearer token of a non-loopback admin address (default $PROXYD_ADMIN_TOKEN)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *token == "" {
		*token = io.getenv("PROXYD_ADMIN_TOKEN")
	}
	target := *admin
	if !strings.Contains(target, "://") {
		target = "http://" + target
	}
	target += "/pool"
	q := url.Values{}
	for k, v := range map[string]string{"service": *service, "state": *state, "listener": *listener} {
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
		return 2
	}
	if *token != "" {
		req.Header.Set("Authorization", "Bearer "+*token)
	}
	resp, err := (&http.Client{Transport: &http.Transport{Proxy: nil}}).Do(req)
	if err != nil {
		fmt.Fprintf(io.err, "proxyd pool: is proxyd running with its admin server on %s? %v\n", *admin, err)
		return 1
	}
	defer resp.Body.Close()
	body, err := readAllLimit(resp.Body, 64<<20)
	if err != nil {
		fmt.Fprintf(io.err, "proxyd pool: %v\n", err)
		return 1
	}
	if resp.StatusCode != http.StatusOK {
		fmt.Fprintf(io.err, "proxyd pool: %s: %s\n", resp.Status, strings.TrimSpace(string(body)))
		return 1
	}
	if *asJSON {
		io.out.Write(ensureNewline(body))
		return 0
	}
	var ex pool.Explanation
	if err := json.Unmarshal(body, &ex); err != nil {
		fmt.Fprintf(io.err, "proxyd pool: decoding /pool: %v\n", err)
		return 1
	}
	if err := renderPool(io.out, ex, time.Now()); err != nil {
		fmt.Fprintf(io.err, "proxyd pool: %v\n", err)
		return 1
	}
	return 0
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
	return nil
}
