// SPDX-License-Identifier: Apache-2.0

package scheduler

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// TestTimersComeDueInOrderWhateverOrderTheyAreSet sets timers mostly in
// due order (the FIFO) and partly not (the heap), sets them again and
// again (the old entries go stale and are compacted away) and deletes
// some, then takes them at increasing instants: each live timer comes out
// once, at its instant or later and never before, in due order.
func TestTimersComeDueInOrderWhateverOrderTheyAreSet(t *testing.T) {
	s, err := New(Config{}, newFakeClock())
	if err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	const n, rounds = 300, 5
	for i := range n {
		s.lookupLocked(fmt.Sprint("p", i), 0)
	}
	rng := rand.New(rand.NewPCG(3, 4))
	want := make(map[int32]int64, n)
	for round := range rounds {
		for pid := range int32(n) {
			due := int64(round*n+int(pid)) * 10
			if rng.IntN(3) == 0 {
				due = rng.Int64N(rounds * n * 10)
			}
			s.timerSetLocked(pid, due)
			want[pid] = due
		}
	}
	for pid := int32(0); pid < n; pid += 7 {
		s.timerDelLocked(pid)
		delete(want, pid)
	}
	if len(s.heapLocked()) == 0 || s.inOrder.live == 0 {
		t.Fatalf("setup: %d in the heap, %d in order; want both used", len(s.heapLocked()), s.inOrder.live)
	}
	if entries := len(s.heapLocked()) + s.inOrder.live; entries >= rounds*n {
		t.Fatalf("%d entries for %d timers set: stale ones were never compacted", entries, rounds*n)
	}
	dues := make([]int64, 0, len(want))
	for _, d := range want {
		dues = append(dues, d)
	}
	slices.Sort(dues)
	last := int64(-1)
	for _, now := range slices.Compact(dues) {
		for pid := s.popDueLocked(now); pid != none; pid = s.popDueLocked(now) {
			d, ok := want[pid]
			if !ok {
				t.Fatalf("participant %d came due twice, or after its timer was deleted", pid)
			}
			if d != now || d < last {
				t.Fatalf("participant %d due at %d came out at %d (previous due %d)", pid, d, now, last)
			}
			last = d
			delete(want, pid)
		}
	}
	if len(want) != 0 {
		t.Fatalf("%d timers never came due: %v", len(want), want)
	}
}
