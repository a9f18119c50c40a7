// SPDX-License-Identifier: Apache-2.0

package scheduler

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fairshare-dev/fairshare/internal/clock"
	"github.com/fairshare-dev/fairshare/pools"
)

// eps absorbs float rounding in "holds at least one credit": a timer computed
// for the instant a bucket reaches 1.0 must find it there.
const eps = 1e-9

// none marks an absent timer or handle.
const none = -1

// Scheduler orders requests from many participants onto one server. See the
// package documentation for the rule it implements.
type Scheduler struct {
	clk   clock.Clock
	cfg   Config
	epoch time.Time     // internal times are nanoseconds since epoch
	wake  chan struct{} // nudges Run after Submit and Done; capacity 1
	run   atomic.Bool   // a Run loop is active

	mu          sync.Mutex // guards the fields below
	byName      map[string]int32
	policies    map[string]Policy // kept when an idle participant is forgotten
	hot         []hot             // by handle: what a decision reads and writes
	cold        []cold            // by handle: names, queue tails and statistics
	free        []int32
	rings       [4]ring     // eligible non-empty queues by class, index 1..3
	timers      []timer     // 4-ary min-heap after hpad padding entries: when a parked queue can climb
	inOrder     fifo[timer] // timers set in due order, earliest first; the others are in timers
	staleTimers int         // entries in timers and inOrder that no longer match hot.due
	// timerPrefetched is what prefetchTimersLocked prefetched last: the
	// FIFO's head position and the heap's top.
	timerPrefetched struct {
		head uint32
		top  timer
	}
	tickets    []Ticket    // preallocated tickets handed out by Submit
	inFlight   int         // dispatched, not yet Done
	engaged    int         // participants counted in the places' share (cold.engaged)
	idle       fifo[timer] // when engaged participants went idle, oldest first (expireLocked)
	holds      int         // places kept for participants between two requests (holdLocked)
	holdQ      fifo[timer] // when they stop being kept, soonest first (expireHoldsLocked)
	reserve    int         // the places only a participant under its share takes: the rule's FLOOR of MaxInFlight
	seq        uint64      // dispatches so far, numbers turns for entry placement
	dispatched [4]uint64   // by class
	visits     uint64      // queues examined: the cursor's queue plus timer relinks
	skips      uint64      // ring tombstones passed over by the head
	wait       waitHist
	lastSweep  int64
}

// A participant is one queue and its buckets, split by how often it is
// touched. Its handle indexes two dense arrays: hot holds everything the
// decision reads or writes (one 64-byte cache line, so at 100k participants
// the hot state is 6.4 MB and a decision costs one miss per queue it looks
// at, prefetched turns ahead), cold holds what only Submit, completion and
// status output need. Only the Scheduler's mu guards them.
type hot struct {
	p1, p2 float64 // balances as of last; may be negative
	last   int64   // when p1/p2 were last refilled
	due    int64   // when refill lifts the class: the live timer; none if not parked
	head   *Ticket // oldest queued ticket, linked through Ticket.next/prev
	slot   uint32  // position of the ring entry, valid while where != inNone
	queue  int32   // queued tickets
	shares float32 // 0 marks a free slot
	// inflight counts its dispatched tickets not yet Done: the places it
	// holds.
	inflight int32
	// lastSeq is the low 32 bits of s.seq at this participant's last turn.
	// Only the distance to s.seq is read, modulo 2^32: a participant idle
	// for more than 2^31 turns (and not forgotten meanwhile) may enter a
	// ring behind everyone instead of at the cursor. That costs it at most
	// one round of waiting, never its turn.
	lastSeq uint32
	tier    uint8 // a Tier
	ring    uint8 // Class of the ring the queue is a member of, 0 = none
	where   uint8 // which of the ring's fifos holds its entry: inBack etc.
}

type cold struct {
	dispatched [4]uint64
	tail       *Ticket
	name       string
	idleAt     int64 // when it last went idle (nothing queued or in flight)
	holdUntil  int64 // until when a place is kept for it, while held
	lastEnd    int64 // when a request of it last ended with none queued, once ended
	lastClass  uint8 // a Class
	// engaged: counted in s.engaged, from its first request queued to
	// Window after its last ended; held: a place is kept for it (counted
	// in s.holds); ended: lastEnd is set; steady: its requests come one
	// after another (engageLocked).
	engaged, held, ended, steady bool
}

func (q *hot) holdsP1() bool { return Tier(q.tier).holdsP1() }
func (q *hot) holdsP2() bool { return Tier(q.tier).holdsP2() }
func (q *hot) live() bool    { return q.shares > 0 }

type timer struct {
	due int64
	pid int32
}

// New returns a Scheduler. Zero Config fields take the package defaults; a
// nil clk means the system clock. The scheduler reads clk once per decision,
// so a fake clock makes every decision reproducible.
func New(cfg Config, clk clock.Clock) (*Scheduler, error) {
	clk = clock.Or(clk)
	def := func(v *float64, d float64) {
		if *v == 0 {
			*v = d
		}
	}
	def(&cfg.P1Rate, DefaultP1Rate)
	def(&cfg.P1Burst, DefaultP1Burst)
	def(&cfg.P2Rate, DefaultP2Rate)
	def(&cfg.P2Burst, DefaultP2Burst)
	if cfg.Poll == 0 {
		cfg.Poll = DefaultPoll
	}
	if cfg.Window == 0 {
		cfg.Window = DefaultWindow
	}
	if cfg.Keep == 0 {
		cfg.Keep = DefaultKeep
	}
	for _, f := range []struct {
		name     string
		v        float64
		min, max float64
	}{{"P1Rate", cfg.P1Rate, 0, MaxRate}, {"P2Rate", cfg.P2Rate, 0, MaxRate}, {"P1Burst", cfg.P1Burst, 1, MaxBurst}, {"P2Burst", cfg.P2Burst, 1, MaxBurst}} {
		// A rate must be positive or a parked queue would never climb; a
		// burst below one credit could never pay for a dispatch.
		if math.IsNaN(f.v) || f.v < f.min || (f.min == 0 && f.v <= 0) || f.v > f.max {
			return nil, fmt.Errorf("%s %v out of range: %w", f.name, f.v, ErrInvalidConfig)
		}
	}
	if cfg.MaxInFlight < 0 {
		return nil, fmt.Errorf("MaxInFlight %d is negative: %w", cfg.MaxInFlight, ErrInvalidConfig)
	}
	if cfg.Poll < 0 {
		return nil, fmt.Errorf("poll %v is negative: %w", cfg.Poll, ErrInvalidConfig)
	}
	if cfg.Window < 0 {
		return nil, fmt.Errorf("window %v is negative: %w", cfg.Window, ErrInvalidConfig)
	}
	if cfg.Keep < 0 {
		return nil, fmt.Errorf("keep %v is negative: %w", cfg.Keep, ErrInvalidConfig)
	}
	if cfg.DefaultPolicy.Tier < TierNone || cfg.DefaultPolicy.Tier > TierPro {
		return nil, fmt.Errorf("default policy tier %d: %w", cfg.DefaultPolicy.Tier, ErrInvalidConfig)
	}
	cfg.DefaultPolicy = normPolicy(cfg.DefaultPolicy)
	s := &Scheduler{
		clk:      clk,
		cfg:      cfg,
		epoch:    clk.Now(),
		wake:     make(chan struct{}, 1),
		byName:   make(map[string]int32),
		policies: make(map[string]Policy),
		wait:     newWaitHist(),
		timers:   make([]timer, hpad),
	}
	if cfg.MaxInFlight > 0 {
		s.reserve = pools.DefaultFloor(cfg.MaxInFlight)
	}
	return s, nil
}

// maxShares keeps shares exact in the float32 the hot struct stores.
const maxShares = 1 << 24

func normPolicy(p Policy) Policy {
	p.Shares = min(max(p.Shares, 1), maxShares)
	if p.Tier < TierNone || p.Tier > TierPro {
		p.Tier = TierNone
	}
	return p
}

// now reads the clock once; every decision made under one reading agrees.
func (s *Scheduler) now() int64 { return int64(s.clk.Now().Sub(s.epoch)) }

func (s *Scheduler) nudge() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// SetPolicy sets a participant's tier and shares. It takes effect at once
// for a known participant (a newly held bucket starts full, balances are
// clipped to the new bucket size) and is remembered across the participant
// being forgotten while idle. Shares below 1 count as 1; an unknown tier
// counts as TierNone.
func (s *Scheduler) SetPolicy(participant string, p Policy) {
	p = normPolicy(p)
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.policies[participant] = p
	if pid, ok := s.byName[participant]; ok {
		s.applyPolicyLocked(pid, p, now)
	}
}

// DeletePolicy forgets a participant's policy: it falls back to
// Config.DefaultPolicy at once if known, and on its next arrival otherwise.
// Without it a deleted policy would stay in force, and in memory, for as
// long as the Scheduler lives.
func (s *Scheduler) DeletePolicy(participant string) {
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.policies, participant)
	if pid, ok := s.byName[participant]; ok {
		s.applyPolicyLocked(pid, s.cfg.DefaultPolicy, now)
	}
}

// applyPolicyLocked changes a known participant's tier and shares.
func (s *Scheduler) applyPolicyLocked(pid int32, p Policy, now int64) {
	q := &s.hot[pid]
	s.refillLocked(q, now)
	had1, had2 := q.holdsP1(), q.holdsP2()
	q.tier, q.shares = uint8(p.Tier), float32(p.Shares)
	b1, b2 := s.cfg.P1Burst*float64(q.shares), s.cfg.P2Burst*float64(q.shares)
	switch {
	case q.holdsP1() && !had1:
		q.p1 = b1
	case !q.holdsP1():
		q.p1 = 0
	}
	switch {
	case q.holdsP2() && !had2:
		q.p2 = b2
	case !q.holdsP2():
		q.p2 = 0
	}
	q.p1, q.p2 = min(q.p1, b1), min(q.p2, b2)
	s.placeLocked(pid, now)
}

// Submit queues one request at the tail of the participant's queue. It never
// refuses: the ticket will be dispatched eventually unless withdrawn.
//
// While a Run loop is active, a request that finds nothing else waiting and
// the server with room is dispatched before Submit returns (unless the
// places left are not for it: pickReservedLocked; the loop then decides):
// it is the decision the loop would make next, made without waking the
// loop, so Wait returns at once. With anything waiting it queues, so it
// never overtakes.
func (s *Scheduler) Submit(participant string) *Ticket {
	now := s.now()
	s.mu.Lock()
	idle := !s.workLocked()
	t := s.newTicketLocked()
	pid := s.lookupLocked(participant, now)
	q, qc := &s.hot[pid], &s.cold[pid]
	t.pid, t.enq = pid, now
	if qc.tail == nil {
		q.head = t
	} else {
		qc.tail.next, t.prev = t, qc.tail
	}
	qc.tail = t
	q.queue++
	if q.queue == 1 {
		s.engageLocked(pid, now)
		s.placeLocked(pid, now)
	}
	// t, its queue the only one with work, unless the places left are
	// kept from it (pickLocked): then the loop is nudged to wait for one.
	if idle && s.run.Load() && s.roomLocked() && s.dispatchLocked(now) != nil {
		s.mu.Unlock()
		return t
	}
	s.mu.Unlock()
	s.nudge()
	return t
}

// workLocked reports whether any queue holds a request: every queue with
// work is linked in exactly one ring.
func (s *Scheduler) workLocked() bool {
	return s.rings[P1].n+s.rings[P2].n+s.rings[P3].n > 0
}

// roomLocked is Run's room test for a dispatch made outside the loop:
// MaxInFlight first, so a full server is not asked HasRoom.
func (s *Scheduler) roomLocked() bool {
	if s.cfg.MaxInFlight > 0 && s.inFlight >= s.cfg.MaxInFlight {
		return false
	}
	return s.cfg.HasRoom == nil || s.cfg.HasRoom()
}

// lookupLocked returns the participant's handle, creating it with full
// buckets if it is new (or was forgotten).
func (s *Scheduler) lookupLocked(name string, now int64) int32 {
	if pid, ok := s.byName[name]; ok {
		return pid
	}
	pol, ok := s.policies[name]
	if !ok {
		pol = s.cfg.DefaultPolicy
	}
	var pid int32
	if n := len(s.free); n > 0 {
		pid, s.free = s.free[n-1], s.free[:n-1]
	} else {
		s.hot = append(s.hot, hot{})
		s.cold = append(s.cold, cold{})
		pid = int32(len(s.hot) - 1)
	}
	q := &s.hot[pid]
	*q = hot{
		tier: uint8(pol.Tier), shares: float32(pol.Shares), last: now,
		due: none,
		// Never dispatched: as long ago as the 32-bit distance can say.
		lastSeq: uint32(s.seq) - 1<<31,
	}
	s.cold[pid] = cold{name: name}
	if q.holdsP1() {
		q.p1 = s.cfg.P1Burst * float64(q.shares)
	}
	if q.holdsP2() {
		q.p2 = s.cfg.P2Burst * float64(q.shares)
	}
	s.byName[name] = pid
	return pid
}

// refillLocked brings q's buckets up to now. Refill depends only on the
// clock and q's own shares, never on the server or other participants. A
// now earlier than the last refill (clock readings taken before the lock
// arrive out of order) changes nothing.
func (s *Scheduler) refillLocked(q *hot, now int64) {
	if now <= q.last {
		return
	}
	dt := float64(now-q.last) / 1e9
	if q.holdsP1() {
		q.p1 = min(q.p1+s.cfg.P1Rate*float64(q.shares)*dt, s.cfg.P1Burst*float64(q.shares))
	}
	if q.holdsP2() {
		q.p2 = min(q.p2+s.cfg.P2Rate*float64(q.shares)*dt, s.cfg.P2Burst*float64(q.shares))
	}
	q.last = now
}

// classOf is the highest class q's balances support right now.
func classOf(q *hot) Class {
	switch {
	case q.holdsP1() && q.p1 >= 1-eps:
		return P1
	case q.holdsP2() && q.p2 >= 1-eps:
		return P2
	}
	return P3
}

// maxRepay bounds a participant's debt: the time its refill takes to bring
// a balance back to one credit after a completion charged it. A cost
// beyond that (an upstream's cost header of 1e12, a request timed in
// nanoseconds of cost_unit) charges only as much, so the debt stays a
// number of nanoseconds an int64 holds, and a wake-up time never wraps
// into the past, where the loop would set it again forever.
const maxRepay = 24 * time.Hour

// riseAt is when q's class next improves by refill alone, or none: at most
// maxRepay after q.last, which a rate set very low (refill slower than a
// credit a day) also respects, its timer then set again a day on.
func (s *Scheduler) riseAt(q *hot, c Class) int64 {
	due := int64(none)
	at := func(b, rate float64) int64 {
		ns := math.Ceil((1 - b) / rate * 1e9)
		if !(ns < float64(maxRepay)) { // NaN included
			ns = float64(maxRepay)
		}
		return q.last + max(int64(ns), 0)
	}
	if c > P1 && q.holdsP1() {
		due = at(q.p1, s.cfg.P1Rate*float64(q.shares))
	}
	if c > P2 && q.holdsP2() {
		if d := at(q.p2, s.cfg.P2Rate*float64(q.shares)); due == none || d < due {
			due = d
		}
	}
	return due
}

// placeLocked restores the invariant after q's queue or balances changed: a
// queue with work is linked in the ring of exactly the class its balances
// support, and parked on a timer if refill alone can lift it higher.
func (s *Scheduler) placeLocked(pid int32, now int64) {
	q := &s.hot[pid]
	s.refillLocked(q, now)
	var want Class
	if q.queue > 0 {
		want = classOf(q)
	}
	switch {
	case want != Class(q.ring):
		if q.ring != 0 {
			s.unlinkLocked(pid)
		}
		if want != 0 {
			s.linkLocked(pid, want)
		}
	case want != 0 && q.where == inNone: // just served, stays in its class: behind everyone
		q.where, q.slot = inBack, s.pushLocked(&s.rings[want].back, pid)
	}
	due := int64(none)
	if want > P1 {
		due = s.riseAt(q, want)
	}
	if due == none {
		s.timerDelLocked(pid)
	} else {
		s.timerSetLocked(pid, due)
	}
}

// dispatchLocked makes one decision at now and sends the ticket at the
// head of the chosen queue, or returns nil when nothing waits or MaxInFlight
// is reached. It allocates nothing.
func (s *Scheduler) dispatchLocked(now int64) *Ticket {
	if s.cfg.MaxInFlight > 0 && s.inFlight >= s.cfg.MaxInFlight {
		return nil
	}
	pid, c := s.pickLocked(now)
	if pid == none {
		return nil
	}
	q := &s.hot[pid]
	t := q.head
	// The new head's prev is left stale, not cleared: the head's prev is
	// never read, and not touching the next ticket saves a cache miss.
	q.head = t.next
	t.next = nil
	q.queue--
	s.chargeLocked(pid, c, now)
	qc := &s.cold[pid]
	if q.head == nil {
		qc.tail = nil
	}
	qc.lastClass = uint8(c)
	qc.dispatched[c]++
	if qc.held { // the place kept for it
		qc.held = false
		s.holds--
	}
	q.inflight++
	s.inFlight++
	w := max(now-t.enq, 0)
	t.waited.Store(w)
	s.wait.observe(w)
	t.class, t.state = c, ticketDispatched
	if t.ready != nil {
		t.ready <- struct{}{} // never blocks: one send per ticket into capacity 1
	}
	return t
}

// pickLocked is the decision itself: it relinks the parked queues that are
// due, takes the best class with an eligible queue and the queue at the
// head of that class's ring, so the class's next turn resumes after this
// queue. It returns none if no queue has work. It reads and writes only
// hot state and ring arrays: no ticket, no cold record.
func (s *Scheduler) pickLocked(now int64) (int32, Class) {
	s.runTimersLocked(now)
	c := P1
	for c <= P3 && s.rings[c].n == 0 {
		c++
	}
	if c > P3 {
		return none, 0
	}
	if s.inFlight >= s.cfg.MaxInFlight-s.reserve && s.cfg.MaxInFlight > 0 {
		return s.pickReservedLocked(c, now)
	}
	s.visits++
	// The queue stays a member, entry-less, until placeLocked pushes it
	// back at the tail or moves it.
	pid := s.popLocked(s.turnFifoLocked(&s.rings[c]))
	s.hot[pid].where = inNone
	return pid, c
}

// pickReservedLocked is pickLocked for the last places (s.reserve of
// them: the fair-share rule's floor of MaxInFlight). A participant under
// its share of places (MaxInFlight over the participants with work queued
// or in flight or ended within Window, at least the reserve) goes first,
// from the best class that has one; the queues of participants at or over
// their share are passed over, each behind everyone in its ring, without a
// turn. With nobody under its share waiting, the queue at the head of the
// best class is served, unless every place left is kept for a participant
// between two of its requests (holdLocked). The queues passed over hold
// their share each, so there are at most MaxInFlight/reserve of them
// however many participants there are: 20 from 40 places up, fewer than
// 40 below.
func (s *Scheduler) pickReservedLocked(best Class, now int64) (int32, Class) {
	s.expireLocked(now)
	share := int32(pools.Share(s.cfg.MaxInFlight, s.reserve, s.engaged))
	for c := best; c <= P3; c++ {
		r := &s.rings[c]
		// Each member is popped once: one passed over goes to the
		// back's tail, behind every member not popped yet.
		for range r.n {
			s.visits++
			pid := s.popLocked(r.serving())
			q := &s.hot[pid]
			if q.inflight < share {
				q.where = inNone
				return pid, c
			}
			q.where, q.slot = inBack, s.pushLocked(&r.back, pid)
		}
	}
	// Nobody under its share waits: the others may have the places not
	// kept for one between two requests (holdLocked), from the best class,
	// the queue that was at the head of its ring (the pass above turned
	// the ring round once).
	s.expireHoldsLocked(now)
	if s.inFlight+s.holds >= s.cfg.MaxInFlight {
		return none, 0
	}
	s.visits++
	pid := s.popLocked(s.rings[best].serving())
	s.hot[pid].where = inNone
	return pid, best
}

// chargeLocked completes a class-c turn of pid once its queue has given up
// the ticket: one credit, flat, from the bucket of the class it goes out
// under, then the queue is placed where its new balances and queue put it.
func (s *Scheduler) chargeLocked(pid int32, c Class, now int64) {
	q := &s.hot[pid]
	s.refillLocked(q, now)
	switch c {
	case P1:
		q.p1--
	case P2:
		q.p2--
	}
	s.seq++
	q.lastSeq = uint32(s.seq)
	s.dispatched[c]++
	s.placeLocked(pid, now)
	if len(s.hot) >= prefetchFrom {
		s.prefetchNextLocked()
	}
}

// runTimersLocked relinks every parked queue whose climb is due.
func (s *Scheduler) runTimersLocked(now int64) {
	for s.inOrder.live > 0 || len(s.timers) > hpad {
		pid := s.popDueLocked(now)
		if pid == none {
			return
		}
		s.visits++
		s.placeLocked(pid, now)
	}
}

// ticketChunk is how many tickets one allocation provides. Tickets are
// 64 bytes, so a chunk is one 4 KiB allocation; a ticket a caller keeps
// alive keeps its chunk alive, which bounds the cost of holding on to one.
const ticketChunk = 64

// newTicketLocked hands out a zeroed ticket from the current chunk, so
// Submit allocates once per ticketChunk requests instead of every time.
// Tickets are never recycled: a caller may hold one forever.
func (s *Scheduler) newTicketLocked() *Ticket {
	if len(s.tickets) == 0 {
		s.tickets = make([]Ticket, ticketChunk)
	}
	t := &s.tickets[0]
	s.tickets = s.tickets[1:]
	t.s = s
	return t
}

// withdrawLocked removes a still-queued ticket without touching anyone else.
func (s *Scheduler) withdrawLocked(t *Ticket, now int64) {
	q, qc := &s.hot[t.pid], &s.cold[t.pid]
	// A head's prev is stale (dispatch leaves it, see dispatchLocked): at
	// the head, the ticket before it is nobody.
	prev := t.prev
	if q.head == t {
		prev = nil
		q.head = t.next
	} else {
		prev.next = t.next
	}
	if qc.tail == t {
		qc.tail = prev
	} else {
		t.next.prev = prev
	}
	t.next, t.prev = nil, nil
	t.state = ticketWithdrawn
	t.waited.Store(max(now-t.enq, 0))
	q.queue--
	if q.queue == 0 {
		if q.inflight == 0 {
			s.idleLocked(t.pid, now)
		}
		s.placeLocked(t.pid, now)
	}
}

// engageLocked counts pid among the participants the places are divided
// between, from now on while it has work (its first request queued), and
// notes whether its requests come one after another (holdLocked).
func (s *Scheduler) engageLocked(pid int32, now int64) {
	if s.cfg.MaxInFlight == 0 {
		return
	}
	qc := &s.cold[pid]
	// One after another: its first (since it was last forgotten: the
	// benefit of the doubt, once), sent within Keep of the last end, or
	// while another of its requests is under way (whose end then finds
	// this one queued and stamps no lastEnd).
	qc.steady = !qc.ended || s.hot[pid].inflight > 0 || now-qc.lastEnd <= int64(s.cfg.Keep)
	if !qc.engaged {
		qc.engaged = true
		s.engaged++
	}
}

// idleLocked notes that pid has nothing queued or in flight since now: it
// stays counted for Window (expireLocked, run here too, so that the record
// of idle times holds about a Window of them whoever calls). Without a
// bound on the places nothing is counted.
func (s *Scheduler) idleLocked(pid int32, now int64) {
	if s.cfg.MaxInFlight == 0 {
		return
	}
	s.expireLocked(now)
	s.cold[pid].idleAt = now
	s.idle.push(timer{due: now, pid: pid})
}

// holdLocked keeps a place for pid, whose request just ended with nothing
// of it queued, if it holds fewer places than its share and its requests
// come one after another (this one was its first, or came within Keep of
// the end of the one before, or while another was under way: a
// participant whose requests come further apart keeps nothing idle, and
// one that sent one request and stopped, a place for Keep once): until its
// next request or for Keep, whichever comes first, participants at or over
// their share do not take it (pickReservedLocked; another under its share
// may). A client that sends one request after another thus finds the place
// it gave back, however long the others' requests are. At most the
// reserve's worth of places are kept at once; a participant's one place,
// kept from its latest request.
func (s *Scheduler) holdLocked(pid int32, now int64) {
	if s.cfg.MaxInFlight == 0 {
		return
	}
	s.expireLocked(now)
	s.expireHoldsLocked(now)
	qc := &s.cold[pid]
	qc.ended, qc.lastEnd = true, now
	if !qc.steady || int(s.hot[pid].inflight) >= pools.Share(s.cfg.MaxInFlight, s.reserve, s.engaged) {
		return
	}
	if !qc.held {
		if s.holds >= s.reserve {
			return
		}
		qc.held = true
		s.holds++
	}
	qc.holdUntil = now + int64(s.cfg.Keep)
	s.holdQ.push(timer{due: qc.holdUntil, pid: pid})
}

// expireHoldsLocked lets go of the places kept until now or before. An
// entry of a place since taken, or kept again later, is stale: its due no
// longer matches.
func (s *Scheduler) expireHoldsLocked(now int64) {
	expireUntil(&s.holdQ, now, func(e timer) {
		if qc := &s.cold[e.pid]; qc.held && qc.holdUntil == e.due {
			qc.held = false
			s.holds--
		}
	})
}

// expireLocked stops counting the participants idle for Window by now. An
// entry of one that has work (or has had work since and is idle again,
// or was forgotten, its handle perhaps reused) is stale: it is not idle,
// or its idleAt no longer matches.
func (s *Scheduler) expireLocked(now int64) {
	expireUntil(&s.idle, now-int64(s.cfg.Window), func(e timer) {
		q, qc := &s.hot[e.pid], &s.cold[e.pid]
		if qc.engaged && q.queue == 0 && q.inflight == 0 && qc.idleAt == e.due {
			qc.engaged = false
			s.engaged--
		}
	})
}

// expireUntil takes the entries of f due at until or before, in order
// (f's entries are in due order but for clock readings taken before the
// lock, which end a little late), and hands each to end.
func expireUntil(f *fifo[timer], until int64, end func(timer)) {
	for f.live > 0 {
		e := f.buf[f.head&f.mask()]
		if e.due > until {
			return
		}
		f.take()
		end(e)
	}
}

// doneLocked charges cost-1 back to the bucket that admitted t.
func (s *Scheduler) doneLocked(t *Ticket, cost float64, now int64) {
	t.state = ticketDone
	q := &s.hot[t.pid]
	s.refillLocked(q, now)
	if math.IsNaN(cost) {
		cost = 1
	}
	adj := max(cost, 0) - 1
	// floor is the debt maxRepay of refill repays: where the balance stops.
	floor := func(rate float64) float64 { return 1 - rate*float64(q.shares)*maxRepay.Seconds() }
	switch t.class {
	case P1:
		q.p1 = max(min(q.p1-adj, s.cfg.P1Burst*float64(q.shares)), min(q.p1, floor(s.cfg.P1Rate)))
	case P2:
		q.p2 = max(min(q.p2-adj, s.cfg.P2Burst*float64(q.shares)), min(q.p2, floor(s.cfg.P2Rate)))
	}
	q.inflight--
	s.inFlight--
	if q.queue > 0 {
		s.placeLocked(t.pid, now)
	} else {
		if q.inflight == 0 {
			s.idleLocked(t.pid, now)
		}
		s.holdLocked(t.pid, now)
	}
}

// sweepLocked forgets participants that are idle, have nothing queued or in
// flight and whose buckets are full again: a new one would be identical, so
// remembering it buys nothing and memory stays bounded by the active set.
func (s *Scheduler) sweepLocked(now int64) {
	s.lastSweep = now
	s.expireLocked(now)
	s.expireHoldsLocked(now)
	for pid := range s.hot {
		q := &s.hot[pid]
		if !q.live() || q.queue > 0 || q.inflight > 0 || s.cold[pid].engaged || s.cold[pid].held {
			continue
		}
		s.refillLocked(q, now)
		if q.holdsP1() && q.p1 < s.cfg.P1Burst*float64(q.shares) {
			continue
		}
		if q.holdsP2() && q.p2 < s.cfg.P2Burst*float64(q.shares) {
			continue
		}
		s.timerDelLocked(int32(pid))
		delete(s.byName, s.cold[pid].name)
		*q = hot{due: none}
		s.cold[pid] = cold{}
		s.free = append(s.free, int32(pid))
	}
}

// dispatch is the deterministic single step used by Run and by tests: ask
// for room, then make one decision at now.
func (s *Scheduler) dispatch(now int64) *Ticket {
	if s.cfg.HasRoom != nil && !s.cfg.HasRoom() {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dispatchLocked(now)
}

// Run is the dispatch loop. Before each dispatch it asks whether the server
// has room (MaxInFlight, then HasRoom); without room it waits Poll, or less
// if a ticket completes, and asks again. It never waits for a particular
// request to finish. Run returns ctx.Err() when ctx is done, or ErrRunning if
// another Run is active.
func (s *Scheduler) Run(ctx context.Context) error {
	if !s.run.CompareAndSwap(false, true) {
		return ErrRunning
	}
	defer s.run.Store(false)
	tm := time.NewTimer(time.Hour)
	defer tm.Stop()
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		room := s.cfg.HasRoom == nil || s.cfg.HasRoom()
		s.mu.Lock()
		now := s.now()
		if now-s.lastSweep >= int64(time.Second) {
			s.sweepLocked(now)
		}
		var t *Ticket
		if room {
			t = s.dispatchLocked(now)
		}
		work := s.workLocked()
		s.mu.Unlock()
		if t != nil {
			continue
		}
		// Nothing waiting: sleep until a Submit, but wake once a second to
		// forget idle participants. Waiting without room: poll.
		d := time.Second
		if work {
			d = s.cfg.Poll
		}
		tm.Reset(d)
		select {
		case <-ctx.Done():
		case <-s.wake:
		case <-tm.C:
		}
		if !tm.Stop() {
			select {
			case <-tm.C:
			default:
			}
		}
	}
}

// Snapshot returns a consistent view: totals, the wait histogram and every
// known participant sorted by name.
func (s *Scheduler) Snapshot() Snapshot {
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	snap := Snapshot{InFlight: s.inFlight, Dispatched: s.dispatched, Wait: s.wait.export()}
	snap.Participants = make([]ParticipantStat, 0, len(s.byName))
	for pid := range s.hot {
		q, qc := &s.hot[pid], &s.cold[pid]
		if !q.live() {
			continue
		}
		s.refillLocked(q, now)
		snap.Participants = append(snap.Participants, ParticipantStat{
			Participant: qc.name,
			Policy:      Policy{Tier: Tier(q.tier), Shares: int(q.shares)},
			Queue:       int(q.queue),
			InFlight:    int(q.inflight),
			P1:          q.p1,
			P2:          q.p2,
			LastClass:   Class(qc.lastClass),
			Dispatched:  qc.dispatched,
		})
	}
	slices.SortFunc(snap.Participants, func(a, b ParticipantStat) int { return strings.Compare(a.Participant, b.Participant) })
	return snap
}

type ticketState uint8

const (
	ticketQueued ticketState = iota
	ticketDispatched
	ticketWithdrawn
	ticketDone
)

// Ticket is one submitted request, from Submit until Done. Its 64 bytes
// are one cache line, the only one of the ticket a dispatch touches.
type Ticket struct {
	s          *Scheduler
	next, prev *Ticket // the participant's queue (prev unused at the head); guarded by s.mu
	// ready is made by Wait when it has to block, and receives the one send
	// at dispatch (capacity 1, so dispatch never blocks). A ticket nobody
	// waits on never needs one, and dispatch then touches no channel.
	ready  chan struct{} // guarded by s.mu
	waited atomic.Int64  // ns queued, set at dispatch or withdrawal
	enq    int64         // guarded by s.mu
	pid    int32         // guarded by s.mu
	state  ticketState   // guarded by s.mu
	class  Class         // guarded by s.mu
}

// Wait blocks until the ticket is dispatched and returns the class it went
// out under. If ctx is done first the ticket is withdrawn from its queue,
// leaving every other ticket where it was, and ctx.Err() is returned; if
// the two race and dispatch wins, Wait returns the class and the caller owns
// the slot (call Done). Waiting on a withdrawn ticket returns ErrWithdrawn.
func (t *Ticket) Wait(ctx context.Context) (Class, error) {
	s := t.s
	s.mu.Lock()
	if t.state != ticketQueued {
		c, err := t.settledLocked()
		s.mu.Unlock()
		return c, err
	}
	if t.ready == nil {
		t.ready = make(chan struct{}, 1)
	}
	ready := t.ready
	s.mu.Unlock()
	// A dispatch after the check above is buffered in ready, not lost.
	select {
	case <-ready:
		s.mu.Lock()
		defer s.mu.Unlock()
		return t.class, nil
	case <-ctx.Done():
	}
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	if t.state == ticketQueued {
		s.withdrawLocked(t, now)
		return 0, ctx.Err()
	}
	return t.settledLocked()
}

// TryWait is Wait without blocking: ok is false while the ticket is still
// queued (then call Wait, or TryWait again); otherwise it returns what Wait
// would.
func (t *Ticket) TryWait() (c Class, ok bool, err error) {
	s := t.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if t.state == ticketQueued {
		return 0, false, nil
	}
	c, err = t.settledLocked()
	return c, true, err
}

// settledLocked is the outcome of a ticket that has left its queue.
func (t *Ticket) settledLocked() (Class, error) {
	if t.state == ticketWithdrawn {
		return 0, ErrWithdrawn
	}
	return t.class, nil
}

// Waited is how long the ticket was queued: submit to dispatch (or to
// withdrawal). It is 0 while the ticket is still queued.
func (t *Ticket) Waited() time.Duration { return time.Duration(t.waited.Load()) }

// Done reports completion with the request's real cost in credits (1 is an
// average request). cost-1 is charged to the bucket that admitted the
// ticket, refunding light work and putting heavy work into debt; negative
// costs count as 0 and NaN as 1. Done frees the server slot. Only the first
// call counts; Done on a ticket still queued withdraws it.
func (t *Ticket) Done(cost float64) {
	s := t.s
	now := s.now()
	s.mu.Lock()
	switch t.state {
	case ticketQueued:
		s.withdrawLocked(t, now)
	case ticketDispatched:
		s.doneLocked(t, cost, now)
	}
	// The freed slot matters to the loop only if a request waits for it;
	// with none, waking the loop would cost a goroutine switch for nothing.
	work := s.workLocked()
	s.mu.Unlock()
	if work {
		s.nudge()
	}
}
