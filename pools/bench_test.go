// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sync/semaphore"
	"golang.org/x/time/rate"
)

// The reference benchmarks (x/sync/semaphore, x/time/rate) run in the same
// package and run as ours, so the ratios are measured on one machine state.

func BenchmarkSemaphoreTryAcquireRelease(b *testing.B) {
	s := semaphore.NewWeighted(1 << 20)
	b.ReportAllocs()
	for b.Loop() {
		if !s.TryAcquire(1) {
			b.Fatal("refused")
		}
		s.Release(1)
	}
}

func BenchmarkSemaphoreAcquireReleaseParallel(b *testing.B) {
	s := semaphore.NewWeighted(1 << 20)
	ctx := context.Background()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := s.Acquire(ctx, 1); err != nil {
				b.Fatal(err)
			}
			s.Release(1)
		}
	})
}

func BenchmarkSemaphoreTryAcquireReleaseParallel(b *testing.B) {
	s := semaphore.NewWeighted(1 << 20)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if !s.TryAcquire(1) {
				b.Fatal("refused")
			}
			s.Release(1)
		}
	})
}

func benchPool(b *testing.B, projects int) *Pool {
	p, err := New(Config{Name: "bench", Size: 1 << 20}, nil)
	if err != nil {
		b.Fatal(err)
	}
	for i := 0; i < projects; i++ {
		pm, err := p.TryAcquire(fmt.Sprint("p", i))
		if err != nil {
			b.Fatal(err)
		}
		_ = p.Release(pm)
	}
	return p
}

func BenchmarkPoolTryAcquireRelease(b *testing.B) {
	for _, projects := range []int{1, 10, 100_000} {
		b.Run(fmt.Sprint("projects=", projects), func(b *testing.B) {
			p := benchPool(b, projects)
			b.ReportAllocs()
			for b.Loop() {
				pm, err := p.TryAcquire("p0")
				if err != nil {
					b.Fatal(err)
				}
				if err := p.Release(pm); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkPoolTryAcquireReleaseParallel(b *testing.B) {
	p := benchPool(b, 10)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			pm, err := p.TryAcquire("p0")
			if err != nil {
				b.Fatal(err)
			}
			if err := p.Release(pm); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func BenchmarkPoolAcquireReleaseParallel(b *testing.B) {
	p := benchPool(b, 10)
	ctx := context.Background()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			pm, err := p.Acquire(ctx, "p0")
			if err != nil {
				b.Fatal(err)
			}
			if err := p.Release(pm); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkPoolRefuse measures the refusal path (it builds a *Refusal).
func BenchmarkPoolRefuse(b *testing.B) {
	p, err := New(Config{Name: "bench", Size: 1}, nil)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := p.TryAcquire("hog"); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := p.TryAcquire("other"); err == nil {
			b.Fatal("admitted")
		}
	}
}

// BenchmarkPoolRecompute: the per-second recompute with 100,000 active
// projects (each holds a permit, so none leaves and the cost is the scan).
func BenchmarkPoolRecompute(b *testing.B) {
	for _, n := range []int{1000, 100_000} {
		b.Run(fmt.Sprint("active=", n), func(b *testing.B) {
			clk := newFakeClock()
			p, err := New(Config{Name: "bench", Size: 1 << 30}, clk)
			if err != nil {
				b.Fatal(err)
			}
			for i := 0; i < n; i++ {
				if _, err := p.TryAcquire(fmt.Sprint("p", i)); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportAllocs()
			for b.Loop() {
				clk.Advance(time.Second)
				p.Recompute()
			}
			if s := p.Snapshot(); s.Active != n {
				b.Fatalf("active %d", s.Active)
			}
		})
	}
}

// BenchmarkResidentsEvictAndAdmit: a full residents pool (FLOOR 1, so the
// share is objects/projects and every project sits at it); a project at its
// share spawns a new object, which evicts its own idlest, and the victim is
// then removed (2 calls per op). The under-share branch (a max-heap lookup
// instead of the own LRU tail) is not benchmarked: no cycle of calls keeps a
// full pool in a steady state for it.
func BenchmarkResidentsEvictAndAdmit(b *testing.B) {
	for _, tc := range []struct{ objects, projects int }{{10_000, 100}, {1_000_000, 100_000}} {
		b.Run(fmt.Sprintf("objects=%d/projects=%d", tc.objects, tc.projects), func(b *testing.B) {
			r, err := NewResidents(Config{Name: "bench", Size: tc.objects, Floor: 1}, newFakeClock())
			if err != nil {
				b.Fatal(err)
			}
			ctx := context.Background()
			for i := 0; i < tc.objects; i++ {
				if _, err := r.Spawn(ctx, fmt.Sprint("p", i%tc.projects), fmt.Sprintf("o%d", i)); err != nil {
					b.Fatal(err)
				}
			}
			names := make([]string, 1<<16)
			for i := range names {
				names[i] = fmt.Sprint("new", i)
			}
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				name := names[i&(len(names)-1)]
				i++
				ev, err := r.Spawn(ctx, "p1", name)
				if err != nil || ev.Reason != EvictOwnIdlest {
					b.Fatalf("spawn: %+v %v", ev, err)
				}
				if err := r.Remove(ev.Object); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkResidentsTouch(b *testing.B) {
	r, err := NewResidents(Config{Name: "bench", Size: 100_000}, newFakeClock())
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	names := make([]string, 100_000)
	for i := range names {
		names[i] = fmt.Sprint("o", i)
		if _, err := r.Spawn(ctx, fmt.Sprint("p", i%1000), names[i]); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if err := r.Touch(names[i%len(names)]); err != nil {
			b.Fatal(err)
		}
		i += 7919
	}
}

func BenchmarkRateLimiterAllowN(b *testing.B) {
	l := rate.NewLimiter(1e9, 1e9)
	now := time.Now()
	b.ReportAllocs()
	for b.Loop() {
		if !l.AllowN(now, 1) {
			b.Fatal("refused")
		}
	}
}

func BenchmarkRateLimiterAllow(b *testing.B) {
	l := rate.NewLimiter(1e9, 1e9)
	b.ReportAllocs()
	for b.Loop() {
		l.Allow()
	}
}

// BenchmarkRatesTake is our bucket at a fixed now (the twin of AllowN).
func BenchmarkRatesTake(b *testing.B) {
	r := NewRates(nil)
	r.SetLimits("p", Limits{RequestsPerSec: 1e9, WorkPerSec: 1e9})
	now := time.Now().UnixNano()
	b.ReportAllocs()
	for b.Loop() {
		if ok, _ := r.allow("p", func() int64 { return now }); !ok {
			b.Fatal("refused")
		}
	}
}

// BenchmarkRatesAllow includes the clock read.
func BenchmarkRatesAllow(b *testing.B) {
	r := NewRates(nil)
	r.SetLimits("p", Limits{RequestsPerSec: 1e9, WorkPerSec: 1e9})
	b.ReportAllocs()
	for b.Loop() {
		r.Allow("p")
	}
}

// BenchmarkPoolRefuseInto is the refused path with caller-owned storage
// (TryAcquireInto); compare it with BenchmarkPoolTryAcquireRelease.
func BenchmarkPoolRefuseInto(b *testing.B) {
	p, err := New(Config{Name: "bench", Size: 1}, nil)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := p.TryAcquire("hog"); err != nil {
		b.Fatal(err)
	}
	var rf Refusal
	b.ReportAllocs()
	for b.Loop() {
		if _, ok := p.TryAcquireInto("other", &rf); ok {
			b.Fatal("admitted")
		}
	}
}

// BenchmarkMapLookup100k is the reference for BenchmarkResidentsTouch: the
// bare string-keyed lookup Touch starts with, same 100,000 keys, same
// cache-hostile order. Touch cannot be cheaper than this.
func BenchmarkMapLookup100k(b *testing.B) {
	m := make(map[string]int32)
	names := make([]string, 100_000)
	for i := range names {
		names[i] = fmt.Sprint("o", i)
		m[names[i]] = int32(i)
	}
	b.ReportAllocs()
	i := 0
	var sink int32
	for b.Loop() {
		sink += m[names[i%len(names)]]
		i += 7919
	}
	_ = sink
}

// BenchmarkAtomicAdd is the research note's "atomic add" anchor for Touch.
func BenchmarkAtomicAdd(b *testing.B) {
	var n atomic.Int64
	b.ReportAllocs()
	for b.Loop() {
		n.Add(1)
	}
}
