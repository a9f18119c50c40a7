// SPDX-License-Identifier: Apache-2.0

package pools

import "context"

// Residents is the residents pool: the fair-share rule with eviction instead
// of refusal. It is safe for concurrent use.
type Residents struct {
	cfg Config
	clk Clock
}

// NewResidents returns an empty residents pool.
func NewResidents(cfg Config, clk Clock) (*Residents, error) {
	cfg, err := cfg.normalize()
	if err != nil {
		return nil, err
	}
	return &Residents{cfg: cfg, clk: clockOrSystem(clk)}, nil
}

// Eviction names the object the caller must put to sleep so that a spawn can
// proceed. The zero value means nothing is evicted.
type Eviction struct{ Project, Object, Reason string }

// Eviction reasons.
const (
	EvictOwnIdlest         = "own-idlest"
	EvictFurthestOverShare = "furthest-over-share"
)

// ResidentsSnapshot is a Snapshot with the residents' own counters.
type ResidentsSnapshot struct {
	Snapshot
	// Sleeping counts sleeping objects per project.
	Sleeping map[string]int
	// Evictions counts evicted objects: victim project -> reason -> count.
	Evictions map[string]map[string]uint64
}

// Spawn makes object of project resident (spawned or woken).
func (r *Residents) Spawn(ctx context.Context, project, object string) (Eviction, error) {
	return Eviction{}, nil
}

// Touch records a call on a resident object.
func (r *Residents) Touch(object string) error { return nil }

// Sleep records that object went to sleep: its permit is freed.
func (r *Residents) Sleep(object string) error { return nil }

// Remove forgets object entirely.
func (r *Residents) Remove(object string) error { return nil }

// Recompute settles the active set and the share; call it once per second.
func (r *Residents) Recompute() {}

// Snapshot returns the residents pool's state.
func (r *Residents) Snapshot() ResidentsSnapshot { return ResidentsSnapshot{} }
