// SPDX-License-Identifier: Apache-2.0

package scheduler

import (
	"math"
	"testing"
)

// The wait sum outlives 2^63 nanoseconds of summed wait (292 years, days
// with thousands of tasks always queued): kept in nanoseconds it wrapped
// negative there and scheduler_wait_seconds_sum went backwards.
func TestWaitHistSumDoesNotWrap(t *testing.T) {
	h := newWaitHist()
	const w = int64(4e18) // nanoseconds: three pass 2^63
	prev := 0.0
	for i := 1; i <= 6; i++ {
		h.observe(w)
		sum := h.export().Sum
		if want := float64(i) * 4e9; sum <= prev || math.Abs(sum-want) > want*1e-12 {
			t.Fatalf("after %d waits of %ds the sum is %v, want %v (growing from %v)", i, w/1e9, sum, want, prev)
		}
		prev = sum
	}
	h = newWaitHist() // the nanoseconds below a second carry
	h.observe(1500)
	h.observe(999_999_000)
	if got, want := h.export().Sum, 1.0000005; math.Abs(got-want) > 1e-15 {
		t.Errorf("sum %v, want %v", got, want)
	}
}
