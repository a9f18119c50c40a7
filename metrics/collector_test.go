// SPDX-License-Identifier: Apache-2.0

package metrics

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/internal/membership"
	"github.com/fairshare-dev/fairshare/internal/netnsscan"
	"github.com/fairshare-dev/fairshare/policy"
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
			{Name: "connections", Enforcer: "kernel", Size: 20, Floor: 1, InUse: 7, Active: 2, Share: 10, Admitted: 30, Refused: 4, RateLimited: 9,
				Projects: []admin.Project{{Project: "alpha", Held: 5, Admitted: 20, Refused: 4, Active: true}, {Project: "beta", Held: 2, Admitted: 10, Active: true,
					RateLimited: 9, ConnectionsPerSec: 50}}},
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
		Reconcile: &admin.Reconcile{Time: time.Unix(1700000000, 0), Sockets: 7, Held: 7, Repairs: 1, Passes: 3, RepairsTotal: 2, Unadopted: 5},
		Listeners: []admin.Listener{{Name: "front", Open: 3, MaxConns: 100, Accepted: 50, Refused: map[string]uint64{"listener_full": 4}}},
	}
}

func TestCollectReconcileAndListeners(t *testing.T) {
	c := New(fixed(sample()), 10, nil)
	want := `
# HELP fairshare_listener_refused_total Connections closed at once for a cap, by reason.
# TYPE fairshare_listener_refused_total counter
fairshare_listener_refused_total{listener="front",reason="listener_full"} 4
fairshare_listener_refused_total{listener="front",reason="peer_full"} 0
# HELP fairshare_reconcile_last_pass_timestamp_seconds When the last reconcile pass ended, as a Unix time.
# TYPE fairshare_reconcile_last_pass_timestamp_seconds gauge
fairshare_reconcile_last_pass_timestamp_seconds 1.7e+09
# HELP fairshare_reconcile_passes_total Reconcile passes of the kernel's counts against its socket table that completed.
# TYPE fairshare_reconcile_passes_total counter
fairshare_reconcile_passes_total 3
# HELP fairshare_reconcile_unadopted_sockets Project sockets holding no permit that the last reconcile pass could not adopt, the held-permit table having no room: they count nowhere until a pass finds room.
# TYPE fairshare_reconcile_unadopted_sockets gauge
fairshare_reconcile_unadopted_sockets 5
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), "fairshare_listener_refused_total",
		"fairshare_reconcile_last_pass_timestamp_seconds", "fairshare_reconcile_passes_total", "fairshare_reconcile_unadopted_sockets"); err != nil {
		t.Error(err)
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
	lint(t, c)
}

// The kernel pool's refusals by a project's connections_per_sec are their
// own families, apart from refused_total; the user-space pools have none.
func TestCollectRateLimited(t *testing.T) {
	c := New(fixed(sample()), 10, nil)
	want := `
# HELP fairshare_pool_rate_limited_total Permit requests refused by their project's rate (connections: the policy's connections_per_sec and accepts_per_sec); not in refused_total.
# TYPE fairshare_pool_rate_limited_total counter
fairshare_pool_rate_limited_total{pool="connections"} 9
# HELP fairshare_project_permits_rate_limited_total Permit requests of the project refused by its rate (connections: connections_per_sec and accepts_per_sec); not in refused_total.
# TYPE fairshare_project_permits_rate_limited_total counter
fairshare_project_permits_rate_limited_total{pool="connections",project="alpha"} 0
fairshare_project_permits_rate_limited_total{pool="connections",project="beta"} 9
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), "fairshare_pool_rate_limited_total",
		"fairshare_project_permits_rate_limited_total"); err != nil {
		t.Error(err)
	}
	problems, err := testutil.CollectAndLint(c, "fairshare_pool_rate_limited_total", "fairshare_project_permits_rate_limited_total")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
}

// TestEnforcedFollowsTheEnforcer: a pool nothing enforces (the connections
// pool with bpf off: enforcer "off") is reported not enforced, as is one in
// dry-run; it read 1 before, and an alert on enforced == 0 missed a node
// that refused nothing.
func TestEnforcedFollowsTheEnforcer(t *testing.T) {
	st := admin.Status{Pools: []admin.Pool{
		{Name: "connections", Enforcer: "off", Size: 20, Floor: 1},
		{Name: "requests", Enforcer: "daemon", Size: 8, Floor: 1},
		{Name: "flights", Enforcer: "daemon", Size: 8, Floor: 1, DryRun: true},
	}}
	want := `
# HELP fairshare_pool_enforced 1 while the pool enforces its rule, 0 while it is in dry-run (enforce: false) or nothing enforces it (the connections pool with bpf: false).
# TYPE fairshare_pool_enforced gauge
fairshare_pool_enforced{pool="connections"} 0
fairshare_pool_enforced{pool="flights"} 0
fairshare_pool_enforced{pool="requests"} 1
`
	if err := testutil.CollectAndCompare(New(fixed(st), 10, nil), strings.NewReader(want), "fairshare_pool_enforced"); err != nil {
		t.Error(err)
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
	var totalHeld, totalAdmitted int
	for i := range n {
		name := fmt.Sprintf("p%03d", i)
		pool.Projects = append(pool.Projects, admin.Project{Project: name, Held: i % 7, Admitted: uint64(i)})
		totalHeld += i % 7
		totalAdmitted += i
		rates = append(rates, admin.Rate{Project: name, Limited: uint64(i)})
		sched.Participants = append(sched.Participants, admin.Participant{Participant: name, Queue: i % 3})
	}
	pool.Admitted = uint64(totalAdmitted)
	c := New(fixed(admin.Status{Pools: []admin.Pool{pool}, Rates: rates, Scheduler: sched}), limit, nil)
	for _, name := range []string{"fairshare_project_permits_held", "fairshare_project_rate_limited_total", "fairshare_scheduler_queue_length"} {
		if got := testutil.CollectAndCount(c, name); got != limit {
			t.Errorf("%s: %d series, want %d", name, got, limit)
		}
	}
	held, admitted := scrape(t, c, "fairshare_project_permits_held"), scrape(t, c, "fairshare_project_admitted_total")
	var sumHeld, sumAdmitted float64
	for k, v := range held {
		sumHeld += v
		sumAdmitted += admitted[k]
	}
	if int(sumHeld) != totalHeld || int(sumAdmitted) != totalAdmitted {
		t.Errorf("held sums to %v (want %d), admitted to %v (want %d)", sumHeld, totalHeld, sumAdmitted, totalAdmitted)
	}
	if _, ok := held[`pool="requests",project="(other)"`]; !ok {
		t.Errorf("no (other) series: %v", held)
	}
	if _, ok := held[`pool="requests",project="p244"`]; !ok {
		t.Errorf("the busiest project (holds 6, most traffic) is not named: %v", held)
	}
}

// scrape collects one family into label text -> value.
func scrape(t *testing.T, c prometheus.Collector, family string) map[string]float64 {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != family {
			continue
		}
		for _, m := range mf.GetMetric() {
			var ls []string
			for _, l := range m.GetLabel() {
				ls = append(ls, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
			}
			v := m.GetGauge().GetValue()
			if m.GetCounter() != nil {
				v = m.GetCounter().GetValue()
			}
			out[strings.Join(ls, ",")] = v
		}
	}
	return out
}

// The review's case: a named project is forgotten (idle a minute) and comes
// back with counts from zero, a project moves from (other) to its own label,
// a rate bucket is deleted. No counter series goes down, and at every scrape
// the series of the pool add up to its total: (other) is the total less the
// named series, so it carries the counts of projects that left their label.
func TestCountersNeverGoDown(t *testing.T) {
	var st admin.Status
	c := New(func(context.Context) (admin.Status, error) { return st, nil }, 3, nil) // 2 named + (other)
	var forgotten uint64
	pool := func(ps ...admin.Project) {
		adm := forgotten
		for _, p := range ps {
			adm += p.Admitted
		}
		st = admin.Status{Pools: []admin.Pool{{Name: "requests", Projects: ps, Admitted: adm,
			Forgotten: admin.Forgotten{Admitted: forgotten}}}}
	}
	const fam = "fairshare_project_admitted_total"
	seen := map[string]float64{}
	check := func(step string) map[string]float64 {
		t.Helper()
		got := scrape(t, c, fam)
		var sum float64
		for k, v := range got {
			if old, ok := seen[k]; ok && v < old {
				t.Errorf("%s: %s went down from %v to %v", step, k, old, v)
			}
			seen[k] = v
			sum += v
		}
		if want := float64(st.Pools[0].Admitted); sum != want {
			t.Errorf("%s: series sum to %v, the pool's total is %v: %v", step, sum, want, got)
		}
		return got
	}
	other := `pool="requests",project="(other)"`
	pool(admin.Project{Project: "a", Admitted: 10}, admin.Project{Project: "b", Admitted: 5},
		admin.Project{Project: "c", Admitted: 3}, admin.Project{Project: "d", Admitted: 1})
	if got := check("start"); got[other] != 4 || got[`pool="requests",project="a"`] != 10 {
		t.Fatalf("start: %v", got)
	}
	// a is forgotten; c (busiest unnamed) takes its label from zero, and
	// counts c's one new admission; (other) has a's 10, c's first 3, d's 2.
	forgotten = 10
	pool(admin.Project{Project: "b", Admitted: 5}, admin.Project{Project: "c", Admitted: 4}, admin.Project{Project: "d", Admitted: 2})
	got := check("a forgotten")
	if got[`pool="requests",project="c"`] != 1 || got[other] != 15 {
		t.Fatalf("after a left: %v; want c=1 and (other)=15", got)
	}
	// a comes back from zero: no room, so it is in (other).
	pool(admin.Project{Project: "a", Admitted: 1}, admin.Project{Project: "b", Admitted: 6},
		admin.Project{Project: "c", Admitted: 4}, admin.Project{Project: "d", Admitted: 2})
	if got := check("a back"); got[other] != 16 {
		t.Fatalf("a back: %v, want (other)=16", got)
	}
	// d is forgotten: (other) keeps what d counted.
	forgotten += 2
	pool(admin.Project{Project: "a", Admitted: 2}, admin.Project{Project: "b", Admitted: 6}, admin.Project{Project: "c", Admitted: 4})
	if got := check("d forgotten"); got[other] != 17 {
		t.Fatalf("d forgotten: %v, want (other)=17", got)
	}
	// A named project's own count restarting (forgotten between scrapes):
	// its 6 went to forgotten, its new 1 is new.
	forgotten += 6
	pool(admin.Project{Project: "a", Admitted: 2}, admin.Project{Project: "b", Admitted: 1}, admin.Project{Project: "c", Admitted: 4})
	if got := check("b reset"); got[`pool="requests",project="b"`] != 7 {
		t.Fatalf("b reset: %v, want b=7", got)
	}
}

// A random walk of many projects (counts growing, projects forgotten and
// coming back from zero) never makes a counter series go down while it
// exists, never exceeds the label cap, and the pool's series always add up
// to its total (the projects' counts plus the forgotten ones'). A series
// that vanished (its project forgotten, its label freed) and comes back
// later starts from zero: a real restart, which rate() reads right.
func TestCountersMonotonicRandomWalk(t *testing.T) {
	const limit, projects, steps = 4, 12, 400
	rng := rand.New(rand.NewPCG(1, 2))
	raw := map[string]uint64{}
	var st admin.Status
	c := New(func(context.Context) (admin.Status, error) { return st, nil }, limit, nil)
	seenPool, seenRates := map[string]float64{}, map[string]float64{}
	var increases, forgotten uint64
	for step := range steps {
		for i := range projects {
			name := fmt.Sprintf("p%d", i)
			switch r := rng.IntN(10); {
			case r == 0:
				forgotten += raw[name]
				delete(raw, name) // forgotten
			case r < 6:
				n := uint64(rng.IntN(5))
				raw[name] += n
				increases += n
			}
		}
		var ps []admin.Project
		var rates []admin.Rate
		for name, v := range raw {
			ps = append(ps, admin.Project{Project: name, Admitted: v, Held: int(v % 3)})
			rates = append(rates, admin.Rate{Project: name, Limited: v})
		}
		st = admin.Status{Pools: []admin.Pool{{Name: "flights", Projects: ps, Admitted: increases,
			Forgotten: admin.Forgotten{Admitted: forgotten}}}, Rates: rates}
		var sum float64
		got := scrape(t, c, "fairshare_project_admitted_total")
		if len(got) > limit {
			t.Fatalf("step %d: %d series, cap %d", step, len(got), limit)
		}
		rl := scrape(t, c, "fairshare_project_rate_limited_total")
		for _, fam := range []struct {
			now, seen map[string]float64
		}{{got, seenPool}, {rl, seenRates}} {
			for k := range fam.seen {
				if _, ok := fam.now[k]; !ok {
					delete(fam.seen, k) // the series ended
				}
			}
			for k, v := range fam.now {
				if old, ok := fam.seen[k]; ok && v < old {
					t.Fatalf("step %d: %s went down from %v to %v", step, k, old, v)
				}
				fam.seen[k] = v
			}
		}
		for _, v := range got {
			sum += v
		}
		if _, ok := got[`pool="flights",project="(other)"`]; !ok && step > 0 {
			t.Fatalf("step %d: the (other) series vanished: %v", step, got)
		}
		if uint64(sum) != increases {
			t.Fatalf("step %d: series sum to %v, the pool's total is %d", step, sum, increases)
		}
	}
}

// One overflow label everywhere (internal/labels, which the front's
// collector uses too), and no project can be called that.
func TestOverflowLabelIsOneAndNoProjectName(t *testing.T) {
	if err := policy.ValidateProject(Other); err == nil {
		t.Errorf("%q is a valid project name, so a project could be summed with the overflow", Other)
	}
	// A cgroup named like the overflow is summed with it, not emitted twice.
	st := admin.Status{Pools: []admin.Pool{{Name: "connections", Projects: []admin.Project{
		{Project: Other, Held: 1, Admitted: 2}, {Project: "a", Held: 1}, {Project: "b", Held: 1}, {Project: "c", Held: 1}}}}}
	c := New(fixed(st), 2, nil)
	if _, err := testutil.CollectAndLint(c); err != nil {
		t.Fatal(err)
	}
	if got := scrape(t, c, "fairshare_project_permits_held"); len(got) != 2 {
		t.Errorf("series %v, want 2", got)
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

// The kernel's node-wide event counters are one family by event, from the
// kernel pool's KernelEvents; a pool without them (a destination pool, the
// user-space ones) adds none.
func TestCollectKernelEvents(t *testing.T) {
	st := sample()
	st.Pools[0].KernelEvents = &admin.KernelEvents{Adopted: 5, Late: 4, Unaccounted: 3, Expired: 2, MapFull: 7}
	st.Pools = append(st.Pools, admin.Pool{Name: "db", Enforcer: "kernel", Size: 4, Floor: 1, Projects: []admin.Project{}})
	c := New(fixed(st), 10, nil)
	want := `
# HELP fairshare_kernel_events_total Node-wide events of the BPF programs, by event: adopted (sockets a reconcile pass found holding no permit and counted), late (children established without a reservation, put under the rule then), unaccounted (children the rule refused once established: up, holding no permit), expired (reservations given back past connections.reservation_ttl), map_full (a full kernel table left a connection or a project's listener uncounted).
# TYPE fairshare_kernel_events_total counter
fairshare_kernel_events_total{event="adopted"} 5
fairshare_kernel_events_total{event="expired"} 2
fairshare_kernel_events_total{event="late"} 4
fairshare_kernel_events_total{event="map_full"} 7
fairshare_kernel_events_total{event="unaccounted"} 3
`
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "fairshare_kernel_events_total"); err != nil {
		t.Error(err)
	}
	lint(t, c)
	if n := testutil.CollectAndCount(New(fixed(sample()), 10, nil), "fairshare_kernel_events_total"); n != 0 {
		t.Errorf("%d kernel event series without the kernel's counters", n)
	}
}

// TestCollectEventsLog: the events events.log did not write, by reason,
// only with a log configured.
func TestCollectEventsLog(t *testing.T) {
	st := sample()
	st.Events = &admin.Events{Published: 9, Log: "/var/log/fairshare/events.log", LogErrors: 6, LogFailed: 1, LogDropped: 2, LogClosed: 3}
	c := New(fixed(st), 10, nil)
	want := `
# HELP fairshare_events_log_lost_total Events events.log did not write, by reason: failed (a write failed, e.g. a full disk), dropped (its queue was full: the file did not keep up), closed (published after it closed).
# TYPE fairshare_events_log_lost_total counter
fairshare_events_log_lost_total{reason="closed"} 3
fairshare_events_log_lost_total{reason="dropped"} 2
fairshare_events_log_lost_total{reason="failed"} 1
`
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "fairshare_events_log_lost_total"); err != nil {
		t.Error(err)
	}
	lint(t, c)
	st.Events.Log = ""
	if n := testutil.CollectAndCount(New(fixed(st), 10, nil), "fairshare_events_log_lost_total"); n != 0 {
		t.Errorf("%d events.log series without events.log", n)
	}
}

func TestCollectMembership(t *testing.T) {
	st := sample()
	ref := func(src, by string) admin.Refused {
		return admin.Refused{Refusal: membership.Refusal{Entry: membership.Entry{Source: src}}, By: by}
	}
	st.Membership = &admin.Membership{
		Sources: []admin.MemberSource{{Name: "directory", Members: 3, Refused: 1}, {Name: "registered", Members: 5, Error: "boom"}},
		Refused: []admin.Refused{ref("directory", "sources"), ref("registered", "kernel"), ref("registered", "kernel")},
		Netns:   &admin.Netns{Namespaces: []admin.Namespace{{Attached: true}, {}}, Scan: netnsscan.Stats{Sweeps: 7, SweepTime: 1500 * time.Millisecond}},
	}
	want := `
# HELP fairshare_membership_members Registered cgroups in force, by the source that registered them.
# TYPE fairshare_membership_members gauge
fairshare_membership_members{source="directory"} 3
fairshare_membership_members{source="registered"} 5
# HELP fairshare_membership_refused Registered cgroups not in force (a conflict, an invalid name or path, or refused by the kernel side), and cgroups a source could not make members.
# TYPE fairshare_membership_refused gauge
fairshare_membership_refused{by="kernel",source="registered"} 2
fairshare_membership_refused{by="sources",source="directory"} 1
fairshare_membership_refused{by="sources",source="registered"} 0
# HELP fairshare_membership_source_up Whether the last read of the source of members worked.
# TYPE fairshare_membership_source_up gauge
fairshare_membership_source_up{source="directory"} 1
fairshare_membership_source_up{source="registered"} 0
# HELP fairshare_netns_attached Of those, the namespaces inbound admission is attached in.
# TYPE fairshare_netns_attached gauge
fairshare_netns_attached 1
# HELP fairshare_netns_namespaces Network namespaces the members' processes are in (the host's not counted).
# TYPE fairshare_netns_namespaces gauge
fairshare_netns_namespaces 2
# HELP fairshare_netns_sweep_seconds How long the last sweep's steps took, summed.
# TYPE fairshare_netns_sweep_seconds gauge
fairshare_netns_sweep_seconds 1.5
# HELP fairshare_netns_sweeps_total Sweeps of the network namespace scan over every member.
# TYPE fairshare_netns_sweeps_total counter
fairshare_netns_sweeps_total 7
`
	c := New(fixed(st), 10, nil)
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), "fairshare_membership_members",
		"fairshare_membership_refused", "fairshare_membership_source_up", "fairshare_netns_attached", "fairshare_netns_namespaces",
		"fairshare_netns_sweep_seconds", "fairshare_netns_sweeps_total"); err != nil {
		t.Error(err)
	}
	lint(t, c)
}

// lint fails t for every problem promlint finds in what c exposes.
func lint(t *testing.T, c prometheus.Collector) {
	t.Helper()
	problems, err := testutil.CollectAndLint(c)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
}

// TestCollectPoliciesFile: a refused policies file shows as the gauge at 1
// with its count and time; no policies file, no series.
func TestCollectPoliciesFile(t *testing.T) {
	names := []string{"fairshare_policies_file_refused", "fairshare_policies_file_refusals_total",
		"fairshare_policies_file_last_refused_timestamp_seconds", "fairshare_policies_file_loaded_timestamp_seconds",
		"fairshare_policies_file_projects"}
	if n := testutil.CollectAndCount(New(fixed(sample()), 10, nil), names...); n != 0 {
		t.Errorf("%d policies file series without a policies file", n)
	}
	st := sample()
	st.PoliciesFile = &admin.PoliciesFile{Path: "/etc/fairshare/policies/policies.yaml", Projects: 3,
		LoadedAt: time.Unix(1700000000, 0), Error: "line 2: project a: shares 0", Refusals: 2, RefusedAt: time.Unix(1700000100, 500e6)}
	want := `
# HELP fairshare_policies_file_last_refused_timestamp_seconds When a content of the policies file was last refused, as a Unix time.
# TYPE fairshare_policies_file_last_refused_timestamp_seconds gauge
fairshare_policies_file_last_refused_timestamp_seconds 1.7000001005e+09
# HELP fairshare_policies_file_loaded_timestamp_seconds When the policies in force were read from the policies file, as a Unix time.
# TYPE fairshare_policies_file_loaded_timestamp_seconds gauge
fairshare_policies_file_loaded_timestamp_seconds 1.7e+09
# HELP fairshare_policies_file_projects Projects the policies in force from the policies file name.
# TYPE fairshare_policies_file_projects gauge
fairshare_policies_file_projects 3
# HELP fairshare_policies_file_refusals_total Contents of the policies file refused (each content counted once).
# TYPE fairshare_policies_file_refusals_total counter
fairshare_policies_file_refusals_total 2
# HELP fairshare_policies_file_refused Whether the policies file's current content is refused (the policies read before stay in force).
# TYPE fairshare_policies_file_refused gauge
fairshare_policies_file_refused 1
`
	c := New(fixed(st), 10, nil)
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), names...); err != nil {
		t.Error(err)
	}
	lint(t, c)
	st.PoliciesFile.Error = ""
	if err := testutil.CollectAndCompare(New(fixed(st), 10, nil), strings.NewReader(strings.Replace(want, "fairshare_policies_file_refused 1", "fairshare_policies_file_refused 0", 1)), names...); err != nil {
		t.Errorf("a good file again: %v", err)
	}
}
