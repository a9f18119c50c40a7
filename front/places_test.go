// SPDX-License-Identifier: Apache-2.0

package front

import (
	"fmt"
	"io"
	"net/http"
	"sync"
	"testing"
	"time"
)

// A project whose exchanges are long (answers that stay open, as a stream
// or a long poll does) takes every place of max_in_flight while alone.
// Another project's short requests, one after another, then run on the
// first place a long exchange gives back, each on the place the one before
// it freed: it is kept for the short project's next request (50 ms), so
// the long project, past its share of places, does not take it back.
// Before, the scheduler's round robin gave every other freed place back to
// the long project, where it stayed: the short project ran one request,
// then waited for the next long exchange to end. Here a long exchange ends
// every 300 ms (its queued successor may take the place), and the 30 short
// requests must be done before ten have: one each would take thirty. On
// the fast path and on Go's server, with 2, 4 and 8 places.
func TestLongExchangesLeaveThePlaces(t *testing.T) {
	for _, fast := range []bool{true, false} {
		for _, places := range []int{2, 4, 8} {
			t.Run(fmt.Sprintf("fast=%v/places=%d", fast, places), func(t *testing.T) {
				longExchangesLeavePlaces(t, fast, places)
			})
		}
	}
}

func longExchangesLeavePlaces(t *testing.T, fast bool, places int) {
	var mu sync.Mutex
	var holds []chan struct{} // one per long exchange begun
	end := make(chan struct{})
	r := newRig(t, rigOpts{poolSize: 64, cfg: Config{MaxInFlight: places},
		tweak: func(f *Front) { f.cfg.FastPath = fast }}, func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path != "/long" {
			_, _ = io.WriteString(w, "short")
			return
		}
		hold := make(chan struct{})
		mu.Lock()
		holds = append(holds, hold)
		mu.Unlock()
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		select {
		case <-hold:
		case <-end:
		case <-req.Context().Done():
		}
	})
	// Twice as many long clients as places: half run, half queue, and
	// each sends its next long request as soon as one ends, so the long
	// project always has requests waiting.
	var clients sync.WaitGroup
	var once sync.Once
	stop := func() { once.Do(func() { close(end) }) }
	defer clients.Wait()
	defer stop() // first: the long exchanges end, then their clients
	for range 2 * places {
		clients.Add(1)
		go func() {
			defer clients.Done()
			for {
				select {
				case <-end:
					return
				default:
				}
				req, _ := http.NewRequest("GET", r.url+"/long", nil)
				req.Header.Set(DefaultProjectHeader, "long")
				resp, err := r.client.Do(req)
				if err != nil {
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}()
	}
	waitFor(t, 10*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(holds) == places && r.sched.Snapshot().InFlight == places
	})
	const shorts = 30
	done := make(chan error, 1)
	go func() {
		for i := range shorts {
			req, _ := http.NewRequest("GET", r.url+"/short", nil)
			req.Header.Set(DefaultProjectHeader, "short")
			resp, err := r.client.Do(req)
			if err != nil {
				done <- fmt.Errorf("short request %d: %w", i, err)
				return
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || resp.StatusCode != http.StatusOK || string(b) != "short" {
				done <- fmt.Errorf("short request %d: %d %q %v", i, resp.StatusCode, b, err)
				return
			}
		}
		done <- nil
	}()
	// The short project's first request waits in its queue.
	waitFor(t, 10*time.Second, func() bool {
		for _, p := range r.sched.Snapshot().Participants {
			if p.Participant == "short" && p.Queue > 0 {
				return true
			}
		}
		return false
	})
	ended := 0
	tick := time.NewTicker(300 * time.Millisecond)
	defer tick.Stop()
	for {
		mu.Lock()
		if ended < len(holds) {
			close(holds[ended]) // the oldest long exchange still under way ends
			ended++
		}
		mu.Unlock()
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%d short requests done after %d long exchanges ended", shorts, ended)
			return
		case <-tick.C:
		}
		if ended >= 10 {
			t.Fatalf("%d long exchanges ended and the %d short requests are not done: the short project does not keep the place it was given", ended, shorts)
		}
	}
}

// waitFor polls cond every 5ms until it holds, failing the test after d.
func waitFor(t *testing.T, d time.Duration, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(d); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("not so after %v", d)
		}
	}
}
