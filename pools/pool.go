// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"context"
	"time"
)

// Pool is one permit pool under the fair-share rule. It is safe for
// concurrent use.
type Pool struct {
	cfg Config
	clk Clock
}

// New returns an empty pool.
func New(cfg Config, clk Clock) (*Pool, error) {
	cfg, err := cfg.normalize()
	if err != nil {
		return nil, err
	}
	return &Pool{cfg: cfg, clk: clockOrSystem(clk)}, nil
}

// Name returns the pool's name.
func (p *Pool) Name() string { return p.cfg.Name }

// Permit is one held permit. It is a comparable value; the zero Permit is
// not valid.
type Permit struct {
	pool    *Pool
	project string
	slot    int32
	gen     uint32
}

// Project returns the project that holds the permit.
func (pm Permit) Project() string { return pm.project }

// Valid reports whether the permit was issued by a pool (it may already have
// been released).
func (pm Permit) Valid() bool { return pm.pool != nil }

// TryAcquire takes a permit for project or refuses at once with a *Refusal.
func (p *Pool) TryAcquire(project string) (Permit, error) {
	return Permit{}, &Refusal{Pool: p.cfg.Name, Project: project, Reason: "not implemented"}
}

// Acquire takes a permit, waiting (FIFO per project) until a release makes
// room or ctx is done.
func (p *Pool) Acquire(ctx context.Context, project string) (Permit, error) {
	return p.TryAcquire(project)
}

// Release gives a permit back and wakes waiters.
func (p *Pool) Release(pm Permit) error { return ErrDoubleRelease }

// Resize changes POOL and FLOOR (floor 0 = DefaultFloor(size)).
func (p *Pool) Resize(size, floor int) error { return nil }

// Recompute settles the active set and the share; call it once per second.
func (p *Pool) Recompute() {}

// Snapshot returns the pool's state for metrics and status.
func (p *Pool) Snapshot() Snapshot { return Snapshot{Name: p.cfg.Name} }

// Snapshot is a point-in-time view of a pool.
type Snapshot struct {
	Name                              string
	Size, Floor, InUse, Active, Share int
	// Projects is sorted by project.
	Projects []ProjectStat
}

// ProjectStat is one project's view in a Snapshot.
type ProjectStat struct {
	Project string
	// Held is the number of permits (resident objects) the project holds.
	Held int
	// Admitted and Refused count asks since the project's state was created.
	Admitted, Refused uint64
	// LastSeen is the last time the project held or asked, at the
	// resolution of the recompute period.
	LastSeen time.Time
	// Active reports membership of the active set.
	Active bool
}

var _ = time.Second
