// SPDX-License-Identifier: Apache-2.0

package sockdiag

// CountByCgroup counts the sockets for which include returns true (all of
// them when include is nil) by cgroup id. Sockets without a cgroup id
// (TIME_WAIT, SYN_RECV) are counted under 0.
func CountByCgroup(socks []Socket, include func(Socket) bool) map[uint64]int {
	counts := make(map[uint64]int)
	for _, s := range socks {
		if include == nil || include(s) {
			counts[s.CgroupID]++
		}
	}
	return counts
}

// CountByProject folds per-cgroup counts into per-project counts with an
// index from cgroup.ProjectIndex. Counts of cgroups outside the index (other
// hierarchies, cgroups created after the walk, the 0 of TIME_WAIT) are
// returned under "" so that nothing disappears silently.
func CountByProject(counts map[uint64]int, index map[uint64]string) map[string]int {
	out := make(map[string]int)
	for id, n := range counts {
		out[index[id]] += n
	}
	return out
}
