// SPDX-License-Identifier: Apache-2.0

package scheduler

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// startRun runs s.Run in a goroutine and stops it when the test ends.
func startRun(t *testing.T, s *Scheduler) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("Run returned %v, want context.Canceled", err)
		}
	})
}

func TestRunWithRealGoroutines(t *testing.T) {
	const slots, workers, each = 3, 8, 200
	s, err := New(Config{MaxInFlight: slots, P1Rate: 50, P1Burst: 5, P2Rate: 50, P2Burst: 5}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s.SetPolicy("w0", pro(2))
	s.SetPolicy("w1", lite(1))
	startRun(t, s)
	var inUse, maxInUse, served, withdrawn atomic.Int64
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				tk := s.Submit(fmt.Sprint("w", w%5))
				ctx, cancel := context.WithCancel(context.Background())
				if i%17 == 0 {
					cancel() // the client went away
				}
				c, err := tk.Wait(ctx)
				cancel()
				if err != nil {
					withdrawn.Add(1)
					continue
				}
				if c < P1 || c > P3 {
					t.Errorf("class %v", c)
				}
				n := inUse.Add(1)
				for m := maxInUse.Load(); n > m && !maxInUse.CompareAndSwap(m, n); m = maxInUse.Load() {
				}
				if i%5 == 0 {
					time.Sleep(50 * time.Microsecond)
				}
				inUse.Add(-1)
				tk.Done(float64(i%3) + 0.5)
				served.Add(1)
			}
		}()
	}
	wg.Wait()
	snap := s.Snapshot()
	total := snap.Dispatched[1] + snap.Dispatched[2] + snap.Dispatched[3]
	if int64(total) != served.Load() || served.Load()+withdrawn.Load() != workers*each {
		t.Fatalf("dispatched %d, served %d, withdrawn %d of %d", total, served.Load(), withdrawn.Load(), workers*each)
	}
	if snap.InFlight != 0 || maxInUse.Load() > slots {
		t.Fatalf("in flight %d at end, max observed %d (bound %d)", snap.InFlight, maxInUse.Load(), slots)
	}
	for _, p := range snap.Participants {
		if p.Queue != 0 {
			t.Fatalf("%s: %d still queued", p.Participant, p.Queue)
		}
	}
	checkInvariants(t, s)
}

func TestRunPollsWhileTheServerHasNoRoom(t *testing.T) {
	var room atomic.Bool
	var asked atomic.Int64
	s, err := New(Config{Poll: 100 * time.Microsecond, HasRoom: func() bool {
		asked.Add(1)
		return room.Load()
	}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	startRun(t, s)
	tk := s.Submit("a")
	// No room: the loop keeps asking and dispatches nothing.
	for asked.Load() < 5 {
		time.Sleep(100 * time.Microsecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	if _, err := tk.Wait(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("dispatched without room: %v", err)
	}
	// The withdrawn ticket is gone; a new one goes out once room appears.
	tk = s.Submit("a")
	room.Store(true)
	if c, err := tk.Wait(context.Background()); err != nil || c != P3 {
		t.Fatalf("after room: %v %v", c, err)
	}
	tk.Done(1)
}

func TestRunRefusesASecondLoop(t *testing.T) {
	s, err := New(Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	startRun(t, s)
	for !s.run.Load() {
		time.Sleep(time.Millisecond)
	}
	if err := s.Run(context.Background()); !errors.Is(err, ErrRunning) {
		t.Fatalf("second Run: %v, want ErrRunning", err)
	}
}

// TestWithdrawHeadAfterDispatch: a dispatch leaves the new head's prev
// pointing at the ticket that left; withdrawing that head, alone in its
// queue, must leave the queue empty and usable (it once left the tail on the
// dispatched ticket, and the next Submit vanished into it).
func TestWithdrawHeadAfterDispatch(t *testing.T) {
	clk := newFakeClock()
	s, err := New(Config{}, clk)
	if err != nil {
		t.Fatal(err)
	}
	first, second := s.Submit("a"), s.Submit("a")
	s.mu.Lock()
	got := s.dispatchLocked(s.now())
	s.mu.Unlock()
	if got != first {
		t.Fatal("the first ticket was not dispatched first")
	}
	second.Done(1) // withdraws: still queued, now the head and the tail
	first.Done(1)
	third := s.Submit("a")
	s.mu.Lock()
	got = s.dispatchLocked(s.now())
	s.mu.Unlock()
	if got != third {
		t.Fatalf("after withdrawing the head, the next submit was not dispatched (got %p, want %p)", got, third)
	}
	checkInvariants(t, s)
}

// stallCtx is a context whose Err blocks once armed. Run calls Err at the
// top of every turn of its loop, outside the lock, so arming it and nudging
// the loop parks the Run goroutine where it can dispatch nothing while the
// Scheduler still counts it as running.
type stallCtx struct {
	context.Context
	armed   atomic.Bool
	stalled chan struct{} // closed once the loop is parked
	release chan struct{} // closing it lets the loop go on
}

func (c *stallCtx) Err() error {
	if c.armed.CompareAndSwap(true, false) {
		close(c.stalled)
		<-c.release
	}
	return c.Context.Err()
}

// TestSubmitDispatchesInlineWhileNothingWaits: with the Run loop parked, a
// request that finds nothing waiting and room goes out inside Submit, with
// the accounting of a loop dispatch; one that finds another waiting queues
// behind it even though there is room.
func TestSubmitDispatchesInlineWhileNothingWaits(t *testing.T) {
	s, err := New(Config{MaxInFlight: 1, DefaultPolicy: pro(1)}, newFakeClock())
	if err != nil {
		t.Fatal(err)
	}
	base, cancel := context.WithCancel(context.Background())
	ctx := &stallCtx{Context: base, stalled: make(chan struct{}), release: make(chan struct{})}
	var release sync.Once
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		release.Do(func() { close(ctx.release) })
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("Run returned %v, want context.Canceled", err)
		}
	})
	for !s.run.Load() {
		time.Sleep(100 * time.Microsecond)
	}
	ctx.armed.Store(true)
	s.nudge()
	<-ctx.stalled

	a := s.Submit("a")
	wctx, wcancel := context.WithTimeout(context.Background(), time.Second)
	defer wcancel()
	if c, err := a.Wait(wctx); err != nil || c != P1 {
		t.Fatalf("Wait with the loop parked: %v %v, want P1 dispatched by Submit", c, err)
	}
	snap := s.Snapshot()
	if a.Waited() != 0 || snap.InFlight != 1 || snap.Dispatched != [4]uint64{0, 1, 0, 0} ||
		snap.Wait.Count != 1 || snap.Wait.Sum != 0 || snap.Wait.Counts[0] != 1 {
		t.Fatalf("inline dispatch accounting: waited %v, snapshot %+v", a.Waited(), snap)
	}
	if p := snap.Participants[0]; p.P1 != DefaultP1Burst-1 || p.LastClass != P1 || p.Dispatched != [4]uint64{0, 1, 0, 0} {
		t.Fatalf("inline dispatch did not charge the flat P1 credit: %+v", p)
	}

	b := s.Submit("b") // no room: queues
	a.Done(1)
	c := s.Submit("c") // room, but b waits: queues behind it
	s.mu.Lock()
	bState, cState := b.state, c.state
	s.mu.Unlock()
	if bState != ticketQueued || cState != ticketQueued {
		t.Fatalf("states b=%d c=%d, want both queued: c must not overtake b", bState, cState)
	}
	checkInvariants(t, s)

	release.Do(func() { close(ctx.release) })
	if cl, err := b.Wait(context.Background()); err != nil || cl != P1 {
		t.Fatalf("b: %v %v", cl, err)
	}
	s.mu.Lock()
	cState = c.state
	s.mu.Unlock()
	if cState != ticketQueued {
		t.Fatal("c went out while b held the only slot")
	}
	b.Done(1)
	if cl, err := c.Wait(context.Background()); err != nil || cl != P1 {
		t.Fatalf("c: %v %v", cl, err)
	}
	c.Done(1)
}
