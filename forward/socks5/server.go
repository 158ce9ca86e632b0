package socks5

import (
	"bytes"
	"fmt"
	"io"
	"net/netip"
)

// ServerConfig is the server side's authentication policy. The zero value
// accepts clients with and without credentials and any password.
type ServerConfig struct {
	// RequireAuth refuses clients that do not offer username/password
	// (method 0x02) with 0xFF. When false, a client that offers it is still
	// asked for it, so that its username (a sticky session key) can be read.
	RequireAuth bool
	// Authenticate checks a username and password. nil accepts any.
	// It is called whenever the client sent credentials, required or not.
	Authenticate func(user, pass string) bool
}

// Request is a client's request as read by ReadRequest.
type Request struct {
	Command  byte   // CmdConnect, CmdBind, CmdUDPAssociate, or whatever the client sent
	Dest     Addr   // the destination; Host empty when its address type was not supported
	Username string // RFC 1929 credentials, empty when Method is MethodNoAuth
	Password string
	Method   byte // the method selected: MethodNoAuth or MethodUserPass
}

// serverBufSize holds the largest single read or write of the server side:
// a method list or credential (1 + 255 bytes) or a domain name and port.
const serverBufSize = 1 + 255 + 2

// ReadRequest reads one client's handshake from rw and answers the parts
// that do not depend on the destination: the greeting and its method
// selection, and the RFC 1929 subnegotiation. It stops after the request;
// the caller answers it with WriteReply.
//
// Method selection: if the client offers username/password it is selected;
// otherwise no-auth if !cfg.RequireAuth; otherwise 0xFF is sent and
// ErrNoAcceptableMethod returned. Failed credentials are answered with
// status 0x01 and ErrAuthFailed is returned. A request with an unsupported
// command or address type returns the Request with a *RequestError whose
// Reply the caller should send. A version byte other than 5 (1 in the
// subnegotiation) gives ErrVersion; truncated input gives ErrMalformed
// wrapping io.EOF or io.ErrUnexpectedEOF. Network errors are returned
// wrapped. The caller sets the deadlines and closes rw after any error.
func ReadRequest(rw io.ReadWriter, cfg ServerConfig) (*Request, error) {
	var buf [serverBufSize]byte

	// Greeting: VER NMETHODS METHODS...
	if err := readFull(rw, buf[:2], "greeting"); err != nil {
		return nil, err
	}
	if buf[0] != VersionSOCKS5 {
		return nil, fmt.Errorf("reading greeting: %w: 0x%02x", ErrVersion, buf[0])
	}
	methods := buf[:buf[1]]
	if err := readFull(rw, methods, "greeting methods"); err != nil {
		return nil, err
	}
	method := byte(MethodNoAcceptable)
	switch {
	case bytes.IndexByte(methods, MethodUserPass) >= 0:
		method = MethodUserPass
	case !cfg.RequireAuth && bytes.IndexByte(methods, MethodNoAuth) >= 0:
		method = MethodNoAuth
	}
	buf[0], buf[1] = VersionSOCKS5, method
	if _, err := rw.Write(buf[:2]); err != nil {
		return nil, fmt.Errorf("writing method selection: %w", err)
	}
	if method == MethodNoAcceptable {
		return nil, ErrNoAcceptableMethod
	}
	req := &Request{Method: method}

	if method == MethodUserPass {
		// RFC 1929: VER ULEN UNAME PLEN PASSWD
		if err := readFull(rw, buf[:2], "username/password"); err != nil {
			return nil, err
		}
		if buf[0] != VersionUserPass {
			return nil, fmt.Errorf("reading username/password: %w: 0x%02x", ErrVersion, buf[0])
		}
		ulen := int(buf[1])
		if err := readFull(rw, buf[:ulen+1], "username/password"); err != nil {
			return nil, err
		}
		req.Username = string(buf[:ulen])
		plen := int(buf[ulen])
		if err := readFull(rw, buf[:plen], "username/password"); err != nil {
			return nil, err
		}
		req.Password = string(buf[:plen])
		ok := cfg.Authenticate == nil || cfg.Authenticate(req.Username, req.Password)
		buf[0], buf[1] = VersionUserPass, UserPassSucceeded
		if !ok {
			buf[1] = UserPassFailed
		}
		if _, err := rw.Write(buf[:2]); err != nil {
			return nil, fmt.Errorf("writing authentication status: %w", err)
		}
		if !ok {
			return nil, ErrAuthFailed
		}
	}

	// Request: VER CMD RSV ATYP DST.ADDR DST.PORT. RSV is not checked:
	// RFC 1928 only reserves it.
	if err := readFull(rw, buf[:4], "request"); err != nil {
		return nil, err
	}
	if buf[0] != VersionSOCKS5 {
		return nil, fmt.Errorf("reading request: %w: 0x%02x", ErrVersion, buf[0])
	}
	req.Command = buf[1]
	switch atyp := buf[3]; atyp {
	case AtypIPv4:
		if err := readFull(rw, buf[:4+2], "request address"); err != nil {
			return nil, err
		}
		req.Dest.Host = netip.AddrFrom4([4]byte(buf[:4])).String()
		req.Dest.Port = uint16(buf[4])<<8 | uint16(buf[5])
	case AtypIPv6:
		if err := readFull(rw, buf[:16+2], "request address"); err != nil {
			return nil, err
		}
		req.Dest.Host = netip.AddrFrom16([16]byte(buf[:16])).String()
		req.Dest.Port = uint16(buf[16])<<8 | uint16(buf[17])
	case AtypDomain:
		if err := readFull(rw, buf[:1], "request address"); err != nil {
			return nil, err
		}
		n := int(buf[0])
		if err := readFull(rw, buf[:n+2], "request address"); err != nil {
			return nil, err
		}
		req.Dest.Port = uint16(buf[n])<<8 | uint16(buf[n+1])
		if !validHost(buf[:n]) {
			return req, &RequestError{Reply: ReplyAddressNotSupported, why: fmt.Sprintf("invalid domain name (%d bytes)", n)}
		}
		req.Dest.Host = string(buf[:n])
	default:
		// The address's length is unknown, so nothing after ATYP can be read.
		return req, &RequestError{Reply: ReplyAddressNotSupported, why: fmt.Sprintf("address type 0x%02x", atyp)}
	}
	if req.Command != CmdConnect {
		return req, &RequestError{Reply: ReplyCommandNotSupported, why: fmt.Sprintf("command 0x%02x", req.Command)}
	}
	return req, nil
}

// WriteReply sends a reply to a request: reply is a Reply* code, bind the
// address the server bound for the connection (the zero Addr is sent as
// 0.0.0.0:0). It writes the whole reply in one call.
func WriteReply(w io.Writer, reply byte, bind Addr) error {
	if bind.Host != "" && !validHost(bind.Host) {
		return fmt.Errorf("writing reply: %w", errBadHost(bind.Host))
	}
	var buf [3 + 1 + 1 + MaxDomainBytes + 2]byte
	b := append(buf[:0], VersionSOCKS5, reply, 0)
	b = appendAddr(b, bind)
	if _, err := w.Write(b); err != nil {
		return fmt.Errorf("writing reply: %w", err)
	}
	return nil
}
