package providersim

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"net"
	"strconv"
)

// Layout selects how IP lists (endpoint 16) and sticky session lists
// (endpoint 17) are written; the specification leaves both open. Empty
// fields take the defaults.
type Layout struct {
	// TXT is the line format of txt lists (and of the "strings" JSON
	// layout): "colon" ip:port[@login:password] (default), "loginfirst"
	// [login:password@]ip:port, "fourpart" ip:port[:login:password].
	TXT string
	// CRLF ends txt, csv and "lines" JSON lines with CRLF instead of LF.
	CRLF bool
	// NoFinalNewline leaves the line terminator off the last line of txt,
	// plain csv and "lines" JSON lists.
	NoFinalNewline bool
	// CSV is "header" (default): a host,port,login,password header row then
	// one row per entry (login and password empty when the type carries
	// none), or "plain": no header, ip:port[:login:password] per line.
	CSV string
	// JSON is "objects" (default): an array of {"host","port" (string),
	// "login","password"}; "objects-alt": an array of {"ip","port"
	// (number),"user","pass"}; "strings": an array of strings in the TXT
	// line format; "lines": one object as in "objects" per line, each
	// followed by a comma (not valid JSON as a whole). Credentials are
	// left out of objects of http-ip and socks-ip lists.
	JSON string
	// StickyShape is "array" (default): [{"server","session","port","ip",
	// "ttl"}], or "wrapped": {"sessions":[{"host","session_id","port"
	// (string),"exit_ip","ttl"}]}.
	StickyShape string
	// StickyPorts is what a sticky record says about ports (the provider
	// does not publish its record): "port" (default) the session's one
	// Port; "split" "http_port" and "socks_port" in place of "port";
	// "object" a "ports" object keyed by protocol ({"http":..,"socks5":..});
	// "none" no port at all. Per-protocol ports that are zero are left out.
	// Ports are numbers in the "array" shape and strings in "wrapped".
	StickyPorts string
	// PPRHosts is how ppr-http and ppr-socks lists name the gateway: "ip"
	// (default) as the entries are stored, "name" by the gateway host name
	// (SetGateway) whose addresses hold the entry's host.
	PPRHosts string
}

// Layout names.
const (
	TXTColon      = "colon"
	TXTLoginFirst = "loginfirst"
	TXTFourPart   = "fourpart"

	CSVHeader = "header"
	CSVPlain  = "plain"

	JSONObjects    = "objects"
	JSONObjectsAlt = "objects-alt"
	JSONStrings    = "strings"
	JSONLines      = "lines"

	StickyArray   = "array"
	StickyWrapped = "wrapped"

	StickyPortOne    = "port"
	StickyPortSplit  = "split"
	StickyPortObject = "object"
	StickyPortNone   = "none"

	PPRHostIP   = "ip"
	PPRHostName = "name"
)

// LayoutDefault is the layout of the zero Layout, spelled out. The
// simulator never reads it.
var LayoutDefault = Layout{TXT: TXTColon, CSV: CSVHeader, JSON: JSONObjects, StickyShape: StickyArray,
	StickyPorts: StickyPortOne, PPRHosts: PPRHostIP}

// Validate reports unknown layout names.
func (l Layout) Validate() error {
	check := func(what, v string, allowed ...string) error {
		if v == "" {
			return nil
		}
		for _, a := range allowed {
			if v == a {
				return nil
			}
		}
		return fmt.Errorf("unknown %s layout %q (want one of %q)", what, v, allowed)
	}
	if err := check("txt", l.TXT, TXTColon, TXTLoginFirst, TXTFourPart); err != nil {
		return err
	}
	if err := check("csv", l.CSV, CSVHeader, CSVPlain); err != nil {
		return err
	}
	if err := check("json", l.JSON, JSONObjects, JSONObjectsAlt, JSONStrings, JSONLines); err != nil {
		return err
	}
	if err := check("sticky", l.StickyShape, StickyArray, StickyWrapped); err != nil {
		return err
	}
	if err := check("sticky ports", l.StickyPorts, StickyPortOne, StickyPortSplit, StickyPortObject, StickyPortNone); err != nil {
		return err
	}
	return check("ppr hosts", l.PPRHosts, PPRHostIP, PPRHostName)
}

// withDefaults replaces empty and unknown names by the defaults.
func (l Layout) withDefaults() Layout {
	if l.TXT != TXTLoginFirst && l.TXT != TXTFourPart {
		l.TXT = TXTColon
	}
	if l.CSV != CSVPlain {
		l.CSV = CSVHeader
	}
	switch l.JSON {
	case JSONObjectsAlt, JSONStrings, JSONLines:
	default:
		l.JSON = JSONObjects
	}
	if l.StickyShape != StickyWrapped {
		l.StickyShape = StickyArray
	}
	switch l.StickyPorts {
	case StickyPortSplit, StickyPortObject, StickyPortNone:
	default:
		l.StickyPorts = StickyPortOne
	}
	if l.PPRHosts != PPRHostName {
		l.PPRHosts = PPRHostIP
	}
	return l
}

// listType reports whether lines of an IP list type carry credentials and
// which product type serves it; ok is false for an unknown type.
func listType(typel string) (creds bool, productType string, ok bool) {
	switch typel {
	case "http-ip", "socks-ip":
		return false, "fpr", true
	case "http-auth":
		return true, "fpr", true
	case "ppr-http", "ppr-socks":
		return true, "ppr", true
	}
	return false, "", false
}

// renderList writes entries in format ("txt", "csv", "json") and returns
// the body and its content type.
func renderList(l Layout, format string, creds bool, entries []Entry) ([]byte, string) {
	eol := "\n"
	if l.CRLF {
		eol = "\r\n"
	}
	lines := func(ls []string) []byte {
		var b bytes.Buffer
		for i, s := range ls {
			b.WriteString(s)
			if i < len(ls)-1 || !l.NoFinalNewline {
				b.WriteString(eol)
			}
		}
		return b.Bytes()
	}
	withCreds := func(e Entry) bool { return creds && (e.Login != "" || e.Password != "") }

	switch format {
	case "txt":
		var ls []string
		for _, e := range entries {
			ls = append(ls, txtLine(l.TXT, e, withCreds(e)))
		}
		return lines(ls), "text/plain; charset=utf-8"

	case "csv":
		if l.CSV == CSVPlain {
			var ls []string
			for _, e := range entries {
				ls = append(ls, txtLine(TXTFourPart, e, withCreds(e)))
			}
			return lines(ls), "text/csv; charset=utf-8"
		}
		var b bytes.Buffer
		cw := csv.NewWriter(&b)
		cw.UseCRLF = l.CRLF
		_ = cw.Write([]string{"host", "port", "login", "password"})
		for _, e := range entries {
			login, password := "", ""
			if creds {
				login, password = e.Login, e.Password
			}
			_ = cw.Write([]string{e.Host, strconv.Itoa(e.Port), login, password})
		}
		cw.Flush() // writes to a bytes.Buffer cannot fail
		return b.Bytes(), "text/csv; charset=utf-8"

	default: // json
		switch l.JSON {
		case JSONStrings:
			out := make([]string, 0, len(entries))
			for _, e := range entries {
				out = append(out, txtLine(l.TXT, e, withCreds(e)))
			}
			b, _ := json.Marshal(out)
			return b, "application/json"
		case JSONObjectsAlt:
			out := make([]object, 0, len(entries))
			for _, e := range entries {
				o := object{{"ip", e.Host}, {"port", e.Port}}
				if creds {
					o = append(o, field{"user", e.Login}, field{"pass", e.Password})
				}
				out = append(out, o)
			}
			b, _ := json.Marshal(out)
			return b, "application/json"
		case JSONLines:
			var ls []string
			for _, e := range entries {
				b, _ := json.Marshal(jsonObject(e, creds))
				ls = append(ls, string(b)+",")
			}
			return lines(ls), "application/json"
		default:
			out := make([]object, 0, len(entries))
			for _, e := range entries {
				out = append(out, jsonObject(e, creds))
			}
			b, _ := json.Marshal(out)
			return b, "application/json"
		}
	}
}

func jsonObject(e Entry, creds bool) object {
	o := object{{"host", e.Host}, {"port", strconv.Itoa(e.Port)}}
	if creds {
		o = append(o, field{"login", e.Login}, field{"password", e.Password})
	}
	return o
}

// txtLine writes one entry in a TXT layout; IPv6 hosts are bracketed.
func txtLine(layout string, e Entry, withCreds bool) string {
	hp := net.JoinHostPort(e.Host, strconv.Itoa(e.Port))
	if !withCreds {
		return hp
	}
	switch layout {
	case TXTLoginFirst:
		return e.Login + ":" + e.Password + "@" + hp
	case TXTFourPart:
		return hp + ":" + e.Login + ":" + e.Password
	default:
		return hp + "@" + e.Login + ":" + e.Password
	}
}
