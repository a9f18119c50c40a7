// SPDX-License-Identifier: Apache-2.0

package scheduler

import (
	"context"
	"time"
)

// Scheduler orders requests from many participants onto one server.
type Scheduler struct{}

// New returns a Scheduler. clk nil means the system clock.
func New(cfg Config, clk Clock) (*Scheduler, error) { return &Scheduler{}, nil }

// SetPolicy sets a participant's tier and shares; it survives the
// participant being forgotten while idle.
func (s *Scheduler) SetPolicy(participant string, p Policy) {}

// Submit queues one request at the tail of the participant's queue.
func (s *Scheduler) Submit(participant string) *Ticket { return &Ticket{} }

// Run is the dispatch loop; it returns ctx.Err() when ctx is done.
func (s *Scheduler) Run(ctx context.Context) error { <-ctx.Done(); return ctx.Err() }

// Snapshot returns the current state.
func (s *Scheduler) Snapshot() Snapshot { return Snapshot{} }

// Ticket is one submitted request.
type Ticket struct{}

// Wait blocks until the ticket is dispatched and returns its class. If ctx
// is done first the ticket is withdrawn and ctx.Err() returned.
func (t *Ticket) Wait(ctx context.Context) (Class, error) { <-ctx.Done(); return 0, ctx.Err() }

// Waited is the time the ticket spent queued.
func (t *Ticket) Waited() time.Duration { return 0 }

// Done reports completion with the request's real cost in credits.
func (t *Ticket) Done(cost float64) {}
