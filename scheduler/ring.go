// SPDX-License-Identifier: Apache-2.0

package scheduler

import "unsafe"

// A class's ring is two FIFO arrays of participant handles. Round robin
// pops the head and pushes the queue back at the tail, so the order of the
// next turns is written down in advance: the records of the queues a few
// turns ahead can be prefetched while the current one is served, and at
// 100k participants their cache misses overlap instead of following one
// another as they did when the ring was a list threaded through the
// records. Pushing and popping touch only the array, never a neighbour's
// record.
//
// A queue leaves a ring from the middle (its class changed, its queue
// emptied) by overwriting its entry with gone; the head skips such
// tombstones when it reaches them, reading nothing but the array. A full
// array that is at least half tombstones is squeezed instead of grown, so
// an array only grows when more than half of it is members, and is never
// more than four times its ring's peak membership.
type ring struct {
	// front holds the queues that entered at the cursor (see linkLocked)
	// in arrival order; they are served before back.
	front fifo[int32]
	// back holds everyone else in turn order: a queue just served goes to
	// its tail.
	back fifo[int32]
	// n counts members, including the queue being served between its pop
	// in pickLocked and its push back in placeLocked.
	n int
	// warm is the position in the fifo being served up to which records
	// have been prefetched.
	warm uint32
}

// fifo is a circular array: of handles for the rings, of timers for the
// ones set in due order. Positions are absolute and only grow (modulo
// 2^32): an entry's position never changes while the array grows, so a
// ring member's hot.slot stays valid without touching its record.
type fifo[T any] struct {
	buf        []T    // length a power of two, nil until the first push
	head, tail uint32 // entries are buf[p&mask] for head <= p < tail
	live       int    // entries that are not gone (a ring's tombstones)
}

// gone marks the entry of a queue that left the ring.
const gone = -1

// Where a ring member's entry is: hot.where.
const (
	inNone  = iota // not a member, or popped and being served
	inBack         // ring.back at hot.slot
	inFront        // ring.front at hot.slot
)

// prefetchAhead is how many turns ahead of the head records are
// prefetched: enough that a miss started now completes before its turn at
// a few tens of nanoseconds a decision, few enough to stay in L1.
const prefetchAhead = 8

// prefetchFrom is the participant count from which chargeLocked calls
// prefetchNextLocked, and the ring size from which it prefetches a ring's
// members. Below it their records (256 KiB) stay in cache, and a prefetch
// is a call that costs more than the hit it would speed up.
const prefetchFrom = 4096

func (f *fifo[T]) mask() uint32 { return uint32(len(f.buf) - 1) }

func (f *fifo[T]) full() bool { return int(f.tail-f.head) == len(f.buf) }

// add appends v at the tail of an f that is not full and returns its
// position.
func (f *fifo[T]) add(v T) uint32 {
	p := f.tail
	f.buf[p&f.mask()] = v
	f.tail++
	f.live++
	return p
}

// grow doubles the array, keeping every entry at its position.
func (f *fifo[T]) grow() {
	buf := make([]T, max(2*len(f.buf), 8))
	m := uint32(len(buf) - 1)
	for p := f.head; p != f.tail; p++ {
		buf[p&m] = f.buf[p&f.mask()]
	}
	f.buf = buf
}

// push appends v at the tail, growing f if it is full.
func (f *fifo[T]) push(v T) {
	if f.full() {
		f.grow()
	}
	f.add(v)
}

// take removes and returns the entry at the head.
func (f *fifo[T]) take() T {
	v := f.buf[f.head&f.mask()]
	f.head++
	f.live--
	return v
}

// serving is the fifo the next turn of r most likely comes from (for
// prefetching; pickLocked asks turnFifoLocked), and the one the reserved
// places' pass (pickReservedLocked) pops from: front first, so that the
// pass, which pops each member once and puts those it passes over at
// back's tail, meets every member once.
func (r *ring) serving() *fifo[int32] {
	if r.front.live > 0 {
		return &r.front
	}
	return &r.back
}

// turnFifoLocked is the fifo a turn of r comes from (pickLocked): front,
// the sparse queues, unless back's head has waited a round (it has not had
// a turn since every current member could have had one, as linkLocked
// asks of a queue entering). A name is sparse until its first turn: with
// front served before back without that bound, a steady stream of sparse
// queues (light participants whose requests together kept up with
// dispatch, or names made up one per request) kept back's queues from ever
// being served. Now a queue of back waits at most a round of the ring's
// members, as in plain round robin.
func (s *Scheduler) turnFifoLocked(r *ring) *fifo[int32] {
	if r.front.live == 0 {
		return &r.back
	}
	if r.back.live == 0 {
		return &r.front
	}
	if uint64(uint32(s.seq)-s.hot[s.headLocked(&r.back)].lastSeq) >= uint64(r.n) {
		return &r.back
	}
	return &r.front
}

// pushLocked appends pid at f's tail and returns its position.
func (s *Scheduler) pushLocked(f *fifo[int32], pid int32) uint32 {
	if f.full() {
		s.makeRoomLocked(f)
	}
	return f.add(pid)
}

// makeRoomLocked makes room in a full f. An array at least half
// tombstones is squeezed instead of grown: the entries behind a tombstone
// move up and their records learn their new positions, at most one record
// write per tombstone.
func (s *Scheduler) makeRoomLocked(f *fifo[int32]) {
	if used := int(f.tail - f.head); used > 0 && f.live <= used/2 {
		m, w := f.mask(), f.head
		for p := f.head; p != f.tail; p++ {
			id := f.buf[p&m]
			if id == gone {
				continue
			}
			if w != p {
				f.buf[w&m] = id
				s.hot[id].slot = w
			}
			w++
		}
		f.tail = w
		return
	}
	f.grow()
}

// popLocked takes the live entry nearest f's head; f must hold one.
func (s *Scheduler) popLocked(f *fifo[int32]) int32 {
	s.headLocked(f)
	return f.take()
}

// headLocked moves f's head past its tombstones and returns the live entry
// there; f must hold one.
func (s *Scheduler) headLocked(f *fifo[int32]) int32 {
	m := f.mask()
	for f.buf[f.head&m] == gone {
		f.head++
		s.skips++
	}
	return f.buf[f.head&m]
}

// drop turns the entry at p of a ring's fifo into a tombstone.
func drop(f *fifo[int32], p uint32) {
	f.buf[p&f.mask()] = gone
	if f.live--; f.live == 0 {
		f.head = f.tail // nothing left to skip to
	}
}

// linkLocked enters q into ring c. A queue that has not had a turn since
// every current member could have had one enters at the cursor and is
// served next, so a sparse participant is not queued behind a whole round;
// several such queues are served in their arrival order. One that just had
// a turn enters behind everyone, so re-submitting after each dispatch
// cannot jump the ring.
func (s *Scheduler) linkLocked(pid int32, c Class) {
	r, q := &s.rings[c], &s.hot[pid]
	q.ring = uint8(c)
	if uint64(uint32(s.seq)-q.lastSeq) >= uint64(r.n) {
		q.where, q.slot = inFront, s.pushLocked(&r.front, pid)
	} else {
		q.where, q.slot = inBack, s.pushLocked(&r.back, pid)
	}
	r.n++
}

func (s *Scheduler) unlinkLocked(pid int32) {
	q := &s.hot[pid]
	r := &s.rings[q.ring]
	switch q.where {
	case inBack:
		drop(&r.back, q.slot)
	case inFront:
		drop(&r.front, q.slot)
	}
	r.n--
	q.ring, q.where = 0, inNone
}

// prefetchNextLocked starts loading the records the next decisions will
// most likely read: those of the queues up to prefetchAhead turns ahead in
// every non-empty ring (the best class first, the others one entry a
// decision so a switch of class finds them warm), and those of the queues
// whose timers are due first. At 100k participants these are cache misses;
// started now, they overlap with each other and with this dispatch
// instead of stalling a later decision.
func (s *Scheduler) prefetchNextLocked() {
	budget := prefetchAhead
	for c := P1; c <= P3; c++ {
		r := &s.rings[c]
		if r.n < prefetchFrom { // empty, or its members' records fit in cache
			continue
		}
		f := r.serving()
		if int32(r.warm-f.head) < 0 || int32(r.warm-f.tail) > 0 {
			r.warm = f.head // the head moved past it, or to another fifo
		}
		m := f.mask()
		for ; budget > 0 && r.warm != f.tail && r.warm-f.head < prefetchAhead; r.warm++ {
			if pid := f.buf[r.warm&m]; pid != gone {
				s.prefetchRecordsLocked(pid)
			}
			budget--
		}
		budget = min(budget, 1)
	}
	s.prefetchTimersLocked()
}

// prefetchRecordsLocked starts loading both of pid's records: a dispatch
// reads and writes the hot one and updates the cold one's statistics.
func (s *Scheduler) prefetchRecordsLocked(pid int32) {
	prefetch(unsafe.Pointer(&s.hot[pid]))
	prefetch(unsafe.Pointer(&s.cold[pid]))
}
