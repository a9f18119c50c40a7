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
	if _, gap := p.Slot("c", now, 300*time.Millisecond, 0); gap != 300*time.Millisecond {
		t.Fatalf("gap at unknown rate %v, want the estimate", gap)
	}
	// A later estimate comes before the project's backlog of 20 slots.
	if d, _ := p.Slot("a", now, 30*time.Second, 10); d != 32*time.Second {
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

func TestUnknownRateIsNotQueued(t *testing.T) {
	p := New(time.Minute)
	now := time.Unix(1000, 0)
	for range 20 {
		if d, _ := p.Slot("a", now, time.Second, 0); d != time.Second {
			t.Fatalf("unknown rate: %v, want the estimate", d)
		}
	}
	// Once the rate is known, the line starts from the estimate.
	if d, _ := p.Slot("a", now, 10*time.Millisecond, 100); d != 10*time.Millisecond {
		t.Fatalf("first slot at a known rate after unknown ones: %v", d)
	}
}

func TestBacklogFollowsTheRate(t *testing.T) {
	p := New(0)
	now := time.Unix(1000, 0)
	for range 10 {
		p.Slot("a", now, 0, 10)
	}
	// Ten due back at 10/s; the rate doubles: they now take half a second.
	if d, _ := p.Slot("a", now, 0, 20); d != 500*time.Millisecond {
		t.Fatalf("after the rate doubled: %v, want 500ms", d)
	}
	// A second later at 20/s the eleven have drained.
	if d, _ := p.Slot("a", now.Add(time.Second), 0, 20); d != 0 {
		t.Fatalf("a second later: %v", d)
	}
}

func TestSpread(t *testing.T) {
	for _, u := range []float64{0, 0.25, 0.5, 0.999} {
		d := Spread(time.Second, 100*time.Millisecond, u)
		if d < 950*time.Millisecond || d >= 1050*time.Millisecond {
			t.Fatalf("Spread(1s, 100ms, %v) = %v", u, d)
		}
	}
	if d := Spread(10*time.Millisecond, time.Second, 0); d != 0 {
		t.Fatalf("Spread below zero: %v", d)
	}
}

// TestTinyRateGapIsCapped: at a rate near zero the gap between slots is the
// most a gap may be. Before, 1s/rate past what a Duration holds wrapped
// negative and the gap read a microsecond: the slowest pool packed its
// refused clients tightest (review).
func TestTinyRateGapIsCapped(t *testing.T) {
	p := New(0)
	now := time.Now()
	for _, rate := range []float64{1e-3, 1e-9, 1e-10, 1e-300} {
		if _, gap := p.Slot("a", now, time.Second, rate); gap != maxGap {
			t.Errorf("rate %g/s: gap %v, want %v", rate, gap, maxGap)
		}
	}
}
