package agent

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
)

// The sticky endpoints' success bodies are not documented by the provider.
// Sessions are read from common synonyms; whatever is not understood stays
// visible in StickySession.Extra and the Raw bodies.

// Field synonyms of sticky session records, as normalised keys (normKey),
// in order of preference.
var (
	serverKeys  = [...]string{"server", "host", "gateway", "hostname", "gw", "node", "serverhost", "servername"}
	sessionKeys = [...]string{"session", "sessionid", "id", "sid", "sessionname", "sessionkey"}
	exitIPKeys  = [...]string{"exitip", "ip", "currentip", "exit", "externalip", "publicip", "outip", "newip", "exitaddress"}
	ttlKeys     = [...]string{"ttl", "ttlminutes", "lifetime"}
	// Per-protocol ports: a record may name the port of each protocol
	// ("http_port", "socks_port") or a "ports" object keyed by protocol.
	httpPortKeys  = [...]string{"httpport", "porthttp"}
	socksPortKeys = [...]string{"socksport", "socks5port", "portsocks", "portsocks5"}
	portsKeys     = [...]string{"ports"}
)

// protocolNames maps the normalised keys of a "ports" object to protocols.
var protocolNames = map[string]string{"http": "http", "https": "http", "socks": "socks5", "socks5": "socks5"}

// parsePorts reads a "ports" object keyed by protocol; keys that name no
// protocol are ignored, and an object naming none is not a ports object.
func parsePorts(b []byte) (map[string]int, error) {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(b, &obj); err != nil {
		return nil, err
	}
	ports := map[string]int{}
	for _, k := range sortedKeys(obj) {
		proto, ok := protocolNames[normKey(k)]
		if !ok {
			continue
		}
		if n, err := parseInt(obj[k]); err == nil && n > 0 && n <= 65535 {
			if _, dup := ports[proto]; !dup {
				ports[proto] = n
			}
		}
	}
	if len(ports) == 0 {
		return nil, errors.New("no protocol port in object")
	}
	return ports, nil
}

// ParseStickyList decodes a sticky session list: an array of records, an
// object wrapping one (under "sessions", "data", "list", ...), an object of
// records keyed by session id, or a single record. An empty body, null, []
// and {} are an empty list. The error is non-nil only when the body is not
// JSON at all or has no list shape; the list (with Raw) is returned with it.
func ParseStickyList(body []byte) (*StickyList, error) {
	l := &StickyList{Raw: body}
	t := bytes.TrimSpace(body)
	if len(t) == 0 {
		return l, nil
	}
	elems, err := decodeArray(t)
	if errors.Is(err, ErrListRefused) {
		return l, fmt.Errorf("parsing sticky sessions: %w", err)
	}
	if err != nil {
		var obj map[string]json.RawMessage
		if json.Unmarshal(t, &obj) != nil {
			return l, fmt.Errorf("parsing sticky sessions: %w", err)
		}
		if s, ok := sessionFromObject(obj); ok && (s.Server != "" || s.Session != "") {
			l.Sessions = append(l.Sessions, s)
			return l, nil
		}
		l.keyed(obj, true)
		if len(l.Sessions) == 0 && l.Skipped > 0 {
			return l, fmt.Errorf("parsing sticky sessions: none of the %d values is a session record", l.Skipped)
		}
		return l, nil
	}
	for _, raw := range elems {
		raw = bytes.TrimSpace(raw)
		switch {
		case len(raw) > 0 && raw[0] == '{':
			var obj map[string]json.RawMessage
			if json.Unmarshal(raw, &obj) != nil {
				l.Skipped++
				continue
			}
			s, _ := sessionFromObject(obj)
			l.Sessions = append(l.Sessions, s)
		case len(raw) > 0 && raw[0] == '"':
			var id string
			if json.Unmarshal(raw, &id) != nil || id == "" {
				l.Skipped++
				continue
			}
			l.Sessions = append(l.Sessions, StickySession{Session: id})
		default:
			l.Skipped++
		}
	}
	if len(l.Sessions) == 0 && l.Skipped > 0 {
		return l, fmt.Errorf("parsing sticky sessions: none of the %d elements is a session record", l.Skipped)
	}
	return l, nil
}

// keyed appends the session records of obj, keyed by session id. A value
// that is no object (a count, a status beside the records), or an object
// with no session field, is skipped.
// With wrapped, a key such as "sessions" (wrapKeys) whose object holds no
// record field is a wrapper of such records, read the same way.
func (l *StickyList) keyed(obj map[string]json.RawMessage, wrapped bool) {
	for _, k := range sortedKeys(obj) {
		var rec map[string]json.RawMessage
		if json.Unmarshal(obj[k], &rec) != nil || rec == nil {
			l.Skipped++
			continue
		}
		s, ok := sessionFromObject(rec)
		switch {
		case !ok && wrapped && slices.ContainsFunc(wrapKeys[:], func(w string) bool { return strings.EqualFold(w, k) }):
			l.keyed(rec, false)
			continue
		case !ok:
			l.Skipped++ // no session field at all ({"meta": {"page": 1}})
			continue
		}
		if s.Session == "" {
			s.Session = k
		}
		l.Sessions = append(l.Sessions, s)
	}
}

// sessionFromObject reads a session record; ok reports whether any known
// field was found. For each field the most preferred synonym whose value
// can be read wins; every other key goes to Extra.
func sessionFromObject(obj map[string]json.RawMessage) (StickySession, bool) {
	var s StickySession
	r := newObjectReader(obj)
	field(r, &s.Server, serverKeys[:], parseText)
	field(r, &s.Session, sessionKeys[:], parseText)
	field(r, &s.ExitIP, exitIPKeys[:], parseText)
	field(r, &s.Port, []string{"port"}, parseInt)
	field(r, &s.TTL, ttlKeys[:], parseInt)
	var ports map[string]int
	field(r, &ports, portsKeys[:], parsePorts)
	var httpPort, socksPort int
	field(r, &httpPort, httpPortKeys[:], parseInt)
	field(r, &socksPort, socksPortKeys[:], parseInt)
	for proto, n := range map[string]int{"http": httpPort, "socks5": socksPort} {
		if n > 0 && n <= 65535 {
			if ports == nil {
				ports = map[string]int{}
			}
			ports[proto] = n
		}
	}
	s.Ports = ports
	for _, k := range r.keys {
		if !r.used[k] {
			if s.Extra == nil {
				s.Extra = map[string]json.RawMessage{}
			}
			s.Extra[k] = obj[k]
		}
	}
	if s.Port == 0 && s.Server != "" {
		if h, pt, ok := parseHostPort(s.Server); ok {
			s.Server, s.Port = h, pt
		}
	}
	return s, len(r.used) > 0
}

// objectReader reads the fields of a decoded JSON object by synonyms.
type objectReader struct {
	obj  map[string]json.RawMessage
	keys []string // sortedKeys(obj): duplicates resolve the same way every time
	norm []string // normKey of each key
	used map[string]bool
}

func newObjectReader(obj map[string]json.RawMessage) *objectReader {
	r := &objectReader{obj: obj, keys: sortedKeys(obj), used: map[string]bool{}}
	r.norm = make([]string, len(r.keys))
	for i, k := range r.keys {
		r.norm[i] = normKey(k)
	}
	return r
}

// field sets dst from the most preferred synonym whose value parse can
// read, and marks that key used.
func field[T any](r *objectReader, dst *T, syns []string, parse func([]byte) (T, error)) {
	for _, syn := range syns {
		for i, k := range r.keys {
			if r.norm[i] != syn {
				continue
			}
			if v, err := parse(r.obj[k]); err == nil {
				*dst, r.used[k] = v, true
				return
			}
		}
	}
}

// findExitIP looks for an IP address under a known exit-IP key in a JSON
// body, preferring shallow matches, or takes a body that is itself an IP.
func findExitIP(body []byte) string {
	t := bytes.TrimSpace(body)
	if a, err := netip.ParseAddr(strings.Trim(string(t), `"`)); err == nil {
		return a.String()
	}
	var v any
	if json.Unmarshal(t, &v) != nil {
		return ""
	}
	level := []any{v}
	for depth := 0; depth < 5 && len(level) > 0; depth++ {
		var next []any
		for _, node := range level {
			switch n := node.(type) {
			case map[string]any:
				best, bestRank := "", len(exitIPKeys)
				for _, k := range sortedKeys(n) {
					nk := normKey(k)
					for r, ek := range exitIPKeys {
						if nk != ek || r >= bestRank {
							continue
						}
						if s, ok := n[k].(string); ok {
							if a, err := netip.ParseAddr(strings.TrimSpace(s)); err == nil {
								best, bestRank = a.String(), r
							}
						}
					}
					next = append(next, n[k])
				}
				if best != "" {
					return best
				}
			case []any:
				next = append(next, n...)
			}
		}
		level = next
	}
	return ""
}
