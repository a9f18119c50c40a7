// SPDX-License-Identifier: Apache-2.0

// Package membership says which cgroups are in which project: one Member
// per registered cgroup, at any depth of the cgroup2 hierarchy; every
// process in that cgroup or below it is in the project. It is a leaf
// (it imports only internal/cgroup and internal/project), so the kernel
// side and the daemon share its types.
//
// Members come from sources, each behind the Source interface, optionally
// with a change notification (Notifier):
//
//   - directory (NewDirectory): every child directory of the projects root
//     is the project of its name. The default, and the layout before
//     membership became data.
//   - systemd (NewSystemd): the projects root is a slice's cgroup
//     (fairshare.slice); its child slices fairshare-<name>.slice are the
//     projects. A dash nests in systemd (fairshare-a-b.slice lives inside
//     fairshare-a.slice, so it is part of project a), hence a project
//     name with a dash is written \x2d in the unit name, as systemd-escape
//     writes it: project web-api is fairshare-web\x2dapi.slice (SliceName).
//   - registered (Static): the operator's explicit registrations, which the
//     daemon keeps in its store.
//   - a source read by polling something slow, such as the Kubernetes
//     source (a container runtime's pods), is a Polled: its fetch runs on
//     its own schedule, bounded, and Scan returns the last result or error
//     without waiting.
//
// A source's Scan error means it could not be read; the caller keeps the
// members of its last good scan in force and shows the error.
//
// Resolve unions the sources' scans into one accepted set and the refused
// rest, with why: an invalid name or path, a cgroup claimed twice, or a
// cgroup at, above or below one of another project. It is deterministic:
// the members in force win over newcomers, then the earlier source, then
// the order of Compare, so a conflict is refused the same way every time
// and can be reported once. Diff compares two accepted sets; Tree finds the
// member a cgroup is in (itself or its nearest registered ancestor), which
// is how user space places a process, a socket or a peer in a project.
package membership
