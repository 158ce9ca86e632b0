package socks5

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
)

// clientBufSize holds the largest write of the client side: a pipelined
// greeting (4 bytes), RFC 1929 request (1 + 1 + 255 + 1 + 255 bytes) and
// CONNECT request (3 + 1 + 1 + 255 + 2 bytes).
const clientBufSize = 4 + (3 + 2*MaxCredentialBytes) + (3 + 1 + 1 + MaxDomainBytes + 2)

// Client holds the options of the client side. The zero value is what
// ClientHandshake uses.
type Client struct {
	// Pipeline sends the greeting, the credentials and the request in one
	// write without waiting for each answer, saving one round trip to the
	// upstream (two with credentials). It offers a single method then
	// (username/password when a username is given, else no-auth), so that
	// the upstream's choice cannot change how the bytes that follow it are
	// read. RFC 1928 does not promise that a server keeps bytes that arrive
	// before it answers (ReadRequest does, and Dante 1.4 keeps a request
	// sent behind its greeting; see the tests of this package and of
	// package forward). With a username, a failure where one message at a
	// time might have worked is told by ErrPipelineFailed; without one, a
	// silence after the greeting looks like a slow destination's.
	Pipeline bool
}

// ClientHandshake asks the SOCKS5 upstream on the other end of rw (already
// dialed; the caller sets its deadlines) to CONNECT to dest, and returns
// the address the upstream bound. On success rw carries the destination's
// bytes; nothing past the reply has been read.
//
// It offers no-auth and, when user != "", username/password, and waits for
// each answer before the next message (see Client.Pipeline for the
// faster way). A domain name in dest is sent unresolved (ATYP 3), IP
// literals as ATYP 1 or 4.
//
// Errors: *ReplyError for a non-zero reply (see DestinationFault);
// ErrAuthRejected when the upstream selects 0xFF or refuses the credentials;
// ErrMalformed (wrapping the detail, and io.EOF or io.ErrUnexpectedEOF when
// the upstream closed early) for answers that are not SOCKS5;
// ErrAwaitingReply wrapping any failure to read the reply once the
// greeting was answered; ErrPipelineFailed (see Client.Pipeline); ErrBadAddress
// and ErrBadCredentials for arguments that cannot be sent (nothing is
// written then); otherwise the network error, wrapped (a timeout satisfies
// errors.Is(err, os.ErrDeadlineExceeded)).
func ClientHandshake(rw io.ReadWriter, dest Addr, user, pass string) (bound Addr, err error) {
	return Client{}.Handshake(rw, dest, user, pass)
}

// Handshake is ClientHandshake with the options of c.
func (c Client) Handshake(rw io.ReadWriter, dest Addr, user, pass string) (bound Addr, err error) {
	if !validHost(dest.Host) {
		return Addr{}, errBadHost(dest.Host)
	}
	if len(user) > MaxCredentialBytes || len(pass) > MaxCredentialBytes {
		return Addr{}, ErrBadCredentials
	}
	var buf [clientBufSize]byte
	// A pipelined handshake with credentials says when it failed where one
	// message at a time might not have (ErrPipelineFailed): not by the
	// upstream's verdict (credentials refused, a reply code), and not by a
	// silence before the greeting's answer or after the credentials' answer,
	// which one message at a time would meet too.
	piped, credentials, verdict := c.Pipeline && user != "", false, false
	defer func() {
		if err != nil && piped && !verdict && (credentials || !isTimeout(err)) {
			err = fmt.Errorf("%w: %w", ErrPipelineFailed, err)
		}
	}()

	// Greeting, and in a pipeline everything else too.
	var b []byte
	switch {
	case user == "":
		b = append(buf[:0], VersionSOCKS5, 1, MethodNoAuth)
	case c.Pipeline:
		b = append(buf[:0], VersionSOCKS5, 1, MethodUserPass)
		b = appendUserPass(b, user, pass)
	default:
		b = append(buf[:0], VersionSOCKS5, 2, MethodNoAuth, MethodUserPass)
	}
	if c.Pipeline {
		b = appendRequest(b, dest)
	}
	if _, err := rw.Write(b); err != nil {
		return Addr{}, fmt.Errorf("writing greeting: %w", err)
	}

	if err := readFull(rw, buf[:2], "method selection"); err != nil {
		return Addr{}, err
	}
	if buf[0] != VersionSOCKS5 {
		return Addr{}, malformed(fmt.Sprintf("method selection version 0x%02x", buf[0]), nil)
	}
	switch m := buf[1]; {
	case m == MethodNoAcceptable:
		return Addr{}, ErrAuthRejected
	case m == MethodNoAuth && !(c.Pipeline && user != ""):
	case m == MethodUserPass && user != "":
		credentials = true // awaiting their answer
		if !c.Pipeline {
			b = appendUserPass(buf[:0], user, pass)
			if _, err := rw.Write(b); err != nil {
				return Addr{}, fmt.Errorf("writing username/password: %w", err)
			}
		}
		if err := readFull(rw, buf[:2], "authentication status"); err != nil {
			return Addr{}, err
		}
		// Some servers put the SOCKS version (5) instead of the
		// subnegotiation version (1) here; the status is what matters.
		if buf[0] != VersionUserPass && buf[0] != VersionSOCKS5 {
			return Addr{}, malformed(fmt.Sprintf("authentication status version 0x%02x", buf[0]), nil)
		}
		if buf[1] != UserPassSucceeded {
			verdict = true
			return Addr{}, fmt.Errorf("%w: status 0x%02x", ErrAuthRejected, buf[1])
		}
		credentials = false
	default:
		return Addr{}, malformed(fmt.Sprintf("upstream selected method 0x%02x that was not offered", m), nil)
	}

	if !c.Pipeline {
		// The request, in one write.
		if _, err := rw.Write(appendRequest(buf[:0], dest)); err != nil {
			return Addr{}, fmt.Errorf("writing request: %w", err)
		}
	}

	// Reply: VER REP RSV ATYP BND.ADDR BND.PORT.
	if err := readFull(rw, buf[:4], "reply"); err != nil {
		return Addr{}, fmt.Errorf("%w: %w", ErrAwaitingReply, err)
	}
	if buf[0] != VersionSOCKS5 {
		return Addr{}, malformed(fmt.Sprintf("reply version 0x%02x", buf[0]), nil)
	}
	if buf[1] != ReplySucceeded {
		// The bound address of a failure reply carries nothing of use and
		// the connection is done; it is not read.
		verdict = true
		return Addr{}, &ReplyError{Code: buf[1]}
	}
	switch atyp := buf[3]; atyp {
	case AtypIPv4:
		if err := readFull(rw, buf[:4+2], "reply address"); err != nil {
			return Addr{}, err
		}
		bound.Host = netip.AddrFrom4([4]byte(buf[:4])).String()
		bound.Port = uint16(buf[4])<<8 | uint16(buf[5])
	case AtypIPv6:
		if err := readFull(rw, buf[:16+2], "reply address"); err != nil {
			return Addr{}, err
		}
		bound.Host = netip.AddrFrom16([16]byte(buf[:16])).String()
		bound.Port = uint16(buf[16])<<8 | uint16(buf[17])
	case AtypDomain:
		if err := readFull(rw, buf[:1], "reply address"); err != nil {
			return Addr{}, err
		}
		n := int(buf[0])
		if err := readFull(rw, buf[:n+2], "reply address"); err != nil {
			return Addr{}, err
		}
		// The bound name is informative only; it is kept as sent.
		bound.Host = string(buf[:n])
		bound.Port = uint16(buf[n])<<8 | uint16(buf[n+1])
	default:
		return Addr{}, malformed(fmt.Sprintf("reply address type 0x%02x", atyp), nil)
	}
	return bound, nil
}

// appendUserPass appends the RFC 1929 request; lengths are checked.
func appendUserPass(b []byte, user, pass string) []byte {
	b = append(b, VersionUserPass, byte(len(user)))
	b = append(b, user...)
	b = append(b, byte(len(pass)))
	return append(b, pass...)
}

// appendRequest appends a CONNECT request for dest; dest is checked.
func appendRequest(b []byte, dest Addr) []byte {
	return appendAddr(append(b, VersionSOCKS5, CmdConnect, 0), dest)
}

// isTimeout reports whether err is a deadline that passed.
func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, os.ErrDeadlineExceeded) || errors.As(err, &ne) && ne.Timeout()
}
