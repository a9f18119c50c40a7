// SPDX-License-Identifier: Apache-2.0

package permitd

import (
	"github.com/fairshare-dev/fairshare/internal/project"
	"github.com/fairshare-dev/fairshare/internal/wire"
)

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
	// internMaxBytes bounds what the table holds, counted as internCost
	// per name: with the 4 KiB read buffer and the rest of an idle
	// session, well inside the 16 KiB a connection is budgeted
	// (docs/security.md). It holds the few names a runtime repeats; past
	// it a name is allocated as usual, which costs time, not memory.
	internMaxBytes = 8 << 10
	internMaxLen   = 256 // bytes of one name: a longer one is not worth a place
	// internOverhead is a name's cost beyond its bytes: the map's key and
	// value headers, its control bytes and free slots, the allocation's
	// rounding.
	internOverhead = 64
)

// internCost is what keeping s costs the session, as internMaxBytes counts.
func internCost(s string) int { return len(s) + internOverhead }

// interner turns the names a session sends again and again (pools, projects,
// objects) into strings without allocating each time. It belongs to one
// session's reader goroutine and is bounded: it keeps only names that mean
// something to the server (a known op or a served pool, which come from
// tables of the server and take no room; a valid project name; an object
// name), and only up to internMaxBytes. It used to keep any name, valid or
// not, before the request was checked, up to 4096 of 256 bytes: a session
// sending made-up op names held 1.3 MB for its whole life.
type interner struct {
	m     map[string]string
	bytes int               // kept in m, as internCost counts
	pools map[string]string // the server's served pool names, read only
}

// keep returns s, kept for the next time if there is room.
func (in *interner) keep(s string) string {
	if len(s) > internMaxLen || in.bytes+internCost(s) > internMaxBytes {
		return s
	}
	if in.m == nil {
		in.m = make(map[string]string)
	}
	in.m[s] = s
	in.bytes += internCost(s)
	return s
}

// object returns an object name.
func (in *interner) object(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	if s, ok := in.m[string(b)]; ok { // the conversion in a map index does not allocate
		return s
	}
	return in.keep(string(b))
}

// project returns a project name; only a valid one is kept (an invalid one
// is refused by the operation).
func (in *interner) project(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	if s, ok := in.m[string(b)]; ok {
		return s
	}
	s := string(b)
	if project.Validate(s) != nil {
		return s
	}
	return in.keep(s)
}

// pool returns the server's string for a served pool; any other name is
// allocated and not kept.
func (in *interner) pool(b []byte) string {
	if s, ok := in.pools[string(b)]; ok {
		return s
	}
	if len(b) == 0 {
		return ""
	}
	return string(b)
}

// opName returns the constant for a known op so that matching and storing
// it costs no allocation; an unknown op is allocated and not kept.
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
	case "":
		return ""
	}
	return string(b)
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
				rq.Pool = in.pool(s)
			case "project":
				rq.Project = in.project(s)
			default:
				rq.Object = in.object(s)
			}
			return k, true
		}
		return 0, false
	})
}
