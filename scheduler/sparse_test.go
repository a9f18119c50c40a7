// SPDX-License-Identifier: Apache-2.0

package scheduler

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// TestSparseQueuesCannotStarveTheRing: a queue enters its ring at the
// cursor while it is sparse (it has not had a turn for a round), and a name
// is sparse until its first turn. A stream of such queues, light
// participants or names made up one per request, whose arrivals kept up
// with dispatch was served all before the ring's other queues for as long
// as it lasted: a participant with work waiting had 1 turn in 1000. Now a
// queue with work waits at most a round of its ring's members between two
// turns, as in plain round robin. 300 rounds of random streams (fresh
// names, a few light participants reused, 0 to 2 arrivals a turn) beside 1
// to 3 backlogged participants, in every class.
func TestSparseQueuesCannotStarveTheRing(t *testing.T) {
	for round := range 300 {
		rng := rand.New(rand.NewPCG(uint64(round), 7))
		pol, c := Policy{Tier: TierNone}, P3
		switch round % 3 {
		case 1:
			pol, c = Policy{Tier: TierPro, Shares: 1000}, P1
		case 2:
			pol, c = Policy{Tier: TierLite, Shares: 1000}, P2
		}
		h := newHarness(t, Config{DefaultPolicy: pol})
		h.every = 97
		backlogged := 1 + rng.IntN(3)
		last := map[string]int{}
		for b := range backlogged {
			h.submit(fmt.Sprintf("big%d", b), 2000)
			last[fmt.Sprintf("big%d", b)] = 0
		}
		lights := 1 + rng.IntN(8)
		fresh, maxN, worst := 0, 0, 0
		for turn := 1; turn <= 1000; turn++ {
			for range rng.IntN(3) {
				if rng.IntN(2) == 0 {
					h.submit(fmt.Sprintf("fresh%d", fresh), 1)
					fresh++
				} else {
					h.submit(fmt.Sprintf("light%d", rng.IntN(lights)), 1)
				}
			}
			maxN = max(maxN, h.s.rings[c].n)
			who, got, tk := h.step()
			if tk == nil || got != c {
				t.Fatalf("round %d: turn %d went to %q under %v, want a turn of %v", round, turn, who, got, c)
			}
			tk.Done(1)
			if prev, ok := last[who]; ok {
				worst = max(worst, turn-prev)
				last[who] = turn
			}
		}
		for _, prev := range last {
			worst = max(worst, 1000-prev)
		}
		if worst > maxN+1 {
			t.Fatalf("round %d (%v, %d backlogged, %d lights, %d fresh names): a backlogged participant waited %d turns, more than a round of the ring's members (%d at most)",
				round, c, backlogged, lights, fresh, worst, maxN)
		}
	}
}
