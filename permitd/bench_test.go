// SPDX-License-Identifier: Apache-2.0

package permitd_test

import (
	"bufio"
	"context"
	"io"
	"net"
	goruntime "runtime"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/client"
)

// BenchmarkRoundTrip measures acquire+release round trips over the socket
// with one pipelined client: 64 goroutines share the connection, so requests
// of one burst travel in one write. It reports round trips per second and
// the p99 latency of one acquire+release pair.
//
//	go test -run '^$' -bench RoundTrip -benchtime 200000x -count 5 ./permitd
func BenchmarkRoundTrip(b *testing.B) {
	for _, workers := range []int{1, 64} {
		b.Run(map[int]string{1: "serial", 64: "pipelined64"}[workers], func(b *testing.B) {
			f := start(b, 1<<20, 4)
			c := dial(b, f, client.Options{})
			ctx := context.Background()
			lat := make([][]time.Duration, workers)
			var wg sync.WaitGroup
			per := b.N / workers
			b.ResetTimer()
			for w := 0; w < workers; w++ {
				wg.Add(1)
				go func(w int) {
					defer wg.Done()
					ls := make([]time.Duration, 0, per)
					for i := 0; i < per; i++ {
						t0 := time.Now()
						l, err := c.Acquire(ctx, "flights", "bench")
						if err != nil {
							b.Error(err)
							return
						}
						if _, err := c.Release(ctx, l); err != nil {
							b.Error(err)
							return
						}
						ls = append(ls, time.Since(t0))
					}
					lat[w] = ls
				}(w)
			}
			wg.Wait()
			elapsed := b.Elapsed()
			b.StopTimer()
			var all []time.Duration
			for _, ls := range lat {
				all = append(all, ls...)
			}
			if len(all) == 0 {
				return
			}
			sort.Slice(all, func(i, j int) bool { return all[i] < all[j] })
			b.ReportMetric(float64(len(all))/elapsed.Seconds(), "roundtrips/s")
			b.ReportMetric(float64(all[len(all)*99/100].Microseconds()), "p99-µs")
			b.ReportMetric(float64(all[len(all)/2].Microseconds()), "p50-µs")
		})
	}
}

// BenchmarkIdleSessionMemory measures what an open, idle session costs the
// daemon: heap and goroutine stacks per session, with 2,000 sessions open.
// It is the number the daemon's default connection caps are budgeted with
// (package daemon, connCost).
//
//	go test -run '^$' -bench IdleSessionMemory -count 5 ./permitd
func BenchmarkIdleSessionMemory(b *testing.B) {
	const n = 2000
	for range b.N {
		f := start(b, 4, 4)
		goruntime.GC()
		var before goruntime.MemStats
		goruntime.ReadMemStats(&before)
		conns := make([]net.Conn, 0, n)
		for range n {
			c, err := net.Dial("unix", f.sock)
			if err != nil {
				b.Fatal(err)
			}
			conns = append(conns, c)
			io.WriteString(c, `{"id":1,"op":"ping"}`+"\n")
		}
		for _, c := range conns {
			if _, err := bufio.NewReader(c).ReadString('\n'); err != nil {
				b.Fatal(err)
			}
		}
		goruntime.GC()
		var after goruntime.MemStats
		goruntime.ReadMemStats(&after)
		used := (after.HeapInuse + after.StackInuse) - (before.HeapInuse + before.StackInuse)
		b.ReportMetric(float64(used)/n, "B/session")
		for _, c := range conns {
			c.Close()
		}
	}
}
