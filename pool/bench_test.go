package pool

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"
)

var benchSizes = []int{10, 1000, 100000}

func benchPool(b *testing.B, strategy string, n int) (*Pool, []Upstream) {
	b.Helper()
	p, err := New(conf(func(c *Config) { c.Strategy = strategy }), Options{})
	if err != nil {
		b.Fatal(err)
	}
	set := ups(1, n)
	p.Update(set)
	p.SetListeners([]ListenerSlice{{Name: "http", Protocol: HTTP}})
	// Some history, so that the latency strategy has averages to compare.
	for i, h := range p.snap.Load().hosts {
		h.observe(time.Duration(50+i%50) * time.Millisecond)
	}
	return p, set
}

// BenchmarkPick is one Pick and its Release, from all Ps in parallel.
func BenchmarkPick(b *testing.B) {
	for _, strategy := range []string{RoundRobin, Random, LeastConn, Latency} {
		for _, n := range benchSizes {
			b.Run(strategy+"/"+strconv.Itoa(n), func(b *testing.B) {
				p, _ := benchPool(b, strategy, n)
				benchPicks(b, p, false)
			})
		}
	}
	// Sticky picks of known keys: each goroutine cycles through its own
	// 1,000 keys, assigned before the timer starts.
	for _, n := range benchSizes {
		b.Run("sticky-round-robin/"+strconv.Itoa(n), func(b *testing.B) {
			p, _ := benchPool(b, RoundRobin, n)
			ctx := context.Background()
			var worker atomic.Int64
			const keys = 1000
			all := make([][]Request, 64)
			for w := range all {
				all[w] = make([]Request, keys)
				for k := range keys {
					all[w][k] = Request{Listener: "http", Key: fmt.Sprintf("user\x00w%dk%d", w, k)}
					u, err := p.Pick(ctx, all[w][k])
					if err != nil {
						b.Fatal(err)
					}
					p.Release(u, all[w][k])
				}
			}
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				reqs := all[int(worker.Add(1)-1)%len(all)]
				i := 0
				for pb.Next() {
					u, err := p.Pick(ctx, reqs[i])
					if err != nil {
						b.Error(err)
						return
					}
					p.Release(u, reqs[i])
					if i++; i == keys {
						i = 0
					}
				}
			})
		})
	}
}

// BenchmarkPickPastEjected is BenchmarkPick with the first half of the
// upstreams ejected (the most the default cap allows): a pick whose turn
// falls in that half passes over ejected upstreams.
func BenchmarkPickPastEjected(b *testing.B) {
	for _, strategy := range []string{RoundRobin, Random, LeastConn, Latency} {
		for _, n := range benchSizes[:2] {
			b.Run(strategy+"/"+strconv.Itoa(n), func(b *testing.B) {
				p, set := benchPool(b, strategy, n)
				for i := range n / 2 {
					fail(p, handle(p, set[i]), 3)
				}
				benchPicks(b, p, false)
			})
		}
	}
}

// BenchmarkPickReport is the whole cycle a connection makes: Pick, Report
// of a success with its time, Release.
func BenchmarkPickReport(b *testing.B) {
	for _, n := range benchSizes {
		b.Run(RoundRobin+"/"+strconv.Itoa(n), func(b *testing.B) {
			p, _ := benchPool(b, RoundRobin, n)
			benchPicks(b, p, true)
		})
	}
}

// benchPicks times Pick, with report a Report of a success, and Release of
// listener "http", from all Ps in parallel.
func benchPicks(b *testing.B, p *Pool, report bool) {
	ctx := context.Background()
	req := Request{Listener: "http"}
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			u, err := p.Pick(ctx, req)
			if err != nil {
				b.Error(err)
				return
			}
			if report {
				p.Report(u, Success, 80*time.Millisecond)
			}
			p.Release(u, req)
		}
	})
}

// BenchmarkUpdate swaps in a set of the same n IDs, so every upstream keeps
// its state, alternating between two versions of the set:
//
//	(none)        the same upstreams in the same order
//	shuffled/     the same upstreams, the second version in another order
//	              (no same-order fast path: one index lookup per upstream)
//	credentials/  half of them with another password in the second version
//	churn/        1 % of them replaced by others in the second version
func BenchmarkUpdate(b *testing.B) {
	for _, variant := range []string{"", "shuffled/", "credentials/", "churn/"} {
		for _, n := range benchSizes {
			b.Run(variant+strconv.Itoa(n), func(b *testing.B) {
				benchUpdate(b, variant, n)
			})
		}
	}
}

func benchUpdate(b *testing.B, variant string, n int) {
	p, set := benchPool(b, RoundRobin, n)
	next := append([]Upstream(nil), set...)
	switch variant {
	case "shuffled/":
		rand.New(rand.NewPCG(1, 2)).Shuffle(len(next), func(i, j int) { next[i], next[j] = next[j], next[i] })
	case "credentials/":
		for i := 0; i < len(next); i += 2 {
			next[i].Password = "changed"
		}
	case "churn/":
		for i := 0; i < len(next); i += 100 {
			next[i].Address = fmt.Sprintf("192.0.%d.%d:8080", i>>8&255, i&255)
		}
	}
	sets := [2][]Upstream{set, next}
	want := len(p.snap.Load().hosts)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		p.Update(sets[i%2])
	}
	b.StopTimer()
	if got := len(p.snap.Load().hosts); got != want {
		b.Fatalf("%d upstreams, want %d", got, want)
	}
}

// BenchmarkMemory reports the heap the pool holds per upstream, beyond the
// caller's own []Upstream (whose strings the pool shares), with two
// listener slices and a sticky table holding one key per upstream.
func BenchmarkMemory(b *testing.B) {
	for _, n := range []int{100000} {
		b.Run(strconv.Itoa(n), func(b *testing.B) {
			set := ups(1, n)
			var perUpstream, perKey float64
			for i := 0; i < b.N; i++ {
				before := heap()
				p, err := New(DefaultConfig(), Options{})
				if err != nil {
					b.Fatal(err)
				}
				p.SetListeners([]ListenerSlice{{Name: "http", Protocol: HTTP}, {Name: "socks", Protocol: SOCKS5}})
				p.Update(set)
				p.Update(set) // a refresh: the old snapshot is garbage
				mid := heap()
				keys := make([]string, n)
				for k := range keys {
					keys[k] = "user\x00key" + strconv.Itoa(k)
				}
				keysHeap := heap()
				for k := range keys {
					u, _ := p.Pick(context.Background(), Request{Listener: "http", Key: keys[k]})
					p.Release(u, Request{Listener: "http", Key: keys[k]})
				}
				after := heap()
				perUpstream = float64(mid-before) / float64(n)
				perKey = float64(after-keysHeap) / float64(n)
				runtime.KeepAlive(p)
				runtime.KeepAlive(keys)
			}
			runtime.KeepAlive(set)
			b.ReportMetric(perUpstream, "B/upstream")
			b.ReportMetric(perKey, "B/sticky-key")
		})
	}
}

func heap() int64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

// BenchmarkExplain is what a /pool request or a metrics scrape costs.
func BenchmarkExplain(b *testing.B) {
	for _, n := range benchSizes {
		b.Run(strconv.Itoa(n), func(b *testing.B) {
			p, _ := benchPool(b, RoundRobin, n)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				_ = p.Explain()
			}
		})
	}
}

// BenchmarkEventRecord is one event into a ring that logs it through a slog
// text handler, as an ejection on the connection path records it.
func BenchmarkEventRecord(b *testing.B) {
	l := NewEventLog(0, slog.New(slog.NewTextHandler(io.Discard, nil)), nil)
	e := Event{Kind: EventEjected, Upstream: "1/http/10.1.0.0:8080", Service: 1, Reason: "dial_refused"}
	b.ReportAllocs()
	for b.Loop() {
		l.Record(e)
	}
}
