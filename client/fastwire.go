// SPDX-License-Identifier: Apache-2.0

package client

import "unicode/utf8"

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
	i := skipSpace(line, 0)
	if i >= len(line) || line[i] != '{' {
		return false
	}
	i = skipSpace(line, i+1)
	if i < len(line) && line[i] == '}' {
		return skipSpace(line, i+1) == len(line)
	}
	for {
		key, j, ok := scanString(line, i)
		if !ok {
			return false
		}
		j = skipSpace(line, j)
		if j >= len(line) || line[j] != ':' {
			return false
		}
		j = skipSpace(line, j+1)
		switch string(key) {
		case "id", "lease", "session", "retry_after_ms":
			v, k, ok := scanUint(line, j)
			if !ok {
				return false
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
					return false
				}
				rp.RetryAfterMS = int64(v)
			}
			j = k
		case "ok", "released":
			v, k, ok := scanBool(line, j)
			if !ok {
				return false
			}
			if string(key) == "ok" {
				rp.OK = v
			} else {
				rp.Released = v
			}
			j = k
		case "code", "error", "note", "event", "project", "object", "reason":
			s, k, ok := scanString(line, j)
			if !ok {
				return false
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
			j = k
		default:
			return false
		}
		j = skipSpace(line, j)
		if j >= len(line) {
			return false
		}
		switch line[j] {
		case ',':
			i = skipSpace(line, j+1)
		case '}':
			return skipSpace(line, j+1) == len(line)
		default:
			return false
		}
	}
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func skipSpace(b []byte, i int) int {
	for i < len(b) && isSpace(b[i]) {
		i++
	}
	return i
}

func endsValue(b []byte, j int) bool {
	return j >= len(b) || b[j] == ',' || b[j] == '}' || isSpace(b[j])
}

// scanString reads a JSON string without escapes starting at the opening
// quote b[i]; it returns the contents and the index after the closing quote.
func scanString(b []byte, i int) (s []byte, next int, ok bool) {
	if i >= len(b) || b[i] != '"' {
		return nil, 0, false
	}
	start := i + 1
	high := false
	for j := start; j < len(b); j++ {
		c := b[j]
		switch {
		case c == '"':
			s = b[start:j]
			if high && !utf8.Valid(s) {
				return nil, 0, false // encoding/json would replace bytes
			}
			return s, j + 1, true
		case c == '\\' || c < 0x20:
			return nil, 0, false
		case c >= utf8.RuneSelf:
			high = true
		}
	}
	return nil, 0, false
}

// scanUint reads an unsigned decimal integer of at most 19 digits (so it
// cannot overflow) without a leading zero.
func scanUint(b []byte, i int) (v uint64, next int, ok bool) {
	j := i
	for j < len(b) && b[j] >= '0' && b[j] <= '9' {
		v = v*10 + uint64(b[j]-'0')
		j++
	}
	n := j - i
	if n == 0 || n > 19 || (n > 1 && b[i] == '0') || !endsValue(b, j) {
		return 0, 0, false
	}
	return v, j, true
}

func scanBool(b []byte, i int) (v bool, next int, ok bool) {
	switch {
	case len(b)-i >= 4 && string(b[i:i+4]) == "true" && endsValue(b, i+4):
		return true, i + 4, true
	case len(b)-i >= 5 && string(b[i:i+5]) == "false" && endsValue(b, i+5):
		return false, i + 5, true
	}
	return false, 0, false
}
