// SPDX-License-Identifier: Apache-2.0

package client

import "github.com/fairshare-dev/fairshare/internal/wire"

// Answers are parsed by hand on the common path because encoding/json was
// the largest user-space cost of a pipelined round trip.
//
// parseReply accepts only a strict subset of JSON: one flat object whose keys
// are the lower-case names of reply's fields, whose strings hold no escapes,
// control characters or invalid UTF-8, whose numbers are unsigned integers
// without a leading zero that fit their field, and whose booleans are
// literals. Anything else (a nested refusal or eviction, an escape, another
// key) makes it return false and the caller uses encoding/json, so the fast
// path never reads a line differently from encoding/json.
func parseReply(line []byte, rp *reply) bool {
	*rp = reply{}
	return wire.WalkObject(line, func(key []byte, j int) (int, bool) {
		switch string(key) {
		case "id", "lease", "session", "retry_after_ms":
			v, k, ok := wire.ScanUint(line, j)
			if !ok {
				return 0, false
			}
			switch string(key) {
			case "id":
				rp.ID = v
			case "lease":
				rp.Lease = v
			case "session":
				rp.Session = v
			default:
				if v > 1<<62 {
					return 0, false
				}
				rp.RetryAfterMS = int64(v)
			}
			return k, true
		case "ok", "released":
			v, k, ok := wire.ScanBool(line, j)
			if !ok {
				return 0, false
			}
			if string(key) == "ok" {
				rp.OK = v
			} else {
				rp.Released = v
			}
			return k, true
		case "code", "error", "note", "event", "project", "object", "reason":
			s, k, ok := wire.ScanString(line, j)
			if !ok {
				return 0, false
			}
			switch string(key) {
			case "code":
				rp.Code = string(s)
			case "error":
				rp.Error = string(s)
			case "note":
				rp.Note = string(s)
			case "event":
				rp.Event = string(s)
			case "project":
				rp.Project = string(s)
			case "object":
				rp.Object = string(s)
			default:
				rp.Reason = string(s)
			}
			return k, true
		}
		return 0, false
	})
}
