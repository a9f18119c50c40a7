// SPDX-License-Identifier: Apache-2.0

package fleet

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/pools"
)

// TestComputeTimeline walks the story on a fleet of 12 over three
// nodes.
func TestComputeTimeline(t *testing.T) {
	hungry := func(held int) Demand { return Demand{Held: held, Refused: 20, Active: true} }
	steps := []struct {
		name  string
		nodes []Node
		sizes map[string]int
		caps  map[string]map[string]int
	}{
		{"nobody: the spare is spread",
			[]Node{{Name: "a"}, {Name: "b"}, {Name: "c"}},
			map[string]int{"a": 4, "b": 4, "c": 4}, nil},
		{"alpha alone on a takes 12",
			[]Node{{Name: "a", Projects: map[string]Demand{"alpha": hungry(4)}}, {Name: "b"}, {Name: "c"}},
			map[string]int{"a": 12, "b": 0, "c": 0},
			map[string]map[string]int{"a": {"alpha": 12}}},
		{"beta on b: one share each",
			[]Node{{Name: "a", Projects: map[string]Demand{"alpha": hungry(12)}}, {Name: "b", Projects: map[string]Demand{"beta": hungry(0)}}, {Name: "c"}},
			map[string]int{"a": 6, "b": 6, "c": 0},
			map[string]map[string]int{"a": {"alpha": 6}, "b": {"beta": 6}}},
		{"alpha on a and b: its share split",
			[]Node{{Name: "a", Projects: map[string]Demand{"alpha": {Held: 6, Refused: 6, Active: true}}},
				{Name: "b", Projects: map[string]Demand{"beta": hungry(6), "alpha": {Refused: 12, Active: true}}}, {Name: "c"}},
			map[string]int{"a": 3, "b": 9, "c": 0},
			map[string]map[string]int{"a": {"alpha": 3}, "b": {"alpha": 3, "beta": 6}}},
		{"a small project gets all it wants, the rest is water-filled over S-F",
			[]Node{{Name: "a", Projects: map[string]Demand{"alpha": hungry(6)}}, {Name: "b", Projects: map[string]Demand{"small": {Held: 2, Active: true}}}, {Name: "c"}},
			// share 6; small 2; alpha past its share: up to 12-1-8 = 3 more: 9. Spare 1 on a.
			map[string]int{"a": 10, "b": 2, "c": 0},
			map[string]map[string]int{"a": {"alpha": 9}, "b": {"small": 2}}},
	}
	for _, st := range steps {
		p := Compute(12, 0, st.nodes)
		for n, want := range st.sizes {
			if got := p.Nodes[n].Size; got != want {
				t.Errorf("%s: node %s allotment %d, want %d (plan %+v)", st.name, n, got, want, p)
			}
		}
		for n, caps := range st.caps {
			for proj, want := range caps {
				if got := p.Nodes[n].Caps[proj]; got != want {
					t.Errorf("%s: node %s cap of %s %d, want %d", st.name, n, proj, got, want)
				}
			}
		}
	}
}

// oracle is the rule computed the naive way: unit by unit, each to the
// wanting project with the least so far (ties by name order), first up to
// the share over S, then past it over S - F.
func oracle(size, floor int, want []int) []int {
	floor = pools.EffectiveFloor(size, floor)
	share := pools.Share(size, floor, len(want))
	out := make([]int, len(want))
	fill := func(limit func(i int) int, capacity int) {
		for capacity > 0 {
			best := -1
			for i := range want {
				if out[i] < limit(i) && (best < 0 || out[i] < out[best]) {
					best = i
				}
			}
			if best < 0 {
				return
			}
			out[best]++
			capacity--
		}
	}
	fill(func(i int) int { return min(want[i], share) }, size)
	fill(func(i int) int { return want[i] }, size-floor-sum(out))
	return out
}

func randomNodes(r *rand.Rand, size int) []Node {
	nn := 1 + r.IntN(12)
	np := 1 + r.IntN(40)
	nodes := make([]Node, nn)
	for i := range nodes {
		nodes[i] = Node{Name: fmt.Sprintf("n%02d", i), Projects: map[string]Demand{}}
		for p := 0; p < np; p++ {
			if r.IntN(3) != 0 {
				continue
			}
			d := Demand{Held: r.IntN(size/2 + 1), Active: r.IntN(2) == 0}
			if r.IntN(2) == 0 {
				d.Refused = uint64(r.IntN(size))
			}
			nodes[i].Projects[fmt.Sprintf("p%02d", p)] = d
		}
	}
	return nodes
}

// TestComputeProperties checks the guarantees of the package doc on random
// fleets against the oracle.
func TestComputeProperties(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 35))
	for round := 0; round < 3000; round++ {
		size := 1 + r.IntN(200)
		if r.IntN(4) == 0 {
			size = 1 + r.IntN(5000)
		}
		floor := 0
		if r.IntN(3) == 0 {
			floor = 1 + r.IntN(size)
		}
		nodes := randomNodes(r, size)
		p := Compute(size, floor, nodes)
		fail := func(format string, args ...any) {
			t.Fatalf("round %d (seed %d, size %d floor %d): %s\nnodes %+v\nplan %+v", round, seed, size, floor, fmt.Sprintf(format, args...), nodes, p)
		}
		total, spare := 0, 0
		for _, a := range p.Nodes {
			total += a.Size
			spare += a.Spare
			for proj, c := range a.Caps {
				if c < 0 || c > a.Size-a.Spare {
					fail("cap of %s %d outside [0, size %d - spare %d]", proj, c, a.Size, a.Spare)
				}
			}
		}
		if total != size {
			fail("allotments sum to %d, want the size %d", total, size)
		}
		// Against the oracle, and the split adds up.
		var names []string
		var wants []int
		for proj, pp := range p.Projects {
			names = append(names, proj)
			wants = append(wants, pp.Want)
		}
		sortTogether(names, wants)
		want := oracle(size, floor, wants)
		allocated := 0
		for i, proj := range names {
			pp := p.Projects[proj]
			if pp.Alloc != want[i] {
				fail("project %s allocated %d, the oracle %d", proj, pp.Alloc, want[i])
			}
			if pp.Alloc > pp.Want {
				fail("project %s allocated %d past its want %d", proj, pp.Alloc, pp.Want)
			}
			parts := 0
			for _, n := range nodes {
				if c, ok := p.Nodes[n.Name].Caps[proj]; ok {
					part := c
					if part > n.Projects[proj].want(size) {
						fail("project %s's part %d on %s past its want there", proj, part, n.Name)
					}
					parts += part
				}
			}
			if parts != pp.Alloc {
				fail("project %s's parts sum to %d, allocated %d", proj, parts, pp.Alloc)
			}
			allocated += pp.Alloc
			if pp.Want <= p.Share && pp.Alloc != pp.Want && len(names)*p.Share <= size {
				fail("project %s wants %d <= share %d and got %d", proj, pp.Want, p.Share, pp.Alloc)
			}
		}
		if spare != size-allocated {
			fail("spare %d, want %d", spare, size-allocated)
		}
		// A project past its share leaves the floor to newcomers.
		past := false
		for _, proj := range names {
			past = past || p.Projects[proj].Alloc > p.Share
		}
		if past && spare < p.Floor {
			fail("a project past its share and only %d spare, floor %d", spare, p.Floor)
		}
	}
}

func sortTogether(names []string, xs []int) {
	for i := 1; i < len(names); i++ {
		for j := i; j > 0 && names[j] < names[j-1]; j-- {
			names[j], names[j-1] = names[j-1], names[j]
			xs[j], xs[j-1] = xs[j-1], xs[j]
		}
	}
}

// TestComputeOrderFree: every node computes the same plan whatever order it
// read the publications in.
func TestComputeOrderFree(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 35))
	for round := 0; round < 200; round++ {
		nodes := randomNodes(r, 100)
		a := Compute(100, 0, nodes)
		r.Shuffle(len(nodes), func(i, j int) { nodes[i], nodes[j] = nodes[j], nodes[i] })
		b := Compute(100, 0, nodes)
		if fmt.Sprint(a) != fmt.Sprint(b) {
			t.Fatalf("round %d: order changed the plan:\n%+v\n%+v", round, a, b)
		}
	}
}

// TestComputeFor: a node's own plan is the whole plan's part for it.
func TestComputeFor(t *testing.T) {
	r := rand.New(rand.NewPCG(8, 35))
	for round := 0; round < 200; round++ {
		nodes := randomNodes(r, 100)
		all := Compute(100, 0, nodes)
		for _, n := range append(nodes, Node{Name: "absent"}) {
			one := ComputeFor(100, 0, nodes, n.Name)
			want, ok := all.Nodes[n.Name]
			if got, mine := one.Nodes[n.Name]; ok != mine || fmt.Sprint(got) != fmt.Sprint(want) || len(one.Nodes) > 1 {
				t.Fatalf("round %d node %s: ComputeFor %+v, Compute's %+v", round, n.Name, one.Nodes, want)
			}
			if fmt.Sprint(one.Projects) != fmt.Sprint(all.Projects) || one.Share != all.Share || one.Active != all.Active {
				t.Fatalf("round %d node %s: the projects differ", round, n.Name)
			}
		}
	}
}

// BenchmarkCompute is one node's computation at the scale: 1,000
// nodes and 10,000 projects, each project on one to three nodes. A node
// computes at most five times a second (the watch coalesces).
func BenchmarkCompute(b *testing.B) {
	for _, sc := range []struct{ nodes, projects int }{{50, 500}, {1000, 10000}} {
		b.Run(fmt.Sprintf("nodes=%d/projects=%d", sc.nodes, sc.projects), func(b *testing.B) {
			r := rand.New(rand.NewPCG(1, 2))
			nodes := make([]Node, sc.nodes)
			for i := range nodes {
				nodes[i] = Node{Name: fmt.Sprintf("n%04d", i), Projects: map[string]Demand{}}
			}
			for p := range sc.projects {
				for range 1 + r.IntN(3) {
					nodes[r.IntN(sc.nodes)].Projects[fmt.Sprintf("p%05d", p)] = Demand{Held: r.IntN(30), Refused: uint64(r.IntN(3)), Active: true}
				}
			}
			b.Run("all", func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					Compute(20*sc.projects, 0, nodes)
				}
			})
			// What a Member computes: its own allotment.
			b.Run("one", func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					ComputeFor(20*sc.projects, 0, nodes, "n0007")
				}
			})
		})
	}
}
