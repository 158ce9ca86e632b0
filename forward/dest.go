package forward

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
)

var (
	errRefusedDestination = errors.New("refused destination")
	errBadDestination     = errors.New("malformed destination")
)

// destPolicy decides which destinations may be relayed. It looks at the
// literal host only: host names are never resolved here, they go to the
// upstream as they are.
type destPolicy struct {
	allow []netip.Prefix

	mu  sync.RWMutex
	own []netip.AddrPort // addresses this listener serves on
}

func (p *destPolicy) setOwn(own []netip.AddrPort) {
	p.mu.Lock()
	p.own = own
	p.mu.Unlock()
}

// check validates host and port (host without brackets) and returns the
// refusal reason, or nil.
func (p *destPolicy) check(host string, port uint16) error {
	if host == "" || port == 0 || len(host) > 255 {
		return errBadDestination
	}
	addr, err := netip.ParseAddr(host)
	if err != nil {
		return p.checkName(host)
	}
	if addr.Zone() != "" {
		return errBadDestination
	}
	addr = addr.Unmap()
	ap := netip.AddrPortFrom(addr, port)
	p.mu.RLock()
	for _, o := range p.own {
		if o == ap {
			p.mu.RUnlock()
			return errRefusedDestination // a loop, whatever is allowed
		}
	}
	p.mu.RUnlock()
	for _, pr := range p.allow {
		if pr.Contains(addr) {
			return nil
		}
	}
	if addr.IsLoopback() || addr.IsLinkLocalUnicast() || addr.IsLinkLocalMulticast() ||
		addr.IsPrivate() || addr.IsUnspecified() || addr.IsInterfaceLocalMulticast() ||
		isSpecialV6(addr) {
		return errRefusedDestination
	}
	return nil
}

// isSpecialV6 catches IPv6 forms that embed an IPv4 address an upstream could
// reach (NAT64, 6to4, IPv4-compatible) when the embedded address is refused.
func isSpecialV6(a netip.Addr) bool {
	if !a.Is6() {
		return false
	}
	b := a.As16()
	var v4 netip.Addr
	switch {
	case b[0] == 0 && b[1] == 0 && allZero(b[2:12]): // ::a.b.c.d (deprecated IPv4-compatible)
		v4 = netip.AddrFrom4([4]byte(b[12:16]))
	case b[0] == 0x00 && b[1] == 0x64 && b[2] == 0xff && b[3] == 0x9b: // 64:ff9b::/96 NAT64
		v4 = netip.AddrFrom4([4]byte(b[12:16]))
	case b[0] == 0x20 && b[1] == 0x02: // 2002::/16 6to4
		v4 = netip.AddrFrom4([4]byte(b[2:6]))
	default:
		return false
	}
	return v4.IsLoopback() || v4.IsPrivate() || v4.IsLinkLocalUnicast() || v4.IsUnspecified()
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// checkName refuses names that are not plain DNS names: numeric forms an
// upstream's resolver would read as an IPv4 address ("2130706433",
// "0x7f.1", "127.1"), "localhost", and bytes that have no place in a host.
func (p *destPolicy) checkName(host string) error {
	h := strings.TrimSuffix(strings.ToLower(host), ".")
	if h == "" {
		return errBadDestination
	}
	for i := 0; i < len(h); i++ {
		c := h[i]
		if !('a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-' || c == '.' || c == '_') {
			return errBadDestination
		}
	}
	if h == "localhost" || strings.HasSuffix(h, ".localhost") {
		return errRefusedDestination
	}
	last := h[strings.LastIndexByte(h, '.')+1:]
	if last == "" || '0' <= last[0] && last[0] <= '9' {
		// A numeric last label is never a DNS name; inet_aton would take it.
		return errRefusedDestination
	}
	return nil
}

// splitHostPort parses "host:port" as an HTTP CONNECT target or Host.
func splitHostPort(hostport string, defPort uint16) (string, uint16, error) {
	host, portStr, err := net.SplitHostPort(hostport)
	if err != nil {
		if defPort == 0 {
			return "", 0, errBadDestination
		}
		// No port: the whole thing is the host, maybe a bracketed IPv6 literal.
		host = strings.TrimSuffix(strings.TrimPrefix(hostport, "["), "]")
		return host, defPort, nil
	}
	port, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil || port == 0 {
		return "", 0, errBadDestination
	}
	return host, uint16(port), nil
}

// interfaceAddrs is net.InterfaceAddrs; a test makes it fail.
var interfaceAddrs = net.InterfaceAddrs

// ownAddrs lists the addresses a listener on addr serves on: the address
// itself, or every interface address when it is unspecified. Listing the
// interfaces takes a netlink socket on Linux; where that is forbidden (a
// systemd unit whose RestrictAddressFamilies lacks AF_NETLINK) the error
// says so, and a request to one of the host's public addresses is not
// recognised as one to proxyd itself (loopback and private ones are refused
// as such anyway, unless allowed).
func ownAddrs(addr net.Addr) ([]netip.AddrPort, error) {
	ta, ok := addr.(*net.TCPAddr)
	if !ok {
		return nil, nil
	}
	ap := ta.AddrPort()
	ip := ap.Addr().Unmap()
	if !ip.IsUnspecified() {
		return []netip.AddrPort{netip.AddrPortFrom(ip, ap.Port())}, nil
	}
	ifAddrs, err := interfaceAddrs()
	if err != nil {
		return nil, fmt.Errorf("listing this host's addresses: %w", err)
	}
	out := make([]netip.AddrPort, 0, len(ifAddrs))
	for _, a := range ifAddrs {
		if pn, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(pn.IP); ok {
				out = append(out, netip.AddrPortFrom(ip.Unmap(), ap.Port()))
			}
		}
	}
	return out, nil
}

// prefixes returns the networks' prefixes.
func prefixes(nets []Network) []netip.Prefix {
	out := make([]netip.Prefix, len(nets))
	for i, n := range nets {
		out[i] = n.Prefix
	}
	return out
}
