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
// Run serves the admin API, /metrics, the HTTP front and the permit API, and
// runs the control loop: every tick it calls loader.Tick (active set and share
// into the BPF maps) and Recompute on each user-space pool, and every
// reconcile period it compares the BPF counts with the kernel's socket table.
// The loop logs changes (a pool's active count or share moving, a repair), not
// ticks, so a steady node is quiet.
//
// Policies are applied when they are written (the admin API's PATCH stores,
// fsyncs, then calls scheduler.SetPolicy and Rates.SetLimits before it
// answers) and all at once at start. There is no other writer while the daemon
// runs, because bbolt's file lock keeps the CLI out of the store.
//
// Shutdown (ctx done) stops the servers, closes the limiter's descriptors and
// leaves the pinned programs enforcing, unless DetachOnExit is set, which
// unpins and detaches everything (loader.Cleanup).
package daemon
