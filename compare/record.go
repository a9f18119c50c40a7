// SPDX-License-Identifier: Apache-2.0

package compare

import (
	"math"
	"slices"
	"sort"
	"sync"
	"time"
)

// recorder integrates, event by event, what each project holds against
// what max-min fairness would give it, and collects latencies. Every event
// reads the clock under the lock, so the integrals see events in order.
type recorder struct {
	start time.Time
	pool  int
	floor int
	// warmup is the time from the start that no metric counts.
	warmup time.Duration

	mu sync.Mutex // guards the fields below
	// last is the time (since start) the integrals reach; frozen stops them.
	last     time.Duration
	frozen   bool
	projects map[string]*projRec
	order    []string // first-seen order, for stable output
	inUse    int
	maxInUse int // the most seats in use at once, over the whole run
	demand   int
	// overloaded is the time total demand exceeded the pool, busy the
	// seat-time in use during it.
	overloaded, busy float64
	mouseLat         []time.Duration
	floorWaits       []time.Duration
	shareWaits       []time.Duration
	refusals, admits int
	samples          []Sample
}

type projRec struct {
	held, demand int
	fair         float64 // max-min allocation at the current demands
	heldInt      float64 // seat-seconds held
	fairInt      float64 // seat-seconds max-min would give
	done         int
	// arrived is when a newcomer arrived (after the start, with the pool
	// already wanted whole by the others) and waits for its share; pending
	// until it holds it; want is its writers, all of which must have
	// asked before its share is judged.
	arrived time.Duration
	pending bool
	want    int
	// floorFrom is when a newcomer (any, full pool or not) arrived;
	// floorPending until it holds the floor (its first seat, with
	// FLOOR = 1).
	floorFrom    time.Duration
	floorPending bool
}

// shareTargetLocked is the seats newcomer p must hold to have its share:
// an equal split of the pool over the projects with writers alive,
// rounded down (at least one), or all its writers if it has fewer. Every
// scheme here protects at least that much (the rule's POOL/active, APF's
// equal division between flows, a static cap of pool/N with N right);
// what max-min adds above it is Jain's business.
func (r *recorder) shareTargetLocked(p *projRec) int {
	present := 0
	for _, q := range r.projects {
		if q.demand > 0 {
			present++
		}
	}
	return max(1, min(p.want, r.pool/max(present, 1)))
}

// Sample is the seats each project held at one moment (for the plot).
type Sample struct {
	At   time.Duration
	Held map[string]int
	// Demand is each present project's writers.
	Demand map[string]int
}

func newRecorder(pool, floor int, start time.Time) *recorder {
	return &recorder{start: start, pool: pool, floor: floor, projects: map[string]*projRec{}}
}

func (r *recorder) projLocked(name string) *projRec {
	p := r.projects[name]
	if p == nil {
		p = &projRec{}
		r.projects[name] = p
		r.order = append(r.order, name)
	}
	return p
}

// advanceLocked integrates up to now.
func (r *recorder) advanceLocked() time.Duration {
	now := time.Since(r.start)
	if r.frozen || now < r.warmup {
		r.last = now
		return now
	}
	dt := (now - max(r.last, r.warmup)).Seconds()
	if dt > 0 {
		for _, p := range r.projects {
			p.heldInt += float64(p.held) * dt
			p.fairInt += p.fair * dt
		}
		if r.demand > r.pool {
			r.overloaded += dt
			r.busy += float64(r.inUse) * dt
		}
		r.last = now
	}
	return now
}

// refairLocked recomputes the max-min allocation of the pool over the
// current demands (water-filling).
func (r *recorder) refairLocked() {
	var ds []*projRec
	for _, p := range r.projects {
		p.fair = 0
		if p.demand > 0 {
			ds = append(ds, p)
		}
	}
	sort.Slice(ds, func(i, j int) bool { return ds[i].demand < ds[j].demand })
	left := float64(r.pool)
	for i, p := range ds {
		even := left / float64(len(ds)-i)
		p.fair = math.Min(float64(p.demand), even)
		left -= p.fair
	}
}

// arrive adds writers to project's demand. A newcomer (arriving after the
// start) that finds the writers alive already wanting every seat is timed
// from its first writer's ask until it holds its share (shareTarget), once
// all want of its writers have asked.
func (r *recorder) arrive(project string, writers int, newcomer bool, want int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.advanceLocked()
	p := r.projLocked(project)
	if p.demand == 0 && newcomer && now >= r.warmup && !r.frozen {
		p.floorFrom, p.floorPending = now, true
		if r.demand >= r.pool {
			p.arrived, p.pending, p.want = now, true, want
		}
	}
	p.demand += writers
	r.demand += writers
	r.refairLocked()
	r.checkSharesLocked(now)
}

// checkSharesLocked ends the wait of every pending newcomer that holds its
// share, now that the holdings or the shares have changed.
func (r *recorder) checkSharesLocked(now time.Duration) {
	if r.frozen {
		return
	}
	for _, p := range r.projects {
		if p.pending && p.demand >= p.want && p.held >= r.shareTargetLocked(p) {
			p.pending = false
			r.shareWaits = append(r.shareWaits, now-p.arrived)
		}
	}
}

func (r *recorder) leave(project string, writers int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.advanceLocked()
	p := r.projLocked(project)
	p.demand -= writers
	r.demand -= writers
	if p.demand == 0 && p.pending && !r.frozen {
		// Left without reaching its share: count its whole life.
		p.pending = false
		r.shareWaits = append(r.shareWaits, now-p.arrived)
	}
	if p.demand == 0 && p.floorPending && !r.frozen {
		p.floorPending = false
		r.floorWaits = append(r.floorWaits, now-p.floorFrom)
	}
	r.refairLocked()
	r.checkSharesLocked(now)
}

// hold records a seat taken (+1) or given back (-1) by project.
func (r *recorder) hold(project string, d int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.advanceLocked()
	p := r.projLocked(project)
	p.held += d
	r.inUse += d
	if !r.frozen {
		r.maxInUse = max(r.maxInUse, r.inUse)
	}
	if d > 0 && p.floorPending && p.held >= min(r.floor, p.demand) {
		p.floorPending = false
		if !r.frozen {
			r.floorWaits = append(r.floorWaits, now-p.floorFrom)
		}
	}
	if d > 0 && p.pending {
		r.checkSharesLocked(now)
	}
}

func (r *recorder) refused() {
	r.mu.Lock()
	if !r.frozen && time.Since(r.start) >= r.warmup {
		r.refusals++
	}
	r.mu.Unlock()
}

func (r *recorder) done(project string, mouse bool, lat time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.frozen || time.Since(r.start) < r.warmup {
		return
	}
	r.admits++
	r.projLocked(project).done++
	if mouse {
		r.mouseLat = append(r.mouseLat, lat)
	}
}

func (r *recorder) sample() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.frozen {
		return
	}
	s := Sample{At: time.Since(r.start), Held: make(map[string]int, len(r.projects)), Demand: map[string]int{}}
	for name, p := range r.projects {
		if p.held > 0 || p.demand > 0 {
			s.Held[name] = p.held
			s.Demand[name] = p.demand
		}
	}
	r.samples = append(r.samples, s)
}

// freeze ends the integrals at the run's end. A newcomer still waiting
// for its share or its floor counts its wait until then.
func (r *recorder) freeze() {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.advanceLocked()
	for _, name := range r.order {
		p := r.projects[name]
		if p.pending {
			p.pending = false
			r.shareWaits = append(r.shareWaits, now-p.arrived)
		}
		if p.floorPending {
			p.floorPending = false
			r.floorWaits = append(r.floorWaits, now-p.floorFrom)
		}
	}
	r.frozen = true
}

// Result is one run of one system on one workload.
type Result struct {
	System   string `json:"system"`
	Workload string `json:"workload"`
	Seed     uint64 `json:"seed"`
	// Jain is Jain's index of x_i = seat-time held / seat-time max-min
	// fair given the demands, over every project that had demand.
	Jain float64 `json:"jain"`
	// MouseP99 is the p99 latency (first ask to completion, retries
	// included) of the 2-writer projects' requests; 0 without mice.
	MouseP99 time.Duration `json:"mouse_p99_ns"`
	// Utilization is the seat-time in use over the pool's seat-time while
	// the writers alive outnumbered the pool; -1 if they never did.
	Utilization float64 `json:"utilization"`
	// ShareWaits are the times newcomers (projects arriving after the
	// start while the writers alive wanted every seat) waited to hold
	// their max-min share (rounded down, at least one seat), counted from
	// their first ask, or their whole life if they left without it.
	ShareWaits []time.Duration `json:"share_waits_ns"`
	// FloorWaits are the times every newcomer waited to hold the floor
	// (FLOOR = 1 seat of 32: its first seat), full pool or not.
	FloorWaits []time.Duration `json:"floor_waits_ns"`
	Refusals   int             `json:"refusals"`
	Admits     int             `json:"admits"`
	// MaxInUse is the most seats in use at once until the run's end,
	// warmup included: over HTTP, the most requests the upstream held at
	// once.
	MaxInUse int             `json:"max_in_use"`
	Projects []ProjectResult `json:"projects"`
	Samples  []Sample        `json:"-"`
}

// ProjectResult is one project's share of a run.
type ProjectResult struct {
	Name     string  `json:"name"`
	HeldSec  float64 `json:"held_seat_seconds"`
	FairSec  float64 `json:"fair_seat_seconds"`
	Requests int     `json:"requests"`
}

// RefusalsPerAdmit is refusals (each followed by a retry) per admitted
// request.
func (r Result) RefusalsPerAdmit() float64 {
	if r.Admits == 0 {
		return math.NaN()
	}
	return float64(r.Refusals) / float64(r.Admits)
}

// MaxFloorWait is the longest newcomer wait for its first seat; -1
// without newcomers.
func (r Result) MaxFloorWait() time.Duration {
	if len(r.FloorWaits) == 0 {
		return -1
	}
	return slices.Max(r.FloorWaits)
}

// MaxShareWait is the longest newcomer wait for its share; -1 without
// newcomers into a full pool.
func (r Result) MaxShareWait() time.Duration {
	if len(r.ShareWaits) == 0 {
		return -1
	}
	return slices.Max(r.ShareWaits)
}

func (r *recorder) result() Result {
	r.mu.Lock()
	defer r.mu.Unlock()
	res := Result{Refusals: r.refusals, Admits: r.admits, MaxInUse: r.maxInUse, Samples: r.samples,
		ShareWaits: slices.Clone(r.shareWaits), FloorWaits: slices.Clone(r.floorWaits), Utilization: -1}
	var sum, sq float64
	n := 0
	for _, name := range r.order {
		p := r.projects[name]
		res.Projects = append(res.Projects, ProjectResult{Name: name, HeldSec: p.heldInt, FairSec: p.fairInt, Requests: p.done})
		if p.fairInt <= 0 {
			continue
		}
		x := p.heldInt / p.fairInt
		sum += x
		sq += x * x
		n++
	}
	if n > 0 && sq > 0 {
		res.Jain = sum * sum / (float64(n) * sq)
	}
	if r.overloaded > 0 {
		res.Utilization = r.busy / (float64(r.pool) * r.overloaded)
	}
	res.MouseP99 = quantile(r.mouseLat, 0.99)
	return res
}

// quantile is the q-quantile of ds by the nearest rank; 0 for none.
func quantile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(math.Ceil(q*float64(len(s)))) - 1
	return s[max(i, 0)]
}
