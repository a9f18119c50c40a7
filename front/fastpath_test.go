// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/pools"
)

// fastRig is a rig whose front serves on the fast path.
func fastRig(t *testing.T, o rigOpts, upstream http.HandlerFunc) *rig {
	t.Helper()
	tweak := o.tweak
	o.tweak = func(f *Front) {
		f.cfg.FastPath = true
		if tweak != nil {
			tweak(f)
		}
	}
	r := newRig(t, o, upstream)
	deadline := time.Now().Add(5 * time.Second)
	for r.front.fast.Load() == nil {
		if time.Now().After(deadline) {
			t.Fatal("the fast path did not start")
		}
		time.Sleep(time.Millisecond)
	}
	return r
}

// TestFastPathServes: plain exchanges stay in the loops (no connection is
// handed to net/http's server), keep both their client and their upstream
// connection, and relay an answer larger than the loop's buffer and the
// sockets' to a client that reads it late; a refusal is answered there
// too. An HTTP/1.0 request is handed over, and answered.
func TestFastPathServes(t *testing.T) {
	big := strings.Repeat("0123456789abcdef", 1<<19) // 8 MiB: more than the sockets hold
	var (
		mu    sync.Mutex
		conns = map[string]bool{}
	)
	r := fastRig(t, rigOpts{poolSize: 4}, func(w http.ResponseWriter, req *http.Request) {
		mu.Lock()
		conns[req.RemoteAddr] = true
		mu.Unlock()
		b, _ := io.ReadAll(req.Body)
		w.Header().Set("Content-Type", "text/plain")
		switch req.URL.Path {
		case "/big":
			w.Header().Set("Content-Length", strconv.Itoa(len(big)))
			_, _ = io.WriteString(w, big)
		default:
			_, _ = fmt.Fprintf(w, "%s %s %d", req.Method, req.URL.Path, len(b))
		}
	})
	c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	send := func(raw string) *http.Response {
		t.Helper()
		if _, err := io.WriteString(c, raw); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	for i := range 3 {
		resp := send("GET /a HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\n\r\n")
		if b := readAll(t, resp); resp.StatusCode != 200 || b != "GET /a 0" || resp.Header.Get(HeaderClass) == "" {
			t.Fatalf("GET %d: %d %q %v", i, resp.StatusCode, b, resp.Header)
		}
	}
	resp := send("POST /p HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\nContent-Length: 5\r\n\r\nhello")
	if b := readAll(t, resp); b != "POST /p 5" {
		t.Fatalf("POST: %d %q", resp.StatusCode, b)
	}
	resp = send("GET /big HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\n\r\n")
	time.Sleep(200 * time.Millisecond) // the front waits on the client
	if b := readAll(t, resp); b != big {
		t.Fatalf("big answer: %d bytes, want %d", len(b), len(big))
	}
	// Two requests in one write: pipelined.
	if _, err := io.WriteString(c, "GET /1 HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\n\r\nGET /2 HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"GET /1 0", "GET /2 0"} {
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		if b := readAll(t, resp); b != want {
			t.Fatalf("pipelined: %q, want %q", b, want)
		}
	}
	waitInUse(t, r.pool, 0)
	if n := r.front.fast.Load().handedN.Load(); n != 0 {
		t.Errorf("%d connections handed to net/http's server, want 0", n)
	}
	mu.Lock()
	if len(conns) != 1 {
		t.Errorf("the upstream saw %d connections, want 1 (kept alive)", len(conns))
	}
	mu.Unlock()

	// A project over its share is refused in the loop, as ServeHTTP does.
	r.rates.SetLimits("slow", pools.Limits{RequestsPerSec: 0.001})
	send("GET / HTTP/1.1\r\nHost: x\r\nFairshare-Project: slow\r\n\r\n").Body.Close()
	resp = send("GET / HTTP/1.1\r\nHost: x\r\nFairshare-Project: slow\r\n\r\n")
	if b := readAll(t, resp); resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") == "" ||
		resp.Header.Get(HeaderRetryAfterMs) == "" || resp.Header.Get(HeaderRefused) != "rate" || !strings.Contains(b, "slow") {
		t.Errorf("refusal: %d %v %q", resp.StatusCode, resp.Header, b)
	}
	if n := r.front.fast.Load().handedN.Load(); n != 0 {
		t.Errorf("%d connections handed over after a refusal, want 0", n)
	}

	// HTTP/1.0 is net/http's.
	resp = send("GET /old HTTP/1.0\r\nHost: x\r\nFairshare-Project: alpha\r\nConnection: keep-alive\r\n\r\n")
	if b := readAll(t, resp); resp.StatusCode != 200 || b != "GET /old 0" {
		t.Errorf("HTTP/1.0: %d %q", resp.StatusCode, b)
	}
	if n := r.front.fast.Load().handedN.Load(); n != 1 {
		t.Errorf("%d connections handed over, want 1", n)
	}
	// The loops sent with their io_uring, or, with
	// FAIRSHARE_FRONT_PLAIN_SENDS=1 (Config.PlainSends), without.
	var ringSent int64
	for _, lp := range r.front.fast.Load().loops {
		ringSent += lp.ringSent.Load()
		if err := lp.ringErr; err != nil && !plainSendsAlways {
			if ringDenied(err) {
				t.Logf("no io_uring here: %v", err)
				return
			}
			t.Errorf("a loop has no io_uring (this kernel gives one): %v", err)
		}
	}
	if plainSendsAlways && ringSent != 0 || !plainSendsAlways && ringSent < 20 {
		t.Errorf("%d sends with the ring (plain sends %v)", ringSent, plainSendsAlways)
	}
}

// TestFastPathIdleUpstreamSpeaks: an idle pooled connection on which the
// upstream sends bytes nobody asked for is closed by the loop, and the next
// request gets its own answer on a new connection.
func TestFastPathIdleUpstreamSpeaks(t *testing.T) {
	u := newHostileUpstream(t)
	front, f := hostileFront(t, u, func(f *Front) { f.cfg.FastPath = true })
	if got, _ := hostileSend(t, front, hostileByName(t, "second answer later"), "1", "alpha"); got != gotOwn {
		t.Fatalf("late case: %v", got)
	}
	deadline := time.Now().Add(5 * time.Second)
	for u.openConns() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the idle connection that spoke is still open (%d open)", u.openConns())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got, _ := hostileSend(t, front, hostileByName(t, "honest"), "2", "alpha"); got != gotOwn {
		t.Fatalf("after: %v", got)
	}
	if f.fast.Load() == nil {
		t.Fatal("not on the fast path")
	}
}

// hostileByName returns the index of the hostile case named name.
func hostileByName(t *testing.T, name string) int {
	t.Helper()
	for i, tc := range hostileCases {
		if tc.name == name {
			return i
		}
	}
	t.Fatalf("no hostile case %q", name)
	return -1
}

// TestLoopHeat: a window of hotWindow with at least the threshold's events
// makes the loop hot, one with fewer cool; a look inside a window only
// counts.
func TestLoopHeat(t *testing.T) {
	h := loopHeat{events: 10}
	defer h.cool()
	t0 := time.Now()
	steps := []struct {
		at       time.Duration
		n        int
		switched bool
		hot      bool
	}{
		{0, 9, false, false},                     // the first window: 9 events
		{5 * time.Millisecond, 30, false, false}, // inside the next window
		{hotWindow, 0, true, true},               // its end: 30 events
		{hotWindow + time.Millisecond, 9, false, true},
		{2 * hotWindow, 0, true, false},             // 9 events
		{3 * hotWindow, 10, true, true},             // 10: the threshold
		{3*hotWindow + hotWindow/2, 9, false, true}, // inside
		{5 * hotWindow, 1, false, true},             // a long window, 10 events in all
		{6 * hotWindow, 0, true, false},
	}
	for i, s := range steps {
		if got := h.count(t0.Add(s.at), s.n); got != s.switched || h.hot != s.hot {
			t.Fatalf("step %d (%v, %d events): switched %v, hot %v; want %v, %v", i, s.at, s.n, got, h.hot, s.switched, s.hot)
		}
	}
}

// TestFastPathHeat: a loop is cool under a light load, turns hot under
// load (it holds its OS thread, loopHeat) and cool again after, and every
// client gets its own answers meanwhile.
func TestFastPathHeat(t *testing.T) {
	r := fastRig(t, rigOpts{poolSize: 64, tweak: func(f *Front) { f.fastHotEvents = 20 }},
		func(w http.ResponseWriter, req *http.Request) { _, _ = io.WriteString(w, req.URL.Path) })
	lp := r.front.fast.Load().loops[0]
	addr := strings.TrimPrefix(r.url, "http://")
	client := func(id, n int) error {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			return err
		}
		defer c.Close()
		br := bufio.NewReader(c)
		for i := range n {
			path := fmt.Sprintf("/c%d/r%d", id, i)
			if _, err := fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\n\r\n", path); err != nil {
				return err
			}
			_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				return err
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil {
				return err
			}
			if resp.StatusCode != 200 || string(b) != path {
				return fmt.Errorf("%s: %d %q", path, resp.StatusCode, b)
			}
		}
		return nil
	}
	// light sends one request a window and a half apart until the loop is
	// cool (a window ends with a request or two in it, 20 allowed).
	next := 0
	light := func(when string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for first := true; first || lp.hot.Load(); first = false {
			if time.Now().After(deadline) {
				t.Fatalf("%s: the loop stayed hot under one request every %v", when, 3*hotWindow/2)
			}
			time.Sleep(3 * hotWindow / 2)
			next++
			if err := client(10000+next, 1); err != nil {
				t.Fatal(err)
			}
		}
	}
	light("before the load")
	deadline := time.Now().Add(20 * time.Second)
	for round := 0; ; round++ {
		if time.Now().After(deadline) {
			t.Fatal("the loop did not turn hot under 8 clients")
		}
		var (
			wg     sync.WaitGroup
			done   = make(chan struct{})
			sawHot = make(chan bool, 1)
			errs   = make(chan error, 8)
		)
		go func() {
			saw := false
			for !saw {
				select {
				case <-done:
					sawHot <- false
					return
				case <-time.After(time.Millisecond):
					saw = lp.hot.Load()
				}
			}
			sawHot <- true
		}()
		for id := range 8 {
			wg.Go(func() { errs <- client(round*8+id, 100) })
		}
		wg.Wait()
		close(done)
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatal(err)
			}
		}
		if <-sawHot {
			break
		}
	}
	light("after the load")
}

// TestStopBy: the drain's end only moves earlier, and the time stopBy
// returns keeps the monotonic reading of the time it was given, so that a
// step of the wall clock does not move the drain's end.
func TestStopBy(t *testing.T) {
	fs := &fastServer{}
	t0 := time.Now()
	for _, c := range []struct{ ask, want time.Duration }{
		{5 * time.Second, 5 * time.Second},
		{10 * time.Second, 5 * time.Second},
		{time.Second, time.Second},
		{2 * time.Second, time.Second},
	} {
		got := fs.stopBy(t0.Add(c.ask))
		if d := got.Sub(t0); d != c.want {
			t.Errorf("stopBy(+%v) = +%v, want +%v", c.ask, d, c.want)
		}
		if !strings.Contains(got.String(), "m=") {
			t.Errorf("stopBy(+%v) = %v: no monotonic reading", c.ask, got)
		}
	}
}

// TestDrainKeepsEarlierEnd: of the drains posted to a loop (the stop's and
// a failed listener's, in either order), the earliest end holds.
func TestDrainKeepsEarlierEnd(t *testing.T) {
	t0 := time.Now()
	for _, order := range [][2]time.Duration{{0, 5 * time.Second}, {5 * time.Second, 0}} {
		lp := &loop{clients: map[int32]*fclient{}}
		lp.drain(t0.Add(order[0]))
		lp.drain(t0.Add(order[1]))
		if !lp.drainBy.Equal(t0) {
			t.Errorf("drains to +%v then +%v: the drain ends at +%v, want +0s", order[0], order[1], lp.drainBy.Sub(t0))
		}
	}
}

// A client that pipelines requests the loop answers itself (refusals) has
// them served a turn a pass, not all at once: with the ring, each answer
// goes out at the end of a pass and the client's next request waits for the
// next pass (the again list), so one sendAll never runs more than a few
// rounds of sends. Before, each answer sent led straight to the next
// request and its answer, 200 rounds in one sendAll, while the loop looked
// at no other connection.
func TestFastPathPipelinedRefusalsTakeTurns(t *testing.T) {
	if plainSendsAlways {
		t.Skip("no ring with FAIRSHARE_FRONT_PLAIN_SENDS=1: each answer is sent in the pass")
	}
	r := fastRig(t, rigOpts{poolSize: 4}, ok)
	needRing(t, r)
	r.rates.SetLimits("slow", pools.Limits{RequestsPerSec: 0.001})
	c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const n = 200
	req := "GET / HTTP/1.1\r\nHost: x\r\nFairshare-Project: slow\r\n\r\n"
	if _, err := io.WriteString(c, strings.Repeat(req, n)); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	for i := range n {
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("answer %d: %v", i, err)
		}
		readAll(t, resp)
		if i > 0 && resp.StatusCode != http.StatusTooManyRequests {
			t.Fatalf("answer %d: %d, want 429", i, resp.StatusCode)
		}
	}
	var most int64
	for _, lp := range r.front.fast.Load().loops {
		most = max(most, lp.mostRounds.Load())
	}
	if most > 3 {
		t.Errorf("one sendAll made %d rounds of sends for %d pipelined refusals, want a few", most, n)
	}
}

// Likewise a long answer relayed to a client that reads it as fast as it
// comes: a piece a pass, so one sendAll makes a round or two of sends, not
// one per 32 KiB read while the loop looks at no other connection.
func TestFastPathLongAnswerTakesTurns(t *testing.T) {
	if plainSendsAlways {
		t.Skip("no ring with FAIRSHARE_FRONT_PLAIN_SENDS=1")
	}
	big := strings.Repeat("0123456789abcdef", 1<<19) // 8 MiB
	r := fastRig(t, rigOpts{poolSize: 4}, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Content-Length", strconv.Itoa(len(big)))
		_, _ = io.WriteString(w, big)
	})
	needRing(t, r)
	req, _ := http.NewRequest("GET", r.url+"/big", nil)
	req.Header.Set("Fairshare-Project", "alpha")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if b := readAll(t, resp); b != big {
		t.Fatalf("%d %d bytes (%.100q), want %d", resp.StatusCode, len(b), b, len(big))
	}
	var most int64
	for _, lp := range r.front.fast.Load().loops {
		most = max(most, lp.mostRounds.Load())
	}
	if most > 3 {
		t.Errorf("one sendAll made %d rounds of sends relaying 8 MiB, want a few", most)
	}
}

// needRing skips the test where the kernel refuses the loops an io_uring,
// and fails it where a loop has none for another reason.
func needRing(t *testing.T, r *rig) {
	t.Helper()
	for _, lp := range r.front.fast.Load().loops {
		if err := lp.ringErr; err != nil {
			if ringDenied(err) {
				t.Skipf("no io_uring here: %v", err)
			}
			t.Fatal(err)
		}
	}
}
