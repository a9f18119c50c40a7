// SPDX-License-Identifier: Apache-2.0

// Package pace spaces the return of refused clients, per project.
//
// A refusal carries an estimate of when the project could be admitted again,
// but every client refused in the same instant gets about the same estimate,
// so a crowd that obeys returns as a crowd and is refused again together.
// A Pacer instead gives each refusal of a project its own return slot: the
// first at now plus the estimate, each later one 1/rate after the previous,
// where rate is how fast the project can be admitted again. Clients that obey
// their slot return at about the rate they can be served. Projects have their
// own slots, so one project's crowd does not push another's out, and a project
// that keeps asking without obeying pushes only its own slots, up to a cap.
//
// The HTTP front (Retry-After, whole seconds) and the permit API
// (retry_after_ms) both use it; each adds its own jitter and rounding.
package pace
