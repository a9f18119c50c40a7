// SPDX-License-Identifier: Apache-2.0

package fleet

import "github.com/fairshare-dev/fairshare/pools"

// PoolTarget drives a user-space pool (package pools): Target, Capper and
// Source in one.
type PoolTarget struct{ Pool *pools.Pool }

// SetSize resizes the pool, with the default floor (unused by capped
// projects; it divides the spare among the uncapped ones).
func (t PoolTarget) SetSize(size int) error { return t.Pool.Resize(size, 0) }

// SetCaps sets the pool's per-project caps.
func (t PoolTarget) SetCaps(caps map[string]int, others int) error {
	t.Pool.SetCaps(caps, others)
	return nil
}

// Usage reads the pool's projects from one snapshot.
func (t PoolTarget) Usage() (map[string]Usage, error) {
	s := t.Pool.Snapshot()
	out := make(map[string]Usage, len(s.Projects))
	for _, p := range s.Projects {
		out[p.Project] = Usage{Held: p.Held, Refused: p.Refused, Active: p.Active}
	}
	return out, nil
}
