// SPDX-License-Identifier: Apache-2.0

package front

import (
	"errors"
	"net/http"
	"sync"
	"testing"
)

// TestExempt fills the node (requests pool and upstream room), then shows
// that probe traffic (an exempt project and an exempt route) still gets
// through without taking a permit, up to the exempt budget, past which an
// exempt request is refused like any other of its project.
func TestExempt(t *testing.T) {
	entered := make(chan struct{}, 16)
	release := make(chan struct{})
	var once sync.Once
	open := func() { once.Do(func() { close(release) }) }
	t.Cleanup(open)
	r := newRig(t, rigOpts{poolSize: 2, cfg: Config{
		Routes:    map[string]string{"status.example": "ops"},
		Exempt:    Exempt{Projects: []string{"probe"}, Routes: []string{"status.example"}},
		ExemptMax: 2,
	}}, holdUpstream(entered, release))

	type answer struct {
		status int
		class  string
	}
	answers := make(chan answer, 8)
	var wg sync.WaitGroup
	send := func(project, host string) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequest("GET", r.url, nil)
			if project != "" {
				req.Header.Set(DefaultProjectHeader, project)
			}
			if host != "" {
				req.Host = host
			}
			resp, err := r.client.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			readAll(t, resp)
			answers <- answer{resp.StatusCode, resp.Header.Get(HeaderClass)}
		}()
		<-entered
	}
	send("alpha", "")
	send("alpha", "")
	if s := r.pool.Snapshot(); s.InUse != 2 {
		t.Fatalf("in use %d, want the pool full at 2", s.InUse)
	}
	if resp := r.get(t, "beta", "/"); resp.StatusCode != 429 {
		t.Fatalf("ordinary request on a full node: %d, want 429", resp.StatusCode)
	}
	// A full node: the exempt requests still reach the upstream.
	send("probe", "")
	send("", "status.example")
	if got := r.front.ExemptInFlight(); got != 2 {
		t.Errorf("exempt in flight %d, want 2", got)
	}
	if s := r.pool.Snapshot(); s.InUse != 2 {
		t.Errorf("in use %d: exempt requests took permits", s.InUse)
	}
	// The budget is spent: the next probe is an ordinary request of its
	// project and the full pool refuses it.
	resp := r.get(t, "probe", "/")
	readAll(t, resp)
	if resp.StatusCode != 429 || resp.Header.Get(HeaderRefused) != "share" {
		t.Errorf("probe over the exempt budget: %d %q, want 429 share", resp.StatusCode, resp.Header.Get(HeaderRefused))
	}
	if n := metricValue(t, r.front, "fairshare_front_exempt_over_budget_total"); n != 1 {
		t.Errorf("over budget counted %v, want 1", n)
	}
	if n := metricValue(t, r.front, "fairshare_front_exempt_requests_in_flight"); n != 2 {
		t.Errorf("exempt in flight gauge %v, want 2", n)
	}
	open()
	wg.Wait()
	close(answers)
	classes := map[string]int{}
	for a := range answers {
		if a.status != 200 {
			t.Errorf("held request answered %d", a.status)
		}
		classes[a.class]++
	}
	if classes[ClassExempt] != 2 {
		t.Errorf("classes %v, want 2 exempt answers", classes)
	}
	waitOutcome(t, r.front, "probe", "exempt", 1)
	waitOutcome(t, r.front, "ops", "exempt", 1)
	waitOutcome(t, r.front, "probe", "refused_share", 1)
	waitInUse(t, r.pool, 0)
	if got := r.front.ExemptInFlight(); got != 0 {
		t.Errorf("exempt in flight %d after all ended, want 0", got)
	}
}

func TestExemptConfig(t *testing.T) {
	if _, err := New(Config{Upstream: "http://x", Exempt: Exempt{Routes: []string{"nope"}}}, Deps{}); !errors.Is(err, ErrUnknownRoute) {
		t.Errorf("exempt route not in routes: %v", err)
	}
	if _, err := New(Config{Upstream: "http://x", Exempt: Exempt{Projects: []string{"a b"}}}, Deps{}); !errors.Is(err, ErrBadProject) {
		t.Errorf("bad exempt project: %v", err)
	}
	f, err := New(Config{Upstream: "http://x"}, Deps{})
	if err != nil || f.Config().ExemptMax != DefaultExemptMax {
		t.Errorf("default exempt budget: %v %v", f.Config().ExemptMax, err)
	}
}
