package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/proxyd/proxyd/agent"
)

// adminServer is the admin HTTP server: the status page, /events, /pool,
// /metrics, /healthz and /readyz (see adminHandler for the access rules).
type adminServer struct {
	addr    string                       // the configured address
	srv     *http.Server                 // nil when the admin server is off
	ln      net.Listener                 // bound by bindAdmin, served by serve
	handler atomic.Pointer[http.Handler] // swapped by a reload that changes only the token
	done    chan struct{}
}

// bindAdmin binds the admin address of c ("" = off) and builds its server
// without serving yet: the step of a start or reload that can fail, taken
// before anything is committed.
func bindAdmin(c adminConfig, d *daemon) (*adminServer, error) {
	a := &adminServer{addr: c.Address, done: make(chan struct{})}
	if c.Address == "" {
		close(a.done)
		return a, nil
	}
	h, err := d.adminAccess(c)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", c.Address)
	if err != nil {
		return nil, fmt.Errorf("admin.address: %w", err)
	}
	a.handler.Store(&h)
	a.ln = ln
	a.srv = &http.Server{
		Handler:           a,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      30 * time.Second,
	}
	return a, nil
}

// adminAccess is the admin handler for c's token (read from token_file
// again each time, so a reload rotates it).
func (d *daemon) adminAccess(c adminConfig) (http.Handler, error) {
	token := c.Token
	if c.TokenFile != "" {
		t, err := agent.ReadTokenFile(c.TokenFile)
		if err != nil {
			return nil, fmt.Errorf("admin.token_file: %w", err)
		}
		token = t
	}
	return d.adminHandler(token, c.Address), nil
}

func (a *adminServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	(*a.handler.Load()).ServeHTTP(w, r)
}

// serve starts serving a bound admin server.
func (a *adminServer) serve(log *slog.Logger) {
	if a.srv == nil {
		return
	}
	go func() {
		defer close(a.done)
		if err := a.srv.Serve(a.ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("admin server stopped", "err", err)
		}
	}()
}

// close stops the server: in-flight answers get 2 s to finish.
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

// abandon releases a bound server that never served (a reload rolled back).
func (a *adminServer) abandon() {
	if a != nil && a.ln != nil {
		a.ln.Close()
	}
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
	for _, l := range d.pool.Listeners() { // the configured ones (a retiring one is not explained)
		if l.Usable == 0 {
			why = append(why, fmt.Sprintf("listener %s has no usable upstream (%d known)", l.Name, l.Total))
		}
	}
	if len(why) > 0 {
		return false, strings.Join(why, "; ")
	}
	return true, ""
}
