// SPDX-License-Identifier: Apache-2.0

// Package fleet divides one pool across many nodes: a pool marked fleet-wide
// has a size that is the fleet's total (a database's 1,000 connections used
// from 50 nodes), and each node enforces its allotment of it locally. The
// nodes meet in etcd: each publishes what its projects hold and ask, every
// node reads what all publish and computes the same allotments. Nothing of
// this sits on the connection or request path: the fleet layer only moves a
// node's POOL and its projects' caps, about once a second.
//
// # The rule at fleet scope
//
// The fleet has a size S and a floor F (as a node pool's: 5% of S, at least
// 1, unless configured). Each node n publishes, for each project p it has
// seen in the pool, held(n,p), refused(n,p) (refusals since its previous
// publication) and whether p is active there. From these:
//
//	want(n,p) = held(n,p) + refused(n,p), at least 1 when p is active on n
//	D(p)      = sum over nodes of want(n,p), at most S
//	active    = projects active (or holding) on any node
//	share     = max(F, S / active)              (integer division)
//
// Each project gets an allocation a(p), in two rounds of max-min fair
// water-filling (a project never gets more than it wants; what is left goes
// to the hungriest, level by level):
//
//  1. up to its share: a(p) = min(D(p), share), water-filled over S when
//     active·share > S (many projects, floor-bound shares);
//  2. past its share: the wants above a(p) are water-filled over
//     S - F - sum a(p), so the fleet, like a node, stops projects past their
//     share F short of the size (room for a newcomer).
//
// A project's allocation is split among the nodes where it wants by the
// same water-filling, over its wants there (ties by node name): a node
// where it wants little gets all it wants, the rest goes where it wants
// more. So part(n,p) <= want(n,p) and sum over n of part(n,p) = a(p). (A
// split in proportion to want would hand a node whose want one period's
// refusals swelled more than it uses, and starve the node that needs it.) What nobody
// was allocated, U = S - sum a(p), is spread evenly over the live nodes
// (largest remainder, by node name): spare(n). A node's allotment and a
// project's cap on that node are
//
//	allotment(n) = sum over p of part(n,p) + spare(n)
//	cap(n,p)     = part(n,p)
//
// The spare is not in any cap: it is the room of projects new on a node
// since the last computation, each of which is capped at spare(n) until
// the computation that includes it. (Were the spare open to every project,
// the first to take it would keep it, within its cap, and a hungrier
// project of the same node would find the pool full short of its own
// part.)
//
// # Guarantees
//
//   - The allotments of the live nodes sum to S exactly, less what the
//     departed nodes are counted as holding (Edges): there is no slack, U
//     is handed out as spare. (Each node computes from what it read of
//     etcd; two nodes may read two different revisions for the time a
//     publication takes to reach both, well under a second.)
//   - A project holds at most a(p) on the fleet, plus what it took as a
//     newcomer on a node before its first computation there (at most that
//     node's spare, itself at most U), plus, for a moment, what it holds
//     on a node whose cap for it fell while another node's rose (its part
//     moved with its wants): that node refuses it there until it lets go
//     (TestFleetKernelCaps sees one permit, about a second, with clients
//     that hold a connection three or four seconds). While every project asks for at least its share,
//     a(p) = share: a project on many nodes holds no more than one share
//     fleet-wide, its share split among its nodes.
//   - Under steady demand each project's allocation is its max-min fair
//     share of S (of S - F once some project is past its share), to one
//     permit per rounding; TestSteadyDemand checks the holdings of real
//     node pools converge within 5% of it.
//   - A project that wants at most its share gets all it wants.
//   - The price: a project at its cap on a node is refused there until the
//     next computation raises it (its refusals raise its want); that is one
//     publication and one watch event, about a second.
//
// # Locally
//
// A node enforces its allotment as its pool's POOL, and cap(n,p) as the
// project's cap (pools.Pool.SetCaps): a capped project is admitted while it
// holds fewer than its cap and in_use < POOL. The local share and floor do
// not apply to capped projects: the fleet kept the floor back already, and
// the local floor would hold back permits the fleet granted (a node with two
// projects whose caps are 3 and 6 would stop the second at POOL - FLOOR =
// 8, one short). A project the fleet has not seen yet (new on this node
// since the last computation) is capped at the node's spare: it is
// admitted at once into that room, and gets its own allocation at the next
// computation after the node publishes it. Before its first view of the
// fleet, and while cut off from etcd, a node has no caps: its rule divides
// its allotment (then its safe slice) among its projects.
//
// The kernel's pools (the connections pool, destination pools) take the
// caps too (loader.Limiter.SetCaps, bpf/lib/cap.h): the programs admit a
// capped project's connect (and, in the connections pool, its inbound
// handshake) while it holds fewer than its cap and the pool's in_use is
// under its POOL, as above; a refusal at the cap is reported with the
// reason fleet_cap. So the one-share bound holds for every kind of fleet
// pool. Without a fleet pool with caps, a connect reads one more word of
// the config the programs have loaded already, and nothing else. Exempt
// connections (connections.exempt) take the exempt budget, not the pool,
// and no cap.
//
// # Edges
//
//   - A node that holds more than its new allotment (or a project more than
//     its new cap) refuses new permits until releases bring it under. No
//     permit is taken back, no socket is closed; the fleet is over S by that
//     excess until those releases.
//   - A newcomer finds the fleet's floor F unallocated whenever some project
//     is past its share; that room is spare, spread over the nodes, so a
//     newcomer is admitted at once on the nodes that hold some of it
//     (F >= nodes: every node) and within one publication and one
//     computation (about a second) everywhere. When every project wants
//     less than its share, U is larger still. When the fleet is exactly
//     divided among projects that each want at least their share (U = 0,
//     e.g. one project alone holding all of S, as on a node), a newcomer
//     waits for that cycle: the immediate floor of a node's rule is not
//     guaranteed at fleet scope on every node.
//   - A node whose lease expired is not in the computation: its projects'
//     wants are gone and its allotment is handed to the others. What it
//     held is not: see departed nodes, below.
//   - The others stop counting a node when its lease ends, a lease_ttl
//     after its last renewal was sent at the soonest. So a node whose
//     renewals fail lowers its allotment linearly over the lease's last
//     quarter and is at its safe slice when it ends: floor(S · safe_fraction),
//     safe_fraction defaulting to one over the number of nodes it last saw
//     (before its first view, F, or for a kernel pool the safe slice its
//     pins kept from the daemon's last run if lower: Config.LastSafe).
//     Past a lease period with no answer from etcd it counts itself cut
//     off and drops its caps (its rule divides the safe slice). It never
//     raises them while cut off, and after a new lease it applies the plan
//     only once its view holds its publication under that lease. During a
//     partition the fleet may hold up to S plus the cut-off nodes' safe
//     slices (less, once their keys are gone, the holdings counted for
//     them as departed nodes); that is the price of every node keeping
//     working without etcd.
//   - A departed node (its key gone: revoked at a clean stop, expired) whose
//     pool outlives the daemon (the kernel's, a Safer) keeps holding what
//     it held: its connections stay open. Its holdings stay counted for
//     Config.DepartedTTL (connections.lapse_after, the time its kernel
//     enforces without a daemon; an hour if that is 0): the live nodes
//     divide S - sum of the departed nodes' holdings, each its record's,
//     clamped to [0, S] (ComputeDeparted), so their allotments and those
//     holdings sum to S. The record is etcd's key Prefix/Pool/departed/Node
//     ({"h": held, "t": unix time, "by": writer}) under a lease of that
//     TTL: a node writes its own at a clean stop, before it revokes its
//     lease, with what its pool holds then; when a key expires, every
//     node that saw it go counts it at once as holding its last published
//     holdings or, if more, its allotment less its safe slice (a killed
//     daemon leaves its kernel pool at its allotment until the lease ends,
//     and may have taken more than it last published), and writes the
//     record on its behalf, in a transaction that creates it only if
//     neither it nor the node's key exists (one writer wins); a node that
//     publishes again deletes its own (its publication carries its
//     holdings; a record of a node whose key is there is not counted).
//     While a node is away its pool holds at most its safe slice past its
//     record, so the fleet holds at most S plus the safe slices of the
//     nodes cut off or away, for DepartedTTL; past it, what a departed
//     node still holds is past S until it is released.
//     User-space pools stop with the daemon and hold nothing: they write
//     no record, and count those they read.
//   - A view counts only while it shows the node's own puts. A node whose
//     view stops (a watch stalled, or ended while its reads fail; etcd
//     restored from a snapshot without --bump-revision, silent) while etcd
//     takes its puts and renewals is not cut off, but the others divide by
//     its publications since, and the view's plan may give it what they
//     gave away. So once the view lacks a put of its own (by revision)
//     answered more than two periods ago, the node holds at most its safe
//     slice, without caps (state stale), and reads the view again. A put
//     answered with a revision at most the previous put's is of another
//     history of etcd's: no view read before it shows it.
//   - Each node publishes its configured S and F; all divide the smallest
//     S and the largest F published, so a resize rolled out node by node
//     never lets the fleet hold more than the smallest.
//   - A node's key written after the node's last publication, under a
//     lease the node was never granted, is another daemon's of the same
//     name: the node holds its safe slice and publishes nothing until that
//     key is gone.
//
// # Cost
//
// A node computes the plan from every node's publication, but only its own
// allotment and caps (ComputeFor): O(D log D) for D demands (a project on
// a node), with 150 allocations where Compute for every node makes 16,966
// and the computation before ComputeFor made 40,922 (BenchmarkCompute at
// 1,000 nodes and 10,000 projects; on a 2-core machine at a load of 20,
// medians of 3 interleaved: 24.7 ms, against 73.0 ms and 123.0 ms). The
// watch coalesces the publications that arrive within a fifth of a period
// of the last computation into one, and, where a computation takes more
// than a fiftieth of a period, those within ten computations' time: a
// node computes at most a tenth of its time, and at least once a period.
//
// Each node reads every publication: with N nodes etcd sends N² watch
// events a period (a million a second at 1,000 nodes, each a few hundred
// bytes), and each node decodes N a period. A real fleet of that size
// needs an etcd that can send that much, or the etcd gRPC proxy in front
// of it, which coalesces the nodes' identical watches into one watch on
// etcd and fans the events out itself (docs/fleet.md, Load on etcd).
//
// TestFleetSimulation runs a whole fleet in one process. Above 100 nodes
// its nodes share one watch and one computation of the projects'
// allocations per view (exact: every node that saw a view computes the
// same allocations from it), each node then splitting its own allotment
// and publishing under its own lease; this is a seam for that test alone
// (an unexported field of Member), and a real node always has its own
// watch and computation. The simulation therefore measures the rule, the
// write rate and convergence at 1,000 nodes, but not etcd's N² fan-out,
// which it does not make. It also dilates its time to keep up (see there).
//
// Compute is a pure function; Member runs it against etcd.
package fleet
