// Package agent is proxyd's client of the provider API (PROVIDER_API.md):
// one typed method per endpoint, the raw Call they are built on, the error
// type and sentinels of every documented condition, tolerant decoding of the
// provider's PHP-flavoured JSON, and the parsers of IP lists and sticky
// session lists that have no documented layout.
//
// The package produces plain data. It never imports pool; turning IP lists
// and sessions into upstreams, and the poll loops, live elsewhere. The API
// credential never appears in an error string or a log line.
package agent

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// Defaults of Config.
const (
	DefaultBaseURL = "https://api.example-provider.net"
	DefaultTimeout = 15 * time.Second
	DefaultVersion = "dev"
	DefaultMaxBody = 32 << 20
)

// TokenEnv is the environment variable holding the API token (DESIGN.md §4).
const TokenEnv = "PROXYD_API_TOKEN"

// Config configures a Client. Zero values mean the documented defaults.
type Config struct {
	// BaseURL is the API's address without the /api prefix; default
	// DefaultBaseURL. http or https, no credentials, query or fragment.
	BaseURL string
	// Token is the dashboard API token, sent verbatim as
	// "Authorization: Basic <Token>". It wins over Login and Password.
	Token string
	// Login and Password, used when Token is empty, are sent as
	// "Authorization: Basic base64(login:password)".
	Login    string
	Password string
	// Timeout bounds each request, body included; default 15s.
	Timeout time.Duration
	// Version goes into "User-Agent: proxyd/<Version>"; default "dev".
	Version string
	// Transport sends the requests; nil means a clone of
	// http.DefaultTransport with Proxy set to nil: environment proxy
	// settings are never used.
	Transport http.RoundTripper
	// MaxBody caps a response body in bytes; default 32 MiB. A larger body
	// fails with ErrBodyTooLarge.
	MaxBody int64
	// Observe, if set, is called after each request with the route
	// template, the HTTP status as text ("200") or "error" when no answer
	// came, and the time taken. It may be called concurrently.
	Observe func(route, code string, took time.Duration)
	// Logger, if set, receives one debug record per request. It never
	// receives the credential.
	Logger *slog.Logger
}

func (c Config) withDefaults() Config {
	if c.BaseURL == "" {
		c.BaseURL = DefaultBaseURL
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultTimeout
	}
	if c.Version == "" {
		c.Version = DefaultVersion
	}
	if c.MaxBody == 0 {
		c.MaxBody = DefaultMaxBody
	}
	return c
}

// Validate reports the first problem of the configuration after defaults.
// Its messages never quote the credential.
func (c Config) Validate() error {
	c = c.withDefaults()
	u, err := url.Parse(c.BaseURL)
	if err != nil {
		return fmt.Errorf("parsing base URL: %w", err)
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return fmt.Errorf("base URL %q: scheme must be http or https", u.Redacted())
	case u.Host == "":
		return fmt.Errorf("base URL %q: no host", u.Redacted())
	case u.User != nil:
		return fmt.Errorf("base URL %q: credentials belong in token or login/password, not in the URL", u.Redacted())
	case u.RawQuery != "" || u.Fragment != "":
		return fmt.Errorf("base URL %q: no query or fragment allowed", u.Redacted())
	}
	if c.Token == "" && c.Login == "" {
		return errors.New("no API credential: set a token, or login and password")
	}
	if c.Token == "" && c.Password == "" {
		return errors.New("login is set without a password")
	}
	if c.Token != "" && !headerSafe(c.Token) {
		return errors.New("token holds whitespace or control characters")
	}
	if c.Token == "" && (strings.ContainsAny(c.Login, ":\r\n") || strings.ContainsAny(c.Password, "\r\n")) {
		return errors.New("login must not hold a colon or line break, password no line break")
	}
	if c.Timeout < 0 {
		return fmt.Errorf("timeout %v is negative", c.Timeout)
	}
	if c.MaxBody < 0 {
		return fmt.Errorf("max body %d is negative", c.MaxBody)
	}
	if !headerSafe(c.Version) {
		return fmt.Errorf("version %q holds whitespace or control characters", c.Version)
	}
	return nil
}

func headerSafe(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] <= ' ' || s[i] == 0x7f {
			return false
		}
	}
	return true
}

// ReadTokenFile reads an API token from path, trimming surrounding
// whitespace. Its errors name the path, never the content.
func ReadTokenFile(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("reading token file: %w", err)
	}
	tok := strings.TrimSpace(string(b))
	switch {
	case tok == "":
		return "", fmt.Errorf("reading token file %s: file is empty", path)
	case !headerSafe(tok):
		return "", fmt.Errorf("reading token file %s: token holds whitespace or control characters", path)
	}
	return tok, nil
}

// Client calls the provider API. It is safe for concurrent use.
type Client struct {
	base    string   // BaseURL without a trailing slash
	auth    string   // the whole Authorization header value
	secrets []string // strings scrubbed from bodies before they reach errors
	ua      string
	http    *http.Client
	maxBody int64
	observe func(route, code string, took time.Duration)
	log     *slog.Logger
}

// New returns a Client for cfg, or cfg's validation error.
func New(cfg Config) (*Client, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("configuring provider API client: %w", err)
	}
	cfg = cfg.withDefaults()
	c := &Client{
		base:    strings.TrimRight(cfg.BaseURL, "/"),
		ua:      "proxyd/" + cfg.Version,
		maxBody: cfg.MaxBody,
		observe: cfg.Observe,
		log:     cfg.Logger,
	}
	if cfg.Token != "" {
		c.auth = "Basic " + cfg.Token
		c.secrets = []string{cfg.Token}
		if raw, err := base64.StdEncoding.DecodeString(cfg.Token); err == nil {
			// A token made of base64(login:password): scrub the password too.
			if _, pw, ok := strings.Cut(string(raw), ":"); ok && len(pw) >= minScrubLen && utf8.ValidString(pw) {
				c.secrets = append(c.secrets, pw)
			}
		}
	} else {
		enc := base64.StdEncoding.EncodeToString([]byte(cfg.Login + ":" + cfg.Password))
		c.auth = "Basic " + enc
		c.secrets = []string{enc}
		if len(cfg.Password) >= minScrubLen {
			c.secrets = append(c.secrets, cfg.Password)
		}
	}
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	tr := cfg.Transport
	if tr == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.Proxy = nil
		tr = t
	}
	c.http = &http.Client{
		Transport: tr,
		Timeout:   cfg.Timeout,
		CheckRedirect: func(req *http.Request, via []*http.Request) error {
			// Go drops Authorization on a redirect to another host; the
			// API has no business redirecting at all, so stop early.
			if len(via) >= 3 {
				return errors.New("stopped after 3 redirects")
			}
			return nil
		},
	}
	return c, nil
}

// Call sends one request and returns the body of a 2xx answer. route is a
// template such as "/api/service/{id}" whose {…} placeholders args fill in
// order (path-escaped). body, if not nil, is sent as JSON: a []byte or
// json.RawMessage verbatim, anything else through json.Marshal. A non-2xx
// answer is a *APIError.
func (c *Client) Call(ctx context.Context, method, route string, args []string, body any) ([]byte, error) {
	start := time.Now()
	path, err := fillRoute(route, args)
	if err != nil {
		return nil, fmt.Errorf("calling %s %s: %w", method, route, err)
	}
	var reqBody io.Reader
	if body != nil {
		var b []byte
		switch v := body.(type) {
		case []byte:
			b = v
		case json.RawMessage:
			b = v
		default:
			if b, err = json.Marshal(body); err != nil {
				return nil, fmt.Errorf("encoding request body of %s %s: %w", method, route, err)
			}
		}
		reqBody = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, reqBody)
	if err != nil {
		return nil, fmt.Errorf("calling %s %s: %w", method, route, err)
	}
	req.Header.Set("Authorization", c.auth)
	req.Header.Set("Accept", "application/json")
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", c.ua)

	status, header, respBody, err := c.send(req)
	took := time.Since(start)
	if err != nil {
		err = fmt.Errorf("calling %s %s: %w", method, route, c.scrubErr(err))
		c.done(method, route, "error", took, err)
		return nil, err
	}
	code := strconv.Itoa(status)
	if status < 200 || status > 299 {
		apiErr := decodeError(status, route, c.scrub(respBody))
		apiErr.Method = method
		if status == http.StatusTooManyRequests && apiErr.NextAllowed.IsZero() {
			apiErr.NextAllowed = retryAfter(header.Get("Retry-After"), time.Now())
		}
		c.done(method, route, code, took, apiErr)
		return nil, apiErr
	}
	c.done(method, route, code, took, nil)
	return respBody, nil
}

func (c *Client) send(req *http.Request) (int, http.Header, []byte, error) {
	resp, err := c.http.Do(req)
	if err != nil {
		return 0, nil, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, c.maxBody+1))
	if err != nil {
		return 0, nil, nil, fmt.Errorf("reading response body: %w", err)
	}
	if int64(len(b)) > c.maxBody {
		return 0, nil, nil, fmt.Errorf("%w (%d bytes)", ErrBodyTooLarge, c.maxBody)
	}
	return resp.StatusCode, resp.Header, b, nil
}

// retryAfter reads a Retry-After header (seconds or an HTTP date) as a UTC
// time; zero if absent or unreadable. The provider's 429 message is
// preferred; this covers a proxy or rate limiter in front of it.
func retryAfter(v string, now time.Time) time.Time {
	v = strings.TrimSpace(v)
	if v == "" {
		return time.Time{}
	}
	if secs, err := strconv.Atoi(v); err == nil && secs >= 0 && secs < 1<<31 {
		return now.Add(time.Duration(secs) * time.Second).UTC()
	}
	if t, err := http.ParseTime(v); err == nil {
		return t.UTC()
	}
	return time.Time{}
}

func (c *Client) done(method, route, code string, took time.Duration, err error) {
	if c.observe != nil {
		c.observe(route, code, took)
	}
	if err != nil {
		c.log.Debug("provider request", "method", method, "route", route, "code", code, "took", took, "err", err.Error())
		return
	}
	c.log.Debug("provider request", "method", method, "route", route, "code", code, "took", took)
}

// minScrubLen is the shortest password scrubbed from bodies: replacing a
// two-letter password everywhere would garble messages without protecting it.
const minScrubLen = 4

// scrub replaces the credential in b: a misbehaving server or proxy might
// echo the Authorization header into an error page.
func (c *Client) scrub(b []byte) []byte {
	for _, s := range c.secrets {
		if bytes.Contains(b, []byte(s)) {
			b = bytes.ReplaceAll(b, []byte(s), []byte("[redacted]"))
		}
	}
	return b
}

func (c *Client) scrubErr(err error) error {
	msg := err.Error()
	for _, s := range c.secrets {
		if strings.Contains(msg, s) {
			return &scrubbedError{msg: string(c.scrub([]byte(msg))), err: err}
		}
	}
	return err
}

// scrubbedError keeps the wrapped chain (errors.Is(err, context.Canceled))
// while its message lacks the credential.
type scrubbedError struct {
	msg string
	err error
}

func (e *scrubbedError) Error() string { return e.msg }
func (e *scrubbedError) Unwrap() error { return e.err }

// fillRoute substitutes args, path-escaped, into route's placeholders. Its
// errors name placeholders, never argument values.
func fillRoute(route string, args []string) (string, error) {
	var b strings.Builder
	n := 0
	rest := route
	for {
		i := strings.IndexByte(rest, '{')
		if i < 0 {
			b.WriteString(rest)
			break
		}
		j := strings.IndexByte(rest[i:], '}')
		if j < 0 {
			return "", errors.New("unterminated placeholder in route")
		}
		if n >= len(args) {
			return "", fmt.Errorf("route has more placeholders than the %d arguments given", len(args))
		}
		if args[n] == "" {
			return "", fmt.Errorf("argument %s is empty", rest[i:i+j+1])
		}
		b.WriteString(rest[:i])
		b.WriteString(url.PathEscape(args[n]))
		n++
		rest = rest[i+j+1:]
	}
	if n != len(args) {
		return "", fmt.Errorf("route has %d placeholders but %d arguments were given", n, len(args))
	}
	if !strings.HasPrefix(route, "/") {
		return "", errors.New("route must start with /")
	}
	return b.String(), nil
}

// decodeError wraps a decoding failure of route's answer. A 2xx body that
// carries the provider's {"error": ...} adds that message. The text may
// quote part of the body, so it is scrubbed like error bodies are.
func (c *Client) decodeError(route string, body []byte, err error) error {
	if t := bytes.TrimSpace(body); len(t) > 0 && t[0] == '{' {
		if msg := errorMessage(t); msg != "" {
			err = fmt.Errorf("%w (provider says %q)", err, msg)
		}
	}
	return &DecodeError{Route: route, Err: c.scrubErr(err)}
}
