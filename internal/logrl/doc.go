// SPDX-License-Identifier: Apache-2.0

// Package logrl keeps repeated log lines from flooding the daemon's log.
//
// Handler wraps the daemon's slog.Handler once, so every part (front,
// permit API, admin API, listeners, control loop) is limited the same way
// without a call at each site. Records are grouped by what makes them "the
// same line": the logger's own attributes (part=front), the level and the
// message; the attributes of the record itself (which project, which error)
// do not split a group, since an outage repeats one line with a thousand
// different projects. In each window (10s by default) the first Burst
// records of a group (5) pass; the rest are counted, not written. When the
// window ends the last suppressed record is written once more with
// suppressed=N (how many were not written) and window=10s, so the log says
// both what happened and how often. A group that repeats again after its
// window starts a new one.
//
// Records below Options.MinLevel (Debug by default) are never limited: an
// operator who asked for debug logs asked for all of them. The number of
// groups is bounded (Options.MaxGroups); past it, new groups share one.
package logrl
