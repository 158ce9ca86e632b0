package agent

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

// The provider's backend is PHP: numbers often arrive as strings ("8080",
// "12.34"), empty dates as "" or "0000-00-00", and empty lists as null. The
// scalar types below accept all of those so that one oddly encoded field does
// not fail a whole poll, while a value that is really wrong ("abc" for a
// price) is still an error.

// Number is a float64 that decodes from a JSON number or from a string
// holding one. null and "" decode as 0. NaN and infinities are refused.
type Number float64

// UnmarshalJSON implements json.Unmarshaler.
func (n *Number) UnmarshalJSON(b []byte) error {
	f, err := parseNumber(b)
	if err != nil {
		return err
	}
	*n = Number(f)
	return nil
}

// Int is an int that decodes from a JSON number or from a string holding
// one. null and "" decode as 0. A fractional value is refused.
type Int int

// UnmarshalJSON implements json.Unmarshaler.
func (n *Int) UnmarshalJSON(b []byte) error {
	i, err := parseInt(b)
	if err != nil {
		return err
	}
	*n = Int(i)
	return nil
}

// Date is a calendar date (YYYY-MM-DD, UTC midnight). It decodes from
// "YYYY-MM-DD", from a timestamp whose date part it keeps, and decodes "",
// null and "0000-00-00" (with or without a time) as the zero Date.
type Date struct{ time.Time }

// dateLayouts are tried in order; the time of day, if any, is dropped.
var dateLayouts = [...]string{"2006-01-02", "2006-01-02 15:04:05.999999999", time.RFC3339Nano, "2006-01-02T15:04:05.999999999"}

// UnmarshalJSON implements json.Unmarshaler.
func (d *Date) UnmarshalJSON(b []byte) error {
	t, err := parseTime(b)
	if err != nil {
		return err
	}
	if !t.IsZero() {
		t = time.Date(t.Year(), t.Month(), t.Day(), 0, 0, 0, 0, time.UTC)
	}
	d.Time = t
	return nil
}

// MarshalJSON writes "YYYY-MM-DD", or "" for the zero Date.
func (d Date) MarshalJSON() ([]byte, error) {
	return json.Marshal(d.String())
}

// String returns "YYYY-MM-DD", or "" for the zero Date.
func (d Date) String() string {
	if d.IsZero() {
		return ""
	}
	return d.Format("2006-01-02")
}

// maxValueExcerpt bounds how much of a bad value an error message quotes.
const maxValueExcerpt = 40

func badValue(kind string, b []byte) error {
	return fmt.Errorf("decoding %s: unexpected value %q", kind, excerpt(b, maxValueExcerpt))
}

// scalarString returns the text of a JSON string or, for anything else, the
// raw JSON token; ok is false for null.
func scalarString(b []byte) (s string, quoted, ok bool, err error) {
	b = bytes.TrimSpace(b)
	if len(b) == 0 || string(b) == "null" {
		return "", false, false, nil
	}
	if b[0] == '"' {
		if err := json.Unmarshal(b, &s); err != nil {
			return "", true, false, err
		}
		return strings.TrimSpace(s), true, true, nil
	}
	return string(b), false, true, nil
}

func parseNumber(b []byte) (float64, error) {
	s, quoted, ok, err := scalarString(b)
	if err != nil {
		return 0, badValue("number", b)
	}
	if !ok || (quoted && s == "") {
		return 0, nil
	}
	if !looksNumeric(s) {
		return 0, badValue("number", b)
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, badValue("number", b)
	}
	return f, nil
}

func parseInt(b []byte) (int, error) {
	s, quoted, ok, err := scalarString(b)
	if err != nil {
		return 0, badValue("integer", b)
	}
	if !ok || (quoted && s == "") {
		return 0, nil
	}
	if !looksNumeric(s) {
		return 0, badValue("integer", b)
	}
	if i, err := strconv.ParseInt(s, 10, 0); err == nil {
		return int(i), nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f != math.Trunc(f) || math.Abs(f) > 1<<53 {
		return 0, badValue("integer", b)
	}
	return int(f), nil
}

// looksNumeric admits decimal notation only: strconv would also take "Inf",
// "0x1p4" and "1_0", which no provider means as a number.
func looksNumeric(s string) bool {
	if s == "" {
		return false
	}
	digits := false
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= '0' && c <= '9':
			digits = true
		case c == '.' || c == 'e' || c == 'E':
		case (c == '+' || c == '-') && (i == 0 || s[i-1] == 'e' || s[i-1] == 'E'):
		default:
			return false
		}
	}
	return digits
}

// parseTime decodes a date or timestamp in UTC; "", null and all-zero dates
// give the zero time.
func parseTime(b []byte) (time.Time, error) {
	s, quoted, ok, err := scalarString(b)
	if err != nil || (ok && !quoted) {
		return time.Time{}, badValue("date", b)
	}
	if !ok || s == "" || strings.HasPrefix(s, "0000-00-00") {
		return time.Time{}, nil
	}
	for _, layout := range dateLayouts {
		if t, err := time.ParseInLocation(layout, s, time.UTC); err == nil {
			return t.UTC(), nil
		}
	}
	return time.Time{}, badValue("date", b)
}

// text is a string that also accepts a JSON number or boolean (kept as its
// literal text) and null (""). Wire structs use it for every string field.
type text string

func (t *text) UnmarshalJSON(b []byte) error {
	s, err := parseText(b)
	if err != nil {
		return err
	}
	*t = text(s)
	return nil
}

// parseText decodes a JSON value as text does.
func parseText(b []byte) (string, error) {
	b = bytes.TrimSpace(b)
	if len(b) > 0 && (b[0] == '{' || b[0] == '[') {
		return "", badValue("string", b)
	}
	s, _, _, err := scalarString(b)
	if err != nil {
		return "", badValue("string", b)
	}
	return s, nil
}

// flag is a bool that also accepts 0/1 and their string forms.
type flag bool

func (f *flag) UnmarshalJSON(b []byte) error {
	s, _, _, err := scalarString(b)
	if err != nil {
		return badValue("boolean", b)
	}
	switch strings.ToLower(s) {
	case "", "0", "false", "no", "off":
		*f = false
	case "1", "true", "yes", "on":
		*f = true
	default:
		return badValue("boolean", b)
	}
	return nil
}

// timestamp is a time.Time decoded by parseTime (for update_time).
type timestamp time.Time

func (t *timestamp) UnmarshalJSON(b []byte) error {
	v, err := parseTime(b)
	if err != nil {
		return err
	}
	*t = timestamp(v)
	return nil
}
