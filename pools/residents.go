// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/fairshare-dev/fairshare/internal/clock"
)

// Errors of the residents pool besides ErrTooManyResidents.
var (
	// ErrUnknownObject: the object was never spawned or has been removed.
	ErrUnknownObject = errors.New("unknown object")
	// ErrNotResident: the object exists but is asleep (it was put to sleep
	// or named in an Eviction); wake it with Spawn.
	ErrNotResident = errors.New("object is not resident")
	// ErrObjectProject: Spawn named an existing object with another project.
	ErrObjectProject = errors.New("object belongs to another project")
)

// Residents is the residents pool: the fair-share rule with eviction instead
// of refusal. A resident (awake) object holds one permit; a sleeping object
// holds none but is remembered so that its project and counts stay exact. It
// is safe for concurrent use.
type Residents struct {
	clk       clock.Clock
	ns        clock.Nanos // clk as the ledger's int64 times
	name      string
	evictWait time.Duration
	// after starts Spawn's eviction wait; tests replace it with a timer they
	// fire themselves, so that the wait costs no real time.
	after func(time.Duration) (<-chan time.Time, func() bool)

	mu      sync.Mutex // guards the fields below
	l       ledger
	objects map[string]int32
	objs    []object
	free    []int32
	rp      []resProject  // in step with l.projects
	heap    []int32       // max-heap of projects with held > 0, keyed on held
	changed chan struct{} // closed (and replaced) when room may have appeared
	blocked int           // spawns waiting on changed
}

// object is one known object; awake objects are linked in their project's
// LRU list, most recently called at the head.
type object struct {
	name       string
	proj       int32
	prev, next int32
	awake      bool
	// pending: woken by SpawnPending or TrySpawnPending and not settled
	// yet: its caller has not loaded it, so it cannot be put to sleep,
	// and it is never named as a victim.
	pending bool
}

// resProject is the residents-only part of a project.
type resProject struct {
	head, tail int32 // LRU of awake objects, -1 when empty
	heapPos    int32 // -1 when not in the heap
	sleeping   int
	waiting    int       // spawns blocked in Spawn
	evicted    [3]uint64 // victims by reason: own-idlest, furthest-over-share, unconfirmed
}

func newResProject() resProject { return resProject{head: -1, tail: -1, heapPos: -1} }

// NewResidents returns an empty residents pool; a nil clk means the system
// clock.
func NewResidents(cfg Config, clk clock.Clock) (*Residents, error) {
	cfg, err := cfg.normalize()
	if err != nil {
		return nil, err
	}
	clk = clock.Or(clk)
	ns := clock.NewNanos(clk)
	return &Residents{
		clk:       clk,
		ns:        ns,
		name:      cfg.Name,
		evictWait: cfg.EvictWait,
		after:     realAfter,
		l:         newLedger(cfg, ns),
		objects:   map[string]int32{},
		changed:   make(chan struct{}),
	}, nil
}

// Eviction names the object the caller must put to sleep so that a spawn can
// proceed. The zero value means nothing is evicted.
type Eviction struct{ Project, Object, Reason string }

// Eviction reasons.
const (
	EvictOwnIdlest         = "own-idlest"
	EvictFurthestOverShare = "furthest-over-share"
	// EvictUnconfirmed: the caller put the object to sleep without its
	// owner, which had left evictions unconfirmed (Drop, Dropped).
	EvictUnconfirmed = "unconfirmed"
)

var evictReasons = [3]string{EvictOwnIdlest, EvictFurthestOverShare, EvictUnconfirmed}

// reasonIndex is reason's place in evictReasons, -1 if none.
func reasonIndex(reason string) int {
	for i, r := range evictReasons {
		if r == reason {
			return i
		}
	}
	return -1
}

// ResidentsSnapshot is a Snapshot with the residents' own counters.
type ResidentsSnapshot struct {
	Snapshot
	// Sleeping counts sleeping objects per project (projects with none are
	// left out).
	Sleeping map[string]int
	// Evictions counts evicted objects: victim project -> reason -> count.
	Evictions map[string]map[string]uint64
}

// Spawn makes object of project resident: a new object, or a sleeping one
// woken by a call. When the rule says it cannot fit, Spawn evicts one object
// instead of refusing (see the package documentation for who is evicted) and
// returns it: the accounting already counts the victim as asleep and the
// caller must put it to sleep. When no victim is eligible, Spawn waits up to
// the eviction wait (1s by default) for room or a victim, honouring ctx, and
// then refuses with a *Refusal that matches ErrTooManyResidents. Spawning an
// object that is already resident only records a call.
func (r *Residents) Spawn(ctx context.Context, project, object string) (Eviction, error) {
	return r.spawn(ctx, project, object, false)
}

// SpawnPending is Spawn for a caller that has more to do before the object
// is loaded (wait for an eviction's confirmation, answer its client): the
// object holds its permit but is pending, never named as a victim, until
// Settle, Sleep, Remove or Unevict. An object still being loaded has
// nothing to put to sleep: evicting it would hand its permit, or the one
// its own eviction is waiting on, to a third spawn while both objects stay
// in memory.
func (r *Residents) SpawnPending(ctx context.Context, project, object string) (Eviction, error) {
	return r.spawn(ctx, project, object, true)
}

func (r *Residents) spawn(ctx context.Context, project, object string, pending bool) (Eviction, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var expired <-chan time.Time
	var stop func() bool
	waiting := int32(-1)
	defer func() {
		if stop != nil {
			stop()
		}
		if waiting >= 0 {
			r.rp[waiting].waiting--
			r.blocked--
		}
	}()
	for {
		ev, done, err := r.spawnLocked(project, object, pending)
		if done {
			return ev, err
		}
		idx := r.l.index[project] // spawnLocked registered it
		if expired == nil {
			expired, stop = r.after(r.evictWait)
			waiting = idx
			r.rp[idx].waiting++
			r.blocked++
		}
		ch := r.changed
		r.mu.Unlock()
		var cerr error
		select {
		case <-ch:
		case <-ctx.Done():
			cerr = ctx.Err()
		case <-expired:
			cerr = errTimeout
		}
		r.mu.Lock()
		r.l.advance(r.ns.Now())
		if cerr != nil {
			// One last look: room may have appeared together with the end.
			if ev, done, err := r.spawnLocked(project, object, pending); done {
				return ev, err
			}
			rf := r.l.refusal(r.l.index[project])
			rf.residents = true
			rf.Reason = "no object could be evicted"
			if cerr == errTimeout {
				return Eviction{}, rf
			}
			return Eviction{}, fmt.Errorf("%w: %w", rf, cerr)
		}
	}
}

var errTimeout = errors.New("eviction wait over")

// realAfter is the eviction wait's timer outside tests.
func realAfter(d time.Duration) (<-chan time.Time, func() bool) {
	t := time.NewTimer(d)
	return t.C, t.Stop
}

// TrySpawn is Spawn without the wait: done is false, and nothing changed
// but the project's being seen, when the pool has neither room nor an
// object to evict now.
func (r *Residents) TrySpawn(project, object string) (ev Eviction, done bool, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.spawnLocked(project, object, false)
}

// TrySpawnPending is TrySpawn for a caller that settles the object later
// (SpawnPending).
func (r *Residents) TrySpawnPending(project, object string) (ev Eviction, done bool, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.spawnLocked(project, object, true)
}

// Settle ends the pending state of a resident object woken by SpawnPending
// or TrySpawnPending: it may be named as a victim from now on.
func (r *Residents) Settle(object string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	oi, err := r.residentLocked(object, "settling")
	if err != nil {
		return err
	}
	o := &r.objs[oi]
	if o.pending {
		o.pending = false
		// A spawn waiting for a victim may find this one now.
		r.notifyLocked()
	}
	return nil
}

// spawnLocked tries once. done is false when the spawn must wait. pending:
// the object woken is pending (SpawnPending).
func (r *Residents) spawnLocked(project, name string, pending bool) (ev Eviction, done bool, err error) {
	oi, exists := r.objects[name]
	if exists {
		o := &r.objs[oi]
		if r.l.projects[o.proj].name != project {
			return Eviction{}, true, fmt.Errorf("residents %s: spawning %q for %q: %w", r.name, name, project, ErrObjectProject)
		}
		if o.awake {
			r.l.seen(o.proj)
			r.toFrontLocked(oi)
			return Eviction{}, true, nil
		}
	}
	idx := r.l.lookup(project)
	r.growLocked()
	r.l.seen(idx)
	if !r.l.admits(idx) {
		victim, reason := r.victimLocked(idx)
		if victim < 0 {
			return Eviction{}, false, nil
		}
		v := &r.objs[victim]
		vp := v.proj
		ev = Eviction{Project: r.l.projects[vp].name, Object: v.name, Reason: evictReasons[reason]}
		r.rp[vp].evicted[reason]++
		r.sleepLocked(victim)
	}
	if !exists {
		oi = r.newObjectLocked(name, idx)
	} else {
		r.rp[idx].sleeping--
	}
	r.wakeLocked(oi)
	r.objs[oi].pending = pending
	return ev, true, nil
}

// victimLocked picks the object to evict for a spawn by project idx that the
// rule cannot fit: the project's own idlest object when it is at or over its
// share, else the idlest object of the project holding the most among those
// at or over their share. Pending objects are passed over. It returns -1
// when nobody is eligible.
func (r *Residents) victimLocked(idx int32) (obj int32, reason int) {
	if r.l.projects[idx].held >= r.l.share {
		return r.idlestLocked(idx), 0
	}
	if len(r.heap) == 0 {
		return -1, 0
	}
	top := r.heap[0]
	if top == idx || r.l.projects[top].held < r.l.share {
		return -1, 0
	}
	if v := r.idlestLocked(top); v >= 0 {
		return v, 1
	}
	// Every resident of the project furthest over its share is pending
	// (a rare moment: each is a spawn under way): the next furthest over
	// it that has one to give, found by a walk of the heap.
	best, bestHeld := int32(-1), 0
	for _, p := range r.heap[1:] {
		held := r.l.projects[p].held
		if p == idx || held < r.l.share || held <= bestHeld {
			continue
		}
		if v := r.idlestLocked(p); v >= 0 {
			best, bestHeld = v, held
		}
	}
	return best, 1
}

// idlestLocked is project idx's least recently called resident object that
// is not pending, -1 if none. Pending objects were woken last, near the
// head, and there are no more of them than spawns under way.
func (r *Residents) idlestLocked(idx int32) int32 {
	for oi := r.rp[idx].tail; oi >= 0; oi = r.objs[oi].prev {
		if !r.objs[oi].pending {
			return oi
		}
	}
	return -1
}

func (r *Residents) growLocked() {
	for len(r.rp) < len(r.l.projects) {
		r.rp = append(r.rp, newResProject())
	}
}

func (r *Residents) newObjectLocked(name string, proj int32) int32 {
	var oi int32
	if n := len(r.free); n > 0 {
		oi = r.free[n-1]
		r.free = r.free[:n-1]
	} else {
		oi = int32(len(r.objs))
		r.objs = append(r.objs, object{})
	}
	r.objs[oi] = object{name: name, proj: proj, prev: -1, next: -1}
	r.objects[name] = oi
	return oi
}

// wakeLocked makes a sleeping (or new) object resident; the rule was checked.
func (r *Residents) wakeLocked(oi int32) {
	o := &r.objs[oi]
	o.awake = true
	r.l.take(o.proj)
	r.pushFrontLocked(oi)
	r.heapFixLocked(o.proj)
}

// sleepLocked frees a resident object's permit.
func (r *Residents) sleepLocked(oi int32) {
	o := &r.objs[oi]
	r.unlinkLocked(oi)
	o.awake, o.pending = false, false
	r.l.give(o.proj)
	r.rp[o.proj].sleeping++
	r.heapFixLocked(o.proj)
	r.notifyLocked()
}

// notifyLocked wakes blocked spawns; with none it costs nothing (no channel
// is allocated on the eviction path).
func (r *Residents) notifyLocked() {
	if r.blocked == 0 {
		return
	}
	close(r.changed)
	r.changed = make(chan struct{})
}

func (r *Residents) pushFrontLocked(oi int32) {
	o := &r.objs[oi]
	p := &r.rp[o.proj]
	o.prev, o.next = -1, p.head
	if p.head >= 0 {
		r.objs[p.head].prev = oi
	} else {
		p.tail = oi
	}
	p.head = oi
}

func (r *Residents) pushBackLocked(oi int32) {
	o := &r.objs[oi]
	p := &r.rp[o.proj]
	o.prev, o.next = p.tail, -1
	if p.tail >= 0 {
		r.objs[p.tail].next = oi
	} else {
		p.head = oi
	}
	p.tail = oi
}

func (r *Residents) unlinkLocked(oi int32) {
	o := &r.objs[oi]
	p := &r.rp[o.proj]
	if o.prev >= 0 {
		r.objs[o.prev].next = o.next
	} else {
		p.head = o.next
	}
	if o.next >= 0 {
		r.objs[o.next].prev = o.prev
	} else {
		p.tail = o.prev
	}
	o.prev, o.next = -1, -1
}

func (r *Residents) toFrontLocked(oi int32) {
	if r.rp[r.objs[oi].proj].head == oi {
		return
	}
	r.unlinkLocked(oi)
	r.pushFrontLocked(oi)
}

// Touch records a call on a resident object: it becomes its project's most
// recently used. It does not read the clock.
func (r *Residents) Touch(object string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	oi, err := r.residentLocked(object, "touching")
	if err != nil {
		return err
	}
	r.l.seen(r.objs[oi].proj)
	r.toFrontLocked(oi)
	return nil
}

// Sleep records that a resident object went to sleep: its permit is freed.
func (r *Residents) Sleep(object string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	oi, err := r.residentLocked(object, "sleeping")
	if err != nil {
		return err
	}
	r.sleepLocked(oi)
	return nil
}

// Remove forgets an object entirely, resident or asleep.
func (r *Residents) Remove(name string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	oi, ok := r.objects[name]
	if !ok {
		return fmt.Errorf("residents %s: removing %q: %w", r.name, name, ErrUnknownObject)
	}
	r.removeLocked(oi)
	return nil
}

func (r *Residents) removeLocked(oi int32) {
	o := &r.objs[oi]
	if o.awake {
		r.sleepLocked(oi)
	}
	r.rp[o.proj].sleeping--
	delete(r.objects, o.name)
	*o = object{prev: -1, next: -1}
	r.free = append(r.free, oi)
}

// Unevict undoes a Spawn of object that evicted ev: object leaves residence
// (it is forgotten when forget, else it sleeps) and ev.Object is resident
// again, as its project's idlest. Both happen under one lock, so no other
// spawn can take the permit in between and in_use does not change.
//
// The caller uses it when ev.Object's owner was never asked to put it to
// sleep (the spawn could not wait): the victim is as idle as it was, and
// is the next one named. When the owner was asked and did not confirm, use
// Unconfirmed. The victim's eviction is no longer counted. When the victim
// is no longer an asleep object of ev.Project (it was woken or removed
// meanwhile), only object's residence is undone and ErrNotResident or
// ErrUnknownObject is returned with it.
func (r *Residents) Unevict(ev Eviction, object string, forget bool) error {
	return r.unevict(ev, object, forget, false)
}

// Unconfirmed is Unevict for a victim whose owner was asked to put it to
// sleep and did not confirm: as far as anyone knows it is still in memory,
// so it is counted resident again, but as its project's most recently
// called object. Put back as the idlest, it was named again by the next
// spawn, and an owner that never confirms kept its project over its share
// for good, every other spawn refused; now the project's other objects are
// named first, and the caller can tell whether their owner confirms (and
// Drop what it leaves unconfirmed).
func (r *Residents) Unconfirmed(ev Eviction, object string, forget bool) error {
	return r.unevict(ev, object, forget, true)
}

func (r *Residents) unevict(ev Eviction, object string, forget, recent bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	oi, ok := r.objects[object]
	if !ok {
		return fmt.Errorf("residents %s: unevicting for %q: %w", r.name, object, ErrUnknownObject)
	}
	if !r.objs[oi].awake {
		return fmt.Errorf("residents %s: unevicting for %q: %w", r.name, object, ErrNotResident)
	}
	if forget {
		r.removeLocked(oi)
	} else {
		r.sleepLocked(oi)
	}
	vi, err := r.evictedLocked(ev, "unevicting")
	if err != nil {
		return err
	}
	v := &r.objs[vi]
	rp := &r.rp[v.proj]
	rp.sleeping--
	if i := reasonIndex(ev.Reason); i >= 0 && rp.evicted[i] > 0 {
		rp.evicted[i]--
	}
	// Its permit is held again, not admitted again: the undone spawn
	// counted the one admission.
	v.awake = true
	r.l.hold(v.proj)
	if recent {
		r.pushFrontLocked(vi)
	} else {
		// It was chosen for being the least recently called, and
		// nothing has called it since.
		r.pushBackLocked(vi)
	}
	r.heapFixLocked(v.proj)
	return nil
}

// evictedLocked is the object ev named, if it is still an asleep object of
// ev.Project.
func (r *Residents) evictedLocked(ev Eviction, doing string) (int32, error) {
	vi, ok := r.objects[ev.Object]
	switch {
	case !ok:
		return -1, fmt.Errorf("residents %s: %s %q: %w", r.name, doing, ev.Object, ErrUnknownObject)
	case r.objs[vi].awake || r.l.projects[r.objs[vi].proj].name != ev.Project:
		return -1, fmt.Errorf("residents %s: %s %q: %w", r.name, doing, ev.Object, ErrNotResident)
	}
	return vi, nil
}

// residentLocked is the index of object, an awake object of the pool; doing
// names the caller's act in the error.
func (r *Residents) residentLocked(object, doing string) (int32, error) {
	oi, ok := r.objects[object]
	switch {
	case !ok:
		return -1, fmt.Errorf("residents %s: %s %q: %w", r.name, doing, object, ErrUnknownObject)
	case !r.objs[oi].awake:
		return -1, fmt.Errorf("residents %s: %s %q: %w", r.name, doing, object, ErrNotResident)
	}
	return oi, nil
}

// Drop puts a resident object to sleep without its owner, and counts it as
// an eviction for EvictUnconfirmed: the caller asked the owner to put its
// objects to sleep, and the owner left the evictions unconfirmed. Its
// permit is free at once.
func (r *Residents) Drop(object string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	oi, err := r.residentLocked(object, "dropping")
	if err != nil {
		return err
	}
	r.rp[r.objs[oi].proj].evicted[reasonIndex(EvictUnconfirmed)]++
	r.sleepLocked(oi)
	return nil
}

// Dropped recounts ev, whose victim the pool has counted asleep since the
// Spawn that named it, as an eviction for EvictUnconfirmed: its owner did
// not confirm, and the caller keeps it asleep all the same (see Drop).
// Nothing else changes.
func (r *Residents) Dropped(ev Eviction) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	vi, err := r.evictedLocked(ev, "dropping")
	if err != nil {
		return err
	}
	rp := &r.rp[r.objs[vi].proj]
	if i := reasonIndex(ev.Reason); i >= 0 && rp.evicted[i] > 0 {
		rp.evicted[i]--
	}
	rp.evicted[reasonIndex(EvictUnconfirmed)]++
	return nil
}

// Recompute settles the active set and the share at the clock's now; the
// owner calls it once per second.
func (r *Residents) Recompute() { r.recompute(r.clk.Now()) }

func (r *Residents) recompute(now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.l.recompute(r.ns.Of(now),
		func(idx int32) bool { return r.rp[idx].waiting > 0 },
		func(idx int32) bool { return r.rp[idx].sleeping > 0 || r.rp[idx].waiting > 0 },
		func(idx int32) { r.rp[idx] = newResProject() })
	r.notifyLocked()
}

// Snapshot returns the residents pool's state.
func (r *Residents) Snapshot() ResidentsSnapshot {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.clk.Now()
	s := ResidentsSnapshot{
		Snapshot:  r.l.snapshot(now, r.ns.Of(now)),
		Sleeping:  map[string]int{},
		Evictions: map[string]map[string]uint64{},
	}
	for name, idx := range r.l.index {
		rp := &r.rp[idx]
		if rp.sleeping > 0 {
			s.Sleeping[name] = rp.sleeping
		}
		for i, n := range rp.evicted {
			if n == 0 {
				continue
			}
			if s.Evictions[name] == nil {
				s.Evictions[name] = map[string]uint64{}
			}
			s.Evictions[name][evictReasons[i]] = n
		}
	}
	return s
}

// The heap orders projects by held, largest first, so that "the project
// furthest over its share" is the root: every active project has the same
// share, so the largest held is the furthest over it.

func (r *Residents) heapFixLocked(idx int32) {
	p := &r.rp[idx]
	held := r.l.projects[idx].held
	switch {
	case p.heapPos < 0 && held > 0:
		p.heapPos = int32(len(r.heap))
		r.heap = append(r.heap, idx)
		r.heapUpLocked(int(p.heapPos))
	case p.heapPos >= 0 && held == 0:
		i := int(p.heapPos)
		last := len(r.heap) - 1
		r.heapSwapLocked(i, last)
		r.heap = r.heap[:last]
		p.heapPos = -1
		if i < last {
			r.heapDownLocked(i)
			r.heapUpLocked(i)
		}
	case p.heapPos >= 0:
		i := int(p.heapPos)
		r.heapDownLocked(i)
		r.heapUpLocked(i)
	}
}

func (r *Residents) heapLessLocked(i, j int) bool {
	return r.l.projects[r.heap[i]].held > r.l.projects[r.heap[j]].held
}

func (r *Residents) heapSwapLocked(i, j int) {
	r.heap[i], r.heap[j] = r.heap[j], r.heap[i]
	r.rp[r.heap[i]].heapPos = int32(i)
	r.rp[r.heap[j]].heapPos = int32(j)
}

func (r *Residents) heapUpLocked(i int) {
	for i > 0 {
		parent := (i - 1) / 2
		if !r.heapLessLocked(i, parent) {
			return
		}
		r.heapSwapLocked(i, parent)
		i = parent
	}
}

func (r *Residents) heapDownLocked(i int) {
	n := len(r.heap)
	for {
		best := i
		if l := 2*i + 1; l < n && r.heapLessLocked(l, best) {
			best = l
		}
		if rr := 2*i + 2; rr < n && r.heapLessLocked(rr, best) {
			best = rr
		}
		if best == i {
			return
		}
		r.heapSwapLocked(i, best)
		i = best
	}
}
