// SPDX-License-Identifier: Apache-2.0

// Package compare measures fairshare side by side with the admission
// schemes its users would otherwise pick: Kubernetes API Priority and
// Fairness's queueset, static per-project caps (what nginx limit_conn per
// tenant gives) and a FIFO semaphore. Each scheme gets the same closed-loop
// workloads and is driven as its users drive it; the report gives, per
// scheme and workload, Jain's fairness index of the seat-time the projects
// held against their max-min fair share given their demands, the small
// projects' p99 latency against their p99 alone, the pool's utilization
// while demand exceeds it, the newcomers' wait for their share of a full
// pool, and refusals per admitted request; for the workload with mixed
// service times, each project's share of the seat-time and of the
// requests. docs/compare.md has the results and what they mean.
//
// The code sleeps and reads the clock as any program does; which clock
// that is depends on the caller. `make compare` and the package's tests run
// it inside a testing/synctest bubble, in virtual time, so that the
// machine's load cannot blur the numbers. Command cmd/compare runs it in
// real time, and with -http puts the front beside nginx and HAProxy.
//
// It is a module of its own so that k8s.io/apiserver stays out of
// fairshare's.
package compare
