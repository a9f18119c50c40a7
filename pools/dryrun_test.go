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
