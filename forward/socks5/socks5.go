// Package socks5 speaks the SOCKS version 5 wire protocol (RFC 1928) with
// username/password authentication (RFC 1929): the server side of one
// connection's handshake (ReadRequest, WriteReply) and a small client
// (ClientHandshake) for dialing through a SOCKS5 upstream.
//
// Scope: only the bytes of the handshake. Listening, dialing, timeouts,
// relaying, policy on destinations and the choice of reply codes belong to
// the caller (package forward). Only CONNECT is served; BIND and
// UDP ASSOCIATE are parsed so that the caller can answer "command not
// supported". GSSAPI (RFC 1961) is not offered nor accepted. Host names are
// never resolved here: a domain name stays a domain name in both directions.
//
// Why our own client rather than golang.org/x/net/proxy: x/net reports the
// upstream's reply code only inside its error text, and it dials and
// handshakes in one call. proxyd needs the code (replies 0x01 and 0x07–0x08
// blame the upstream, 0x02–0x06 the destination, an authentication failure is
// its own class) and the dial time apart from the handshake time, so the
// caller dials, times and sets deadlines itself and hands the connection to
// ClientHandshake, which returns typed errors.
//
// Neither side reads ahead: every read asks for exactly the bytes the
// protocol announces, so data that follows the handshake on the same
// connection (a client's first bytes, an origin's first answer) stays in the
// connection for the relay. Buffers are small and fixed; no length read from
// the wire can make either side allocate more than a few hundred bytes.
package socks5

import (
	"errors"
	"fmt"
	"io"
	"net/netip"
	"strconv"
)

// Protocol constants of RFC 1928 and RFC 1929.
const (
	VersionSOCKS5 = 5

	MethodNoAuth       = 0x00
	MethodUserPass     = 0x02
	MethodNoAcceptable = 0xFF

	CmdConnect      = 1
	CmdBind         = 2
	CmdUDPAssociate = 3

	ReplySucceeded           = 0
	ReplyGeneralFailure      = 1
	ReplyNotAllowed          = 2
	ReplyNetworkUnreachable  = 3
	ReplyHostUnreachable     = 4
	ReplyConnectionRefused   = 5
	ReplyTTLExpired          = 6
	ReplyCommandNotSupported = 7
	ReplyAddressNotSupported = 8
)

// Address types and the RFC 1929 subnegotiation constants.
const (
	AtypIPv4   = 1
	AtypDomain = 3
	AtypIPv6   = 4

	VersionUserPass    = 1 // RFC 1929 subnegotiation version
	UserPassSucceeded  = 0 // RFC 1929 status: success
	UserPassFailed     = 1 // RFC 1929 status: failure (any non-zero value)
	MaxCredentialBytes = 255
	MaxDomainBytes     = 255
)

// Sentinel errors.
var (
	// ErrAuthFailed: ReadRequest refused the client's username/password
	// (after answering it with RFC 1929 status 0x01).
	ErrAuthFailed = errors.New("socks5: authentication failed")
	// ErrNoAcceptableMethod: ReadRequest found no method it could accept
	// among the client's offer (after answering 0xFF).
	ErrNoAcceptableMethod = errors.New("socks5: no acceptable authentication method")
	// ErrVersion: the peer's version byte was not 5 (or, in the RFC 1929
	// subnegotiation, not 1).
	ErrVersion = errors.New("socks5: unsupported protocol version")
	// ErrAuthRejected: the upstream refused every method ClientHandshake
	// offered (0xFF) or refused its username/password.
	ErrAuthRejected = errors.New("socks5: upstream rejected authentication")
	// ErrMalformed: the peer's bytes are not a valid SOCKS5 message (a wrong
	// version, an unknown method or address type, a truncated message).
	// The returned error wraps it together with the detail.
	ErrMalformed = errors.New("socks5: malformed message")
	// ErrPipelineFailed: a pipelined handshake (Client.Pipeline with a
	// username) failed where one message at a time might not have: the
	// upstream closed, reset or answered something that is not SOCKS5
	// (before or after the greeting's answer), refused the one method
	// offered (0xFF; one message at a time offers no-auth too) or selected
	// no-auth though it was not offered, or left the credentials sent along
	// with the greeting unanswered until the deadline, as a server does that
	// drops bytes arriving before its answer. A silence before the
	// greeting's answer or after the credentials' answer is not this (one
	// message at a time meets it too), and neither is a verdict: the
	// credentials refused, a reply with a failure code. The returned error
	// wraps it together with the cause (ErrAuthRejected, ErrMalformed, the
	// network error).
	ErrPipelineFailed = errors.New("socks5: pipelined handshake failed")
	// ErrBadAddress: an address given to ClientHandshake or WriteReply
	// cannot be sent: not an IP literal without zone nor a domain name of
	// 1–255 letters, digits, '-', '_' and '.'.
	ErrBadAddress = errors.New("socks5: address cannot be sent")
	// ErrBadCredentials: a username or password given to ClientHandshake is
	// longer than 255 bytes.
	ErrBadCredentials = errors.New("socks5: username or password longer than 255 bytes")
	// ErrAwaitingReply: the upstream answered the greeting (and the
	// credentials), so it is there, but reading its reply to the request
	// failed: a server answers the request only once it reached the
	// destination, so a reply that does not come in time may be the
	// destination's slowness. The returned error wraps it together with
	// the cause (the network error, ErrMalformed).
	ErrAwaitingReply = errors.New("socks5: no reply to the request")
)

// Addr is a SOCKS5 address: an IP literal or a domain name, and a port.
// Host holds an IP literal without brackets or zone, or a domain name that
// is never resolved by this package.
type Addr struct {
	Host string
	Port uint16
}

// String returns host:port, with an IPv6 literal in brackets.
func (a Addr) String() string {
	if ip, ok := parseIP(a.Host); ok && ip.Is6() {
		return "[" + a.Host + "]:" + strconv.Itoa(int(a.Port))
	}
	return a.Host + ":" + strconv.Itoa(int(a.Port))
}

// IsDomain reports whether Host is not an IP literal. It looks at the text,
// not at the address type the peer used: "127.0.0.1" sent as a domain name
// is an IP literal here, so checks on literal destinations cannot be
// sidestepped through ATYP 3.
func (a Addr) IsDomain() bool {
	_, ok := parseIP(a.Host)
	return !ok
}

// IP returns Host as an address when it is an IP literal (possibly
// IPv4-mapped IPv6, kept as such), for checks on literal destinations.
func (a Addr) IP() (netip.Addr, bool) {
	return parseIP(a.Host)
}

// parseIP parses an IP literal like netip.ParseAddr, without the error
// value (which allocates) for the common case of a domain name.
func parseIP[T ~string | ~[]byte](h T) (netip.Addr, bool) {
	letters := false
	for i := 0; i < len(h); i++ {
		switch c := h[i]; {
		case c == ':': // IPv6 is the only candidate left
			ip, err := netip.ParseAddr(string(h))
			return ip, err == nil
		case '0' <= c && c <= '9', c == '.':
		case 'a' <= c && c <= 'f', 'A' <= c && c <= 'F':
			letters = true
		default:
			return netip.Addr{}, false // not in an address before its first ':'
		}
	}
	if letters || len(h) == 0 {
		return netip.Addr{}, false // IPv4 has none
	}
	ip, err := netip.ParseAddr(string(h))
	return ip, err == nil
}

// RequestError is returned by ReadRequest, together with the parsed
// Request, when the request is well-formed but cannot be served here: an
// unsupported command or address type. The caller should answer it with
// WriteReply(w, Reply, Addr{}) and close.
type RequestError struct {
	Reply byte
	why   string
}

func (e *RequestError) Error() string {
	return "socks5: " + e.why + " (reply " + ReplyText(e.Reply) + ")"
}

// ReplyError is returned by ClientHandshake when the upstream answered the
// request with a non-zero reply code.
type ReplyError struct {
	Code byte
}

func (e *ReplyError) Error() string {
	return "socks5: upstream replied " + ReplyText(e.Code)
}

// DestinationFault reports whether the reply code points at the destination
// (0x02–0x06: not allowed by ruleset, network or host unreachable, connection
// refused, TTL expired) rather than at the upstream itself (0x01 general
// failure, 0x07 command and 0x08 address type not supported, and any code
// RFC 1928 does not assign).
func (e *ReplyError) DestinationFault() bool {
	return e.Code >= ReplyNotAllowed && e.Code <= ReplyTTLExpired
}

var replyTexts = [...]string{
	ReplySucceeded:           "succeeded",
	ReplyGeneralFailure:      "general SOCKS server failure",
	ReplyNotAllowed:          "connection not allowed by ruleset",
	ReplyNetworkUnreachable:  "network unreachable",
	ReplyHostUnreachable:     "host unreachable",
	ReplyConnectionRefused:   "connection refused",
	ReplyTTLExpired:          "TTL expired",
	ReplyCommandNotSupported: "command not supported",
	ReplyAddressNotSupported: "address type not supported",
}

// ReplyText returns the RFC 1928 meaning of a reply code with the code in
// hex, e.g. "0x05 connection refused".
func ReplyText(code byte) string {
	if int(code) < len(replyTexts) {
		return fmt.Sprintf("0x%02x %s", code, replyTexts[code])
	}
	return fmt.Sprintf("0x%02x unassigned", code)
}

// malformed wraps ErrMalformed with a detail and, when cause is not nil, the
// cause (so errors.Is works for both).
func malformed(detail string, cause error) error {
	if cause != nil {
		return fmt.Errorf("%w: %s: %w", ErrMalformed, detail, cause)
	}
	return fmt.Errorf("%w: %s", ErrMalformed, detail)
}

// validHost reports whether h can be carried as a SOCKS5 address of a
// destination: an IP literal without zone, or a domain name of 1–255 bytes
// made of letters, digits, '-', '_' and '.'. Anything else (spaces, control
// bytes, ':' '/' '@' '%' and the like) could change meaning once the name is
// put in a host:port string or a URL, so it is refused rather than passed on.
func validHost[T ~string | ~[]byte](h T) bool {
	if len(h) == 0 {
		return false
	}
	for i := 0; i < len(h); i++ {
		c := h[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9',
			c == '-', c == '_', c == '.':
		default:
			// Not a plain name (nor IPv4); only an IPv6 literal remains.
			ip, ok := parseIP(h)
			return ok && ip.Zone() == ""
		}
	}
	// A domain name, or an IPv4 literal: both are carried as they are.
	return len(h) <= MaxDomainBytes
}

func errBadHost(h string) error {
	return fmt.Errorf("%w: host %q", ErrBadAddress, h)
}

// readFull reads exactly len(b) bytes. A peer that closes early gives
// ErrMalformed wrapping io.EOF or io.ErrUnexpectedEOF.
func readFull(r io.Reader, b []byte, what string) error {
	if _, err := io.ReadFull(r, b); err != nil {
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return malformed("truncated "+what, err)
		}
		return fmt.Errorf("reading %s: %w", what, err)
	}
	return nil
}

// appendAddr appends ATYP, address and port for a; the caller has checked
// validHost (or a is the zero Addr, which becomes 0.0.0.0:0).
func appendAddr(b []byte, a Addr) []byte {
	if a.Host == "" {
		return append(b, AtypIPv4, 0, 0, 0, 0, byte(a.Port>>8), byte(a.Port))
	}
	if ip, ok := parseIP(a.Host); ok {
		if ip.Is4() {
			v := ip.As4()
			b = append(b, AtypIPv4)
			b = append(b, v[:]...)
		} else {
			v := ip.As16()
			b = append(b, AtypIPv6)
			b = append(b, v[:]...)
		}
	} else {
		b = append(b, AtypDomain, byte(len(a.Host)))
		b = append(b, a.Host...)
	}
	return append(b, byte(a.Port>>8), byte(a.Port))
}
