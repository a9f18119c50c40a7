// SPDX-License-Identifier: Apache-2.0

// Package pace spaces the return of refused clients, per project.
//
// A refusal carries an estimate of when the project could be admitted again,
// but every client refused in the same instant gets about the same estimate,
// so a crowd that obeys returns as a crowd and is refused again together.
// A Pacer instead gives each refusal of a project its own return slot: the
// estimate plus one 1/rate for each of the project's refused clients still
// due back, where rate is how fast the project can be admitted again. That
// backlog is a count draining at the rate, so a rate measured anew moves
// every later slot. Clients that obey their slot return at about the rate
// they can be served. Projects have their own backlog, so one project's crowd
// does not push another's out, and a project that keeps asking without
// obeying pushes only its own slots, up to the caller's horizon. A refusal
// at an unknown rate (nothing released yet) gets its estimate and no place in
// line.
//
// The HTTP front (Retry-After, whole seconds) and the permit API
// (retry_after_ms) both use it, with Spread for the jitter; the front rounds
// to whole seconds at random.
package pace
