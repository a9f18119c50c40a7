// SPDX-License-Identifier: Apache-2.0

package scheduler

// The parked-queue timers: a 4-ary min-heap of (due, pid) with lazy
// deletion. A participant's live timer is participant.due; a heap entry
// whose due no longer matches is stale and is dropped when it reaches the
// top. Not tracking heap positions in the participants means a sift touches
// only the contiguous heap array, never a random participant: at 100k
// parked queues that is the difference between a few cache misses per
// dispatch and one per heap level. Stale entries are bounded by compacting
// when they outnumber live ones.

func (s *Scheduler) timerSetLocked(pid int32, due int64) {
	q := &s.parts[pid]
	if q.due == due {
		return
	}
	if q.due != none {
		s.staleTimers++
	}
	q.due = due
	s.timers = append(s.timers, timer{due: due, pid: pid})
	s.siftUpLocked(len(s.timers) - 1)
	if s.staleTimers > len(s.timers)/2+64 {
		s.compactTimersLocked()
	}
}

func (s *Scheduler) timerDelLocked(pid int32) {
	q := &s.parts[pid]
	if q.due != none {
		q.due = none
		s.staleTimers++
	}
}

// popDueLocked returns the next participant whose live timer is due at now,
// dropping stale entries on the way, or none.
func (s *Scheduler) popDueLocked(now int64) int32 {
	for len(s.timers) > 0 && s.timers[0].due <= now {
		top := s.timers[0]
		s.popTopLocked()
		q := &s.parts[top.pid]
		if q.due == top.due {
			q.due = none
			return top.pid
		}
		s.staleTimers--
	}
	return none
}

func (s *Scheduler) popTopLocked() {
	last := len(s.timers) - 1
	s.timers[0] = s.timers[last]
	s.timers = s.timers[:last]
	if last > 0 {
		s.siftDownLocked(0)
	}
}

// compactTimersLocked rebuilds the heap from the live timers: O(n), run
// only when at least half the entries are stale, so O(1) amortized.
func (s *Scheduler) compactTimersLocked() {
	h := s.timers[:0]
	for _, tm := range s.timers {
		q := &s.parts[tm.pid]
		if q.live && q.due == tm.due {
			h = append(h, tm)
			q.due = -2 - q.due // mark taken so a duplicate entry is dropped
		}
	}
	for i := range h {
		q := &s.parts[h[i].pid]
		q.due = -2 - q.due
	}
	s.timers = h
	s.staleTimers = 0
	for i := len(h)/4 + 1; i >= 0; i-- {
		if i < len(h) {
			s.siftDownLocked(i)
		}
	}
}

func (s *Scheduler) siftUpLocked(i int) {
	h := s.timers
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

func (s *Scheduler) siftDownLocked(i int) {
	h := s.timers
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
