// SPDX-License-Identifier: Apache-2.0

package pace

import (
	"sync"
	"time"
)

// Bounds of the gap between two slots of a project: below a microsecond the
// slots are one instant anyway, and a rate under 0.1/s is better served by a
// later estimate than by pushing every slot ten seconds further.
const (
	minGap = time.Microsecond
	maxGap = 10 * time.Second
)

// sweepMin is the smallest map size at which stale slots are swept.
const sweepMin = 1024

// Pacer hands out return slots per project. It is safe for concurrent use.
type Pacer struct {
	horizon time.Duration

	mu      sync.Mutex           // guards the fields below
	next    map[string]time.Time // per project: the earliest slot not handed out
	sweepAt int                  // len(next) at which stale slots are dropped
}

// New returns a Pacer whose slots are never more than horizon after the
// refusal.
func New(horizon time.Duration) *Pacer {
	return &Pacer{horizon: horizon, next: map[string]time.Time{}, sweepAt: sweepMin}
}

// Slot gives a refusal of project at now its return slot. est is the
// refusal's own estimate (the earliest slot), rate how many of the project's
// clients can be admitted per second (0 or less: unknown, one per second). It
// returns the delay from now to the slot, at most the horizon, and the gap
// between this project's slots, which callers use to size their jitter.
func (p *Pacer) Slot(project string, now time.Time, est time.Duration, rate float64) (delay, gap time.Duration) {
	gap = time.Second
	if rate > 0 {
		gap = time.Duration(float64(time.Second) / rate)
	}
	gap = min(max(gap, minGap), maxGap)
	horizon := now.Add(p.horizon)

	p.mu.Lock()
	defer p.mu.Unlock()
	slot := now.Add(max(est, 0))
	if n, ok := p.next[project]; ok && n.After(slot) {
		slot = n
	}
	if slot.After(horizon) {
		slot = horizon
	}
	next := slot.Add(gap)
	if next.After(horizon) {
		next = horizon
	}
	p.next[project] = next
	if len(p.next) >= p.sweepAt {
		p.sweepLocked(now)
	}
	return slot.Sub(now), gap
}

// Len returns how many projects have slots pending (for tests and metrics).
func (p *Pacer) Len() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.next)
}

// sweepLocked drops the slots already in the past: those projects have no
// refused client still waiting.
func (p *Pacer) sweepLocked(now time.Time) {
	for k, t := range p.next {
		if !t.After(now) {
			delete(p.next, k)
		}
	}
	p.sweepAt = max(sweepMin, 2*len(p.next))
}
