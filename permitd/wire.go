// SPDX-License-Identifier: Apache-2.0

package permitd

import (
	"encoding/json"
	"errors"
	"strconv"

	"github.com/fairshare-dev/fairshare/internal/wire"
	"github.com/fairshare-dev/fairshare/pools"
)

// MaxLine bounds one request line, newline included. A longer line cannot be
// answered in place (its id is unknown and the frame has no end in sight), so
// the connection is closed after a LINE_TOO_LONG answer.
const MaxLine = 64 << 10

// Error codes carried in an answer's "code" field; doc.go says when each is used.
const (
	CodeBadRequest       = "BAD_REQUEST"
	CodeUnknownOp        = "UNKNOWN_OP"
	CodeUnknownPool      = "UNKNOWN_POOL"
	CodeMissingField     = "MISSING_FIELD"
	CodeRefused          = "REFUSED"
	CodeTooManyResidents = "TOO_MANY_RESIDENTS"
	CodeUnknownObject    = "UNKNOWN_OBJECT"
	CodeConflict         = "CONFLICT"
	CodeCanceled         = "CANCELED"
	CodeLineTooLong      = "LINE_TOO_LONG"
	CodeForbidden        = "FORBIDDEN"
	CodeTooManyWaiting   = "TOO_MANY_WAITING"
	CodeTooManySessions  = "TOO_MANY_SESSIONS"
	CodeTooManyObjects   = "TOO_MANY_OBJECTS"
)

// ResidentsPool is the pool name under which the residents pool is served to
// acquire; spawn is the same operation by its own name.
const ResidentsPool = "residents"

// request is one line from a client. Unknown fields are ignored so that older
// servers accept newer clients' optional fields.
type request struct {
	ID      uint64 `json:"id"`
	Op      string `json:"op"`
	Pool    string `json:"pool"`
	Project string `json:"project"`
	Object  string `json:"object"`
	Lease   uint64 `json:"lease"`
	WaitMS  int64  `json:"wait_ms"`
}

// parseRequest decodes one line. On failure it still returns whatever id it
// could read, so the client can match the BAD_REQUEST answer.
func parseRequest(line []byte, rq *request) error {
	*rq = request{}
	if err := json.Unmarshal(line, rq); err != nil {
		var idOnly struct {
			ID uint64 `json:"id"`
		}
		if json.Unmarshal(line, &idOnly) == nil {
			rq.ID = idOnly.ID
		} else {
			rq.ID = 0
		}
		var syn *json.SyntaxError
		var typ *json.UnmarshalTypeError
		switch {
		case errors.As(err, &syn):
			return errors.New("malformed JSON: " + syn.Error())
		case errors.As(err, &typ):
			return errors.New("field " + strconv.Quote(typ.Field) + ": " + typ.Error())
		default:
			return errors.New("malformed request: " + err.Error())
		}
	}
	if rq.WaitMS < 0 {
		return errors.New("wait_ms must not be negative")
	}
	return nil
}

// response is one answer line. Zero fields are left out on the wire.
type response struct {
	ID           uint64
	OK           bool
	Lease        uint64
	HasReleased  bool // whether Released goes on the wire (release answers only)
	Released     bool
	Code         string
	Error        string
	RetryAfterMS int64
	Refusal      *pools.Refusal
	Evicted      *pools.Eviction
	Session      uint64
	Server       string
	Note         string

	// settle, not on the wire: the object a spawn loaded, to be settled
	// (Server.settle) once this answer is written.
	settle *object
	object string
}

// appendResponse encodes r as one JSON line. It is hand-written because the
// answer path runs once per request and reflection-based encoding was the
// largest cost in the pipelined benchmark.
func appendResponse(b []byte, r *response) []byte {
	b = append(b, `{"id":`...)
	b = strconv.AppendUint(b, r.ID, 10)
	if r.OK {
		b = append(b, `,"ok":true`...)
	} else {
		b = append(b, `,"ok":false`...)
	}
	if r.Lease != 0 {
		b = append(b, `,"lease":`...)
		b = strconv.AppendUint(b, r.Lease, 10)
	}
	if r.HasReleased {
		b = append(b, `,"released":`...)
		b = strconv.AppendBool(b, r.Released)
	}
	if r.Code != "" {
		b = appendField(b, "code", r.Code)
	}
	if r.Error != "" {
		b = appendField(b, "error", r.Error)
	}
	if r.Note != "" {
		b = appendField(b, "note", r.Note)
	}
	if r.Code == CodeRefused || r.RetryAfterMS > 0 {
		b = append(b, `,"retry_after_ms":`...)
		b = strconv.AppendInt(b, r.RetryAfterMS, 10)
	}
	if f := r.Refusal; f != nil {
		b = append(b, `,"refusal":{`...)
		b = wire.AppendString(b, "pool")
		b = append(b, ':')
		b = wire.AppendString(b, f.Pool)
		b = appendField(b, "project", f.Project)
		b = appendField(b, "reason", f.Reason)
		b = appendInt(b, "held", f.Held)
		b = appendInt(b, "share", f.Share)
		b = appendInt(b, "in_use", f.InUse)
		b = appendInt(b, "size", f.Size)
		b = append(b, '}')
	}
	if e := r.Evicted; e != nil {
		b = append(b, `,"evicted":`...)
		b = appendEviction(b, e)
	}
	if r.Session != 0 {
		b = append(b, `,"session":`...)
		b = strconv.AppendUint(b, r.Session, 10)
	}
	if r.Server != "" {
		b = appendField(b, "server", r.Server)
	}
	return append(b, '}', '\n')
}

// Events the server sends to the owner of an object.
const (
	// EventEvict asks the owner to put the object to sleep and confirm.
	EventEvict = "evict"
	// EventDropped tells the owner that the server ended the object's
	// residence without it (MaxUnconfirmed): the object no longer holds a
	// permit, and must be put to sleep; there is nothing to confirm.
	EventDropped = "dropped"
)

// appendEvent encodes event kind (EventEvict, EventDropped) for e, whose
// residence is lease.
func appendEvent(b []byte, kind string, e *pools.Eviction, lease uint64) []byte {
	b = append(b, `{"event":`...)
	b = wire.AppendString(b, kind)
	b = append(b, `,"project":`...)
	b = wire.AppendString(b, e.Project)
	b = appendField(b, "object", e.Object)
	b = appendField(b, "reason", e.Reason)
	b = append(b, `,"lease":`...)
	b = strconv.AppendUint(b, lease, 10)
	return append(b, '}', '\n')
}

func appendEviction(b []byte, e *pools.Eviction) []byte {
	b = append(b, `{"project":`...)
	b = wire.AppendString(b, e.Project)
	b = appendField(b, "object", e.Object)
	b = appendField(b, "reason", e.Reason)
	return append(b, '}')
}

func appendField(b []byte, k, v string) []byte {
	b = append(b, ',')
	b = wire.AppendString(b, k)
	b = append(b, ':')
	return wire.AppendString(b, v)
}

func appendInt(b []byte, k string, v int) []byte {
	b = append(b, ',')
	b = wire.AppendString(b, k)
	b = append(b, ':')
	return strconv.AppendInt(b, int64(v), 10)
}
