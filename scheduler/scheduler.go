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
)

// eps absorbs float rounding in "holds at least one credit": a timer computed
// for the instant a bucket reaches 1.0 must find it there.
const eps = 1e-9

// none marks an absent ring link, cursor or heap position.
const none = -1

// Scheduler orders requests from many participants onto one server. See the
// package documentation for the rule it implements.
type Scheduler struct {
	clk   Clock
	cfg   Config
	epoch time.Time     // internal times are nanoseconds since epoch
	wake  chan struct{} // nudges Run after Submit and Done; capacity 1
	run   atomic.Bool   // a Run loop is active

	mu          sync.Mutex // guards the fields below
	byName      map[string]int32
	policies    map[string]Policy // kept when an idle participant is forgotten
	parts       []participant     // dense handles; free slots listed in free
	free        []int32
	rings       [4]ring   // eligible non-empty queues by class, index 1..3
	timers      []timer   // 4-ary min-heap: when a parked queue can climb
	staleTimers int       // entries in timers that no longer match participant.due
	inFlight    int       // dispatched, not yet Done
	seq         uint64    // dispatches so far, numbers turns for entry placement
	dispatched  [4]uint64 // by class
	visits      uint64    // queues examined: the cursor's queue plus timer relinks
	wait        waitHist
	lastSweep   int64
}

// participant is one queue and its buckets. Only the Scheduler's mu guards
// it. The layout is 128 bytes, two cache lines: the fields every decision
// reads come first, so at 100k participants a dispatch costs the misses on
// this struct and the ticket, and nothing else.
type participant struct {
	head       *Ticket // FIFO, linked through Ticket.next/prev
	p1, p2     float64 // balances as of last; may be negative
	last       int64   // when p1/p2 were last refilled
	due        int64   // when refill lifts the class: the live timer; none if not parked
	next, prev int32   // ring links, valid while ring != 0
	queue      int32
	inflight   int32
	shares     float32
	tier       uint8 // a Tier
	ring       uint8 // Class of the ring the queue is linked in, 0 = none
	lastClass  uint8 // a Class
	live       bool
	// Second cache line.
	lastSeq    uint64 // s.seq at this participant's last dispatch; 0 = never
	tail       *Ticket
	dispatched [4]uint64
	name       string
}

func (q *participant) holdsP1() bool { return Tier(q.tier).holdsP1() }
func (q *participant) holdsP2() bool { return Tier(q.tier).holdsP2() }

// ring is a circular doubly linked list of participants threaded through
// participant.next/prev. cursor is the next queue to serve. Queues that
// entered at the cursor and have not been served yet sit in a run starting
// at the cursor; lastJump is the last of them, so later entrants line up
// behind it in arrival order instead of overtaking it.
type ring struct {
	cursor   int32
	lastJump int32
	n        int
}

type timer struct {
	due int64
	pid int32
}

// New returns a Scheduler. Zero Config fields take the package defaults; a
// nil clk means the system clock.
func New(cfg Config, clk Clock) (*Scheduler, error) {
	if clk == nil {
		clk = systemClock{}
	}
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
	for _, f := range []struct {
		name string
		v    float64
		min  float64
	}{{"P1Rate", cfg.P1Rate, 0}, {"P2Rate", cfg.P2Rate, 0}, {"P1Burst", cfg.P1Burst, 1}, {"P2Burst", cfg.P2Burst, 1}} {
		// A rate must be positive or a parked queue would never climb; a
		// burst below one credit could never pay for a dispatch.
		if math.IsNaN(f.v) || math.IsInf(f.v, 0) || f.v < f.min || (f.min == 0 && f.v <= 0) {
			return nil, fmt.Errorf("%s %v out of range: %w", f.name, f.v, ErrInvalidConfig)
		}
	}
	if cfg.MaxInFlight < 0 {
		return nil, fmt.Errorf("MaxInFlight %d is negative: %w", cfg.MaxInFlight, ErrInvalidConfig)
	}
	if cfg.Poll < 0 {
		return nil, fmt.Errorf("poll %v is negative: %w", cfg.Poll, ErrInvalidConfig)
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
	}
	for c := range s.rings {
		s.rings[c].cursor, s.rings[c].lastJump = none, none
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
	pid, ok := s.byName[participant]
	if !ok {
		return
	}
	q := &s.parts[pid]
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
func (s *Scheduler) Submit(participant string) *Ticket {
	now := s.now()
	t := &Ticket{s: s, ready: make(chan struct{}, 1)}
	s.mu.Lock()
	pid := s.lookupLocked(participant, now)
	q := &s.parts[pid]
	t.pid, t.enq = pid, now
	if q.tail == nil {
		q.head = t
	} else {
		q.tail.next, t.prev = t, q.tail
	}
	q.tail = t
	q.queue++
	if q.queue == 1 {
		s.placeLocked(pid, now)
	}
	s.mu.Unlock()
	s.nudge()
	return t
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
		s.parts = append(s.parts, participant{})
		pid = int32(len(s.parts) - 1)
	}
	q := &s.parts[pid]
	*q = participant{
		name: name, tier: uint8(pol.Tier), shares: float32(pol.Shares), last: now,
		next: none, prev: none, due: none, live: true,
	}
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
func (s *Scheduler) refillLocked(q *participant, now int64) {
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
func classOf(q *participant) Class {
	switch {
	case q.holdsP1() && q.p1 >= 1-eps:
		return P1
	case q.holdsP2() && q.p2 >= 1-eps:
		return P2
	}
	return P3
}

// riseAt is when q's class next improves by refill alone, or none.
func (s *Scheduler) riseAt(q *participant, c Class) int64 {
	due := int64(none)
	at := func(b, rate float64) int64 {
		return q.last + int64(math.Ceil((1-b)/rate*1e9))
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
	q := &s.parts[pid]
	s.refillLocked(q, now)
	var want Class
	if q.queue > 0 {
		want = classOf(q)
	}
	if want != Class(q.ring) {
		if q.ring != 0 {
			s.unlinkLocked(pid)
		}
		if want != 0 {
			s.linkLocked(pid, want)
		}
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

// linkLocked enters q into ring c. A queue that has not had a turn since
// every current member could have had one enters at the cursor and is
// served next, so a sparse participant is not queued behind a whole round;
// one that just had a turn enters behind everyone (just before the cursor),
// so re-submitting after each dispatch cannot jump the ring.
func (s *Scheduler) linkLocked(pid int32, c Class) {
	r, q := &s.rings[c], &s.parts[pid]
	q.ring = uint8(c)
	jump := q.lastSeq == 0 || s.seq-q.lastSeq >= uint64(r.n)
	if r.cursor == none {
		q.next, q.prev, r.cursor, r.n, r.lastJump = pid, pid, pid, 1, none
		if jump {
			r.lastJump = pid
		}
		return
	}
	at := r.cursor // insert before at
	if jump && r.lastJump != none {
		at = s.parts[r.lastJump].next
	}
	prev := s.parts[at].prev
	q.prev, q.next = prev, at
	s.parts[prev].next, s.parts[at].prev = pid, pid
	if jump {
		if r.lastJump == none {
			r.cursor = pid
		}
		r.lastJump = pid
	}
	r.n++
}

func (s *Scheduler) unlinkLocked(pid int32) {
	q := &s.parts[pid]
	r := &s.rings[q.ring]
	if r.lastJump == pid {
		r.lastJump = none
	}
	if r.n == 1 {
		r.cursor = none
	} else {
		s.parts[q.prev].next, s.parts[q.next].prev = q.next, q.prev
		if r.cursor == pid {
			r.cursor = q.next
		}
	}
	r.n--
	q.ring, q.next, q.prev = 0, none, none
}

// dispatchLocked makes one decision at now and returns the ticket sent, or
// nil when nothing waits or MaxInFlight is reached. It allocates nothing.
func (s *Scheduler) dispatchLocked(now int64) *Ticket {
	if s.cfg.MaxInFlight > 0 && s.inFlight >= s.cfg.MaxInFlight {
		return nil
	}
	s.runTimersLocked(now)
	var c Class
	switch {
	case s.rings[P1].n > 0:
		c = P1
	case s.rings[P2].n > 0:
		c = P2
	case s.rings[P3].n > 0:
		c = P3
	default:
		return nil
	}
	r := &s.rings[c]
	pid := r.cursor
	q := &s.parts[pid]
	s.visits++
	s.refillLocked(q, now)
	t := q.head
	// The new head's prev is left stale, not cleared: the head's prev is
	// never read, and not touching the next ticket saves a cache miss.
	q.head = t.next
	if q.head == nil {
		q.tail = nil
	}
	t.next = nil
	q.queue--
	// One credit, flat, from the bucket of the class it goes out under.
	switch c {
	case P1:
		q.p1--
	case P2:
		q.p2--
	}
	s.seq++
	q.lastSeq, q.lastClass = s.seq, uint8(c)
	q.dispatched[c]++
	q.inflight++
	s.dispatched[c]++
	s.inFlight++
	w := max(now-t.enq, 0)
	t.waited.Store(w)
	s.wait.observe(w)
	t.class, t.state = c, ticketDispatched
	r.cursor = q.next // the turn resumes after this queue
	if r.lastJump == pid {
		r.lastJump = none
	}
	s.placeLocked(pid, now)
	t.ready <- struct{}{} // never blocks: one send per queued ticket into capacity 1
	return t
}

// runTimersLocked relinks every parked queue whose climb is due.
func (s *Scheduler) runTimersLocked(now int64) {
	for {
		pid := s.popDueLocked(now)
		if pid == none {
			return
		}
		s.visits++
		s.placeLocked(pid, now)
	}
}

// withdrawLocked removes a still-queued ticket without touching anyone else.
func (s *Scheduler) withdrawLocked(t *Ticket, now int64) {
	q := &s.parts[t.pid]
	if q.head == t {
		q.head = t.next
	} else {
		t.prev.next = t.next
	}
	if q.tail == t {
		q.tail = t.prev
	} else {
		t.next.prev = t.prev
	}
	t.next, t.prev = nil, nil
	t.state = ticketWithdrawn
	t.waited.Store(max(now-t.enq, 0))
	q.queue--
	if q.queue == 0 {
		s.placeLocked(t.pid, now)
	}
}

// doneLocked charges cost-1 back to the bucket that admitted t.
func (s *Scheduler) doneLocked(t *Ticket, cost float64, now int64) {
	t.state = ticketDone
	q := &s.parts[t.pid]
	s.refillLocked(q, now)
	if math.IsNaN(cost) {
		cost = 1
	}
	adj := max(cost, 0) - 1
	switch t.class {
	case P1:
		q.p1 = min(q.p1-adj, s.cfg.P1Burst*float64(q.shares))
	case P2:
		q.p2 = min(q.p2-adj, s.cfg.P2Burst*float64(q.shares))
	}
	q.inflight--
	s.inFlight--
	if q.queue > 0 {
		s.placeLocked(t.pid, now)
	}
}

// sweepLocked forgets participants that are idle, have nothing queued or in
// flight and whose buckets are full again: a new one would be identical, so
// remembering it buys nothing and memory stays bounded by the active set.
func (s *Scheduler) sweepLocked(now int64) {
	s.lastSweep = now
	for pid := range s.parts {
		q := &s.parts[pid]
		if !q.live || q.queue > 0 || q.inflight > 0 {
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
		delete(s.byName, q.name)
		*q = participant{next: none, prev: none, due: none}
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
		work := s.rings[P1].n+s.rings[P2].n+s.rings[P3].n > 0
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
	for pid := range s.parts {
		q := &s.parts[pid]
		if !q.live {
			continue
		}
		s.refillLocked(q, now)
		snap.Participants = append(snap.Participants, ParticipantStat{
			Participant: q.name,
			Policy:      Policy{Tier: Tier(q.tier), Shares: int(q.shares)},
			Queue:       int(q.queue),
			P1:          q.p1,
			P2:          q.p2,
			LastClass:   Class(q.lastClass),
			Dispatched:  q.dispatched,
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

// Ticket is one submitted request, from Submit until Done.
type Ticket struct {
	s          *Scheduler
	ready      chan struct{} // capacity 1, one send at dispatch (reusable, unlike close)
	waited     atomic.Int64  // ns queued, set at dispatch or withdrawal
	next, prev *Ticket       // the participant's queue (prev unused at the head); guarded by s.mu
	enq        int64         // guarded by s.mu
	pid        int32         // guarded by s.mu
	state      ticketState   // guarded by s.mu
	class      Class         // written before ready is closed
}

// Wait blocks until the ticket is dispatched and returns the class it went
// out under. If ctx is done first the ticket is withdrawn from its queue,
// leaving every other ticket where it was, and ctx.Err() is returned; if
// the two race and dispatch wins, Wait returns the class and the caller owns
// the slot (call Done). Waiting on a withdrawn ticket returns ErrWithdrawn.
func (t *Ticket) Wait(ctx context.Context) (Class, error) {
	s := t.s
	if c, ok, err := t.settled(); ok {
		return c, err
	}
	// A dispatch after settled looked is buffered in ready, not lost.
	select {
	case <-t.ready:
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
	if t.state == ticketWithdrawn {
		return 0, ErrWithdrawn
	}
	return t.class, nil
}

// settled reports the outcome if the ticket has already left its queue.
func (t *Ticket) settled() (Class, bool, error) {
	t.s.mu.Lock()
	defer t.s.mu.Unlock()
	switch t.state {
	case ticketQueued:
		return 0, false, nil
	case ticketWithdrawn:
		return 0, true, ErrWithdrawn
	}
	return t.class, true, nil
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
	s.mu.Unlock()
	s.nudge()
}
