// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/fairshare-dev/fairshare/internal/clock"
)

// Limits is a project's rate policy. Zero means unbounded.
type Limits struct{ RequestsPerSec, WorkPerSec float64 }

// Bounds of a rate, per second: 0 (unbounded), or from MinRate to MaxRate.
// MinRate is one request (work unit) per 1000 s: a slower limit is a typo or
// a block, and a block is not what a rate is for. MaxRate is far above what
// one node serves: anything above it is a typo too. package policy refuses
// rates outside the bounds; SetLimits takes a rate in (0, MinRate) as
// MinRate and one above MaxRate as MaxRate, so the bucket's arithmetic stays
// far inside float64 and time.Duration.
const (
	MinRate = 1e-3
	MaxRate = 1e9
)

// MaxRateRetry bounds the retry times Allow returns. At MinRate a token is at
// most 1000 s away, but work debt can be any size: a charge of a million
// units at 0.001/s is 31 years of debt, which overflowed the conversion to
// a Duration (and came out as an immediate retry). Callers cap the hint they
// give clients further (the HTTP front: 60 s).
const MaxRateRetry = 24 * time.Hour

// ClampRate applies the bounds to one rate as SetLimits does: 0, below or
// NaN is unbounded (0), (0, MinRate) is MinRate, above MaxRate is MaxRate.
func ClampRate(r float64) float64 {
	switch {
	case math.IsNaN(r) || r <= 0:
		return 0
	case r < MinRate:
		return MinRate
	case r > MaxRate || math.IsInf(r, 1):
		return MaxRate
	}
	return r
}

// Rates holds per-project token buckets for requests per second and work
// units per second. Only projects with a limit have state, so memory is
// bounded by the number of policies. It is safe for concurrent use.
type Rates struct {
	ns clock.Nanos // the clock, as the buckets' int64 times

	mu      sync.Mutex // guards the fields below
	buckets map[string]*bucket
}

// bucket is one project's pair of token buckets, refilled lazily on access.
type bucket struct {
	limits  Limits
	req     float64
	work    float64
	last    int64 // ns of the latest refill; never moves back
	limited uint64
}

// NewRates returns an empty set of buckets; a nil clk means the system clock.
func NewRates(clk clock.Clock) *Rates {
	return &Rates{ns: clock.NewNanos(clk), buckets: map[string]*bucket{}}
}

// burst is one second's worth of rate, but at least one token so that a rate
// below 1/s still admits.
func burst(rate float64) float64 { return math.Max(rate, 1) }

// SetLimits sets a project's limits. Both zero removes the project's
// buckets (unbounded). A new bucket starts full, a rate added to a project
// that had only the other included; a changed one keeps its balance, capped
// at the new burst.
func (r *Rates) SetLimits(project string, l Limits) {
	r.setLimits(project, l, r.ns.Now())
}

func (r *Rates) setLimits(project string, l Limits, n int64) {
	l.RequestsPerSec = ClampRate(l.RequestsPerSec)
	l.WorkPerSec = ClampRate(l.WorkPerSec)
	r.mu.Lock()
	defer r.mu.Unlock()
	if l == (Limits{}) {
		delete(r.buckets, project)
		return
	}
	b, ok := r.buckets[project]
	if !ok {
		r.buckets[project] = &bucket{limits: l, req: burst(l.RequestsPerSec), work: burst(l.WorkPerSec), last: n}
		return
	}
	b.refill(n)
	was := b.limits
	b.limits = l
	// A rate added to a project with only the other is a new bucket too:
	// its balance was never refilled (a bucket without a rate is not).
	if was.RequestsPerSec == 0 {
		b.req = burst(l.RequestsPerSec)
	} else {
		b.req = math.Min(b.req, burst(l.RequestsPerSec))
	}
	if was.WorkPerSec == 0 {
		b.work = burst(l.WorkPerSec)
	} else {
		// A debt made at a higher rate is held to a day of the new one's
		// refill, as a new charge is (charge).
		b.work = math.Max(math.Min(b.work, burst(l.WorkPerSec)), -l.WorkPerSec*float64(MaxRateRetry/time.Second))
	}
}

// refill adds the tokens earned since last. A timestamp older than last (a
// caller that read the clock before waiting for the lock) earns nothing and
// does not move last back: moving it back would pay the same interval twice
// (golang/go#71360).
func (b *bucket) refill(now int64) {
	if now <= b.last {
		return
	}
	el := float64(now-b.last) / float64(time.Second)
	b.last = now
	if rt := b.limits.RequestsPerSec; rt > 0 {
		b.req = math.Min(burst(rt), b.req+el*rt)
	}
	if rt := b.limits.WorkPerSec; rt > 0 {
		b.work = math.Min(burst(rt), b.work+el*rt)
	}
}

// Allow takes one request token for project. It refuses, with the time
// until it would succeed, while the request bucket holds less than one token
// or while the work bucket is in debt (below zero).
func (r *Rates) Allow(project string) (ok bool, retryAfter time.Duration) {
	return r.allow(project, r.nanos)
}

// nanos reads the clock. Allow and Charge read it only for a project with
// limits: most have none, and a read is 36 ns here, a third of what Allow
// costs without it.
func (r *Rates) nanos() int64 { return r.ns.Now() }

func (r *Rates) allow(project string, now func() int64) (bool, time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	b, ok := r.buckets[project]
	if !ok {
		return true, 0
	}
	b.refill(now())
	if rt := b.limits.WorkPerSec; rt > 0 && b.work < 0 {
		b.limited++
		return false, secondsCeil(-b.work / rt)
	}
	if rt := b.limits.RequestsPerSec; rt > 0 {
		if b.req < 1 {
			b.limited++
			return false, secondsCeil((1 - b.req) / rt)
		}
		b.req--
	}
	return true, 0
}

// secondsCeil converts seconds to a Duration, rounding up so that a client
// waiting that long finds the token there, and saturating at MaxRateRetry.
func secondsCeil(s float64) time.Duration {
	ns := math.Ceil(s * float64(time.Second))
	if !(ns < float64(MaxRateRetry)) { // NaN included
		return MaxRateRetry
	}
	return max(time.Duration(ns), time.Nanosecond)
}

// Charge takes work units from project's work bucket after the work is
// done. The balance may go below zero: the project is then in debt and
// Allow refuses until the refill brings it back to zero.
func (r *Rates) Charge(project string, work float64) {
	r.charge(project, work, r.nanos)
}

func (r *Rates) charge(project string, work float64, now func() int64) {
	if math.IsNaN(work) || work <= 0 {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	b, ok := r.buckets[project]
	if !ok || b.limits.WorkPerSec <= 0 {
		return
	}
	b.refill(now())
	// The debt stops at what a day of the bucket's own refill repays: a
	// cost, however large (an upstream's cost header says any number),
	// holds a project back a day at most, its Retry-After's bound.
	b.work = math.Max(b.work-work, math.Min(b.work, -b.limits.WorkPerSec*float64(MaxRateRetry/time.Second)))
}

// State returns one project's buckets, refilled to now. A project without
// limits reports zero Limits and zero balances.
func (r *Rates) State(project string) RateState {
	now := r.ns.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	b, ok := r.buckets[project]
	if !ok {
		return RateState{Project: project}
	}
	b.refill(now)
	return b.state(project)
}

// Snapshot returns every project with limits, sorted by project.
func (r *Rates) Snapshot() []RateState {
	now := r.ns.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]RateState, 0, len(r.buckets))
	for name, b := range r.buckets {
		b.refill(now)
		out = append(out, b.state(name))
	}
	slices.SortFunc(out, func(a, b RateState) int { return strings.Compare(a.Project, b.Project) })
	return out
}

func (b *bucket) state(project string) RateState {
	return RateState{Project: project, Limits: b.limits, RequestTokens: b.req, WorkTokens: b.work, Limited: b.limited}
}

// RateState is one project's buckets.
type RateState struct {
	Project string
	Limits  Limits
	// RequestTokens and WorkTokens are the current balances; WorkTokens < 0
	// means the project is in work debt.
	RequestTokens, WorkTokens float64
	// Limited counts requests refused by rate or debt.
	Limited uint64
}
