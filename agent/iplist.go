package agent

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// MaxBadLines is how many unreadable lines an IPList keeps in BadLines.
const MaxBadLines = 5

// maxBadLineLen bounds each kept bad line.
const maxBadLineLen = 200

// ParseIPList parses the body of an IP list (endpoint 16). format is the
// requested one (txt, csv, json) or "" to detect; it is a hint only, since
// the layouts are undocumented and providers differ, so every layout is
// recognised in every format:
//
//   - lines with LF or CRLF endings, blank lines and '#' comments skipped,
//     with or without a final newline;
//   - ip:port, ip:port@login:password, login:password@ip:port,
//     ip:port:login:password, login:password:ip:port (a line that reads
//     both ways, as a login with a numeric password does, is read with the
//     IP address, else the dotted name, as its host), optionally behind a
//     scheme such as http://;
//   - csv with or without a header row, as host,port[,login,password] or
//     ip:port[,login,password], or one txt form per row;
//   - a JSON array (or {"data": [...]}) of such strings or of objects with
//     host/ip, port (number or string), login/user/username and
//     password/pass; and the same objects one per line, each ending in a
//     comma, which is not valid JSON as a whole.
//
// IPv6 hosts are written in brackets ([2001:db8::1]:8080) and returned
// without. Unreadable lines or elements are counted in Bad and the first
// MaxBadLines kept, while the good ones are returned. The error is non-nil
// only for an unknown format or when a non-empty body yields no entry at
// all; the list is returned with it.
func ParseIPList(body []byte, format string) (*IPList, error) {
	l := &IPList{Raw: body}
	switch format {
	case "", "txt", "csv", "json":
	default:
		return l, fmt.Errorf("parsing ip list: unknown format %q", excerpt([]byte(format), maxValueExcerpt))
	}
	t := bytes.TrimSpace(trimBOM(body)) // a body from elsewhere than Client may have one too
	if len(t) == 0 || string(t) == "null" {
		return l, nil
	}
	p := listParser{l: l, csvFirst: format == "csv"}
	switch {
	case (t[0] == '[' || t[0] == '{') && json.Valid(t):
		p.jsonValue(t, 0)
	case t[0] == '{' || (t[0] == '"' && firstLineIsJSONString(t)) || (t[0] == '[' && opensJSONArray(t)):
		p.jsonStream(t)
	default:
		p.lines(t)
	}
	if obj, ok := jsonObject(t); ok && len(l.Entries) == 0 && emptyBesideError(obj) {
		return l, fmt.Errorf("parsing ip list: %w", ErrListRefused)
	}
	if len(l.Entries) == 0 && l.Bad > 0 {
		// The line's shape, not its text: it may hold a proxy password,
		// and this error is logged.
		return l, fmt.Errorf("parsing ip list: no proxy in %d unreadable lines, the first shaped %q (digits as 9, letters as a)",
			l.Bad, lineShape(l.BadLines[0]))
	}
	return l, nil
}

// lineShape is line with each run of digits written 9 and each run of
// other letters a: the layout of an unreadable list line, its separators
// and fields, without the addresses, names or passwords it holds.
func lineShape(line string) string {
	var b strings.Builder
	var last byte
	for _, r := range line {
		c := byte('a')
		switch {
		case r >= '0' && r <= '9':
			c = '9'
		case unicode.IsLetter(r):
		case r < utf8.RuneSelf:
			c = byte(r)
		}
		if (c == 'a' || c == '9') && c == last {
			continue
		}
		b.WriteByte(c)
		last = c
	}
	return b.String()
}

type listParser struct {
	l        *IPList
	csvFirst bool
	header   map[string]int // csv header: field name -> column
}

func (p *listParser) bad(line []byte) {
	p.l.Bad++
	if len(p.l.BadLines) < MaxBadLines {
		p.l.BadLines = append(p.l.BadLines, excerpt(line, maxBadLineLen))
	}
}

func (p *listParser) add(e Entry, ok bool, line []byte) {
	if !ok {
		p.bad(line)
		return
	}
	p.l.Entries = append(p.l.Entries, e)
}

// lines parses a line-oriented (txt or csv) list.
func (p *listParser) lines(t []byte) {
	first := true
	for _, raw := range bytes.Split(t, []byte("\n")) {
		line := strings.TrimSpace(string(raw))
		if line == "" || line[0] == '#' {
			continue
		}
		if first {
			first = false
			if h := csvHeader(line); h != nil {
				p.header = h
				continue
			}
		}
		e, ok := p.line(line)
		p.add(e, ok, []byte(line))
	}
}

// line reads one txt or csv line.
func (p *listParser) line(line string) (Entry, bool) {
	if p.header != nil {
		return recordWithHeader(splitCSV(line), p.header)
	}
	if p.csvFirst {
		if e, ok := record(splitCSV(line)); ok {
			return e, true
		}
		return parseProxyLine(line)
	}
	if e, ok := parseProxyLine(line); ok {
		return e, true
	}
	if strings.ContainsAny(line, ",;\t") {
		return record(splitCSV(line))
	}
	return Entry{}, false
}

// opensJSONArray tells a JSON array's '[' from an IPv6 txt line's: the
// array's next non-space byte opens an element or closes the array.
func opensJSONArray(t []byte) bool {
	rest := bytes.TrimLeft(t[1:], " \t\r\n")
	return len(rest) == 0 || rest[0] == '{' || rest[0] == '"' || rest[0] == ']' || rest[0] == '['
}

// firstLineIsJSONString tells a list of JSON strings, one per line, from a
// csv file with quoted fields.
func firstLineIsJSONString(t []byte) bool {
	line, _, _ := bytes.Cut(t, []byte("\n"))
	line = bytes.TrimRight(bytes.TrimSpace(line), ",")
	var s string
	return json.Unmarshal(line, &s) == nil
}

// jsonValue parses a valid JSON document or element.
func (p *listParser) jsonValue(raw []byte, depth int) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return
	}
	switch raw[0] {
	case '[':
		var elems []json.RawMessage
		if json.Unmarshal(raw, &elems) != nil {
			p.bad(raw)
			return
		}
		if depth == 0 || !allScalars(elems) {
			for _, e := range elems {
				if depth == 0 {
					p.jsonValue(e, depth+1)
				} else {
					p.bad(e)
				}
			}
			return
		}
		// An element that is an array of fields: ["1.2.3.4", 8080, "u", "p"].
		fields := make([]string, 0, len(elems))
		for _, e := range elems {
			s, err := parseText(e)
			if err != nil {
				p.bad(raw)
				return
			}
			fields = append(fields, s)
		}
		e, ok := record(fields)
		p.add(e, ok, raw)
	case '{':
		var obj map[string]json.RawMessage
		if json.Unmarshal(raw, &obj) != nil {
			p.bad(raw)
			return
		}
		if depth == 0 {
			for _, key := range wrapKeys {
				if inner, ok := lookupFold(obj, key); ok {
					p.jsonValue(inner, 0)
					return
				}
			}
			if !isEntryObject(obj) {
				// An object of entries keyed by index or name.
				for _, k := range sortedKeys(obj) {
					p.jsonValue(obj[k], 1)
				}
				return
			}
		}
		e, ok := entryFromObject(obj)
		p.add(e, ok, raw)
	case '"':
		var s string
		if json.Unmarshal(raw, &s) != nil {
			p.bad(raw)
			return
		}
		e, ok := p.line(strings.TrimSpace(s))
		p.add(e, ok, []byte(s))
	case 'n': // null elements are skipped
		if string(raw) != "null" {
			p.bad(raw)
		}
	default:
		p.bad(raw)
	}
}

// jsonStream parses JSON values separated by commas and newlines, such as
// one object per line each ending in a comma, or an array with a trailing
// comma. An unreadable value costs the rest of its line.
func (p *listParser) jsonStream(t []byte) {
	pos := 0
	for pos < len(t) {
		c := t[pos]
		switch {
		case c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == ',' || c == ']':
			pos++
			continue
		case c == '[' && opensJSONArray(t[pos:]):
			pos++
			continue
		case c == '{' || c == '"':
			dec := json.NewDecoder(bytes.NewReader(t[pos:]))
			var raw json.RawMessage
			if err := dec.Decode(&raw); err == nil {
				p.jsonValue(raw, 1)
				pos += int(dec.InputOffset())
				continue
			}
		}
		end := bytes.IndexByte(t[pos:], '\n')
		if end < 0 {
			end = len(t) - pos
		}
		line := strings.TrimSpace(string(t[pos : pos+end]))
		pos += end + 1
		if line == "" || line[0] == '#' {
			continue
		}
		if c == '{' || c == '"' {
			p.bad([]byte(line))
			continue
		}
		e, ok := p.line(strings.TrimRight(line, ","))
		p.add(e, ok, []byte(line))
	}
}

func allScalars(elems []json.RawMessage) bool {
	for _, e := range elems {
		e = bytes.TrimSpace(e)
		if len(e) == 0 || e[0] == '{' || e[0] == '[' {
			return false
		}
	}
	return true
}

// Field synonyms of list entries, as normalised keys (see normKey).
var (
	hostKeys     = [...]string{"host", "ip", "address", "addr", "hostname", "server", "proxyip", "proxyhost", "proxyaddress"}
	portKeys     = [...]string{"port", "proxyport"}
	loginKeys    = [...]string{"login", "user", "username", "proxyuser", "proxylogin", "proxyusername"}
	passwordKeys = [...]string{"password", "pass", "pwd", "passwd", "proxypassword", "proxypass"}
	lineKeys     = [...]string{"proxy", "line", "url"}
)

// pick returns the value of the first synonym present in the normalised
// object.
func pick(norm map[string]json.RawMessage, keys []string) (json.RawMessage, bool) {
	for _, k := range keys {
		if v, ok := norm[k]; ok {
			return v, true
		}
	}
	return nil, false
}

func normalise(obj map[string]json.RawMessage) map[string]json.RawMessage {
	norm := make(map[string]json.RawMessage, len(obj))
	for k, v := range obj {
		nk := normKey(k)
		if _, dup := norm[nk]; !dup || k == nk {
			norm[nk] = v
		}
	}
	return norm
}

func isEntryObject(obj map[string]json.RawMessage) bool {
	norm := normalise(obj)
	_, host := pick(norm, hostKeys[:])
	_, line := pick(norm, lineKeys[:])
	return host || line
}

// entryFromObject reads an entry from a JSON object.
func entryFromObject(obj map[string]json.RawMessage) (Entry, bool) {
	norm := normalise(obj)
	str := func(keys []string) (string, bool) {
		raw, ok := pick(norm, keys)
		if !ok {
			return "", true
		}
		s, err := parseText(raw)
		return s, err == nil
	}
	host, okH := str(hostKeys[:])
	login, okL := str(loginKeys[:])
	password, okP := str(passwordKeys[:])
	if !okH || !okL || !okP {
		return Entry{}, false
	}
	if host == "" {
		line, ok := str(lineKeys[:])
		if !ok || line == "" {
			return Entry{}, false
		}
		e, ok := parseProxyLine(line)
		if ok && e.Login == "" && login != "" {
			e.Login, e.Password = login, password
		}
		return e, ok
	}
	port := 0
	if raw, ok := pick(norm, portKeys[:]); ok {
		n, err := parseInt(raw)
		if err != nil {
			return Entry{}, false
		}
		port = n
	}
	if port == 0 {
		h, pt, ok := parseHostPort(host)
		if !ok {
			return Entry{}, false
		}
		host, port = h, pt
	} else {
		host = unbracket(host)
	}
	if !validHost(host) || port < 1 || port > 65535 {
		return Entry{}, false
	}
	return Entry{Host: host, Port: port, Login: login, Password: password}, true
}

// csvColumns are the fields a csv header names, with their synonyms.
var csvColumns = [...]struct {
	name string
	keys []string
}{
	{"host", hostKeys[:]}, {"port", portKeys[:]}, {"login", loginKeys[:]}, {"password", passwordKeys[:]}, {"line", lineKeys[:]},
}

// csvHeader returns the column of each known field if line is a csv header
// row: several fields, at least one a known name, none a port number.
func csvHeader(line string) map[string]int {
	fields := splitCSV(line)
	if len(fields) == 1 {
		// A one-column header such as "proxy".
		if _, ok := parseProxyLine(line); ok {
			return nil
		}
	}
	cols := map[string]int{}
	for i, f := range fields {
		if _, err := strconv.Atoi(f); err == nil {
			return nil
		}
		nf := normKey(strings.Trim(f, `"' `))
		for _, c := range csvColumns {
			if _, dup := cols[c.name]; !dup && slices.Contains(c.keys, nf) {
				cols[c.name] = i
			}
		}
	}
	if _, ok := cols["host"]; !ok {
		if _, ok := cols["line"]; !ok {
			return nil
		}
	}
	return cols
}

func recordWithHeader(fields []string, cols map[string]int) (Entry, bool) {
	get := func(name string) string {
		if i, ok := cols[name]; ok && i < len(fields) {
			return fields[i]
		}
		return ""
	}
	if len(fields) == 1 {
		return parseProxyLine(fields[0]) // a txt line, or the one column of a one-column header
	}
	host, port := get("host"), get("port")
	if host == "" {
		return parseProxyLine(get("line"))
	}
	var e Entry
	if port == "" {
		h, pt, ok := parseHostPort(host)
		if !ok {
			return Entry{}, false
		}
		e = Entry{Host: h, Port: pt}
	} else {
		pt, ok := parsePort(port)
		host = unbracket(host)
		if !ok || !validHost(host) {
			return Entry{}, false
		}
		e = Entry{Host: host, Port: pt}
	}
	e.Login, e.Password = get("login"), get("password")
	return e, true
}

// record reads a csv row without header: host,port[,login,password],
// ip:port[,login,password], or a single txt form.
func record(fields []string) (Entry, bool) {
	for len(fields) > 1 && fields[len(fields)-1] == "" {
		fields = fields[:len(fields)-1] // "1.2.3.4,8080,," : no credentials
	}
	switch {
	case len(fields) == 1:
		return parseProxyLine(fields[0])
	case len(fields) == 2 || len(fields) == 4:
		if pt, ok := parsePort(fields[1]); ok {
			host := unbracket(fields[0])
			if !validHost(host) {
				return Entry{}, false
			}
			e := Entry{Host: host, Port: pt}
			if len(fields) == 4 {
				e.Login, e.Password = fields[2], fields[3]
			}
			return e, true
		}
	}
	if len(fields) == 3 {
		if h, pt, ok := parseHostPort(fields[0]); ok {
			return Entry{Host: h, Port: pt, Login: fields[1], Password: fields[2]}, true
		}
	}
	return Entry{}, false
}

// splitCSV splits one csv line on ',' (or ';' or tab when it has no comma),
// honouring double quotes ("" inside quotes is a quote); fields are trimmed.
func splitCSV(line string) []string {
	sep := byte(',')
	switch {
	case strings.IndexByte(line, ',') >= 0:
	case strings.IndexByte(line, ';') >= 0:
		sep = ';'
	case strings.IndexByte(line, '\t') >= 0:
		sep = '\t'
	}
	var fields []string
	var b strings.Builder
	i := 0
	for {
		for i < len(line) && (line[i] == ' ' || (line[i] == '\t' && sep != '\t')) {
			i++
		}
		b.Reset()
		if i < len(line) && line[i] == '"' {
			i++
			for i < len(line) {
				if line[i] == '"' {
					if i+1 < len(line) && line[i+1] == '"' {
						b.WriteByte('"')
						i += 2
						continue
					}
					i++
					break
				}
				b.WriteByte(line[i])
				i++
			}
		}
		for i < len(line) && line[i] != sep {
			b.WriteByte(line[i]) // after a closing quote, or an unquoted field
			i++
		}
		fields = append(fields, strings.TrimSpace(b.String()))
		if i >= len(line) {
			return fields
		}
		i++ // the separator
	}
}

// schemes that may prefix a txt line.
var schemes = [...]string{"http://", "https://", "socks5://", "socks5h://", "socks4://", "socks://"}

// parseProxyLine reads one txt form: ip:port, ip:port@login:password,
// login:password@ip:port, ip:port:login:password, login:password:ip:port,
// with IPv6 hosts in brackets.
//
// A login and a numeric password look like a host name and a port
// ("PPR123:4567@192.0.2.21:3081"), so when a line reads both ways the
// reading whose host looks more like a proxy's host is taken (hostRank);
// on a tie, the host-first form (the provider's documented one).
func parseProxyLine(s string) (Entry, bool) {
	s = strings.TrimSpace(s)
	for _, sc := range schemes {
		if len(s) > len(sc) && strings.EqualFold(s[:len(sc)], sc) {
			s = strings.TrimSuffix(s[len(sc):], "/")
			break
		}
	}
	if s == "" {
		return Entry{}, false
	}
	if i := strings.IndexByte(s, '@'); i >= 0 {
		// ip:port@login:password (the provider's documented form) or
		// login:password@ip:port; the password may hold '@'.
		var hostFirst, credsFirst Entry
		okA, okB := false, false
		if h, pt, ok := parseHostPort(s[:i]); ok {
			if login, pw, ok := splitCreds(s[i+1:]); ok {
				hostFirst, okA = Entry{Host: h, Port: pt, Login: login, Password: pw}, true
			}
		}
		j := strings.LastIndexByte(s, '@')
		if h, pt, ok := parseHostPort(s[j+1:]); ok {
			if login, pw, ok := splitCreds(s[:j]); ok {
				credsFirst, okB = Entry{Host: h, Port: pt, Login: login, Password: pw}, true
			}
		}
		if e, ok := likelier(hostFirst, okA, credsFirst, okB); ok {
			return e, true
		}
		// Else an '@' inside the password of ip:port:login:password.
	}
	if s[0] == '[' {
		end := strings.Index(s, "]:")
		if end < 0 {
			return Entry{}, false
		}
		rest := s[end+2:]
		portStr, creds, hasCreds := strings.Cut(rest, ":")
		h, pt, ok := parseHostPort(s[:end+2] + portStr)
		if !ok {
			return Entry{}, false
		}
		e := Entry{Host: h, Port: pt}
		if hasCreds {
			if e.Login, e.Password, ok = splitCreds(creds); !ok {
				return Entry{}, false
			}
		}
		return e, true
	}
	parts := strings.SplitN(s, ":", 4)
	switch len(parts) {
	case 2:
		h, pt, ok := parseHostPort(s)
		return Entry{Host: h, Port: pt}, ok
	case 4:
		// ip:port:login:password (the password may hold ':') or
		// login:password:ip:port (the password without ':').
		var hostFirst, credsFirst Entry
		okA, okB := false, false
		if pt, ok := parsePort(parts[1]); ok && validHost(parts[0]) && parts[2] != "" {
			hostFirst, okA = Entry{Host: parts[0], Port: pt, Login: parts[2], Password: parts[3]}, true
		}
		if strings.Count(s, ":") == 3 {
			if pt, ok := parsePort(parts[3]); ok && validHost(parts[2]) && parts[0] != "" {
				credsFirst, okB = Entry{Host: parts[2], Port: pt, Login: parts[0], Password: parts[1]}, true
			}
		}
		return likelier(hostFirst, okA, credsFirst, okB)
	}
	return Entry{}, false
}

// likelier picks between the host-first and the credentials-first reading
// of a line: the one that parsed, else the one whose host ranks higher,
// else the host-first one.
func likelier(hostFirst Entry, okA bool, credsFirst Entry, okB bool) (Entry, bool) {
	switch {
	case okA && okB:
		if hostRank(credsFirst.Host) > hostRank(hostFirst.Host) {
			return credsFirst, true
		}
		return hostFirst, true
	case okA:
		return hostFirst, true
	case okB:
		return credsFirst, true
	}
	return Entry{}, false
}

// hostRank says how much a valid host looks like a proxy's host rather
// than a login: an IP address (2), a dotted name (1), a single label such
// as "PPR123" (0), which is what logins look like.
func hostRank(h string) int {
	if _, err := netip.ParseAddr(unbracket(h)); err == nil {
		return 2
	}
	if strings.Contains(h, ".") {
		return 1
	}
	return 0
}

// splitCreds splits login:password; the password may hold ':'.
func splitCreds(s string) (login, password string, ok bool) {
	login, password, ok = strings.Cut(s, ":")
	if !ok || login == "" {
		return "", "", false
	}
	return login, password, true
}

// parseHostPort reads host:port or [ipv6]:port with a numeric port.
func parseHostPort(s string) (string, int, bool) {
	var host, port string
	if strings.HasPrefix(s, "[") {
		end := strings.Index(s, "]:")
		if end < 0 {
			return "", 0, false
		}
		host, port = s[1:end], s[end+2:]
		a, err := netip.ParseAddr(host)
		if err != nil || !a.Is6() {
			return "", 0, false
		}
	} else {
		var ok bool
		host, port, ok = strings.Cut(s, ":")
		if !ok || strings.Contains(port, ":") || !validHost(host) {
			return "", 0, false
		}
	}
	pt, ok := parsePort(port)
	if !ok {
		return "", 0, false
	}
	return host, pt, true
}

func parsePort(s string) (int, bool) {
	if len(s) == 0 || len(s) > 5 {
		return 0, false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return 0, false
		}
	}
	n, _ := strconv.Atoi(s)
	return n, n >= 1 && n <= 65535
}

// unbracket drops the brackets of an IPv6 host written as in a URL
// ("[2001:db8::1]") when it comes with a separate port field.
func unbracket(host string) string {
	return strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
}

// validHost admits an IP address or a DNS name (letters, digits, '-', '_'
// and '.').
func validHost(h string) bool {
	if h == "" || len(h) > 253 {
		return false
	}
	if _, err := netip.ParseAddr(h); err == nil {
		return true
	}
	for i := 0; i < len(h); i++ {
		c := h[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '-', c == '_', c == '.':
		default:
			return false
		}
	}
	return h[0] != '.' && h[0] != '-'
}
