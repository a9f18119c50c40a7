// SPDX-License-Identifier: Apache-2.0

package permitd

import "github.com/fairshare-dev/fairshare/internal/wire"

// The request line is parsed by hand on the common path because
// encoding/json (reflection, a validating pre-scan and one string allocation
// per field) was a fifth of the server's CPU in the pipelined benchmark.
//
// parseFast accepts only a strict subset of JSON: one flat object whose keys
// are the documented lower-case names, whose string values hold no escapes,
// control characters or invalid UTF-8, and whose numbers are unsigned
// integers without a leading zero that fit their field. Anything else (an
// unknown or differently cased key, a null, a negative or fractional number,
// nesting, an escape) makes it return false, and the line goes to
// parseRequest, which decides with encoding/json. So the fast path never
// accepts a line that encoding/json would reject or read differently, and
// malformed input keeps its error code and message.

// Bounds of the per-session string table.
const (
	internMax    = 4096 // entries
	internMaxLen = 256  // bytes of one entry
)

// interner turns the names a session sends again and again (pools, projects,
// objects) into strings without allocating each time. It belongs to one
// session's reader goroutine and is bounded: past internMax entries, or for
// long names, a name is allocated as usual.
type interner struct{ m map[string]string }

func (in *interner) str(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	if s, ok := in.m[string(b)]; ok { // the conversion in a map index does not allocate
		return s
	}
	s := string(b)
	if len(b) <= internMaxLen && len(in.m) < internMax {
		if in.m == nil {
			in.m = make(map[string]string)
		}
		in.m[s] = s
	}
	return s
}

// opName returns the constant for a known op so that matching and storing
// it costs no allocation; an unknown op is interned like any name.
func (in *interner) opName(b []byte) string {
	switch string(b) {
	case "acquire":
		return "acquire"
	case "release":
		return "release"
	case "spawn":
		return "spawn"
	case "touch":
		return "touch"
	case "sleep":
		return "sleep"
	case "remove":
		return "remove"
	case "hello":
		return "hello"
	case "ping":
		return "ping"
	}
	return in.str(b)
}

// parseFast fills rq from line when line is in the subset described above.
// On false rq is undefined and the caller must use parseRequest.
func (in *interner) parseFast(line []byte, rq *request) bool {
	*rq = request{}
	return wire.WalkObject(line, func(key []byte, j int) (int, bool) {
		switch string(key) {
		case "id", "lease", "wait_ms":
			v, k, ok := wire.ScanUint(line, j)
			if !ok {
				return 0, false
			}
			switch string(key) {
			case "id":
				rq.ID = v
			case "lease":
				rq.Lease = v
			default:
				if v > 1<<62 {
					return 0, false // out of int64's range: encoding/json words the error
				}
				rq.WaitMS = int64(v)
			}
			return k, true
		case "op", "pool", "project", "object":
			s, k, ok := wire.ScanString(line, j)
			if !ok {
				return 0, false
			}
			switch string(key) {
			case "op":
				rq.Op = in.opName(s)
			case "pool":
				rq.Pool = in.str(s)
			case "project":
				rq.Project = in.str(s)
			default:
				rq.Object = in.str(s)
			}
			return k, true
		}
		return 0, false
	})
}
