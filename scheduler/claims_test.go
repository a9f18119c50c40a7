// SPDX-License-Identifier: Apache-2.0

package scheduler

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"
)

// pro and lite are shorthand policies.
func pro(shares int) Policy  { return Policy{Tier: TierPro, Shares: shares} }
func lite(shares int) Policy { return Policy{Tier: TierLite, Shares: shares} }

// drain dispatches n times at the current instant and returns "who:class"
// for each decision.
func (h *harness) drain(n int) []string {
	h.t.Helper()
	out := make([]string, 0, n)
	for range n {
		who, c, _ := h.step()
		out = append(out, who+":"+c.String())
	}
	return out
}

func TestQueuesAreFIFOPerParticipant(t *testing.T) {
	h := newHarness(t, Config{})
	a := h.submit("a", 5)
	b := h.submit("b", 5)
	var gotA, gotB []*Ticket
	for range 10 {
		_, _, tk := h.step()
		switch tk.pid {
		case a[0].pid:
			gotA = append(gotA, tk)
		default:
			gotB = append(gotB, tk)
		}
	}
	for i := range 5 {
		if gotA[i] != a[i] || gotB[i] != b[i] {
			t.Fatalf("dispatch %d out of arrival order", i)
		}
	}
}

func TestClassIsDecidedAtDispatchNotAtArrival(t *testing.T) {
	h := newHarness(t, Config{P1Rate: 1, P1Burst: 1, P2Rate: 1, P2Burst: 1, DefaultPolicy: pro(1)})
	tks := h.submit("a", 3) // all three arrive together, identically
	if c, _ := tks[0].class, 0; c != 0 {
		t.Fatalf("queued ticket already has class %v", c)
	}
	if got := h.drain(2); fmt.Sprint(got) != "[a:P1 a:P2]" {
		t.Fatalf("got %v: same arrival, classes must follow balances at dispatch", got)
	}
	// The third has waited through both buckets running dry; a credit landing
	// before its turn lifts it to P1.
	h.clk.Advance(time.Second)
	if got := h.drain(1); got[0] != "a:P1" {
		t.Fatalf("third request went out as %v, want P1 after refill", got[0])
	}
}

func TestClassSelectionP1ThenP2ThenP3(t *testing.T) {
	h := newHarness(t, Config{P1Rate: 1, P1Burst: 3, P2Rate: 1, P2Burst: 3})
	h.s.SetPolicy("p", pro(1))
	h.s.SetPolicy("l", lite(1))
	h.s.SetPolicy("n", Policy{Tier: TierNone, Shares: 5})
	h.submit("n", 10)
	h.submit("l", 10)
	h.submit("p", 10)
	got := h.drain(15)
	want := "[p:P1 p:P1 p:P1 " + // only p holds P1: l and n are ignored
		"l:P2 p:P2 l:P2 p:P2 l:P2 p:P2 " + // then P2 among l and p
		"n:P3 l:P3 p:P3 n:P3 l:P3 p:P3]" // then every queue with work
	if fmt.Sprint(got) != want {
		t.Fatalf("got  %v\nwant %v", got, want)
	}
}

func TestP3IsTheCreditTestSwitchedOff(t *testing.T) {
	h := newHarness(t, Config{P1Rate: 1, P1Burst: 1, P2Rate: 1, P2Burst: 1})
	h.s.SetPolicy("rich", pro(10))
	h.s.SetPolicy("lite", lite(1))
	// rich ends deep in debt in both buckets; debt does not exclude it from P3.
	first := h.submit("rich", 20)
	for range 20 {
		_, c, tk := h.step()
		if c != P3 {
			tk.Done(1000)
		}
	}
	for _, tk := range first {
		tk.Done(1)
	}
	if p1, p2 := h.balances("rich"); p1 > -100 || p2 > -100 {
		t.Fatalf("setup: rich balances %v %v not in debt", p1, p2)
	}
	h.submit("lite", 30)
	h.drain(1) // lite's one P2 credit
	h.submit("rich", 30)
	h.submit("none", 30)
	got := h.drain(30)
	count := map[string]int{}
	for i, g := range got {
		count[g]++
		if i >= 3 && g != got[i-3] {
			t.Fatalf("P3 not a strict rotation: %v", got)
		}
	}
	for _, w := range []string{"rich:P3", "lite:P3", "none:P3"} {
		if count[w] != 10 {
			t.Fatalf("P3 turns %v, want 10 each of rich, lite, none", count)
		}
	}
}

func TestQueueWithHundredWaitingCannotOccupyAClass(t *testing.T) {
	h := newHarness(t, Config{DefaultPolicy: pro(1)})
	h.submit("a", 100)
	h.submit("b", 3)
	h.submit("c", 3)
	got := h.drain(9)
	want := "[a:P1 b:P1 c:P1 a:P1 b:P1 c:P1 a:P1 b:P1 c:P1]"
	if fmt.Sprint(got) != want {
		t.Fatalf("got %v, want %v", got, want)
	}
}

func TestCursorResumesWhereThePreviousTurnLeftOff(t *testing.T) {
	h := newHarness(t, Config{})
	h.submit("a", 10)
	h.submit("b", 10)
	h.submit("c", 10)
	first := h.drain(2) // a, b
	// New work arriving for a queue already in the ring, and a fresh
	// decision, must not send the cursor back to the start.
	h.submit("a", 1)
	next := h.drain(4)
	if fmt.Sprint(first, next) != "[a:P3 b:P3] [c:P3 a:P3 b:P3 c:P3]" {
		t.Fatalf("got %v %v", first, next)
	}
}

func TestTurnsArePerParticipantNotPerShare(t *testing.T) {
	for _, tier := range []Tier{TierPro, TierNone} {
		t.Run(tier.String(), func(t *testing.T) {
			// Refill fast enough that both always hold P1 when Pro.
			h := newHarness(t, Config{P1Rate: 2000, P1Burst: 5})
			h.s.SetPolicy("one", Policy{Tier: tier, Shares: 1})
			h.s.SetPolicy("ten", Policy{Tier: tier, Shares: 10})
			h.submit("one", 1000)
			h.submit("ten", 1000)
			if tier == TierPro {
				p1one, _ := h.balances("one")
				p1ten, _ := h.balances("ten")
				if p1ten != 10*p1one {
					t.Fatalf("bucket sizes %v vs %v: shares must scale them", p1one, p1ten)
				}
			}
			turns := map[string]int{}
			for range 1000 {
				who, _, _ := h.step()
				turns[who]++
				h.clk.Advance(time.Millisecond)
			}
			if turns["one"] != 500 || turns["ten"] != 500 {
				t.Fatalf("turns %v: want 500 each", turns)
			}
		})
	}
}

func TestDroppingDownAndClimbingBackAreOneMechanism(t *testing.T) {
	h := newHarness(t, Config{P1Rate: 1, P1Burst: 2, P2Rate: 1, P2Burst: 2, DefaultPolicy: pro(1)})
	h.submit("a", 20)
	down := h.drain(6)
	if fmt.Sprint(down) != "[a:P1 a:P1 a:P2 a:P2 a:P3 a:P3]" {
		t.Fatalf("burst: %v", down)
	}
	// Work still waiting when credits land goes out at the higher class.
	h.clk.Advance(time.Second)
	up := h.drain(3)
	if fmt.Sprint(up) != "[a:P1 a:P2 a:P3]" {
		t.Fatalf("after one second of refill: %v", up)
	}
	// Half a credit is not a credit.
	h.clk.Advance(500 * time.Millisecond)
	if got := h.drain(1); got[0] != "a:P3" {
		t.Fatalf("after half a credit: %v", got)
	}
	h.clk.Advance(500 * time.Millisecond)
	if got := h.drain(1); got[0] != "a:P1" {
		t.Fatalf("after the rest of the credit: %v", got)
	}
}

// proWaitForP1 puts "me" (Pro, 1 share) into P1 debt d, lets `others` Pro
// participants with big budgets spend P1 flat out (one dispatch per ms) and
// returns how long me's next request waited for a P1 dispatch.
func proWaitForP1(t *testing.T, others int, d float64) time.Duration {
	h := newHarness(t, Config{P1Rate: 10, P1Burst: 1, P2Rate: 10, P2Burst: 1})
	h.every = 101
	h.s.SetPolicy("me", pro(1))
	h.submit("me", 2)
	for range 2 {
		_, _, tk := h.step()
		tk.Done(1 + d) // P1 then P2 into debt d
	}
	for i := range others {
		name := fmt.Sprintf("o%03d", i)
		h.s.SetPolicy(name, pro(1000))
		h.submit(name, 1000)
	}
	start := h.clk.Now()
	mine := h.submit("me", 1)[0]
	for i := 0; ; i++ {
		who, c, tk := h.step()
		if tk == mine {
			if c != P1 {
				t.Fatalf("me went out as %v", c)
			}
			return h.clk.Now().Sub(start)
		}
		if others > 0 && c != P1 {
			t.Fatalf("%s went out as %v: others must keep the server in P1", who, c)
		}
		h.clk.Advance(time.Millisecond)
		if i > 1_000_000 {
			t.Fatal("me never dispatched")
		}
	}
}

func TestProWaitIsBoundedByItsOwnP1Refill(t *testing.T) {
	const debt = 4.0
	// me's P1 is 1-1-debt = -debt; reaching 1 takes (1+debt)/rate.
	bound := time.Duration((1 + debt) / 10 * float64(time.Second))
	for _, others := range []int{1, 5, 200} {
		w := proWaitForP1(t, others, debt)
		if w < bound || w > bound+time.Millisecond {
			t.Errorf("%d others: waited %v, want its own refill time %v (+1 step)", others, w, bound)
		}
	}
}

func TestLiteWaitsForP1WorkToRunOut(t *testing.T) {
	h := newHarness(t, Config{P1Rate: 1, P1Burst: 3, P2Rate: 1, P2Burst: 10})
	h.s.SetPolicy("l", lite(10))
	h.s.SetPolicy("p", pro(1))
	h.submit("l", 5)
	h.submit("p", 5)
	got := h.drain(7)
	want := "[p:P1 p:P1 p:P1 l:P2 p:P2 l:P2 p:P2]"
	if fmt.Sprint(got) != want {
		t.Fatalf("got %v, want %v", got, want)
	}
}

func TestHeavyWorkIsNeverBlockedInAdvanceButSlowsItsOwnReturn(t *testing.T) {
	// returnAfter measures how long after one request of the given cost the
	// participant's next request goes out as P1 again, while b keeps the
	// server busy (one dispatch per ms).
	returnAfter := func(cost float64) (time.Duration, []string) {
		h := newHarness(t, Config{P1Rate: 10, P1Burst: 1.5, P2Rate: 10, P2Burst: 100, DefaultPolicy: pro(1)})
		h.submit("a", 1)
		_, _, tk := h.step()
		tk.Done(cost)
		h.every = 101
		h.submit("a", 6000)
		h.submit("b", 6000)
		var classes []string
		start := h.clk.Now()
		for range 100_000 {
			who, c, _ := h.step()
			if who == "a" {
				classes = append(classes, c.String())
				if c == P1 {
					return h.clk.Now().Sub(start), classes
				}
			}
			h.clk.Advance(time.Millisecond)
		}
		t.Fatalf("cost %v: a never returned to P1: %v", cost, classes)
		return 0, nil
	}
	light, lc := returnAfter(0.5)
	avg, _ := returnAfter(1)
	heavy, hc := returnAfter(50)
	if lc[0] != "P1" || light != 0 {
		t.Fatalf("light work: next requests %v after %v, want P1 at once (refund)", lc, light)
	}
	// Heavy: the following requests are not held back, they run at P2.
	if len(hc) < 3 || hc[0] != "P2" || hc[1] != "P2" {
		t.Fatalf("after heavy work: %v, want P2 dispatches while P1 repays", hc[:min(len(hc), 5)])
	}
	// P1 = 1.5-1-(cost-1); back at 1 after (0.5+cost-1)/10 s, give or take a step.
	for _, c := range []struct {
		got, want time.Duration
	}{{avg, 50 * time.Millisecond}, {heavy, 4950 * time.Millisecond}} {
		if c.got < c.want || c.got > c.want+time.Millisecond {
			t.Errorf("return to P1 after %v, want %v", c.got, c.want)
		}
	}
}

func TestCompletionIsChargedToTheBucketThatAdmittedIt(t *testing.T) {
	h := newHarness(t, Config{P1Rate: 1, P1Burst: 1, P2Rate: 1, P2Burst: 1, DefaultPolicy: pro(1)})
	h.submit("a", 3)
	_, c1, t1 := h.step()
	_, c2, t2 := h.step()
	_, c3, t3 := h.step()
	if c1 != P1 || c2 != P2 || c3 != P3 {
		t.Fatalf("classes %v %v %v", c1, c2, c3)
	}
	// The participant is now on P3; t1 still charges P1.
	t1.Done(5)
	if p1, p2 := h.balances("a"); p1 != -4 || p2 != 0 {
		t.Fatalf("after P1 ticket Done(5): p1=%v p2=%v, want -4 0", p1, p2)
	}
	t2.Done(0.25) // refunds three quarters to P2
	if p1, p2 := h.balances("a"); p1 != -4 || p2 != 0.75 {
		t.Fatalf("after P2 ticket Done(0.25): p1=%v p2=%v, want -4 0.75", p1, p2)
	}
	t3.Done(100) // P3 is charged to nothing
	if p1, p2 := h.balances("a"); p1 != -4 || p2 != 0.75 {
		t.Fatalf("after P3 ticket Done(100): p1=%v p2=%v", p1, p2)
	}
	t1.Done(1000) // only the first Done counts
	if p1, _ := h.balances("a"); p1 != -4 {
		t.Fatalf("second Done charged again: p1=%v", p1)
	}
	if s := h.s.Snapshot(); s.InFlight != 0 {
		t.Fatalf("in flight %d after all Done", s.InFlight)
	}
}

func TestRefundNeverOverfillsTheBucket(t *testing.T) {
	h := newHarness(t, Config{P1Rate: 1, P1Burst: 2, DefaultPolicy: pro(1)})
	h.submit("a", 1)
	_, _, tk := h.step()
	tk.Done(0)
	if p1, _ := h.balances("a"); p1 != 2 {
		t.Fatalf("p1=%v after refunding a free request, want the bucket size 2", p1)
	}
}

func TestSharesScaleRefillAndBucketSize(t *testing.T) {
	h := newHarness(t, Config{P1Rate: 2, P1Burst: 3, P2Rate: 5, P2Burst: 7})
	h.s.SetPolicy("a", pro(4))
	h.submit("a", 1)
	if p1, p2 := h.balances("a"); p1 != 12 || p2 != 28 {
		t.Fatalf("full buckets %v %v, want 12 28", p1, p2)
	}
	_, _, tk := h.step()
	tk.Done(1 + 20) // P1 now 12-1-20 = -9
	h.clk.Advance(time.Second)
	if p1, _ := h.balances("a"); p1 != -9+8 {
		t.Fatalf("p1=%v after 1s, want -1 (refill 2/s x 4 shares)", p1)
	}
	h.clk.Advance(time.Hour)
	if p1, p2 := h.balances("a"); p1 != 12 || p2 != 28 {
		t.Fatalf("refill overfilled: %v %v", p1, p2)
	}
}

func TestRefillDoesNotDependOnTheServer(t *testing.T) {
	// Same participant history, very different server load: same balance.
	bal := func(busy int) float64 {
		h := newHarness(t, Config{P1Rate: 3, P1Burst: 10, DefaultPolicy: pro(1)})
		h.submit("me", 1)
		_, _, tk := h.step()
		tk.Done(9)
		for i := range busy {
			h.submit(fmt.Sprint("x", i), 5)
		}
		for range busy * 2 {
			h.step()
			h.clk.Advance(time.Millisecond)
		}
		h.clk.Advance(time.Duration(1000-busy*2) * time.Millisecond)
		p1, _ := h.balances("me")
		return p1
	}
	if a, b := bal(0), bal(300); math.Abs(a-b) > 1e-9 || math.Abs(a-(10-9+3)) > 1e-9 {
		t.Fatalf("balance idle server %v, busy server %v, want both 4", a, b)
	}
}

func TestBusierServerMeansMoreRefilledBucketAtYourTurn(t *testing.T) {
	// Every dispatch takes 1ms of server time. Measure how much me's P1
	// bucket refilled between two of its turns.
	refillPerTurn := func(others int) float64 {
		h := newHarness(t, Config{P1Rate: 1, P1Burst: 100, DefaultPolicy: pro(1)})
		for i := range others {
			h.submit(fmt.Sprint("o", i), 1000)
		}
		h.submit("me", 1000)
		var at []float64
		for len(at) < 3 {
			who, _, _ := h.step()
			if who == "me" {
				p1, _ := h.balances("me")
				at = append(at, p1)
			}
			h.clk.Advance(time.Millisecond)
		}
		return at[2] - at[1] + 1 // the turn's own credit put back
	}
	quiet, busy := refillPerTurn(1), refillPerTurn(19)
	if math.Abs(quiet-0.002) > 1e-9 || math.Abs(busy-0.020) > 1e-9 {
		t.Fatalf("refill between turns: 2 queues %v, 20 queues %v; want 0.002 and 0.020", quiet, busy)
	}
}

func TestNothingIsRefusedAndEveryRequestRuns(t *testing.T) {
	h := newHarness(t, Config{P1Rate: 1, P1Burst: 1, P2Rate: 1, P2Burst: 1, MaxInFlight: 3})
	h.s.SetPolicy("p", pro(1))
	h.s.SetPolicy("l", lite(1))
	var all []*Ticket
	for _, who := range []string{"p", "l", "n"} {
		all = append(all, h.submit(who, 50)...)
	}
	// Every request in deep debt or with no tier still runs.
	var inflight []*Ticket
	for done := 0; done < len(all); {
		_, _, tk := h.step()
		if tk != nil {
			inflight = append(inflight, tk)
			continue
		}
		if len(inflight) == 0 {
			t.Fatalf("stuck with %d of %d dispatched", done, len(all))
		}
		inflight[0].Done(100)
		inflight = inflight[1:]
		done++
	}
	for i, tk := range all {
		if tk.state != ticketDone {
			t.Fatalf("ticket %d state %d", i, tk.state)
		}
	}
}

func TestDispatchesOnlyWhileTheServerHasRoom(t *testing.T) {
	room := true
	h := newHarness(t, Config{MaxInFlight: 2, HasRoom: func() bool { return room }})
	h.submit("a", 5)
	_, _, t1 := h.step()
	_, _, t2 := h.step()
	if who, _, _ := h.step(); who != "" || t1 == nil || t2 == nil {
		t.Fatalf("dispatched beyond MaxInFlight")
	}
	t1.Done(1)
	if who, _, _ := h.step(); who != "a" {
		t.Fatal("no dispatch after a slot freed")
	}
	t2.Done(1)
	room = false
	if who, _, _ := h.step(); who != "" {
		t.Fatal("dispatched while HasRoom said no")
	}
	room = true
	if who, _, _ := h.step(); who != "a" {
		t.Fatal("no dispatch after HasRoom said yes")
	}
}

func TestLoopNeverWaitsForARequestToFinish(t *testing.T) {
	// With room reported by HasRoom alone, requests go out back to back
	// while earlier ones are still running.
	h := newHarness(t, Config{HasRoom: func() bool { return true }})
	h.submit("a", 10)
	for i := range 10 {
		if who, _, _ := h.step(); who != "a" {
			t.Fatalf("dispatch %d held back", i)
		}
	}
	if s := h.s.Snapshot(); s.InFlight != 10 {
		t.Fatalf("in flight %d, want 10", s.InFlight)
	}
}

func TestCancelledWaitWithdrawsOnlyThatTicket(t *testing.T) {
	h := newHarness(t, Config{})
	a := h.submit("a", 3)
	b := h.submit("b", 2)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := a[1].Wait(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Wait on cancelled ctx: %v", err)
	}
	if _, err := a[1].Wait(context.Background()); !errors.Is(err, ErrWithdrawn) {
		t.Fatalf("second Wait: %v, want ErrWithdrawn", err)
	}
	var order []*Ticket
	for range 4 {
		_, _, tk := h.step()
		order = append(order, tk)
	}
	if order[0] != a[0] || order[1] != b[0] || order[2] != a[2] || order[3] != b[1] {
		t.Fatal("withdrawal disturbed the others' order")
	}
	if _, _, tk := h.step(); tk != nil {
		t.Fatal("withdrawn ticket was dispatched")
	}
	// A ticket already dispatched is not withdrawn by a late cancel.
	c := h.submit("c", 1)[0]
	h.step()
	if cl, err := c.Wait(ctx); err != nil || cl != P3 {
		t.Fatalf("Wait after dispatch with done ctx: %v %v", cl, err)
	}
	if a[1].Waited() != 0 {
		t.Fatalf("withdrawn at once, Waited %v", a[1].Waited())
	}
}

func TestWithdrawingTheLastTicketLeavesTheRing(t *testing.T) {
	h := newHarness(t, Config{P1Rate: 1, P1Burst: 1, DefaultPolicy: pro(1)})
	a := h.submit("a", 1)[0]
	h.submit("b", 2)
	a.Done(1) // Done on a queued ticket withdraws it
	if got := h.drain(2); fmt.Sprint(got) != "[b:P1 b:P2]" {
		t.Fatalf("got %v", got)
	}
	if a.state != ticketWithdrawn {
		t.Fatal("Done on a queued ticket did not withdraw it")
	}
}

func TestOutOfOrderClockReadingsDoNotRefillTwice(t *testing.T) {
	h := newHarness(t, Config{P1Rate: 1, P1Burst: 10, DefaultPolicy: pro(1)})
	h.submit("a", 1)
	_, _, tk := h.step()
	tk.Done(10) // p1 = 10 - 1 - 9 = 0
	now := h.s.now()
	h.s.mu.Lock()
	q := &h.s.hot[h.s.byName["a"]]
	h.s.refillLocked(q, now+int64(time.Second))
	h.s.refillLocked(q, now+int64(500*time.Millisecond)) // arrives late
	h.s.refillLocked(q, now+int64(time.Second))
	p1 := q.p1
	h.s.mu.Unlock()
	if p1 != 1 {
		t.Fatalf("p1=%v after out-of-order readings, want exactly 1", p1)
	}
}

func TestIdleParticipantsAreForgottenButPolicyIsKept(t *testing.T) {
	h := newHarness(t, Config{P1Rate: 1, P1Burst: 2})
	h.s.SetPolicy("a", pro(3))
	h.submit("a", 1)
	_, _, tk := h.step()
	h.s.mu.Lock()
	h.s.sweepLocked(h.s.now())
	h.s.mu.Unlock()
	if len(h.s.Snapshot().Participants) != 1 {
		t.Fatal("forgot a participant with a request in flight")
	}
	tk.Done(1)
	h.s.mu.Lock()
	h.s.sweepLocked(h.s.now())
	h.s.mu.Unlock()
	if len(h.s.Snapshot().Participants) != 1 {
		t.Fatal("forgot a participant whose bucket is not full")
	}
	h.clk.Advance(time.Second)
	h.s.mu.Lock()
	h.s.sweepLocked(h.s.now())
	free := len(h.s.free)
	h.s.mu.Unlock()
	if n := len(h.s.Snapshot().Participants); n != 0 || free != 1 {
		t.Fatalf("idle, full participant kept (%d known, %d free)", n, free)
	}
	h.submit("b", 1) // reuses the slot
	h.submit("a", 1)
	for _, p := range h.s.Snapshot().Participants {
		if p.Participant == "a" && (p.Policy != pro(3) || p.P1 != 6) {
			t.Fatalf("a came back as %+v, want its policy pro x3 and full buckets", p)
		}
	}
}

func TestSetPolicyTakesEffectForQueuedWork(t *testing.T) {
	h := newHarness(t, Config{P1Rate: 1, P1Burst: 1, P2Rate: 1, P2Burst: 1})
	h.submit("a", 3)
	if got := h.drain(1); got[0] != "a:P3" {
		t.Fatalf("default tier none: %v", got)
	}
	h.s.SetPolicy("a", pro(1))
	if got := h.drain(2); fmt.Sprint(got) != "[a:P1 a:P2]" {
		t.Fatalf("after upgrade: %v", got)
	}
	h.s.SetPolicy("a", lite(1))
	if p1, p2 := h.balances("a"); p1 != 0 || p2 != 0 {
		t.Fatalf("after downgrade: %v %v", p1, p2)
	}
}

func TestSnapshotReportsQueuesBalancesClassesAndWaits(t *testing.T) {
	h := newHarness(t, Config{P1Rate: 1, P1Burst: 1, P2Rate: 1, P2Burst: 2, DefaultPolicy: pro(1)})
	h.s.SetPolicy("l", lite(1))
	h.submit("a", 3)
	h.submit("l", 1)
	h.clk.Advance(3 * time.Millisecond)
	h.drain(2) // a:P1, then l:P2 (fresh) ahead of a's P2
	snap := h.s.Snapshot()
	if snap.InFlight != 2 || snap.Dispatched != [4]uint64{0, 1, 1, 0} {
		t.Fatalf("totals %+v", snap)
	}
	if len(snap.Participants) != 2 {
		t.Fatalf("participants %+v", snap.Participants)
	}
	a, l := snap.Participants[0], snap.Participants[1]
	if a.Participant != "a" || a.Queue != 2 || a.P1 != 0 || a.P2 != 2 || a.LastClass != P1 || a.Dispatched != [4]uint64{0, 1, 0, 0} {
		t.Fatalf("a: %+v", a)
	}
	if l.Participant != "l" || l.Queue != 0 || l.P1 != 0 || l.P2 != 1 || l.LastClass != P2 || l.Policy != lite(1) {
		t.Fatalf("l: %+v", l)
	}
	w := snap.Wait
	if w.Count != 2 || math.Abs(w.Sum-0.006) > 1e-12 || len(w.Counts) != len(w.Bounds)+1 {
		t.Fatalf("wait histogram %+v", w)
	}
	// 3ms falls in the (2.5ms, 5ms] bucket.
	for i, b := range w.Bounds {
		if b == 0.005 && w.Counts[i] != 2 {
			t.Fatalf("wait histogram counts %v", w.Counts)
		}
	}
}

func TestNewRejectsBadConfig(t *testing.T) {
	for _, cfg := range []Config{
		{P1Rate: -1}, {P2Rate: math.NaN()}, {P1Burst: 0.5}, {P2Burst: math.Inf(1)},
		{P1Burst: MaxBurst * 2}, {P2Rate: MaxRate * 2}, {P1Burst: math.MaxFloat64},
		{MaxInFlight: -1}, {Poll: -time.Second}, {DefaultPolicy: Policy{Tier: 7}},
	} {
		if _, err := New(cfg, nil); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("New(%+v) = %v, want ErrInvalidConfig", cfg, err)
		}
	}
	s, err := New(Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if s.cfg.P1Rate != DefaultP1Rate || s.cfg.P2Burst != DefaultP2Burst || s.cfg.Poll != DefaultPoll || s.cfg.DefaultPolicy.Shares != 1 {
		t.Fatalf("defaults not applied: %+v", s.cfg)
	}
}

func TestTierAndClassNames(t *testing.T) {
	for _, tier := range []Tier{TierNone, TierLite, TierPro} {
		got, err := ParseTier(tier.String())
		if err != nil || got != tier {
			t.Errorf("ParseTier(%q) = %v, %v", tier.String(), got, err)
		}
	}
	if _, err := ParseTier("gold"); !errors.Is(err, ErrUnknownTier) {
		t.Errorf("ParseTier(gold) = %v", err)
	}
	for c, want := range map[Class]string{0: "-", P1: "P1", P2: "P2", P3: "P3", 4: "Class(4)"} {
		if got := c.String(); got != want {
			t.Errorf("Class(%d).String() = %q, want %q", int(c), got, want)
		}
	}
	// Logs and status name classes often: naming one must not allocate.
	if n := testing.AllocsPerRun(100, func() { _ = P2.String() }); n != 0 {
		t.Errorf("Class.String allocates %v times", n)
	}
}

// TestHostileCostsNeverStallTheScheduler is the class of a cost no request
// could really have, from an upstream's cost header or a clock (1e12,
// MaxFloat64, +Inf, NaN, negative), at rates down to a credit in 30 000
// years: the participant charged repays at most a day of refill and is
// served at P3 meanwhile, and the others are served as before. Before the
// debt was bounded, the wake-up time of such a debt overflowed into the past
// and the loop set it again forever, holding the lock: every request of
// every participant hung.
func TestHostileCostsNeverStallTheScheduler(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 11))
	costs := []float64{1e12, 1e20, 1e300, math.MaxFloat64, math.Inf(1), math.NaN(), -1, -math.MaxFloat64, 0}
	rates := []float64{1e-12, 1e-3, 1, 10, 1e6}
	for round := range 2000 {
		cost := costs[r.IntN(len(costs))]
		if r.IntN(3) == 0 {
			cost = math.Ldexp(r.Float64(), r.IntN(1024))
		}
		rate := rates[r.IntN(len(rates))]
		shares := 1 + r.IntN(1<<10)
		done := make(chan string, 1)
		policy := []Policy{pro(shares), lite(shares)}[r.IntN(2)]
		go func() {
			h := newHarness(t, Config{P1Rate: rate, P1Burst: 2, P2Rate: rate, P2Burst: 2, DefaultPolicy: policy})
			h.every = 7
			h.submit("a", 1)
			_, _, tk := h.step()
			h.clk.Advance(time.Duration(r.IntN(1000)) * time.Millisecond)
			tk.Done(cost)
			h.submit("a", 3)
			h.submit("b", 3)
			served := map[string]int{}
			for range 50 {
				who, _, tk := h.step()
				if tk != nil {
					served[who]++
					tk.Done(1)
				}
				h.clk.Advance(time.Duration(r.IntN(3)) * time.Hour)
			}
			p1, p2 := h.balances("a")
			if policy.Tier != TierPro {
				p1 = p2 // a lite participant holds no P1 bucket
			}
			debt := 1 - rate*float64(shares)*maxRepay.Seconds()
			switch {
			case served["a"] != 3 || served["b"] != 3:
				done <- fmt.Sprintf("served %v, want 3 each", served)
			case math.IsNaN(p1) || math.IsNaN(p2) || p1 < debt-1e-6*math.Abs(debt) || p2 < debt-1e-6*math.Abs(debt):
				done <- fmt.Sprintf("balances %v %v, past the bound %v", p1, p2, debt)
			default:
				done <- ""
			}
		}()
		select {
		case msg := <-done:
			if msg != "" {
				t.Fatalf("round %d, cost %v, rate %v, shares %d: %s", round, cost, rate, shares, msg)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("round %d, cost %v, rate %v, shares %d: the scheduler stalled", round, cost, rate, shares)
		}
	}
}
