// SPDX-License-Identifier: Apache-2.0

package scheduler

// The parked-queue timers: a 4-ary min-heap keyed by due time, with each
// participant's position kept in participant.heapIdx so a timer can be moved
// or removed in O(log n) without searching. Four children per node halve the
// depth of a binary heap, and the depth is what costs cache misses at 100k.

func (s *Scheduler) timerSetLocked(pid int32, due int64) {
	q := &s.parts[pid]
	if i := q.heapIdx; i != none {
		old := s.timers[i].due
		if old == due {
			return
		}
		s.timers[i].due = due
		if due < old {
			s.siftUpLocked(int(i))
		} else {
			s.siftDownLocked(int(i))
		}
		return
	}
	s.timers = append(s.timers, timer{due: due, pid: pid})
	q.heapIdx = int32(len(s.timers) - 1)
	s.siftUpLocked(len(s.timers) - 1)
}

func (s *Scheduler) timerDelLocked(pid int32) {
	q := &s.parts[pid]
	i := int(q.heapIdx)
	if i == none {
		return
	}
	q.heapIdx = none
	last := len(s.timers) - 1
	if i != last {
		s.timers[i] = s.timers[last]
		s.parts[s.timers[i].pid].heapIdx = int32(i)
	}
	s.timers = s.timers[:last]
	if i != last {
		s.siftDownLocked(i)
		s.siftUpLocked(i)
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
		s.parts[h[i].pid].heapIdx = int32(i)
		i = p
	}
	h[i] = x
	s.parts[x.pid].heapIdx = int32(i)
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
		s.parts[h[i].pid].heapIdx = int32(i)
		i = m
	}
	h[i] = x
	s.parts[x.pid].heapIdx = int32(i)
}
