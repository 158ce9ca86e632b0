//go:build !linux

package main

import "errors"

// monotonicUsec: systemd, and so sd_notify, exists only on Linux.
func monotonicUsec() (int64, error) {
	return 0, errors.New("no systemd monotonic clock on this system")
}
