package agent

import (
	"context"
	"maps"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"
)

// UpstreamSpec is one dialable upstream derived from a ServiceState; the
// daemon turns it into a pool upstream unchanged.
type UpstreamSpec struct {
	Service  int
	Kind     string // fpr | ppr
	Protocol string // http | socks5
	Address  string // host:port
	Username string
	Password string
	Server   string
	Session  string
	ExitIP   string
	// Match says how a session upstream's port was found for its protocol:
	// MatchRecord, MatchList or MatchSingle; "" for upstreams that stand for
	// no session.
	Match string
	// StatusIP is the IP address by which the provider's network-status
	// lists (ServiceState.Errored, Inactive) name this upstream's proxy
	// when Address names it by host name: an address the name resolved to
	// in the last lists round (ServiceState.Resolved), the one the
	// service's IP lists name if any, else the lowest. Compare the status
	// lists with StatusIP when it is set, else with Address's host. Empty
	// when Address's host is an IP address already, or the name never
	// resolved.
	StatusIP string
}

// How a sticky session's port for a protocol was found.
const (
	MatchRecord = "record" // the record names this protocol's port (http_port, socks_port, ports)
	MatchList   = "list"   // the record's one port is in this protocol's list
	MatchSingle = "single" // the list's only entry for the record's server
)

// listTypeOf names the IP list type that gives a kind's upstreams of a
// protocol: the one table of which list feeds what.
var listTypeOf = map[[2]string]string{
	{"fpr", "http"}: "http-auth", {"fpr", "socks5"}: "socks-ip",
	{"ppr", "http"}: "ppr-http", {"ppr", "socks5"}: "ppr-socks",
}

// listType is the IP list type of kind's upstreams of protocol; a kind
// other than ppr takes fpr's lists.
func listType(kind, protocol string) string {
	if kind != "ppr" {
		kind = "fpr"
	}
	return listTypeOf[[2]string{kind, protocol}]
}

// listProtocol maps each IP list type to the protocol its entries speak.
var listProtocol = func() map[string]string {
	m := make(map[string]string, len(listTypeOf))
	for kp, typ := range listTypeOf {
		m[typ] = kp[1]
	}
	return m
}()

// Upstreams derives the dialable upstreams of one service. Which list
// feeds which protocol: fpr http from http-auth (credentials from each line,
// else the service record's), fpr socks5 from socks-ip (the record's
// credentials), ppr http from ppr-http and ppr socks5 from ppr-socks (the
// line's credentials, else the record's).
//
// A ppr service's sticky sessions become upstreams per protocol by
// matchSession. For each protocol, the sessions that got an upstream serve
// it; when none did, the protocol's list entries serve as plain rotating
// upstreams (the sessions are still rotated when their exit IP is errored).
// A port is never dialed with a protocol whose list does not vouch for it,
// unless the record itself names it for that protocol. An upstream dialed
// by host name carries the IP the network-status lists name it by
// (StatusIP).
func (s *ServiceState) Upstreams() []UpstreamSpec {
	kind := s.Record.ProductType
	var out []UpstreamSpec
	for _, typ := range slices.Sorted(maps.Keys(s.Lists)) {
		proto, ok := listProtocol[typ]
		if !ok {
			continue
		}
		entries := s.Lists[typ]
		creds := func(e Entry) (string, string) {
			if typ == "socks-ip" || e.Login == "" {
				return s.Record.Username, s.Record.Password
			}
			return e.Login, e.Password
		}
		var sessions []UpstreamSpec
		if kind == "ppr" {
			for _, ss := range s.Sticky {
				addr, e, match := matchSession(ss, proto, entries, s.Resolved[ss.Server])
				if match == "" {
					continue
				}
				u, pw := creds(e)
				sessions = append(sessions, UpstreamSpec{Service: s.ID, Kind: kind, Protocol: proto,
					Address: addr, Username: u, Password: pw,
					Server: ss.Server, Session: ss.Session, ExitIP: ss.ExitIP, Match: match,
					StatusIP: s.statusIP(addr)})
			}
		}
		if len(sessions) > 0 {
			out = append(out, sessions...)
			continue
		}
		for _, e := range entries {
			u, pw := creds(e)
			addr := net.JoinHostPort(e.Host, strconv.Itoa(e.Port))
			out = append(out, UpstreamSpec{Service: s.ID, Kind: kind, Protocol: proto,
				Address: addr, Username: u, Password: pw, StatusIP: s.statusIP(addr)})
		}
	}
	return out
}

// statusIP is UpstreamSpec.StatusIP for an upstream dialed at addr.
func (s *ServiceState) statusIP(addr string) string {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return ""
	}
	if _, err := netip.ParseAddr(host); err == nil {
		return ""
	}
	var resolved []netip.Addr
	for name, addrs := range s.Resolved {
		if strings.EqualFold(name, host) {
			for _, a := range addrs {
				if ip, err := netip.ParseAddr(a); err == nil {
					resolved = append(resolved, ip.Unmap())
				}
			}
		}
	}
	if len(resolved) == 0 {
		return ""
	}
	slices.SortFunc(resolved, netip.Addr.Compare)
	for _, ip := range resolved {
		for _, entries := range s.Lists {
			for _, e := range entries {
				if containsAddr([]string{ip.String()}, e.Host) {
					return ip.String()
				}
			}
		}
	}
	return resolved[0].String()
}

// UnservedSessions returns the sticky sessions that got no upstream for any
// protocol of the service's lists: they serve no connection, so no failure
// ever asks for their rotation, while an errored exit IP of theirs still
// does (the pool takes them as unserved sessions).
func (s *ServiceState) UnservedSessions() []StickySession {
	if s.Record.ProductType != "ppr" {
		return nil
	}
	var out []StickySession
	for _, ss := range s.Sticky {
		served := false
		for typ, entries := range s.Lists {
			if proto, ok := listProtocol[typ]; ok {
				if _, _, m := matchSession(ss, proto, entries, s.Resolved[ss.Server]); m != "" {
					served = true
					break
				}
			}
		}
		if !served {
			out = append(out, ss)
		}
	}
	return out
}

// matchSession finds the address of session ss for protocol proto, given
// that protocol's list entries and the addresses ss.Server resolved to:
//
//  1. a port the record names for proto (MatchRecord), dialed at the server;
//  2. else the record's one port, when the list holds server:port: the host
//     compared as written (case-insensitively), and when no entry matches so,
//     by the addresses the server resolved to (MatchList), dialed at the
//     list entry;
//  3. else, for a port not in the list or a record without one, the list's
//     entry for the server when it holds exactly one (MatchSingle);
//  4. else none: match is "".
//
// e is the list entry whose credentials apply: the matched one, or for a
// record port the list's entry at that address if any, else the list's
// first entry with credentials (the gateway's login), else a zero Entry
// (the service record's credentials).
func matchSession(ss StickySession, proto string, entries []Entry, resolved []string) (addr string, e Entry, match string) {
	if ss.Server == "" {
		return "", Entry{}, ""
	}
	byName := func(c Entry) bool { return strings.EqualFold(unbracket(c.Host), ss.Server) }
	byAddr := func(c Entry) bool { return containsAddr(resolved, c.Host) }
	// find returns the entries for the server (by name, else by address),
	// restricted to port when port > 0.
	find := func(port int) []Entry {
		for _, same := range []func(Entry) bool{byName, byAddr} {
			var got []Entry
			for _, c := range entries {
				if same(c) && (port == 0 || c.Port == port) {
					got = append(got, c)
				}
			}
			if len(got) > 0 {
				return got
			}
		}
		return nil
	}
	if port := ss.Ports[proto]; port > 0 {
		if got := find(port); len(got) > 0 {
			e = got[0]
		} else {
			for _, c := range entries {
				if c.Login != "" {
					e = c
					break
				}
			}
		}
		return net.JoinHostPort(ss.Server, strconv.Itoa(port)), e, MatchRecord
	}
	if ss.Port > 0 {
		if got := find(ss.Port); len(got) > 0 {
			e = got[0]
			return net.JoinHostPort(e.Host, strconv.Itoa(e.Port)), e, MatchList
		}
	}
	if got := find(0); len(got) == 1 {
		e = got[0]
		return net.JoinHostPort(e.Host, strconv.Itoa(e.Port)), e, MatchSingle
	}
	return "", Entry{}, ""
}

// containsAddr reports whether host is an IP address among addrs,
// comparing addresses rather than spellings.
func containsAddr(addrs []string, host string) bool {
	a, err := netip.ParseAddr(unbracket(host))
	if err != nil {
		return false
	}
	a = a.Unmap()
	for _, s := range addrs {
		if b, err := netip.ParseAddr(s); err == nil && b.Unmap() == a {
			return true
		}
	}
	return false
}

// resolveTimeout bounds the lookups of all host names of one service.
const resolveTimeout = 5 * time.Second

// hostNames returns the sessions' servers and the list entries' hosts that
// are not IP addresses, in order, repeats included.
func hostNames(sessions []StickySession, lists map[string][]Entry) []string {
	var out []string
	isName := func(h string) bool {
		_, err := netip.ParseAddr(unbracket(h))
		return h != "" && err != nil
	}
	for _, ss := range sessions {
		if isName(ss.Server) {
			out = append(out, ss.Server)
		}
	}
	for _, typ := range slices.Sorted(maps.Keys(lists)) {
		for _, e := range lists[typ] {
			if isName(e.Host) {
				out = append(out, e.Host)
			}
		}
	}
	return out
}

// resolveHosts looks up the addresses of hosts, host names as hostNames
// returns them (the provider's gateways: sticky servers, list entries), each once per lists
// round: a session's port is then found in lists that name the gateway by
// IP, and an upstream dialed by name gets the IP the network-status lists
// name it by. A failed lookup keeps the name's addresses in last, the
// previous round's answers (a resolver's passing failure must not unmatch
// the sessions and status IPs of a gateway until the next round); a name
// that never resolved has none (its sessions match by name or as the
// list's single entry). Each lookup beats loop owner.
func (p *Poller) resolveHosts(ctx context.Context, owner Loop, cfg PollConfig, hosts []string, last map[string][]string) map[string][]string {
	lookup := cfg.LookupHost
	if lookup == nil {
		lookup = net.DefaultResolver.LookupHost
	}
	ctx, cancel := context.WithTimeout(ctx, resolveTimeout)
	defer cancel()
	var out map[string][]string
	for _, h := range hosts {
		if _, done := out[h]; done {
			continue
		}
		if out == nil {
			out = map[string][]string{}
		}
		addrs, err := lookup(ctx, h)
		p.beat(owner)
		if err != nil {
			p.log.Debug("resolving a gateway's host name failed; keeping its last addresses", "host", h, "err", err, "last", last[h])
			out[h] = last[h]
			continue
		}
		out[h] = addrs
	}
	return out
}
