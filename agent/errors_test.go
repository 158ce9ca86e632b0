package agent

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

var allSentinels = []error{
	ErrUnauthenticated, ErrInvalidAuthHeader, ErrInvalidCredentialsFormat, ErrProductNotFound,
	ErrClientNotFound, ErrNotEnoughFunds, ErrIncorrectPostedData, ErrInvalidIPv4, ErrIPAlreadyBound,
	ErrTooManyAttempts, ErrUnprocessable,
}

// specErrors is the provider's table of authentication and application
// errors, with the
// trailing-space variants the provider sends.
var specErrors = []struct {
	name        string
	status      int
	contentType string
	body        string
	route       string
	want        []error // sentinels that must match; every other must not
	message     string
}{
	{"401 unauthenticated", 401, "text/plain", "Unauthenticated", RouteClients, []error{ErrUnauthenticated}, "Unauthenticated"},
	{"400 invalid header", 400, "text/plain", "Invalid Authorization header", RouteServices, []error{ErrInvalidAuthHeader}, "Invalid Authorization header"},
	{"400 invalid credentials", 400, "text/plain", "Invalid credentials format", RouteServices, []error{ErrInvalidCredentialsFormat}, "Invalid credentials format"},
	{"422 general", 422, "application/json", `{"error":"Unprocessable Entity"}`, RouteStats, []error{ErrUnprocessable}, "Unprocessable Entity"},
	{"422 general trailing space", 422, "application/json", `{"error":"Unprocessable Entity "}`, RouteIPList, []error{ErrUnprocessable}, "Unprocessable Entity"},
	{"422 product not found", 422, "application/json", `{"error":"Unprocessable Entity or product ID not found"}`, RouteProduct, []error{ErrProductNotFound, ErrUnprocessable}, "Unprocessable Entity or product ID not found"},
	{"422 not enough funds", 422, "application/json", `{"error":"Unprocessed entity or not enough funds to order"}`, RouteProduct, []error{ErrNotEnoughFunds, ErrUnprocessable}, "Unprocessed entity or not enough funds to order"},
	{"422 incorrect posted data", 422, "application/json", `{"error":"Unprocessable Entity. Incorrect posted data"}`, RouteService, []error{ErrIncorrectPostedData, ErrUnprocessable}, "Unprocessable Entity. Incorrect posted data"},
	{"422 incorrect posted data trailing space", 422, "application/json", `{"error":"Unprocessable Entity . Incorrect posted data "}`, RouteProduct, []error{ErrIncorrectPostedData, ErrUnprocessable}, "Unprocessable Entity . Incorrect posted data"},
	{"422 client not found", 422, "application/json", `{"error":"Unprocessable Entity. ClientID not found"}`, RouteProduct, []error{ErrClientNotFound, ErrUnprocessable}, "Unprocessable Entity. ClientID not found"},
	{"422 invalid ipv4", 422, "application/json", `{"error":"Unprocessable Entity. Invalid IPv4 format"}`, RouteService, []error{ErrInvalidIPv4, ErrUnprocessable}, "Unprocessable Entity. Invalid IPv4 format"},
	{"422 ip already binded", 422, "application/json", `{"error":"Unprocessable Entity. IP already binded"}`, RouteService, []error{ErrIPAlreadyBound, ErrUnprocessable}, "Unprocessable Entity. IP already binded"},
	{"400 client not found json", 400, "application/json", `{"error":"Unprocessable Entity. ClientID not found"}`, RouteNetworkErrors, []error{ErrClientNotFound}, "Unprocessable Entity. ClientID not found"},
	{"400 client not found trailing space", 400, "application/json", `{"error":"Unprocessable Entity . ClientID not found "}`, RouteNetworkInactive, []error{ErrClientNotFound}, "Unprocessable Entity . ClientID not found"},
	{"429 too many attempts", 429, "application/json", `{"error":"Too Many Attempts (updateList). Next update possible: 2026-11-21 11:40:05"}`, RouteService, []error{ErrTooManyAttempts}, "Too Many Attempts (updateList). Next update possible: 2026-11-21 11:40:05"},
	{"422 sticky descriptive", 422, "application/json", `{"error":"Sticky sessions are not available for this service"}`, RouteStickyList, []error{ErrUnprocessable}, "Sticky sessions are not available for this service"},
}

func TestSpecErrorTable(t *testing.T) {
	for _, tc := range specErrors {
		t.Run(tc.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", tc.contentType)
				w.WriteHeader(tc.status)
				w.Write([]byte(tc.body))
			}))
			defer srv.Close()
			c := newTestClient(t, srv.URL)
			args := make([]string, strings.Count(tc.route, "{"))
			for i := range args {
				args[i] = "1"
			}
			_, err := c.Call(context.Background(), http.MethodGet, tc.route, args, nil)
			var apiErr *APIError
			if !errors.As(err, &apiErr) {
				t.Fatalf("err = %v (%T), want *APIError", err, err)
			}
			if apiErr.Status != tc.status || apiErr.Route != tc.route || apiErr.Message != tc.message {
				t.Errorf("got status %d route %q message %q; want %d %q %q", apiErr.Status, apiErr.Route, apiErr.Message, tc.status, tc.route, tc.message)
			}
			for _, s := range allSentinels {
				want := false
				for _, w := range tc.want {
					want = want || w == s
				}
				if got := errors.Is(err, s); got != want {
					t.Errorf("errors.Is(err, %v) = %v, want %v", s, got, want)
				}
			}
			if !strings.Contains(err.Error(), tc.message) || !strings.Contains(err.Error(), tc.route) {
				t.Errorf("Error() = %q, want the message and the route", err)
			}
		})
	}
}

func TestTooManyAttemptsNextAllowed(t *testing.T) {
	e := decodeError(429, RouteService, []byte(`{"error":"Too Many Attempts (updateList). Next update possible: 2026-11-21 11:40:05 "}`))
	want := time.Date(2026, 11, 21, 11, 40, 5, 0, time.UTC)
	if !e.NextAllowed.Equal(want) || e.NextAllowed.Location() != time.UTC {
		t.Errorf("NextAllowed = %v, want %v", e.NextAllowed, want)
	}
	e = decodeError(429, RouteService, []byte(`{"error":"Too Many Attempts"}`))
	if !e.NextAllowed.IsZero() || !errors.Is(e, ErrTooManyAttempts) {
		t.Errorf("without a time: NextAllowed %v, Is %v", e.NextAllowed, errors.Is(e, ErrTooManyAttempts))
	}
}

// The rate limit is a 429 whatever its body, or the provider's message in
// a 2xx refusal; the same message with another error status is that
// status's error.
func TestRateLimited(t *testing.T) {
	named := time.Date(2026, 11, 21, 11, 40, 5, 0, time.UTC)
	for _, tc := range []struct {
		name string
		e    *APIError
		want bool
		next time.Time
	}{
		{"429", decodeError(429, RouteService, []byte(`{"error":"Too Many Attempts (updateList). Next update possible: 2026-11-21 11:40:05"}`)), true, named},
		{"429 other body", decodeError(429, RouteStickyRotate, []byte(`slow down`)), true, time.Time{}},
		{"200 refusal of the action", refusal(200, RouteService, []byte(`{"update_list":{"error":"Too Many Attempts (updateList). Next update possible: 2026-11-21 11:40:05"}}`), "update_list"), true, named},
		{"200 refusal at the top", refusal(200, RouteStickyRotate, []byte(`{"error":"too many  attempts"}`)), true, time.Time{}},
		{"200 refusal for another reason", refusal(200, RouteStickyRotate, []byte(`{"error":"Session expired"}`)), false, time.Time{}},
		{"503 with the message", decodeError(503, RouteService, []byte(`{"error":"Too Many Attempts"}`)), false, time.Time{}},
		{"200 refusal that mentions attempts", refusal(200, RouteStickyRotate, []byte(`{"error":"Login failed: too many attempts"}`)), false, time.Time{}},
	} {
		if tc.e == nil {
			t.Fatalf("%s: no error", tc.name)
		}
		if got := tc.e.RateLimited(); got != tc.want || errors.Is(tc.e, ErrTooManyAttempts) != tc.want {
			t.Errorf("%s: RateLimited %v, Is(ErrTooManyAttempts) %v; want %v", tc.name, got, errors.Is(tc.e, ErrTooManyAttempts), tc.want)
		}
		if !tc.e.NextAllowed.Equal(tc.next) {
			t.Errorf("%s: NextAllowed %v, want %v", tc.name, tc.e.NextAllowed, tc.next)
		}
	}
}

func TestUnknownStatusAndNonJSONBodies(t *testing.T) {
	html := "<html><head><title>502 Bad Gateway</title></head><body>" + strings.Repeat("nginx ", 200) + "</body></html>"
	for _, tc := range []struct {
		status  int
		body    string
		message string
	}{
		{502, html, ""},
		{500, "", ""},
		{503, "upstream connect error\nor disconnect", ""},
		{500, `{"error":"Server Error"}`, "Server Error"},
		{418, "I'm a teapot", "I'm a teapot"},
		{404, `{"message":"Not Found"}`, "Not Found"},
		{400, `{"message":"bad thing\nsecond line "}`, "bad thing\nsecond line"}, // callers render the break (proxyd api: "; ")
		{500, "\xff\xfe\x00binary", "\ufffd"},
	} {
		e := decodeError(tc.status, RouteServices, []byte(tc.body))
		msg := e.Error()
		if !strings.Contains(msg, RouteServices) || !strings.Contains(msg, itoa(tc.status)) {
			t.Errorf("%d %.20q: Error() = %q lacks status or route", tc.status, tc.body, msg)
		}
		if len(e.Body) > maxExcerpt || !utf8.ValidString(e.Body) || !utf8.ValidString(msg) {
			t.Errorf("%d: Body excerpt %d bytes, valid %v", tc.status, len(e.Body), utf8.ValidString(e.Body))
		}
		if tc.message != "\ufffd" && e.Message != tc.message {
			t.Errorf("%d %.20q: Message = %q, want %q", tc.status, tc.body, e.Message, tc.message)
		}
		for _, s := range allSentinels {
			if errors.Is(e, s) {
				t.Errorf("%d: matches %v", tc.status, s)
			}
		}
	}
	e := decodeError(502, RouteServices, []byte(html))
	if !strings.HasPrefix(e.Body, "<html><head><title>502 Bad Gateway") || !strings.HasSuffix(e.Body, "...") {
		t.Errorf("Body = %q, want the start of the page cut with ...", e.Body)
	}
}

func TestExcerptCutsAtRuneBoundary(t *testing.T) {
	s := strings.Repeat("é", 300) // 2 bytes each
	got := excerpt([]byte(s), 256)
	if len(got) > 256 || !utf8.ValidString(got) || strings.Contains(got, "?") {
		t.Errorf("excerpt = %d bytes %q", len(got), got)
	}
	if got := excerpt([]byte("short"), 256); got != "short" {
		t.Errorf("excerpt(short) = %q", got)
	}
}

func TestRetryAfter(t *testing.T) {
	now := time.Date(2026, 11, 21, 10, 0, 0, 0, time.UTC)
	for in, want := range map[string]time.Time{
		"120":                           now.Add(2 * time.Minute),
		"Sat, 21 Nov 2026 10:05:00 GMT": now.Add(5 * time.Minute),
		"":                              {},
		"soon":                          {},
		"-5":                            {},
		"2147483647":                    now.Add(2147483647 * time.Second),
		"2147483648":                    {},
	} {
		if got := retryAfter(in, now); !got.Equal(want) {
			t.Errorf("retryAfter(%q) = %v, want %v", in, got, want)
		}
	}
	// Through the client: a bare 429 with Retry-After.
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Retry-After", "60")
		w.WriteHeader(429)
		w.Write([]byte("Too Many Requests"))
	}))
	defer srv.Close()
	start := time.Now()
	_, err := newTestClient(t, srv.URL).UpdateService(context.Background(), 101, ServiceUpdate{UpdateList: true})
	var apiErr *APIError
	if !errors.Is(err, ErrTooManyAttempts) || !errors.As(err, &apiErr) || apiErr.NextAllowed.Before(start.Add(59*time.Second)) || apiErr.NextAllowed.After(time.Now().Add(61*time.Second)) {
		t.Errorf("429 with Retry-After: %v, NextAllowed %v", err, apiErr.NextAllowed)
	}
}
