// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"math"
	"sync"
	"testing"
	"time"
)

func TestRatesUnbounded(t *testing.T) {
	r := NewRates(newFakeClock())
	for i := 0; i < 10000; i++ {
		if ok, _ := r.Allow("free"); !ok {
			t.Fatal("unbounded project refused")
		}
	}
	r.Charge("free", 1e9)
	if ok, _ := r.Allow("free"); !ok {
		t.Fatal("unbounded project refused after a charge")
	}
	r.SetLimits("p", Limits{RequestsPerSec: 1})
	r.SetLimits("p", Limits{}) // back to unbounded: state dropped
	if len(r.Snapshot()) != 0 {
		t.Fatalf("state kept for an unbounded project: %+v", r.Snapshot())
	}
}

// TestRatesTimeline: burst of one second's worth, refill, refusal with the
// time to the next token.
func TestRatesTimeline(t *testing.T) {
	clk := newFakeClock()
	r := NewRates(clk)
	r.SetLimits("p", Limits{RequestsPerSec: 10})
	type step struct {
		advance time.Duration
		ok      bool
		retry   time.Duration
	}
	var tl []step
	for i := 0; i < 10; i++ {
		tl = append(tl, step{ok: true}) // the burst
	}
	tl = append(tl,
		step{ok: false, retry: 100 * time.Millisecond},
		step{advance: 50 * time.Millisecond, ok: false, retry: 50 * time.Millisecond},
		step{advance: 50 * time.Millisecond, ok: true},
		step{ok: false, retry: 100 * time.Millisecond},
		step{advance: 10 * time.Second, ok: true}, // refill caps at the burst
	)
	for i := 0; i < 9; i++ {
		tl = append(tl, step{ok: true})
	}
	tl = append(tl, step{ok: false, retry: 100 * time.Millisecond})
	for i, s := range tl {
		clk.Advance(s.advance)
		ok, retry := r.Allow("p")
		if ok != s.ok || (!ok && (retry < s.retry-time.Microsecond || retry > s.retry+time.Microsecond)) {
			t.Fatalf("step %d: ok %v retry %v, want %v %v", i, ok, retry, s.ok, s.retry)
		}
	}
	if st := r.State("p"); st.Limited != 4 {
		t.Fatalf("limited %d", st.Limited)
	}
}

func TestRatesSlowRateStillAdmits(t *testing.T) {
	clk := newFakeClock()
	r := NewRates(clk)
	r.SetLimits("p", Limits{RequestsPerSec: 0.5}) // burst is at least 1 token
	if ok, _ := r.Allow("p"); !ok {
		t.Fatal("first request refused")
	}
	ok, retry := r.Allow("p")
	if ok || retry != 2*time.Second {
		t.Fatalf("ok %v retry %v", ok, retry)
	}
}

// TestRatesDebt: work is charged after the fact and may drive the bucket
// below zero; requests are refused until the refill brings it back to zero.
func TestRatesDebt(t *testing.T) {
	clk := newFakeClock()
	r := NewRates(clk)
	r.SetLimits("p", Limits{WorkPerSec: 100})
	if ok, _ := r.Allow("p"); !ok {
		t.Fatal("refused before any work")
	}
	r.Charge("p", 350) // 100 - 350 = -250: 2.5 s of debt
	if st := r.State("p"); st.WorkTokens != -250 {
		t.Fatalf("work tokens %v", st.WorkTokens)
	}
	ok, retry := r.Allow("p")
	if ok || retry != 2500*time.Millisecond {
		t.Fatalf("in debt: ok %v retry %v", ok, retry)
	}
	clk.Advance(2 * time.Second)
	ok, retry = r.Allow("p")
	if ok || retry != 500*time.Millisecond {
		t.Fatalf("still in debt: ok %v retry %v", ok, retry)
	}
	clk.Advance(500 * time.Millisecond)
	if ok, _ := r.Allow("p"); !ok {
		t.Fatal("refused at zero balance")
	}
	if st := r.State("p"); st.Limited != 2 || st.WorkTokens != 0 {
		t.Fatalf("state %+v", st)
	}
	// Debt and request rate together: debt is reported first.
	r.SetLimits("q", Limits{RequestsPerSec: 1, WorkPerSec: 1})
	r.Charge("q", 3)
	if ok, retry := r.Allow("q"); ok || retry != 2*time.Second {
		t.Fatalf("q: ok %v retry %v", ok, retry)
	}
	if st := r.State("q"); st.RequestTokens != 1 {
		t.Fatalf("a refusal for debt took a request token: %+v", st)
	}
}

// A rate added to a project that had only the other starts full, as a new
// bucket does. It started with the one token a bucket without a rate holds:
// after work 50/s, requests 100/s admitted one request at once, not 100, and
// the other order started the work bucket at 1.
func TestRatesAddedRateStartsFull(t *testing.T) {
	r := NewRates(newFakeClock())
	r.SetLimits("p", Limits{WorkPerSec: 50})
	r.SetLimits("p", Limits{RequestsPerSec: 100, WorkPerSec: 50})
	if st := r.State("p"); st.RequestTokens != 100 || st.WorkTokens != 50 {
		t.Errorf("requests added to work: %v request and %v work tokens, want 100 and 50", st.RequestTokens, st.WorkTokens)
	}
	for i := range 100 {
		if ok, _ := r.Allow("p"); !ok {
			t.Errorf("request %d of the burst of 100 refused", i+1)
			break
		}
	}
	r.SetLimits("q", Limits{RequestsPerSec: 100})
	r.SetLimits("q", Limits{RequestsPerSec: 100, WorkPerSec: 50})
	if st := r.State("q"); st.RequestTokens != 100 || st.WorkTokens != 50 {
		t.Errorf("work added to requests: %v request and %v work tokens, want 100 and 50", st.RequestTokens, st.WorkTokens)
	}
	r.Charge("q", 50) // the work burst, down to zero: no debt
	if ok, _ := r.Allow("q"); !ok {
		t.Error("refused after charging the work bucket's burst")
	}
	// A rate changed, not added, keeps its balance.
	r.SetLimits("q", Limits{RequestsPerSec: 200, WorkPerSec: 50})
	if st := r.State("q"); st.RequestTokens != 99 || st.WorkTokens != 0 {
		t.Errorf("changed rate: %v request and %v work tokens, want 99 and 0", st.RequestTokens, st.WorkTokens)
	}
}

// TestRatesOutOfOrderTimestamps is the regression test for golang/go#71360:
// timestamps read before the lock arrive out of order; an older one must not
// move the bucket's time back and pay the same interval twice.
func TestRatesOutOfOrderTimestamps(t *testing.T) {
	r := NewRates(newFakeClock())
	base := r.ns.Now()
	r.setLimits("p", Limits{RequestsPerSec: 10}, base)
	admitted := 0
	// 10 s of calls; every other call carries a timestamp 1 s older.
	for i := 0; i < 10000; i++ {
		now := base + int64(i)*int64(time.Millisecond)
		if i%2 == 1 {
			now -= int64(time.Second)
		}
		if ok, _ := r.allow("p", func() int64 { return now }); ok {
			admitted++
		}
	}
	// Over 10 s at 10/s with a burst of 10: at most 110 (+1).
	if admitted > 111 {
		t.Fatalf("admitted %d > rate*T + burst", admitted)
	}
	if admitted < 100 {
		t.Fatalf("admitted only %d", admitted)
	}
}

// TestRatesConcurrentBound: under contention from many goroutines, admitted
// <= rate*T + burst.
func TestRatesConcurrentBound(t *testing.T) {
	clk := newFakeClock()
	r := NewRates(clk)
	r.SetLimits("p", Limits{RequestsPerSec: 1000})
	var mu sync.Mutex
	admitted := 0
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 2000; i++ {
				if i%100 == 0 {
					clk.Advance(time.Millisecond)
				}
				if ok, _ := r.Allow("p"); ok {
					mu.Lock()
					admitted++
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	elapsed := 160 * time.Millisecond // 8 goroutines x 20 advances of 1 ms
	if limit := 1000*elapsed.Seconds() + 1000 + 1; float64(admitted) > limit {
		t.Fatalf("admitted %d > %v", admitted, math.Floor(limit))
	}
}

// countingClock counts its reads.
type countingClock struct{ n int }

func (c *countingClock) Now() time.Time { c.n++; return time.Unix(1e9, 0) }

// TestRatesReadClockOnlyWithLimits: a request of a project without limits
// (most) costs Allow and Charge no clock read; one with limits still reads
// it to refill.
func TestRatesReadClockOnlyWithLimits(t *testing.T) {
	clk := &countingClock{}
	r := NewRates(clk)
	r.SetLimits("limited", Limits{RequestsPerSec: 10, WorkPerSec: 10})
	clk.n = 0
	if ok, _ := r.Allow("free"); !ok {
		t.Fatal("a project without limits refused")
	}
	r.Charge("free", 3)
	if clk.n != 0 {
		t.Errorf("a project without limits: %d clock reads, want 0", clk.n)
	}
	if ok, _ := r.Allow("limited"); !ok {
		t.Fatal("limited refused its first request")
	}
	r.Charge("limited", 3)
	if clk.n != 2 {
		t.Errorf("a project with limits: %d clock reads, want 2 (Allow and Charge)", clk.n)
	}
}
