// SPDX-License-Identifier: Apache-2.0

package scheduler

import (
	"fmt"
	"slices"
	"testing"
	"time"
)

// TestRingSqueezesTombstonesAndKeepsTurnOrder fills a ring's array, empties
// every other queue from the middle, and adds queues until the array is
// full again: the tombstones are squeezed out (not grown around), every
// moved entry's record follows it, and the turns keep arrival order.
func TestRingSqueezesTombstonesAndKeepsTurnOrder(t *testing.T) {
	h := newHarness(t, Config{})
	var first []*Ticket
	for i := range 64 {
		first = append(first, h.submit(fmt.Sprintf("a%02d", i), 1)[0])
	}
	front := &h.s.rings[P3].front
	if len(front.buf) != 64 || front.live != 64 {
		t.Fatalf("setup: %d new queues in a front array of %d with %d live", 64, len(front.buf), front.live)
	}
	var want []string
	for i, tk := range first {
		if i%2 == 0 {
			tk.Done(1) // withdrawn: a tombstone in the middle
		} else {
			want = append(want, fmt.Sprintf("a%02d:P3", i))
		}
	}
	checkInvariants(t, h.s)
	for i := range 32 {
		h.submit(fmt.Sprintf("b%02d", i), 1)
		want = append(want, fmt.Sprintf("b%02d:P3", i))
	}
	if len(front.buf) != 64 || int(front.tail-front.head) != 64 {
		t.Fatalf("array of %d holding %d entries, want the 64 squeezed in place", len(front.buf), front.tail-front.head)
	}
	if got := h.drain(64); !slices.Equal(got, want) {
		t.Fatalf("turns after squeezing:\ngot  %v\nwant %v", got, want)
	}
}

// TestRingsAtPrefetchScale runs the decision with enough participants that
// records are prefetched, in the P1/P2 mix of the benchmarks, and checks
// that every request goes out once with the invariants intact.
func TestRingsAtPrefetchScale(t *testing.T) {
	const n, each = prefetchFrom + 500, 3
	h := newHarness(t, Config{P1Rate: 10, P1Burst: 1, P2Rate: 10, P2Burst: 1, DefaultPolicy: pro(1)})
	h.every = 2000
	for i := range n {
		h.submit(fmt.Sprint("p", i), each)
	}
	turns := make(map[string]int, n)
	for range n * each {
		who, c, _ := h.step()
		if c == 0 {
			t.Fatal("nothing dispatched with work queued")
		}
		turns[who]++
		h.clk.Advance(time.Second / (20 * n)) // half a credit of each bucket per round
	}
	if _, c, _ := h.step(); c != 0 {
		t.Fatal("dispatched more than was submitted")
	}
	for who, k := range turns {
		if k != each {
			t.Fatalf("%s went out %d times, want %d", who, k, each)
		}
	}
	checkInvariants(t, h.s)
}
