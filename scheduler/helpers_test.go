// SPDX-License-Identifier: Apache-2.0

package scheduler

import (
	"slices"
	"testing"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// fakeClock is a settable clock; tests move it explicitly.
type fakeClock = testutil.FakeClock

func newFakeClock() *fakeClock { return testutil.NewFakeClock() }

// harness drives the deterministic core: no goroutines, explicit time.
type harness struct {
	t     testing.TB
	s     *Scheduler
	clk   *fakeClock
	every int // check invariants every this many steps (1 = always)
	steps int
}

func newHarness(t testing.TB, cfg Config) *harness {
	t.Helper()
	clk := newFakeClock()
	s, err := New(cfg, clk)
	if err != nil {
		t.Fatal(err)
	}
	return &harness{t: t, s: s, clk: clk, every: 1}
}

// step makes one decision at the fake clock's now and returns who went out
// under which class ("" if nothing did).
func (h *harness) step() (string, Class, *Ticket) {
	h.t.Helper()
	tk := h.s.dispatch(h.s.now())
	if h.steps++; h.steps%h.every == 0 {
		checkInvariants(h.t, h.s)
	}
	if tk == nil {
		return "", 0, nil
	}
	return h.name(tk), tk.class, tk
}

func (h *harness) name(tk *Ticket) string {
	h.s.mu.Lock()
	defer h.s.mu.Unlock()
	return h.s.cold[tk.pid].name
}

func (h *harness) submit(who string, n int) []*Ticket {
	out := make([]*Ticket, n)
	for i := range out {
		out[i] = h.s.Submit(who)
	}
	if h.every == 1 {
		checkInvariants(h.t, h.s)
	}
	return out
}

// balances returns who's P1 and P2 balances refilled to now.
func (h *harness) balances(who string) (p1, p2 float64) {
	for _, p := range h.s.Snapshot().Participants {
		if p.Participant == who {
			return p.P1, p.P2
		}
	}
	h.t.Fatalf("participant %q unknown", who)
	return 0, 0
}

// checkInvariants verifies the structural invariants the O(1) decision
// relies on, against a naive recount.
func checkInvariants(t testing.TB, s *Scheduler) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	var ringN [4]int
	timerSet := make(map[timer]bool)
	for _, tm := range slices.Concat(s.heapLocked(), timersInOrder(s)) {
		timerSet[tm] = true
	}
	inFlight, engaged, held := 0, 0, 0
	for pid := range s.hot {
		q, qc := &s.hot[pid], &s.cold[pid]
		if !q.live() {
			continue
		}
		if got := s.byName[qc.name]; got != int32(pid) {
			t.Fatalf("%s: byName %d, want %d", qc.name, got, pid)
		}
		n := 0
		var prev *Ticket
		for tk := q.head; tk != nil; tk = tk.next {
			if (prev != nil && tk.prev != prev) || tk.state != ticketQueued || tk.pid != int32(pid) {
				t.Fatalf("%s: queue links broken at %d", qc.name, n)
			}
			prev = tk
			n++
		}
		if qc.tail != prev || int(q.queue) != n {
			t.Fatalf("%s: queue=%d, counted %d", qc.name, q.queue, n)
		}
		inFlight += int(q.inflight)
		if qc.engaged {
			engaged++
		}
		if qc.held {
			held++
		}
		if (n > 0 || q.inflight > 0) && !qc.engaged && s.cfg.MaxInFlight > 0 {
			t.Fatalf("%s: with work, not engaged", qc.name)
		}
		if q.inflight < 0 {
			t.Fatalf("%s: %d in flight", qc.name, q.inflight)
		}
		if n == 0 {
			if q.ring != 0 || q.due != none {
				t.Fatalf("%s: empty queue in ring %d / parked until %d", qc.name, q.ring, q.due)
			}
			continue
		}
		if q.ring == 0 {
			t.Fatalf("%s: queue with work in no ring", qc.name)
		}
		ringN[q.ring]++
		// Balances are as of q.last: the ring matches them exactly.
		if c := classOf(q); c != Class(q.ring) {
			t.Fatalf("%s: in ring %v but balances (%.3f,%.3f) support %v", qc.name, q.ring, q.p1, q.p2, c)
		}
		if due := s.riseAt(q, Class(q.ring)); due != q.due {
			t.Fatalf("%s: rises at %d, parked until %d", qc.name, due, q.due)
		}
		if q.due != none && !timerSet[timer{due: q.due, pid: int32(pid)}] {
			t.Fatalf("%s: parked until %d with no timer entry", qc.name, q.due)
		}
	}
	if inFlight != s.inFlight {
		t.Fatalf("inFlight %d, participants sum %d", s.inFlight, inFlight)
	}
	if held != s.holds || held > s.reserve {
		t.Fatalf("holds %d, participants held %d, at most %d", s.holds, held, s.reserve)
	}
	if engaged != s.engaged {
		t.Fatalf("engaged %d, participants engaged %d", s.engaged, engaged)
	}
	for c := P1; c <= P3; c++ {
		r := s.rings[c]
		if r.n != ringN[c] {
			t.Fatalf("ring %v: n=%d, members %d", c, r.n, ringN[c])
		}
		k := 0
		for w, f := range map[uint8]*fifo[int32]{inBack: &r.back, inFront: &r.front} {
			live := 0
			for p := f.head; p != f.tail; p++ {
				pid := f.buf[p&f.mask()]
				if pid == gone {
					continue
				}
				if q := &s.hot[pid]; Class(q.ring) != c || q.where != w || q.slot != p {
					t.Fatalf("ring %v: entry of %d at %d, record says ring %v fifo %d slot %d", c, pid, p, q.ring, q.where, q.slot)
				}
				live++
			}
			if live != f.live {
				t.Fatalf("ring %v fifo %d: %d live entries, counted %d", c, w, live, f.live)
			}
			k += live
		}
		if k != r.n {
			t.Fatalf("ring %v: %d entries, n=%d", c, k, r.n)
		}
	}
	stale := 0
	inOrder := timersInOrder(s)
	for i, tm := range inOrder {
		if q := &s.hot[tm.pid]; q.due != tm.due || !q.live() {
			stale++
		}
		if i > 0 && inOrder[i-1].due > tm.due {
			t.Fatalf("timers set in due order out of order at %d", i)
		}
	}
	heap := s.heapLocked()
	for i, tm := range heap {
		if q := &s.hot[tm.pid]; q.due != tm.due || !q.live() {
			stale++
		}
		if i > 0 && heap[(i-1)/4].due > tm.due {
			t.Fatalf("timer heap order broken at %d", i)
		}
	}
	// Duplicates of a live entry count once as live, so stale may be below
	// the running count but never above it.
	if stale > s.staleTimers {
		t.Fatalf("%d stale timers, counted %d", stale, s.staleTimers)
	}
}

// timersInOrder lists the FIFO of timers set in due order, head first.
func timersInOrder(s *Scheduler) []timer {
	r := &s.inOrder
	out := make([]timer, 0, r.live)
	for p := r.head; p != r.tail; p++ {
		out = append(out, r.buf[p&r.mask()])
	}
	return out
}
