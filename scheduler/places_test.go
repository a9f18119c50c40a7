// SPDX-License-Identifier: Apache-2.0

package scheduler

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

// A participant whose requests are long (a stream, a long poll) took every
// place while it was alone. Another arrives with short requests, one after
// another, as a client that waits for each answer sends them. The first
// goes out on the first place a long request gives back, and from then on
// the place is kept for it between its requests (for Keep after each: its
// first, and then each sent within Keep of the end of the one before),
// while the long one waits with its queue full and its P1 credit unspent;
// Keep after the newcomer's last request, the long one takes the place
// back. A request that comes later than Keep after the one before finds
// its place taken, and nothing is kept after it. Before the places were
// divided, round robin gave every other freed place back to the long
// participant, where it stayed: the newcomer ran one request, then waited
// for the next long one to end. (One place is not divided: there the two
// take turns.)
func TestPlacesKeptFromALongParticipant(t *testing.T) {
	for _, max := range []int{2, 3, 8, 64} {
		t.Run(fmt.Sprint(max), func(t *testing.T) {
			h := newHarness(t, Config{MaxInFlight: max})
			h.s.SetPolicy("long", pro(1))
			long := h.submit("long", 3*max)
			for i := range max {
				if who, _, _ := h.step(); who != "long" {
					t.Fatalf("place %d: %q, want long (alone)", i, who)
				}
			}
			h.submit("short", 1)
			if who, _, _ := h.step(); who != "" {
				t.Fatalf("every place is held, yet %q went out", who)
			}
			long[0].Done(1) // one long request ends
			for i := range 100 {
				who, _, tk := h.step()
				if who != "short" {
					t.Fatalf("short request %d: %q went out, want short (long holds %d of %d places)", i, who, max-1, max)
				}
				if who, _, _ := h.step(); who != "" {
					t.Fatalf("short request %d in flight: %q went out past the last place", i, who)
				}
				h.clk.Advance(time.Millisecond)
				tk.Done(1)
				// Between two requests of the newcomer.
				h.clk.Advance(time.Duration(i%10) * time.Millisecond)
				if who, _, _ := h.step(); who != "" {
					t.Fatalf("after short request %d: %q went out, want the place kept", i, who)
				}
				if i < 99 {
					h.submit("short", 1)
				}
			}
			h.clk.Advance(DefaultKeep - 9*time.Millisecond - time.Nanosecond) // 9ms passed since the last ended
			if who, _, _ := h.step(); who != "" {
				t.Fatalf("within Keep: %q went out, want the place kept", who)
			}
			h.clk.Advance(time.Nanosecond)
			if who, _, _ := h.step(); who != "long" {
				t.Fatalf("Keep after the short ones: %q, want long", who)
			}
			// Later than Keep: the next long request's end lets it out,
			// and nothing is kept after it.
			h.clk.Advance(time.Millisecond)
			tk := h.submit("short", 1)[0]
			long[1].Done(1)
			if who, _, _ := h.step(); who != "short" {
				t.Fatalf("a late short request: %q went out, want short", who)
			}
			tk.Done(1)
			if who, _, _ := h.step(); who != "long" {
				t.Fatalf("after a late short request: %q went out, want long (nothing kept)", who)
			}
		})
	}
}

// The places follow the fair-share rule (pools.Admits over MaxInFlight, its
// floor and the share among the participants with work queued or in
// flight) at every decision, in random runs: random bounds (1 to 40
// places), participants of every tier, requests ended at random (some
// never: a participant that holds its places), arrivals in random order,
// queued requests given up, policies changed, idle participants swept.
// Each decision is the oracle's (naiveRoom, naiveClass): the class is the
// best any queue the places admit supports, nothing goes out while such a
// queue waits unless every place is taken, and what goes out was
// admitted.
func TestPlacesFollowTheRule(t *testing.T) {
	rounds := 2000
	if testing.Short() {
		rounds = 300
	}
	reserved, kept := 0, 0 // decisions made in the reserved places; free places kept from waiting work
	for round := range rounds {
		rng := rand.New(rand.NewPCG(uint64(round), 99))
		max := 1 + rng.IntN(40)
		h := newHarness(t, Config{MaxInFlight: max, P1Rate: 5, P1Burst: 5, P2Rate: 10, P2Burst: 10})
		h.every = 7
		n := 2 + rng.IntN(6)
		names := make([]string, n)
		keeps := make([]bool, n) // never ends its requests
		for i := range names {
			names[i] = fmt.Sprintf("p%d", i)
			h.s.SetPolicy(names[i], Policy{Tier: Tier(rng.IntN(3)), Shares: 1 + rng.IntN(3)})
			keeps[i] = rng.IntN(3) == 0
		}
		var running, submitted []*Ticket
		owner := map[*Ticket]int{}
		for range 200 {
			switch rng.IntN(7) {
			case 0: // arrivals
				i := rng.IntN(n)
				for _, tk := range h.submit(names[i], 1+rng.IntN(5)) {
					owner[tk] = i
					submitted = append(submitted, tk)
				}
			case 3: // a queued request given up (its Wait's context ended)
				if len(submitted) > 0 {
					if tk := submitted[rng.IntN(len(submitted))]; tk.state == ticketQueued {
						tk.Done(1)
					}
				}
			case 4: // a policy changed
				h.s.SetPolicy(names[rng.IntN(n)], Policy{Tier: Tier(rng.IntN(3)), Shares: 1 + rng.IntN(3)})
			case 5: // the loop's sweep (idle participants forgotten)
				h.s.mu.Lock()
				h.s.sweepLocked(h.s.now())
				h.s.mu.Unlock()
			case 1: // an end, not of a participant that keeps its places
				if len(running) > 0 {
					k := rng.IntN(len(running))
					if tk := running[k]; !keeps[owner[tk]] {
						tk.Done(rng.Float64() * 3)
						running = append(running[:k], running[k+1:]...)
					}
				}
			case 2:
				h.clk.Advance(time.Duration(rng.IntN(300)) * time.Millisecond)
			}
			for {
				now := h.s.now()
				want := naiveClass(h.s, now)
				h.s.mu.Lock()
				full, inRes := h.s.inFlight >= max, h.s.inFlight >= max-h.s.reserve
				admitted := map[string]bool{}
				for pid, q := range h.s.hot {
					if q.live() && naiveRoom(h.s, pid, now) {
						admitted[h.s.cold[pid].name] = true
					}
				}
				h.s.mu.Unlock()
				who, c, tk := h.step()
				if tk == nil {
					if want != 0 && !full {
						t.Fatalf("round %d (max %d): nothing went out, %v work the places admit waits", round, max, want)
					}
					h.s.mu.Lock()
					if !full && h.s.workLocked() {
						kept++ // work waits beside a free place kept for another
					}
					h.s.mu.Unlock()
					break
				}
				if c != want || !admitted[who] {
					t.Fatalf("round %d (max %d): %s went out as %v, the oracle says %v, admitted %v", round, max, who, c, want, admitted)
				}
				if inRes {
					reserved++
				}
				running = append(running, tk)
			}
		}
	}
	t.Logf("%d decisions in the last places, %d times a free place kept from waiting work", reserved, kept)
	if reserved < rounds || kept < rounds/10 {
		t.Fatalf("only %d decisions in the reserved places and %d places kept over %d rounds: the test misses its cases", reserved, kept, rounds)
	}
}

// A participant whose place was kept, and nothing more from it: once Keep
// and Window have passed it is forgotten by the sweep, as any idle
// participant whose buckets are full again, and its place is no longer
// kept.
func TestKeptPlaceThenForgotten(t *testing.T) {
	h := newHarness(t, Config{MaxInFlight: 4})
	tk := h.submit("a", 1)[0]
	if who, _, _ := h.step(); who != "a" {
		t.Fatalf("%q went out", who)
	}
	h.clk.Advance(time.Millisecond)
	tk.Done(1)
	h.s.mu.Lock()
	holds := h.s.holds
	h.s.mu.Unlock()
	if holds != 1 {
		t.Fatalf("%d places kept after a's first request ended, want 1", holds)
	}
	h.clk.Advance(2 * DefaultWindow)
	h.s.mu.Lock()
	h.s.sweepLocked(h.s.now())
	known, holds, engaged := len(h.s.byName), h.s.holds, h.s.engaged
	h.s.mu.Unlock()
	if known != 0 || holds != 0 || engaged != 0 {
		t.Fatalf("after the sweep: %d participants known, %d places kept, %d engaged; want none", known, holds, engaged)
	}
	checkInvariants(t, h.s)
}

// A client whose requests overlap (the next sent before the one before it
// ends, as several connections of one project do) counts as sending one
// after another however long its requests last: when its last one ends
// the place is kept for it, even though no request of it ever ended with
// nothing queued within Keep before the next.
func TestKeptPlaceOverlappingRequests(t *testing.T) {
	h := newHarness(t, Config{MaxInFlight: 4})
	h.submit("long", 8)
	for range 3 {
		h.step()
	}
	first := h.submit("short", 1)[0]
	if who, _, _ := h.step(); who != "short" {
		t.Fatalf("%q went out, want short", who)
	}
	h.clk.Advance(100 * time.Millisecond)
	second := h.submit("short", 1)[0] // while the first is under way
	h.clk.Advance(time.Millisecond)
	first.Done(1)
	if who, _, _ := h.step(); who != "short" {
		t.Fatalf("%q went out, want short's second request", who)
	}
	h.clk.Advance(100 * time.Millisecond)
	second.Done(1)
	if who, _, _ := h.step(); who != "" {
		t.Fatalf("%q went out, want the place kept for short", who)
	}
	h.clk.Advance(DefaultKeep)
	if who, _, _ := h.step(); who != "long" {
		t.Fatalf("Keep later: %q went out, want long", who)
	}
}
