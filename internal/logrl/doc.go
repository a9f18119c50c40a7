// SPDX-License-Identifier: Apache-2.0

// Package logrl keeps repeated log lines from flooding the daemon's log.
//
// Handler wraps the daemon's slog.Handler once, so every part (front,
// permit API, admin API, listeners, control loop) is limited the same way
// without a call at each site. Records are grouped by what makes them "the
// same line": the logger's own attributes (part=front), the level, the
// message, and the values of a few attributes of the record that say what
// kind of event it is (Options.KeyAttrs: listener, reason, pool, code, and
// the class of err: its errno, a timeout, an end of stream, or the type and
// digit-free text of the innermost error). Other attributes (which project,
// which peer, which address) do not split a group: an outage repeats one
// line with a thousand projects, and a flood one line with a thousand
// peers, whose values are the attacker's to choose.
//
// In each window (10s by default) the first Burst records of a group (5)
// pass; the rest are counted, not written. So the first record of every
// kind is written: a flood of refusals on one listener does not hide the
// first refusal on another, nor a new kind of upstream error behind a known
// one. When the window ends the last suppressed record is written once more
// with suppressed=N (how many were not written) and window=10s, so the log
// says both what happened and how often. A group that repeats again after
// its window starts a new one.
//
// Audit records (carrying Audit(): a policy set or deleted, a permit
// session opened or closed) are always written and never counted. Records
// below Options.MinLevel (Debug by default) are never limited either: an
// operator who asked for debug logs asked for all of them.
//
// Memory is bounded: at most Options.MaxGroups (1024) groups are tracked,
// each holding one record; groups whose window ended with nothing pending
// are dropped when room is needed, and past the bound new kinds of line
// share one overflow group (its first lines still pass, then it is counted
// like any other).
package logrl
