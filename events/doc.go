// SPDX-License-Identifier: Apache-2.0

// Package events carries the decisions an operator needs to see when a
// tenant's connections or requests fail: what was refused (or would have
// been, in dry-run), for whom, why, and the rule's inputs at that moment
// (held, in use, share, pool size). The kernel's refusals, the front's and
// the permit API's, evictions and reconcile's repairs all become an Event.
//
// A Hub fans events out to subscribers (the admin API streams them to
// `fairshare events`). Publishing never blocks the decision that made the
// event: a subscriber that falls behind loses events and receives a
// KindDropped event with the count as soon as it has room. A Log keeps them
// as JSON lines in a file rotated by size, written by a goroutine of its
// own: a file that is slow, full or hung loses events (counted) and never
// holds up the decision.
//
// Events are for diagnosis, not accounting: the counters in the metrics are
// exact, events may be dropped under a flood (the kernel limits their rate
// per project, and says how many it dropped).
package events
