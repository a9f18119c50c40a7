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
//	fairshare_pool_rate_limited_total{pool}                 kernel pool: refused by a project's rate
//	fairshare_project_permits_held{pool,project}
//	fairshare_project_admitted_total|refused_total{pool,project}
//	fairshare_project_permits_rate_limited_total{pool,project} kernel pool: connections_per_sec and accepts_per_sec
//	fairshare_project_sleeping{pool,project}              residents only
//	fairshare_project_evictions_total{pool,project,reason} residents only
//	fairshare_project_rate_limited_total{project}
//	fairshare_project_work_tokens{project}                below zero = work debt
//	fairshare_scheduler_in_flight
//	fairshare_scheduler_queue_length{participant}
//	fairshare_scheduler_dispatched_total{class}
//	fairshare_scheduler_wait_seconds                      histogram
//	fairshare_reconcile_passes_total|failures_total|repairs_total
//	fairshare_reconcile_last_pass_timestamp_seconds
//	fairshare_reconcile_sockets|held                      at the last pass
//	fairshare_kernel_events_total{event}                  the BPF programs' node-wide counters: adopted,
//	                                                      late, unaccounted, expired, map_full
//	fairshare_listener_open_connections|max_connections{listener}
//	fairshare_listener_accepted_total|accept_errors_total{listener}
//	fairshare_listener_refused_total{listener,reason}     reason: listener_full, peer_full
//	fairshare_membership_members{source}                  registered cgroups in force
//	fairshare_membership_refused{source,by}               by: sources or kernel
//	fairshare_membership_source_up{source}                1 if its last read worked
//	fairshare_netns_namespaces|attached                   the members' network namespaces
//	fairshare_netns_sweeps_total|scan_errors_total
//	fairshare_netns_sweep_seconds                         the last sweep's steps, summed
//	fairshare_policies_file_refused                       1 while its current content is refused
//	fairshare_policies_file_refusals_total|projects
//	fairshare_policies_file_last_refused_timestamp_seconds|loaded_timestamp_seconds
//
// Cardinality is bounded by MaxProjects (metrics.max_projects in the config),
// by the one policy of package internal/labels, which the front's request
// families follow too: per pool, and for rates and scheduler queues, at most
// MaxProjects-1 projects have a label of their own and the rest are summed under
// project="(other)", a name no project can have. Labels are sticky: a
// project keeps its label while the daemon reports it, and a label frees
// only when its project is forgotten (idle past the pool's forget period),
// going then to the busiest unnamed project.
//
// Every counter series only grows while it exists. The daemon's own
// per-project counts restart at zero when a forgotten project returns, and
// a sum under "(other)" would drop whenever a member left it, so the
// collector keeps each series as the sum of its members' increases between
// scrapes (a count below the last one is a restart from zero). A named
// series whose project was forgotten ends; if the project later gets a
// label again, its series starts over at the project's new count, a real
// restart that rate() handles. The per-pool totals come from the pools
// themselves and never go down.
package metrics
