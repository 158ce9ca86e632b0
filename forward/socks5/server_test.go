package socks5

import (
	"bytes"
	"errors"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
)

// serve writes input to a real loopback connection (then half-closes it),
// runs ReadRequest on the other end and returns its result, what it wrote
// back, and whatever of input ReadRequest left unread.
func serve(t *testing.T, input []byte, cfg ServerConfig) (req *Request, err error, output, rest []byte) {
	t.Helper()
	client, server := loopbackPair(t)
	outc := make(chan []byte, 1)
	goOwned(t, func() {
		client.Write(input)
		client.(*net.TCPConn).CloseWrite()
		outc <- readAllUntilEOF(client)
	})
	req, err = ReadRequest(server, cfg)
	server.(*net.TCPConn).CloseWrite()
	rest = readAllUntilEOF(server)
	return req, err, <-outc, rest
}

func cat(parts ...[]byte) []byte { return bytes.Join(parts, nil) }

func domainReq(cmd byte, name string, port uint16) []byte {
	return cat([]byte{5, cmd, 0, AtypDomain, byte(len(name))}, []byte(name), []byte{byte(port >> 8), byte(port)})
}

var (
	greetNoAuth = []byte{5, 1, MethodNoAuth}
	greetBoth   = []byte{5, 2, MethodNoAuth, MethodUserPass}
	reqIPv4     = []byte{5, CmdConnect, 0, AtypIPv4, 192, 0, 2, 1, 0, 80}
	reqIPv6     = []byte{5, CmdConnect, 0, AtypIPv6, 0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0x01, 0xbb}
)

func userPass(u, p string) []byte {
	return cat([]byte{1, byte(len(u))}, []byte(u), []byte{byte(len(p))}, []byte(p))
}

func TestReadRequest(t *testing.T) {
	checkPass := ServerConfig{RequireAuth: true, Authenticate: func(u, p string) bool { return u == "alice" && p == "s3cret" }}
	long := strings.Repeat("a", 63) + "." + strings.Repeat("b", 63) + "." + strings.Repeat("c", 63) + "." + strings.Repeat("d", 63)
	cases := []struct {
		name      string
		cfg       ServerConfig
		input     []byte
		want      *Request // nil: no request expected
		wantErr   error    // sentinel, or nil
		wantReply byte     // RequestError.Reply when non-zero
		wantOut   []byte
	}{
		{name: "ipv4 no-auth", input: cat(greetNoAuth, reqIPv4),
			want: &Request{Command: CmdConnect, Dest: Addr{"192.0.2.1", 80}, Method: MethodNoAuth}, wantOut: []byte{5, 0}},
		{name: "ipv6 no-auth", input: cat(greetNoAuth, reqIPv6),
			want: &Request{Command: CmdConnect, Dest: Addr{"2001:db8::1", 443}, Method: MethodNoAuth}, wantOut: []byte{5, 0}},
		{name: "ipv4-mapped ipv6 kept as sent", input: cat(greetNoAuth, []byte{5, 1, 0, AtypIPv6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1, 0, 80}),
			want: &Request{Command: CmdConnect, Dest: Addr{"::ffff:127.0.0.1", 80}, Method: MethodNoAuth}, wantOut: []byte{5, 0}},
		{name: "domain no-auth", input: cat(greetNoAuth, domainReq(CmdConnect, "only-upstream.invalid", 8080)),
			want: &Request{Command: CmdConnect, Dest: Addr{"only-upstream.invalid", 8080}, Method: MethodNoAuth}, wantOut: []byte{5, 0}},
		{name: "domain of 255 bytes", input: cat(greetNoAuth, domainReq(CmdConnect, long, 1)),
			want: &Request{Command: CmdConnect, Dest: Addr{long, 1}, Method: MethodNoAuth}, wantOut: []byte{5, 0}},
		{name: "user/pass selected when offered and optional", input: cat(greetBoth, userPass("session-k1", "x"), reqIPv4),
			want:    &Request{Command: CmdConnect, Dest: Addr{"192.0.2.1", 80}, Username: "session-k1", Password: "x", Method: MethodUserPass},
			wantOut: []byte{5, 2, 1, 0}},
		{name: "empty username and password", input: cat(greetBoth, userPass("", ""), reqIPv4),
			want:    &Request{Command: CmdConnect, Dest: Addr{"192.0.2.1", 80}, Method: MethodUserPass},
			wantOut: []byte{5, 2, 1, 0}},
		{name: "user/pass checked", cfg: checkPass, input: cat([]byte{5, 1, 2}, userPass("alice", "s3cret"), reqIPv6),
			want:    &Request{Command: CmdConnect, Dest: Addr{"2001:db8::1", 443}, Username: "alice", Password: "s3cret", Method: MethodUserPass},
			wantOut: []byte{5, 2, 1, 0}},
		{name: "wrong password", cfg: checkPass, input: cat(greetBoth, userPass("alice", "guess"), reqIPv4),
			wantErr: ErrAuthFailed, wantOut: []byte{5, 2, 1, 1}},
		{name: "auth required, not offered", cfg: checkPass, input: cat(greetNoAuth, reqIPv4),
			wantErr: ErrNoAcceptableMethod, wantOut: []byte{5, 0xff}},
		{name: "no methods", input: []byte{5, 0},
			wantErr: ErrNoAcceptableMethod, wantOut: []byte{5, 0xff}},
		{name: "only gssapi", input: []byte{5, 1, 1},
			wantErr: ErrNoAcceptableMethod, wantOut: []byte{5, 0xff}},
		{name: "bind", input: cat(greetNoAuth, []byte{5, CmdBind, 0, AtypIPv4, 192, 0, 2, 1, 0, 80}),
			want: &Request{Command: CmdBind, Dest: Addr{"192.0.2.1", 80}, Method: MethodNoAuth}, wantReply: ReplyCommandNotSupported, wantOut: []byte{5, 0}},
		{name: "udp associate", input: cat(greetNoAuth, []byte{5, CmdUDPAssociate, 0, AtypIPv4, 0, 0, 0, 0, 0, 0}),
			want: &Request{Command: CmdUDPAssociate, Dest: Addr{"0.0.0.0", 0}, Method: MethodNoAuth}, wantReply: ReplyCommandNotSupported, wantOut: []byte{5, 0}},
		{name: "unknown command", input: cat(greetNoAuth, domainReq(9, "example.com", 80)),
			want: &Request{Command: 9, Dest: Addr{"example.com", 80}, Method: MethodNoAuth}, wantReply: ReplyCommandNotSupported, wantOut: []byte{5, 0}},
		{name: "bad atyp", input: cat(greetNoAuth, []byte{5, CmdConnect, 0, 2, 1, 2, 3, 4, 0, 80}),
			want: &Request{Command: CmdConnect, Method: MethodNoAuth}, wantReply: ReplyAddressNotSupported, wantOut: []byte{5, 0}},
		{name: "bad atyp with bind", input: cat(greetNoAuth, []byte{5, CmdBind, 0, 0xff}),
			want: &Request{Command: CmdBind, Method: MethodNoAuth}, wantReply: ReplyAddressNotSupported, wantOut: []byte{5, 0}},
		{name: "empty domain", input: cat(greetNoAuth, domainReq(CmdConnect, "", 80)),
			want: &Request{Command: CmdConnect, Dest: Addr{"", 80}, Method: MethodNoAuth}, wantReply: ReplyAddressNotSupported, wantOut: []byte{5, 0}},
		{name: "domain with colon", input: cat(greetNoAuth, domainReq(CmdConnect, "a.com:25", 80)),
			want: &Request{Command: CmdConnect, Dest: Addr{"", 80}, Method: MethodNoAuth}, wantReply: ReplyAddressNotSupported, wantOut: []byte{5, 0}},
		{name: "domain with NUL", input: cat(greetNoAuth, domainReq(CmdConnect, "a.com\x00.evil", 80)),
			want: &Request{Command: CmdConnect, Dest: Addr{"", 80}, Method: MethodNoAuth}, wantReply: ReplyAddressNotSupported, wantOut: []byte{5, 0}},
		{name: "domain with zone", input: cat(greetNoAuth, domainReq(CmdConnect, "fe80::1%eth0", 80)),
			want: &Request{Command: CmdConnect, Dest: Addr{"", 80}, Method: MethodNoAuth}, wantReply: ReplyAddressNotSupported, wantOut: []byte{5, 0}},
		{name: "ip literal sent as domain", input: cat(greetNoAuth, domainReq(CmdConnect, "127.0.0.1", 80)),
			want: &Request{Command: CmdConnect, Dest: Addr{"127.0.0.1", 80}, Method: MethodNoAuth}, wantOut: []byte{5, 0}},
		{name: "socks4 greeting", input: []byte{4, 1, 0, 80, 127, 0, 0, 1, 0},
			wantErr: ErrVersion},
		{name: "http request", input: []byte("GET / HTTP/1.1\r\n\r\n"),
			wantErr: ErrVersion},
		{name: "bad subnegotiation version", input: cat(greetBoth, []byte{5, 1, 'u', 1, 'p'}, reqIPv4),
			wantErr: ErrVersion, wantOut: []byte{5, 2}},
		{name: "bad request version", input: cat(greetNoAuth, []byte{4, 1, 0, 1, 1, 2, 3, 4, 0, 80}),
			wantErr: ErrVersion, wantOut: []byte{5, 0}},
		{name: "empty input", input: nil, wantErr: ErrMalformed},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			req, err, out, _ := serve(t, c.input, c.cfg)
			if !bytes.Equal(out, c.wantOut) {
				t.Errorf("wrote %x, want %x", out, c.wantOut)
			}
			var rerr *RequestError
			switch {
			case c.wantErr != nil:
				if !errors.Is(err, c.wantErr) {
					t.Fatalf("err = %v, want %v", err, c.wantErr)
				}
			case c.wantReply != 0:
				if !errors.As(err, &rerr) || rerr.Reply != c.wantReply {
					t.Fatalf("err = %v, want *RequestError{Reply: %#02x}", err, c.wantReply)
				}
			case err != nil:
				t.Fatalf("err = %v", err)
			}
			if c.want == nil {
				if req != nil {
					t.Fatalf("req = %+v, want nil", req)
				}
				return
			}
			if req == nil || *req != *c.want {
				t.Fatalf("req = %+v, want %+v", req, c.want)
			}
		})
	}
}

// Every strict prefix of a valid handshake is truncated input: ErrMalformed
// wrapping EOF, and never a request.
func TestReadRequestTruncated(t *testing.T) {
	inputs := [][]byte{
		cat(greetNoAuth, reqIPv4),
		cat(greetNoAuth, reqIPv6),
		cat(greetBoth, userPass("user", "pass"), domainReq(CmdConnect, "example.com", 443)),
	}
	for _, in := range inputs {
		for n := 0; n < len(in); n++ {
			req, err, _, _ := serve(t, in[:n], ServerConfig{})
			if req != nil || !errors.Is(err, ErrMalformed) || !(errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)) {
				t.Fatalf("input %x: req = %+v, err = %v; want nil and truncated", in[:n], req, err)
			}
		}
		if req, err, _, _ := serve(t, in, ServerConfig{}); err != nil || req == nil {
			t.Fatalf("full input %x: err = %v", in, err)
		}
	}
}

// Bytes the client sends right behind its request stay unread.
func TestReadRequestNoReadAhead(t *testing.T) {
	first := []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	_, err, _, rest := serve(t, cat(greetBoth, userPass("u", "p"), reqIPv4, first), ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(rest, first) {
		t.Fatalf("left %q, want %q", rest, first)
	}
}

func TestWriteReply(t *testing.T) {
	cases := []struct {
		reply byte
		bind  Addr
		want  []byte
	}{
		{ReplySucceeded, Addr{}, []byte{5, 0, 0, AtypIPv4, 0, 0, 0, 0, 0, 0}},
		{ReplyConnectionRefused, Addr{}, []byte{5, 5, 0, AtypIPv4, 0, 0, 0, 0, 0, 0}},
		{ReplySucceeded, Addr{"10.0.0.1", 1080}, []byte{5, 0, 0, AtypIPv4, 10, 0, 0, 1, 0x04, 0x38}},
		{ReplySucceeded, Addr{"::1", 80}, []byte{5, 0, 0, AtypIPv6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 80}},
		{ReplySucceeded, Addr{"proxy.lan", 2}, cat([]byte{5, 0, 0, AtypDomain, 9}, []byte("proxy.lan"), []byte{0, 2})},
	}
	for _, c := range cases {
		var b bytes.Buffer
		if err := WriteReply(&b, c.reply, c.bind); err != nil {
			t.Fatalf("%v: %v", c.bind, err)
		}
		if !bytes.Equal(b.Bytes(), c.want) {
			t.Errorf("WriteReply(%d, %v) = %x, want %x", c.reply, c.bind, b.Bytes(), c.want)
		}
	}
	var b bytes.Buffer
	if err := WriteReply(&b, 0, Addr{"a b", 1}); !errors.Is(err, ErrBadAddress) || b.Len() != 0 {
		t.Errorf("bad bind: err = %v, wrote %x", err, b.Bytes())
	}
}

func TestAddr(t *testing.T) {
	cases := []struct {
		a        Addr
		str      string
		isDomain bool
	}{
		{Addr{"example.com", 80}, "example.com:80", true},
		{Addr{"192.0.2.1", 443}, "192.0.2.1:443", false},
		{Addr{"2001:db8::1", 443}, "[2001:db8::1]:443", false},
		{Addr{"::ffff:127.0.0.1", 1}, "[::ffff:127.0.0.1]:1", false},
		{Addr{}, ":0", true},
	}
	for _, c := range cases {
		if got := c.a.String(); got != c.str {
			t.Errorf("%#v.String() = %q, want %q", c.a, got, c.str)
		}
		if got := c.a.IsDomain(); got != c.isDomain {
			t.Errorf("%#v.IsDomain() = %v, want %v", c.a, got, c.isDomain)
		}
		if ip, ok := c.a.IP(); ok == c.isDomain || (ok && ip != netip.MustParseAddr(c.a.Host)) {
			t.Errorf("%#v.IP() = %v, %v", c.a, ip, ok)
		}
	}
}

func TestErrorTexts(t *testing.T) {
	if got, want := (&ReplyError{Code: 5}).Error(), "socks5: upstream replied 0x05 connection refused"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	if got, want := ReplyText(0x42), "0x42 unassigned"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}
