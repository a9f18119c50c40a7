// SPDX-License-Identifier: Apache-2.0

package scheduler

// The parked-queue timers: a FIFO of the timers set in due order and a
// 4-ary min-heap of the others, both of (due, pid), with lazy deletion.
//
// Timers are mostly set in due order: a queue parked now, short of a
// credit by less than one, rises within about one refill interval, and
// with similar policies after the queues parked before it. Those go to
// the FIFO, where setting and taking a timer touch the two ends of an
// array. In a heap of 100k parked queues every pop moves the last entry to
// the root and sifts it down to a leaf, a cache miss at each level below
// the cached top. A timer due before the FIFO's last goes to the heap; the
// next timer due is the earlier of the two heads.
//
// A participant's live timer is hot.due; an entry whose due no longer
// matches is stale and is dropped when it comes up. Not tracking entry
// positions in the participants means setting a timer or sifting touches
// only the timer arrays, never another participant's record. Stale
// entries are bounded by compacting when they outnumber live ones.
//
// The heap starts hpad entries into s.timers. Entries are 16 bytes, so the
// four children of heap node i (4i+1..4i+4, at slots 4i+4..4i+7) then share
// one 64-byte cache line whenever the array is line aligned (Go aligns the
// large allocations where it matters), and a sift level costs at most one
// miss instead of two.
const hpad = 3

// heapLocked is the heap proper, without the padding.
func (s *Scheduler) heapLocked() []timer { return s.timers[hpad:] }

func (s *Scheduler) timerSetLocked(pid int32, due int64) {
	q := &s.hot[pid]
	if q.due == due {
		return
	}
	if q.due != none {
		s.staleTimers++
	}
	q.due = due
	t := timer{due: due, pid: pid}
	if r := &s.inOrder; r.live == 0 || r.buf[(r.tail-1)&r.mask()].due <= due {
		r.push(t)
	} else {
		s.timers = append(s.timers, t)
		h := s.heapLocked()
		siftUp(h, len(h)-1)
	}
	if s.staleTimers > (len(s.timers)-hpad+s.inOrder.live)/2+64 {
		s.compactTimersLocked()
	}
}

func (s *Scheduler) timerDelLocked(pid int32) {
	q := &s.hot[pid]
	if q.due != none {
		q.due = none
		s.staleTimers++
	}
}

// popDueLocked returns the next participant whose live timer is due at now,
// dropping stale entries on the way, or none.
func (s *Scheduler) popDueLocked(now int64) int32 {
	for {
		r, h := &s.inOrder, s.heapLocked()
		var t timer
		fromFIFO := r.live > 0 && (len(h) == 0 || r.buf[r.head&r.mask()].due <= h[0].due)
		switch {
		case fromFIFO:
			t = r.buf[r.head&r.mask()]
		case len(h) > 0:
			t = h[0]
		default:
			return none
		}
		if t.due > now {
			return none
		}
		if fromFIFO {
			r.take()
		} else {
			s.popTopLocked()
		}
		q := &s.hot[t.pid]
		if q.due == t.due {
			q.due = none
			return t.pid
		}
		s.staleTimers--
	}
}

func (s *Scheduler) popTopLocked() {
	h := s.heapLocked()
	last := len(h) - 1
	h[0] = h[last]
	s.timers = s.timers[:hpad+last]
	if last > 0 {
		siftDown(h[:last], 0)
	}
}

// compactTimersLocked drops the stale entries of the FIFO (in place, in
// order) and rebuilds the heap from its live ones: O(n), run only when at
// least half the entries are stale, so O(1) amortized.
func (s *Scheduler) compactTimersLocked() {
	// keep marks an entry's participant taken, so a duplicate entry (in
	// either structure) is dropped; the marks are undone below.
	keep := func(t timer) bool {
		q := &s.hot[t.pid]
		if q.live() && q.due == t.due {
			q.due = -2 - q.due
			return true
		}
		return false
	}
	r := &s.inOrder
	m, w := r.mask(), r.head
	for p := r.head; p != r.tail; p++ {
		if t := r.buf[p&m]; keep(t) {
			r.buf[w&m] = t
			w++
		}
	}
	r.tail, r.live = w, int(w-r.head)
	h := s.heapLocked()[:0]
	for _, tm := range s.heapLocked() {
		if keep(tm) {
			h = append(h, tm)
		}
	}
	for p := r.head; p != r.tail; p++ {
		q := &s.hot[r.buf[p&m].pid]
		q.due = -2 - q.due
	}
	for i := range h {
		q := &s.hot[h[i].pid]
		q.due = -2 - q.due
	}
	s.timers = s.timers[:hpad+len(h)]
	s.staleTimers = 0
	for i := len(h)/4 + 1; i >= 0; i-- {
		if i < len(h) {
			siftDown(h, i)
		}
	}
}

func siftUp(h []timer, i int) {
	x := h[i]
	for i > 0 {
		p := (i - 1) / 4
		if h[p].due <= x.due {
			break
		}
		h[i] = h[p]
		i = p
	}
	h[i] = x
}

func siftDown(h []timer, i int) {
	n := len(h)
	x := h[i]
	for {
		c := 4*i + 1
		if c >= n {
			break
		}
		m := c
		for j := c + 1; j < c+4 && j < n; j++ {
			if h[j].due < h[m].due {
				m = j
			}
		}
		if h[m].due >= x.due {
			break
		}
		h[i] = h[m]
		i = m
	}
	h[i] = x
}

// timerAhead is how many timers ahead of the FIFO's head records are
// prefetched: the FIFO gives up about one a decision.
const timerAhead = 4

// prefetchTimersLocked starts loading the records of the queues whose
// timers are due next: those of the entry timerAhead behind the FIFO's
// head, and those of the heap's top and its four children, among which is
// the heap's second. What did not change since the last decision is not
// prefetched again: with no timer due, these would be calls for lines
// already in cache. Head tickets are not prefetched: measured
// (BenchmarkFlat, RingOnly, DispatchNotify at 100k), doing so two ways
// bought nothing and cost the decision its calls.
func (s *Scheduler) prefetchTimersLocked() {
	pf := &s.timerPrefetched
	if r := &s.inOrder; r.live > 0 && r.head != pf.head {
		m := r.mask()
		if r.live > timerAhead {
			s.prefetchRecordsLocked(r.buf[(r.head+timerAhead)&m].pid)
		}
		pf.head = r.head
	}
	if h := s.heapLocked(); len(h) > 0 && h[0] != pf.top {
		for i := range min(len(h), 5) {
			s.prefetchRecordsLocked(h[i].pid)
		}
		pf.top = h[0]
	}
}
