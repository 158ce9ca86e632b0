package socks5

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"testing"
	"time"
)

// upstreamScript is a tiny scripted SOCKS5 upstream: it answers the
// greeting with method, the RFC 1929 subnegotiation (if method is 0x02)
// with authStatus, and the request with reply followed by after. Any nil
// answer makes it close the connection at that point.
type upstreamScript struct {
	method     []byte
	authStatus []byte
	reply      []byte
	after      []byte
}

// seen is what the scripted upstream read from the client.
type seen struct {
	greeting, auth, request []byte
	err                     error
}

// run plays s on c and reports what the client sent.
func (s upstreamScript) run(c net.Conn) (got seen) {
	defer c.Close()
	readN := func(dst *[]byte, n int) bool {
		b := make([]byte, n)
		if _, err := io.ReadFull(c, b); err != nil {
			got.err = err
			return false
		}
		*dst = append(*dst, b...)
		return true
	}
	if !readN(&got.greeting, 2) || !readN(&got.greeting, int(got.greeting[1])) {
		return
	}
	if s.method == nil {
		return
	}
	c.Write(s.method)
	if len(s.method) != 2 {
		return // not a method selection: close
	}
	if s.method[1] == MethodUserPass {
		if !readN(&got.auth, 2) || !readN(&got.auth, int(got.auth[1])+1) ||
			!readN(&got.auth, int(got.auth[len(got.auth)-1])) {
			return
		}
		if s.authStatus == nil {
			return
		}
		c.Write(s.authStatus)
		if s.authStatus[1] != 0 {
			return
		}
	}
	if !readN(&got.request, 4) {
		return
	}
	switch got.request[3] {
	case AtypIPv4:
		readN(&got.request, 4+2)
	case AtypIPv6:
		readN(&got.request, 16+2)
	case AtypDomain:
		if readN(&got.request, 1) {
			readN(&got.request, int(got.request[4])+2)
		}
	}
	if s.reply == nil {
		return
	}
	c.Write(s.reply)
	c.Write(s.after)
	return
}

// handshakeWith runs ClientHandshake against the script over loopback and
// returns its result, what the upstream saw, and the client connection.
func handshakeWith(t *testing.T, s upstreamScript, dest Addr, user, pass string) (Addr, error, seen, net.Conn) {
	t.Helper()
	client, server := loopbackPair(t)
	ch := make(chan seen, 1)
	goOwned(t, func() { ch <- s.run(server) })
	bound, err := ClientHandshake(client, dest, user, pass)
	client.(*net.TCPConn).CloseWrite()
	return bound, err, <-ch, client
}

var (
	okMethod   = []byte{5, MethodNoAuth}
	okReply4   = []byte{5, 0, 0, AtypIPv4, 10, 1, 2, 3, 0x1f, 0x90}
	exampleDst = Addr{Host: "example.com", Port: 443}
)

func TestClientHandshakeReplyCodes(t *testing.T) {
	for code := 0; code <= 0x0a; code++ {
		testReplyCode(t, byte(code))
	}
	testReplyCode(t, 0x80)
	testReplyCode(t, 0xff)
}

func testReplyCode(t *testing.T, code byte) {
	t.Run(fmt.Sprintf("%#02x", code), func(t *testing.T) {
		reply := []byte{5, code, 0, AtypIPv4, 10, 1, 2, 3, 0x1f, 0x90}
		bound, err, _, _ := handshakeWith(t, upstreamScript{method: okMethod, reply: reply}, exampleDst, "", "")
		if code == ReplySucceeded {
			if err != nil {
				t.Fatalf("err = %v", err)
			}
			if want := (Addr{"10.1.2.3", 8080}); bound != want {
				t.Fatalf("bound = %v, want %v", bound, want)
			}
			return
		}
		var re *ReplyError
		if !errors.As(err, &re) {
			t.Fatalf("err = %v (%T), want *ReplyError", err, err)
		}
		if re.Code != code {
			t.Errorf("Code = %#02x, want %#02x", re.Code, code)
		}
		wantDest := code >= 2 && code <= 6
		if re.DestinationFault() != wantDest {
			t.Errorf("DestinationFault() = %v, want %v", re.DestinationFault(), wantDest)
		}
		if errors.Is(err, ErrMalformed) || errors.Is(err, ErrAuthRejected) {
			t.Errorf("err %v also matches another class", err)
		}
	})
}

func TestClientHandshakeRequestEncoding(t *testing.T) {
	cases := []struct {
		dest Addr
		want []byte
	}{
		{Addr{"example.com", 443}, append(append([]byte{5, 1, 0, AtypDomain, 11}, "example.com"...), 1, 0xbb)},
		{Addr{"192.0.2.7", 80}, []byte{5, 1, 0, AtypIPv4, 192, 0, 2, 7, 0, 80}},
		{Addr{"2001:db8::1", 8443}, []byte{5, 1, 0, AtypIPv6, 0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0x20, 0xfb}},
		// A name that only the upstream can resolve stays a name.
		{Addr{"only-upstream.invalid", 1}, append(append([]byte{5, 1, 0, AtypDomain, 21}, "only-upstream.invalid"...), 0, 1)},
	}
	for _, c := range cases {
		t.Run(c.dest.String(), func(t *testing.T) {
			_, err, got, _ := handshakeWith(t, upstreamScript{method: okMethod, reply: okReply4}, c.dest, "", "")
			if err != nil {
				t.Fatal(err)
			}
			if want := []byte{5, 1, MethodNoAuth}; !bytes.Equal(got.greeting, want) {
				t.Errorf("greeting = %x, want %x", got.greeting, want)
			}
			if !bytes.Equal(got.request, c.want) {
				t.Errorf("request = %x, want %x", got.request, c.want)
			}
		})
	}
}

func TestClientHandshakeUserPass(t *testing.T) {
	_, err, got, _ := handshakeWith(t, upstreamScript{
		method: []byte{5, MethodUserPass}, authStatus: []byte{1, 0}, reply: okReply4,
	}, exampleDst, "session-abc", "p@ss:w/rd")
	if err != nil {
		t.Fatal(err)
	}
	if want := []byte{5, 2, MethodNoAuth, MethodUserPass}; !bytes.Equal(got.greeting, want) {
		t.Errorf("greeting = %x, want %x", got.greeting, want)
	}
	want := append(append(append([]byte{1, 11}, "session-abc"...), 9), "p@ss:w/rd"...)
	if !bytes.Equal(got.auth, want) {
		t.Errorf("auth = %q, want %q", got.auth, want)
	}

	// Offered user/pass, but the upstream picks no-auth: fine.
	if _, err, got, _ := handshakeWith(t, upstreamScript{method: okMethod, reply: okReply4}, exampleDst, "u", "p"); err != nil || got.auth != nil {
		t.Fatalf("no-auth selected: err = %v, auth sent = %q", err, got.auth)
	}
}

func TestClientHandshakeErrors(t *testing.T) {
	cases := []struct {
		name       string
		s          upstreamScript
		user, pass string
		want       error
		wantEOF    bool
	}{
		{name: "no acceptable method", s: upstreamScript{method: []byte{5, 0xff}}, want: ErrAuthRejected},
		{name: "no acceptable method with creds", s: upstreamScript{method: []byte{5, 0xff}}, user: "u", pass: "p", want: ErrAuthRejected},
		{name: "wrong password", s: upstreamScript{method: []byte{5, 2}, authStatus: []byte{1, 1}}, user: "u", pass: "bad", want: ErrAuthRejected},
		{name: "auth status 0xff", s: upstreamScript{method: []byte{5, 2}, authStatus: []byte{1, 0xff}}, user: "u", pass: "bad", want: ErrAuthRejected},
		{name: "auth status version 5 accepted", s: upstreamScript{method: []byte{5, 2}, authStatus: []byte{5, 0}, reply: okReply4}, user: "u", pass: "p"},
		{name: "auth status bad version", s: upstreamScript{method: []byte{5, 2}, authStatus: []byte{9, 0}}, user: "u", pass: "p", want: ErrMalformed},
		{name: "user/pass selected but not offered", s: upstreamScript{method: []byte{5, 2}}, want: ErrMalformed},
		{name: "gssapi selected", s: upstreamScript{method: []byte{5, 1}}, want: ErrMalformed},
		{name: "socks4 answer", s: upstreamScript{method: []byte{0, 0x5a}}, want: ErrMalformed},
		{name: "http answer", s: upstreamScript{method: []byte("HTTP/1.1 400 Bad Request\r\n\r\n")}, want: ErrMalformed},
		{name: "closed after greeting", s: upstreamScript{}, want: ErrMalformed, wantEOF: true},
		{name: "half a method selection", s: upstreamScript{method: []byte{5}}, want: ErrMalformed, wantEOF: true},
		{name: "closed after auth", s: upstreamScript{method: []byte{5, 2}}, user: "u", want: ErrMalformed, wantEOF: true},
		{name: "closed after request", s: upstreamScript{method: okMethod}, want: ErrMalformed, wantEOF: true},
		{name: "reply bad version", s: upstreamScript{method: okMethod, reply: []byte{4, 0, 0, 1, 0, 0, 0, 0, 0, 0}}, want: ErrMalformed},
		{name: "reply bad atyp", s: upstreamScript{method: okMethod, reply: []byte{5, 0, 0, 2, 0, 0, 0, 0, 0, 0}}, want: ErrMalformed},
		{name: "reply truncated address", s: upstreamScript{method: okMethod, reply: []byte{5, 0, 0, AtypIPv6, 0, 0, 0}}, want: ErrMalformed, wantEOF: true},
		{name: "reply truncated domain", s: upstreamScript{method: okMethod, reply: []byte{5, 0, 0, AtypDomain, 200, 'a'}}, want: ErrMalformed, wantEOF: true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err, _, _ := handshakeWith(t, c.s, exampleDst, c.user, c.pass)
			if c.want == nil {
				if err != nil {
					t.Fatalf("err = %v", err)
				}
				return
			}
			if !errors.Is(err, c.want) {
				t.Fatalf("err = %v, want %v", err, c.want)
			}
			var re *ReplyError
			if errors.As(err, &re) {
				t.Errorf("err %v is also a *ReplyError", err)
			}
			if got := errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF); got != c.wantEOF {
				t.Errorf("err %v: wraps EOF = %v, want %v", err, got, c.wantEOF)
			}
		})
	}
}

func TestClientHandshakeBoundAddresses(t *testing.T) {
	cases := []struct {
		reply []byte
		want  Addr
	}{
		{[]byte{5, 0, 0, AtypIPv4, 0, 0, 0, 0, 0, 0}, Addr{"0.0.0.0", 0}},
		{[]byte{5, 0, 0, AtypIPv6, 0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 1}, Addr{"2001:db8::2", 1}},
		{append(append([]byte{5, 0, 0, AtypDomain, 9}, "proxy.lan"...), 0xff, 0xff), Addr{"proxy.lan", 65535}},
	}
	for _, c := range cases {
		t.Run(c.want.String(), func(t *testing.T) {
			bound, err, _, _ := handshakeWith(t, upstreamScript{method: okMethod, reply: c.reply}, exampleDst, "", "")
			if err != nil || bound != c.want {
				t.Fatalf("bound, err = %v, %v; want %v", bound, err, c.want)
			}
		})
	}
}

// The bytes the destination sends right behind the reply must stay in the
// connection for the relay.
func TestClientHandshakeNoReadAhead(t *testing.T) {
	after := []byte("HTTP/1.1 200 OK\r\n\r\nhello")
	_, err, _, client := handshakeWith(t, upstreamScript{method: okMethod, reply: okReply4, after: after}, exampleDst, "", "")
	if err != nil {
		t.Fatal(err)
	}
	if got := readAllUntilEOF(client); !bytes.Equal(got, after) {
		t.Fatalf("after the handshake read %q, want %q", got, after)
	}
}

func TestClientHandshakeTimeout(t *testing.T) {
	client, server := loopbackPair(t)
	_ = server // never answers
	client.SetDeadline(timeNowPlus(50))
	_, err := ClientHandshake(client, exampleDst, "", "")
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("err = %v, want a deadline error", err)
	}
	if errors.Is(err, ErrMalformed) {
		t.Fatalf("a timeout must not be ErrMalformed: %v", err)
	}
	if errors.Is(err, ErrAwaitingReply) {
		t.Fatalf("a greeting never answered is not ErrAwaitingReply: %v", err)
	}
}

// A server that answers the greeting and then not the request: the
// timeout says that the reply was awaited (the server is there).
func TestClientHandshakeTimeoutAwaitingReply(t *testing.T) {
	client, server := loopbackPair(t)
	go func() {
		var greeting [3]byte
		if _, err := io.ReadFull(server, greeting[:]); err == nil {
			_, _ = server.Write(okMethod)
		}
	}()
	client.SetDeadline(timeNowPlus(200))
	_, err := ClientHandshake(client, exampleDst, "", "")
	if !errors.Is(err, os.ErrDeadlineExceeded) || !errors.Is(err, ErrAwaitingReply) {
		t.Fatalf("err = %v, want a deadline error awaiting the reply", err)
	}
}

func TestClientHandshakeBadArguments(t *testing.T) {
	client, _ := loopbackPair(t)
	long := string(bytes.Repeat([]byte("a"), 256))
	for _, dest := range []Addr{{"", 80}, {"fe80::1%eth0", 80}, {"a b", 80}, {"host:80", 80}, {"[::1]", 80}, {long, 80}, {"evil\x00.com", 80}} {
		if _, err := ClientHandshake(client, dest, "", ""); !errors.Is(err, ErrBadAddress) {
			t.Errorf("dest %q: err = %v, want ErrBadAddress", dest.Host, err)
		}
	}
	if _, err := ClientHandshake(client, exampleDst, long, ""); !errors.Is(err, ErrBadCredentials) {
		t.Errorf("long user: err = %v", err)
	}
	if _, err := ClientHandshake(client, exampleDst, "u", long); !errors.Is(err, ErrBadCredentials) {
		t.Errorf("long password: err = %v", err)
	}
}

// writeCounter is an in-memory upstream that counts the client's writes.
type writeCounter struct {
	r      *bytes.Reader
	writes [][]byte
}

func (w *writeCounter) Read(b []byte) (int, error) { return w.r.Read(b) }
func (w *writeCounter) Write(b []byte) (int, error) {
	w.writes = append(w.writes, append([]byte(nil), b...))
	return len(b), nil
}

func TestClientHandshakeWrites(t *testing.T) {
	req := cat([]byte{5, 1, 0, AtypDomain, 11}, []byte("example.com"), []byte{1, 0xbb})
	auth := userPass("session-abc", "pw")
	cases := []struct {
		name       string
		c          Client
		user       string
		answers    []byte
		wantWrites [][]byte
	}{
		{"no auth", Client{}, "", cat(okMethod, okReply4),
			[][]byte{{5, 1, 0}, req}},
		{"auth", Client{}, "session-abc", cat([]byte{5, 2, 1, 0}, okReply4),
			[][]byte{{5, 2, 0, 2}, auth, req}},
		{"pipelined no auth", Client{Pipeline: true}, "", cat(okMethod, okReply4),
			[][]byte{cat([]byte{5, 1, 0}, req)}},
		{"pipelined auth", Client{Pipeline: true}, "session-abc", cat([]byte{5, 2, 1, 0}, okReply4),
			[][]byte{cat([]byte{5, 1, 2}, auth, req)}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			w := &writeCounter{r: bytes.NewReader(c.answers)}
			if _, err := c.c.Handshake(w, exampleDst, c.user, "pw"); err != nil {
				t.Fatal(err)
			}
			if fmt.Sprintf("%x", w.writes) != fmt.Sprintf("%x", c.wantWrites) {
				t.Fatalf("writes %x, want %x", w.writes, c.wantWrites)
			}
			if w.r.Len() != 0 {
				t.Fatalf("%d bytes of the answers left unread", w.r.Len())
			}
		})
	}
}

func TestClientPipelineOverLoopback(t *testing.T) {
	pipelined := Client{Pipeline: true}
	t.Run("auth", func(t *testing.T) {
		client, server := loopbackPair(t)
		ch := make(chan seen, 1)
		s := upstreamScript{method: []byte{5, 2}, authStatus: []byte{1, 0}, reply: okReply4, after: []byte("data")}
		goOwned(t, func() { ch <- s.run(server) })
		if _, err := pipelined.Handshake(client, exampleDst, "u", "p"); err != nil {
			t.Fatal(err)
		}
		if got := readAllUntilEOF(client); string(got) != "data" {
			t.Fatalf("after the reply: %q", got)
		}
		got := <-ch
		if !bytes.Equal(got.greeting, []byte{5, 1, 2}) || !bytes.Equal(got.auth, userPass("u", "p")) || len(got.request) != 4+1+11+2 {
			t.Fatalf("upstream saw %+v", got)
		}
	})
	for _, c := range []struct {
		name   string
		method []byte
		want   error
	}{
		{"no acceptable method", []byte{5, 0xff}, ErrAuthRejected},
		{"no-auth selected though not offered", []byte{5, 0}, ErrMalformed},
	} {
		t.Run(c.name, func(t *testing.T) {
			client, server := loopbackPair(t)
			goOwned(t, func() { upstreamScript{method: c.method}.run(server) })
			// One message at a time offers no-auth as well: these may be
			// the pipeline's doing.
			_, err := pipelined.Handshake(client, exampleDst, "u", "p")
			if !errors.Is(err, c.want) || !errors.Is(err, ErrPipelineFailed) {
				t.Fatalf("err = %v, want %v and ErrPipelineFailed", err, c.want)
			}
		})
	}
}

// A pipelined handshake says when it failed where one message at a time
// might not have (ErrPipelineFailed): the upstream closed or answered
// garbage at any point, or left the credentials unanswered; a verdict
// (credentials refused, a reply code) and a silence before the greeting's
// answer or after the credentials' answer do not, and neither do the same
// failures one message at a time.
func TestClientPipelineUnanswered(t *testing.T) {
	pipelined := Client{Pipeline: true}
	for _, c := range []struct {
		name   string
		status []byte // the upstream's answer to the credentials; nil: it closes
	}{
		{"closed after the greeting's answer", nil},
		{"status of another protocol", []byte{9, 0}},
		{"closed after the credentials' answer", []byte{1, 0}},
	} {
		t.Run(c.name, func(t *testing.T) {
			client, server := loopbackPair(t)
			goOwned(t, func() { upstreamScript{method: []byte{5, 2}, authStatus: c.status}.run(server) })
			_, err := pipelined.Handshake(client, exampleDst, "u", "p")
			if !errors.Is(err, ErrPipelineFailed) {
				t.Fatalf("err = %v, want ErrPipelineFailed", err)
			}

			client, server = loopbackPair(t)
			goOwned(t, func() { upstreamScript{method: []byte{5, 2}, authStatus: c.status}.run(server) })
			_, err = ClientHandshake(client, exampleDst, "u", "p")
			client.Close()
			if err == nil || errors.Is(err, ErrPipelineFailed) {
				t.Fatalf("one message at a time: err = %v, want a failure that is not ErrPipelineFailed", err)
			}
		})
	}

	t.Run("silent: the upstream dropped what came with the greeting", func(t *testing.T) {
		client, server := loopbackPair(t)
		goOwned(t, func() {
			defer server.Close()
			// One read takes the greeting and what came with it; only the
			// greeting is used, the rest is gone. Then it waits for the
			// credentials that already came.
			b := make([]byte, 512)
			if n, err := server.Read(b); err != nil || n < 3 {
				return
			}
			server.Write([]byte{5, 2})
			server.Read(b)
		})
		client.SetDeadline(time.Now().Add(200 * time.Millisecond))
		_, err := pipelined.Handshake(client, exampleDst, "u", "p")
		client.Close()
		if !errors.Is(err, ErrPipelineFailed) || !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("err = %v, want ErrPipelineFailed wrapping the deadline", err)
		}
	})

	t.Run("credentials refused", func(t *testing.T) {
		client, server := loopbackPair(t)
		goOwned(t, func() { upstreamScript{method: []byte{5, 2}, authStatus: []byte{1, 1}}.run(server) })
		_, err := pipelined.Handshake(client, exampleDst, "u", "p")
		if !errors.Is(err, ErrAuthRejected) || errors.Is(err, ErrPipelineFailed) {
			t.Fatalf("err = %v, want ErrAuthRejected alone", err)
		}
	})

	t.Run("reply code", func(t *testing.T) {
		client, server := loopbackPair(t)
		goOwned(t, func() {
			upstreamScript{method: []byte{5, 2}, authStatus: []byte{1, 0}, reply: []byte{5, ReplyHostUnreachable, 0, AtypIPv4, 0, 0, 0, 0, 0, 0}}.run(server)
		})
		var re *ReplyError
		_, err := pipelined.Handshake(client, exampleDst, "u", "p")
		if !errors.As(err, &re) || errors.Is(err, ErrPipelineFailed) {
			t.Fatalf("err = %v, want the reply code alone", err)
		}
	})

	t.Run("closed before the greeting's answer", func(t *testing.T) {
		client, server := loopbackPair(t)
		goOwned(t, func() { upstreamScript{}.run(server) })
		_, err := pipelined.Handshake(client, exampleDst, "u", "p")
		if !errors.Is(err, ErrPipelineFailed) {
			t.Fatalf("err = %v, want ErrPipelineFailed", err)
		}
	})

	// Silent before the greeting's answer, or after the credentials'
	// answer (where a slow destination keeps the reply back).
	for _, c := range []struct {
		name string
		s    upstreamScript
	}{
		{"silent before the greeting's answer", upstreamScript{}},
		{"silent after the credentials' answer", upstreamScript{method: []byte{5, 2}, authStatus: []byte{1, 0}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			client, server := loopbackPair(t)
			goOwned(t, func() {
				defer server.Close()
				b := make([]byte, 512)
				server.Read(b)
				if c.s.method != nil {
					server.Write(append(c.s.method, c.s.authStatus...))
				}
				server.Read(b) // until the client gives up
			})
			client.SetDeadline(time.Now().Add(200 * time.Millisecond))
			_, err := pipelined.Handshake(client, exampleDst, "u", "p")
			client.Close()
			if !errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, ErrPipelineFailed) {
				t.Fatalf("err = %v, want the deadline alone", err)
			}
		})
	}
}
