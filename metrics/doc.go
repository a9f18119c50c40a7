// SPDX-License-Identifier: Apache-2.0

// Package metrics exports the daemon's state to Prometheus.
//
// Nothing is counted here: a custom Collector asks the daemon for one
// admin.Status at scrape time (which reads the BPF maps through the loader and
// the user-space pools, rates and scheduler) and turns it into constant
// metrics. So /metrics and `fairshare status` show the same numbers, and a
// scrape costs nothing between scrapes.
//
// Families (labels in braces):
//
//	fairshare_up                                  1 if the last status read worked
//	fairshare_kernel_enforcement                  1 if connections are enforced by BPF
//	fairshare_pool_size|floor|in_use|share{pool}
//	fairshare_pool_active_projects{pool}
//	fairshare_pool_admitted_total|refused_total{pool}
//	fairshare_project_permits_held{pool,project}
//	fairshare_project_admitted_total|refused_total{pool,project}
//	fairshare_project_sleeping{pool,project}              residents only
//	fairshare_project_evictions_total{pool,project,reason} residents only
//	fairshare_project_rate_limited_total{project}
//	fairshare_project_work_tokens{project}                below zero = work debt
//	fairshare_scheduler_in_flight
//	fairshare_scheduler_queue_length{participant}
//	fairshare_scheduler_dispatched_total{class}
//	fairshare_scheduler_wait_seconds                      histogram
//
// Cardinality is bounded by MaxProjects (metrics.max_projects in the config):
// per pool, and for rates and scheduler queues, the projects holding the most
// (then with the most traffic, then by name) keep their own label; the rest
// are summed under project="(other)", a name no project can have. A project
// moving in or out of the named set makes the "(other)" counters step, so
// rate() over "(other)" is approximate; the per-pool totals are exact.
package metrics
