// SPDX-License-Identifier: Apache-2.0

package pace

import (
	"fmt"
	"testing"
	"time"
)

func TestSlotsFollowTheRate(t *testing.T) {
	p := New(time.Minute)
	now := time.Unix(1000, 0)
	for i := range 20 {
		d, gap := p.Slot("a", now, 2*time.Second, 10)
		if want := 2*time.Second + time.Duration(i)*100*time.Millisecond; d != want || gap != 100*time.Millisecond {
			t.Fatalf("slot %d: %v (gap %v), want %v", i, d, gap, want)
		}
	}
	// Another project starts from its own estimate.
	if d, _ := p.Slot("b", now, 300*time.Millisecond, 10); d != 300*time.Millisecond {
		t.Fatalf("b's first slot %v", d)
	}
	// Unknown rate: one per second.
	if _, gap := p.Slot("c", now, 0, 0); gap != time.Second {
		t.Fatalf("gap at unknown rate %v", gap)
	}
	// A later estimate than the queue moves the slot to the estimate.
	if d, _ := p.Slot("a", now, 30*time.Second, 10); d != 30*time.Second {
		t.Fatalf("late estimate: %v", d)
	}
	// Once the slots are past, a refusal starts from its estimate again.
	if d, _ := p.Slot("a", now.Add(time.Hour), 0, 10); d != 0 {
		t.Fatalf("an hour later: %v", d)
	}
}

func TestSlotsStayWithinHorizon(t *testing.T) {
	p := New(time.Minute)
	now := time.Unix(1000, 0)
	for range 10000 {
		if d, _ := p.Slot("greedy", now, 0, 1); d > time.Minute || d < 0 {
			t.Fatalf("slot %v outside [0, 1m]", d)
		}
	}
	if d, _ := p.Slot("greedy", now, 0, 1); d != time.Minute {
		t.Fatalf("greedy: %v, want the horizon", d)
	}
	if d, _ := p.Slot("other", now, time.Hour, 1); d != time.Minute {
		t.Fatalf("estimate past the horizon: %v", d)
	}
	if d, gap := p.Slot("slow", now, 0, 0.001); gap != maxGap || d != 0 {
		t.Fatalf("very slow rate: %v gap %v", d, gap)
	}
}

func TestStaleSlotsAreSwept(t *testing.T) {
	p := New(time.Minute)
	now := time.Unix(1000, 0)
	for i := range sweepMin - 1 {
		p.Slot(fmt.Sprint("p", i), now, 0, 1000)
	}
	// All of those slots are past a second later: the sweep drops them.
	p.Slot("last", now.Add(time.Second), 0, 1000)
	if n := p.Len(); n != 1 {
		t.Fatalf("%d projects kept after the sweep, want 1", n)
	}
}
