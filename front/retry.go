// SPDX-License-Identifier: Apache-2.0

package front

import (
	"math"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/fairshare-dev/fairshare/internal/pace"
)

// minRetrySeconds is the smallest Retry-After: 0 would invite a retry loop.
const minRetrySeconds = 1

// retryHorizon bounds how far a project's backlog can push its slots; 0 is
// no bound (see the package documentation, Retry-After).
var retryHorizon = time.Minute

// retryPacer turns a refusal's estimate into a Retry-After in whole seconds
// that spreads the refused clients of one project over time; the slots come
// from package pace.
//
// Why not the estimate alone: Retry-After has a resolution of one second, so
// every estimate under a second (the common case) becomes "1" and all the
// clients refused in one second come back in the same second, to be refused
// again together. The pacer instead gives each refusal of a project its own
// return slot: the first at now + estimate, each later one 1/rate after the
// previous, where rate is how fast the project can be admitted again (its
// requests/s, its work refill, or the pool's release rate). Clients that obey
// thus return at about the rate they can be served. A uniform jitter of one
// slot centred on it (pace.Spread) and a random rounding to whole seconds
// (up with probability equal to the fraction) keep the expected value equal
// to the slot while no two projects or clients line up on a second boundary.
type retryPacer struct {
	slots *pace.Pacer

	mu  sync.Mutex // guards the fields below
	rng *rand.Rand
}

func newRetryPacer(seed uint64) *retryPacer {
	return &retryPacer{slots: pace.New(retryHorizon), rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
}

// seconds returns the Retry-After for a refusal of project at now, admitted
// again after est at rate per second (0: unknown, one per second).
func (p *retryPacer) seconds(project string, now time.Time, est time.Duration, rate float64) int {
	s, _ := p.hint(project, now, est, rate)
	return s
}

// hint returns a refusal's Retry-After in whole seconds and the same slot
// to the millisecond (HeaderRetryAfterMs): the slot itself, rounded up, at
// least 1ms and at most the horizon. Whole seconds round the slot at random
// so that their expected value is the slot; the milliseconds need no
// rounding of that kind, and a client that reads them comes back at its
// slot, which is mostly well under a second.
func (p *retryPacer) hint(project string, now time.Time, est time.Duration, rate float64) (secs int, ms int64) {
	delay, gap := p.slots.Slot(project, now, est, rate)
	p.mu.Lock()
	jitter, round := p.rng.Float64(), p.rng.Float64()
	p.mu.Unlock()
	slot := pace.Spread(delay, gap, jitter)
	x := slot.Seconds()
	s := math.Floor(x)
	if round < x-s {
		s++
	}
	secs = int(min(max(s, minRetrySeconds), retryHorizon.Seconds()))
	ms = (slot + time.Millisecond - 1).Milliseconds()
	if retryHorizon > 0 {
		ms = min(ms, retryHorizon.Milliseconds())
	}
	return secs, max(ms, 1)
}
