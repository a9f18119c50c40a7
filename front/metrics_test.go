// SPDX-License-Identifier: Apache-2.0

package front

import (
	"math"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// The front's histogram sums outlive 2^64 nanoseconds of summed time (585
// years, days for a series with thousands of requests always in flight):
// kept in nanoseconds they wrapped there and the exported sums went
// backwards.
func TestMetricsHistogramSumDoesNotWrap(t *testing.T) {
	clk := testutil.NewFakeClock()
	f, err := New(Config{Upstream: "http://upstream.test", MaxProjects: 3}, Deps{Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	const d = time.Duration(math.MaxInt64) // three pass 2^64ns
	prevDur, prevWait := 0.0, 0.0
	for i := 1; i <= 5; i++ {
		f.stats.record("alpha", outcomeOK, d, d, true, clk.Now())
		want := float64(i) * d.Seconds()
		dur := histogramSum(t, f, "fairshare_front_request_duration_seconds", "alpha")
		wait := histogramSum(t, f, "fairshare_front_queue_wait_seconds", "alpha")
		if dur <= prevDur || math.Abs(dur-want) > want*1e-9 || wait <= prevWait || math.Abs(wait-want) > want*1e-9 {
			t.Fatalf("after %d requests of %v: duration sum %v, wait sum %v; want %v (growing from %v, %v)", i, d, dur, wait, want, prevDur, prevWait)
		}
		prevDur, prevWait = dur, wait
	}
	// The nanoseconds below a microsecond carry to later requests.
	f.stats.record("beta", outcomeOK, 1500*time.Nanosecond, 0, true, clk.Now())
	f.stats.record("beta", outcomeOK, 2500*time.Nanosecond, 0, true, clk.Now())
	if got := histogramSum(t, f, "fairshare_front_request_duration_seconds", "beta"); math.Abs(got-4e-6) > 1e-15 {
		t.Errorf("beta's duration sum %v, want 4µs", got)
	}
}

// histogramSum is the sum of project's series of the histogram name.
func histogramSum(t *testing.T, f *Front, name, project string) float64 {
	t.Helper()
	for _, m := range series(t, f, name) {
		for _, l := range m.GetLabel() {
			if l.GetName() == "project" && l.GetValue() == project {
				return m.GetHistogram().GetSampleSum()
			}
		}
	}
	t.Fatalf("no %s series for %s", name, project)
	return 0
}
