// SPDX-License-Identifier: Apache-2.0

// Package wire holds what the permit API's server (package permitd) and its
// Go client (package client) share about the line format: the default socket
// path, the JSON string encoder both use for names and texts, and the
// scanners of the hand-written parsers on each side's common path.
//
// The scanners accept a strict subset of JSON (strings without escapes,
// control characters or invalid UTF-8; unsigned integers of at most 19 digits
// without a leading zero; the literals true and false), each followed by the
// end of a value. On anything else they report false, and the caller hands
// the whole line to encoding/json. So the fast paths never read a line
// differently from encoding/json, which the tests and fuzz targets check.
package wire
