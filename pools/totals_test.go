// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"testing"
	"time"
)

// The pool's Admitted and Refused only grow: forgetting an idle project
// drops its own counts, and a total summed over projects would go down with
// them (Prometheus reads that as a counter reset).
func TestSnapshotTotalsSurviveForgetting(t *testing.T) {
	clk := newFakeClock()
	p, err := New(Config{Name: "t", Size: 2, Floor: 1, Window: time.Second, Forget: time.Minute}, clk)
	if err != nil {
		t.Fatal(err)
	}
	a, err := p.TryAcquire("a")
	if err != nil {
		t.Fatal(err)
	}
	b, err := p.TryAcquire("a")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.TryAcquire("b"); err == nil {
		t.Fatal("a full pool admitted b")
	}
	var rf Refusal
	if _, ok := p.TryAcquireInto("b", &rf); ok {
		t.Fatal("a full pool admitted b")
	}
	for _, pm := range []Permit{a, b} {
		if err := p.Release(pm); err != nil {
			t.Fatal(err)
		}
	}
	s := p.Snapshot()
	if s.Admitted != 2 || s.Refused != 2 || len(s.Projects) != 2 {
		t.Fatalf("before forgetting: admitted %d refused %d projects %d, want 2 2 2", s.Admitted, s.Refused, len(s.Projects))
	}
	// Idle past the window (leave the active set: the recompute after the
	// last ask vouches for it, the next one lets it go), then past Forget.
	clk.Advance(2 * time.Second)
	p.Recompute()
	clk.Advance(2 * time.Second)
	p.Recompute()
	clk.Advance(2 * time.Minute)
	p.Recompute()
	s = p.Snapshot()
	if len(s.Projects) != 0 {
		t.Fatalf("projects not forgotten: %+v", s.Projects)
	}
	if s.Admitted != 2 || s.Refused != 2 {
		t.Fatalf("after forgetting: admitted %d refused %d, want 2 2", s.Admitted, s.Refused)
	}
	if _, err := p.TryAcquire("a"); err != nil {
		t.Fatal(err)
	}
	if s = p.Snapshot(); s.Admitted != 3 {
		t.Fatalf("admitted %d after one more grant, want 3", s.Admitted)
	}
}

// Residents count their spawns and refusals the same way.
func TestResidentsTotalsSurviveForgetting(t *testing.T) {
	clk := newFakeClock()
	r, err := NewResidents(Config{Name: "r", Size: 1, Floor: 1, Window: time.Second, Forget: time.Minute}, clk)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Spawn(t.Context(), "a", "o1"); err != nil {
		t.Fatal(err)
	}
	if err := r.Remove("o1"); err != nil {
		t.Fatal(err)
	}
	clk.Advance(2 * time.Second)
	r.Recompute()
	clk.Advance(2 * time.Second)
	r.Recompute()
	clk.Advance(2 * time.Minute)
	r.Recompute()
	s := r.Snapshot()
	if len(s.Projects) != 0 || s.Admitted != 1 {
		t.Fatalf("projects %+v admitted %d, want none and 1", s.Projects, s.Admitted)
	}
}
