// SPDX-License-Identifier: Apache-2.0

package permitd

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/fairshare-dev/fairshare/events"
	"github.com/fairshare-dev/fairshare/internal/pace"
	"github.com/fairshare-dev/fairshare/internal/project"
	"github.com/fairshare-dev/fairshare/pools"
)

// Codes beyond those in wire.go that only the operations produce.
const (
	CodeNotResident = "NOT_RESIDENT"
	CodeInternal    = "INTERNAL"
)

func (s *Server) acquire(ss *session, rq *request, resp *response) bool {
	if rq.Pool == "" {
		resp.Code, resp.Error = CodeMissingField, "acquire needs pool"
		return true
	}
	p := s.pools[rq.Pool]
	if p == nil {
		resp.Code, resp.Error = CodeUnknownPool, "unknown pool "+quote(rq.Pool)
		return true
	}
	if rq.Project == "" {
		resp.Code, resp.Error = CodeMissingField, "acquire needs project"
		return true
	}
	if err := project.Validate(rq.Project); err != nil {
		resp.Code, resp.Error = CodeBadRequest, err.Error()
		return true
	}
	var rf pools.Refusal
	try := p.TryAcquireInto
	if rq.WaitMS > 0 {
		// One ask, one refusal at most: the wait's end counts it.
		try = p.TryAcquireFirst
	}
	if s.tryGrant(ss, p, try, rq, &rf, resp) {
		return true
	}
	if rq.WaitMS <= 0 {
		r := rf // the refusal the answer keeps is its own allocation, on this path only
		s.refuse(ss, resp, &r)
		return true
	}
	if why := s.startWait(ss, waitAcquire); why != "" {
		// The ask ends here: its one try that counts (a permit, if one
		// came free meanwhile; else the pool's refusal, counted).
		if s.tryGrant(ss, p, p.TryAcquireInto, rq, &rf, resp) {
			return true
		}
		s.publish(events.Event{Kind: events.KindRefused, Pool: rq.Pool, Project: rq.Project,
			Reason: events.ReasonWaiting, Remote: peerText(ss), Detail: why})
		resp.Code, resp.Error = CodeTooManyWaiting, why
		return true
	}
	// Capped before the multiplication, which would overflow past about
	// 292 years of milliseconds into a negative wait.
	wait := time.Duration(min(rq.WaitMS, MaxWaitMS)) * time.Millisecond
	s.wg.Add(1)
	go func(rq request) {
		defer s.wg.Done()
		defer s.endWait(ss, waitAcquire)
		ctx, cancel := context.WithTimeout(ss.ctx, wait)
		defer cancel()
		resp := response{ID: rq.ID}
		// Acquire's end is a last look: a permit, or a refusal (the
		// ask's one) with the pool's numbers and estimate then.
		pm, err := p.Acquire(ctx, rq.Project)
		switch {
		case err == nil:
			s.grant(ss, p, pm, &rq, &resp)
		case ss.ctx.Err() != nil:
			resp.Code, resp.Error = CodeCanceled, "session closed while waiting"
		default:
			s.refuse(ss, &resp, err)
		}
		ss.answerLate(&resp)
	}(*rq)
	return false
}

// tryGrant grants rq a permit of p if try (TryAcquireInto or
// TryAcquireFirst) admits it, its dry-run refusal reported; rf holds the
// refusal otherwise.
func (s *Server) tryGrant(ss *session, p *pools.Pool, try func(string, *pools.Refusal) (pools.Permit, bool),
	rq *request, rf *pools.Refusal, resp *response) bool {
	pm, ok := try(rq.Project, rf)
	if !ok {
		return false
	}
	if rf.WouldRefuse {
		s.refusalEvent(ss, events.KindWouldRefuse, rf)
	}
	s.grant(ss, p, pm, rq, resp)
	return true
}

// grant turns a permit into a lease of the session, or gives it back when
// the session closed meanwhile.
func (s *Server) grant(ss *session, p *pools.Pool, pm pools.Permit, rq *request, resp *response) {
	id, ok := ss.addLease(s.newLease, lease{pool: p, permit: pm, project: rq.Project})
	if !ok {
		p.Release(pm)
		resp.Code, resp.Error = CodeCanceled, "session closed"
		return
	}
	resp.OK, resp.Lease = true, id
}

// refuse fills resp from a pool's error. A *pools.Refusal gives the
// project's estimate and the pool's release rate; retry_after_ms is the
// project's next return slot from them (see retryMS), so the refused clients
// of one project are told different times.
func (s *Server) refuse(ss *session, resp *response, err error) {
	var rf *pools.Refusal
	if !errors.As(err, &rf) {
		resp.Code, resp.Error = CodeInternal, err.Error()
		return
	}
	s.refusalEvent(ss, events.KindRefused, rf)
	resp.Code = CodeRefused
	if errors.Is(err, pools.ErrTooManyResidents) {
		resp.Code = CodeTooManyResidents
	}
	resp.RetryAfterMS = s.retryMS(rf.Project, rf.RetryAfter, rf.ReleaseRate)
	// The message says the hint the client is given, not the pool's
	// estimate it came from: one value, within maxRetry.
	told := *rf
	told.RetryAfter = time.Duration(resp.RetryAfterMS) * time.Millisecond
	resp.Error, resp.Refusal = told.Error(), &told
}

// retryMS is the retry hint for a refusal of project: its return slot (est
// plus one 1/rate for each of the project's refused clients still due back;
// see pace.Pacer.Slot) spread over one slot's width (pace.Spread), so that
// clients that obey come back at about the rate they can be admitted and not
// in step. It is at least 1 ms: an answer of 0 would invite a retry loop;
// and at most maxRetry, the documented cap, which the jitter around a slot
// at the horizon would pass by up to half a gap (5 s).
func (s *Server) retryMS(project string, est time.Duration, rate float64) int64 {
	delay, gap := s.pacer.Slot(project, time.Now(), est, rate)
	d := min(pace.Spread(delay, gap, rand.Float64()), maxRetry)
	return max(int64((d+time.Millisecond-1)/time.Millisecond), 1)
}

func (s *Server) release(ss *session, rq *request, resp *response) {
	if rq.Lease == 0 {
		resp.Code, resp.Error = CodeMissingField, "release needs lease"
		return
	}
	resp.HasReleased = true
	l, ok := ss.takeLease(rq.Lease)
	if !ok {
		resp.OK, resp.Note = true, "already released"
		return
	}
	if l.pool == nil {
		// A resident's lease is its residence: releasing it puts it to sleep.
		s.leaveResidence(ss, l.object, rq.Lease, false, resp)
		resp.HasReleased, resp.Released = true, resp.OK
		return
	}
	if err := l.pool.Release(l.permit); err != nil {
		resp.Code, resp.Error = CodeInternal, "releasing lease: "+err.Error()
		return
	}
	resp.OK, resp.Released = true, true
}

func (s *Server) touch(ss *session, rq *request, resp *response) {
	if rq.Object == "" {
		resp.Code, resp.Error = CodeMissingField, "touch needs object"
		return
	}
	s.mu.Lock()
	o := s.objects[rq.Object]
	switch {
	case o == nil || o.owner != ss:
		s.mu.Unlock()
		resp.Code, resp.Error = CodeUnknownObject, "object "+quote(rq.Object)+" is not owned by this session"
		return
	case !o.resident:
		s.mu.Unlock()
		resp.Code, resp.Error = CodeNotResident, "object "+quote(rq.Object)+" is not resident; spawn wakes it"
		return
	case o.evicting:
		s.mu.Unlock()
		resp.Code, resp.Error = CodeNotResident, "object "+quote(rq.Object)+" is being evicted; put it to sleep and release its lease"
		return
	}
	o.touched = time.Now()
	err := s.residents.Touch(rq.Object)
	s.mu.Unlock()
	if err != nil {
		resp.Code, resp.Error = CodeInternal, "touch: "+err.Error()
		return
	}
	resp.OK = true
}

func (s *Server) sleep(ss *session, rq *request, resp *response, remove bool) {
	if rq.Object == "" {
		resp.Code, resp.Error = CodeMissingField, rq.Op+" needs object"
		return
	}
	s.leaveResidence(ss, rq.Object, 0, remove, resp)
}

// leaveResidence puts an object to sleep (or forgets it when remove) and
// wakes the spawns waiting for room. lease, if not 0, is the residence to
// end (a release of it): the object's residence must still be that one.
func (s *Server) leaveResidence(ss *session, name string, lease uint64, remove bool, resp *response) {
	s.mu.Lock()
	o := s.objects[name]
	switch {
	case o == nil || o.owner != ss:
		s.mu.Unlock()
		resp.Code, resp.Error = CodeUnknownObject, "object "+quote(name)+" is not owned by this session"
		return
	case lease != 0 && o.lease != lease:
		// The session held the lease, so nothing else has ended it; a
		// guard, logged should it ever differ.
		s.mu.Unlock()
		s.log.Error("released residence is not the object's", "object", name, "lease", lease, "current", o.lease)
		resp.OK, resp.Note = true, "already released"
		return
	case o.spawning:
		s.mu.Unlock()
		resp.Code, resp.Error = CodeConflict, "object "+quote(name)+" has a spawn in progress"
		return
	case !o.resident && !remove:
		s.mu.Unlock()
		resp.OK, resp.Note = true, "already sleeping"
		return
	}
	leaseID := o.lease
	// An evicted object is already asleep in the pool's accounting; this
	// is its owner's confirmation. One whose deadline passed is resident
	// again, and this is its owner's late confirmation: either way the
	// owner does confirm.
	poolAwake := o.resident && !o.evicting
	s.confirmedLocked(name, o, o.evicting || o.unconfirmed)
	o.lease, o.resident, o.evicting = 0, false, false
	if remove {
		s.dropObjectLocked(name)
	}
	s.mu.Unlock()
	if leaseID != 0 {
		ss.takeLease(leaseID)
	}
	var err error
	switch {
	case remove:
		err = s.residents.Remove(name)
	case poolAwake:
		err = s.residents.Sleep(name)
		if errors.Is(err, pools.ErrNotResident) {
			// Named a victim since s.mu was let go, before the
			// spawn that named it marked it evicting: asleep all
			// the same, and that spawn, finding it so, goes on.
			err = nil
		}
	}
	s.wakeSleepers(name)
	if err != nil {
		resp.Code, resp.Error = CodeInternal, "residents: "+err.Error()
		return
	}
	resp.OK = true
}

func (s *Server) startSpawn(ss *session, rq *request, resp *response) bool {
	switch {
	case s.residents == nil:
		resp.Code, resp.Error = CodeUnknownPool, "no residents pool is served"
		return true
	case rq.Project == "":
		resp.Code, resp.Error = CodeMissingField, "spawn needs project"
		return true
	case rq.Object == "":
		resp.Code, resp.Error = CodeMissingField, "spawn needs object"
		return true
	case len(rq.Object) > MaxObjectLen:
		resp.Code, resp.Error = CodeBadRequest, "object name longer than "+strconv.Itoa(MaxObjectLen)+" bytes"
		return true
	}
	if err := project.Validate(rq.Project); err != nil {
		resp.Code, resp.Error = CodeBadRequest, err.Error()
		return true
	}
	s.mu.Lock()
	o := s.objects[rq.Object]
	switch {
	case o != nil && o.owner != ss:
		s.mu.Unlock()
		resp.Code, resp.Error = CodeConflict, "object "+quote(rq.Object)+" is owned by another session"
		return true
	case o != nil && o.project != rq.Project:
		s.mu.Unlock()
		resp.Code, resp.Error = CodeConflict, "object "+quote(rq.Object)+" belongs to project "+quote(o.project)
		return true
	case o != nil && o.spawning:
		s.mu.Unlock()
		resp.Code, resp.Error = CodeConflict, "object "+quote(rq.Object)+" has a spawn in progress"
		return true
	case o != nil && o.resident:
		// Spawning a resident object again is a call on it. One being
		// evicted is a call too: its owner has not confirmed, so it
		// holds it still, and the spawn waiting for its room goes on
		// waiting for the confirmation. (Taking this spawn for a wake
		// that ends the old residence let that spawn in while the
		// object was still in memory.) The pool may count an object
		// asleep that is not marked evicting yet: it has just named it
		// a victim, and the notice is on its way.
		o.touched = time.Now()
		var err error
		if !o.evicting {
			err = s.residents.Touch(rq.Object)
		}
		lease, note := o.lease, "already resident"
		if o.evicting {
			note = "already resident; being evicted: confirm by releasing its lease"
		}
		s.mu.Unlock()
		if err != nil && !errors.Is(err, pools.ErrNotResident) {
			resp.Code, resp.Error = CodeInternal, "touch: "+err.Error()
			return true
		}
		resp.OK, resp.Lease, resp.Note = true, lease, note
		return true
	}
	wasSleeping := o != nil
	if o == nil {
		o = &object{project: rq.Project, owner: ss}
		if why := s.addObjectLocked(ss, rq.Object, o); why != "" {
			s.mu.Unlock()
			resp.Code, resp.Error = CodeTooManyObjects, why
			return true
		}
	}
	o.spawning = true
	s.mu.Unlock()
	// Room now, or an error, is answered here; only a spawn that must
	// wait (for room, or for a victim's owner to confirm) takes a waiting
	// place and a goroutine, so however many places others hold, a spawn
	// the pool admits at once is admitted.
	// Pending (pools.Residents.SpawnPending) until admitted: the pool
	// never names an object this spawn has not loaded yet as a victim.
	ev, done, err := s.residents.TrySpawnPending(rq.Project, rq.Object)
	switch {
	case done && err != nil:
		*resp = s.spawnError(ss, rq, o, wasSleeping, err, nil)
		return true
	case done && ev.Object == "":
		*resp = s.admitted(ss, rq, o, nil)
		return true
	}
	if why := s.startWait(ss, waitSpawn); why != "" {
		if done {
			s.evictionUndone(ss, rq, o, wasSleeping, ev)
		} else {
			s.spawnFailed(ss, rq, o, wasSleeping, false)
		}
		resp.Code, resp.Error = CodeTooManyWaiting, why
		return true
	}
	s.wg.Add(1)
	go func(rq request) {
		defer s.wg.Done()
		defer s.endWait(ss, waitSpawn)
		var first *pools.Eviction
		if done {
			first = &ev
		}
		resp := s.spawn(ss, &rq, o, wasSleeping, first)
		ss.answerLate(&resp)
	}(*rq)
	return false
}

// spawn runs one spawn to its end. The pool either admits at once, admits
// by naming an object it already counts as asleep, or waits for room. A named
// object's owner is asked to put it to sleep, and the spawner is answered only
// when it confirms.
//
// One deadline, EvictionWait after the spawn began, bounds both waits: the
// pool's wait for room and the owner's confirmation. So a spawn for which
// nothing was put to sleep is refused with TOO_MANY_RESIDENTS within that
// second, however the second was split between the two. first, if not nil,
// is the eviction the pool already made for this spawn (TrySpawn).
func (s *Server) spawn(ss *session, rq *request, o *object, wasSleeping bool, first *pools.Eviction) response {
	resp := response{ID: rq.ID}
	began := s.now()
	expired, stop := s.after(EvictionWait)
	defer stop()
	ctx, cancel := context.WithCancelCause(ss.ctx)
	defer cancel(nil)
	go func() {
		select {
		case <-expired:
			cancel(errSpawnDeadline)
		case <-ctx.Done():
		}
	}()
	var ev pools.Eviction
	var err error
	if first != nil {
		ev = *first
	} else {
		ev, err = s.residents.SpawnPending(ctx, rq.Project, rq.Object)
	}
	if err != nil {
		return s.spawnError(ss, rq, o, wasSleeping, err, ctx)
	}
	if ev.Object == "" {
		return s.admitted(ss, rq, o, nil)
	}
	// The owner's time to confirm is what is left of the second when it
	// is asked: the pool may have named the victim late (its last look at
	// the deadline names one with no time left). An owner asked past the
	// first half of the second is not held to have left it unconfirmed
	// (no strike, evictionFailed): a crowd of spawns that waited on the
	// pool would otherwise drop a healthy owner's objects.
	fair := ctx.Err() == nil && s.now().Sub(began) <= EvictionWait/2
	confirmed := s.evict(ev, rq.Project)
	select {
	case <-confirmed:
		return s.admitted(ss, rq, o, &ev)
	case <-ctx.Done():
	}
	if s.evictionFailed(ss, rq, o, wasSleeping, ev, fair && errors.Is(context.Cause(ctx), errSpawnDeadline)) {
		// The owner left too many evictions unconfirmed: the victim
		// was dropped, and its permit is this spawn's.
		return s.admitted(ss, rq, o, &ev)
	}
	resp.Evicted = &ev
	if ss.ctx.Err() != nil {
		resp.Code, resp.Error = CodeCanceled, "session closed during spawn"
		return resp
	}
	resp.Code = CodeTooManyResidents
	resp.Error = "residents pool full: " + quote(ev.Object) + " was not put to sleep within " + EvictionWait.String() + "; it stays resident"
	resp.RetryAfterMS = s.retryMS(rq.Project, EvictionWait, 0)
	return resp
}

// spawnError undoes a spawn the pool refused and says why; ctx is the
// spawn's context when it waited.
func (s *Server) spawnError(ss *session, rq *request, o *object, wasSleeping bool, err error, ctx context.Context) response {
	resp := response{ID: rq.ID}
	s.spawnFailed(ss, rq, o, wasSleeping, false)
	switch {
	case ss.ctx.Err() != nil:
		resp.Code, resp.Error = CodeCanceled, "session closed during spawn"
	case errors.Is(err, pools.ErrObjectProject):
		resp.Code, resp.Error = CodeConflict, err.Error()
	default:
		s.refuse(ss, &resp, err)
		if resp.Code == CodeRefused || ctx != nil && errors.Is(context.Cause(ctx), errSpawnDeadline) {
			resp.Code = CodeTooManyResidents
		}
	}
	return resp
}

// evictionUndone undoes a spawn the pool admitted by counting ev asleep,
// before anyone was asked to put it to sleep: ev is counted resident
// again, the spawner not.
func (s *Server) evictionUndone(ss *session, rq *request, o *object, wasSleeping bool, ev pools.Eviction) {
	s.mu.Lock()
	o.spawning = false
	keep := wasSleeping && ss.ctx.Err() == nil
	if s.objects[rq.Object] == o && !keep {
		s.dropObjectLocked(rq.Object)
	}
	err := s.residents.Unevict(ev, rq.Object, !keep)
	s.mu.Unlock()
	if err != nil {
		s.log.Error("undoing a spawn that could not wait", "object", rq.Object, "victim", ev.Object, "err", err)
	}
}

// errSpawnDeadline is the cause of a spawn's context ending at its deadline,
// as opposed to its session closing.
var errSpawnDeadline = errors.New("spawn deadline passed")

// realAfter is the spawn deadline's timer outside tests.
func realAfter(d time.Duration) (<-chan time.Time, func() bool) {
	t := time.NewTimer(d)
	return t.C, t.Stop
}

// spawnFailed undoes a spawn's bookkeeping; admittedByPool says the pool
// counted the object resident and must be told it is not.
func (s *Server) spawnFailed(ss *session, rq *request, o *object, wasSleeping, admittedByPool bool) {
	s.mu.Lock()
	o.spawning = false
	keep := wasSleeping && ss.ctx.Err() == nil
	mine := s.objects[rq.Object] == o
	if mine && !keep {
		s.dropObjectLocked(rq.Object)
	}
	s.mu.Unlock()
	var err error
	switch {
	case !mine:
	case !keep && (admittedByPool || wasSleeping):
		err = s.residents.Remove(rq.Object)
	case keep && admittedByPool:
		err = s.residents.Sleep(rq.Object)
	}
	if err != nil {
		s.log.Error("undoing a failed spawn", "object", rq.Object, "err", err)
	}
}

// evictionFailed undoes a spawn that the pool admitted by evicting ev when
// ev's owner did not confirm in time (deadline: the spawn's second passed,
// the owner asked within its first half; else the spawner's session closed
// first, or the owner was asked too late to be held to it). The owner was
// asked and did not
// answer, so as far as anyone knows the victim is still in memory: it is
// counted resident again (and the spawner not), so the pool's count stays
// exact, as its project's most recently called object, so that the next
// spawns name the project's other objects first.
//
// That trust has a limit. An owner that leaves MaxUnconfirmed evictions of a
// project's objects in a row unconfirmed (by not reading, an OnEvict that
// fails or hangs, or on purpose) would keep its project over its share for
// ever, every spawn that names one of its objects refused. So at that count
// the victim is dropped instead: its residence ends without its owner (the
// owner is told so, with a dropped event), it stays asleep in the pool, and
// admit is true: the spawn goes on with its permit. The owner's other
// objects of the project left unconfirmed are dropped with it, which frees
// their permits; until the owner confirms an eviction again, each further
// unconfirmed eviction of the project is dropped at once. An owner that
// confirms late (a sleep of an object whose deadline passed) starts the
// count over, as one that confirms in time does.
//
// Why not end the owner's session instead: that would end every lease of the
// session, in every pool, while the runtime may still be using them (a slow
// runtime is not a dead one), so those pools would undercount. An owner that
// confirms late is handled as a sleep of a resident object.
func (s *Server) evictionFailed(ss *session, rq *request, o *object, wasSleeping bool, ev pools.Eviction, deadline bool) (admit bool) {
	s.mu.Lock()
	mine := s.objects[rq.Object] == o
	v := s.objects[ev.Object]
	awake := v != nil && v.evicting // still unconfirmed: nobody put it to sleep
	var st *strikes
	if deadline && mine && awake {
		// The owner had at least half the second (spawn).
		st = v.owner.strikes[v.project]
		if st == nil {
			if v.owner.strikes == nil {
				v.owner.strikes = map[string]*strikes{}
			}
			st = &strikes{objects: map[string]*object{}}
			v.owner.strikes[v.project] = st
		}
		st.n++
		if s.maxUnconfirmed > 0 && st.n >= s.maxUnconfirmed {
			owner, n, drops := v.owner, st.n, s.dropLocked(ev, st)
			s.mu.Unlock()
			s.announceDrops(owner, drops, ev.Project, rq.Project, n)
			return true
		}
	}
	o.spawning = false
	keep := wasSleeping && ss.ctx.Err() == nil
	if mine && !keep {
		s.dropObjectLocked(rq.Object)
	}
	var err error
	switch {
	case mine && awake:
		// Under s.mu, so that a confirmation arriving now sees the victim
		// resident (and tells the pool) or came first (and v.evicting is
		// false): the two cannot both count it.
		v.evicting = false
		delete(s.sleepers, ev.Object) // this spawn was the only one waiting
		if st != nil {
			v.unconfirmed = true
			st.objects[ev.Object] = v
			err = s.residents.Unconfirmed(ev, rq.Object, !keep)
		} else {
			// The spawner left before the owner's second was over:
			// nothing is held against the owner.
			err = s.residents.Unevict(ev, rq.Object, !keep)
		}
	case mine && !keep:
		err = s.residents.Remove(rq.Object)
	case mine:
		err = s.residents.Sleep(rq.Object)
	case awake:
		// Cannot happen while the spawning flag keeps the object ours;
		// logged rather than guessed at.
		err = errors.New("spawned object changed hands; victim left counted asleep")
	}
	s.mu.Unlock()
	if err != nil {
		s.log.Error("undoing a spawn whose eviction was not confirmed", "object", rq.Object, "victim", ev.Object, "err", err)
	}
	return false
}

// dropped is a residence the server ended without its owner.
type dropped struct {
	object string
	lease  uint64
}

// dropLocked ends, without their owner, the residence of ev's victim (which
// the pool already counts asleep) and those of the objects in st, which the
// owner left unconfirmed before and which are still resident as it last
// said. Their leases are taken from the owner's session, so that a late
// release or sleep of them ends nothing. An object being evicted again or
// spawned is left to that operation.
func (s *Server) dropLocked(ev pools.Eviction, st *strikes) []dropped {
	v := s.objects[ev.Object]
	drops := []dropped{{ev.Object, v.lease}}
	s.endResidenceLocked(ev.Object, v)
	delete(s.sleepers, ev.Object) // this spawn was the only one waiting
	if err := s.residents.Dropped(ev); err != nil {
		s.log.Error("dropping an unconfirmed victim", "object", ev.Object, "err", err)
	}
	for name, u := range st.objects {
		delete(st.objects, name)
		if s.objects[name] != u || !u.unconfirmed || !u.resident || u.evicting || u.spawning {
			continue
		}
		drops = append(drops, dropped{name, u.lease})
		s.endResidenceLocked(name, u)
		// ErrNotResident: a spawn has just named it a victim and not
		// marked it evicting yet; asleep all the same, and that spawn,
		// finding it so, goes on (evict).
		if err := s.residents.Drop(name); err != nil && !errors.Is(err, pools.ErrNotResident) {
			s.log.Error("dropping an unconfirmed object", "object", name, "err", err)
		}
	}
	s.dropped[ev.Project] += uint64(len(drops))
	return drops
}

// endResidenceLocked makes o asleep for the server and its owner's session.
func (s *Server) endResidenceLocked(name string, o *object) {
	if o.lease != 0 {
		o.owner.takeLease(o.lease)
	}
	o.lease, o.resident, o.evicting = 0, false, false
	s.confirmedLocked(name, o, false)
}

// announceDrops publishes the objects of project dropped for a spawn of
// spawner and tells their owner, each notice on a goroutine of its own (as
// evict does): an owner that does not read holds up nothing.
func (s *Server) announceDrops(owner *session, drops []dropped, project, spawner string, strikes int) {
	detail := "its owner left " + strconv.Itoa(strikes) + " evictions of the project in a row unconfirmed; put to sleep without it"
	for _, d := range drops {
		s.publish(events.Event{Kind: events.KindEvicted, Pool: ResidentsPool, Project: project, Reason: pools.EvictUnconfirmed,
			Victim: d.object, Owner: peerText(owner), Spawner: spawner, Detail: detail})
		s.log.Warn("object dropped from the residents pool: its owner leaves evictions unconfirmed", "object", d.object,
			"project", project, "session", owner.id, "unconfirmed", strikes)
		ev := pools.Eviction{Project: project, Object: d.object, Reason: pools.EvictUnconfirmed}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			owner.sendEvent(EventDropped, &ev, d.lease)
		}()
	}
}

// confirmedLocked ends o's unconfirmed mark; byOwner (its owner put it to
// sleep after being asked to) starts the owner's count of unconfirmed
// evictions of the project over.
func (s *Server) confirmedLocked(name string, o *object, byOwner bool) {
	marked := o.unconfirmed
	o.unconfirmed = false
	st := o.owner.strikes[o.project]
	if st == nil {
		return
	}
	if marked {
		delete(st.objects, name)
	}
	if byOwner {
		st.n = 0
	}
	if st.n == 0 && len(st.objects) == 0 {
		delete(o.owner.strikes, o.project)
	}
}

func (s *Server) admitted(ss *session, rq *request, o *object, evicted *pools.Eviction) response {
	resp := response{ID: rq.ID, Evicted: evicted}
	// The object stops spawning before its lease is the session's: a
	// session closing in between then finds it not spawning and takes it
	// out (endSession), or has closed first and putLease fails. The other
	// order let a close skip it as spawning after the lease was recorded,
	// and the object stayed for good, holding its permit.
	id := ss.freshLease(s.newLease)
	s.mu.Lock()
	o.spawning, o.resident, o.lease, o.touched = false, true, id, time.Now()
	s.mu.Unlock()
	if ss.putLease(id, lease{project: rq.Project, object: rq.Object}) {
		resp.OK, resp.Lease = true, id
		resp.settle, resp.object = o, rq.Object
		return resp
	}
	// The session closed while the spawn ran; its objects are leaving.
	s.mu.Lock()
	drop := s.objects[rq.Object] == o
	if drop {
		s.dropObjectLocked(rq.Object)
	}
	s.mu.Unlock()
	if drop {
		s.residents.Remove(rq.Object)
		s.wakeSleepers(rq.Object)
	}
	resp.Code, resp.Error = CodeCanceled, "session closed during spawn"
	return resp
}

// settle lets the pool name the object a spawn answered by resp loaded as a
// victim, once the answer is written: an eviction notice the owner read
// before the answer would name an object it does not know it holds, and a
// runtime that confirmed it (nothing to put to sleep) would load it next,
// beyond the pool's count. Nothing is done if the object has changed since
// (removed, or being spawned again); it is pending until then, which only
// keeps it from being a victim.
func (s *Server) settle(resp *response) {
	s.mu.Lock()
	defer s.mu.Unlock()
	o := resp.settle
	// The same residence, not only the same object: a wake reuses it.
	if s.objects[resp.object] != o || o.spawning || !o.resident || o.evicting || o.lease != resp.Lease {
		return
	}
	if err := s.residents.Settle(resp.object); err != nil {
		s.log.Error("settling a spawned object", "object", resp.object, "err", err)
	}
}

// evict tells the session owning ev.Object to put it to sleep; the pool
// already counts it asleep. The returned channel is closed when the owner
// confirms (a release of the residence's lease, a sleep or a remove), or at
// once when there is nobody to ask.
func (s *Server) evict(ev pools.Eviction, spawner string) <-chan struct{} {
	ch := make(chan struct{})
	s.mu.Lock()
	o := s.objects[ev.Object]
	if o == nil || o.owner == nil || !o.resident || o.spawning {
		s.mu.Unlock()
		s.log.Warn("pool evicted an object no session can put to sleep", "object", ev.Object, "project", ev.Project)
		close(ch)
		return ch
	}
	o.evicting = true
	s.sleepers[ev.Object] = append(s.sleepers[ev.Object], ch)
	s.evictions[ev.Reason]++
	owner, lease := o.owner, o.lease
	s.mu.Unlock()
	s.publish(events.Event{Kind: events.KindEvicted, Pool: ResidentsPool, Project: ev.Project, Reason: ev.Reason,
		Victim: ev.Object, Owner: peerText(owner), Spawner: spawner})
	// Written by its own goroutine: an owner that does not read holds up
	// only this notice (up to writeTimeout, then its session is closed),
	// never the spawn, whose one-second deadline runs meanwhile.
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		owner.sendEvent(EventEvict, &ev, lease)
	}()
	return ch
}
