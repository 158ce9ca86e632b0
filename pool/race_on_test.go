//go:build race

package pool

// raceEnabled: under the race detector sync.Pool drops items at random, so
// slog's pooled buffers allocate; allocation counts are checked without it.
const raceEnabled = true
