// SPDX-License-Identifier: Apache-2.0

package labels

import "sort"

// Other is the label value of the projects beyond a group's cap.
const Other = "(other)"

// Set is the label policy's state for one group (see the package
// documentation). It is not safe for concurrent use: its owner scrapes one
// group at a time.
type Set struct {
	max      int                          // named labels at most (one value is kept for Other); the rest share Other
	named    map[string]bool              // projects with a label of their own
	last     map[string]map[string]uint64 // project -> counter -> raw value at the last scrape
	acc      map[string]map[string]uint64 // label -> counter -> value emitted
	otherMax map[string]uint64            // counter -> the largest remainder emitted for Other
}

// NewSet returns the set of one group whose series may carry at most
// maxLabels label values, Other included (at least 1: then every project is
// summed under Other).
func NewSet(maxLabels int) *Set {
	return &Set{max: max(maxLabels, 1) - 1, named: map[string]bool{}, last: map[string]map[string]uint64{},
		acc: map[string]map[string]uint64{}, otherMax: map[string]uint64{}}
}

// Assign takes the projects the owner reports now, busiest first: it frees
// the labels and forgets the raw values of projects no longer reported and
// names newcomers while there is room.
func (s *Set) Assign(present []string) {
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
			// Forgotten by the owner: if it comes back its counts start
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

// Remainder is Other's value of a counter the group's pool totals itself:
// total less every named series. Named series only count increases their
// projects really made, so it never goes down while total does not; a
// named series that ends (its project forgotten) moves its value into
// Other. The guard keeps it monotonic should a caller's totals not be.
func (s *Set) Remainder(counter string, total uint64) uint64 {
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

// Label is the label value of project.
func (s *Set) Label(project string) string {
	if s.named[project] {
		return project
	}
	return Other
}

// Count records project's raw counter value and adds its increase since the
// last scrape to the project's series. A value below the last one is a
// restart from zero, so all of it is new.
func (s *Set) Count(project, counter string, raw uint64) {
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
	l := s.Label(project)
	acc := s.acc[l]
	if acc == nil {
		acc = map[string]uint64{}
		s.acc[l] = acc
	}
	acc[counter] += delta
}

// Total is the value of label's counter series.
func (s *Set) Total(label, counter string) uint64 { return s.acc[label][counter] }

// Counters returns the counter names label's series has, for counters with
// a variable part (eviction reasons).
func (s *Set) Counters(label string) map[string]uint64 { return s.acc[label] }

// OtherUsed reports whether the Other series exist: once they do, they are
// emitted on every scrape, so they do not vanish and come back.
func (s *Set) OtherUsed() bool { return s.acc[Other] != nil }

// MarkOther records that the Other series exist, so they keep being
// emitted.
func (s *Set) MarkOther() {
	if s.acc[Other] == nil {
		s.acc[Other] = map[string]uint64{}
	}
}

// Busiest lists the projects of items in the order Assign takes them:
// busiest first, by load (compared key by key, the larger first), then by
// name.
func Busiest[T any](items []T, name func(T) string, load func(T) [2]uint64) []string {
	type entry struct {
		name string
		load [2]uint64
	}
	es := make([]entry, len(items))
	for i, it := range items {
		es[i] = entry{name(it), load(it)}
	}
	sort.Slice(es, func(i, j int) bool {
		a, b := es[i], es[j]
		if a.load[0] != b.load[0] {
			return a.load[0] > b.load[0]
		}
		if a.load[1] != b.load[1] {
			return a.load[1] > b.load[1]
		}
		return a.name < b.name
	})
	out := make([]string, len(es))
	for i, e := range es {
		out[i] = e.name
	}
	return out
}
