package socks5

import (
	"bytes"
	"errors"
	"net/netip"
	"testing"
)

// rw is an in-memory peer: reads come from the fuzzer's bytes.
type rw struct {
	*bytes.Reader
	out bytes.Buffer
}

func (p *rw) Write(b []byte) (int, error) { return p.out.Write(b) }

func FuzzReadRequest(f *testing.F) {
	f.Add(cat(greetNoAuth, reqIPv4), false)
	f.Add(cat(greetNoAuth, reqIPv6), false)
	f.Add(cat(greetNoAuth, domainReq(CmdConnect, "example.com", 443)), false)
	f.Add(cat(greetBoth, userPass("alice", "s3cret"), domainReq(CmdConnect, "example.com", 443)), true)
	f.Add(cat(greetBoth, userPass("alice", "wrong"), reqIPv4), true)
	f.Add(cat(greetBoth, userPass("session-k", ""), reqIPv4), false)
	f.Add(cat(greetNoAuth, []byte{5, CmdBind, 0, AtypIPv4, 1, 2, 3, 4, 0, 80}), false)
	f.Add(cat(greetNoAuth, []byte{5, CmdUDPAssociate, 0, AtypIPv6}), false)
	f.Add(cat(greetNoAuth, []byte{5, CmdConnect, 0, 7, 1, 2}), false)
	f.Add(cat(greetNoAuth, domainReq(CmdConnect, "::ffff:127.0.0.1", 80)), false)
	f.Add(cat(greetNoAuth, domainReq(CmdConnect, "a b", 80)), false)
	f.Add([]byte{5, 255}, false)
	f.Add([]byte{4, 1, 0, 80, 127, 0, 0, 1, 0}, false)
	f.Add([]byte{}, true)

	f.Fuzz(func(t *testing.T, data []byte, requireAuth bool) {
		cfg := ServerConfig{}
		if requireAuth {
			cfg = aliceOnly
		}
		p := &rw{Reader: bytes.NewReader(data)}
		req, err := ReadRequest(p, cfg)
		out := p.out.Bytes()
		if len(out) > 0 && (out[0] != VersionSOCKS5 || len(out) < 2) {
			t.Fatalf("wrote %x", out)
		}
		var rerr *RequestError
		switch {
		case err == nil:
			if req == nil || req.Command != CmdConnect || !validHost(req.Dest.Host) {
				t.Fatalf("accepted %+v", req)
			}
			want := []byte{5, req.Method}
			if req.Method == MethodUserPass {
				want = append(want, VersionUserPass, UserPassSucceeded)
			} else if req.Method != MethodNoAuth || requireAuth {
				t.Fatalf("method %#02x accepted (requireAuth %v)", req.Method, requireAuth)
			}
			if requireAuth && (req.Username != "alice" || req.Password != "s3cret") {
				t.Fatalf("accepted credentials %q/%q", req.Username, req.Password)
			}
			if !bytes.Equal(out, want) {
				t.Fatalf("wrote %x, want %x", out, want)
			}
			checkRoundTrip(t, req.Dest)
		case errors.As(err, &rerr):
			if req == nil || (rerr.Reply != ReplyCommandNotSupported && rerr.Reply != ReplyAddressNotSupported) {
				t.Fatalf("req %+v, err %v", req, err)
			}
			if rerr.Reply == ReplyCommandNotSupported && (req.Command == CmdConnect || !validHost(req.Dest.Host)) {
				t.Fatalf("command not supported for %+v", req)
			}
			if req.Dest.Host != "" && !validHost(req.Dest.Host) {
				t.Fatalf("invalid host passed on: %q", req.Dest.Host)
			}
		default:
			if req != nil {
				t.Fatalf("req %+v with err %v", req, err)
			}
			if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrVersion) &&
				!errors.Is(err, ErrAuthFailed) && !errors.Is(err, ErrNoAcceptableMethod) {
				t.Fatalf("unclassified error %v", err)
			}
			if errors.Is(err, ErrAuthFailed) && !bytes.HasSuffix(out, []byte{VersionUserPass, UserPassFailed}) {
				t.Fatalf("auth failure answered %x", out)
			}
			if errors.Is(err, ErrNoAcceptableMethod) && !bytes.Equal(out, []byte{5, MethodNoAcceptable}) {
				t.Fatalf("no acceptable method answered %x", out)
			}
		}
	})
}

// checkRoundTrip sends dest through ClientHandshake's encoding and reads it
// back with ReadRequest: the same address must come out.
func checkRoundTrip(t *testing.T, dest Addr) {
	t.Helper()
	msg := append(append([]byte{}, greetNoAuth...), VersionSOCKS5, CmdConnect, 0)
	msg = appendAddr(msg, dest)
	req, err := ReadRequest(&rw{Reader: bytes.NewReader(msg)}, ServerConfig{})
	if err != nil {
		t.Fatalf("re-reading %v: %v", dest, err)
	}
	if req.Dest == dest {
		return
	}
	a, errA := netip.ParseAddr(dest.Host)
	b, errB := netip.ParseAddr(req.Dest.Host)
	if errA != nil || errB != nil || a != b || req.Dest.Port != dest.Port {
		t.Fatalf("round trip %v → %v", dest, req.Dest)
	}
}

func FuzzClientHandshake(f *testing.F) {
	for _, code := range []byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0xff} {
		f.Add(cat(okMethod, []byte{5, code, 0, AtypIPv4, 1, 2, 3, 4, 0, 80}), false)
	}
	f.Add(cat([]byte{5, 2, 1, 0}, okReply4, []byte("trailing data")), true)
	f.Add([]byte{5, 2, 1, 1}, true)
	f.Add([]byte{5, 0xff}, true)
	f.Add(cat(okMethod, []byte{5, 0, 0, AtypIPv6}, make([]byte, 18)), false)
	f.Add(cat(okMethod, []byte{5, 0, 0, AtypDomain, 3, 'a', 'b', 'c', 0, 1}), false)
	f.Add(cat(okMethod, []byte{5, 0, 0, 9}), false)
	f.Add([]byte("HTTP/1.1 400 Bad Request\r\n\r\n"), false)

	f.Fuzz(func(t *testing.T, data []byte, withAuth bool) {
		user, pass := "", ""
		if withAuth {
			user, pass = "session-k", "pw"
		}
		p := &rw{Reader: bytes.NewReader(data)}
		bound, err := ClientHandshake(p, exampleDst, user, pass)
		var re *ReplyError
		switch {
		case err == nil:
			// Only the handshake was consumed: recompute its length.
			n := 2
			if data[1] == MethodUserPass {
				n += 2
			}
			atyp := data[n+3]
			switch atyp {
			case AtypIPv4:
				n += 4 + 4 + 2
			case AtypIPv6:
				n += 4 + 16 + 2
			case AtypDomain:
				n += 4 + 1 + int(data[n+4]) + 2
			default:
				t.Fatalf("accepted address type %#02x", atyp)
			}
			if p.Len() != len(data)-n {
				t.Fatalf("consumed %d bytes, want %d", len(data)-p.Len(), n)
			}
			if _, err := netip.ParseAddr(bound.Host); atyp != AtypDomain && err != nil {
				t.Fatalf("bound %q", bound.Host)
			}
		case errors.As(err, &re):
			if re.Code == ReplySucceeded {
				t.Fatalf("ReplyError with code 0")
			}
			if errors.Is(err, ErrMalformed) || errors.Is(err, ErrAuthRejected) {
				t.Fatalf("two classes: %v", err)
			}
		case errors.Is(err, ErrAuthRejected):
			if errors.Is(err, ErrMalformed) {
				t.Fatalf("two classes: %v", err)
			}
		case errors.Is(err, ErrMalformed):
		default:
			t.Fatalf("unclassified error %v", err)
		}
		if err != nil && bound != (Addr{}) {
			t.Fatalf("bound %v with error %v", bound, err)
		}
	})
}

// parseIP is netip.ParseAddr without the error value: same answers.
func FuzzParseIP(f *testing.F) {
	for _, s := range []string{"", "1.2.3.4", "::1", "fe80::1%eth0", "::ffff:1.2.3.4", "beef", "dead:beef::",
		"example.com", "1.2.3", "01.2.3.4", "2001:db8::1", "ABCD::", "1.2.3.4.5", "a:b"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		want, err := netip.ParseAddr(s)
		got, ok := parseIP(s)
		if ok != (err == nil) || got != want {
			t.Fatalf("parseIP(%q) = %v, %v; netip: %v, %v", s, got, ok, want, err)
		}
		if gotB, okB := parseIP([]byte(s)); okB != ok || gotB != got {
			t.Fatalf("parseIP([]byte(%q)) differs", s)
		}
		if (Addr{Host: s}).IsDomain() == ok {
			t.Fatalf("IsDomain(%q) = %v", s, !ok)
		}
	})
}
