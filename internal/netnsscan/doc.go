// SPDX-License-Identifier: Apache-2.0

// Package netnsscan finds the network namespaces that processes of the
// registered cgroups are in: every cgroup.procs of each member's cgroup
// and of the cgroups below it, then /proc/<pid>/ns/net of each process,
// deduplicated by the namespace's inode; the daemon's own namespace (the
// host's) is left out. These are the namespaces where the kernel side
// attaches inbound admission (sk_lookup is per network namespace), so a
// pod's listener is counted and refused like a host process's.
//
// The work is bounded per Step, for big nodes: members new since the last
// SetMembers are read at every step for their first Options.Fresh steps
// (a pod's containers start after its cgroup is registered, so a new pod's
// namespace is found in the step after), oldest first, at most
// Options.Budget directories per step; and all members are swept in cgroup
// order, at most Options.Budget directories per step again, each step
// going on where the last stopped. The first members a scanner is given
// are not new: its first sweep reads them. A namespace that a whole sweep
// did not see is reported gone. One member's tree is read up to
// Options.Budget directories: a bigger one (a tenant with a delegated
// subtree can make thousands of cgroups) is read in part and counted in
// Stats.Truncated, so no member stalls a step. A leaf cgroup costs a stat
// and a read of cgroup.procs (kernfs gives a directory 2 + its
// subdirectories links, so leaves are not listed), a process an open, an
// fstat, an ioctl (NS_GET_ID) and a close of its namespace file, or one
// stat where the kernel gives namespaces no ids (BenchmarkIdentity).
//
// What it reports is as fresh as its reads: a process that joins a
// namespace of its own after its cgroup was last read is found in the next
// sweep at the latest (one step on a small node). A namespace known
// already is reported Joined when a member whose processes were not seen
// in it is (a tenant's process in another's namespace), and each keeps the
// members whose processes it was last seen with. The kernel gives a dead
// namespace's inode number to the next one made: where it gives
// namespaces ids (NS_GET_ID, Linux 6.18), a known number found with
// another id is reported gone and new in one read.
//
// A namespace found is opened for the attach by its process only while the
// process is still in the cgroup it was found in (OpenPid, through a
// pidfd); a pod's namespace a container runtime names without a pid, only
// as a network namespace mounted in /run/netns or /var/run/netns
// (OpenPath: no symbolic link followed, no FIFO waited on).
package netnsscan
