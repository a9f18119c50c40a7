// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"math"
	"testing"
	"time"
)

// The time to the next token is right at every rate a policy accepts, from
// MinRate to MaxRate: positive, one token's time (1/rate, rounded up to the
// nanosecond), and never wrapped around. A rate below MinRate (1e-12 was
// accepted and overflowed to a retry of 1s) is taken as MinRate.
func TestRetryAtEveryAcceptedRate(t *testing.T) {
	clk := newFakeClock()
	r := NewRates(clk)
	for e := math.Log10(MinRate); e <= math.Log10(MaxRate)+1e-9; e += 0.25 {
		rate := math.Pow(10, e)
		r.SetLimits("p", Limits{RequestsPerSec: rate})
		r.buckets["p"].req = 0 // spent (a loop of Allow would take a billion calls at MaxRate)
		ok, retry := r.Allow("p")
		want := time.Duration(math.Ceil(float64(time.Second) / rate))
		if ok || retry <= 0 || retry > want+time.Nanosecond || float64(retry) < 0.999*float64(want) {
			t.Errorf("rate %g: retry %v, want about %v", rate, retry, want)
		}
		r.SetLimits("p", Limits{})
	}
	for _, tiny := range []float64{1e-12, 1e-9, 1e-300, math.SmallestNonzeroFloat64} {
		r.SetLimits("q", Limits{RequestsPerSec: tiny})
		r.Allow("q")
		if ok, retry := r.Allow("q"); ok || retry != 1000*time.Second {
			t.Errorf("rate %g: ok %v retry %v, want the 1000s of MinRate", tiny, ok, retry)
		}
		r.SetLimits("q", Limits{})
	}
}

// Work debt of any size gives a retry of at most MaxRateRetry, never one that
// overflowed into the past.
func TestDebtRetrySaturates(t *testing.T) {
	clk := newFakeClock()
	r := NewRates(clk)
	r.SetLimits("p", Limits{WorkPerSec: MinRate})
	last := time.Duration(0)
	for _, debt := range []float64{2, 1e3, 1e6, 1e9, 1e15, 1e30, 1e300, math.Inf(1), math.NaN(), -5} {
		r.Charge("p", debt)
		ok, retry := r.Allow("p")
		if ok || retry <= 0 || retry > MaxRateRetry || retry < last {
			t.Errorf("after a charge of %g: ok %v retry %v (before %v)", debt, ok, retry, last)
		}
		last = retry
	}
	if last != MaxRateRetry {
		t.Errorf("a huge debt gives %v, want MaxRateRetry", last)
	}
}

// A debt, however large, is repaid by a day of the bucket's own refill: at
// every work rate a policy accepts, a charge of 1e300 (an upstream's cost
// header) holds the project back a day, not the years the refill would
// take, and the retry it is told then holds; so does a debt made before
// the rate was lowered.
func TestDebtStopsAtADayOfRefill(t *testing.T) {
	for _, rate := range []float64{MinRate, 1e-3, 1, 50, 1e6, MaxRate} {
		clk := newFakeClock()
		r := NewRates(clk)
		r.SetLimits("p", Limits{WorkPerSec: rate})
		for _, work := range []float64{1e300, math.Inf(1), 1e300} {
			r.Charge("p", work)
		}
		ok, retry := r.Allow("p")
		if ok || retry > MaxRateRetry {
			t.Errorf("rate %g: ok %v retry %v, want refused for at most a day", rate, ok, retry)
		}
		clk.Advance(retry)
		if ok, again := r.Allow("p"); !ok {
			t.Errorf("rate %g: refused again %v after the retry of %v", rate, again, retry)
		}
		// A day's debt at this rate, then the rate lowered a
		// thousandfold (a reload): a day of the new rate's refill.
		r.Charge("p", math.Inf(1))
		r.SetLimits("p", Limits{WorkPerSec: max(rate/1000, MinRate)})
		if _, retry := r.Allow("p"); retry > MaxRateRetry {
			t.Errorf("rate %g lowered: retry %v", rate, retry)
		}
		clk.Advance(MaxRateRetry)
		if ok, again := r.Allow("p"); !ok {
			t.Errorf("rate %g lowered a thousandfold: refused again %v after a day", rate, again)
		}
	}
}
