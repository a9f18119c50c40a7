// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/fairshare-dev/fairshare/internal/clock"
)

// Pool is one permit pool under the fair-share rule (requests, connections,
// flights or any configured pool). It is safe for concurrent use.
type Pool struct {
	clk    clock.Clock
	ns     clock.Nanos // clk as the ledger's int64 times
	name   string
	window time.Duration

	mu      sync.Mutex // guards the fields below
	l       ledger
	slots   []slot  // one per permit ever outstanding at once
	free    []int32 // free slots
	queues  []waitQueue
	waiting []int32 // projects with waiters (round-robin order)
	cursor  int     // next position in waiting to serve
}

// slot backs one outstanding permit; gen changes on every release so that a
// stale Permit value is recognized.
type slot struct {
	gen  uint32
	proj int32
	live bool
}

// waitQueue is one project's FIFO of blocked Acquire calls. It is indexed by
// project slot, in step with ledger.projects.
type waitQueue struct {
	ws  []*waiter
	pos int32 // position in Pool.waiting, -1 when not waiting
}

type waiter struct {
	ch      chan struct{} // closed when granted
	pm      Permit
	granted bool
}

// New returns an empty pool; a nil clk means the system clock.
func New(cfg Config, clk clock.Clock) (*Pool, error) {
	cfg, err := cfg.normalize()
	if err != nil {
		return nil, err
	}
	clk = clock.Or(clk)
	ns := clock.NewNanos(clk)
	return &Pool{
		clk:    clk,
		ns:     ns,
		name:   cfg.Name,
		window: cfg.Window,
		l:      newLedger(cfg, ns),
	}, nil
}

// Name returns the pool's name.
func (p *Pool) Name() string { return p.name }

// Permit is one held permit: a comparable value that must be released once
// with Release. The zero Permit is not valid.
type Permit struct {
	pool    *Pool
	project string
	slot    int32
	gen     uint32
}

// Project returns the project that holds the permit.
func (pm Permit) Project() string { return pm.project }

// Valid reports whether the permit was issued by a pool. A released permit
// stays Valid; releasing it again returns ErrDoubleRelease.
func (pm Permit) Valid() bool { return pm.pool != nil }

// TryAcquire takes a permit for project or refuses at once with a *Refusal
// (errors.Is(err, ErrRefused)). It does not read the clock: the ask is stamped
// with the pool's coarse time, advanced by Recompute.
func (p *Pool) TryAcquire(project string) (Permit, error) {
	var rf Refusal
	if pm, ok := p.TryAcquireInto(project, &rf); ok {
		return pm, nil
	}
	r := rf // a refusal the caller may keep is its own allocation
	return Permit{}, &r
}

// Acquire takes a permit, waiting until a release (or a recompute or resize)
// makes room under the rule, or until ctx is done. Waiters of one project are
// served in FIFO order. When ctx ends first, the error matches both ctx.Err()
// and ErrRefused (errors.As gives the *Refusal with its retry estimate),
// unless the rule admits the project then (a last look, with no other waiter
// of the project left before it): a permit granted while ctx was ending is
// returned with a nil error.
func (p *Pool) Acquire(ctx context.Context, project string) (Permit, error) {
	p.mu.Lock()
	idx := p.l.lookup(project)
	p.l.seen(idx)
	p.growQueuesLocked()
	q := &p.queues[idx]
	if len(q.ws) == 0 && p.l.admits(idx) {
		pm := p.grantLocked(idx)
		p.mu.Unlock()
		return pm, nil
	}
	if p.l.dry(idx) {
		var rf Refusal
		p.l.fillWould(idx, &rf)
		pm := p.grantLocked(idx)
		p.mu.Unlock()
		return pm, nil
	}
	if err := ctx.Err(); err != nil {
		r := p.l.refusal(idx)
		p.mu.Unlock()
		return Permit{}, fmt.Errorf("%w: %w", r, err)
	}
	w := &waiter{ch: make(chan struct{})}
	q.ws = append(q.ws, w)
	if q.pos < 0 {
		q.pos = int32(len(p.waiting))
		p.waiting = append(p.waiting, idx)
	}
	p.mu.Unlock()

	select {
	case <-w.ch:
		return w.pm, nil
	case <-ctx.Done():
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if w.granted {
		return w.pm, nil
	}
	p.l.advance(p.ns.Now())
	q = &p.queues[idx]
	if i := slices.Index(q.ws, w); i >= 0 {
		q.ws = slices.Delete(q.ws, i, i+1)
	}
	if len(q.ws) == 0 {
		p.unwaitLocked(idx)
		if p.l.admits(idx) {
			return p.grantLocked(idx), nil
		}
	}
	r := p.l.refusal(idx)
	return Permit{}, fmt.Errorf("%w: %w", r, ctx.Err())
}

// growQueuesLocked keeps queues as long as the project table.
func (p *Pool) growQueuesLocked() {
	for len(p.queues) < len(p.l.projects) {
		p.queues = append(p.queues, waitQueue{pos: -1})
	}
}

// grantLocked takes a permit for project idx; the caller checked the rule.
func (p *Pool) grantLocked(idx int32) Permit {
	p.l.take(idx)
	var s int32
	if n := len(p.free); n > 0 {
		s = p.free[n-1]
		p.free = p.free[:n-1]
	} else {
		s = int32(len(p.slots))
		p.slots = append(p.slots, slot{})
	}
	sl := &p.slots[s]
	sl.live = true
	sl.proj = idx
	return Permit{pool: p, project: p.l.projects[idx].name, slot: s, gen: sl.gen}
}

// Release gives a permit back and wakes the waiters it makes room for.
// Releasing a permit twice, or one from another pool, returns
// ErrDoubleRelease and changes nothing.
func (p *Pool) Release(pm Permit) error {
	if pm.pool != p {
		return fmt.Errorf("pool %s: releasing a permit of project %q not issued here: %w", p.name, pm.project, ErrDoubleRelease)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if int(pm.slot) >= len(p.slots) || p.slots[pm.slot].gen != pm.gen || !p.slots[pm.slot].live {
		return fmt.Errorf("pool %s: project %q: %w", p.name, pm.project, ErrDoubleRelease)
	}
	sl := &p.slots[pm.slot]
	sl.live = false
	sl.gen++
	p.free = append(p.free, pm.slot)
	p.l.give(sl.proj)
	if len(p.waiting) > 0 {
		p.wakeLocked()
	}
	return nil
}

// wakeLocked grants permits to the heads of the waiting projects' queues,
// round-robin across projects, until a full pass admits nobody.
func (p *Pool) wakeLocked() {
	for len(p.waiting) > 0 && p.l.inUse < p.l.size {
		progress := false
		for n := len(p.waiting); n > 0 && len(p.waiting) > 0; n-- {
			if p.cursor >= len(p.waiting) {
				p.cursor = 0
			}
			idx := p.waiting[p.cursor]
			if !p.l.admits(idx) {
				p.cursor++
				continue
			}
			q := &p.queues[idx]
			w := q.ws[0]
			q.ws[0] = nil
			q.ws = q.ws[1:]
			w.pm = p.grantLocked(idx)
			w.granted = true
			close(w.ch)
			progress = true
			if len(q.ws) == 0 {
				p.unwaitLocked(idx) // the cursor now points at the next project
			} else {
				p.cursor++
			}
		}
		if !progress {
			return
		}
	}
}

// unwaitLocked removes project idx from the waiting list.
func (p *Pool) unwaitLocked(idx int32) {
	q := &p.queues[idx]
	if q.pos < 0 {
		return
	}
	i := int(q.pos)
	p.waiting = slices.Delete(p.waiting, i, i+1)
	for j := i; j < len(p.waiting); j++ {
		p.queues[p.waiting[j]].pos = int32(j)
	}
	q.pos = -1
	q.ws = nil
	if p.cursor > i {
		p.cursor--
	}
}

// Resize changes POOL and FLOOR (floor 0 = DefaultFloor(size)). Permits
// already held stay held; when the pool shrinks under its in_use, nobody is
// admitted until releases bring in_use back under the new limits.
//
// Size 0 with floor 0 admits nobody: a fleet node whose allotment is zero
// (package fleet).
func (p *Pool) Resize(size, floor int) error {
	cfg := Config{Name: p.name}
	if size != 0 || floor != 0 {
		var err error
		if cfg, err = (Config{Name: p.name, Size: size, Floor: floor}).normalize(); err != nil {
			return fmt.Errorf("resizing: %w", err)
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.l.resize(cfg.Size, cfg.Floor)
	p.wakeLocked()
	return nil
}

// SetCaps replaces the pool's per-project caps (nil: none). A project
// with a cap is admitted while it holds fewer than its cap and
// in_use < POOL, in place of the share and the floor. While caps is not
// nil, the projects it does not name have the cap others, or keep the rule
// when others < 0. A cap below what a project holds refuses it until releases bring it
// under; nothing held is taken back. The caps outlive the projects' state.
// Package fleet sets them from the fleet's allotment.
func (p *Pool) SetCaps(caps map[string]int, others int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if caps != nil {
		caps = maps.Clone(caps)
	}
	p.l.setCaps(caps, others)
	p.wakeLocked()
}

// SetDryRun puts the pool (project "") or one project in dry-run (on) or
// back under enforcement: in dry-run an ask the rule refuses is admitted
// and counted in WouldRefuse. A project's setting is kept while the pool
// forgets its state. Waiters already blocked in Acquire are admitted at
// once as their project goes into dry-run, in their order, counted as the
// rule has them: a later ask, admitted at once, would otherwise overtake
// them.
func (p *Pool) SetDryRun(project string, on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.l.setDryRun(project, on)
	if on {
		p.admitDryWaitersLocked()
	}
}

// admitDryWaitersLocked grants every waiter of a project in dry-run, each
// counted in WouldRefuse if the rule refuses it.
func (p *Pool) admitDryWaitersLocked() {
	for i := 0; i < len(p.waiting); {
		idx := p.waiting[i]
		if !p.l.dry(idx) {
			i++
			continue
		}
		for _, w := range p.queues[idx].ws {
			if !p.l.admits(idx) {
				var rf Refusal
				p.l.fillWould(idx, &rf)
			}
			w.pm = p.grantLocked(idx)
			w.granted = true
			close(w.ch)
		}
		p.unwaitLocked(idx) // p.waiting[i] is the next project now
	}
}

// Recompute settles the active set and the share at the clock's now; the
// owner calls it once per second. See recompute for its cost.
func (p *Pool) Recompute() { p.recompute(p.clk.Now()) }

func (p *Pool) recompute(now time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.l.recompute(p.ns.Of(now), p.hasWaitersLocked, nil, p.forgottenLocked)
	p.wakeLocked()
}

func (p *Pool) hasWaitersLocked(idx int32) bool {
	return int(idx) < len(p.queues) && len(p.queues[idx].ws) > 0
}

func (p *Pool) forgottenLocked(idx int32) {
	if int(idx) < len(p.queues) {
		p.queues[idx] = waitQueue{pos: -1}
	}
}

// Snapshot returns the pool's state for metrics and status.
func (p *Pool) Snapshot() Snapshot {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := p.clk.Now()
	return p.l.snapshot(now, p.ns.Of(now))
}

// Snapshot is a point-in-time view of a pool.
type Snapshot struct {
	Name                              string
	Size, Floor, InUse, Active, Share int
	// Admitted and Refused count the pool's asks since it was built; unlike
	// the per-project counts they survive projects being forgotten, so they
	// only grow. They equal the sums over Projects plus Forgotten's, in
	// every snapshot. WouldRefuse counts the asks dry-run admitted that the
	// rule refused (they are in Admitted too), summing the same way.
	Admitted, Refused, WouldRefuse uint64
	// DryRun reports the pool in dry-run (SetDryRun).
	DryRun bool
	// Projects is sorted by project; it lists every project with state
	// (active ones and idle ones not yet forgotten).
	Projects []ProjectStat
	// Forgotten sums the projects whose state was dropped after idling.
	Forgotten ForgottenStat
}

// ForgottenStat is what the projects a pool forgot had been counted for.
type ForgottenStat struct {
	Projects                       uint64 // projects forgotten (a project forgotten twice counts twice)
	Admitted, Refused, WouldRefuse uint64
}

// ProjectStat is one project's view in a Snapshot.
type ProjectStat struct {
	Project string
	// Held is the number of permits (resident objects) the project holds.
	Held int
	// Admitted and Refused count asks since the project's state was created;
	// WouldRefuse the admitted ones dry-run let through.
	Admitted, Refused, WouldRefuse uint64
	// DryRun reports the project in dry-run (SetDryRun).
	DryRun bool
	// LastSeen is the last time the project held or asked, at the
	// resolution of the recompute period.
	LastSeen time.Time
	// Active reports membership of the active set.
	Active bool
}

func sortStats(s []ProjectStat) {
	slices.SortFunc(s, func(a, b ProjectStat) int { return strings.Compare(a.Project, b.Project) })
}
