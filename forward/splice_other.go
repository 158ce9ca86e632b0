//go:build !linux

package forward

import "syscall"

// Splicing is Linux's (splice_linux.go); elsewhere every direction copies.

type splicePipe struct{ n int }

type pipeCache struct{}

func (*pipeCache) get() *splicePipe { return nil }
func (*pipeCache) put(*splicePipe)  {}
func (*pipeCache) close()           {}

func (t *tunnel) splice(_, _ syscall.RawConn, _ *splicePipe, _ *readDeadline) (int64, spliceResult) {
	return 0, spliceCaughtUp
}
