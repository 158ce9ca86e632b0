package main

import "golang.org/x/sys/unix"

// monotonicUsec is CLOCK_MONOTONIC in microseconds, the clock systemd
// compares RELOADING=1's MONOTONIC_USEC with.
func monotonicUsec() (int64, error) {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return 0, err
	}
	return ts.Nano() / 1e3, nil
}
