// SPDX-License-Identifier: Apache-2.0

package front

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/pools"
)

// herd is what happened to a crowd of clients refused at one instant that
// then obeyed their Retry-After until admitted.
type herd struct {
	firstReturns map[int]int // second -> clients coming back for the first time
	rerefused    int         // refusals after the first one
	lastSecond   int         // when the last client got in
}

// maxShare is the largest fraction of the first returns in one second.
func (h herd) maxShare() float64 {
	var most, all int
	for _, n := range h.firstReturns {
		most = max(most, n)
		all += n
	}
	return float64(most) / float64(all)
}

// simulateHerd sends n requests at t0 through ask (which returns 0 for
// admitted, else the Retry-After in seconds) and then, second by second on
// the manual clock, sends each refused client again when its Retry-After
// says.
func simulateHerd(t *testing.T, clk *testutil.FakeClock, n int, ask func() int) herd {
	t.Helper()
	t0 := clk.Now()
	h := herd{firstReturns: map[int]int{}}
	due := map[int]int{} // second -> clients due
	for range n {
		if ra := ask(); ra > 0 {
			due[ra]++
			h.firstReturns[ra]++
		}
	}
	for sec := 1; sec <= 300 && len(due) > 0; sec++ {
		clk.Set(t0.Add(time.Duration(sec) * time.Second))
		k := due[sec]
		delete(due, sec)
		for range k {
			ra := ask()
			if ra == 0 {
				h.lastSecond = sec
				continue
			}
			h.rerefused++
			due[sec+ra]++
		}
	}
	if len(due) > 0 {
		t.Fatalf("clients still waiting after 300s: %v", due)
	}
	return h
}

// TestRetryAfterSpreadsHerd: 250 clients of one project at 50 requests/s
// arrive at once; 50 pass and 200 are refused. Obeying the front's
// Retry-After they come back spread over the seconds at about the rate the
// bucket refills, and are rarely refused again. The baseline, a fixed
// "Retry-After: 1" (what rounding any sub-second estimate up gives), brings
// all 200 back in the same second, where 150 are refused again, and so on.
func TestRetryAfterSpreadsHerd(t *testing.T) {
	const n, rate = 250, 50
	up := httptest.NewServer(http.HandlerFunc(ok))
	t.Cleanup(up.Close)

	clk := testutil.NewFakeClock()
	rates := pools.NewRates(clk)
	rates.SetLimits("crowd", pools.Limits{RequestsPerSec: rate})
	f, err := New(Config{Upstream: up.URL, TrustedPeers: []string{"192.0.2.1"}}, Deps{Rates: rates, Clock: clk, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.CloseIdle)
	paced := simulateHerd(t, clk, n, func() int {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest("GET", "/", nil)
		req.Header.Set(DefaultProjectHeader, "crowd")
		f.ServeHTTP(rec, req)
		if rec.Code == 200 {
			return 0
		}
		if rec.Code != 429 {
			t.Fatalf("status %d", rec.Code)
		}
		ra, err := strconv.Atoi(rec.Header().Get("Retry-After"))
		if err != nil || ra < 1 {
			t.Fatalf("Retry-After %q", rec.Header().Get("Retry-After"))
		}
		return ra
	})

	bclk := testutil.NewFakeClock()
	brates := pools.NewRates(bclk)
	brates.SetLimits("crowd", pools.Limits{RequestsPerSec: rate})
	fixed := simulateHerd(t, bclk, n, func() int {
		if ok, _ := brates.Allow("crowd"); ok {
			return 0
		}
		return 1
	})

	t.Logf("paced: first returns by second %v, max %.0f%% in one second, %d refused again, all in by %ds",
		paced.firstReturns, 100*paced.maxShare(), paced.rerefused, paced.lastSecond)
	t.Logf("fixed 1s: first returns by second %v, max %.0f%% in one second, %d refused again, all in by %ds",
		fixed.firstReturns, 100*fixed.maxShare(), fixed.rerefused, fixed.lastSecond)
	if fixed.maxShare() != 1 || fixed.rerefused < 250 {
		t.Fatalf("baseline is not a herd: %+v", fixed)
	}
	if paced.maxShare() > 0.4 {
		t.Errorf("paced: %.0f%% of the refused clients return in one second, want at most 40%%", 100*paced.maxShare())
	}
	if paced.rerefused*4 > fixed.rerefused {
		t.Errorf("paced: %d refused again, want under a quarter of the baseline's %d", paced.rerefused, fixed.rerefused)
	}
	// Spreading must not slow the crowd down much: the bucket admits 50/s,
	// so 200 need 4s whatever the order.
	if paced.lastSecond > fixed.lastSecond+3 {
		t.Errorf("paced crowd all in by %ds, baseline by %ds", paced.lastSecond, fixed.lastSecond)
	}
}

// TestRetryPacer checks the pacer alone: slots follow the rate, start at
// the estimate, stay within the cap, and projects do not share slots.
func TestRetryPacer(t *testing.T) {
	now := time.Unix(1000, 0)
	p := newRetryPacer(7)
	var sum float64
	got := map[int]int{}
	for range 100 {
		s := p.seconds("a", now, 2*time.Second, 10)
		got[s]++
		sum += float64(s)
		if s < 1 {
			t.Fatalf("Retry-After %d out of bounds", s)
		}
	}
	// Slots at 2s + i/10 for i < 100, each plus U[0, 0.1s): mean 2 + 4.95 + 0.05.
	if mean := sum / 100; mean < 6.5 || mean > 7.5 {
		t.Errorf("mean Retry-After %.2f, want about 7", mean)
	}
	if len(got) < 8 {
		t.Errorf("Retry-After values %v: not spread", got)
	}
	for s := range got {
		if s < 1 || s > 13 {
			t.Errorf("value %d outside [1, 13]", s)
		}
	}
	// Another project starts at its own estimate.
	if s := p.seconds("b", now, 0, 10); s > 2 {
		t.Errorf("b's first Retry-After %d, want 1 or 2", s)
	}
	// A project that never obeys pushes only itself out, to the bound.
	for range 1000 {
		p.seconds("greedy", now, 0, 10)
	}
	if s := p.seconds("greedy", now, 0, 10); s != int(retryHorizon.Seconds()) {
		t.Errorf("greedy after 1000 refusals at 10/s: %d, want the bound %v", s, retryHorizon)
	}
	if s := p.seconds("c", now, 0, 10); s > 1 {
		t.Errorf("another project beside greedy: %d, want 1", s)
	}
	// Once slots are in the past, a refusal starts from the estimate again.
	if s := p.seconds("a", now.Add(time.Minute), 0, 10); s > 2 {
		t.Errorf("a a minute later: %d, want 1 or 2", s)
	}
}

// TestShareRetrySpread: a crowd refused by the requests pool at one instant
// gets Retry-After values spaced at the pool's measured release rate, not one
// shared value.
func TestShareRetrySpread(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(ok))
	t.Cleanup(up.Close)
	clk := testutil.NewFakeClock()
	pool, err := pools.New(pools.Config{Name: "requests", Size: 10}, clk)
	if err != nil {
		t.Fatal(err)
	}
	// 20 releases in one second: the pool frees 20 permits a second.
	held := make([]pools.Permit, 0, 10)
	for range 10 {
		pm, err := pool.TryAcquire("other")
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, pm)
	}
	pool.Recompute()
	for range 20 {
		if err := pool.Release(held[0]); err != nil {
			t.Fatal(err)
		}
		if held[0], err = pool.TryAcquire("other"); err != nil {
			t.Fatal(err)
		}
	}
	clk.Advance(time.Second)
	pool.Recompute()

	f, err := New(Config{Upstream: up.URL, TrustedPeers: []string{"192.0.2.1"}}, Deps{Requests: pool, Clock: clk, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.CloseIdle)
	counts := map[int]int{}
	const n = 100
	var prevMs int64
	for i := range n {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest("GET", "/", nil)
		req.Header.Set(DefaultProjectHeader, "crowd")
		f.ServeHTTP(rec, req)
		if rec.Code != 429 || rec.Header().Get(HeaderRefused) != "share" {
			t.Fatalf("status %d %q, want 429 share", rec.Code, rec.Header().Get(HeaderRefused))
		}
		ra, _ := strconv.Atoi(rec.Header().Get("Retry-After"))
		counts[ra]++
		// The same slot to the millisecond: the slots are 50ms apart
		// (20/s), each spread over one slot, and the whole seconds are
		// the slot rounded one way or the other (at least 1).
		ms, err := strconv.ParseInt(rec.Header().Get(HeaderRetryAfterMs), 10, 64)
		if err != nil || ms < 1 {
			t.Fatalf("%s %q (%v), want a whole number of milliseconds >= 1", HeaderRetryAfterMs, rec.Header().Get(HeaderRetryAfterMs), err)
		}
		if lo, hi := int64(ra-1)*1000, int64(max(ra, 1)+1)*1000; ms < lo || ms > hi {
			t.Errorf("refusal %d: %s %d, Retry-After %ds: not the same slot", i, HeaderRetryAfterMs, ms, ra)
		}
		if i > 0 && ms < prevMs-50 {
			t.Errorf("refusal %d: %dms after %dms: the slots went back by more than one", i, ms, prevMs)
		}
		prevMs = ms
	}
	if prevMs < 4000 || prevMs > 6000 {
		t.Errorf("the 100th client's slot is %dms, want about 5s (100 at 20/s)", prevMs)
	}
	most := 0
	for _, c := range counts {
		most = max(most, c)
	}
	t.Logf("Retry-After by second: %v", counts)
	// 100 clients at 20/s span about 5s: no second should hold much more
	// than a fifth of them.
	if most > 40 || len(counts) < 4 {
		t.Errorf("Retry-After by second %v: not spread at the release rate", counts)
	}
	for _, pm := range held {
		if err := pool.Release(pm); err != nil {
			t.Fatal(err)
		}
	}
}

// simClient is one client of the Retry-After simulation.
type simClient struct {
	project string
	left    int  // requests still to make
	obeys   bool // sleeps its Retry-After; otherwise retries after retryEvery
	waiting bool // refused and not yet admitted
}

// simResult is what simulateObeying measured.
type simResult struct {
	finish    map[string]time.Duration // per project: when its last client finished
	worst     map[string]float64       // per project: the largest hint / true wait
	maxHint   map[string]int           // per project: the largest hint
	refusals  map[string]int
	completed int
}

// simulateObeying plays clients against a real requests pool on a virtual
// clock: an admitted request holds its permit for service, a refused one
// gets the Retry-After the front computes for the refusal (Front.hint,
// which refuse sends) and, if its client obeys, comes back then. The pool
// is recomputed every second, as the daemon's tick does. A refusal's true
// wait is how long the project's clients then waiting (this one included)
// need at the pool's capacity, size/service, and at least the header's
// resolution of one second; its hint may be at most twice that.
func simulateObeying(t *testing.T, size int, service, retryEvery time.Duration, clients []*simClient) simResult {
	t.Helper()
	clk := testutil.NewFakeClock()
	t0 := clk.Now()
	pool, err := pools.New(pools.Config{Name: "requests", Size: size}, clk)
	if err != nil {
		t.Fatal(err)
	}
	f, err := New(Config{Upstream: "http://upstream.test"}, Deps{Requests: pool, Clock: clk, Seed: 5})
	if err != nil {
		t.Fatal(err)
	}
	capacity := float64(size) / service.Seconds()
	res := simResult{finish: map[string]time.Duration{}, worst: map[string]float64{}, maxHint: map[string]int{}, refusals: map[string]int{}}
	type event struct {
		at      time.Duration
		client  int
		release *pools.Permit
	}
	var queue []event // kept sorted by at, releases first
	push := func(e event) {
		i := len(queue)
		for i > 0 && (queue[i-1].at > e.at || queue[i-1].at == e.at && e.release != nil && queue[i-1].release == nil) {
			i--
		}
		queue = append(queue[:i], append([]event{e}, queue[i:]...)...)
	}
	for i := range clients {
		push(event{at: time.Duration(i) * time.Millisecond, client: i})
	}
	var tick time.Duration
	for len(queue) > 0 {
		e := queue[0]
		queue = queue[1:]
		for tick+time.Second <= e.at {
			tick += time.Second
			clk.Set(t0.Add(tick))
			pool.Recompute()
		}
		clk.Set(t0.Add(e.at))
		if e.at > 2*time.Hour {
			t.Fatalf("still running after 2 virtual hours")
		}
		if e.release != nil {
			if err := pool.Release(*e.release); err != nil {
				t.Fatal(err)
			}
			continue
		}
		c := clients[e.client]
		pm, err := pool.TryAcquire(c.project)
		if err == nil {
			c.waiting = false
			res.completed++
			push(event{at: e.at + service, release: &pm})
			if c.left--; c.left > 0 {
				push(event{at: e.at + service, client: e.client})
			} else {
				res.finish[c.project] = max(res.finish[c.project], e.at+service)
			}
			continue
		}
		var ref *pools.Refusal
		if !errors.As(err, &ref) {
			t.Fatal(err)
		}
		c.waiting = true
		hint := f.hint(c.project, ref.RetryAfter, ref.ReleaseRate)
		q := 0
		for _, o := range clients {
			if o.project == c.project && o.waiting {
				q++
			}
		}
		truth := max(1, float64(q)/capacity)
		res.refusals[c.project]++
		res.maxHint[c.project] = max(res.maxHint[c.project], hint)
		if c.obeys {
			res.worst[c.project] = max(res.worst[c.project], float64(hint)/truth)
			push(event{at: e.at + time.Duration(hint)*time.Second, client: e.client})
		} else {
			push(event{at: e.at + retryEvery, client: e.client})
		}
	}
	return res
}

// TestRetryAfterHonest: clients that obey their Retry-After are done about
// when the pool's capacity allows, and no hint is more than twice the true
// wait; a flood of clients that ignore it pushes only their own project's
// hints out.
func TestRetryAfterHonest(t *testing.T) {
	// 16 clients of one project, 5 requests each, a pool of 4 serving each
	// in 500ms: 8 requests/s, 10s of work.
	const n, k, size, service = 16, 5, 4, 500 * time.Millisecond
	var clients []*simClient
	for range n {
		clients = append(clients, &simClient{project: "crowd", left: k, obeys: true})
	}
	res := simulateObeying(t, size, service, 0, clients)
	ideal := time.Duration(n*k) * service / size
	t.Logf("obeying crowd: done in %v (capacity %v), %d refusals, worst hint/true wait %.2f, largest hint %ds",
		res.finish["crowd"], ideal, res.refusals["crowd"], res.worst["crowd"], res.maxHint["crowd"])
	if res.finish["crowd"] > ideal*3/2 {
		t.Errorf("obeying crowd done in %v, want within 1.5x of the capacity time %v", res.finish["crowd"], ideal)
	}
	if res.worst["crowd"] > 2 {
		t.Errorf("a hint was %.2fx its true wait, want at most 2x", res.worst["crowd"])
	}

	// A flood of 32 clients retrying every 10ms at once, beside a light
	// project of 2 obeying clients.
	clients = nil
	for range 32 {
		clients = append(clients, &simClient{project: "flood", left: 20})
	}
	for range 2 {
		clients = append(clients, &simClient{project: "light", left: 10, obeys: true})
	}
	// One client of the flooding project obeys.
	clients = append(clients, &simClient{project: "flood", left: 10, obeys: true})
	res = simulateObeying(t, size, service, 10*time.Millisecond, clients)
	t.Logf("flood beside a light project: flood's largest hint %ds over %d refusals (its obeying client: worst hint/true wait %.2f); light's largest %ds, worst hint/true wait %.2f, done at %v",
		res.maxHint["flood"], res.refusals["flood"], res.worst["flood"], res.maxHint["light"], res.worst["light"], res.finish["light"])
	if res.worst["light"] > 2 {
		t.Errorf("light project: a hint was %.2fx its true wait", res.worst["light"])
	}
	if res.maxHint["light"] > 2 || res.maxHint["flood"] != int(retryHorizon.Seconds()) {
		t.Errorf("the flood's hints (up to %ds) were not pushed past the light project's (%ds)", res.maxHint["flood"], res.maxHint["light"])
	}
}

// BenchmarkRetryObeying: 16 clients of one project that obey Retry-After,
// 5 requests each, through the front to an upstream that takes 250ms, with a
// requests pool of 4 (16 requests a second, 5s of work) recomputed every
// second as the daemon does. It reports done/capacity (target at most 1.5)
// and the largest Retry-After given. A benchmark, not a test: it takes
// seconds of real time and moves with the machine's load; TestRetryAfterHonest
// is the same scenario on a virtual clock.
func BenchmarkRetryObeying(b *testing.B) {
	const n, k, size, service = 16, 5, 4, 250 * time.Millisecond
	r := newRig(b, rigOpts{poolSize: size}, func(w http.ResponseWriter, _ *http.Request) {
		time.Sleep(service)
		_, _ = io.WriteString(w, "ok\n")
	})
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		tk := time.NewTicker(time.Second)
		defer tk.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tk.C:
				r.pool.Recompute()
			}
		}
	}()
	defer func() { close(stop); <-done }()
	ideal := time.Duration(n*k) * service / size
	var (
		ratios  []float64
		mu      sync.Mutex
		maxHint int
		refused int
	)
	for b.Loop() {
		start := time.Now()
		var wg sync.WaitGroup
		for range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for left := k; left > 0; {
					resp := r.get(b, "crowd", "/")
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode == http.StatusOK {
						left--
						continue
					}
					ra, err := strconv.Atoi(resp.Header.Get("Retry-After"))
					if resp.StatusCode != http.StatusTooManyRequests || err != nil {
						b.Errorf("status %d, Retry-After %q", resp.StatusCode, resp.Header.Get("Retry-After"))
						return
					}
					mu.Lock()
					maxHint, refused = max(maxHint, ra), refused+1
					mu.Unlock()
					time.Sleep(time.Duration(ra) * time.Second)
				}
			}()
		}
		wg.Wait()
		ratios = append(ratios, time.Since(start).Seconds()/ideal.Seconds())
	}
	slices.Sort(ratios)
	b.ReportMetric(ratios[len(ratios)/2], "done/capacity")
	b.ReportMetric(float64(maxHint), "max-retry-after-s")
	b.ReportMetric(float64(refused)/float64(len(ratios)), "refusals/run")
	b.ReportMetric(0, "ns/op")
}
