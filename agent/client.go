// Package agent is proxyd's management agent for the proxy-reselling
// provider's HTTP API: a typed client (one method per endpoint, the raw Call
// they are built on, the error type and sentinels of every documented
// condition, tolerant decoding of the provider's PHP-flavoured JSON, the
// parsers of IP lists and sticky session lists that have no documented
// layout), and the Poller whose loops keep a Snapshot of the served
// services: their IP lists, sticky sessions, network status, usage and the
// account's credit and invoices. ServiceState.Upstreams turns a service into
// dialable upstreams; the Poller can also request fresh IP lists on its own
// ([manage]).
//
// Config, PollConfig and ManageConfig are the [api], [poll] and [manage]
// sections of the configuration file.
//
// The package produces plain data and never imports pool; the daemon wires
// the Snapshot into the pool and the pool's rotation requests into
// Poller.Rotate. The API credential never appears in an error string or a
// log line.
package agent

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// Defaults of Config that are not keys of the file.
const (
	DefaultVersion = "dev"
	DefaultMaxBody = 32 << 20
)

// TokenEnv is the environment variable holding the API token. It wins over
// every credential of the file.
const TokenEnv = "PROXYD_API_TOKEN"

// Config is the [api] section of the configuration file and the options of
// a Client. Start from DefaultConfig: a key present in the file keeps its
// value, and Validate refuses the values that cannot work instead of
// replacing them. Fields without a key (toml:"-") are set by the program.
type Config struct {
	// BaseURL is the API's address without the /api prefix: http or
	// https, no credentials, query or fragment.
	BaseURL string `toml:"base_url"`
	// Token is the dashboard API token, sent verbatim as
	// "Authorization: Basic <Token>". It wins over Login and Password.
	Token string `toml:"token,secret"`
	// TokenFile names a file holding the token; ResolveCredential reads it
	// on every call, which is how a token is rotated by a reload.
	TokenFile string `toml:"token_file"`
	// Login and Password (or PasswordFile), used when no token is set, are
	// sent as "Authorization: Basic base64(login:password)".
	Login        string `toml:"login"`
	Password     string `toml:"password,secret"`
	PasswordFile string `toml:"password_file"`
	// Services are the service IDs to serve; empty means every Active
	// service of the account. The poller is given them in PollConfig.
	Services []int `toml:"services"`
	// Timeout bounds each request, body included; it must be positive.
	Timeout time.Duration `toml:"timeout"`

	// Version goes into "User-Agent: proxyd/<Version>"; empty sends
	// DefaultVersion.
	Version string `toml:"-"`
	// Transport sends the requests; nil means a clone of
	// http.DefaultTransport with Proxy set to nil: environment proxy
	// settings are never used.
	Transport http.RoundTripper `toml:"-"`
	// MaxBody caps a response body in bytes; 0 means DefaultMaxBody. A
	// larger body fails with ErrBodyTooLarge.
	MaxBody int64 `toml:"-"`
	// Observe, if set, is called after each request with the route
	// template, the HTTP status as text ("200") or "error" when no answer
	// came, and the time taken. It may be called concurrently.
	Observe func(route, code string, took time.Duration) `toml:"-"`
	// Logger, if set, receives one debug record per request. It never
	// receives the credential.
	Logger *slog.Logger `toml:"-"`
}

// DefaultConfig returns the [api] section with every key at its default.
// It holds no credential.
func DefaultConfig() Config {
	return Config{
		BaseURL: "https://api.example-provider.net",
		Timeout: 15 * time.Second,
		Version: DefaultVersion,
		MaxBody: DefaultMaxBody,
	}
}

// Validate reports every problem of the section, joined with errors.Join;
// each message starts with the key as written in the file. It does not
// require a credential (one may come from the environment; see
// ResolveCredential and New), and never quotes one.
func (c Config) Validate() error {
	var errs []error
	bad := func(key, format string, args ...any) {
		errs = append(errs, fmt.Errorf(key+": "+format, args...))
	}
	if c.BaseURL == "" {
		bad("base_url", "must be set")
	} else if u, err := url.Parse(c.BaseURL); err != nil {
		bad("base_url", "cannot be parsed as a URL")
	} else {
		switch {
		case u.Scheme != "http" && u.Scheme != "https":
			bad("base_url", "must start with https:// or http://")
		case u.Host == "":
			bad("base_url", "%q: no host", u.Redacted())
		case u.User != nil:
			bad("base_url", "%q: credentials belong in token or login/password, not in the URL", u.Redacted())
		case u.RawQuery != "" || u.Fragment != "":
			bad("base_url", "%q: no query or fragment allowed", u.Redacted())
		}
	}
	if c.Token != "" && !HeaderSafe(c.Token) {
		bad("token", "holds whitespace or control characters")
	}
	if strings.ContainsAny(c.Login, ":\r\n") {
		bad("login", "must not hold a colon or line break")
	}
	if strings.ContainsAny(c.Password, "\r\n") {
		bad("password", "must not hold a line break")
	}
	if c.Password != "" && c.PasswordFile != "" {
		bad("password_file", "set either password or password_file, not both")
	}
	if c.Login != "" && c.Password == "" && c.PasswordFile == "" && c.Token == "" && c.TokenFile == "" {
		bad("login", "is set without a password: set password or password_file")
	}
	for i, id := range c.Services {
		if id <= 0 {
			bad(fmt.Sprintf("services[%d]", i), "service IDs are positive numbers, got %d", id)
		}
	}
	switch {
	case c.Timeout < 0:
		bad("timeout", "must not be negative, got %s", c.Timeout)
	case c.Timeout == 0:
		bad("timeout", "must be more than 0s")
	}
	if c.MaxBody < 0 {
		errs = append(errs, fmt.Errorf("max body %d is negative", c.MaxBody))
	}
	if !HeaderSafe(c.Version) {
		errs = append(errs, fmt.Errorf("version %q holds whitespace or control characters", c.Version))
	}
	return errors.Join(errs...)
}

// Sources of the credential ResolveCredential reports.
const (
	SourceEnv            = TokenEnv                       // the environment variable
	SourceTokenFile      = "token_file"                   // [api] token_file
	SourceToken          = "token"                        // [api] token
	SourceCredentialsDir = "$CREDENTIALS_DIRECTORY/token" // systemd LoadCredential
	SourceLogin          = "login"                        // [api] login with password or password_file
)

// FixedSource reports whether a credential from source is fixed while the
// process runs (the environment, systemd's credentials): a reload cannot
// change it, so a reload that would needs a restart.
func FixedSource(source string) bool {
	return source == SourceEnv || source == SourceCredentialsDir
}

// ResolveCredential returns c with its credential resolved by this
// precedence: the PROXYD_API_TOKEN environment variable, token_file, token,
// a file "token" in $CREDENTIALS_DIRECTORY (systemd's LoadCredential), then
// login with password or password_file (the file wins). The result holds
// either Token or Login and Password, with the file keys cleared; source is
// one of the Source constants. Files are read on every call. getenv is
// os.Getenv outside tests. Errors start with the key at fault and name
// files, never their content.
func (c Config) ResolveCredential(getenv func(string) string) (Config, string, error) {
	tokenOnly := func(tok string) Config {
		c.Token, c.TokenFile, c.Login, c.Password, c.PasswordFile = tok, "", "", "", ""
		return c
	}
	if t := strings.TrimSpace(getenv(TokenEnv)); t != "" {
		if !HeaderSafe(t) {
			// Not "KEY: …": the variable is no key of the file.
			return c, "", fmt.Errorf("the environment's %s holds whitespace or control characters", TokenEnv)
		}
		return tokenOnly(t), SourceEnv, nil
	}
	if c.TokenFile != "" {
		t, err := ReadTokenFile(c.TokenFile)
		if err != nil {
			return c, "", fmt.Errorf("token_file: %w", err)
		}
		return tokenOnly(t), SourceTokenFile, nil
	}
	if c.Token != "" {
		return tokenOnly(c.Token), SourceToken, nil
	}
	if dir := getenv("CREDENTIALS_DIRECTORY"); dir != "" {
		path := filepath.Join(dir, "token")
		if _, err := os.Stat(path); err == nil {
			t, err := ReadTokenFile(path)
			if err != nil {
				return c, "", fmt.Errorf("systemd credential \"token\" (%s): %w", path, err)
			}
			return tokenOnly(t), SourceCredentialsDir, nil
		}
	}
	if c.Login != "" {
		if c.PasswordFile != "" {
			pw, err := ReadSecretFile(c.PasswordFile)
			if err != nil {
				return c, "", fmt.Errorf("password_file: %w", err)
			}
			c.Password = pw
		}
		if c.Password == "" {
			return c, "", errors.New("login: is set without a password: set password or password_file")
		}
		c.Token, c.TokenFile, c.PasswordFile = "", "", ""
		return c, SourceLogin, nil
	}
	return c, "", fmt.Errorf("token: %w: set %s, token_file, token, a systemd credential \"token\", or login with password or password_file",
		ErrNoCredential, TokenEnv)
}

// ErrNoCredential is ResolveCredential's error when nothing gives a
// credential: where the service's environment would (PROXYD_API_TOKEN, a
// systemd credential), another process may see none.
var ErrNoCredential = errors.New("no API credential")

// credentialProblem reports a Config that New cannot authenticate with:
// ResolveCredential's result is expected.
func (c Config) credentialProblem() error {
	if c.Token == "" && c.Login == "" {
		return errors.New("token: no API credential: set a token, or login and password")
	}
	if c.Token == "" && c.Password == "" {
		return errors.New("login: is set without a password")
	}
	return nil
}

// HeaderSafe reports whether s can be sent as a token in an HTTP header
// as it is: no whitespace, no control character (a header value is
// trimmed, so a token with a space at either end could never match).
func HeaderSafe(s string) bool {
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
	tok, err := ReadSecretFile(path)
	if err != nil {
		return "", err
	}
	if !HeaderSafe(tok) {
		return "", fmt.Errorf("reading %s: token holds whitespace or control characters", path)
	}
	return tok, nil
}

// ReadSecretFile reads a one-line secret, trimming surrounding whitespace.
// Its errors name the path, never the content.
func ReadSecretFile(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		var pe *fs.PathError
		if errors.As(err, &pe) {
			return "", fmt.Errorf("reading %s: %w", path, pe.Err)
		}
		return "", fmt.Errorf("reading %s: %w", path, err)
	}
	s := strings.TrimSpace(string(b))
	switch {
	case s == "":
		return "", fmt.Errorf("reading %s: file is empty", path)
	case strings.ContainsAny(s, "\r\n"):
		return "", fmt.Errorf("reading %s: more than one line", path)
	}
	return s, nil
}

// Client calls the provider API. It is safe for concurrent use.
type Client struct {
	base    string   // ProviderURL(BaseURL)
	auth    string   // the whole Authorization header value
	secrets []string // strings scrubbed from bodies before they reach errors
	ua      string
	http    *http.Client
	maxBody int64
	observe func(route, code string, took time.Duration)
	log     *slog.Logger
}

// BaseURL is the provider's base URL the client asks, in ProviderURL's
// spelling.
func (c *Client) BaseURL() string { return c.base }

// ProviderURL spells a base URL one way for each provider, so that two
// spellings of one address compare equal: scheme and host in lower case
// (neither is case-sensitive), no trailing slash. A URL that does not
// parse is returned as given, without trailing slashes.
func ProviderURL(baseURL string) string {
	s := strings.TrimRight(baseURL, "/")
	u, err := url.Parse(s)
	if err != nil {
		return s
	}
	u.Scheme, u.Host = strings.ToLower(u.Scheme), strings.ToLower(u.Host)
	return u.String()
}

// New returns a Client for cfg, or cfg's validation error.
func New(cfg Config) (*Client, error) {
	if err := errors.Join(cfg.Validate(), cfg.credentialProblem()); err != nil {
		return nil, fmt.Errorf("configuring provider API client: %w", err)
	}
	if cfg.Version == "" {
		cfg.Version = DefaultVersion
	}
	if cfg.MaxBody == 0 {
		cfg.MaxBody = DefaultMaxBody
	}
	c := &Client{
		base:    ProviderURL(cfg.BaseURL),
		ua:      "proxyd/" + cfg.Version,
		maxBody: cfg.MaxBody,
		observe: cfg.Observe,
		log:     cfg.Logger,
	}
	if cfg.Token != "" {
		c.auth = "Basic " + cfg.Token
		c.secrets = []string{cfg.Token}
		if raw, err := base64.StdEncoding.DecodeString(cfg.Token); err == nil {
			// A token made of base64(login:password), or of
			// base64(login|password) as some of the provider's clients
			// build it: scrub the password too.
			if i := strings.IndexAny(string(raw), ":|"); i >= 0 {
				if pw := string(raw[i+1:]); len(pw) >= minScrubLen && utf8.ValidString(pw) {
					c.secrets = append(c.secrets, pw)
				}
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
	_, b, err := c.request(ctx, method, route, args, body)
	return b, err
}

// request is Call, with the status of a 2xx answer.
func (c *Client) request(ctx context.Context, method, route string, args []string, body any) (int, []byte, error) {
	start := time.Now()
	path, err := fillRoute(route, args)
	if err != nil {
		return 0, nil, fmt.Errorf("calling %s %s: %w", method, route, err)
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
				return 0, nil, fmt.Errorf("encoding request body of %s %s: %w", method, route, err)
			}
		}
		reqBody = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, reqBody)
	if err != nil {
		return 0, nil, fmt.Errorf("calling %s %s: %w", method, route, err)
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
		return 0, nil, err
	}
	code := strconv.Itoa(status)
	if status < 200 || status > 299 {
		apiErr := decodeError(status, route, respBody)
		apiErr.Method = method
		c.redact(apiErr, respBody)
		if status == http.StatusTooManyRequests && apiErr.NextAllowed.IsZero() {
			apiErr.NextAllowed = retryAfter(header.Get("Retry-After"), time.Now())
		}
		c.done(method, route, code, took, apiErr)
		return 0, nil, apiErr
	}
	c.done(method, route, code, took, nil)
	return status, respBody, nil
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
	return resp.StatusCode, resp.Header, trimBOM(b), nil
}

// trimBOM drops a UTF-8 byte order mark that starts body, which a PHP
// backend may put before any answer (a source file saved with one) and
// JSON decoders refuse.
func trimBOM(body []byte) []byte { return bytes.TrimPrefix(body, []byte("\xef\xbb\xbf")) }

// retryAfter reads a Retry-After header (seconds or an HTTP date) as a UTC
// time; zero if absent or unreadable. The provider's 429 message is
// preferred; this covers a proxy or rate limiter in front of it. The time
// is reported as named, however far: the poll loops and list updates bound
// the wait they take from it.
func retryAfter(v string, now time.Time) time.Time {
	v = strings.TrimSpace(v)
	if v == "" {
		return time.Time{}
	}
	// Up to 2^31-1 seconds, on 32-bit platforms as well; more is unreadable.
	if secs, err := strconv.ParseInt(v, 10, 32); err == nil && secs >= 0 {
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
// echo the Authorization header into an error page. A JSON body may carry
// it with "/" escaped as "\/" (PHP does), which is replaced too.
func (c *Client) scrub(b []byte) []byte {
	for _, s := range c.secrets {
		for _, v := range [...]string{s, strings.ReplaceAll(s, "/", `\/`)} {
			if bytes.Contains(b, []byte(v)) {
				b = bytes.ReplaceAll(b, []byte(v), []byte("[redacted]"))
			}
		}
	}
	return b
}

// redact takes the credentials out of what e shows of raw, the body it
// was read from. The body is read before (a credential's redaction must
// not change what it says: a short password may be part of a key or of
// the provider's message); then the whole message is scrubbed as decoded
// (JSON escapes, such as PHP's "\/" for "/", hid it in the raw body) and
// the whole body as sent, and only then are both cut (cut first, they
// could keep part of a credential that the cut split).
func (c *Client) redact(e *APIError, raw []byte) {
	e.Message = excerpt(c.scrub([]byte(e.full)), maxExcerpt)
	e.Body = excerpt(c.scrub(raw), maxExcerpt)
	e.full = ""
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
			err = fmt.Errorf("%w (provider says %q)", err, excerpt(c.scrub([]byte(msg)), maxExcerpt))
		}
	}
	return &DecodeError{Route: route, Err: c.scrubErr(err)}
}
