// SPDX-License-Identifier: Apache-2.0

// Package labels is the one policy for the project label of the daemon's
// metrics (metrics.max_projects): the collector over the daemon's status
// (package metrics) and the front's own collector both keep their
// per-project series through a Set.
//
// A group (a pool, the rate buckets, the scheduler's queues, the front's
// requests) emits at most its cap of project label values, Other included:
// projects with a label of their own, and the rest summed under Other,
// "(other)", a name no project can have (the one project-name rule refuses
// parentheses).
//
// Labels are sticky: a project keeps its label for as long as its owner
// reports it, so the set of named series does not churn with load. A label
// frees only when its project drops out of the owner's state (forgotten
// after idling), and then goes to the busiest unnamed project (the owner
// lists its projects busiest first).
//
// The owners' per-project counts are not counters in Prometheus's sense:
// they restart at zero when an idle project is forgotten and comes back, and
// a sum over the unnamed projects would lose a member whenever one is
// forgotten or moves to its own label. So each series is kept here as the
// sum of its projects' increases between scrapes, from zero when it got its
// label; it only grows. Where the owner gives its own total (a pool's
// admitted and refused), Other is that total less the named series
// (Remainder), so the series of the group always add up to its total.
package labels
