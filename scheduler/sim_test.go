// SPDX-License-Identifier: Apache-2.0

package scheduler

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/pools"
)

// jain is Jain's fairness index (Σx)²/(nΣx²): 1 when all equal, 1/n when one
// takes everything.
func jain(xs []float64) float64 {
	var s, s2 float64
	for _, x := range xs {
		s += x
		s2 += x * x
	}
	if s2 == 0 {
		return 1
	}
	return s * s / (float64(len(xs)) * s2)
}

// naiveClass is the oracle for the class decision: scan every participant,
// refill a copy of its buckets to now, and take the best class any queue
// with work supports, among the queues the server has room for (naiveRoom).
func naiveClass(s *Scheduler, now int64) Class {
	s.mu.Lock()
	defer s.mu.Unlock()
	best := Class(0)
	for pid, q := range s.hot {
		if !q.live() || q.queue == 0 || !naiveRoom(s, pid, now) {
			continue
		}
		cp := q
		s.refillLocked(&cp, now)
		if c := classOf(&cp); best == 0 || c < best {
			best = c
		}
	}
	return best
}

// naiveRoom is the oracle for the places: whether pid's queue may have a
// place at now. Below the last places (the floor of MaxInFlight,
// pools.DefaultFloor) every queue may. In them, a participant under its
// share (pools.Share of MaxInFlight among the participants with work queued
// or in flight or whose last request ended within Window, counted here)
// may; one at or over it only if no participant under its share has work
// queued and the places not yet taken outnumber those kept (cold.held
// until cold.holdUntil).
func naiveRoom(s *Scheduler, pid int, now int64) bool {
	max := s.cfg.MaxInFlight
	floor := pools.DefaultFloor(max)
	if max == 0 || s.inFlight < max-floor {
		return true
	}
	if s.inFlight >= max {
		return false
	}
	engaged, held := 0, 0
	for o := range s.hot {
		q, qc := &s.hot[o], &s.cold[o]
		if !q.live() {
			continue
		}
		if q.queue > 0 || q.inflight > 0 || qc.engaged && now-qc.idleAt < int64(s.cfg.Window) {
			engaged++
		}
		if qc.held && qc.holdUntil > now {
			held++
		}
	}
	share := pools.Share(max, floor, engaged)
	if int(s.hot[pid].inflight) < share {
		return true
	}
	for o := range s.hot {
		if q := &s.hot[o]; q.live() && q.queue > 0 && int(q.inflight) < share {
			return false
		}
	}
	return s.inFlight+held < max
}

type simTicket struct {
	tk      *Ticket
	who     int
	sub     time.Duration
	dispAt  time.Duration
	service time.Duration
}

// TestSimulationNoStarvationAndFairTurns runs a seeded discrete-event
// simulation: 50 participants with random tiers and shares, Poisson arrivals,
// random service times (cost = service time / mean), a server with 8 slots,
// plus two groups that stay backlogged throughout. It checks the decision
// against the naive oracle at every step, that every request is dispatched
// and completed, that waits of the non-backlogged participants stay bounded,
// and that turns within each backlogged group are fair.
func TestSimulationNoStarvationAndFairTurns(t *testing.T) {
	for _, seed := range []uint64{1, 2, 3} {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) { simulate(t, seed) })
	}
}

func simulate(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	const (
		slots    = 8
		mean     = 2 * time.Millisecond // mean service time: capacity 4000/s
		duration = 20 * time.Second
		nRandom  = 38
		nGroup   = 6
		backlog  = 20
	)
	h := newHarness(t, Config{P1Rate: 5, P1Burst: 10, P2Rate: 10, P2Burst: 20, MaxInFlight: slots})
	h.every = 53
	start := h.clk.Now()
	now := func() time.Duration { return h.clk.Now().Sub(start) }

	names := make([]string, nRandom+2*nGroup)
	rate := make([]float64, nRandom) // arrivals/s
	nextArr := make([]time.Duration, nRandom)
	for i := range names {
		names[i] = fmt.Sprintf("p%02d", i)
		switch {
		case i < nRandom:
			h.s.SetPolicy(names[i], Policy{Tier: Tier(rng.IntN(3)), Shares: 1 + rng.IntN(5)})
			rate[i] = 10 + rng.Float64()*90 // total ~2100/s: half the capacity
			nextArr[i] = time.Duration(rng.ExpFloat64() / rate[i] * 1e9)
		case i < nRandom+nGroup: // group P: identical Pro, backlogged
			h.s.SetPolicy(names[i], pro(2))
		default: // group N: TierNone, backlogged
			h.s.SetPolicy(names[i], Policy{Tier: TierNone, Shares: 1 + i%3})
		}
	}
	isGroup := func(i int) bool { return i >= nRandom }

	var all []*simTicket
	byTicket := map[*Ticket]*simTicket{}
	submit := func(i int) {
		st := &simTicket{tk: h.s.Submit(names[i]), who: i, sub: now()}
		st.service = time.Duration((0.1 + rng.Float64()*1.8) * float64(mean))
		all = append(all, st)
		byTicket[st.tk] = st
	}
	for i := nRandom; i < len(names); i++ {
		for range backlog {
			submit(i)
		}
	}
	var running []*simTicket // sorted by completion time
	turns := make([][4]float64, len(names))
	steps := 0
	for {
		arriving := now() < duration
		// Completions due now.
		for len(running) > 0 && running[0].dispAt+running[0].service <= now() {
			st := running[0]
			running = running[1:]
			st.tk.Done(float64(st.service) / float64(mean))
		}
		for i := range nRandom {
			for arriving && nextArr[i] <= now() {
				submit(i)
				nextArr[i] += time.Duration(rng.ExpFloat64() / rate[i] * 1e9)
			}
		}
		// Dispatch while there is room, checking each decision.
		for {
			want := naiveClass(h.s, h.s.now())
			who, c, tk := h.step()
			steps++
			if tk == nil {
				if want != 0 && len(running) < slots {
					t.Fatalf("t=%v: nothing dispatched with room and %v work waiting", now(), want)
				}
				break
			}
			if c != want {
				t.Fatalf("t=%v: %s dispatched as %v, oracle says %v", now(), who, c, want)
			}
			st := byTicket[tk]
			st.dispAt = now()
			turns[st.who][c]++
			i, _ := slices.BinarySearchFunc(running, st.dispAt+st.service, func(r *simTicket, end time.Duration) int {
				return int(r.dispAt + r.service - end)
			})
			running = slices.Insert(running, i, st)
			if arriving && isGroup(st.who) {
				submit(st.who)
			}
		}
		// Advance to the next event.
		next := time.Duration(-1)
		if len(running) > 0 {
			next = running[0].dispAt + running[0].service
		}
		for i := range nRandom {
			if arriving && (next < 0 || nextArr[i] < next) {
				next = nextArr[i]
			}
		}
		if next < 0 {
			break
		}
		h.clk.Advance(next - now())
	}
	checkInvariants(t, h.s)

	var maxWait time.Duration
	for _, st := range all {
		if st.tk.state != ticketDone {
			t.Fatalf("%s: request submitted at %v never completed (state %d)", names[st.who], st.sub, st.tk.state)
		}
		if w := st.tk.Waited(); !isGroup(st.who) && w > maxWait {
			maxWait = w
		}
	}
	// The random participants offer half the capacity; whatever their tier,
	// nobody may wait anywhere near the run length.
	if maxWait > time.Second {
		t.Errorf("max wait of a non-backlogged request %v", maxWait)
	}
	var gp, gn []float64
	var classes [4]float64
	for i := nRandom; i < len(names); i++ {
		tot := turns[i][1] + turns[i][2] + turns[i][3]
		if i < nRandom+nGroup {
			gp = append(gp, tot)
		} else {
			gn = append(gn, turns[i][3])
		}
		for c := range classes {
			classes[c] += turns[i][c]
		}
	}
	jp, jn := jain(gp), jain(gn)
	t.Logf("seed: %d requests, %d steps, max wait %v; group Pro turns %v J=%.4f; group None P3 turns %v J=%.4f",
		len(all), steps, maxWait, gp, jp, gn, jn)
	if jp < 0.99 || jn < 0.99 {
		t.Errorf("Jain index of turns: Pro group %.4f, None group %.4f; want >= 0.99", jp, jn)
	}
	if gn[0] == 0 {
		t.Error("TierNone group never ran: P3 passes did not happen")
	}
}

// TestSimulationP1TurnsArePerParticipant keeps ten Pro participants with
// 1..10 shares in P1 the whole run (cheap, random-cost work) next to random
// others, and checks their P1 turns are equal whatever their shares.
func TestSimulationP1TurnsArePerParticipant(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	h := newHarness(t, Config{P1Rate: 400, P1Burst: 50, MaxInFlight: 4})
	h.every = 31
	for i := range 10 {
		h.s.SetPolicy(fmt.Sprint("g", i), pro(i+1))
		h.submit(fmt.Sprint("g", i), 5)
	}
	turns := map[string]float64{}
	var running []*Ticket
	for range 20_000 {
		if rng.IntN(4) == 0 {
			h.submit(fmt.Sprint("x", rng.IntN(20)), 1) // TierNone noise
		}
		who, c, tk := h.step()
		if tk == nil {
			running[0].Done(0.5 + rng.Float64())
			running = running[1:]
			h.clk.Advance(250 * time.Microsecond)
			continue
		}
		running = append(running, tk)
		if who[0] == 'g' {
			if c != P1 {
				t.Fatalf("%s ran as %v: setup must keep the group in P1", who, c)
			}
			turns[who]++
			h.submit(who, 1)
		}
	}
	var xs []float64
	for i := range 10 {
		xs = append(xs, turns[fmt.Sprint("g", i)])
	}
	j := jain(xs)
	t.Logf("P1 turns by shares 1..10: %v, J=%.4f", xs, j)
	if j < 0.99 {
		t.Fatalf("P1 turns by shares 1..10: %v, J=%.4f", xs, j)
	}
}
