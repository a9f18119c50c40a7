// SPDX-License-Identifier: Apache-2.0

package scheduler

// The parked-queue timers: a 4-ary min-heap of (due, pid) with lazy
// deletion. A participant's live timer is hot.due; a heap entry whose due
// no longer matches is stale and is dropped when it reaches the top. Not
// tracking heap positions in the participants means a sift touches only
// the contiguous heap array, never a random participant: at 100k parked
// queues that is the difference between a few cache misses per dispatch
// and one per heap level. Stale entries are bounded by compacting when they
// outnumber live ones.
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
	s.timers = append(s.timers, timer{due: due, pid: pid})
	h := s.heapLocked()
	siftUp(h, len(h)-1)
	if s.staleTimers > len(h)/2+64 {
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
	for len(s.timers) > hpad && s.timers[hpad].due <= now {
		top := s.timers[hpad]
		s.popTopLocked()
		q := &s.hot[top.pid]
		if q.due == top.due {
			q.due = none
			return top.pid
		}
		s.staleTimers--
	}
	return none
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

// compactTimersLocked rebuilds the heap from the live timers: O(n), run
// only when at least half the entries are stale, so O(1) amortized.
func (s *Scheduler) compactTimersLocked() {
	h := s.heapLocked()[:0]
	for _, tm := range s.heapLocked() {
		q := &s.hot[tm.pid]
		if q.live() && q.due == tm.due {
			h = append(h, tm)
			q.due = -2 - q.due // mark taken so a duplicate entry is dropped
		}
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
