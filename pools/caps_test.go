// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"context"
	"testing"
	"time"
)

// TestCaps: a capped project is held to its cap in place of the share and
// the floor; an uncapped one keeps the rule; lowering a cap under what is
// held refuses until releases, and raising it wakes a blocked Acquire.
func TestCaps(t *testing.T) {
	p := mustPool(t, 12, 0, newFakeClock())
	p.SetCaps(map[string]int{"a": 3, "b": 9}, -1)
	a := acquireN(t, p, "a", 3)
	if r := mustRefuse(t, p, "a"); r.Reason != ReasonOverCap || r.Share != 3 {
		t.Fatalf("a at its cap: %+v", r)
	}
	// b's cap is past share (6) and past POOL-FLOOR (11) would not matter:
	// b takes all 9, the pool is then full.
	b := acquireN(t, p, "b", 9)
	if in := p.Snapshot().InUse; in != 12 {
		t.Fatalf("in_use %d, want 12", in)
	}
	mustRefuse(t, p, "c")
	// Lower b's cap to 4: b holds 9 and is refused until under 4.
	p.SetCaps(map[string]int{"a": 3, "b": 4}, -1)
	releaseAll(t, p, b[:4])
	mustRefuse(t, p, "b") // holds 5 >= 4
	releaseAll(t, p, b[4:5])
	mustRefuse(t, p, "b") // holds 4
	// c has no cap: the rule (share 12/3 = 4, under it, in_use 7 < 12).
	c := acquireN(t, p, "c", 4)
	releaseAll(t, p, b[5:])
	// A blocked Acquire of a is woken by raising its cap.
	got := make(chan error, 1)
	go func() {
		pm, err := p.Acquire(context.Background(), "a")
		if err == nil {
			err = p.Release(pm)
		}
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("a admitted over its cap: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	p.SetCaps(map[string]int{"a": 4}, -1)
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	// nil removes the caps: the rule is back (b and c still active, a
	// over its share stops at POOL - FLOOR).
	p.SetCaps(nil, 0)
	releaseAll(t, p, append(a, c...))
	// Others capped: an unnamed project is held to that cap.
	p.SetCaps(map[string]int{}, 2)
	d := acquireN(t, p, "d", 2)
	if r := mustRefuse(t, p, "d"); r.Reason != ReasonOverCap {
		t.Fatalf("d over the others' cap: %+v", r)
	}
	releaseAll(t, p, d)
	p.SetCaps(nil, 0)
	acquireN(t, p, "a", 11)
	if r := mustRefuse(t, p, "a"); r.Reason != ReasonOverShare {
		t.Fatalf("a without a cap: %+v", r)
	}
}

// TestResizeZero: a pool resized to 0 (a fleet node with no allotment)
// admits nobody, and admits again once it grows.
func TestResizeZero(t *testing.T) {
	p := mustPool(t, 4, 0, newFakeClock())
	if err := p.Resize(0, 0); err != nil {
		t.Fatal(err)
	}
	mustRefuse(t, p, "a")
	if err := p.Resize(0, 1); err == nil {
		t.Fatal("size 0 floor 1 accepted")
	}
	if err := p.Resize(2, 0); err != nil {
		t.Fatal(err)
	}
	acquireN(t, p, "a", 2)
}

// TestCapRetryAfter: a project refused at its cap is told when its own
// releases let it in, not when the pool's would: its pool has room. Before,
// a capped project in a pool with room was told 1 ms, and clients that
// obeyed spun. One refused with the pool full (under its cap) waits for the
// pool's releases; with no release of its own measured, the estimate is the
// window's back-off, never the 1 ms floor.
func TestCapRetryAfter(t *testing.T) {
	clk := newFakeClock()
	p := mustPool(t, 100, 0, clk)
	p.SetCaps(map[string]int{"a": 2}, -1)
	a := acquireN(t, p, "a", 2)
	p.Recompute()
	// a's own releases: 20 in one second (20/s), the pool's the same.
	for range 20 {
		if err := p.Release(a[0]); err != nil {
			t.Fatal(err)
		}
		a[0] = acquireN(t, p, "a", 1)[0]
	}
	clk.Advance(time.Second)
	p.Recompute()
	r := mustRefuse(t, p, "a")
	if r.Reason != ReasonOverCap {
		t.Fatalf("refusal %+v, want over its cap", r)
	}
	// One release of its own at 20/s: 50 ms.
	if r.RetryAfter != 50*time.Millisecond {
		t.Fatalf("a at its cap in a pool with room: retry after %v, want 50ms (its own releases)", r.RetryAfter)
	}
	// Capped b, its cap not reached, the pool full: the pool's releases
	// (20/s, one needed: 50 ms).
	p.SetCaps(map[string]int{"a": 2, "b": 200}, -1)
	b := acquireN(t, p, "b", 98)
	if rb := mustRefuse(t, p, "b"); rb.RetryAfter != 50*time.Millisecond {
		t.Fatalf("b under its cap in a full pool: retry after %v, want 50ms", rb.RetryAfter)
	}
	releaseAll(t, p, b)
	// c, capped at 1, has released nothing: not 1 ms.
	p.SetCaps(map[string]int{"c": 1}, -1)
	acquireN(t, p, "c", 1)
	if rc := mustRefuse(t, p, "c"); rc.RetryAfter <= time.Millisecond {
		t.Fatalf("c at its cap, no release of its own yet: retry after %v", rc.RetryAfter)
	}
}
