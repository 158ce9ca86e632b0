//go:build !race && unix

package forward

import (
	"syscall"
	"unsafe"
)

// rawRead reads fd once (again on EINTR) with a raw system call; p is not
// empty.
func rawRead(fd uintptr, p []byte) (int, syscall.Errno) {
	for {
		r1, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
		if e != syscall.EINTR {
			return int(r1), e
		}
	}
}

// rawWrite writes p to fd once (again on EINTR) with a raw system call; p
// is not empty.
func rawWrite(fd uintptr, p []byte) (int, syscall.Errno) {
	for {
		r1, _, e := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
		if e != syscall.EINTR {
			return int(r1), e
		}
	}
}
