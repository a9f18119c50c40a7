// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"errors"
	"testing"
)

// TryAcquireInto must decide and report exactly like TryAcquire.
func TestTryAcquireIntoMatchesTryAcquire(t *testing.T) {
	a, err := New(Config{Name: "a", Size: 4, Floor: 1}, newFakeClock())
	if err != nil {
		t.Fatal(err)
	}
	b, err := New(Config{Name: "a", Size: 4, Floor: 1}, newFakeClock())
	if err != nil {
		t.Fatal(err)
	}
	var refusals int
	for i, project := range []string{"x", "x", "x", "x", "y", "y", "x", "y", "z"} {
		pa, errA := a.TryAcquire(project)
		var rf Refusal
		rf.Project = "untouched"
		pb, ok := b.TryAcquireInto(project, &rf)
		if (errA == nil) != ok {
			t.Fatalf("ask %d (%s): TryAcquire err %v, TryAcquireInto ok %v", i, project, errA, ok)
		}
		if ok {
			if rf.Project != "untouched" {
				t.Fatalf("ask %d: admission wrote the refusal: %+v", i, rf)
			}
			if pa.Project() != pb.Project() {
				t.Fatalf("ask %d: permits of %q and %q", i, pa.Project(), pb.Project())
			}
			continue
		}
		refusals++
		var want *Refusal
		if !errors.As(errA, &want) {
			t.Fatalf("ask %d: %v is not a *Refusal", i, errA)
		}
		if *want != rf {
			t.Fatalf("ask %d: TryAcquire %+v, TryAcquireInto %+v", i, *want, rf)
		}
		if !errors.Is(&rf, ErrRefused) {
			t.Fatalf("ask %d: filled refusal does not match ErrRefused", i)
		}
	}
	if refusals == 0 {
		t.Fatal("no refusal happened; the test compares nothing")
	}
	if sa, sb := a.Snapshot(), b.Snapshot(); sa.InUse != sb.InUse || len(sa.Projects) != len(sb.Projects) || sa.Projects[0].Refused != sb.Projects[0].Refused {
		t.Fatalf("snapshots differ: %+v vs %+v", sa, sb)
	}
}

func TestTryAcquireIntoRefusesWithoutAllocating(t *testing.T) {
	p, err := New(Config{Name: "a", Size: 1}, newFakeClock())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.TryAcquire("hog"); err != nil {
		t.Fatal(err)
	}
	var rf Refusal
	if n := testing.AllocsPerRun(100, func() {
		if _, ok := p.TryAcquireInto("other", &rf); ok {
			t.Fatal("admitted over a full pool")
		}
	}); n != 0 {
		t.Fatalf("refused path allocates %v times", n)
	}
}
