// SPDX-License-Identifier: Apache-2.0

package metrics

// labelSet decides which projects of one group (a pool, the rate buckets or
// the scheduler's queues) keep their own label value and turns the daemon's
// per-project counts into counters that never go down.
//
// Labels are sticky: a project keeps its label for as long as the daemon
// reports it, so the set of named series does not churn with load. A slot
// frees only when its project drops out of the daemon's state (forgotten
// after idling), and then goes to the busiest unnamed project.
//
// The daemon's per-project counts are not counters in Prometheus's sense:
// they restart at zero when an idle project is forgotten and comes back, and
// a sum over the unnamed projects would lose a member whenever one is
// forgotten or moves to its own label. So each named series is kept here as
// the sum of its project's increases between scrapes, from zero when it got
// its label; it only grows. Where the pool gives its own total (admitted,
// refused), Other is that total less the named series (remainder), so the
// series of a pool always add up to its total.
type labelSet struct {
	max      int                          // named labels at most; the rest share Other
	named    map[string]bool              // projects with a label of their own
	last     map[string]map[string]uint64 // project -> counter -> raw value at the last scrape
	acc      map[string]map[string]uint64 // label -> counter -> value emitted
	otherMax map[string]uint64            // counter -> the largest remainder emitted for Other
}

func newLabelSet(max int) *labelSet {
	return &labelSet{max: max, named: map[string]bool{}, last: map[string]map[string]uint64{},
		acc: map[string]map[string]uint64{}, otherMax: map[string]uint64{}}
}

// assign takes the projects the daemon reports now, busiest first: it frees
// the labels and forgets the raw values of projects no longer reported and
// names newcomers while there is room.
func (s *labelSet) assign(present []string) {
	now := make(map[string]bool, len(present))
	for _, p := range present {
		now[p] = true
	}
	for p := range s.named {
		if !now[p] {
			delete(s.named, p)
			delete(s.acc, p)
		}
	}
	for p := range s.last {
		if !now[p] {
			// Forgotten by the daemon: if it comes back its counts start
			// from zero, which is what an absent entry means here.
			delete(s.last, p)
		}
	}
	for _, p := range present {
		if len(s.named) >= s.max {
			break
		}
		if s.named[p] || p == Other {
			// A project (a cgroup, for the kernel's pool) that is itself
			// named like the overflow is summed with it rather than emitted
			// twice under one label.
			continue
		}
		s.named[p] = true
		// A newly named series starts at zero: the project's earlier
		// increases stay counted in Other, which keeps them, so nothing is
		// counted twice.
		s.acc[p] = map[string]uint64{}
	}
}

// remainder is Other's value of a counter the group's pool totals itself:
// total less every named series. Named series only count increases their
// projects really made, so it never goes down while total does not; a
// named series that ends (its project forgotten) moves its value into
// Other. The guard keeps it monotonic should a caller's totals not be.
func (s *labelSet) remainder(counter string, total uint64) uint64 {
	var named uint64
	for p := range s.named {
		named += s.acc[p][counter]
	}
	r := uint64(0)
	if total > named {
		r = total - named
	}
	r = max(r, s.otherMax[counter])
	s.otherMax[counter] = r
	return r
}

// label is the label value of project.
func (s *labelSet) label(project string) string {
	if s.named[project] {
		return project
	}
	return Other
}

// count records project's raw counter value and adds its increase since the
// last scrape to the project's series. A value below the last one is a
// restart from zero, so all of it is new.
func (s *labelSet) count(project, counter string, raw uint64) {
	last := s.last[project]
	if last == nil {
		last = map[string]uint64{}
		s.last[project] = last
	}
	prev, seen := last[counter]
	delta := raw
	if seen && raw >= prev {
		delta = raw - prev
	}
	last[counter] = raw
	l := s.label(project)
	acc := s.acc[l]
	if acc == nil {
		acc = map[string]uint64{}
		s.acc[l] = acc
	}
	acc[counter] += delta
}

// total is the value of label's counter series.
func (s *labelSet) total(label, counter string) uint64 { return s.acc[label][counter] }

// counters returns the counter names label's series has, for counters with
// a variable part (eviction reasons).
func (s *labelSet) counters(label string) map[string]uint64 { return s.acc[label] }

// otherUsed reports whether the Other series exist: once they do, they are
// emitted on every scrape, so they do not vanish and come back.
func (s *labelSet) otherUsed() bool { return s.acc[Other] != nil }

// markOther records that the Other series exist, so they keep being
// emitted.
func (s *labelSet) markOther() {
	if s.acc[Other] == nil {
		s.acc[Other] = map[string]uint64{}
	}
}
