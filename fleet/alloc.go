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

// Node is one node's publication: its name and its projects' demands.
type Node struct {
	Name     string            `json:"-"`
	Projects map[string]Demand `json:"p"`
}

// Plan is the fleet's division of one pool: what Compute returns.
type Plan struct {
	// Size and Floor are the fleet's S and F.
	Size, Floor int
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
func Compute(size, floor int, nodes []Node) Plan {
	floor = pools.EffectiveFloor(size, floor)
	nodes = slices.Clone(nodes)
	slices.SortFunc(nodes, func(a, b Node) int { return strings.Compare(a.Name, b.Name) })

	plan := Plan{Size: size, Floor: floor, Projects: map[string]ProjectPlan{}, Nodes: make(map[string]Allotment, len(nodes))}
	// wants[p] lists the nodes p wants on, in node order.
	type where struct {
		node int
		want int
	}
	wants := map[string][]where{}
	for i, n := range nodes {
		for p, d := range n.Projects {
			w := d.want(size)
			if w == 0 {
				continue
			}
			wants[p] = append(wants[p], where{i, w})
			pp := plan.Projects[p]
			pp.Want = min(pp.Want+w, size)
			pp.Held += max(d.Held, 0)
			pp.Nodes++
			plan.Projects[p] = pp
		}
	}
	names := make([]string, 0, len(wants))
	for p := range wants {
		names = append(names, p)
	}
	sort.Strings(names)
	plan.Active = len(names)
	plan.Share = pools.Share(size, floor, plan.Active)

	// Round 1: up to the share, over S.
	d := make([]int, len(names))
	for i, p := range names {
		d[i] = min(plan.Projects[p].Want, plan.Share)
	}
	alloc := waterFill(d, size)
	// Round 2: past the share, over S - F - what round 1 gave.
	used := sum(alloc)
	if room := size - floor - used; room > 0 {
		for i, p := range names {
			d[i] = plan.Projects[p].Want - alloc[i]
		}
		for i, x := range waterFill(d, room) {
			alloc[i] += x
		}
	}
	used = sum(alloc)

	// Split each allocation among its nodes, max-min fair by want: a node
	// where the project wants little gets all it wants, the rest goes
	// where it wants more. (A split in proportion to want would give a
	// node whose want was swollen by one period's refusals more than it
	// uses, and starve the node that needs it.)
	parts := make([]map[string]int, len(nodes))
	sizes := make([]int, len(nodes))
	for i, p := range names {
		pp := plan.Projects[p]
		pp.Alloc = alloc[i]
		plan.Projects[p] = pp
		ws := wants[p]
		weights := make([]int, len(ws))
		for j, w := range ws {
			weights[j] = w.want
		}
		for j, x := range waterFill(weights, alloc[i]) {
			n := ws[j].node
			if parts[n] == nil {
				parts[n] = map[string]int{}
			}
			parts[n][p] = x
			sizes[n] += x
		}
	}
	// Spread what nobody was allocated over the nodes.
	spare := make([]int, len(nodes))
	if len(nodes) > 0 {
		ones := make([]int, len(nodes))
		for i := range ones {
			ones[i] = 1
		}
		spare = proportional(size-used, ones)
	}
	for i, n := range nodes {
		a := Allotment{Size: sizes[i] + spare[i], Spare: spare[i], Caps: make(map[string]int, len(parts[i]))}
		for p, x := range parts[i] {
			a.Caps[p] = x
		}
		plan.Nodes[n.Name] = a
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

// proportional splits total in proportion to weights (all > 0), by largest
// remainder; ties go to the lower index. The parts sum to total.
func proportional(total int, weights []int) []int {
	out := make([]int, len(weights))
	if total <= 0 || len(weights) == 0 {
		return out
	}
	wsum := sum(weights)
	type rem struct {
		i int
		r int
	}
	rems := make([]rem, len(weights))
	given := 0
	for i, w := range weights {
		q := total * w
		out[i] = q / wsum
		rems[i] = rem{i, q % wsum}
		given += out[i]
	}
	sort.SliceStable(rems, func(a, b int) bool { return rems[a].r > rems[b].r })
	for k := 0; given < total; k++ {
		out[rems[k%len(rems)].i]++
		given++
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
