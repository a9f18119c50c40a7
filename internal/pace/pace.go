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

// sweepMin is the smallest map size at which stale backlogs are swept.
const sweepMin = 1024

// Pacer hands out return slots per project. It is safe for concurrent use.
type Pacer struct {
	horizon time.Duration

	mu      sync.Mutex         // guards the fields below
	queue   map[string]backlog // per project: refused clients still due back
	sweepAt int                // len(queue) at which stale backlogs are dropped
}

// backlog is a project's refused clients that were given a slot still
// ahead: n of them as of at, served at one per gap; none left after until.
type backlog struct {
	n     float64
	at    time.Time
	until time.Time
}

// New returns a Pacer whose slots are never more than horizon after the
// refusal; 0 means no bound.
func New(horizon time.Duration) *Pacer {
	return &Pacer{horizon: horizon, queue: map[string]backlog{}, sweepAt: sweepMin}
}

// Slot gives a refusal of project at now its return slot. est is the
// refusal's own estimate (when the first waiting client can get in), rate
// how many of the project's clients can be admitted per second. The slot is
// est plus one gap (1/rate) for each
// client refused before and still due back: the backlog is kept as a count
// that drains at the rate, not as a time, so a rate that changes moves
// every later slot at once and an early estimate that was too slow is not
// carried forward. It returns the delay from now to the slot (at most the
// horizon) and the gap, which callers use to size their jitter.
//
// An unknown rate (0 or less: no release measured yet, as in a pool's first
// second) gives the estimate alone, with a gap as long as the estimate, and
// no place in the backlog: assuming a
// rate (one a second was the old guess) told a busy pool's first crowd to
// come back as many seconds apart as it had clients, where coming back
// together once, when the rate is known, costs one more refusal each.
func (p *Pacer) Slot(project string, now time.Time, est time.Duration, rate float64) (delay, gap time.Duration) {
	est = max(est, 0)
	if rate <= 0 {
		// The estimate is then all there is, and the jitter is as wide
		// as it: a crowd told a second returns over [0.5s, 1.5s), one
		// told a pool's first few milliseconds (package pools'
		// back-off) over as few, where a second's width would bring half
		// of it back at once.
		est = min(est, p.horizonOr(est))
		return est, min(max(est, minGap), maxGap)
	}
	// Clamped as a float: at a rate under 1e-10/s the Duration wraps.
	if g := float64(time.Second) / rate; g >= float64(maxGap) {
		gap = maxGap
	} else {
		gap = max(time.Duration(g), minGap)
	}

	p.mu.Lock()
	defer p.mu.Unlock()
	b := p.queue[project]
	if b.n > 0 {
		b.n = max(0, b.n-float64(now.Sub(b.at))/float64(gap))
	}
	delay = est + time.Duration(b.n*float64(gap))
	if p.horizon > 0 && delay > p.horizon {
		delay = p.horizon
	} else {
		b.n++
	}
	b.at = now
	b.until = now.Add(time.Duration(b.n * float64(gap)))
	p.queue[project] = b
	if len(p.queue) >= p.sweepAt {
		p.sweepLocked(now)
	}
	return delay, gap
}

// Spread places a slot's delay at random within its gap, centred on the
// slot: delay - gap/2 + u*gap for u uniform in [0, 1), never below zero.
// Slots are already one gap apart; centring rather than adding the jitter
// keeps the first client in line within one and a half gaps of its slot.
func Spread(delay, gap time.Duration, u float64) time.Duration {
	return max(0, delay-gap/2+time.Duration(u*float64(gap)))
}

// horizonOr returns the horizon, or d when there is none.
func (p *Pacer) horizonOr(d time.Duration) time.Duration {
	if p.horizon > 0 {
		return p.horizon
	}
	return d
}

// Len returns how many projects have a backlog (for tests and metrics).
func (p *Pacer) Len() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.queue)
}

// sweepLocked drops the backlogs already drained: those projects have no
// refused client still due back.
func (p *Pacer) sweepLocked(now time.Time) {
	for k, b := range p.queue {
		if !b.until.After(now) {
			delete(p.queue, k)
		}
	}
	p.sweepAt = max(sweepMin, 2*len(p.queue))
}
