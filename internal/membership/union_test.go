// SPDX-License-Identifier: Apache-2.0

package membership

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

func m(project, cgroup string) Member { return Member{Project: project, Cgroup: cgroup} }

func in(source string, ms ...Member) Input { return Input{Source: source, Found: Found{Members: ms}} }

// accepted renders a result's accepted set as "project@cgroup(source)".
func accepted(r Result) []string {
	var out []string
	for _, e := range r.Accepted {
		out = append(out, fmt.Sprintf("%s@%s(%s)", e.Project, e.Cgroup, e.Source))
	}
	return out
}

// refused renders a result's refusals as "project@cgroup(source): reason".
func refused(r Result) []string {
	var out []string
	for _, f := range r.Refused {
		out = append(out, fmt.Sprintf("%s@%s(%s): %s", f.Project, f.Cgroup, f.Source, f.Reason))
	}
	return out
}

func TestResolve(t *testing.T) {
	for _, tc := range []struct {
		name     string
		inputs   []Input
		prev     []Entry
		accepted []string
		refused  []string // prefixes of the rendered refusals
	}{{
		name:     "disjoint sources",
		inputs:   []Input{in("directory", m("a", "/cg/a"), m("b", "/cg/b")), in("registered", m("c", "/cg/x/c"))},
		accepted: []string{"a@/cg/a(directory)", "b@/cg/b(directory)", "c@/cg/x/c(registered)"},
	}, {
		name:     "one cgroup claimed by two projects: the earlier source wins",
		inputs:   []Input{in("directory", m("a", "/cg/a")), in("registered", m("z", "/cg/a"))},
		accepted: []string{"a@/cg/a(directory)"},
		refused:  []string{"z@/cg/a(registered): registered to project a by source directory"},
	}, {
		name:     "one cgroup claimed twice for one project: still once",
		inputs:   []Input{in("directory", m("a", "/cg/a")), in("registered", m("a", "/cg/a"))},
		accepted: []string{"a@/cg/a(directory)"},
		refused:  []string{"a@/cg/a(registered): also registered for project a by source directory"},
	}, {
		name:     "below another project's cgroup",
		inputs:   []Input{in("directory", m("a", "/cg/a")), in("registered", m("b", "/cg/a/x/y"))},
		accepted: []string{"a@/cg/a(directory)"},
		refused:  []string{"b@/cg/a/x/y(registered): below /cg/a, registered to project a by source directory"},
	}, {
		name:     "above another project's cgroup",
		inputs:   []Input{in("directory", m("a", "/cg/a/x")), in("registered", m("b", "/cg/a"))},
		accepted: []string{"a@/cg/a/x(directory)"},
		refused:  []string{"b@/cg/a(registered): above /cg/a/x, registered to project a by source directory"},
	}, {
		name:     "a path with a control character is quoted in the reason",
		inputs:   []Input{in("directory", m("a", "/cg/a/x\x1b[2J")), in("registered", m("b", "/cg/a"))},
		accepted: []string{"a@/cg/a/x\x1b[2J(directory)"},
		refused:  []string{`b@/cg/a(registered): above "/cg/a/x\x1b[2J", registered to project a`},
	}, {
		name:     "nesting within one project is allowed",
		inputs:   []Input{in("directory", m("a", "/cg/a")), in("registered", m("a", "/cg/a/x"), m("a", "/cg"))},
		accepted: []string{"a@/cg(registered)", "a@/cg/a(directory)", "a@/cg/a/x(registered)"},
	}, {
		name: "the members in force win over a newcomer of an earlier source",
		inputs: []Input{in("directory", m("a", "/cg/a")),
			in("registered", m("b", "/cg/a/x"))},
		prev:     []Entry{{m("b", "/cg/a/x"), "registered"}},
		accepted: []string{"b@/cg/a/x(registered)"},
		refused:  []string{"a@/cg/a(directory): above /cg/a/x, registered to project b by source registered"},
	}, {
		name: "the members in force by project and cgroup, whatever their source (the kernel's after a restart)",
		inputs: []Input{in("directory", m("a", "/cg/a")),
			in("registered", m("b", "/cg/a/x"))},
		prev:     []Entry{{m("b", "/cg/a/x"), ""}},
		accepted: []string{"b@/cg/a/x(registered)"},
		refused:  []string{"a@/cg/a(directory): above /cg/a/x"},
	}, {
		name:     "same rank: the smaller cgroup wins",
		inputs:   []Input{in("registered", m("b", "/cg/a/x"), m("a", "/cg/a"))},
		accepted: []string{"a@/cg/a(registered)"},
		refused:  []string{"b@/cg/a/x(registered): below /cg/a"},
	}, {
		name: "a mixed subtree: above refuses whatever project it is of",
		inputs: []Input{in("directory", m("a", "/cg/p/a"), m("b", "/cg/p/b")),
			in("registered", m("a", "/cg/p"), m("b", "/cg/p"))},
		accepted: []string{"a@/cg/p/a(directory)", "b@/cg/p/b(directory)"},
		refused: []string{"a@/cg/p(registered): above /cg/p/b, registered to project b",
			"b@/cg/p(registered): above /cg/p/a, registered to project a"},
	}, {
		name: "invalid names and paths",
		inputs: []Input{in("directory", m("ok", "/cg/ok"), m("bad name", "/cg/bad name"), m("x", "relative"),
			m("y", "/cg/../etc"), m("z", "/"), m("", "/cg/empty"), m("w", "/cg//w"), m("v", "/cg/v/"), m("u", "/cg/."))},
		accepted: []string{"ok@/cg/ok(directory)"},
		refused: []string{`@/cg/empty(directory): invalid project name`, `bad name@/cg/bad name(directory): invalid project name`,
			`z@/(directory): the cgroup path "/" is not`, `y@/cg/../etc(directory): the cgroup path`, `x@relative(directory): the cgroup path`,
			`w@/cg//w(directory): the cgroup path`, `v@/cg/v/(directory): the cgroup path`, `u@/cg/.(directory): the cgroup path`},
	}, {
		name:     "the same member twice in one source is one member",
		inputs:   []Input{in("registered", m("a", "/cg/a"), m("a", "/cg/a"))},
		accepted: []string{"a@/cg/a(registered)"},
	}, {
		name: "skipped cgroups are listed with the refusals",
		inputs: []Input{{Source: "systemd", Found: Found{Members: []Member{m("a", "/cg/s/fairshare-a.slice")},
			Skipped: []Skipped{{"/cg/s/x.service", "a unit directly in"}}}}},
		accepted: []string{"a@/cg/s/fairshare-a.slice(systemd)"},
		refused:  []string{"@/cg/s/x.service(systemd): a unit directly in"},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			r := Resolve(tc.inputs, tc.prev)
			if got := accepted(r); !slices.Equal(got, tc.accepted) {
				t.Errorf("accepted %q\nwant     %q", got, tc.accepted)
			}
			got := refused(r)
			if len(got) != len(tc.refused) {
				t.Fatalf("refused %q\nwant    %q", got, tc.refused)
			}
			for _, want := range tc.refused {
				if !slices.ContainsFunc(got, func(g string) bool { return strings.HasPrefix(g, want) }) {
					t.Errorf("no refusal %q in %q", want, got)
				}
			}
			checkInvariants(t, tc.inputs, r)
		})
	}
}

// checkInvariants checks what Resolve promises against a naive oracle:
// each cgroup at most once, no accepted cgroup at or below one of another
// project, every input member either accepted or refused, and every valid
// refusal caused by an accepted member it conflicts with (nothing refused
// that could have been taken).
func checkInvariants(t *testing.T, inputs []Input, r Result) {
	t.Helper()
	under := func(a, b string) bool { return a == b || strings.HasPrefix(a, b+"/") } // a at or below b
	for i, a := range r.Accepted {
		for j, b := range r.Accepted {
			if i != j && under(a.Cgroup, b.Cgroup) && (a.Cgroup == b.Cgroup || a.Project != b.Project) {
				t.Fatalf("accepted %v and %v conflict", a, b)
			}
		}
	}
	seen := map[Entry]bool{}
	for _, e := range r.Accepted {
		seen[e] = true
	}
	for _, f := range r.Refused {
		seen[f.Entry] = true
		if ValidCgroup(f.Cgroup) != nil || f.Project == "" || strings.Contains(f.Reason, "invalid project name") {
			continue
		}
		if !slices.ContainsFunc(r.Accepted, func(a Entry) bool {
			return a.Cgroup == f.Cgroup || (a.Project != f.Project && (under(a.Cgroup, f.Cgroup) || under(f.Cgroup, a.Cgroup)))
		}) {
			t.Fatalf("%v refused (%s) with no accepted member in conflict", f.Entry, f.Reason)
		}
	}
	for _, in := range inputs {
		for _, mb := range in.Members {
			if !seen[Entry{mb, in.Source}] {
				t.Fatalf("%v of %s neither accepted nor refused", mb, in.Source)
			}
		}
	}
}

// TestResolveRandom: on random trees of members from three sources, the
// invariants hold, the result does not depend on the order the sources
// listed their members in, and the members in force stay accepted when
// they are still claimed.
func TestResolveRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(17, 4))
	for round := range 300 {
		inputs := randomInputs(rng, 40)
		r := Resolve(inputs, nil)
		checkInvariants(t, inputs, r)
		shuffled := make([]Input, len(inputs))
		for i, in := range inputs {
			shuffled[i] = Input{Source: in.Source, Found: Found{Members: slices.Clone(in.Members)}}
			rng.Shuffle(len(shuffled[i].Members), func(a, b int) {
				shuffled[i].Members[a], shuffled[i].Members[b] = shuffled[i].Members[b], shuffled[i].Members[a]
			})
		}
		if r2 := Resolve(shuffled, nil); !slices.Equal(accepted(r), accepted(r2)) || !slices.Equal(refused(r), refused(r2)) {
			t.Fatalf("round %d: the order of the members changed the result", round)
		}
		// New members arrive; those in force stay.
		more := randomInputs(rng, 20)
		for i := range inputs {
			more[i].Members = append(more[i].Members, inputs[i].Members...)
		}
		r3 := Resolve(more, r.Accepted)
		checkInvariants(t, more, r3)
		for _, e := range r.Accepted {
			if !slices.Contains(r3.Accepted, e) {
				t.Fatalf("round %d: %v was in force and lost to a newcomer", round, e)
			}
		}
		// Seeded with the members only (the kernel's, after a restart):
		// the same members stay.
		var seed []Entry
		for _, e := range r.Accepted {
			seed = append(seed, Entry{Member: e.Member})
		}
		r4 := Resolve(more, seed)
		for _, e := range r.Accepted {
			if !slices.ContainsFunc(r4.Accepted, func(a Entry) bool { return a.Member == e.Member }) {
				t.Fatalf("round %d: %v was in force (seeded without sources) and lost to a newcomer", round, e.Member)
			}
		}
		// Diff takes the old set to the new.
		c := Diff(r.Accepted, r3.Accepted)
		if got := apply(r.Accepted, c); !slices.Equal(got, r3.Accepted) {
			t.Fatalf("round %d: Diff does not take old to new:\n%v\n%v", round, got, r3.Accepted)
		}
	}
}

func apply(old []Entry, c Changes) []Entry {
	byCg := map[string]Entry{}
	for _, e := range old {
		byCg[e.Cgroup] = e
	}
	for _, e := range c.Removed {
		delete(byCg, e.Cgroup)
	}
	for _, e := range c.Added {
		byCg[e.Cgroup] = e
	}
	for _, mv := range c.Moved {
		byCg[mv.To.Cgroup] = mv.To
	}
	out := make([]Entry, 0, len(byCg))
	for _, e := range byCg {
		out = append(out, e)
	}
	slices.SortFunc(out, Compare)
	return out
}

// randomInputs draws n members over three sources in a small tree, so that
// duplicates and nesting are common.
func randomInputs(rng *rand.Rand, n int) []Input {
	inputs := []Input{{Source: "directory"}, {Source: "registered"}, {Source: "systemd"}}
	for range n {
		depth := 1 + rng.IntN(4)
		path := "/cg"
		for range depth {
			path += "/" + string(rune('a'+rng.IntN(3)))
		}
		p := string(rune('p' + rng.IntN(3)))
		i := rng.IntN(len(inputs))
		inputs[i].Members = append(inputs[i].Members, m(p, path))
	}
	return inputs
}

func TestDiff(t *testing.T) {
	e := func(p, cg, src string) Entry { return Entry{m(p, cg), src} }
	old := []Entry{e("a", "/a", "d"), e("b", "/b", "d"), e("c", "/c", "d")}
	nw := []Entry{e("a", "/a", "d"), e("x", "/b", "d"), e("d", "/d", "r")}
	c := Diff(old, nw)
	if len(c.Added) != 1 || c.Added[0].Cgroup != "/d" || len(c.Removed) != 1 || c.Removed[0].Cgroup != "/c" ||
		len(c.Moved) != 1 || c.Moved[0].From.Project != "b" || c.Moved[0].To.Project != "x" {
		t.Fatalf("%+v", c)
	}
	if !Diff(old, old).Empty() || Diff(nil, nil).Added != nil {
		t.Fatal("no change is not empty")
	}
}

func TestTree(t *testing.T) {
	tr := NewTree([]Entry{{m("a", "/cg/a"), "d"}, {m("a", "/cg/a/x/y"), "r"}, {m("b", "/cg/kubepods/burstable/pod1"), "r"}})
	for path, want := range map[string]string{
		"/cg/a": "a", "/cg/a/x": "a", "/cg/a/x/y/z": "a", "/cg/kubepods/burstable/pod1/ctr": "b",
		"/cg/kubepods/burstable": "", "/cg": "", "/cg/ab": "", "/": "",
	} {
		e, ok := tr.Find(path)
		if e.Project != want || ok != (want != "") {
			t.Errorf("Find(%s) = %v %v, want %q", path, e, ok, want)
		}
	}
	if e, _ := tr.Find("/cg/a/x/y/z"); e.Source != "r" {
		t.Errorf("the nearest member is not the one found: %v", e)
	}
	var nilTree *Tree
	if _, ok := nilTree.Find("/cg/a"); ok || nilTree.Len() != 0 {
		t.Error("a nil tree finds something")
	}
}
