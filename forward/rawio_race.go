//go:build race && unix

package forward

import (
	"errors"
	"syscall"
)

// Under the race detector the reads and writes go through package syscall,
// which tells the detector what memory they touch (raw system calls do not).

func rawRead(fd uintptr, p []byte) (int, syscall.Errno) {
	for {
		n, err := syscall.Read(int(fd), p)
		if !errors.Is(err, syscall.EINTR) {
			return n, errno(err)
		}
	}
}

func rawWrite(fd uintptr, p []byte) (int, syscall.Errno) {
	for {
		n, err := syscall.Write(int(fd), p)
		if !errors.Is(err, syscall.EINTR) {
			return n, errno(err)
		}
	}
}

func errno(err error) syscall.Errno {
	var e syscall.Errno
	if err != nil && !errors.As(err, &e) {
		return syscall.EIO
	}
	return e
}
