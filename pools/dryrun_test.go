// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"context"
	"testing"
	"time"
)

// TestDryRun: a pool in dry-run admits past its share and past POOL,
// counting each ask the rule refused; a project in dry-run does so alone;
// turning dry-run off enforces again.
func TestDryRun(t *testing.T) {
	clk := newFakeClock()
	p, err := New(Config{Name: "requests", Size: 4, Floor: 1}, clk)
	if err != nil {
		t.Fatal(err)
	}
	p.SetDryRun("", true)
	var held []Permit
	take := func(project string, wantOK, wantWould bool) {
		t.Helper()
		var rf Refusal
		pm, ok := p.TryAcquireInto(project, &rf)
		if ok != wantOK || rf.WouldRefuse != wantWould {
			t.Fatalf("%s: ok %v would %v (%+v), want %v %v", project, ok, rf.WouldRefuse, rf, wantOK, wantWould)
		}
		if wantWould && (rf.Reason == "" || rf.Pool != "requests" || rf.Project != project) {
			t.Fatalf("would-refusal without its numbers: %+v", rf)
		}
		if ok {
			held = append(held, pm)
		}
	}
	for range 4 {
		take("big", true, false) // alone, share 4
	}
	take("small", true, true) // the pool is full: would refuse, admitted
	take("big", true, true)   // over its share on a full pool
	s := p.Snapshot()
	if s.InUse != 6 || s.WouldRefuse != 2 || s.Refused != 0 || s.Admitted != 6 || !s.DryRun {
		t.Fatalf("snapshot %+v", s)
	}
	// Acquire in dry-run admits at once too.
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	pm, err := p.Acquire(ctx, "small")
	if err != nil {
		t.Fatalf("Acquire in dry-run: %v", err)
	}
	held = append(held, pm)
	if s := p.Snapshot(); s.WouldRefuse != 3 || s.InUse != 7 {
		t.Fatalf("after Acquire: %+v", s)
	}

	// Only big in dry-run: small is refused for real, big is admitted.
	p.SetDryRun("", false)
	p.SetDryRun("big", true)
	take("small", false, false)
	take("big", true, true)
	s = p.Snapshot()
	if s.Refused != 1 || s.WouldRefuse != 4 || s.DryRun {
		t.Fatalf("snapshot %+v", s)
	}
	for _, pr := range s.Projects {
		if pr.DryRun != (pr.Project == "big") {
			t.Fatalf("project %+v", pr)
		}
	}
	p.SetDryRun("big", false)
	take("big", false, false)
	for _, pm := range held {
		if err := p.Release(pm); err != nil {
			t.Fatal(err)
		}
	}
	// Forgotten projects keep their counts in the totals and their setting.
	p.SetDryRun("big", true)
	for range 3 { // stamped, left the active set, forgotten
		clk.Advance(2 * time.Minute)
		p.Recompute()
	}
	s = p.Snapshot()
	if len(s.Projects) != 0 || s.Forgotten.WouldRefuse != s.WouldRefuse {
		t.Fatalf("after forgetting: %+v", s)
	}
	for range 4 {
		take("small", true, false)
	}
	take("big", true, true) // a newcomer again, and still in dry-run
}

// TestDryRunAdmitsWaiters: waiters blocked in Acquire when their project (or
// the pool) goes into dry-run are admitted then, in their order, each
// counted as the rule has it. Before, they kept waiting while the project's
// later asks, admitted at once, overtook them, and those asks counted as
// would-refused even when the rule admitted them.
func TestDryRunAdmitsWaiters(t *testing.T) {
	for _, scope := range []string{"", "a"} {
		clk := newFakeClock()
		p, err := New(Config{Name: "requests", Size: 1, Floor: 1}, clk)
		if err != nil {
			t.Fatal(err)
		}
		held, err := p.TryAcquire("a")
		if err != nil {
			t.Fatal(err)
		}
		got := make(chan int, 3)
		for i := range 3 {
			go func() {
				pm, err := p.Acquire(context.Background(), "a")
				if err != nil || !pm.Valid() {
					t.Errorf("waiter %d: %v", i, err)
				}
				got <- i
			}()
			for p.waiters() != i+1 {
				time.Sleep(time.Millisecond)
			}
		}
		p.SetDryRun(scope, true)
		for i := range 3 {
			select {
			case <-got:
			case <-time.After(10 * time.Second):
				t.Fatalf("dry-run of %q: waiter %d of 3 still waiting", scope, i)
			}
		}
		if s := p.Snapshot(); s.InUse != 4 || s.WouldRefuse != 3 {
			t.Errorf("dry-run of %q: in use %d, would-refuse %d; want 4 and 3", scope, s.InUse, s.WouldRefuse)
		}
		_ = p.Release(held)
	}
}
