package agent

import (
	"fmt"
	"reflect"
	"strings"
	"testing"
)

var (
	e1     = Entry{Host: "10.0.0.1", Port: 8080}
	e2     = Entry{Host: "10.0.0.2", Port: 8081}
	e1Auth = Entry{Host: "10.0.0.1", Port: 8080, Login: "user1", Password: "pa:ss@1"}
	e2Auth = Entry{Host: "10.0.0.2", Port: 8081, Login: "user2", Password: "secret2"}
	e6     = Entry{Host: "2001:db8::1", Port: 8080}
	e6Auth = Entry{Host: "2001:db8::1", Port: 3128, Login: "u6", Password: "p6"}
	eName  = Entry{Host: "gw1.example.net", Port: 9000, Login: "u", Password: "p"}
)

// ipListLayouts holds every layout public client code shows of the
// provider and its peers;
// the fuzz seed corpus reuses it.
var ipListLayouts = []struct {
	name   string
	format string
	body   string
	want   []Entry
}{
	{"txt ip:port LF", "txt", "10.0.0.1:8080\n10.0.0.2:8081\n", []Entry{e1, e2}},
	{"txt ip:port CRLF", "txt", "10.0.0.1:8080\r\n10.0.0.2:8081\r\n", []Entry{e1, e2}},
	{"txt no final newline", "txt", "10.0.0.1:8080\r\n10.0.0.2:8081", []Entry{e1, e2}},
	{"txt blank lines", "txt", "\r\n10.0.0.1:8080\r\n\r\n  \n10.0.0.2:8081\n\n", []Entry{e1, e2}},
	{"txt ip:port@login:password", "txt", "10.0.0.1:8080@user1:pa:ss@1\r\n10.0.0.2:8081@user2:secret2\r\n", []Entry{e1Auth, e2Auth}},
	{"txt login:password@ip:port", "txt", "user1:pa:ss@1@10.0.0.1:8080\nuser2:secret2@10.0.0.2:8081\n", []Entry{e1Auth, e2Auth}},
	{"txt ip:port:login:password", "txt", "10.0.0.1:8080:user1:pa:ss@1\n10.0.0.2:8081:user2:secret2", []Entry{e1Auth, e2Auth}},
	{"txt login:password:ip:port", "txt", "user2:secret2:10.0.0.2:8081\n", []Entry{e2Auth}},
	{"txt ipv6", "txt", "[2001:db8::1]:8080\n[2001:db8::1]:3128@u6:p6\nu6:p6@[2001:db8::1]:3128\n[2001:db8::1]:3128:u6:p6\n", []Entry{e6, e6Auth, e6Auth, e6Auth}},
	{"txt host names and scheme", "txt", "gw1.example.net:9000@u:p\nhttp://u:p@gw1.example.net:9000/\n", []Entry{eName, eName}},
	{"csv header", "csv", "host,port,login,password\r\n10.0.0.1,8080,user1,pa:ss@1\r\n10.0.0.2,8081,user2,secret2\r\n", []Entry{e1Auth, e2Auth}},
	{"csv header other names and order", "csv", "IP;Port;Pass;User\n10.0.0.2;8081;secret2;user2\n", []Entry{e2Auth}},
	{"csv header no auth", "csv", "ip,port\n10.0.0.1,8080\n10.0.0.2,8081", []Entry{e1, e2}},
	{"csv header proxy column", "csv", "proxy\n10.0.0.1:8080\n", []Entry{e1}},
	{"csv plain columns", "csv", "10.0.0.1,8080,user1,pa:ss@1\n10.0.0.2,8081,user2,secret2\n", []Entry{e1Auth, e2Auth}},
	{"csv plain empty credentials", "csv", "10.0.0.1,8080,,\n10.0.0.2,8081\n", []Entry{e1, e2}},
	{"csv plain ip:port,login,password", "csv", "10.0.0.2:8081,user2,secret2\n", []Entry{e2Auth}},
	{"csv plain fourpart", "csv", "10.0.0.1:8080:user1:pa:ss@1\r\n10.0.0.2:8081:user2:secret2\r\n", []Entry{e1Auth, e2Auth}},
	{"csv plain ip:port", "csv", "10.0.0.1:8080\n10.0.0.2:8081\n", []Entry{e1, e2}},
	{"csv quoted", "csv", "\"host\",\"port\",\"login\",\"password\"\n\"10.0.0.1\",\"8080\",\"user1\",\"pa:ss@1\"\n", []Entry{e1Auth}},
	{"json strings", "json", `["10.0.0.1:8080@user1:pa:ss@1","10.0.0.2:8081@user2:secret2"]`, []Entry{e1Auth, e2Auth}},
	{"json strings fourpart", "json", `["10.0.0.1:8080:user1:pa:ss@1", "[2001:db8::1]:8080"]`, []Entry{e1Auth, e6}},
	{"json objects port string", "json", `[{"host":"10.0.0.1","port":"8080","login":"user1","password":"pa:ss@1"},{"host":"10.0.0.2","port":"8081","login":"user2","password":"secret2"}]`, []Entry{e1Auth, e2Auth}},
	{"json objects alt keys port number", "json", "[\n {\"ip\": \"10.0.0.1\", \"port\": 8080, \"user\": \"user1\", \"pass\": \"pa:ss@1\", \"country\": \"US\"},\n {\"ip\": \"10.0.0.2\", \"port\": 8081, \"username\": \"user2\", \"pass\": \"secret2\"}\n]\n", []Entry{e1Auth, e2Auth}},
	{"json objects no auth", "json", `[{"host":"10.0.0.1","port":8080},{"IP":"10.0.0.2","Port":"8081","login":null}]`, []Entry{e1, e2}},
	{"json object host:port", "json", `[{"proxy":"10.0.0.1:8080"},{"host":"[2001:db8::1]:8080"},{"host":"[2001:db8::1]","port":3128,"login":"u6","password":"p6"}]`, []Entry{e1, e6, e6Auth}},
	{"json wrapped", "json", `{"data":[{"host":"10.0.0.1","port":"8080"}]}`, []Entry{e1}},
	{"json object keyed", "json", `{"1":{"host":"10.0.0.2","port":"8081"},"0":{"host":"10.0.0.1","port":"8080"}}`, []Entry{e1, e2}},
	{"json single object", "json", `{"host":"10.0.0.1","port":"8080"}`, []Entry{e1}},
	{"json arrays of fields", "json", `[["10.0.0.1", 8080], ["10.0.0.2", "8081", "user2", "secret2"]]`, []Entry{e1, e2Auth}},
	{"json lines comma-terminated", "json", "{\"host\":\"10.0.0.1\",\"port\":\"8080\"},\n{\"host\":\"10.0.0.2\",\"port\":\"8081\"},\n", []Entry{e1, e2}},
	{"json lines CRLF no final comma", "json", "{\"host\":\"10.0.0.1\",\"port\":\"8080\",\"login\":\"user1\",\"password\":\"pa:ss@1\"},\r\n{\"host\":\"10.0.0.2\",\"port\":\"8081\",\"login\":\"user2\",\"password\":\"secret2\"}", []Entry{e1Auth, e2Auth}},
	{"json array trailing comma", "json", "[\n  {\n    \"host\": \"10.0.0.1\",\n    \"port\": \"8080\"\n  },\n  {\"host\":\"10.0.0.2\",\"port\":8081},\n]\n", []Entry{e1, e2}},
	{"json empty array", "json", `[]`, nil},
	{"json null", "json", `null`, nil},
	{"empty body", "txt", "", nil},
	{"only blank lines", "txt", "\r\n\r\n", nil},
	{"txt served as json", "json", "10.0.0.1:8080\n", []Entry{e1}},
	{"json served as txt", "txt", `["10.0.0.1:8080"]`, []Entry{e1}},
	{"detect csv", "", "host,port\n10.0.0.1,8080\n", []Entry{e1}},
	{"bom", "txt", "\xef\xbb\xbf10.0.0.1:8080\n", []Entry{e1}},
}

func TestParseIPListLayouts(t *testing.T) {
	for _, tc := range ipListLayouts {
		t.Run(tc.name, func(t *testing.T) {
			l, err := ParseIPList([]byte(tc.body), tc.format)
			if err != nil {
				t.Fatalf("ParseIPList: %v", err)
			}
			if l.Bad != 0 || len(l.BadLines) != 0 {
				t.Errorf("Bad = %d, BadLines = %q; want none", l.Bad, l.BadLines)
			}
			if !reflect.DeepEqual(l.Entries, tc.want) && (len(l.Entries) != 0 || len(tc.want) != 0) {
				t.Errorf("Entries =\n%+v\nwant\n%+v", l.Entries, tc.want)
			}
			if string(l.Raw) != tc.body {
				t.Errorf("Raw = %q, want the body", l.Raw)
			}
		})
	}
}

func TestParseIPListAmbiguousAt(t *testing.T) {
	// a:b@c:d is read by which side is host + numeric port.
	for _, tc := range []struct {
		line string
		want Entry
	}{
		{"10.0.0.1:8080@user:pass", Entry{Host: "10.0.0.1", Port: 8080, Login: "user", Password: "pass"}},
		{"user:pass@10.0.0.1:8080", Entry{Host: "10.0.0.1", Port: 8080, Login: "user", Password: "pass"}},
		{"proxy.example:3128@admin:8080", Entry{Host: "proxy.example", Port: 3128, Login: "admin", Password: "8080"}},
		{"admin:secret@proxy.example:3128", Entry{Host: "proxy.example", Port: 3128, Login: "admin", Password: "secret"}},
		// Both sides parse: the provider's documented ip:port@login:password wins.
		{"10.0.0.1:80@10.0.0.2:90", Entry{Host: "10.0.0.1", Port: 80, Login: "10.0.0.2", Password: "90"}},
		{"user:p@ss@10.0.0.1:8080", Entry{Host: "10.0.0.1", Port: 8080, Login: "user", Password: "p@ss"}},
	} {
		l, err := ParseIPList([]byte(tc.line), "txt")
		if err != nil || len(l.Entries) != 1 || l.Entries[0] != tc.want {
			t.Errorf("%q: entries %+v, err %v; want %+v", tc.line, l.Entries, err, tc.want)
		}
	}
}

// A login with a numeric password reads like host:port; the reading whose
// host is an IP address (or a dotted name, against a bare label) wins, in
// either order and with '@' or ':' between the halves.
func TestParseProxyLineNumericPassword(t *testing.T) {
	gw := Entry{Host: "192.0.2.21", Port: 3081, Login: "PPR123", Password: "4567"}
	named := Entry{Host: "gw.example.net", Port: 3081, Login: "PPR123", Password: "4567"}
	for _, tc := range []struct {
		line string
		want Entry
	}{
		{"PPR123:4567@192.0.2.21:3081", gw},
		{"192.0.2.21:3081@PPR123:4567", gw},
		{"PPR123:4567:192.0.2.21:3081", gw},
		{"192.0.2.21:3081:PPR123:4567", gw},
		{"PPR123:4567@gw.example.net:3081", named},
		{"gw.example.net:3081@PPR123:4567", named},
		{"PPR123:4567:gw.example.net:3081", named},
		{"gw.example.net:3081:PPR123:4567", named},
		{"http://PPR123:4567@192.0.2.21:3081", gw},
	} {
		e, ok := parseProxyLine(tc.line)
		if !ok || e != tc.want {
			t.Errorf("%q: got %+v ok=%v, want %+v", tc.line, e, ok, tc.want)
		}
	}
}

func TestParseIPListBadLines(t *testing.T) {
	body := "10.0.0.1:8080\r\n" +
		"garbage\r\n" +
		"10.0.0.1:99999\r\n" +
		"10.0.0.1:http\r\n" +
		"2001:db8::1\r\n" +
		"@:\r\n" +
		"10.0.0.2:8081\r\n" +
		"1.2.3.4\r\n" +
		"[2001:db8::1]8080\r\n"
	l, err := ParseIPList([]byte(body), "txt")
	if err != nil {
		t.Fatalf("ParseIPList: %v", err)
	}
	if want := []Entry{e1, e2}; !reflect.DeepEqual(l.Entries, want) {
		t.Errorf("Entries = %+v, want %+v", l.Entries, want)
	}
	if l.Bad != 7 {
		t.Errorf("Bad = %d, want 7", l.Bad)
	}
	wantBad := []string{"garbage", "10.0.0.1:99999", "10.0.0.1:http", "2001:db8::1", "@:"}
	if !reflect.DeepEqual(l.BadLines, wantBad) {
		t.Errorf("BadLines = %q, want %q", l.BadLines, wantBad)
	}

	// JSON: bad elements counted, good ones kept.
	l, err = ParseIPList([]byte(`[{"host":"10.0.0.1","port":"8080"},{"host":"10.0.0.2","port":"x"},42,{"foo":1},"nope",{"host":"bad host","port":1}]`), "json")
	if err != nil || len(l.Entries) != 1 || l.Bad != 5 || len(l.BadLines) != 5 {
		t.Errorf("json: entries %+v bad %d %q err %v; want 1 entry, 5 bad", l.Entries, l.Bad, l.BadLines, err)
	}

	// Comma-terminated lines with a broken one in the middle.
	l, err = ParseIPList([]byte("{\"host\":\"10.0.0.1\",\"port\":\"8080\"},\n{\"host\":\"10.0.0.2\",\"port\":\n{\"host\":\"10.0.0.2\",\"port\":\"8081\"},\n"), "json")
	if err != nil || !reflect.DeepEqual(l.Entries, []Entry{e1, e2}) || l.Bad != 1 {
		t.Errorf("json lines: entries %+v bad %d %q err %v", l.Entries, l.Bad, l.BadLines, err)
	}
}

func TestParseIPListNothingReadable(t *testing.T) {
	long := strings.Repeat("x", 1000)
	l, err := ParseIPList([]byte("<html>\n"+long+"\n</html>\n"), "txt")
	if err == nil {
		t.Fatal("want an error for a body without any proxy")
	}
	if l == nil || l.Bad != 3 || len(l.BadLines[1]) > maxBadLineLen {
		t.Fatalf("list %+v", l)
	}
	if _, err := ParseIPList([]byte("1.2.3.4:80"), "xml"); err == nil {
		t.Error("want an error for an unknown format")
	}
}

// The error of a list nothing could be read from is logged: it shows the
// first line's layout, never its text, which may hold a proxy password.
func TestParseIPListErrorHidesLineText(t *testing.T) {
	_, err := ParseIPList([]byte("1.2.3.4:8080|PPR123|s3cretPass\r\n"), "txt")
	if err == nil {
		t.Fatal("want an error for a body without any proxy")
	}
	for _, secret := range []string{"s3cretPass", "PPR123", "1.2.3.4"} {
		if strings.Contains(err.Error(), secret) {
			t.Errorf("the error holds %q: %v", secret, err)
		}
	}
	if !strings.Contains(err.Error(), `"9.9.9.9:9|a9|a9a"`) {
		t.Errorf("the error does not show the line's shape: %v", err)
	}
}

func TestParseIPListKeepsFirstFiveBad(t *testing.T) {
	var b strings.Builder
	for i := 0; i < 20; i++ {
		b.WriteString("bad line\n10.0.0.1:8080\n")
	}
	l, err := ParseIPList([]byte(b.String()), "txt")
	if err != nil || len(l.Entries) != 20 || l.Bad != 20 || len(l.BadLines) != MaxBadLines {
		t.Fatalf("entries %d bad %d badlines %d err %v", len(l.Entries), l.Bad, len(l.BadLines), err)
	}
}

func TestParseIPListOneColumnHeader(t *testing.T) {
	l, err := ParseIPList([]byte("ip\n10.0.0.1:8080\n10.0.0.2:8081@user2:secret2\n"), "csv")
	if err != nil || !reflect.DeepEqual(l.Entries, []Entry{e1, e2Auth}) || l.Bad != 0 {
		t.Errorf("entries %+v bad %q err %v", l.Entries, l.BadLines, err)
	}
}

func benchmarkList(n int, line func(i int) string, sep string) []byte {
	var b strings.Builder
	for i := 0; i < n; i++ {
		b.WriteString(line(i))
		b.WriteString(sep)
	}
	return []byte(b.String())
}

func BenchmarkParseIPList(b *testing.B) {
	const n = 10000
	for _, bc := range []struct {
		name, format string
		body         []byte
	}{
		{"txt", "txt", benchmarkList(n, func(i int) string {
			return fmt.Sprintf("10.%d.%d.%d:8080@user:pass", i>>16&255, i>>8&255, i&255)
		}, "\r\n")},
		{"csv", "csv", append([]byte("host,port,login,password\n"), benchmarkList(n, func(i int) string {
			return fmt.Sprintf("10.%d.%d.%d,8080,user,pass", i>>16&255, i>>8&255, i&255)
		}, "\n")...)},
		{"json", "json", []byte("[" + strings.TrimSuffix(string(benchmarkList(n, func(i int) string {
			return fmt.Sprintf(`{"host":"10.%d.%d.%d","port":"8080","login":"user","password":"pass"}`, i>>16&255, i>>8&255, i&255)
		}, ",")), ",") + "]")},
		{"json-lines", "json", benchmarkList(n, func(i int) string {
			return fmt.Sprintf(`{"host":"10.%d.%d.%d","port":"8080","login":"user","password":"pass"},`, i>>16&255, i>>8&255, i&255)
		}, "\n")},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.SetBytes(int64(len(bc.body)))
			for b.Loop() {
				l, err := ParseIPList(bc.body, bc.format)
				if err != nil || len(l.Entries) != n {
					b.Fatalf("%d entries, %v", len(l.Entries), err)
				}
			}
		})
	}
}

func TestSplitCSV(t *testing.T) {
	for in, want := range map[string][]string{
		`a,b , c`:         {"a", "b", "c"},
		`"a,b",c`:         {"a,b", "c"},
		`"x""y",z`:        {`x"y`, "z"},
		`a;b;c`:           {"a", "b", "c"},
		"a\tb":            {"a", "b"},
		`10.0.0.1,8080,,`: {"10.0.0.1", "8080", "", ""},
		``:                {""},
		`"unterminated,x`: {"unterminated,x"},
		`p@ss:w,rd`:       {"p@ss:w", "rd"},
		` "q" , "r" `:     {"q", "r"},
	} {
		if got := splitCSV(in); !reflect.DeepEqual(got, want) {
			t.Errorf("splitCSV(%q) = %q, want %q", in, got, want)
		}
	}
}
