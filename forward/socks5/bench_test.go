package socks5

import (
	"bytes"
	"testing"
)

// replay is an in-memory peer that answers with the same bytes each run.
type replay struct {
	r bytes.Reader
	b []byte
}

func (p *replay) Read(b []byte) (int, error)  { return p.r.Read(b) }
func (p *replay) Write(b []byte) (int, error) { return len(b), nil }
func (p *replay) reset()                      { p.r.Reset(p.b) }

// The handshakes allocate a fixed handful of times, whatever the lengths.
func TestHandshakeAllocations(t *testing.T) {
	if testing.Short() {
		t.Skip("allocation counts")
	}
	client := &replay{b: cat([]byte{5, 2, 1, 0}, okReply4)}
	name := string(bytes.Repeat([]byte("a"), 255))
	server := &replay{b: cat(greetBoth, userPass("alice", "s3cret"), domainReq(CmdConnect, name, 443))}
	cases := []struct {
		name string
		max  float64 // the buffer, the result's strings and the Request
		run  func()
	}{
		{"ClientHandshake auth, ipv4 bound", 2, func() {
			client.reset()
			if _, err := ClientHandshake(client, exampleDst, "session-abc", "pw"); err != nil {
				t.Fatal(err)
			}
		}},
		{"ReadRequest auth, 255-byte domain", 5, func() {
			server.reset()
			if _, err := ReadRequest(server, ServerConfig{}); err != nil {
				t.Fatal(err)
			}
		}},
	}
	for _, c := range cases {
		if n := testing.AllocsPerRun(100, c.run); n > c.max {
			t.Errorf("%s: %v allocations, want ≤ %v", c.name, n, c.max)
		}
	}
}

func BenchmarkClientHandshake(b *testing.B) {
	p := &replay{b: cat([]byte{5, 2, 1, 0}, okReply4)}
	b.ReportAllocs()
	for b.Loop() {
		p.reset()
		if _, err := ClientHandshake(p, exampleDst, "session-abc", "pw"); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkReadRequest(b *testing.B) {
	p := &replay{b: cat(greetBoth, userPass("alice", "s3cret"), domainReq(CmdConnect, "example.com", 443))}
	b.ReportAllocs()
	for b.Loop() {
		p.reset()
		if _, err := ReadRequest(p, ServerConfig{}); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkLoopbackHandshake runs ClientHandshake against ReadRequest +
// WriteReply over one loopback connection per handshake pair, with and
// without pipelining: the difference is the round trips saved.
func BenchmarkLoopbackHandshake(b *testing.B) {
	for _, c := range []struct {
		name string
		c    Client
	}{{"sequential", Client{}}, {"pipelined", Client{Pipeline: true}}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				b.StopTimer()
				client, server := loopbackPair(b)
				done := make(chan error, 1)
				b.StartTimer()
				go func() {
					_, err := ReadRequest(server, ServerConfig{})
					if err == nil {
						err = WriteReply(server, ReplySucceeded, Addr{})
					}
					done <- err
				}()
				_, err := c.c.Handshake(client, exampleDst, "session-abc", "pw")
				if serr := <-done; serr != nil || err != nil {
					b.Fatal(err, serr)
				}
				b.StopTimer()
				client.Close()
				server.Close()
				b.StartTimer()
			}
		})
	}
}
