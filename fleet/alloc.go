// SPDX-License-Identifier: Apache-2.0

package fleet

import (
	"slices"
	"sort"
	"strings"

	"github.com/fairshare-dev/fairshare/pools"
)

// Demand is one project's state on one node, as the node publishes it.
type Demand struct {
	// Held is the number of permits the project holds on the node.
	Held int `json:"h"`
	// Refused counts its refusals since the node's previous publication.
	Refused uint64 `json:"r,omitempty"`
	// Active reports it in the node's active set.
	Active bool `json:"a,omitempty"`
}

// want is what a demand asks of the fleet: what it holds plus what it was
// refused, at least one when active, at most limit.
func (d Demand) want(limit int) int {
	w := uint64(max(d.Held, 0)) + d.Refused
	if w == 0 && d.Active {
		w = 1
	}
	return int(min(w, uint64(limit)))
}

// Node is one node's publication: its name, the pool's size and floor as
// configured on it, and its projects' demands.
type Node struct {
	Name string `json:"-"`
	// Size and Floor are the node's configured S and F (0: not published,
	// a node of an older release): the fleet divides the smallest size
	// published (see Member).
	Size     int               `json:"s,omitempty"`
	Floor    int               `json:"f,omitempty"`
	Projects map[string]Demand `json:"p"`
	// lease and rev are the etcd lease the key was written under and the
	// revision of that write (not published: etcd's own record), which
	// tell a node its own key from one another daemon wrote under the
	// same name.
	lease, rev int64
}

// Plan is the fleet's division of one pool: what Compute returns.
type Plan struct {
	// Size and Floor are the fleet's S and F.
	Size, Floor int
	// Departed is what the departed nodes are counted as holding (see
	// ComputeDeparted): the live nodes divide Size - Departed.
	Departed int
	// Active is the number of projects active on any node; Share the fleet
	// share, max(F, S/Active).
	Active, Share int
	// Projects is each project's allocation, by name.
	Projects map[string]ProjectPlan
	// Nodes is each live node's allotment, by name.
	Nodes map[string]Allotment
}

// ProjectPlan is one project's part of a Plan.
type ProjectPlan struct {
	// Want is D(p), what it holds and asks for on the fleet; Held what it
	// holds (as published).
	Want, Held int
	// Alloc is a(p), its allocation.
	Alloc int
	// Nodes is the number of nodes it wants on.
	Nodes int
}

// Allotment is one node's part of a Plan.
type Allotment struct {
	// Size is the node's POOL for the fleet pool.
	Size int
	// Spare is the part of Size nobody was allocated: room for projects
	// new on the node since the publications Compute read.
	Spare int
	// Caps is each project's cap on the node: its part of its allocation.
	// A project not listed has no cap (the node's rule, within Size).
	Caps map[string]int
}

// Compute divides a fleet pool of size (> 0) and floor (0: the default, 5%)
// among nodes by the rule in the package doc. Node names must be distinct.
// It is deterministic: every node computes the same Plan from the same
// publications, whatever their order.
func Compute(size, floor int, nodes []Node) Plan { return compute(size, floor, nodes, "", true) }

// ComputeFor is Compute with only node self's allotment in Plan.Nodes
// (none if self published nothing): what a node needs of the plan. The
// projects' allocations are the whole fleet's, as Compute's; the caps of
// the other nodes, which cost a map per node, are not made.
func ComputeFor(size, floor int, nodes []Node, self string) Plan {
	return compute(size, floor, nodes, self, false)
}

// ComputeDeparted is Compute (all) or ComputeFor(..., self) with departed
// permits held outside the live nodes (nodes gone whose holdings still
// count, see Member): the live nodes divide size - departed, departed
// clamped to [0, size], so their allotments and departed sum to size. The
// plan's Size and Floor stay the fleet's; its Share and allocations are of
// what the live nodes divide, with the floor at most that.
func ComputeDeparted(size, floor, departed int, nodes []Node, self string, all bool) Plan {
	departed = min(max(departed, 0), size)
	if departed == 0 {
		return compute(size, floor, nodes, self, all)
	}
	floor = pools.EffectiveFloor(size, floor)
	avail := size - departed
	plan := compute(avail, max(min(floor, avail), 1), nodes, self, all)
	plan.Size, plan.Floor, plan.Departed = size, floor, departed
	return plan
}

// compute is Compute for every node (all) or for node self alone. Its cost
// is O(D log D + P log S) for D demands (a project on a node) of P projects:
// each project's name is looked up once per node it is on, the rest is
// slices.
func compute(size, floor int, nodes []Node, self string, all bool) Plan {
	f := computeFleet(size, floor, nodes)
	if all {
		return f.split(-1)
	}
	return f.forNode(self)
}

// fleetAlloc is the fleet-wide part of a computation: the projects'
// allocations, the same for every node that read the same publications.
// split then derives one node's allotment (or all of them) from it. It is
// read-only once made, so nodes that saw the same view can share one (the
// in-process simulation does, see sharedView).
type fleetAlloc struct {
	size  int
	nodes []Node // by name
	plan  Plan   // without Nodes
	projs []allocProject
	index map[string]int // project name -> first-sight index in projs
	// byProj holds each project's demands, in node order, as the run
	// byProj[start[k]:start[k+1]] (a counting sort of the demands).
	byProj  []allocWhere
	start   []int
	allocOf []int // a(p) by first-sight index
	left    int   // what nobody was allocated
}

type allocProject struct {
	name              string
	want, held, nodes int
}

// allocWhere is one demand: project proj (first-sight index) wants want on
// node node (index in fleetAlloc.nodes).
type allocWhere struct{ proj, node, want int }

func computeFleet(size, floor int, nodes []Node) *fleetAlloc {
	floor = pools.EffectiveFloor(size, floor)
	nodes = slices.Clone(nodes)
	slices.SortFunc(nodes, func(a, b Node) int { return strings.Compare(a.Name, b.Name) })
	demands := 0
	for _, n := range nodes {
		demands += len(n.Projects)
	}

	// Each project once, by first sight, with its totals; and each demand
	// (project, node, want), in node order.
	index := make(map[string]int, demands)
	projs := make([]allocProject, 0, demands)
	wheres := make([]allocWhere, 0, demands)
	for i, n := range nodes {
		for p, d := range n.Projects {
			w := d.want(size)
			if w == 0 {
				continue
			}
			k, ok := index[p]
			if !ok {
				k = len(projs)
				index[p] = k
				projs = append(projs, allocProject{name: p})
			}
			pr := &projs[k]
			pr.want = min(pr.want+w, size)
			pr.held += max(d.Held, 0)
			pr.nodes++
			wheres = append(wheres, allocWhere{k, i, w})
		}
	}
	// Name order: the water-filling's ties go to the lower index.
	order := make([]int, len(projs))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return strings.Compare(projs[a].name, projs[b].name) })

	plan := Plan{Size: size, Floor: floor, Active: len(projs), Projects: make(map[string]ProjectPlan, len(projs))}
	plan.Share = pools.Share(size, floor, plan.Active)

	// Round 1: up to the share, over S.
	d := make([]int, len(order))
	for i, k := range order {
		d[i] = min(projs[k].want, plan.Share)
	}
	alloc := waterFill(d, size)
	// Round 2: past the share, over S - F - what round 1 gave.
	used := sum(alloc)
	if room := size - floor - used; room > 0 {
		for i, k := range order {
			d[i] = projs[k].want - alloc[i]
		}
		for i, x := range waterFill(d, room) {
			alloc[i] += x
		}
	}
	used = sum(alloc)
	allocOf := make([]int, len(projs)) // by first-sight index
	for i, k := range order {
		pr := projs[k]
		allocOf[k] = alloc[i]
		plan.Projects[pr.name] = ProjectPlan{Want: pr.want, Held: pr.held, Alloc: alloc[i], Nodes: pr.nodes}
	}

	start := make([]int, len(projs)+1)
	for _, w := range wheres {
		start[w.proj+1]++
	}
	for k := range projs {
		start[k+1] += start[k]
	}
	byProj := make([]allocWhere, len(wheres))
	next := slices.Clone(start[:len(projs)])
	for _, w := range wheres {
		byProj[next[w.proj]] = w
		next[w.proj]++
	}
	return &fleetAlloc{size: size, nodes: nodes, plan: plan, projs: projs, index: index, byProj: byProj,
		start: start, allocOf: allocOf, left: size - used}
}

// forNode is the Plan of ComputeFor(..., self) from the fleet-wide part:
// none of self's allotment when self published nothing.
func (f *fleetAlloc) forNode(self string) Plan {
	me := sort.Search(len(f.nodes), func(i int) bool { return f.nodes[i].Name >= self })
	if me == len(f.nodes) || f.nodes[me].Name != self {
		return f.split(-2)
	}
	return f.split(me)
}

// split returns the Plan with the allotment of node me (an index in
// f.nodes), of every node (-1), or of none (-2). The Plan's Projects map is
// f's, shared: read it, never write it.
func (f *fleetAlloc) split(me int) Plan {
	plan := f.plan
	if me == -1 {
		plan.Nodes = make(map[string]Allotment, len(f.nodes))
	} else {
		plan.Nodes = make(map[string]Allotment, 1)
	}
	if me == -2 {
		return plan
	}
	all := me == -1
	// Split each allocation among its nodes, max-min fair by want: a node
	// where the project wants little gets all it wants, the rest goes
	// where it wants more. (A split in proportion to want would give a
	// node whose want was swollen by one period's refusals more than it
	// uses, and starve the node that needs it.) A project's demands, in
	// node order, are a run of byProj. For one node, only the projects
	// it published with a want are split.
	var mine []int
	if all {
		mine = make([]int, len(f.projs))
		for k := range mine {
			mine[k] = k
		}
	} else {
		for p, d := range f.nodes[me].Projects {
			if d.want(f.size) > 0 {
				mine = append(mine, f.index[p])
			}
		}
	}
	caps := make([]map[string]int, len(f.nodes))
	sizes := make([]int, len(f.nodes))
	var weights []int
	for _, k := range mine {
		run := f.byProj[f.start[k]:f.start[k+1]]
		weights = weights[:0]
		for _, w := range run {
			weights = append(weights, w.want)
		}
		for j, x := range waterFill(weights, f.allocOf[k]) {
			n := run[j].node
			if !all && n != me {
				continue
			}
			if caps[n] == nil {
				caps[n] = map[string]int{}
			}
			caps[n][f.projs[k].name] = x
			sizes[n] += x
		}
	}
	// Spread what nobody was allocated evenly over the nodes, the
	// remainder one each to the first by name (proportional with equal
	// weights).
	left := f.left
	spare := func(i int) int {
		if len(f.nodes) == 0 || left <= 0 {
			return 0
		}
		s := left / len(f.nodes)
		if i < left%len(f.nodes) {
			s++
		}
		return s
	}
	for i, n := range f.nodes {
		if !all && i != me {
			continue
		}
		c := caps[i]
		if c == nil {
			c = map[string]int{}
		}
		plan.Nodes[n.Name] = Allotment{Size: sizes[i] + spare(i), Spare: spare(i), Caps: c}
	}
	return plan
}

// waterFill gives each i at most d[i], total at most capacity, max-min
// fair: a level L such that everyone gets min(d[i], L), and the units a
// level cannot split evenly go one each to the first wanting more (in
// index order, which Compute makes name order).
func waterFill(d []int, capacity int) []int {
	out := make([]int, len(d))
	if capacity <= 0 || len(d) == 0 {
		return out
	}
	if sum(d) <= capacity {
		copy(out, d)
		return out
	}
	// The highest L with sum(min(d, L)) <= capacity, by binary search on L.
	lo, hi := 0, slices.Max(d)
	for lo < hi {
		mid := (lo + hi + 1) / 2
		s := 0
		for _, x := range d {
			s += min(x, mid)
		}
		if s <= capacity {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	left := capacity
	for i, x := range d {
		out[i] = min(x, lo)
		left -= out[i]
	}
	for i, x := range d {
		if left == 0 {
			break
		}
		if x > out[i] {
			out[i]++
			left--
		}
	}
	return out
}

func sum(xs []int) int {
	s := 0
	for _, x := range xs {
		s += x
	}
	return s
}
