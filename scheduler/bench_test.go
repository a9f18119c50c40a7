// SPDX-License-Identifier: Apache-2.0

package scheduler

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/clock"
)

// requeueLocked puts a completed ticket back at the tail of its queue, so a
// benchmark keeps every queue backlogged without allocating tickets.
func (s *Scheduler) requeueLocked(t *Ticket, now int64) {
	if t.ready != nil {
		<-t.ready
	}
	t.state, t.enq, t.class = ticketQueued, now, 0
	q, qc := &s.hot[t.pid], &s.cold[t.pid]
	if qc.tail == nil {
		q.head = t
	} else {
		qc.tail.next, t.prev = t, qc.tail
	}
	qc.tail = t
	q.queue++
	if q.queue == 1 {
		s.engageLocked(t.pid, now) // as Submit
		s.placeLocked(t.pid, now)
	}
}

// backlogged returns a scheduler with n participants created in memory order
// but queued in shuffled order (rings are then cache-hostile, as arrival
// order is), each with two requests waiting.
func backlogged(b *testing.B, n int, pol Policy) *Scheduler {
	s, err := New(Config{DefaultPolicy: pol}, newFakeClock())
	if err != nil {
		b.Fatal(err)
	}
	names := make([]string, n)
	s.mu.Lock()
	for i := range names {
		names[i] = fmt.Sprintf("project-%06d", i)
		s.lookupLocked(names[i], 0)
	}
	s.mu.Unlock()
	rng := rand.New(rand.NewPCG(1, 2))
	rng.Shuffle(n, func(i, j int) { names[i], names[j] = names[j], names[i] })
	for _, name := range names {
		s.Submit(name)
		s.Submit(name)
	}
	return s
}

// The P1/P2 mix of BenchmarkDecision and BenchmarkDispatch: buckets of one
// credit, and a clock that advances so that each participant refills half
// a P1 credit and half a P2 credit per round, whatever n. Queues keep
// dropping between P1 and P2 and being relinked by their timers, the same
// mix at every n.
func mixScheduler(b *testing.B, n int) (s *Scheduler, dt int64) {
	s = backlogged(b, n, pro(1))
	s.cfg.P1Burst, s.cfg.P2Burst = 1, 1
	s.cfg.P1Rate, s.cfg.P2Rate = 10, 10
	return s, int64(0.5 / (s.cfg.P1Rate * float64(n)) * 1e9)
}

// BenchmarkDecision measures the decision alone, with n participants
// waiting: relink the due timers, choose the class and the queue at its
// cursor, spend the flat credit, move the cursor and re-place the queue.
// The queue keeps its tickets (nothing is taken off it), so no ticket and
// no cold record is touched: this is the part whose cost depends on n.
func BenchmarkDecision(b *testing.B) {
	for _, n := range []int{10, 1000, 100_000} {
		b.Run(fmt.Sprint("n=", n), func(b *testing.B) {
			s, dt := mixScheduler(b, n)
			now := int64(0)
			decide := func() {
				now += dt
				s.mu.Lock()
				pid, c := s.pickLocked(now)
				s.chargeLocked(pid, c, now)
				s.mu.Unlock()
			}
			d0 := timeSteady(b, s, n, decide)
			b.ReportMetric(float64(s.dispatched[P1]-d0[P1])/float64(b.N), "P1-frac")
		})
	}
}

// timeSteady runs op 4n times to reach the steady state, then times it b.N
// times and reports the visits and skips per operation; it returns the
// dispatches by class before the timed part.
func timeSteady(b *testing.B, s *Scheduler, n int, op func()) [4]uint64 {
	for range 4 * n {
		op()
	}
	v0, k0, d0 := s.visits, s.skips, s.dispatched
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		op()
	}
	b.StopTimer()
	reportVisits(b, s, v0, k0)
	return d0
}

// reportVisits reports per operation the queue records examined (S1: at
// most 2 amortized) and, apart, the ring tombstones the head passed over,
// which read only the ring's array.
func reportVisits(b *testing.B, s *Scheduler, v0, k0 uint64) {
	b.ReportMetric(float64(s.visits-v0)/float64(b.N), "visits/op")
	b.ReportMetric(float64(s.skips-k0)/float64(b.N), "skips/op")
}

// BenchmarkDispatch measures one dispatch decision plus the completion and
// re-queue that keep the queue backlogged, with n participants waiting, in
// the mix of BenchmarkDecision. Nobody waits on the tickets, so no channel
// is involved; BenchmarkDispatchNotify adds that.
func BenchmarkDispatch(b *testing.B) {
	for _, n := range []int{10, 1000, 100_000} {
		b.Run(fmt.Sprint("n=", n), func(b *testing.B) { benchDispatch(b, n, false) })
	}
}

// BenchmarkFlat is the flatness claim measured as a ratio in one run:
// schedulers of 10, 1k and 100k participants in the mix of
// BenchmarkDecision and BenchmarkDispatch take turns, one slice of
// decisions (or dispatches) each per round, so the machine's load moves
// every size alike. It reports each size's ns per operation and the
// 100k/10 ratio, as medians over rounds, with the ratio's quartiles.
func BenchmarkFlat(b *testing.B) {
	for _, op := range []string{"decision", "dispatch"} {
		b.Run(op, func(b *testing.B) {
			sizes := []int{10, 1000, 100_000}
			steps := make([]func(), len(sizes))
			for i, n := range sizes {
				s, dt := mixScheduler(b, n)
				now := int64(0)
				steps[i] = func() {
					now += dt
					s.mu.Lock()
					if op == "decision" {
						pid, c := s.pickLocked(now)
						s.chargeLocked(pid, c, now)
					} else {
						tk := s.dispatchLocked(now)
						s.doneLocked(tk, 1, now)
						s.requeueLocked(tk, now)
					}
					s.mu.Unlock()
				}
				for range 4 * n { // reach the steady state before timing
					steps[i]()
				}
			}
			const slice = 20_000
			per := make([][]float64, len(sizes))
			for i := range per {
				per[i] = make([]float64, 0, b.N)
			}
			ratios := make([]float64, 0, b.N)
			b.ResetTimer()
			for range b.N {
				var ns []float64 // this round's ns/op, by size
				for _, step := range steps {
					start := time.Now()
					for range slice {
						step()
					}
					ns = append(ns, float64(time.Since(start).Nanoseconds())/slice)
				}
				for i := range ns {
					per[i] = append(per[i], ns[i])
				}
				ratios = append(ratios, ns[len(ns)-1]/ns[0])
			}
			b.StopTimer()
			for i, n := range sizes {
				b.ReportMetric(quantile(per[i], 0.5), fmt.Sprintf("ns/op@%d", n))
			}
			b.ReportMetric(quantile(ratios, 0.25), "ratio-q1")
			b.ReportMetric(quantile(ratios, 0.5), "ratio-median")
			b.ReportMetric(quantile(ratios, 0.75), "ratio-q3")
			b.ReportMetric(0, "ns/op") // a round is not an operation
		})
	}
}

// quantile returns the q-quantile of xs (nearest rank), sorting xs.
func quantile(xs []float64, q float64) float64 {
	slices.Sort(xs)
	return xs[min(int(q*float64(len(xs))), len(xs)-1)]
}

// BenchmarkDispatchNotify is BenchmarkDispatch with a waiter's channel on
// every ticket: the dispatch sends on it and the re-queue receives, as a
// blocked Wait would.
func BenchmarkDispatchNotify(b *testing.B) {
	for _, n := range []int{10, 1000, 100_000} {
		b.Run(fmt.Sprint("n=", n), func(b *testing.B) { benchDispatch(b, n, true) })
	}
}

func benchDispatch(b *testing.B, n int, notify bool) {
	s, dt := mixScheduler(b, n)
	if notify {
		s.mu.Lock()
		for pid := range s.hot {
			for t := s.hot[pid].head; t != nil; t = t.next {
				t.ready = make(chan struct{}, 1)
			}
		}
		s.mu.Unlock()
	}
	now := int64(0)
	step := func() {
		now += dt
		s.mu.Lock()
		tk := s.dispatchLocked(now)
		s.doneLocked(tk, 1, now)
		s.requeueLocked(tk, now)
		s.mu.Unlock()
	}
	d0 := timeSteady(b, s, n, step)
	b.ReportMetric(float64(s.dispatched[P1]-d0[P1])/float64(b.N), "P1-frac")
	b.ReportMetric(float64(len(s.heapLocked())+s.inOrder.live), "parked")
	b.ReportMetric(float64(len(s.heapLocked())), "in-heap")
}

// BenchmarkDispatchPlaces is BenchmarkDispatch with the places bounded
// (MaxInFlight 64) and always in their last ones: 64 requests in flight,
// the oldest done before each dispatch, so that every decision is made
// with 63 in flight, where a participant holding its share of the places
// is passed over for one under it (pickReservedLocked). With 10
// participants each holds its share (6) or near it, the case where queues
// are passed over; with more, fewer than one place each.
func BenchmarkDispatchPlaces(b *testing.B) {
	for _, n := range []int{10, 1000, 100_000} {
		b.Run(fmt.Sprint("n=", n), func(b *testing.B) {
			// The mix of mixScheduler, with enough requests queued
			// that 64 can always be in flight.
			const max = 64
			s, err := New(Config{DefaultPolicy: pro(1), MaxInFlight: max, P1Burst: 1, P2Burst: 1, P1Rate: 10, P2Rate: 10}, newFakeClock())
			if err != nil {
				b.Fatal(err)
			}
			for i := range n {
				for range 1 + 2*max/n {
					s.Submit(fmt.Sprintf("project-%06d", i))
				}
			}
			dt := int64(0.5 / (s.cfg.P1Rate * float64(n)) * 1e9)
			running := make([]*Ticket, 0, max)
			now := int64(0)
			step := func() {
				now += dt
				s.mu.Lock()
				if len(running) == max {
					tk := running[0]
					running = append(running[:0], running[1:]...)
					s.doneLocked(tk, 1, now)
					s.requeueLocked(tk, now)
				}
				if tk := s.dispatchLocked(now); tk != nil {
					running = append(running, tk)
				}
				s.mu.Unlock()
			}
			d0 := timeSteady(b, s, n, step)
			if d := s.dispatched[P1] + s.dispatched[P2] + s.dispatched[P3] - d0[P1] - d0[P2] - d0[P3]; d != uint64(b.N) {
				b.Fatalf("%d dispatches in %d steps", d, b.N)
			}
		})
	}
}

// BenchmarkDispatchRingOnly is the decision with no class changes at all:
// every bucket is spent and the clock stands still, so every dispatch is a
// P3 turn on the ring.
func BenchmarkDispatchRingOnly(b *testing.B) {
	for _, n := range []int{10, 1000, 100_000} {
		b.Run(fmt.Sprint("n=", n), func(b *testing.B) {
			s := backlogged(b, n, Policy{Tier: TierNone})
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				s.mu.Lock()
				tk := s.dispatchLocked(0)
				s.doneLocked(tk, 1, 0)
				s.requeueLocked(tk, 0)
				s.mu.Unlock()
			}
			b.StopTimer()
			reportVisits(b, s, 0, 0)
		})
	}
}

// BenchmarkDispatchStarved99 has 99% of n Pro queues deep in debt (parked in
// P3 with timers far in the future) and 1% holding P1 credit, refilled fast
// enough to stay there: each P1 decision must touch only the 1%.
func BenchmarkDispatchStarved99(b *testing.B) {
	for _, n := range []int{1000, 100_000} {
		b.Run(fmt.Sprint("n=", n), func(b *testing.B) {
			s := backlogged(b, n, pro(1))
			rich := 0
			s.mu.Lock()
			for pid := range s.hot {
				q := &s.hot[pid]
				if pid%100 == 0 {
					// A billion shares: a bucket that never runs dry in the run.
					q.shares = 1e9
					q.p1 = s.cfg.P1Burst * float64(q.shares)
					rich++
				} else {
					q.p1, q.p2 = -1e9, -1e9
				}
				s.placeLocked(int32(pid), 0)
			}
			s.mu.Unlock()
			now := int64(0)
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				now += 1000
				s.mu.Lock()
				tk := s.dispatchLocked(now)
				if tk.class != P1 {
					b.Fatalf("class %v", tk.class)
				}
				s.doneLocked(tk, 1, now)
				s.requeueLocked(tk, now)
				s.mu.Unlock()
			}
			b.StopTimer()
			reportVisits(b, s, 0, 0)
			b.ReportMetric(float64(s.rings[P1].n), "P1-ring")
			b.ReportMetric(float64(s.rings[P3].n), "P3-ring")
		})
	}
}

// BenchmarkNaiveScan is the O(n) reference the rings replace: scan every
// queue to decide the class (the naive oracle of the tests), at 100k.
func BenchmarkNaiveScan(b *testing.B) {
	s := backlogged(b, 100_000, pro(1))
	for range b.N {
		if naiveClass(s, 0) == 0 {
			b.Fatal("no work")
		}
	}
}

// BenchmarkSubmitWaitDone is the whole path through the public API and the
// Run loop, one client goroutine: Submit, Wait, Done. It includes the ticket
// allocation (one per request, not per dispatch) and the goroutine hand-off.
func BenchmarkSubmitWaitDone(b *testing.B) {
	for _, n := range []int{10, 100_000} {
		b.Run(fmt.Sprint("n=", n), func(b *testing.B) {
			s := backlogged(b, n, pro(1))
			s.clk = clock.System{}
			s.epoch = time.Now()
			ctx, cancel := contextForBench()
			defer cancel()
			go s.Run(ctx) //nolint:errcheck // stops with ctx
			// Drain the backlog so each iteration measures one request.
			for s.Snapshot().Dispatched[1]+s.Snapshot().Dispatched[2]+s.Snapshot().Dispatched[3] < uint64(2*n) {
				time.Sleep(time.Millisecond)
			}
			names := make([]string, n)
			for i := range names {
				names[i] = fmt.Sprintf("project-%06d", i)
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				tk := s.Submit(names[i%n])
				if _, err := tk.Wait(ctx); err != nil {
					b.Fatal(err)
				}
				tk.Done(1)
			}
		})
	}
}

func contextForBench() (context.Context, context.CancelFunc) {
	return context.WithCancel(context.Background())
}
