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
// The loop logs changes, not ticks: a repair at Warn, a pool's active count or
// share moving at Debug (on a busy node it moves every few ticks; the
// fairshare_pool_share metric keeps the history), so a steady node is quiet.
// A failed BPF tick is logged with its consequence: the kernel keeps the last
// share it was given until a tick succeeds.
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
// all at once at start. A loader.Open failure caused by pins of another
// configuration is ErrStalePins, one sentence naming the pin directory and
// 'fairshare cleanup'. There is no other writer while the daemon
// runs, because bbolt's file lock keeps the CLI out of the store.
//
// Shutdown (ctx done) stops the servers, closes the limiter's descriptors and
// leaves the pinned programs enforcing, unless DetachOnExit is set, which
// unpins and detaches everything (loader.Cleanup).
package daemon
