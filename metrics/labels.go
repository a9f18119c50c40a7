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
// forgotten or moves to its own label. So each series is kept here as the
// sum of the increases of its members between scrapes; it only grows.
type labelSet struct {
	max   int                          // named labels at most; the rest share Other
	named map[string]bool              // projects with a label of their own
	last  map[string]map[string]uint64 // project -> counter -> raw value at the last scrape
	acc   map[string]map[string]uint64 // label -> counter -> value emitted
}

func newLabelSet(max int) *labelSet {
	return &labelSet{max: max, named: map[string]bool{}, last: map[string]map[string]uint64{},
		acc: map[string]map[string]uint64{}}
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
		// A newly named series starts at the project's own count (what it
		// would have shown had it been named all along); its earlier
		// increases stay counted in Other, which keeps them.
		acc := make(map[string]uint64, len(s.last[p]))
		for k, v := range s.last[p] {
			acc[k] = v
		}
		s.acc[p] = acc
	}
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
