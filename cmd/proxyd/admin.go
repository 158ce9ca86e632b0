package main

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/proxyd/proxyd/pool"
)

// adminServer serves /metrics, /healthz, /readyz and /pool (DESIGN.md §5).
type adminServer struct {
	srv  *http.Server
	ln   net.Listener
	done chan struct{}
}

func startAdmin(c adminConfig, d *daemon) (*adminServer, error) {
	if c.Address == "" {
		return &adminServer{}, nil
	}
	token := c.Token
	if c.TokenFile != "" {
		t, err := readSecretFile(c.TokenFile)
		if err != nil {
			return nil, fmt.Errorf("admin token: %w", err)
		}
		token = t
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", d.metrics.Handler())
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		if ok, why := d.readiness(); !ok {
			http.Error(w, why, http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	})
	mux.HandleFunc("GET /pool", d.servePool)
	var h http.Handler = mux
	if token != "" {
		h = requireBearer(token, mux)
	}
	ln, err := net.Listen("tcp", c.Address)
	if err != nil {
		return nil, fmt.Errorf("admin: %w", err)
	}
	a := &adminServer{
		srv: &http.Server{
			Handler:           h,
			ReadHeaderTimeout: 10 * time.Second,
			ReadTimeout:       30 * time.Second,
			WriteTimeout:      30 * time.Second,
		},
		ln:   ln,
		done: make(chan struct{}),
	}
	go func() {
		defer close(a.done)
		if err := a.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			d.log.Error("admin server stopped", "err", err)
		}
	}()
	return a, nil
}

func (a *adminServer) close() {
	if a == nil || a.srv == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	a.srv.Shutdown(ctx)
	a.srv.Close()
	<-a.done
}

func requireBearer(token string, next http.Handler) http.Handler {
	want := []byte("Bearer " + token)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/healthz" && subtle.ConstantTimeCompare([]byte(r.Header.Get("Authorization")), want) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="proxyd"`)
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// readiness: every listener accepting and with at least one usable upstream.
func (d *daemon) readiness() (bool, string) {
	select {
	case <-d.ready:
	default:
		return false, "starting"
	}
	if name, stopped := d.stoppedListener(); stopped {
		return false, "listener " + name + " is not accepting"
	}
	var why []string
	for _, l := range d.pool.Listeners() {
		if l.Usable == 0 {
			why = append(why, fmt.Sprintf("listener %s has no usable upstream (%d known)", l.Name, l.Total))
		}
	}
	if len(why) > 0 {
		return false, strings.Join(why, "; ")
	}
	return true, ""
}

// servePool answers GET /pool?service=ID&state=STATE&listener=NAME.
func (d *daemon) servePool(w http.ResponseWriter, r *http.Request) {
	ex := d.pool.Explain()
	q := r.URL.Query()
	if s := q.Get("service"); s != "" {
		id, err := strconv.Atoi(s)
		if err != nil {
			http.Error(w, "service must be a number", http.StatusBadRequest)
			return
		}
		ex.Upstreams = slices.DeleteFunc(ex.Upstreams, func(u pool.UpstreamExplanation) bool { return u.Service != id })
	}
	if s := q.Get("state"); s != "" {
		if !slices.Contains(pool.States(), pool.State(s)) {
			http.Error(w, "unknown state", http.StatusBadRequest)
			return
		}
		ex.Upstreams = slices.DeleteFunc(ex.Upstreams, func(u pool.UpstreamExplanation) bool { return string(u.State) != s })
	}
	if name := q.Get("listener"); name != "" {
		d.mu.Lock()
		lc, ok := d.cfg.listenerNamed(name)
		d.mu.Unlock()
		if !ok {
			http.Error(w, "unknown listener", http.StatusNotFound)
			return
		}
		slice := listenerSlices([]listenerConfig{lc})[0]
		ex.Upstreams = slices.DeleteFunc(ex.Upstreams, func(u pool.UpstreamExplanation) bool { return !slice.Covers(u.Service, u.Kind, u.Protocol) })
		ex.Listeners = slices.DeleteFunc(ex.Listeners, func(l pool.ListenerExplanation) bool { return l.Name != name })
	}
	if ex.Upstreams == nil {
		ex.Upstreams = []pool.UpstreamExplanation{}
	}
	if ex.Listeners == nil {
		ex.Listeners = []pool.ListenerExplanation{}
	}
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(ex)
}
