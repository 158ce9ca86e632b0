package agent

import (
	"encoding/json"
	"errors"
	"math"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzParseIPList: never panics; every entry is a dialable host and port;
// the bad-line bookkeeping holds.
func FuzzParseIPList(f *testing.F) {
	for _, tc := range ipListLayouts {
		f.Add([]byte(tc.body), tc.format)
	}
	for _, s := range []string{
		"10.0.0.1:8080\r\ngarbage\r\n10.0.0.1:99999\r\n[2001:db8::1]8080\r\n",
		"{\"host\":\"10.0.0.1\",\"port\":\n{\"host\":\"10.0.0.2\",\"port\":\"8081\"},",
		"[\n[\n[", "{", "\"", "[2001:db8::1]:8080:u:p@x", "user:p@ss@10.0.0.1:8080", "a:b@c:d",
		"host\n10.0.0.1:8080\n", "\"a\",\"b\"\n1,2\n",
	} {
		f.Add([]byte(s), "")
		f.Add([]byte(s), "json")
	}
	f.Fuzz(func(t *testing.T, body []byte, format string) {
		l, err := ParseIPList(body, format)
		if l == nil {
			t.Fatal("nil list")
		}
		if format != "" && format != "txt" && format != "csv" && format != "json" {
			if err == nil {
				t.Fatalf("format %q accepted", format)
			}
			return
		}
		if err != nil && (len(l.Entries) != 0 || l.Bad == 0) {
			t.Fatalf("error %v with %d entries, %d bad", err, len(l.Entries), l.Bad)
		}
		if len(l.BadLines) > MaxBadLines || len(l.BadLines) > l.Bad || (l.Bad > 0 && len(l.BadLines) == 0) {
			t.Fatalf("Bad %d, BadLines %d", l.Bad, len(l.BadLines))
		}
		for _, b := range l.BadLines {
			if len(b) > maxBadLineLen || !utf8.ValidString(b) {
				t.Fatalf("bad line %q not bounded", b)
			}
		}
		for _, e := range l.Entries {
			if e.Port < 1 || e.Port > 65535 || !validHost(e.Host) {
				t.Fatalf("entry %+v not dialable", e)
			}
			if strings.HasPrefix(e.Host, "[") {
				t.Fatalf("entry %+v keeps brackets", e)
			}
		}
	})
}

// FuzzDecodeError: never panics; the message is bounded and valid UTF-8;
// statuses keep their classes.
func FuzzDecodeError(f *testing.F) {
	for _, tc := range specErrors {
		f.Add(tc.status, []byte(tc.body))
	}
	for _, s := range []string{"", "<html>502</html>", "\xff\xfe", `{"error":42}`, `{"message":"x"}`, `"quoted"`,
		`{"error":"Too Many Attempts (updateList). Next update possible: 9999-99-99 99:99:99"}`, strings.Repeat("é", 300)} {
		f.Add(500, []byte(s))
		f.Add(429, []byte(s))
	}
	f.Fuzz(func(t *testing.T, status int, body []byte) {
		e := decodeError(status, RouteService, body)
		msg := e.Error()
		if !utf8.ValidString(msg) || !utf8.ValidString(e.Body) || !utf8.ValidString(e.Message) {
			t.Fatalf("invalid UTF-8 in %q", msg)
		}
		if len(e.Body) > maxExcerpt || len(e.Message) > maxExcerpt {
			t.Fatalf("excerpt %d / message %d bytes", len(e.Body), len(e.Message))
		}
		if !strings.Contains(msg, strconv.Itoa(status)) || !strings.Contains(msg, RouteService) {
			t.Fatalf("Error() = %q lacks status or route", msg)
		}
		if errors.Is(e, ErrTooManyAttempts) != (status == 429) || errors.Is(e, ErrUnauthenticated) != (status == 401) {
			t.Fatalf("status %d misclassified", status)
		}
		if errors.Is(e, ErrUnprocessable) != (status == 422) {
			t.Fatalf("status %d: ErrUnprocessable %v", status, errors.Is(e, ErrUnprocessable))
		}
		if !e.NextAllowed.IsZero() && status != 429 {
			t.Fatalf("NextAllowed on %d", status)
		}
	})
}

// FuzzNumber: Number, Int and Date never panic, never yield NaN or
// infinities, and agree with strconv on what they accept.
func FuzzNumber(f *testing.F) {
	for _, s := range []string{`8080`, `"8080"`, `"12.34"`, `12.34`, `""`, `null`, `" 7 "`, `"abc"`, `"NaN"`, `"Inf"`,
		`"0x10"`, `1e400`, `"1e400"`, `-0`, `true`, `[]`, `{}`, `"2026-11-21"`, `"0000-00-00"`, `"2026-11-21 10:00:00"`,
		`"9223372036854775807"`, `"9223372036854775808"`, `1e15`, `"\u0031"`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var n Number
		if err := n.UnmarshalJSON(data); err == nil {
			if math.IsNaN(float64(n)) || math.IsInf(float64(n), 0) {
				t.Fatalf("Number(%q) = %v", data, n)
			}
			if json.Valid(data) {
				var direct float64
				if json.Unmarshal(data, &direct) == nil && direct != float64(n) {
					t.Fatalf("Number(%q) = %v, encoding/json says %v", data, n, direct)
				}
			}
		}
		var i Int
		if err := i.UnmarshalJSON(data); err == nil {
			var f Number
			if f.UnmarshalJSON(data) == nil && float64(int(i)) != float64(f) && math.Abs(float64(f)) < 1<<53 {
				t.Fatalf("Int(%q) = %d but Number = %v", data, i, f)
			}
		}
		var d Date
		if err := d.UnmarshalJSON(data); err == nil && !d.IsZero() {
			if d.Hour() != 0 || d.Minute() != 0 || d.Location().String() != "UTC" {
				t.Fatalf("Date(%q) = %v not a UTC date", data, d.Time)
			}
		}
	})
}
