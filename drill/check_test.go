// SPDX-License-Identifier: Apache-2.0

package drill

import (
	"bytes"
	"context"
	"encoding/json"
	"math/rand/v2"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestCheck: the knobs with which a verdict cannot pass are refused, with
// the bound derived from the rule and the drill's timing; the defaults and
// the values just past each bound are not. Before, only values below 1 (or
// 0) were refused: --phase 2s, --pool 17, --pool 1 and --pool 2 ran and
// failed a verdict, whatever the host.
func TestCheck(t *testing.T) {
	ms := time.Millisecond
	for _, tc := range []struct {
		name        string
		cfg         Config
		connections bool
		want        string // "" passes
	}{
		{"defaults", Config{}, false, ""},
		{"defaults, connections", Config{}, true, ""},
		{"defaults, to a destination pool", Config{ToDestination: true}, true, ""},
		// W + 2P + service + retry pause = 1s + 2s + 20ms + 10ms.
		{"phase at the bound", Config{Phase: 3030 * ms}, false, "--phase 3.03s: small stays in the active set up to 3s"},
		{"phase 2s", Config{Phase: 2 * time.Second}, false, "give --phase longer than 3.03s"},
		{"phase 1.5s", Config{Phase: 1500 * ms}, false, "'big alone holds the pool' cannot pass"},
		{"phase past the bound", Config{Phase: 3031 * ms}, false, ""},
		{"phase, longer service and pause", Config{Phase: 3100 * ms, ServiceTime: 50 * ms, RetryPause: 50 * ms}, false, "longer than 3.1s"},
		// The kernel stamps the ask: W + P + service + retry pause.
		{"phase at the bound, connections", Config{Phase: 2030 * ms}, true, "give --phase longer than 2.03s"},
		{"phase past the bound, connections", Config{Phase: 2031 * ms}, true, ""},
		{"pool past big", Config{PoolSize: 17}, false, "--pool 17 with --big 16: a writer holds one permit"},
		{"pool 19", Config{PoolSize: 19}, true, "'big alone holds the pool' cannot pass"},
		{"pool at big", Config{PoolSize: 16}, false, ""},
		{"pool 1", Config{PoolSize: 1}, false, "--pool 1: the floor is 1, and beside small big is admitted up to its share of 1, past POOL - FLOOR = 0"},
		{"pool 2, small 2", Config{PoolSize: 2}, false, "--small 2 with --pool 2: beside big, small's share is 1"},
		{"pool 2, small 1", Config{PoolSize: 2, SmallWriters: 1}, false, ""},
		{"pool 3, small 2", Config{PoolSize: 3}, true, "give --small 1 or fewer"},
		{"pool 4, small 2", Config{PoolSize: 4}, true, ""},
		{"small past its share", Config{SmallWriters: 5}, false, "small's share is 4"},
		{"small at its share", Config{SmallWriters: 4}, false, ""},
		{"slices past the most", Config{Slices: MaxSlices + 1, ServiceTime: time.Microsecond}, false, "--slices 1001: at most 1000"},
		{"slices shorter than ten services", Config{Slices: 26}, false, "--slices 26 with --phase 5s: slices of 192.308ms, shorter than 10 service times (200ms)"},
		{"slices of ten services", Config{Slices: 25}, false, ""},
		{"one slice of a long service", Config{Slices: 1, ServiceTime: time.Second, Phase: 5 * time.Second}, false, ""},
		{"slices of a long service", Config{Slices: 2, ServiceTime: time.Second, Phase: 5 * time.Second}, false, "give --slices 1 or fewer"},
		{"pool past the kernel's", Config{PoolSize: 262145, BigWriters: 262145}, true, "--pool 262145: the kernel's connection pool holds at most 262144"},
		{"pool at the kernel's", Config{PoolSize: 262144, BigWriters: 262144}, true, ""},
		{"destination pool past a sixteenth", Config{PoolSize: 16385, BigWriters: 16385, ToDestination: true}, true, "give --pool 16384 or less"},
		{"destination pool at a sixteenth", Config{PoolSize: 16384, BigWriters: 16384, ToDestination: true}, true, ""},
		// 16 times this is 2^32: as a uint32, a pool of 0.
		{"destination pool that wrapped", Config{PoolSize: 1 << 28, BigWriters: 1 << 28, ToDestination: true}, true, "give --pool 16384 or less"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Check(tc.connections)
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("refused: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("got %v, want %q", err, tc.want)
			}
		})
	}
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil || rl.Cur >= 1<<30 {
		t.Logf("descriptor limit %d (%v): not checked", rl.Cur, err)
		return
	}
	many := int(rl.Cur) / 2
	if err := (Config{BigWriters: many}).Check(false); err == nil || !strings.Contains(err.Error(), "ulimit -n") {
		t.Errorf("%d big writers within %d descriptors: %v", many, rl.Cur, err)
	}
	if err := (Config{BigWriters: many}).Check(true); err != nil {
		t.Errorf("the connections drill's writers are in their own processes: %v", err)
	}
}

// TestSpanAtSearch: the binary search finds what a scan of every span finds,
// gaps and ends included, over many slices.
func TestSpanAtSearch(t *testing.T) {
	t0 := time.Unix(100, 0)
	tl := newTimeline(t0, 300*time.Millisecond, 5*time.Second, MaxSlices)
	big := make([]result, 0, 2*MaxSlices)
	for _, sp := range tl.spans {
		if sp.phase == 1 {
			big = append(big, result{sent: sp.from, latency: time.Duration(rand.IntN(4_000_000))})
		}
	}
	tl.settleGaps(big)
	scan := func(at time.Time) *span {
		for i := range tl.spans {
			if sp := &tl.spans[i]; !at.Before(sp.count) && at.Before(sp.to) {
				return sp
			}
		}
		return nil
	}
	end := tl.endAt.Sub(t0) + time.Second
	for range 20000 {
		at := t0.Add(time.Duration(rand.Int64N(int64(end))))
		if got, want := tl.spanAt(at), scan(at); got != want {
			t.Fatalf("spanAt(+%v) = %v, want %v", at.Sub(t0), got, want)
		}
	}
	for _, sp := range tl.spans {
		for _, at := range []time.Time{sp.from, sp.count, sp.to, sp.count.Add(-1)} {
			if got, want := tl.spanAt(at), scan(at); got != want {
				t.Fatalf("spanAt(+%v) = %v, want %v", at.Sub(t0), got, want)
			}
		}
	}
}

// TestConnectLoopInterrupted: a load generator stopped before its intervals
// ended says so and writes no results, as the drill that started it does.
func TestConnectLoopInterrupted(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	now := time.Now()
	spec, _ := json.Marshal(loopSpec{Addr: "127.0.0.1:1", Writers: 2, RetryPause: time.Millisecond,
		Sends: [][2]int64{{now.UnixNano(), now.Add(time.Hour).UnixNano()}}})
	var out bytes.Buffer
	err := ConnectLoop(ctx, bytes.NewReader(spec), &out)
	if err == nil || !strings.Contains(err.Error(), "interrupted") || out.Len() != 0 {
		t.Errorf("err %v, output %q; want interrupted and nothing written", err, out.String())
	}
}
