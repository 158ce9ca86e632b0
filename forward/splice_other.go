//go:build !linux

package forward

import "net"

// Elsewhere io.Copy between TCP sockets copies through a buffer as well,
// so a TCP direction is pumped like any other.
func (t *tunnel) pumpTCP(dst net.Conn, src *net.TCPConn) int64 {
	return t.pumpBuffered(dst, src)
}

// acked: no measure of a reader's progress here; watchLast goes by the
// bytes read (pumpBuffered's writes are at most copyBufSize).
func acked(net.Conn) uint64 { return 0 }
