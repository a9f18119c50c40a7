// SPDX-License-Identifier: Apache-2.0

package compare

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os/exec"
	"sync"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/front"
)

// TestHTTPSystems drives the elephant workload for two seconds through each
// HTTP system, in real time, and checks each is wired as documented:
// requests reach the upstream (every project's, behind nginx and HAProxy),
// nginx refuses at its per-tenant cap, HAProxy queues and refuses nothing,
// the front refuses the elephant past its share. Latency and fairness are
// not checked here: on a loaded machine they are the machine's
// (docs/compare.md).
func TestHTTPSystems(t *testing.T) {
	for _, tool := range []string{"nginx", "haproxy"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s is not installed (Debian: nginx-light, haproxy): the HTTP comparison needs both", tool)
		}
	}
	o := Defaults()
	o.Duration = 2 * time.Second
	w, err := Build("elephant", o.Duration, 1)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range HTTPSchemes {
		t.Run(s.Name, func(t *testing.T) {
			res, err := Run(s, w, 1, o)
			if errors.Is(err, ErrMissingTool) {
				t.Skip(err)
			}
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("jain %.3f util %.3f refusals %d admits %d", res.Jain, res.Utilization, res.Refusals, res.Admits)
			if res.Admits == 0 {
				t.Fatal("no request reached the upstream")
			}
			// The front is in too: a mouse it refuses is told to come
			// back in milliseconds (Retry-After-Ms), not in the whole
			// second or two that could be past a short run's end.
			for _, p := range res.Projects {
				if p.Requests == 0 || p.HeldSec == 0 {
					t.Errorf("%s: %d requests, %.2f seat-seconds: nothing reached the upstream", p.Name, p.Requests, p.HeldSec)
				}
			}
			switch s.Name {
			case "http-nginx":
				if res.Refusals == 0 {
					t.Error("nginx refused nothing: 64 writers of one project against a cap of 3")
				}
			case "http-haproxy":
				if res.Refusals != 0 {
					t.Errorf("haproxy refused %d: its queue should hold them", res.Refusals)
				}
			case "http-fairshare":
				if res.Refusals == 0 {
					t.Error("the front refused nothing: 64 writers of one project past its share")
				}
			}
		})
	}
}

// TestProxyServerCap checks that nginx, HAProxy and the front never have
// more requests at the upstream than the pool: six projects of four
// clients each ask at once (24 > 8), the per-tenant caps (nginx: 8/2 = 4
// each) add up to three times the pool, and only the server-wide bound
// (nginx's limit_conn on the server zone, HAProxy's server maxconn, the
// front's MaxInFlight) holds them to it. The pool must be reached, or the
// bound was not tested. nginx does not count a request whose
// limit_conn_zone key is empty, so a server zone keyed by $server_name in
// a server block without a server_name bounded nothing: the upstream held
// 24 at once.
func TestProxyServerCap(t *testing.T) {
	for _, name := range []string{"http-nginx", "http-haproxy", "http-fairshare"} {
		t.Run(name, func(t *testing.T) {
			s, err := SchemeByName(name)
			if err != nil {
				t.Fatal(err)
			}
			const pool, projects, clients = 8, 6, 4
			o := Options{Pool: pool, Service: 50 * time.Millisecond}
			sys, err := s.New(o, Workload{Name: "cap", Planned: 2})
			if errors.Is(err, ErrMissingTool) {
				t.Skip(err)
			}
			if err != nil {
				t.Fatal(err)
			}
			defer sys.Close()
			var mu sync.Mutex
			inUse, most, counting := 0, 0, true
			sys.(binder).bind(func(_ string, d int) {
				mu.Lock()
				defer mu.Unlock()
				inUse += d
				if counting {
					most = max(most, inUse)
				}
			})
			ctx, cancel := context.WithCancel(context.Background())
			var wg sync.WaitGroup
			var refused, admitted, failed int
			for p := range projects {
				for range clients {
					wg.Go(func() {
						for ctx.Err() == nil {
							ok, _, err := sys.Do(ctx, fmt.Sprintf("p%d", p), nil)
							mu.Lock()
							switch {
							case err != nil && ctx.Err() == nil:
								failed++
							case err != nil:
							case ok:
								admitted++
							default:
								refused++
							}
							mu.Unlock()
							if !ok {
								time.Sleep(5 * time.Millisecond)
							}
						}
					})
				}
			}
			time.Sleep(1500 * time.Millisecond)
			// Stop counting before the clients go: a request its client
			// abandons leaves the proxy before the upstream ends it.
			mu.Lock()
			counting = false
			mu.Unlock()
			cancel()
			wg.Wait()
			t.Logf("most at the upstream at once: %d (pool %d); admitted %d, refused %d, failed %d", most, pool, admitted, refused, failed)
			if failed > 0 {
				t.Errorf("%d requests failed", failed)
			}
			if most > pool {
				t.Errorf("the upstream held %d requests at once, past the pool of %d: the server-wide bound does not apply", most, pool)
			}
			if most < pool {
				t.Errorf("the upstream held at most %d at once with %d clients asking: the pool of %d was never reached, so the bound was not tested", most, projects*clients, pool)
			}
		})
	}
}

// TestRetryHint: the HTTP writers honour Retry-After-Ms first, as client
// libraries that know it do, then Retry-After's whole seconds.
func TestRetryHint(t *testing.T) {
	for _, c := range []struct {
		ms, secs string
		want     time.Duration
	}{
		{"37", "1", 37 * time.Millisecond},
		{"", "2", 2 * time.Second},
		{"x", "1", time.Second},
		{"0", "", 0},
		{"", "", 0},
	} {
		h := http.Header{}
		if c.ms != "" {
			h.Set(front.HeaderRetryAfterMs, c.ms)
		}
		if c.secs != "" {
			h.Set("Retry-After", c.secs)
		}
		if got := retryHint(h); got != c.want {
			t.Errorf("Retry-After-Ms %q, Retry-After %q: %v, want %v", c.ms, c.secs, got, c.want)
		}
	}
}
