// SPDX-License-Identifier: Apache-2.0

// Package answerfield names the fields of an upstream's answer that the
// front relays by rules of its own: the hop-by-hop fields (never relayed),
// the fields that frame or describe the body (Content-*: the front relays
// the body by its length, and a client needs them to read it), Date (the
// front adds one when the upstream sent none) and the front's own fields
// (set by the front, never taken from an upstream). A header the front
// takes out of every answer, as it takes the cost header, must not be one
// of them: Reserved says why.
package answerfield
