// SPDX-License-Identifier: Apache-2.0

// Package policy validates and stores per-project policies.
//
// A policy says what a project bought, not what it may hold: the tier (pro,
// lite or none) and shares decide its request-class buckets in the scheduler,
// and requests_per_sec / work_per_sec bound what it may spend per second in
// the HTTP front, connections_per_sec the new TCP connections it may open and
// accepts_per_sec those its listeners may accept per second in the kernel,
// each from a bucket of its own (0 = unbounded; otherwise from MinRate,
// one per 1000 seconds, to MaxRate, a billion per second). What a project may hold on the node is never configured: that is
// the fair-share rule in package pools.
//
// The store is one bbolt file, policies.db, in the state directory. A write
// returns only after bbolt's commit has fsynced the file, so a policy that was
// reported saved survives SIGKILL and power loss. bbolt holds an exclusive
// flock while the file is open; a second opener waits up to Options.Timeout
// and then fails with ErrLocked. The daemon keeps the store open for its whole
// life, so while it runs the CLI goes through the admin API and the daemon does
// the write; the CLI opens the file itself only when no daemon answers.
//
// The same file holds the operator's registrations of cgroups to projects
// ('fairshare project add'), the "registered" source of package
// internal/membership: a bucket keyed by cgroup path, so a cgroup is
// registered once; AddMembers writes a batch all or nothing. A bucket of its
// own keeps the policies file's content the daemon last put in force
// (SaveAccepted), so that a daemon starting with a file that does not
// validate keeps the file's policies.
//
// Every write bumps a version counter in the same transaction, so a reader can
// tell cheaply whether anything changed.
//
// Project names are cgroup directory names, header values and metric labels
// at once: 1 to 64 bytes of letters, digits, '.', '_' and '-', starting with a
// letter or digit and not with "cgroup." (the one rule of package
// internal/project, which every entry point applies).
package policy
