//go:build unix

package forward

// rawIOSupported: sockets are file descriptors that read(2) and write(2) take.
const rawIOSupported = true
