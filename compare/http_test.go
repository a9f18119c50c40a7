// SPDX-License-Identifier: Apache-2.0

package compare

import (
	"errors"
	"net/http"
	"os/exec"
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
