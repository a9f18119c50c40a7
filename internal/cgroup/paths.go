// SPDX-License-Identifier: Apache-2.0

package cgroup

import (
	"sync"
	"time"

	"github.com/fairshare-dev/fairshare/internal/clock"
)

// Paths is Mount.PathOf with the answers kept for a while: the front asks
// for its peers' cgroups at each request, and PathOf costs five system
// calls where a kept answer costs a map lookup. A cgroup's path does not
// change while it lives (cgroup2 refuses renames) and its id is never
// another cgroup's (ids are not reused while the system runs): a kept
// answer can only be stale for a cgroup removed since, at most ttl. It is
// safe for concurrent use.
type Paths struct {
	mount Mount
	ttl   time.Duration
	clk   clock.Clock

	mu   sync.Mutex // guards kept
	kept map[uint64]keptPath
}

type keptPath struct {
	path string
	at   time.Time
}

// pathsKept bounds the answers kept: past it, the expired ones are let
// go, and all of them if none had expired.
const pathsKept = 4096

// NewPaths returns the cache of m's PathOf, answers kept for ttl by clk's
// time (the system's when nil).
func NewPaths(m Mount, ttl time.Duration, clk clock.Clock) *Paths {
	return &Paths{mount: m, ttl: ttl, clk: clock.Or(clk), kept: map[uint64]keptPath{}}
}

// PathOf is Mount.PathOf, answered from what was kept when it is fresh.
// Errors are not kept.
func (p *Paths) PathOf(id uint64) (string, error) {
	now := p.clk.Now()
	p.mu.Lock()
	k, ok := p.kept[id]
	p.mu.Unlock()
	if ok && now.Sub(k.at) < p.ttl {
		return k.path, nil
	}
	path, err := p.mount.PathOf(id)
	if err != nil {
		p.mu.Lock()
		delete(p.kept, id)
		p.mu.Unlock()
		return "", err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.kept) >= pathsKept {
		for id, k := range p.kept {
			if now.Sub(k.at) >= p.ttl {
				delete(p.kept, id)
			}
		}
		if len(p.kept) >= pathsKept {
			clear(p.kept)
		}
	}
	p.kept[id] = keptPath{path, now}
	return path, nil
}
