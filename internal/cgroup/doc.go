// SPDX-License-Identifier: Apache-2.0

// Package cgroup holds what the daemon reads about the cgroup v2 hierarchy,
// one function each: where it is mounted (FindMount, from mountinfo, octal
// escapes decoded), how deep a directory is in it as the BPF helpers count
// (Mount.Level), the id of a cgroup (ID: its directory's inode number, the
// value of bpf_get_current_cgroup_id and of sock_diag's INET_DIAG_CGROUP_ID)
// and back (Mount.PathOf), the cgroup of a process (Mount.OfPID: its
// /proc/<pid>/cgroup placed through the mount's Root, so a reader in a
// private cgroup namespace, whose paths start with "..", finds the real
// directory or an error, never another cgroup's), a cgroup as an operator
// writes it (Mount.Path), the tree below a directory by id (Walk), the default rule
// that places a cgroup in a project (ProjectIndex) and removing a tree
// (RemoveTree).
//
// ProjectIndex is the one user-space statement of project membership for
// the directory layout: a project is a directory child of the projects
// root, and every cgroup below it is in it. Membership at any depth, from
// any source, is package internal/membership's (Tree.Find); the kernel
// side's reconcile still asks ProjectIndex until the kernel takes members.
package cgroup
