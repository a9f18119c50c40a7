// SPDX-License-Identifier: Apache-2.0

package front

import (
	"math"
	"math/rand/v2"
	"sync"
	"time"
)

// Bounds of a Retry-After, in seconds.
const (
	minRetrySeconds = 1
	maxRetrySeconds = 60
)

// retryPacer turns a refusal's estimate into a Retry-After in whole seconds
// that spreads the refused clients of one project over time.
//
// Why not the estimate alone: Retry-After has a resolution of one second, so
// every estimate under a second (the common case) becomes "1" and all the
// clients refused in one second come back in the same second, to be refused
// again together. The pacer instead gives each refusal of a project its own
// return slot: the first at now + estimate, each later one 1/rate after the
// previous, where rate is how fast the project can be admitted again (its
// requests/s, its work refill, or the pool's release rate). Clients that obey
// thus return at about the rate they can be served. A uniform jitter of one
// slot, but at least a second, and a random rounding to whole seconds
// (up with probability equal to the fraction) keep the expected value equal
// to the slot while no two projects or clients line up on a second boundary.
type retryPacer struct {
	mu      sync.Mutex // guards the fields below
	rng     *rand.Rand
	next    map[string]time.Time // per project: the earliest slot not handed out
	sweepAt int                  // len(next) at which stale slots are dropped
}

func newRetryPacer(seed uint64) *retryPacer {
	return &retryPacer{rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), next: map[string]time.Time{}, sweepAt: 1024}
}

// seconds returns the Retry-After for a refusal of project at now, admitted
// again after est at rate per second (0: unknown, one per second).
func (p *retryPacer) seconds(project string, now time.Time, est time.Duration, rate float64) int {
	gap := time.Second
	if rate > 0 {
		gap = time.Duration(float64(time.Second) / rate)
	}
	gap = min(max(gap, time.Microsecond), 10*time.Second)
	horizon := now.Add(maxRetrySeconds * time.Second)

	p.mu.Lock()
	defer p.mu.Unlock()
	slot := now.Add(max(est, 0))
	if n, ok := p.next[project]; ok && n.After(slot) {
		slot = n
	}
	// A project that keeps asking without obeying pushes only its own slots
	// out, up to the cap.
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
	x := slot.Sub(now).Seconds() + p.rng.Float64()*max(gap, time.Second).Seconds()
	s := math.Floor(x)
	if p.rng.Float64() < x-s {
		s++
	}
	return int(min(max(s, minRetrySeconds), maxRetrySeconds))
}

// sweepLocked drops the slots already in the past: those projects have no
// refused client still waiting.
func (p *retryPacer) sweepLocked(now time.Time) {
	for k, t := range p.next {
		if !t.After(now) {
			delete(p.next, k)
		}
	}
	p.sweepAt = max(1024, 2*len(p.next))
}
