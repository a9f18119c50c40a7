// SPDX-License-Identifier: Apache-2.0

package metrics

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func fixed(st admin.Status) Source {
	return func(context.Context) (admin.Status, error) { return st, nil }
}

func sample() admin.Status {
	return admin.Status{
		Kernel: true,
		Pools: []admin.Pool{
			{Name: "connections", Enforcer: "kernel", Size: 20, Floor: 1, InUse: 7, Active: 2, Share: 10, Admitted: 30, Refused: 4,
				Projects: []admin.Project{{Project: "alpha", Held: 5, Admitted: 20, Refused: 4, Active: true}, {Project: "beta", Held: 2, Admitted: 10, Active: true}}},
			{Name: "residents", Enforcer: "daemon", Size: 4, Floor: 1, InUse: 4, Active: 1, Share: 4, Admitted: 9,
				Projects: []admin.Project{{Project: "alpha", Held: 4, Admitted: 9, Sleeping: 2, Evictions: map[string]uint64{"own idlest": 2}}}},
		},
		Rates: []admin.Rate{{Project: "alpha", RequestsPerSec: 5, RequestTokens: 1, WorkTokens: -3.5, Limited: 6}},
		Scheduler: &admin.Scheduler{
			InFlight:     2,
			Dispatched:   map[string]uint64{"P1": 3, "P3": 1},
			Participants: []admin.Participant{{Participant: "alpha", Tier: "pro", Shares: 1, Queue: 4}},
			Wait:         admin.Histogram{Bounds: []float64{0.01, 0.1}, Counts: []uint64{2, 1, 1}, Count: 4, Sum: 2.5},
		},
	}
}

func TestCollect(t *testing.T) {
	c := New(fixed(sample()), 10, nil)
	want := `
# HELP fairshare_pool_in_use Permits held now.
# TYPE fairshare_pool_in_use gauge
fairshare_pool_in_use{pool="connections"} 7
fairshare_pool_in_use{pool="residents"} 4
# HELP fairshare_pool_share The current share: max(floor, size / active projects).
# TYPE fairshare_pool_share gauge
fairshare_pool_share{pool="connections"} 10
fairshare_pool_share{pool="residents"} 4
# HELP fairshare_project_permits_held Permits the project holds now.
# TYPE fairshare_project_permits_held gauge
fairshare_project_permits_held{pool="connections",project="alpha"} 5
fairshare_project_permits_held{pool="connections",project="beta"} 2
fairshare_project_permits_held{pool="residents",project="alpha"} 4
# HELP fairshare_project_refused_total Permit requests of the project refused.
# TYPE fairshare_project_refused_total counter
fairshare_project_refused_total{pool="connections",project="alpha"} 4
fairshare_project_refused_total{pool="connections",project="beta"} 0
fairshare_project_refused_total{pool="residents",project="alpha"} 0
# HELP fairshare_project_evictions_total Resident objects of the project put to sleep to make room.
# TYPE fairshare_project_evictions_total counter
fairshare_project_evictions_total{pool="residents",project="alpha",reason="own idlest"} 2
# HELP fairshare_project_rate_limited_total Requests of the project refused by its rate buckets or work debt.
# TYPE fairshare_project_rate_limited_total counter
fairshare_project_rate_limited_total{project="alpha"} 6
# HELP fairshare_project_work_tokens Work-unit bucket balance of the project; negative is debt.
# TYPE fairshare_project_work_tokens gauge
fairshare_project_work_tokens{project="alpha"} -3.5
# HELP fairshare_scheduler_dispatched_total Requests dispatched, by class.
# TYPE fairshare_scheduler_dispatched_total counter
fairshare_scheduler_dispatched_total{class="P1"} 3
fairshare_scheduler_dispatched_total{class="P2"} 0
fairshare_scheduler_dispatched_total{class="P3"} 1
# HELP fairshare_scheduler_queue_length Requests waiting in the participant's queue.
# TYPE fairshare_scheduler_queue_length gauge
fairshare_scheduler_queue_length{participant="alpha"} 4
# HELP fairshare_scheduler_wait_seconds Time from submit to dispatch.
# TYPE fairshare_scheduler_wait_seconds histogram
fairshare_scheduler_wait_seconds_bucket{le="0.01"} 2
fairshare_scheduler_wait_seconds_bucket{le="0.1"} 3
fairshare_scheduler_wait_seconds_bucket{le="+Inf"} 4
fairshare_scheduler_wait_seconds_sum 2.5
fairshare_scheduler_wait_seconds_count 4
# HELP fairshare_up Whether the last read of the daemon's state worked.
# TYPE fairshare_up gauge
fairshare_up 1
`
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	err := testutil.GatherAndCompare(reg, strings.NewReader(want),
		"fairshare_pool_in_use", "fairshare_pool_share", "fairshare_project_permits_held", "fairshare_project_refused_total",
		"fairshare_project_evictions_total", "fairshare_project_rate_limited_total", "fairshare_project_work_tokens",
		"fairshare_scheduler_dispatched_total", "fairshare_scheduler_queue_length", "fairshare_scheduler_wait_seconds", "fairshare_up")
	if err != nil {
		t.Error(err)
	}
	problems, err := testutil.CollectAndLint(c)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
}

func TestCollectSourceError(t *testing.T) {
	c := New(func(context.Context) (admin.Status, error) { return admin.Status{}, errors.New("daemon busy") }, 10, nil)
	if n := testutil.CollectAndCount(c); n != 1 {
		t.Errorf("%d metrics on error, want only fairshare_up", n)
	}
	if v := testutil.ToFloat64(c); v != 0 {
		t.Errorf("fairshare_up = %v, want 0", v)
	}
}

// Label cardinality stays at the cap however many projects exist, and the
// summed series keep the totals.
func TestCardinalityCap(t *testing.T) {
	const n, limit = 250, 5
	pool := admin.Pool{Name: "requests", Size: 1000}
	var rates []admin.Rate
	sched := &admin.Scheduler{Dispatched: map[string]uint64{}}
	var totalHeld int
	for i := range n {
		name := fmt.Sprintf("p%03d", i)
		pool.Projects = append(pool.Projects, admin.Project{Project: name, Held: i % 7, Admitted: uint64(i)})
		totalHeld += i % 7
		rates = append(rates, admin.Rate{Project: name, Limited: uint64(i)})
		sched.Participants = append(sched.Participants, admin.Participant{Participant: name, Queue: i % 3})
	}
	c := New(fixed(admin.Status{Pools: []admin.Pool{pool}, Rates: rates, Scheduler: sched}), limit, nil)
	for _, name := range []string{"fairshare_project_permits_held", "fairshare_project_rate_limited_total", "fairshare_scheduler_queue_length"} {
		if got := testutil.CollectAndCount(c, name); got != limit {
			t.Errorf("%s: %d series, want %d", name, got, limit)
		}
	}
	capped := capProjects(pool.Projects, limit)
	var sum int
	for _, p := range capped {
		sum += p.Held
	}
	if sum != totalHeld || capped[limit-1].Project != Other {
		t.Errorf("capped held sums to %d (want %d), last = %q", sum, totalHeld, capped[limit-1].Project)
	}
	if capped[0].Held != 6 {
		t.Errorf("the busiest project should be named first, got %+v", capped[0])
	}
}

// A pool's exempt class is its own series, apart from pool_in_use; a pool
// without one emits none.
func TestCollectExempt(t *testing.T) {
	st := sample()
	st.Pools[0].Exempt = &admin.Exempt{Members: []string{"/sys/fs/cgroup/fairshare/ops"}, Max: 3, InUse: 2, Admitted: 9, OverBudget: 1}
	c := New(fixed(st), 10, nil)
	want := `
# HELP fairshare_pool_exempt_admitted_total Exempt permits granted (outside the rule and the pool).
# TYPE fairshare_pool_exempt_admitted_total counter
fairshare_pool_exempt_admitted_total{pool="connections"} 9
# HELP fairshare_pool_exempt_in_use Exempt permits held now; not in pool_in_use.
# TYPE fairshare_pool_exempt_in_use gauge
fairshare_pool_exempt_in_use{pool="connections"} 2
# HELP fairshare_pool_exempt_max The exempt budget: exempt permits held at most at a time.
# TYPE fairshare_pool_exempt_max gauge
fairshare_pool_exempt_max{pool="connections"} 3
# HELP fairshare_pool_exempt_over_budget_total Exempt asks that found the exempt budget spent and went under the rule.
# TYPE fairshare_pool_exempt_over_budget_total counter
fairshare_pool_exempt_over_budget_total{pool="connections"} 1
# HELP fairshare_pool_in_use Permits held now.
# TYPE fairshare_pool_in_use gauge
fairshare_pool_in_use{pool="connections"} 7
fairshare_pool_in_use{pool="residents"} 4
`
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "fairshare_pool_exempt_admitted_total",
		"fairshare_pool_exempt_in_use", "fairshare_pool_exempt_max", "fairshare_pool_exempt_over_budget_total",
		"fairshare_pool_in_use"); err != nil {
		t.Error(err)
	}
	if n := testutil.CollectAndCount(New(fixed(sample()), 10, nil), "fairshare_pool_exempt_in_use"); n != 0 {
		t.Errorf("%d exempt series without an exempt class", n)
	}
}
