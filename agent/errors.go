package agent

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

// Sentinels for every error condition the provider documents (its
// authentication and application errors). A *APIError matches them with errors.Is; every 422 answer
// also matches ErrUnprocessable.
var (
	ErrUnauthenticated          = errors.New("unauthenticated")                              // 401 "Unauthenticated"
	ErrInvalidAuthHeader        = errors.New("invalid Authorization header")                 // 400 "Invalid Authorization header"
	ErrInvalidCredentialsFormat = errors.New("invalid credentials format")                   // 400 "Invalid credentials format"
	ErrProductNotFound          = errors.New("product not found")                            // 422 "... or product ID not found"
	ErrClientNotFound           = errors.New("client not found")                             // 422 and 400 "... ClientID not found"
	ErrNotEnoughFunds           = errors.New("not enough funds")                             // 422 "... not enough funds to order"
	ErrIncorrectPostedData      = errors.New("incorrect posted data")                        // 422 "... Incorrect posted data"
	ErrInvalidIPv4              = errors.New("invalid IPv4 address")                         // 422 "... Invalid IPv4 format"
	ErrIPAlreadyBound           = errors.New("IP already bound")                             // 422 "... IP already binded"
	ErrTooManyAttempts          = errors.New("too many attempts")                            // any 429 ("Too Many Attempts (updateList). Next update possible: ..."), or that message in a 2xx refusal
	ErrUnprocessable            = errors.New("unprocessable entity")                         // any 422
	ErrBodyTooLarge             = errors.New("response body exceeds the configured maximum") // Config.MaxBody
	// ErrListRefused: a 2xx answer whose list is empty beside the
	// provider's error message ({"data": [], "error": "..."}): not an
	// empty list, the provider's refusal to give one.
	ErrListRefused = errors.New("the provider's error beside an empty list")
)

// maxExcerpt bounds APIError.Body and APIError.Message.
const maxExcerpt = 256

// APIError is an answer of the provider that reports a failure: a non-2xx
// one, or a 2xx answer to a call that changes the account whose body is
// the provider's error object (refusal).
type APIError struct {
	Status      int       // HTTP status; 2xx for a refusal
	Method      string    // request method, when known
	Route       string    // route template, e.g. "/api/service/{id}"
	Message     string    // the provider's message, trimmed ("error" of a JSON body, or a one-line text body); one line for a refusal
	Body        string    // excerpt of the response body: at most 256 bytes, valid UTF-8, "..." when cut
	NextAllowed time.Time // rate limited: when the next call is allowed (UTC), as the message or Retry-After names it; zero if not given

	kind error  // the specific sentinel, nil if none
	full string // Message before its cut, until the client redacts it
}

// Error describes the answer without the request's credentials.
func (e *APIError) Error() string {
	var b strings.Builder
	b.WriteString("provider answered ")
	b.WriteString(strconv.Itoa(e.Status))
	if e.Route != "" {
		b.WriteString(" on ")
		if e.Method != "" {
			b.WriteString(e.Method)
			b.WriteByte(' ')
		}
		b.WriteString(e.Route)
	}
	switch {
	case e.Message != "":
		b.WriteString(": ")
		b.WriteString(e.Message)
	case e.Body != "":
		b.WriteString(": unexpected body ")
		b.WriteString(strconv.Quote(e.Body))
	default:
		b.WriteString(": empty body")
	}
	return b.String()
}

// Is reports whether target is the sentinel of this answer's condition.
func (e *APIError) Is(target error) bool {
	if target == nil {
		return false
	}
	if target == ErrUnprocessable && e.Status == 422 {
		return true
	}
	return e.kind != nil && target == e.kind
}

// RateLimited reports whether the provider refused the call for coming too
// soon: a 429, or its "Too Many Attempts" message in a 2xx refusal. The
// pool counts a rotation that fails so as "rate_limited" through this
// method, and the poll loops and list updates wait for the time it names
// (NextAllowed).
func (e *APIError) RateLimited() bool {
	return e.Status == http.StatusTooManyRequests || e.kind == ErrTooManyAttempts
}

// isTooManyAttempts reports whether msg is the provider's rate-limit
// message, "Too Many Attempts (updateList). Next update possible: ...":
// it starts so (case and spacing aside). "Too many attempts to log in"
// would match too, but the provider documents no such message; one that
// merely mentions attempts ("Login failed: too many attempts") does not.
func isTooManyAttempts(msg string) bool {
	return strings.HasPrefix(strings.ToLower(strings.Join(strings.Fields(msg), " ")), "too many attempts")
}

// nextUpdateRe finds the timestamp of the 429 message.
var nextUpdateRe = regexp.MustCompile(`(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})`)

// decodeError builds the APIError of a non-2xx answer. It never fails: a body
// it cannot read as the provider's JSON or text form is kept as an excerpt.
func decodeError(status int, route string, body []byte) *APIError {
	return newAPIError(status, route, body, errorMessage(body))
}

// refusal returns the APIError of a 2xx answer to a call that changes the
// account when its body is the provider's error object, and nil for any
// other body. The provider's errors are {"error": "..."} objects, normally
// with a 4xx; one that comes with a 2xx still says the change was not
// made. actions are the keys of an answer given per action (the service
// update's {"update_list": {"success": "..."}}): an action's own
// {"error": "..."} refuses the call too, and the message names the
// action. A body that is no JSON object is a success, and so is an object
// whose "error" is blank, a word for "no error" ("0", "false", "none",
// ...), or stands beside a "success" key that does not say no: the
// success bodies of the sticky calls are not public, and a success that
// also carries such a field must not be taken for a refusal.
func refusal(status int, route string, body []byte, actions ...string) *APIError {
	obj, ok := jsonObject(body)
	if !ok {
		return nil
	}
	msg := refusedIn(obj)
	bare := msg // without the action's name
	for i := 0; msg == "" && i < len(actions); i++ {
		raw, _ := lookupFold(obj, actions[i])
		if inner, ok := jsonObject(raw); ok {
			if bare = refusedIn(inner); bare != "" {
				msg = actions[i] + ": " + bare
			}
		}
	}
	if msg == "" {
		return nil
	}
	e := newAPIError(status, route, body, msg)
	if e.kind == nil && isTooManyAttempts(bare) {
		// The provider's rate limit said with a 2xx is still its rate
		// limit, with the time it names.
		e.kind, e.NextAllowed = ErrTooManyAttempts, nextAllowed(msg)
	}
	return e
}

// refusedIn is the one-line "error" message of obj when obj is a refusal
// (see refusal), else "". A "success" that says no (false, 0, "false",
// "no") makes a refusal, with the error message or, without one, that
// word.
func refusedIn(obj map[string]json.RawMessage) string {
	msg := oneLine(stringField(obj, "error"))
	if noError(msg) {
		msg = ""
	}
	if raw, ok := lookupFold(obj, "success"); ok {
		var word string
		if json.Unmarshal(raw, &word) != nil {
			word = string(bytes.TrimSpace(raw))
		}
		switch strings.ToLower(strings.TrimSpace(word)) {
		case "false", "0", "no":
			return cmp.Or(msg, "success: "+word)
		}
		return ""
	}
	return msg
}

// noError reports whether an "error" field's text says there is none.
func noError(msg string) bool {
	switch strings.ToLower(strings.TrimSpace(msg)) {
	case "", "0", "false", "no", "none", "null", "ok", "n/a":
		return true
	}
	return false
}

// newAPIError builds the APIError of an answer with status and body, and
// the provider's message msg found in it.
func newAPIError(status int, route string, body []byte, msg string) *APIError {
	e := &APIError{Status: status, Route: route, Body: excerpt(body, maxExcerpt), Message: excerpt([]byte(msg), maxExcerpt), full: msg}
	e.kind = classify(status, msg)
	if status == 429 {
		e.NextAllowed = nextAllowed(msg)
	}
	return e
}

// nextAllowed is the time a rate-limit message names as the next allowed
// update (UTC); zero if it names none.
func nextAllowed(msg string) time.Time {
	if m := nextUpdateRe.FindStringSubmatch(msg); m != nil {
		if t, err := time.ParseInLocation("2006-01-02 15:04:05", m[1]+" "+m[2], time.UTC); err == nil {
			return t
		}
	}
	return time.Time{}
}

// errorMessage extracts the provider's message: the "error" (or "message")
// string of a JSON object, or a short one-line text body. Both are trimmed,
// since some provider messages end in a space.
func errorMessage(body []byte) string {
	trimmed := bytes.TrimSpace(body)
	if len(trimmed) == 0 {
		return ""
	}
	if obj, ok := jsonObject(trimmed); ok {
		return stringField(obj, "error", "message", "errors")
	}
	if trimmed[0] == '<' || bytes.ContainsAny(trimmed, "\r\n") || len(trimmed) > maxExcerpt || !utf8.Valid(trimmed) {
		return "" // an HTML page or a dump: shown as Body only
	}
	if trimmed[0] == '"' { // a bare JSON string
		var s string
		if json.Unmarshal(trimmed, &s) == nil {
			return strings.TrimSpace(s)
		}
	}
	return string(trimmed)
}

// jsonObject decodes body as a JSON object; ok is false for anything else.
func jsonObject(body []byte) (obj map[string]json.RawMessage, ok bool) {
	body = bytes.TrimSpace(body)
	if len(body) == 0 || body[0] != '{' || json.Unmarshal(body, &obj) != nil {
		return nil, false
	}
	return obj, true
}

// stringField returns the first non-blank string value of obj under one
// of keys (matched as lookupFold does), trimmed; "" if none. It is not cut:
// an APIError cuts its message once it is redacted (newAPIError, redact).
func stringField(obj map[string]json.RawMessage, keys ...string) string {
	for _, key := range keys {
		raw, ok := lookupFold(obj, key)
		if !ok {
			continue
		}
		var s string
		if json.Unmarshal(raw, &s) == nil && strings.TrimSpace(s) != "" {
			return strings.TrimSpace(s)
		}
	}
	return ""
}

// oneLine makes the message of a refusal fit one line of a log or an
// error: each run of characters that are not printable (line breaks,
// tabs, escapes) becomes one space, and the ends are trimmed. The
// messages of non-2xx answers keep their line breaks, which callers may
// render their own way (proxyd api joins them with "; ").
func oneLine(s string) string {
	var b strings.Builder
	gap := false
	for _, r := range s {
		if !unicode.IsGraphic(r) {
			gap = true
			continue
		}
		if gap {
			b.WriteByte(' ')
			gap = false
		}
		b.WriteRune(r)
	}
	return strings.TrimSpace(b.String())
}

// classify maps status and message to the specific sentinel. Messages are
// matched loosely (case, spacing, the documented "binded") so that small
// wording changes of the provider keep the class.
func classify(status int, msg string) error {
	m := strings.ToLower(strings.Join(strings.Fields(msg), " "))
	switch status {
	case 401:
		return ErrUnauthenticated
	case 429:
		return ErrTooManyAttempts
	}
	switch {
	case strings.Contains(m, "invalid authorization header"):
		return ErrInvalidAuthHeader
	case strings.Contains(m, "invalid credentials format"):
		return ErrInvalidCredentialsFormat
	case strings.Contains(m, "clientid not found") || strings.Contains(m, "client id not found") || strings.Contains(m, "client not found"):
		return ErrClientNotFound
	case status != 422:
		return nil
	case strings.Contains(m, "product id not found") || strings.Contains(m, "product not found"):
		return ErrProductNotFound
	case strings.Contains(m, "not enough funds") || strings.Contains(m, "insufficient"):
		return ErrNotEnoughFunds
	case strings.Contains(m, "incorrect posted data"):
		return ErrIncorrectPostedData
	case strings.Contains(m, "invalid ipv4"):
		return ErrInvalidIPv4
	case strings.Contains(m, "already binded") || strings.Contains(m, "already bound"):
		return ErrIPAlreadyBound
	}
	return nil
}

// excerpt returns at most max bytes of b as valid UTF-8 (invalid bytes
// become '?'); a cut body ends in "...", counted in max.
func excerpt(b []byte, max int) string {
	cut := false
	if len(b) > max {
		b = b[:max-3]
		// Drop a rune split by the cut rather than show a replacement for it.
		for i := 0; i < utf8.UTFMax-1 && len(b) > 0 && !utf8.FullRune(b[lastRuneStart(b):]); i++ {
			b = b[:lastRuneStart(b)]
		}
		cut = true
	}
	s := strings.ToValidUTF8(string(b), "?")
	if cut {
		s += "..."
	}
	return s
}

// lastRuneStart returns the index where the last (possibly partial) rune of b starts.
func lastRuneStart(b []byte) int {
	i := len(b) - 1
	for i > 0 && len(b)-i < utf8.UTFMax && !utf8.RuneStart(b[i]) {
		i--
	}
	return i
}

// DecodeError is returned when a 2xx body cannot be decoded into the
// endpoint's type. Its message names the route and never quotes credentials.
type DecodeError struct {
	Route string
	Err   error
}

func (e *DecodeError) Error() string { return fmt.Sprintf("decoding answer of %s: %v", e.Route, e.Err) }
func (e *DecodeError) Unwrap() error { return e.Err }
