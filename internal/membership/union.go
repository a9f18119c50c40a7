// SPDX-License-Identifier: Apache-2.0

package membership

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	"github.com/fairshare-dev/fairshare/internal/project"
)

// Input is one source's last scan.
type Input struct {
	Source string
	Found
}

// Refusal is a member Resolve did not take (or a cgroup a source skipped,
// with an empty Project), with why.
type Refusal struct {
	Entry
	Reason string `json:"reason"`
}

// Result is the union of the sources: each cgroup at most once, and no
// cgroup at, above or below another project's.
type Result struct {
	Accepted []Entry   `json:"accepted"` // sorted by Compare
	Refused  []Refusal `json:"refused"`  // sorted by Compare of their entries
}

// Resolve unions the inputs' members. A member is refused when its project
// name or cgroup path is invalid, when its cgroup is claimed already (by
// another source, or by another project of the same source), or when it is
// below or above a cgroup of another project (nesting within one project
// is allowed: either way the socket counts for that project).
//
// Which of two conflicting members wins does not depend on the order the
// sources listed them in: first the one in prev (the accepted set in force,
// so a newcomer never evicts a registration that was enforced), then the
// one of the earlier input, then the smaller by Compare. The result is a
// function of its arguments, so a conflict is refused the same way at every
// tick and can be reported once.
//
// Cost: O(n log n) for the order and O(n * depth) map operations for the
// checks, n the members of all inputs.
func Resolve(inputs []Input, prev []Entry) Result {
	type candidate struct {
		Entry
		rank int // 0: in prev; then 1 + the input's index
	}
	inPrev := make(map[Entry]bool, len(prev))
	for _, e := range prev {
		inPrev[e] = true
	}
	var res Result
	n := 0
	for _, in := range inputs {
		n += len(in.Members)
	}
	cands := make([]candidate, 0, n)
	for i, in := range inputs {
		for _, m := range in.Members {
			e := Entry{Member: m, Source: in.Source}
			r := 1 + i
			if inPrev[e] {
				r = 0
			}
			cands = append(cands, candidate{e, r})
		}
		for _, s := range in.Skipped {
			res.Refused = append(res.Refused, Refusal{Entry{Member{Cgroup: s.Cgroup}, in.Source}, s.Reason})
		}
	}
	slices.SortFunc(cands, func(a, b candidate) int {
		if a.rank != b.rank {
			return a.rank - b.rank
		}
		return Compare(a.Entry, b.Entry)
	})

	taken := make(map[string]Entry, len(cands))    // cgroup -> its member
	below := make(map[string]examples, len(cands)) // cgroup -> members below it
	for i, c := range cands {
		if i > 0 && c.Entry == cands[i-1].Entry {
			continue // the same member twice in one source
		}
		if reason := check(c.Entry, taken, below); reason != "" {
			res.Refused = append(res.Refused, Refusal{c.Entry, reason})
			continue
		}
		taken[c.Cgroup] = c.Entry
		for a := range ancestors(c.Cgroup) {
			ex := below[a]
			ex.add(c.Entry)
			below[a] = ex
		}
		res.Accepted = append(res.Accepted, c.Entry)
	}
	slices.SortFunc(res.Accepted, Compare)
	slices.SortFunc(res.Refused, func(a, b Refusal) int {
		if c := Compare(a.Entry, b.Entry); c != 0 {
			return c
		}
		return strings.Compare(a.Reason, b.Reason)
	})
	return res
}

// check returns why e cannot join the members taken so far, or "".
func check(e Entry, taken map[string]Entry, below map[string]examples) string {
	if err := project.Validate(e.Project); err != nil {
		return err.Error()
	}
	if err := ValidCgroup(e.Cgroup); err != nil {
		return err.Error()
	}
	if t, ok := taken[e.Cgroup]; ok {
		if t.Project == e.Project {
			return fmt.Sprintf("also registered for project %s by source %s", t.Project, t.Source)
		}
		return fmt.Sprintf("registered to project %s by source %s", t.Project, t.Source)
	}
	for a := range ancestors(e.Cgroup) {
		if t, ok := taken[a]; ok && t.Project != e.Project {
			return fmt.Sprintf("below %s, registered to project %s by source %s", t.Cgroup, t.Project, t.Source)
		}
	}
	if t, ok := below[e.Cgroup].other(e.Project); ok {
		return fmt.Sprintf("above %s, registered to project %s by source %s", t.Cgroup, t.Project, t.Source)
	}
	return ""
}

// ValidCgroup checks the form of a member's cgroup: an absolute, clean path
// other than "/". Whether it exists and is on cgroup2 is the kernel side's
// question.
func ValidCgroup(p string) error {
	switch {
	case p == "":
		return fmt.Errorf("the cgroup path is empty")
	case !filepath.IsAbs(p) || filepath.Clean(p) != p || p == "/":
		return fmt.Errorf("the cgroup path %q is not an absolute, clean directory path", p)
	case len(p) > 4096:
		return fmt.Errorf("the cgroup path is longer than 4096 bytes")
	}
	return nil
}

// examples keeps two members below a cgroup, of different projects if
// there are such: enough to tell whether a member of any given project has
// a member of another project below it, and to name one.
type examples struct {
	n    int
	a, b Entry
}

func (x *examples) add(e Entry) {
	switch {
	case x.n == 0:
		x.a, x.n = e, 1
	case x.n == 1 && e.Project != x.a.Project:
		x.b, x.n = e, 2
	}
}

// other returns a member of a project other than p, if any.
func (x examples) other(p string) (Entry, bool) {
	switch {
	case x.n >= 1 && x.a.Project != p:
		return x.a, true
	case x.n == 2 && x.b.Project != p:
		return x.b, true
	}
	return Entry{}, false
}

// ancestors yields the proper ancestors of a clean absolute path, nearest
// first, "/" excluded: /a/b/c yields /a/b, then /a.
func ancestors(p string) func(func(string) bool) {
	return func(yield func(string) bool) {
		for {
			i := strings.LastIndexByte(p, '/')
			if i <= 0 {
				return
			}
			p = p[:i]
			if !yield(p) {
				return
			}
		}
	}
}

// Tree finds the member a cgroup belongs to: the registered cgroup at or
// nearest above it. It is read-only once built and safe for concurrent use.
type Tree struct {
	byCgroup map[string]Entry
}

// NewTree indexes an accepted set (Result.Accepted).
func NewTree(es []Entry) *Tree {
	t := &Tree{byCgroup: make(map[string]Entry, len(es))}
	for _, e := range es {
		t.byCgroup[e.Cgroup] = e
	}
	return t
}

// Find returns the member whose cgroup is path or its nearest registered
// ancestor. Its cost is one map lookup per level of path.
func (t *Tree) Find(path string) (Entry, bool) {
	if t == nil {
		return Entry{}, false
	}
	if e, ok := t.byCgroup[path]; ok {
		return e, true
	}
	for a := range ancestors(path) {
		if e, ok := t.byCgroup[a]; ok {
			return e, true
		}
	}
	return Entry{}, false
}

// Len is the number of members.
func (t *Tree) Len() int {
	if t == nil {
		return 0
	}
	return len(t.byCgroup)
}

// Move is a cgroup whose project or source changed.
type Move struct {
	From, To Entry
}

// Changes is what differs between two accepted sets.
type Changes struct {
	Added, Removed []Entry
	Moved          []Move
}

// Empty reports whether nothing changed.
func (c Changes) Empty() bool { return len(c.Added)+len(c.Removed)+len(c.Moved) == 0 }

// Diff compares two accepted sets (sorted by Compare, each cgroup once, as
// Resolve returns them) in one pass.
func Diff(old, new []Entry) Changes {
	var c Changes
	i, j := 0, 0
	for i < len(old) || j < len(new) {
		switch {
		case j == len(new) || i < len(old) && old[i].Cgroup < new[j].Cgroup:
			c.Removed = append(c.Removed, old[i])
			i++
		case i == len(old) || new[j].Cgroup < old[i].Cgroup:
			c.Added = append(c.Added, new[j])
			j++
		default:
			if old[i] != new[j] {
				c.Moved = append(c.Moved, Move{old[i], new[j]})
			}
			i++
			j++
		}
	}
	return c
}
