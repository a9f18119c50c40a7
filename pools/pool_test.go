// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/clock"
)

func mustPool(t testing.TB, size, floor int, clk clock.Clock) *Pool {
	t.Helper()
	p, err := New(Config{Name: "test", Size: size, Floor: floor}, clk)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func acquireN(t testing.TB, p *Pool, project string, n int) []Permit {
	t.Helper()
	var out []Permit
	for i := 0; i < n; i++ {
		pm, err := p.TryAcquire(project)
		if err != nil {
			t.Fatalf("%s permit %d: %v", project, i, err)
		}
		out = append(out, pm)
	}
	return out
}

func mustRefuse(t testing.TB, p *Pool, project string) *Refusal {
	t.Helper()
	pm, err := p.TryAcquire(project)
	var r *Refusal
	if !errors.As(err, &r) || !errors.Is(err, ErrRefused) {
		t.Fatalf("%s: want a refusal, got %v, %v", project, pm, err)
	}
	if pm.Valid() {
		t.Fatalf("%s: refused with a valid permit", project)
	}
	return r
}

func releaseAll(t testing.TB, p *Pool, pms []Permit) {
	t.Helper()
	for _, pm := range pms {
		if err := p.Release(pm); err != nil {
			t.Fatal(err)
		}
	}
}

// Consequence 1: a node with room refuses nothing; a lone project gets the
// whole node; a project over its share keeps taking what nobody uses.
func TestRoomRefusesNothing(t *testing.T) {
	p := mustPool(t, 100, 0, newFakeClock())
	var all []Permit
	for _, pr := range []string{"a", "b", "c"} {
		all = append(all, acquireN(t, p, pr, 30)...) // 90 < 100: never refused
	}
	if s := p.Snapshot(); s.InUse != 90 || s.Active != 3 || s.Share != 33 {
		t.Fatalf("snapshot %+v", s)
	}
	releaseAll(t, p, all)
}

func TestLoneProjectGetsWholeNode(t *testing.T) {
	p := mustPool(t, 20, 0, newFakeClock())
	pms := acquireN(t, p, "solo", 20)
	r := mustRefuse(t, p, "solo")
	if r.Reason != ReasonOverShare || r.Held != 20 || r.Share != 20 || r.InUse != 20 {
		t.Fatalf("refusal %+v", r)
	}
	releaseAll(t, p, pms)
}

func TestOverShareTakesWhatNobodyUses(t *testing.T) {
	// Pool 20, floor 1, two active projects: share 10. b uses 2; a goes far
	// past its share and stops only one floor short of the pool.
	p := mustPool(t, 20, 0, newFakeClock())
	b := acquireN(t, p, "b", 2)
	a := acquireN(t, p, "a", 17)
	r := mustRefuse(t, p, "a")
	if r.Reason != ReasonOverShare || r.Held != 17 || r.Share != 10 || r.InUse != 19 {
		t.Fatalf("refusal %+v", r)
	}
	releaseAll(t, p, append(a, b...))
}

// Consequence 2: a project arriving on a busy node finds its floor at once.
// "Busy" here means filled by projects past their share: they stop a floor
// short of the pool, so the floor is there for the newcomer.
func TestLateArrivalFindsFloor(t *testing.T) {
	for _, tc := range []struct{ size, floor, hogs int }{
		{20, 0, 1}, {100, 0, 1}, {100, 0, 3}, {100, 10, 2}, {1000, 0, 7},
	} {
		p := mustPool(t, tc.size, tc.floor, newFakeClock())
		floor := p.Snapshot().Floor
		// A light project keeps one permit, so each hog's share is at most
		// POOL/2 and the hogs push past it.
		held := acquireN(t, p, "light", 1)
		for progress := true; progress; {
			progress = false
			for h := 0; h < tc.hogs; h++ {
				if pm, err := p.TryAcquire(string(rune('A' + h))); err == nil {
					held = append(held, pm)
					progress = true
				}
			}
		}
		if s := p.Snapshot(); s.InUse != tc.size-floor {
			t.Fatalf("size %d: hogs stopped at %d, want %d", tc.size, s.InUse, tc.size-floor)
		}
		late := acquireN(t, p, "late", floor)
		releaseAll(t, p, append(held, late...))
	}
}

// TestLateArrivalAfterLoneProject is the limit of consequence 2: a project
// alone on the node is under its share (the whole pool) and may fill it, so
// a newcomer cannot find its floor at once; but from its arrival the lone
// project is over its share, so every release goes to the newcomer until it
// holds its floor.
func TestLateArrivalAfterLoneProject(t *testing.T) {
	p := mustPool(t, 100, 0, newFakeClock()) // floor 5
	hog := acquireN(t, p, "hog", 100)
	mustRefuse(t, p, "late")
	var late []Permit
	for i := 0; i < 5; i++ {
		if err := p.Release(hog[0]); err != nil {
			t.Fatal(err)
		}
		hog = hog[1:]
		mustRefuse(t, p, "hog")
		late = append(late, acquireN(t, p, "late", 1)...)
	}
	mustRefuse(t, p, "hog") // in_use 100 >= POOL-FLOOR
	releaseAll(t, p, append(hog, late...))
}

// Consequence 3: on a full node the project at or over its share is refused
// first; a project under its share gets in as soon as anything is released.
func TestFullNodeRefusesOverShareFirst(t *testing.T) {
	p := mustPool(t, 10, 0, newFakeClock()) // floor 1
	big := acquireN(t, p, "big", 9)
	small := acquireN(t, p, "small", 1) // share 5: small is under it
	if r := mustRefuse(t, p, "big"); r.Reason != ReasonOverShare {
		t.Fatalf("big: %+v", r)
	}
	if r := mustRefuse(t, p, "small"); r.Reason != ReasonFull {
		t.Fatalf("small: %+v", r)
	}
	// One release: in_use 9 = POOL-FLOOR. big stays refused, small gets in.
	if err := p.Release(big[0]); err != nil {
		t.Fatal(err)
	}
	mustRefuse(t, p, "big")
	small = append(small, acquireN(t, p, "small", 1)...)
	releaseAll(t, p, append(big[1:], small...))
}

func TestUnderShareWaiterWokenByRelease(t *testing.T) {
	p := mustPool(t, 10, 0, newFakeClock())
	big := acquireN(t, p, "big", 9)
	small := acquireN(t, p, "small", 1)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	bigGot := make(chan error, 1)
	bigCtx, bigCancel := context.WithCancel(ctx)
	go func() {
		pm, err := p.Acquire(bigCtx, "big")
		if err == nil {
			err = p.Release(pm)
			err = errors.Join(errors.New("big was admitted"), err)
		}
		bigGot <- err
	}()
	smallGot := make(chan Permit, 1)
	go func() {
		pm, err := p.Acquire(ctx, "small")
		if err != nil {
			t.Error(err)
		}
		smallGot <- pm
	}()
	waitFor(t, func() bool { return p.waiters() == 2 })
	if err := p.Release(big[0]); err != nil {
		t.Fatal(err)
	}
	pm := <-smallGot
	if pm.Project() != "small" {
		t.Fatalf("got %+v", pm)
	}
	bigCancel()
	err := <-bigGot
	var r *Refusal
	if !errors.Is(err, context.Canceled) || !errors.Is(err, ErrRefused) || !errors.As(err, &r) || r.Project != "big" {
		t.Fatalf("big: %v", err)
	}
	releaseAll(t, p, append(append(big[1:], small...), pm))
	if s := p.Snapshot(); s.InUse != 0 || p.waiters() != 0 {
		t.Fatalf("left over: %+v, waiters %d", s, p.waiters())
	}
}

// waiters counts blocked Acquire calls (test helper).
func (p *Pool) waiters() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, q := range p.queues {
		n += len(q.ws)
	}
	return n
}

func waitFor(t testing.TB, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached in 10s")
		}
		time.Sleep(time.Millisecond)
	}
}

func TestAcquireFIFOPerProject(t *testing.T) {
	p := mustPool(t, 4, 0, newFakeClock())
	held := acquireN(t, p, "a", 4)
	ctx := context.Background()
	const n = 5
	order := make(chan int, n)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		waitFor(t, func() bool { return p.waiters() == i })
		wg.Add(1)
		go func() {
			defer wg.Done()
			pm, err := p.Acquire(ctx, "a")
			if err != nil {
				t.Error(err)
				return
			}
			order <- i
			if err := p.Release(pm); err != nil {
				t.Error(err)
			}
		}()
	}
	waitFor(t, func() bool { return p.waiters() == n })
	// Release one permit; each woken waiter passes its permit on in turn.
	if err := p.Release(held[0]); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	close(order)
	want := 0
	for got := range order {
		if got != want {
			t.Fatalf("waiter %d served at position %d", got, want)
		}
		want++
	}
	releaseAll(t, p, held[1:])
}

func TestAcquireDoneContext(t *testing.T) {
	p := mustPool(t, 1, 0, newFakeClock())
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	// Room: a done context still gets the permit without blocking.
	pm, err := p.Acquire(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Acquire(ctx, "a"); !errors.Is(err, context.Canceled) || !errors.Is(err, ErrRefused) {
		t.Fatalf("full pool, done ctx: %v", err)
	}
	if err := p.Release(pm); err != nil {
		t.Fatal(err)
	}
}

func TestDoubleRelease(t *testing.T) {
	p := mustPool(t, 2, 0, newFakeClock())
	pm := acquireN(t, p, "a", 1)[0]
	if err := p.Release(pm); err != nil {
		t.Fatal(err)
	}
	// The slot is reused by a new permit; the stale value must not free it.
	pm2 := acquireN(t, p, "a", 1)[0]
	if err := p.Release(pm); !errors.Is(err, ErrDoubleRelease) {
		t.Fatalf("second release: %v", err)
	}
	if s := p.Snapshot(); s.InUse != 1 || s.Projects[0].Held != 1 {
		t.Fatalf("double release changed counts: %+v", s)
	}
	if err := p.Release(Permit{}); !errors.Is(err, ErrDoubleRelease) {
		t.Fatalf("zero permit: %v", err)
	}
	other := mustPool(t, 2, 0, newFakeClock())
	if err := other.Release(pm2); !errors.Is(err, ErrDoubleRelease) {
		t.Fatalf("foreign permit: %v", err)
	}
	if err := p.Release(pm2); err != nil {
		t.Fatal(err)
	}
}

// TestActiveWindowTimeline walks a fake clock through the active window: a
// project that stops asking leaves the active set after one window, and the
// share grows back.
func TestActiveWindowTimeline(t *testing.T) {
	type step struct {
		at      time.Duration // fake time of the step
		op      string        // "acq", "rel", "tick"
		project string
		admit   bool // for acq
		active  int  // for tick: want active and share after it
		share   int
	}
	tl := []step{
		{at: 0, op: "acq", project: "a", admit: true},
		{at: 0, op: "acq", project: "b", admit: true},
		{at: 0, op: "tick", active: 2, share: 5},
		{at: 500 * time.Millisecond, op: "rel", project: "b"},  // b holds nothing now
		{at: 1 * time.Second, op: "tick", active: 2, share: 5}, // b asked within the window
		{at: 2 * time.Second, op: "tick", active: 1, share: 10},
		{at: 2500 * time.Millisecond, op: "acq", project: "c", admit: true}, // joins at once
		{at: 2500 * time.Millisecond, op: "tick", active: 2, share: 5},
		{at: 3 * time.Second, op: "tick", active: 2, share: 5}, // c holds
		{at: 3 * time.Second, op: "rel", project: "c"},
		{at: 4 * time.Second, op: "tick", active: 2, share: 5},
		{at: 5 * time.Second, op: "tick", active: 1, share: 10},
		{at: 5 * time.Second, op: "rel", project: "a"},
		{at: 6 * time.Second, op: "tick", active: 1, share: 10},
		{at: 7 * time.Second, op: "tick", active: 0, share: 10},
	}
	clk := newFakeClock()
	t0 := clk.Now()
	p := mustPool(t, 10, 0, clk)
	held := map[string][]Permit{}
	for i, s := range tl {
		clk.Advance(t0.Add(s.at).Sub(clk.Now()))
		switch s.op {
		case "acq":
			pm, err := p.TryAcquire(s.project)
			if (err == nil) != s.admit {
				t.Fatalf("step %d (%v acq %s): err %v, want admit %v", i, s.at, s.project, err, s.admit)
			}
			if err == nil {
				held[s.project] = append(held[s.project], pm)
			}
		case "rel":
			pms := held[s.project]
			if err := p.Release(pms[len(pms)-1]); err != nil {
				t.Fatal(err)
			}
			held[s.project] = pms[:len(pms)-1]
		case "tick":
			p.Recompute()
			snap := p.Snapshot()
			if snap.Active != s.active || snap.Share != s.share {
				t.Fatalf("step %d (%v tick): active %d share %d, want %d %d", i, s.at, snap.Active, snap.Share, s.active, s.share)
			}
		}
	}
}

func TestForgetIdleProjects(t *testing.T) {
	clk := newFakeClock()
	p, err := New(Config{Size: 10, Forget: 5 * time.Second}, clk)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 1000; i++ {
		pm, err := p.TryAcquire(string(rune(0x4e00 + i)))
		if err != nil {
			t.Fatal(err)
		}
		_ = p.Release(pm)
	}
	keep := acquireN(t, p, "keeper", 1)
	for i := 0; i < 10; i++ {
		clk.Advance(time.Second)
		p.Recompute()
	}
	s := p.Snapshot()
	if len(s.Projects) != 1 || s.Projects[0].Project != "keeper" || s.Active != 1 {
		t.Fatalf("after forget: %d projects, active %d", len(s.Projects), s.Active)
	}
	releaseAll(t, p, keep)
	// Recycled slots work for new projects.
	acquireN(t, p, "new", 3)
	if s := p.Snapshot(); s.InUse != 3 || len(s.Projects) != 2 {
		t.Fatalf("%+v", s)
	}
}

func TestResize(t *testing.T) {
	p := mustPool(t, 10, 0, newFakeClock())
	a := acquireN(t, p, "a", 10)
	mustRefuse(t, p, "a")
	if err := p.Resize(12, 2); err != nil {
		t.Fatal(err)
	}
	// Share 12, floor 2: a is under share, admitted up to 12.
	a = append(a, acquireN(t, p, "a", 2)...)
	if err := p.Resize(5, 0); err != nil {
		t.Fatal(err)
	}
	mustRefuse(t, p, "b") // in_use 12 > 5: nobody until releases
	releaseAll(t, p, a[:8])
	b := acquireN(t, p, "b", 1)
	releaseAll(t, p, append(a[8:], b...))
}

// TestRetryAfterEstimate checks that the estimate follows the release rate
// and differs between projects.
func TestRetryAfterEstimate(t *testing.T) {
	clk := newFakeClock()
	p := mustPool(t, 10, 0, clk)
	// No releases seen, no time passed: the shortest estimate (see
	// TestRetryAfterCold).
	a := acquireN(t, p, "a", 10)
	r := mustRefuse(t, p, "a")
	if r.RetryAfter != time.Millisecond {
		t.Fatalf("no history: %v, want 1ms", r.RetryAfter)
	}
	if r.ReleaseRate != 0 {
		t.Fatalf("no history: release rate %v, want 0", r.ReleaseRate)
	}
	p.Recompute()
	// 100 releases (and re-acquires) within one second: 100/s.
	for i := 0; i < 100; i++ {
		if err := p.Release(a[0]); err != nil {
			t.Fatal(err)
		}
		a[0] = acquireN(t, p, "a", 1)[0]
	}
	clk.Advance(time.Second)
	p.Recompute()
	// b is under share and needs one release: ~10ms. a (10 held, share 5
	// beside b, at in_use 10, limit 9) needs two releases and waits behind
	// the 5 it holds past its share: 7 releases, 70ms; or its own 6
	// releases at its own 100/s bring it under its share: 60ms.
	if rb := mustRefuse(t, p, "b"); rb.RetryAfter != 10*time.Millisecond {
		t.Fatalf("b: %v, want 10ms", rb.RetryAfter)
	}
	ra := mustRefuse(t, p, "a")
	if ra.ReleaseRate != 100 {
		t.Fatalf("a: release rate %v, want the measured 100/s", ra.ReleaseRate)
	}
	if ra.RetryAfter != 60*time.Millisecond {
		t.Fatalf("a: %v, want 60ms", ra.RetryAfter)
	}
	releaseAll(t, p, a)
	// Ten idle seconds (nothing held, nothing released) keep the rate
	// measured before them: idleness says nothing about how fast permits
	// free.
	clk.Advance(time.Second)
	p.Recompute() // the releases above
	before := p.l.relRate
	for range 10 {
		clk.Advance(time.Second)
		p.Recompute()
	}
	if p.l.relRate != before || before == 0 {
		t.Fatalf("release rate after 10 idle seconds %v, before %v", p.l.relRate, before)
	}
}

// TestRetryAfterCold: a pool that has measured no release rate yet (its
// first period) answers from what it has seen since it began. With nothing
// released it tells the time since then, a back-off up to the window; once
// something was released, the rate of those releases. Before, it told one
// window, and a crowd refused at a pool's start stayed away a second while
// the first permits came free 20ms later (docs/compare.md, churn).
func TestRetryAfterCold(t *testing.T) {
	clk := newFakeClock()
	p := mustPool(t, 10, 0, clk)
	a := acquireN(t, p, "a", 10)
	clk.Advance(30 * time.Millisecond)
	if r := mustRefuse(t, p, "a"); r.RetryAfter != 30*time.Millisecond || r.ReleaseRate != 0 {
		t.Fatalf("nothing released for 30ms: retry %v at rate %v, want 30ms at 0", r.RetryAfter, r.ReleaseRate)
	}
	// Three released (and taken again) in the first 60ms: 50/s. a, alone
	// and at its share, needs in_use under 9: two releases, 40ms.
	for i := range 3 {
		if err := p.Release(a[i]); err != nil {
			t.Fatal(err)
		}
		a[i] = acquireN(t, p, "a", 1)[0]
	}
	clk.Advance(30 * time.Millisecond)
	r := mustRefuse(t, p, "a")
	if r.ReleaseRate != 50 || r.RetryAfter != 40*time.Millisecond {
		t.Fatalf("3 released in 60ms: retry %v at rate %v, want 40ms at 50/s", r.RetryAfter, r.ReleaseRate)
	}
	// Long without a release: never more than the window.
	p2 := mustPool(t, 2, 0, clk)
	acquireN(t, p2, "a", 2)
	clk.Advance(5 * time.Second)
	if r := mustRefuse(t, p2, "a"); r.RetryAfter != time.Second {
		t.Fatalf("nothing released for 5s: %v, want the window", r.RetryAfter)
	}
	// Once recomputed, the pool's smoothed rate answers and the clock is
	// not read: the estimate does not move while time passes unseen.
	p.Recompute()
	first := mustRefuse(t, p, "a").RetryAfter
	clk.Advance(500 * time.Millisecond)
	if r := mustRefuse(t, p, "a"); r.RetryAfter != first {
		t.Fatalf("with a measured rate the estimate moved from %v to %v with the clock", first, r.RetryAfter)
	}
}

// TestRetryAfterFurthestOverShareLast: among refused projects past their
// share, the one furthest past it is told to come back last, so the
// permits that come free go first to the one nearest its share. Before,
// both were told one release interval, and the room above the share went
// to whichever project had more clients retrying.
func TestRetryAfterFurthestOverShareLast(t *testing.T) {
	clk := newFakeClock()
	p := mustPool(t, 20, 1, clk)
	x := acquireN(t, p, "x", 10)
	y := acquireN(t, p, "y", 6)
	acquireN(t, p, "z", 3) // share 20/3 = 6; in_use 19 = POOL - FLOOR
	// 100 releases in a second, half of them x's, half y's.
	for i := range 100 {
		hs, name := x, "x"
		if i%2 == 1 {
			hs, name = y, "y"
		}
		if err := p.Release(hs[0]); err != nil {
			t.Fatal(err)
		}
		hs[0] = acquireN(t, p, name, 1)[0]
	}
	clk.Advance(time.Second)
	p.Recompute()
	rx, ry := mustRefuse(t, p, "x"), mustRefuse(t, p, "y")
	// y, at its share: one release, 10ms. x, 4 past it: five releases,
	// 50ms (its own five releases at 50/s would take 100ms).
	if ry.RetryAfter != 10*time.Millisecond || rx.RetryAfter != 50*time.Millisecond {
		t.Fatalf("retry x (10 held) %v, y (6 held) %v; want 50ms and 10ms", rx.RetryAfter, ry.RetryAfter)
	}
}

// TestConcurrentInvariants runs many goroutines against one pool under
// -race: in_use never exceeds POOL and returns to zero.
func TestConcurrentInvariants(t *testing.T) {
	const size = 16
	p := mustPool(t, size, 2, nil)
	var mu sync.Mutex
	var held, peak int
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
				p.Recompute()
				time.Sleep(time.Millisecond)
			}
		}
	}()
	var workers sync.WaitGroup
	for g := 0; g < 12; g++ {
		workers.Add(1)
		go func() {
			defer workers.Done()
			project := string(rune('a' + g%5))
			for i := 0; i < 2000; i++ {
				var pm Permit
				var err error
				if i%3 == 0 {
					pm, err = p.Acquire(ctx, project)
				} else {
					pm, err = p.TryAcquire(project)
				}
				if err != nil {
					if !errors.Is(err, ErrRefused) {
						t.Error(err)
						return
					}
					continue
				}
				mu.Lock()
				held++
				peak = max(peak, held)
				mu.Unlock()
				if s := p.Snapshot(); s.InUse > size {
					t.Errorf("in_use %d > %d", s.InUse, size)
				}
				mu.Lock()
				held--
				mu.Unlock()
				if err := p.Release(pm); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	workers.Wait()
	close(stop)
	wg.Wait()
	if s := p.Snapshot(); s.InUse != 0 || peak > size {
		t.Fatalf("in_use %d at the end, peak %d", s.InUse, peak)
	}
	for _, ps := range p.Snapshot().Projects {
		if ps.Held != 0 {
			t.Fatalf("%s holds %d at the end", ps.Project, ps.Held)
		}
	}
}

// TestActiveNeverLeavesEarlyWithLateTicks: recomputes a little more than the
// window apart (a ticker's jitter) must not drop a project that asked inside
// the last window, nor one that keeps asking.
func TestActiveNeverLeavesEarlyWithLateTicks(t *testing.T) {
	clk := newFakeClock()
	p, err := New(Config{Name: "late", Size: 8}, clk)
	if err != nil {
		t.Fatal(err)
	}
	p.Recompute()
	clk.Advance(900 * time.Millisecond)
	pm, err := p.TryAcquire("a") // asked 0.9 s after the recompute
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Release(pm); err != nil {
		t.Fatal(err)
	}
	clk.Advance(101 * time.Millisecond) // next tick 1.001 s after the last: the ask is 0.101 s old
	p.Recompute()
	if s := p.Snapshot(); s.Active != 1 || s.Share != 8 {
		t.Fatalf("a project that asked 0.1 s ago left the active set: %+v", s)
	}
	// Keeps asking every 100 ms across late ticks: always active.
	for tick := 0; tick < 5; tick++ {
		for i := 0; i < 10; i++ {
			clk.Advance(105 * time.Millisecond)
			pm, err := p.TryAcquire("a")
			if err != nil {
				t.Fatal(err)
			}
			p.Release(pm)
		}
		p.Recompute()
		if s := p.Snapshot(); s.Active != 1 {
			t.Fatalf("tick %d: a project asking every 105 ms left the active set", tick)
		}
	}
	// Stops asking: gone once its last ask is surely a window old.
	clk.Advance(1050 * time.Millisecond)
	p.Recompute()
	clk.Advance(1050 * time.Millisecond)
	p.Recompute()
	if s := p.Snapshot(); s.Active != 0 {
		t.Fatalf("a project silent for 2.1 s is still active: %+v", s)
	}
}

// TestRetryAfterLongHold: a pool whose permits stay held with nothing
// released keeps telling refused clients to wait longer, up to the cap,
// however long the hold lasts. Before, the smoothed rate halved at every
// recompute, and after some 37 seconds the estimate overflowed a
// Duration and the hint read 1ms: a long-poll or streaming pool sent its
// refused clients straight back (review).
func TestRetryAfterLongHold(t *testing.T) {
	clk := newFakeClock()
	p := mustPool(t, 10, 0, clk)
	a := acquireN(t, p, "a", 10)
	for i := range 10 { // ten released and taken again in the first second
		if err := p.Release(a[i]); err != nil {
			t.Fatal(err)
		}
		a[i] = acquireN(t, p, "a", 1)[0]
	}
	clk.Advance(time.Second)
	p.Recompute()
	last := time.Duration(0)
	for s := 1; s <= 120; s++ {
		clk.Advance(time.Second)
		p.Recompute()
		r := mustRefuse(t, p, "a")
		if r.RetryAfter < last {
			t.Fatalf("after %ds held with nothing released the hint fell from %v to %v", s, last, r.RetryAfter)
		}
		last = r.RetryAfter
	}
	if last != maxRetry {
		t.Fatalf("after two minutes held with nothing released the hint is %v, want the cap %v", last, maxRetry)
	}
}

// TestRetryAfterColdOnlyFirstPeriod: the short back-off of a pool that has
// measured nothing yet is for its first period only. A pool held full
// from its start, with no release in a whole period, answers the window
// as any pool with no release rate does; before, every recompute reset the
// back-off to a millisecond and doubled it again, for as long as the first
// holders lived (review).
func TestRetryAfterColdOnlyFirstPeriod(t *testing.T) {
	clk := newFakeClock()
	p := mustPool(t, 4, 0, clk)
	acquireN(t, p, "a", 4)
	clk.Advance(time.Millisecond)
	if r := mustRefuse(t, p, "a"); r.RetryAfter != time.Millisecond {
		t.Fatalf("first period, 1ms in: %v, want the cold back-off of 1ms", r.RetryAfter)
	}
	for range 3 {
		clk.Advance(time.Second)
		p.Recompute()
		clk.Advance(time.Millisecond)
		if r := mustRefuse(t, p, "a"); r.RetryAfter != time.Second {
			t.Fatalf("held a whole period with nothing released: %v, want the window", r.RetryAfter)
		}
	}
}
