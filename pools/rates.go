// SPDX-License-Identifier: Apache-2.0

package pools

import "time"

// Limits is a project's rate policy. Zero means unbounded.
type Limits struct{ RequestsPerSec, WorkPerSec float64 }

// Rates holds per-project token buckets. It is safe for concurrent use.
type Rates struct {
	clk Clock
}

// NewRates returns an empty set of buckets.
func NewRates(clk Clock) *Rates { return &Rates{clk: clockOrSystem(clk)} }

// SetLimits sets a project's limits.
func (r *Rates) SetLimits(project string, l Limits) {}

// Allow takes one request token.
func (r *Rates) Allow(project string) (ok bool, retryAfter time.Duration) { return true, 0 }

// Charge charges work units after the fact.
func (r *Rates) Charge(project string, work float64) {}

// State returns one project's buckets.
func (r *Rates) State(project string) RateState { return RateState{Project: project} }

// Snapshot returns every project with limits, sorted by project.
func (r *Rates) Snapshot() []RateState { return nil }

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
