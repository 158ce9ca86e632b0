package providersim

import (
	"fmt"
	"testing"
)

// TestIPListDefaultLayouts checks every type × format of the default world
// in the default layout, byte-exact.
func TestIPListDefaultLayouts(t *testing.T) {
	ts := newTestSim(t, Config{})
	cases := []struct{ typ, format, id, ctype, body string }{
		{"http-auth", "txt", "101", "text/plain; charset=utf-8",
			"10.0.0.1:8080@u101:pw-101-sim\n10.0.0.2:8080@u101:pw-101-sim\n10.0.0.3:8080@u101:pw-101-sim\n"},
		{"http-auth", "csv", "101", "text/csv; charset=utf-8",
			"host,port,login,password\n10.0.0.1,8080,u101,pw-101-sim\n10.0.0.2,8080,u101,pw-101-sim\n10.0.0.3,8080,u101,pw-101-sim\n"},
		{"http-auth", "json", "101", "application/json",
			`[{"host":"10.0.0.1","port":"8080","login":"u101","password":"pw-101-sim"},{"host":"10.0.0.2","port":"8080","login":"u101","password":"pw-101-sim"},{"host":"10.0.0.3","port":"8080","login":"u101","password":"pw-101-sim"}]`},
		{"http-ip", "txt", "101", "text/plain; charset=utf-8", "10.0.0.1:8080\n10.0.0.2:8080\n10.0.0.3:8080\n"},
		{"http-ip", "csv", "101", "text/csv; charset=utf-8",
			"host,port,login,password\n10.0.0.1,8080,,\n10.0.0.2,8080,,\n10.0.0.3,8080,,\n"},
		{"http-ip", "json", "101", "application/json",
			`[{"host":"10.0.0.1","port":"8080"},{"host":"10.0.0.2","port":"8080"},{"host":"10.0.0.3","port":"8080"}]`},
		{"socks-ip", "txt", "101", "text/plain; charset=utf-8", "10.0.0.1:1080\n10.0.0.2:1080\n10.0.0.3:1080\n"},
		{"socks-ip", "csv", "101", "text/csv; charset=utf-8",
			"host,port,login,password\n10.0.0.1,1080,,\n10.0.0.2,1080,,\n10.0.0.3,1080,,\n"},
		{"socks-ip", "json", "101", "application/json",
			`[{"host":"10.0.0.1","port":"1080"},{"host":"10.0.0.2","port":"1080"},{"host":"10.0.0.3","port":"1080"}]`},
		// The sticky sessions' gateway: one HTTP port per session, one
		// SOCKS5 port for all.
		{"ppr-http", "txt", "102", "text/plain; charset=utf-8",
			"192.0.2.21:10001@u102:pw-102-sim\n192.0.2.21:10002@u102:pw-102-sim\n"},
		{"ppr-http", "csv", "102", "text/csv; charset=utf-8",
			"host,port,login,password\n192.0.2.21,10001,u102,pw-102-sim\n192.0.2.21,10002,u102,pw-102-sim\n"},
		{"ppr-http", "json", "102", "application/json",
			`[{"host":"192.0.2.21","port":"10001","login":"u102","password":"pw-102-sim"},{"host":"192.0.2.21","port":"10002","login":"u102","password":"pw-102-sim"}]`},
		{"ppr-socks", "txt", "102", "text/plain; charset=utf-8", "192.0.2.21:2087@u102:pw-102-sim\n"},
		{"ppr-http", "txt", "104", "text/plain; charset=utf-8",
			"192.0.2.21:8000@u104:pw-104-sim\n192.0.2.22:8000@u104:pw-104-sim\n"},
		{"ppr-socks", "txt", "104", "text/plain; charset=utf-8",
			"192.0.2.21:9000@u104:pw-104-sim\n192.0.2.22:9000@u104:pw-104-sim\n"},
		{"ppr-socks", "csv", "104", "text/csv; charset=utf-8",
			"host,port,login,password\n192.0.2.21,9000,u104,pw-104-sim\n192.0.2.22,9000,u104,pw-104-sim\n"},
		{"ppr-socks", "json", "104", "application/json",
			`[{"host":"192.0.2.21","port":"9000","login":"u104","password":"pw-104-sim"},{"host":"192.0.2.22","port":"9000","login":"u104","password":"pw-104-sim"}]`},
		// Suspended services still serve their lists; terminated 105 has empty ones.
		{"socks-ip", "txt", "103", "text/plain; charset=utf-8",
			"10.0.1.1:1080\n10.0.1.2:1080\n10.0.1.3:1080\n10.0.1.4:1080\n10.0.1.5:1080\n"},
		{"http-auth", "txt", "105", "text/plain; charset=utf-8", ""},
		{"http-auth", "csv", "105", "text/csv; charset=utf-8", "host,port,login,password\n"},
		{"http-auth", "json", "105", "application/json", "[]"},
	}
	for _, c := range cases {
		what := c.typ + "/" + c.format + "/" + c.id
		a := ts.do(t, "GET", "/api/iplist/"+what, "")
		a.want(t, what, 200, c.body)
		if a.contentType != c.ctype {
			t.Errorf("%s: content type %q, want %q", what, a.contentType, c.ctype)
		}
	}
}

func TestIPListErrors(t *testing.T) {
	ts := newTestSim(t, Config{})
	for _, p := range []string{
		"/api/iplist/ppr-http/txt/101",  // ppr list of an fpr service
		"/api/iplist/http-auth/txt/102", // fpr list of a ppr service
		"/api/iplist/socks-ip/json/104",
		"/api/iplist/https-ip/txt/101", // unknown type
		"/api/iplist/http-ip/xml/101",  // unknown format
		"/api/iplist/http-ip/TXT/101",
		"/api/iplist/http-ip/txt/1999", // unknown service
		"/api/iplist/http-ip/txt/950",  // orphan service
		"/api/iplist/http-ip/txt/abc",
	} {
		ts.do(t, "GET", p, "").wantError(t, p, 422, unprocessable)
	}
}

// TestIPListLayouts checks every layout option on a list with credentials
// (http-auth, one IPv6 entry, one entry without credentials) and on one
// without (http-ip, whose stored credentials must not be served).
func TestIPListLayouts(t *testing.T) {
	ts := newTestSim(t, Config{})
	entries := []Entry{
		{Host: "127.0.0.1", Port: 31280, Login: "user", Password: "p@ss:w,rd"},
		{Host: "2001:db8::7", Port: 8080, Login: "user", Password: "pw"},
		{Host: "10.0.0.9", Port: 3128},
	}
	ts.SetEntries(101, "http-auth", entries)
	ts.SetEntries(101, "http-ip", entries)
	ts.SetEntries(1999, "http-ip", entries) // unknown service: ignored

	cases := []struct {
		layout         Layout
		format         string
		httpAuth, http string
	}{
		{Layout{}, "txt",
			"127.0.0.1:31280@user:p@ss:w,rd\n[2001:db8::7]:8080@user:pw\n10.0.0.9:3128\n",
			"127.0.0.1:31280\n[2001:db8::7]:8080\n10.0.0.9:3128\n"},
		{Layout{TXT: TXTColon, CRLF: true}, "txt",
			"127.0.0.1:31280@user:p@ss:w,rd\r\n[2001:db8::7]:8080@user:pw\r\n10.0.0.9:3128\r\n",
			"127.0.0.1:31280\r\n[2001:db8::7]:8080\r\n10.0.0.9:3128\r\n"},
		{Layout{TXT: TXTLoginFirst}, "txt",
			"user:p@ss:w,rd@127.0.0.1:31280\nuser:pw@[2001:db8::7]:8080\n10.0.0.9:3128\n",
			"127.0.0.1:31280\n[2001:db8::7]:8080\n10.0.0.9:3128\n"},
		{Layout{TXT: TXTFourPart, CRLF: true, NoFinalNewline: true}, "txt",
			"127.0.0.1:31280:user:p@ss:w,rd\r\n[2001:db8::7]:8080:user:pw\r\n10.0.0.9:3128",
			"127.0.0.1:31280\r\n[2001:db8::7]:8080\r\n10.0.0.9:3128"},
		{Layout{NoFinalNewline: true}, "txt",
			"127.0.0.1:31280@user:p@ss:w,rd\n[2001:db8::7]:8080@user:pw\n10.0.0.9:3128",
			"127.0.0.1:31280\n[2001:db8::7]:8080\n10.0.0.9:3128"},
		{Layout{CSV: CSVHeader}, "csv",
			"host,port,login,password\n127.0.0.1,31280,user,\"p@ss:w,rd\"\n2001:db8::7,8080,user,pw\n10.0.0.9,3128,,\n",
			"host,port,login,password\n127.0.0.1,31280,,\n2001:db8::7,8080,,\n10.0.0.9,3128,,\n"},
		{Layout{CSV: CSVHeader, CRLF: true}, "csv",
			"host,port,login,password\r\n127.0.0.1,31280,user,\"p@ss:w,rd\"\r\n2001:db8::7,8080,user,pw\r\n10.0.0.9,3128,,\r\n",
			"host,port,login,password\r\n127.0.0.1,31280,,\r\n2001:db8::7,8080,,\r\n10.0.0.9,3128,,\r\n"},
		{Layout{CSV: CSVPlain}, "csv",
			"127.0.0.1:31280:user:p@ss:w,rd\n[2001:db8::7]:8080:user:pw\n10.0.0.9:3128\n",
			"127.0.0.1:31280\n[2001:db8::7]:8080\n10.0.0.9:3128\n"},
		{Layout{CSV: CSVPlain, CRLF: true, NoFinalNewline: true}, "csv",
			"127.0.0.1:31280:user:p@ss:w,rd\r\n[2001:db8::7]:8080:user:pw\r\n10.0.0.9:3128",
			"127.0.0.1:31280\r\n[2001:db8::7]:8080\r\n10.0.0.9:3128"},
		{Layout{JSON: JSONObjects}, "json",
			`[{"host":"127.0.0.1","port":"31280","login":"user","password":"p@ss:w,rd"},{"host":"2001:db8::7","port":"8080","login":"user","password":"pw"},{"host":"10.0.0.9","port":"3128","login":"","password":""}]`,
			`[{"host":"127.0.0.1","port":"31280"},{"host":"2001:db8::7","port":"8080"},{"host":"10.0.0.9","port":"3128"}]`},
		{Layout{JSON: JSONObjectsAlt}, "json",
			`[{"ip":"127.0.0.1","port":31280,"user":"user","pass":"p@ss:w,rd"},{"ip":"2001:db8::7","port":8080,"user":"user","pass":"pw"},{"ip":"10.0.0.9","port":3128,"user":"","pass":""}]`,
			`[{"ip":"127.0.0.1","port":31280},{"ip":"2001:db8::7","port":8080},{"ip":"10.0.0.9","port":3128}]`},
		{Layout{JSON: JSONStrings}, "json",
			`["127.0.0.1:31280@user:p@ss:w,rd","[2001:db8::7]:8080@user:pw","10.0.0.9:3128"]`,
			`["127.0.0.1:31280","[2001:db8::7]:8080","10.0.0.9:3128"]`},
		{Layout{JSON: JSONStrings, TXT: TXTLoginFirst}, "json",
			`["user:p@ss:w,rd@127.0.0.1:31280","user:pw@[2001:db8::7]:8080","10.0.0.9:3128"]`,
			`["127.0.0.1:31280","[2001:db8::7]:8080","10.0.0.9:3128"]`},
		{Layout{JSON: JSONStrings, TXT: TXTFourPart}, "json",
			`["127.0.0.1:31280:user:p@ss:w,rd","[2001:db8::7]:8080:user:pw","10.0.0.9:3128"]`,
			`["127.0.0.1:31280","[2001:db8::7]:8080","10.0.0.9:3128"]`},
		{Layout{JSON: JSONLines}, "json",
			"{\"host\":\"127.0.0.1\",\"port\":\"31280\",\"login\":\"user\",\"password\":\"p@ss:w,rd\"},\n{\"host\":\"2001:db8::7\",\"port\":\"8080\",\"login\":\"user\",\"password\":\"pw\"},\n{\"host\":\"10.0.0.9\",\"port\":\"3128\",\"login\":\"\",\"password\":\"\"},\n",
			"{\"host\":\"127.0.0.1\",\"port\":\"31280\"},\n{\"host\":\"2001:db8::7\",\"port\":\"8080\"},\n{\"host\":\"10.0.0.9\",\"port\":\"3128\"},\n"},
		{Layout{JSON: JSONLines, CRLF: true}, "json",
			"{\"host\":\"127.0.0.1\",\"port\":\"31280\",\"login\":\"user\",\"password\":\"p@ss:w,rd\"},\r\n{\"host\":\"2001:db8::7\",\"port\":\"8080\",\"login\":\"user\",\"password\":\"pw\"},\r\n{\"host\":\"10.0.0.9\",\"port\":\"3128\",\"login\":\"\",\"password\":\"\"},\r\n",
			"{\"host\":\"127.0.0.1\",\"port\":\"31280\"},\r\n{\"host\":\"2001:db8::7\",\"port\":\"8080\"},\r\n{\"host\":\"10.0.0.9\",\"port\":\"3128\"},\r\n"},
		// Unknown names fall back to the defaults.
		{Layout{TXT: "bogus"}, "txt",
			"127.0.0.1:31280@user:p@ss:w,rd\n[2001:db8::7]:8080@user:pw\n10.0.0.9:3128\n",
			"127.0.0.1:31280\n[2001:db8::7]:8080\n10.0.0.9:3128\n"},
	}
	for _, c := range cases {
		ts.SetLayout(c.layout)
		what := fmt.Sprintf("%+v %s", c.layout, c.format)
		ts.do(t, "GET", "/api/iplist/http-auth/"+c.format+"/101", "").want(t, "http-auth "+what, 200, c.httpAuth)
		ts.do(t, "GET", "/api/iplist/http-ip/"+c.format+"/101", "").want(t, "http-ip "+what, 200, c.http)
	}

	// The layout from Config applies from the start.
	ts2 := newTestSim(t, Config{Layout: Layout{TXT: TXTFourPart, CRLF: true}})
	ts2.do(t, "GET", "/api/iplist/ppr-http/txt/102", "").want(t, "config layout", 200,
		"192.0.2.21:10001:u102:pw-102-sim\r\n192.0.2.21:10002:u102:pw-102-sim\r\n")
	// Empty lists in the line layouts.
	ts2.SetLayout(Layout{JSON: JSONLines})
	ts2.do(t, "GET", "/api/iplist/socks-ip/json/105", "").want(t, "empty lines", 200, "")
	ts2.SetLayout(Layout{CSV: CSVPlain})
	ts2.do(t, "GET", "/api/iplist/socks-ip/csv/105", "").want(t, "empty plain csv", 200, "")
}
