// SPDX-License-Identifier: Apache-2.0

package clock

import (
	"testing"
	"time"
)

type fixed time.Time

func (f fixed) Now() time.Time { return time.Time(f) }

func TestOr(t *testing.T) {
	at := time.Unix(42, 0)
	if got := Or(fixed(at)).Now(); !got.Equal(at) {
		t.Errorf("Or kept %v, want %v", got, at)
	}
	before := time.Now()
	if got := Or(nil).Now(); got.Before(before) || time.Since(got) > time.Minute {
		t.Errorf("Or(nil) read %v, not the system clock (%v)", got, before)
	}
}

// Nanos reads a clock without monotonic readings (a test's) as UnixNano,
// and the system clock as the Unix time of its first reading plus the
// elapsed time, which never goes back. (That a step of the wall clock moves
// no interval is time.Time.Sub's contract for readings that carry the
// monotonic clock; a test cannot make such a reading with another wall.)
func TestNanos(t *testing.T) {
	at := time.Unix(1000, 0)
	n := NewNanos(fixed(at))
	for _, d := range []time.Duration{0, 1500 * time.Millisecond, -time.Hour} {
		if got, want := n.Of(at.Add(d)), at.Add(d).UnixNano(); got != want {
			t.Errorf("without monotonic readings, %v on: %d, want UnixNano %d", d, got, want)
		}
	}
	before := time.Now().UnixNano()
	sys := NewNanos(nil)
	prev := sys.Now()
	if prev < before || prev > time.Now().UnixNano() {
		t.Errorf("first reading %d is not about now (%d)", prev, before)
	}
	for range 1000 {
		next := sys.Now()
		if next < prev {
			t.Fatalf("the reading went back: %d then %d", prev, next)
		}
		prev = next
	}
}
