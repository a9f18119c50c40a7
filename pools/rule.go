// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"errors"
	"fmt"
	"time"
)

// DefaultWindow is the active window used when Config.Window is zero.
const DefaultWindow = time.Second

// DefaultEvictWait is how long a residents spawn waits for room or a victim
// before it is refused, when Config.EvictWait is zero.
const DefaultEvictWait = time.Second

// DefaultForget is how long an idle project that holds nothing keeps its
// state (counters) before it is dropped, when Config.Forget is zero.
const DefaultForget = time.Minute

// Config describes one pool.
type Config struct {
	// Name names the pool in refusals and snapshots ("requests", "connections").
	Name string
	// Size is POOL, the node-wide number of permits; it must be > 0.
	Size int
	// Floor is FLOOR; 0 means DefaultFloor(Size). It must be <= Size.
	Floor int
	// Window is the active window; 0 means DefaultWindow (1s).
	Window time.Duration
	// EvictWait bounds how long Residents.Spawn waits for room or a victim
	// before refusing; 0 means DefaultEvictWait (1s). Ignored by Pool.
	EvictWait time.Duration
	// Forget is how long a project that holds nothing and asks for nothing
	// keeps its state; 0 means DefaultForget. It is at least Window.
	Forget time.Duration
}

// ErrInvalidConfig is returned for a size <= 0, a negative floor or a floor
// above the size.
var ErrInvalidConfig = errors.New("invalid pool config")

// normalize fills the defaults and validates.
func (c Config) normalize() (Config, error) {
	if c.Size <= 0 {
		return c, fmt.Errorf("pool %q: size %d must be > 0: %w", c.Name, c.Size, ErrInvalidConfig)
	}
	if c.Floor < 0 || c.Floor > c.Size {
		return c, fmt.Errorf("pool %q: floor %d must be in [0, %d]: %w", c.Name, c.Floor, c.Size, ErrInvalidConfig)
	}
	c.Floor = EffectiveFloor(c.Size, c.Floor)
	if c.Window < 0 || c.EvictWait < 0 || c.Forget < 0 {
		return c, fmt.Errorf("pool %q: negative duration: %w", c.Name, ErrInvalidConfig)
	}
	if c.Window == 0 {
		c.Window = DefaultWindow
	}
	if c.EvictWait == 0 {
		c.EvictWait = DefaultEvictWait
	}
	if c.Forget == 0 {
		c.Forget = DefaultForget
	}
	if c.Forget < c.Window {
		c.Forget = c.Window
	}
	return c, nil
}

// DefaultFloor is 5% of size, rounded down, but at least one permit.
func DefaultFloor(size int) int {
	f := size / 20
	if f < 1 {
		f = 1
	}
	return f
}

// EffectiveFloor is the floor in force for a pool of size configured with
// floor: floor, or DefaultFloor(size) when floor is 0. Every part that takes
// a configured floor (the pools, the kernel side, the configuration's
// effective values and the daemon's status) resolves it here.
func EffectiveFloor(size, floor int) int {
	if floor == 0 {
		return DefaultFloor(size)
	}
	return floor
}

// Share is max(floor, size/active) with integer division. With no active
// project (active <= 0) the whole pool is the share.
func Share(size, floor, active int) int {
	if active <= 0 {
		return size
	}
	s := size / active
	if s < floor {
		s = floor
	}
	return s
}

// Admits is the rule: a project holding fewer than share permits is admitted
// while in_use < size; a project at or over its share only while
// in_use < size - floor.
func Admits(inUse, held, size, floor, share int) bool {
	if held < share {
		return inUse < size
	}
	return inUse < size-floor
}

// Sentinel errors callers branch on.
var (
	// ErrRefused matches every *Refusal.
	ErrRefused = errors.New("refused by fair share")
	// ErrDoubleRelease is returned when a permit is released a second time
	// (or a permit that this pool never issued is released).
	ErrDoubleRelease = errors.New("permit already released")
	// ErrTooManyResidents matches a *Refusal from Residents.Spawn: nothing
	// could be evicted within the eviction wait.
	ErrTooManyResidents = errors.New("too many residents")
)

// Refusal explains why a permit was refused and when to ask again.
type Refusal struct {
	Pool, Project string
	// Reason says which branch of the rule refused.
	Reason string
	// Held and Share are the project's, InUse and Size the pool's, at the
	// moment of the refusal.
	Held, Share, InUse, Size int
	// RetryAfter is the estimate of when this project could be admitted
	// (not jittered); see the package documentation for the estimator.
	RetryAfter time.Duration
	// ReleaseRate is the pool's smoothed release rate (permits per second)
	// the estimate was made from; 0 when no release was seen lately. A caller
	// that refuses many clients of one project at once can space their
	// returns by it, so they come back at the rate permits free.
	ReleaseRate float64
	// WouldRefuse marks the refusal dry-run turned into an admission
	// (TryAcquireInto's ok is true).
	WouldRefuse bool

	residents bool
}

// Error implements error.
func (r *Refusal) Error() string {
	kind := "refused"
	if r.residents {
		kind = "too many residents"
	}
	return fmt.Sprintf("pool %s: project %s %s: %s (held %d, share %d, in use %d/%d); retry after %v",
		r.Pool, r.Project, kind, r.Reason, r.Held, r.Share, r.InUse, r.Size, r.RetryAfter)
}

// Is reports ErrRefused for every refusal and ErrTooManyResidents for a
// residents refusal.
func (r *Refusal) Is(target error) bool {
	return target == ErrRefused || (r.residents && target == ErrTooManyResidents)
}

// Refusal reasons.
const (
	ReasonFull      = "pool full"
	ReasonOverShare = "over share: pool full to the floor"
	// ReasonOverCap: the project holds its cap (Pool.SetCaps), its
	// fleet allotment on this node.
	ReasonOverCap = "over its fleet cap"
)
