// SPDX-License-Identifier: Apache-2.0

package front

import (
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"

	"github.com/fairshare-dev/fairshare/pools"
)

// Retry-After is right at every rate: at the slowest rate a policy accepts,
// and at one below it or a work debt too large for a Duration (which came
// out as "1" before), the answer is the cap, 60 s, less the pacer's spread
// (half of its largest gap, 10 s); at a rate of 1/s it is a second or two.
func TestRetryAfterAtRateBounds(t *testing.T) {
	rates := pools.NewRates(nil)
	f, err := New(Config{Upstream: "http://127.0.0.1:1", Routes: map[string]string{
		"min.example": "min", "tiny.example": "tiny", "debt.example": "debt", "one.example": "one"}}, Deps{Rates: rates})
	if err != nil {
		t.Fatal(err)
	}
	rates.SetLimits("min", pools.Limits{RequestsPerSec: pools.MinRate})
	rates.SetLimits("tiny", pools.Limits{RequestsPerSec: 1e-12})
	rates.SetLimits("debt", pools.Limits{WorkPerSec: 1})
	rates.Charge("debt", 1e300)
	rates.SetLimits("one", pools.Limits{RequestsPerSec: 1})
	get := func(host string) (int, int) {
		w := httptest.NewRecorder()
		f.ServeHTTP(w, httptest.NewRequest("GET", "http://"+host+"/", nil))
		ra, _ := strconv.Atoi(w.Header().Get("Retry-After"))
		return w.Code, ra
	}
	for _, c := range []struct {
		host     string
		min, max int
	}{{"min.example", 55, 60}, {"tiny.example", 55, 60}, {"debt.example", 55, 60}, {"one.example", 1, 3}} {
		if c.host != "debt.example" {
			get(c.host) // the burst's one token
		}
		code, ra := get(c.host)
		if code != http.StatusTooManyRequests || ra < c.min || ra > c.max {
			t.Errorf("%s: %d Retry-After %d, want 429 with %d..%d", c.host, code, ra, c.min, c.max)
		}
	}
}
