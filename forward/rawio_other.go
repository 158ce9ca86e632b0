//go:build !unix

package forward

import "syscall"

// Where sockets are not file descriptors, reads and writes go through
// net.Conn: newRawIO gives no rawIO, so these are never called.

const rawIOSupported = false

func rawRead(uintptr, []byte) (int, syscall.Errno)  { return 0, syscall.EINVAL }
func rawWrite(uintptr, []byte) (int, syscall.Errno) { return 0, syscall.EINVAL }
