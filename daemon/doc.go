// SPDX-License-Identifier: Apache-2.0

// Package daemon wires fairshare's parts into the privileged node daemon.
//
// One Daemon owns: the policy store (held open, so the daemon is the only
// writer and the CLI goes through the admin API), the BPF connection limiter
// (package loader; pinned, so it keeps enforcing across restarts), the
// user-space pools (requests for the HTTP front; flights, residents and any
// extra pool for the local permit API), the per-project rate buckets and the
// request-class scheduler.
//
// New builds the parts in steps: the TCP listeners, the store, the
// user-space pools and the scheduler, the front, the permit API, the fleet
// side (fleetSide: one etcd client and a fleet.Member per pool marked
// fleet: true, which sets the pool's size, and a user-space pool's caps,
// from the fleet's allotment; see package fleet), the unix sockets, and last
// the kernel's connections pool (kernelSide, the one place the daemon talks
// to package loader). A start that is refused writes nothing: what can be
// checked is checked before anything is made (preflight: socket paths, the
// state directory, the events log, the exempt cgroups, the host's names),
// and what a later failure finds made is removed again (sockets, a store
// file or directories it made, pins it added). The kernel side comes last
// so that pins a killed daemon left keep enforcing exactly as they were
// when a start fails (see start.go and docs/starting.md). Every pool,
// whoever enforces it, is one small view (pool: name, recompute, status),
// so the control loop and Status go over one list; a fleet pool's status
// carries its fleet view.
//
// Run serves the admin API, /metrics and /healthz (503 when the control
// loop has not ticked for 5 ticks, at least 5s: health.go), the HTTP front
// and the permit API, and runs the control loop: every tick it recomputes
// each pool (for the
// kernel's, loader.Tick writes the active set and share into the BPF maps),
// and every reconcile period it compares the BPF counts with the kernel's
// socket table. The loop logs changes, not ticks: a repair at Warn (the
// loader's line, one per kind of repair), a pool's active count or share
// moving at Debug (on a busy node it moves every few ticks; the
// fairshare_pool_share metric keeps the history), so a steady node is quiet.
// A failed recompute is logged with its consequence: the pool keeps the last
// share (for the kernel's, the programs keep enforcing it) until one
// succeeds.
//
// Every listener (admin, /metrics, the front on TCP and on its unix socket,
// the permit API) is served through package internal/listen: accept errors
// are waited out, and connections are capped from the open-files limit,
// which New raises to the hard limit, and a memory budget (BudgetCaps: the
// daemon keeps 256 descriptors for itself, room for the front's upstream,
// 32 for /metrics and 32 for the admin socket, some of each root's alone,
// and divides the rest among the other listeners, at most 4096 each;
// listeners.max_conns overrides). One peer (listenOptions: a user with its
// subordinate uids, a project on the front, a remote address) holds at
// most a 64th of a listener. So a local user's flood cannot take the
// descriptors the operator's CLI needs. Every part logs through one
// internal/logrl handler, which turns a flood of one line into five lines
// and a count.
//
// Membership (projects.go) is which cgroups are in which project. The
// sources of projects.sources (the children of projects_root as directories
// or as systemd slices, the operator's registrations, kept in the store,
// and the pods of the node's container runtime, package kube) are read at
// every tick and at once when one reports a change (inotify on the root, a
// registration, a poll of the runtime that found other pods); their union (package
// internal/membership: conflicts refused the same way every time, each
// logged once) goes to the kernel side (kernelSide.members, nil until the
// loader takes members) and to the network namespace scan (package
// internal/netnsscan), one bounded step per tick, whose new namespaces get
// inbound admission attached; a pod's own namespace is attached in the
// apply that makes the pod a member, from the runtime's word
// (attachPodNetns), before the scan finds it. A registration through the admin API is
// checked against the members in force and those pending, stored, and
// answered once an apply has put it in force; concurrent registrations share
// one apply. After a restart the kernel's members are in force until every
// source has been read once (at most unreadHold), so a source slow to answer
// (a polled container runtime) does not take its members out meanwhile. Status carries the membership as one immutable view rebuilt
// when it changes, so a scrape costs nothing for it.
//
// Effective resolves every default of the configuration (projects root,
// floors, exempt budgets, caps) once; the daemon runs on what it returns and
// 'run --print-config' prints it. Problems only building the parts finds (a
// permit group that does not exist, a trusted cgroup outside the mount, a
// file at a socket path) wrap config.ErrInvalid.
//
// Status reads each pool as one snapshot whose rows add up: a user-space
// pool under its lock, with the counts of forgotten projects in
// Pool.Forgotten; the kernel's pool from one pass over its entries (in_use
// and the totals are the sums over that pass, not the node counters read
// apart from it), with the counts of entries the loader forgot kept by the
// daemon (kernelBook, read every 15 s, well inside the minute an entry idles
// before it is deleted), and with the programs' own active count and the
// share it gives. The last reconcile pass (time, project sockets in the
// kernel's table, permits held, repairs) is in Status too, and each pass is
// a debug line.
//
// Status joins three sources per project: the stored policy (or the default,
// for projects without one), the rate buckets, and the scheduler's live
// participants, which it forgets when idle; tier and shares therefore come
// from the store, and only the balances and queues from the scheduler. Pool
// totals come from the pools, so they survive idle projects being forgotten,
// and rate refusals of a bucket deleted with its limits stay counted.
//
// Policies are applied when they are written (the admin API's PATCH stores,
// fsyncs, then calls scheduler.SetPolicy and Rates.SetLimits before it
// answers; a DELETE calls scheduler.DeletePolicy and removes the buckets) and
// all at once at start. Pins of another layout are migrated by loader.Open
// under the daemon's lock on the pin directory (Options.PinLock); an Open
// that finds them changed while it loads (another process at work there)
// fails with ErrStalePins, one sentence naming the pin directory and the
// remedy (a start again once that process is done). There is no other writer while the daemon
// runs, because bbolt's file lock keeps the CLI out of the store.
//
// Events: the daemon owns one eventSink (events.go) that every part
// publishes to: the front (share, rate, debt and identity refusals), the
// permit API (refusals, evictions), reconcile (adoptions, repairs) and the
// kernel's refusals. It bounds each project's events per second
// (events.per_sec; the BPF programs apply the same bound in the kernel),
// numbers them, keeps the last events.recent for 'fairshare events', appends
// them to events.log if configured, and fans them out to the admin API's
// streams through an events.Hub; a dropped event says what the bound cut.
// None of it blocks a decision.
//
// The kernel's refusals come from the programs' ring buffer
// (kernel_events.go: loader.ReadRefusals, one goroutine of Run; a reader
// that fails is logged, enforcement goes on), and what the programs dropped
// over their bound is read from the maps each tick and becomes the sink's
// dropped notices.
//
// Dry-run: a pool's enforce: false (configuration) or a project's (its
// policy, live) puts the user-space pools in dry-run (pools.Pool.SetDryRun),
// the front's rate checks for the project (dryRun), and the kernel: the
// pool's flag and the projects' set go into the maps (loader.Options.Events
// at start, before the programs are attached,
// SetDryRunProjects when a policy changes and every tick, for a project
// whose cgroup came later). What the rule would refuse is admitted, counted
// as would_refuse and published as such.
//
// Shutdown (ctx done) stops the servers, closes the limiter's descriptors and
// leaves the pinned programs enforcing, unless DetachOnExit is set, which
// unpins and detaches everything (loader.Cleanup).
package daemon
