package forward_test

import (
	"context"
	"log/slog"
	"net"
	"time"

	"github.com/proxyd/proxyd/forward"
	"github.com/proxyd/proxyd/pool"
)

// Wiring one listener as cmd/proxyd does: a pool, an optional Observer
// (metrics), Serve in a goroutine, Shutdown on SIGTERM.
func ExampleNewListener() {
	p, err := pool.New(pool.DefaultConfig(), pool.Options{})
	if err != nil {
		panic(err)
	}
	p.SetListeners([]pool.ListenerSlice{{Name: "http"}})
	cfg := forward.DefaultConfig() // the file's keys are decoded onto it
	cfg.Name, cfg.Protocol, cfg.Address = "http", forward.ProtocolHTTP, "127.0.0.1:0"
	l, err := forward.NewListener(cfg, p, nil, slog.Default())
	if err != nil {
		panic(err)
	}
	ln, err := net.Listen("tcp", cfg.Address)
	if err != nil {
		panic(err)
	}
	done := make(chan error, 1)
	go func() { done <- l.Serve(ln) }()

	// ... on SIGTERM:
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = l.Shutdown(ctx)
	if err := <-done; err != nil {
		panic(err)
	}
	// Output:
}
