//go:build !unix

package forward

import "syscall"

// peerSilent reports whether an idle connection has nothing to read. Where
// proxyd cannot peek at a socket, every kept connection passes; one the
// upstream closed shows as a stale connection on use.
func peerSilent(syscall.RawConn) bool { return true }

// canAwaitPeer: proxyd cannot peek at a socket here, so a client that
// leaves while its tunnel is being opened is noticed when it is answered.
const canAwaitPeer = false

func peerGone(syscall.RawConn) bool { return false }
