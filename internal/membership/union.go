// SPDX-License-Identifier: Apache-2.0

package membership

import (
	"fmt"
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
	// Tree indexes Accepted: which member a cgroup is in, and whether a
	// newcomer would be refused.
	Tree *Tree `json:"-"`
}

// Resolve unions the inputs' members. A member is refused when its project
// name or cgroup path is invalid, when its cgroup is claimed already (by
// another source, or by another project of the same source), or when it is
// below or above a cgroup of another project (nesting within one project
// is allowed: either way the socket counts for that project).
//
// Which of two conflicting members wins does not depend on the order the
// sources listed them in: first the one in prev (the accepted set in force,
// so a newcomer never evicts a registration that was enforced), from the
// same source before another (prev matches by project and cgroup, so the
// kernel's members, which name no source, seed it after a restart), then
// the one of the earlier input, then the smaller by Compare. The result is a
// function of its arguments, so a conflict is refused the same way at every
// tick and can be reported once.
//
// Cost: O(n log n) for the order and O(n * depth) map operations for the
// checks, n the members of all inputs (BenchmarkResolve).
func Resolve(inputs []Input, prev []Entry) Result {
	type candidate struct {
		Entry
		rank int // 0: in prev from this source, 1: from another; then 2 + the input's index
	}
	inPrev := make(map[Member]string, len(prev)) // member -> its source in prev
	for _, e := range prev {
		inPrev[e.Member] = e.Source
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
			r := 2 + i
			if src, ok := inPrev[m]; ok && src == in.Source {
				r = 0
			} else if ok {
				r = 1
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

	t := &Tree{nodes: make(map[string]*node, n)}
	res.Accepted = make([]Entry, 0, n)
	for i, c := range cands {
		if i > 0 && c.Entry == cands[i-1].Entry {
			continue // the same member twice in one source
		}
		if reason := t.Check(c.Entry); reason != "" {
			res.Refused = append(res.Refused, Refusal{c.Entry, reason})
			continue
		}
		t.add(c.Entry)
		res.Accepted = append(res.Accepted, c.Entry)
	}
	slices.SortFunc(res.Accepted, Compare)
	slices.SortFunc(res.Refused, func(a, b Refusal) int {
		if c := Compare(a.Entry, b.Entry); c != 0 {
			return c
		}
		return strings.Compare(a.Reason, b.Reason)
	})
	res.Tree = t
	return res
}

// ValidCgroup checks the form of a member's cgroup: an absolute, clean path
// other than "/". Whether it exists and is on cgroup2 is the kernel side's
// question.
func ValidCgroup(p string) error {
	switch {
	case p == "":
		return fmt.Errorf("the cgroup path is empty")
	case !clean(p):
		return fmt.Errorf("the cgroup path %q is not an absolute, clean directory path", p)
	case len(p) > 4096:
		return fmt.Errorf("the cgroup path is longer than 4096 bytes")
	}
	return nil
}

// clean reports whether p is absolute, clean (filepath.Clean(p) == p) and
// not "/", without building the cleaned copy.
func clean(p string) bool {
	if len(p) < 2 || p[0] != '/' || p[len(p)-1] == '/' {
		return false
	}
	for elem := range strings.SplitSeq(p[1:], "/") {
		if elem == "" || elem == "." || elem == ".." {
			return false
		}
	}
	return true
}

// examples keeps two members below a cgroup, of different projects if
// there are such: enough to tell whether a member of any given project has
// a member of another project below it, and to name one.
type examples struct {
	n    int
	a, b Entry
}

// add records e and reports whether the examples changed.
func (x *examples) add(e Entry) bool {
	switch {
	case x.n == 0:
		x.a, x.n = e, 1
	case x.n == 1 && e.Project != x.a.Project:
		x.b, x.n = e, 2
	default:
		return false
	}
	return true
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

// Tree indexes an accepted set: it finds the member a cgroup is in (the
// registered cgroup at or nearest above it) and tells whether a newcomer
// could join. It is read-only once built (Resolve, NewTree) and then safe
// for concurrent use.
type Tree struct {
	// nodes holds every member's cgroup and every ancestor of one.
	nodes map[string]*node
	n     int
}

// node is one cgroup of a Tree: the member registered at it, if any, and
// examples of the members below it.
type node struct {
	member Entry
	taken  bool
	below  examples
}

// NewTree indexes an accepted set (Result.Accepted: no conflicts).
func NewTree(es []Entry) *Tree {
	t := &Tree{nodes: make(map[string]*node, len(es))}
	for _, e := range es {
		t.add(e)
	}
	return t
}

// add puts e in the tree, which must not refuse it.
func (t *Tree) add(e Entry) {
	n := t.nodes[e.Cgroup]
	if n == nil {
		n = &node{}
		t.nodes[e.Cgroup] = n
	}
	n.member, n.taken = e, true
	t.n++
	for a := range ancestors(e.Cgroup) {
		an := t.nodes[a]
		if an == nil {
			an = &node{}
			t.nodes[a] = an
		}
		if !an.below.add(e) {
			// This ancestor's examples already had e's project (or two
			// projects), and so do those of every cgroup above it, which
			// hold everything below it.
			break
		}
	}
}

// Check returns why e could not join the tree's members, or "" if it
// could: an invalid name or path, its cgroup taken, or a member of another
// project above it or below it. The sentence is safe to print (a cgroup
// path with a control character is quoted).
func (t *Tree) Check(e Entry) string {
	if err := project.Validate(e.Project); err != nil {
		return err.Error()
	}
	if err := ValidCgroup(e.Cgroup); err != nil {
		return err.Error()
	}
	if n := t.nodes[e.Cgroup]; n != nil {
		if n.taken {
			if n.member.Project == e.Project {
				return fmt.Sprintf("also registered for project %s by source %s", n.member.Project, n.member.Source)
			}
			return fmt.Sprintf("registered to project %s by source %s", n.member.Project, n.member.Source)
		}
		if o, ok := n.below.other(e.Project); ok {
			return fmt.Sprintf("above %s, registered to project %s by source %s", project.Display(o.Cgroup), o.Project, o.Source)
		}
	}
	for a := range ancestors(e.Cgroup) {
		if n := t.nodes[a]; n != nil && n.taken && n.member.Project != e.Project {
			return fmt.Sprintf("below %s, registered to project %s by source %s", project.Display(a), n.member.Project, n.member.Source)
		}
	}
	return ""
}

// Find returns the member whose cgroup is path or its nearest registered
// ancestor. Its cost is one map lookup per level of path (BenchmarkFind).
func (t *Tree) Find(path string) (Entry, bool) {
	if t == nil {
		return Entry{}, false
	}
	if n := t.nodes[path]; n != nil && n.taken {
		return n.member, true
	}
	for a := range ancestors(path) {
		if n := t.nodes[a]; n != nil && n.taken {
			return n.member, true
		}
	}
	return Entry{}, false
}

// Len is the number of members.
func (t *Tree) Len() int {
	if t == nil {
		return 0
	}
	return t.n
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
