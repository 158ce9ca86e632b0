package main

import (
	"context"
	"io"
	"log/slog"
	"slices"
	"sync/atomic"
)

// logControl changes the daemon's log level and format on reload. The
// loggers handed to the packages (and derived with With) all write through
// one root handler that a reload swaps, so a new [log] format reaches every
// one of them without rebuilding anything.
type logControl struct {
	w     io.Writer
	level slog.LevelVar
	root  atomic.Pointer[slog.Handler]
}

// newLogger builds the daemon's logger and its control.
func newLogger(c logConfig, w io.Writer) (*slog.Logger, *logControl) {
	lc := &logControl{w: w}
	lc.set(c)
	return slog.New(&switchHandler{root: &lc.root}), lc
}

// set applies a [log] section.
func (lc *logControl) set(c logConfig) {
	lc.level.Set(logLevel(c.Level))
	opts := &slog.HandlerOptions{Level: &lc.level}
	var h slog.Handler = slog.NewTextHandler(lc.w, opts)
	if c.Format == "json" {
		h = slog.NewJSONHandler(lc.w, opts)
	}
	lc.root.Store(&h)
}

// switchHandler writes through the current root handler, with the
// attributes and groups of the With calls that derived it.
type switchHandler struct {
	root  *atomic.Pointer[slog.Handler]
	ops   []func(slog.Handler) slog.Handler
	cache atomic.Pointer[derivedHandler]
}

type derivedHandler struct {
	root *slog.Handler
	h    slog.Handler
}

func (s *switchHandler) current() slog.Handler {
	r := s.root.Load()
	if c := s.cache.Load(); c != nil && c.root == r {
		return c.h
	}
	h := *r
	for _, op := range s.ops {
		h = op(h)
	}
	s.cache.Store(&derivedHandler{root: r, h: h})
	return h
}

func (s *switchHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return s.current().Enabled(ctx, l)
}

func (s *switchHandler) Handle(ctx context.Context, r slog.Record) error {
	return s.current().Handle(ctx, r)
}

func (s *switchHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return s.with(func(h slog.Handler) slog.Handler { return h.WithAttrs(as) })
}

func (s *switchHandler) WithGroup(name string) slog.Handler {
	return s.with(func(h slog.Handler) slog.Handler { return h.WithGroup(name) })
}

func (s *switchHandler) with(op func(slog.Handler) slog.Handler) slog.Handler {
	return &switchHandler{root: s.root, ops: append(slices.Clip(s.ops), op)}
}
