// SPDX-License-Identifier: Apache-2.0

package wire

import "unicode/utf8"

// DefaultSocket is the permit API's unix socket when none is configured.
const DefaultSocket = "/run/fairshare/permits.sock"

// IsSpace reports JSON whitespace.
func IsSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

// SkipSpace returns the index of the first non-space byte of b at or after i.
func SkipSpace(b []byte, i int) int {
	for i < len(b) && IsSpace(b[i]) {
		i++
	}
	return i
}

// EndsValue reports whether a value may end before b[j]: at the end of the
// line, a comma, a closing brace or space. Without it "1.5" or "1e3" would
// scan as 1, and "truex" as true.
func EndsValue(b []byte, j int) bool {
	return j >= len(b) || b[j] == ',' || b[j] == '}' || IsSpace(b[j])
}

// ScanString reads a JSON string without escapes starting at the opening
// quote b[i]; it returns the contents (a sub-slice of b) and the index after
// the closing quote.
func ScanString(b []byte, i int) (s []byte, next int, ok bool) {
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

// ScanUint reads an unsigned decimal integer of at most 19 digits (so it
// cannot overflow) without a leading zero, which must end a value.
func ScanUint(b []byte, i int) (v uint64, next int, ok bool) {
	j := i
	for j < len(b) && b[j] >= '0' && b[j] <= '9' {
		v = v*10 + uint64(b[j]-'0')
		j++
	}
	n := j - i
	if n == 0 || n > 19 || (n > 1 && b[i] == '0') || !EndsValue(b, j) {
		return 0, 0, false
	}
	return v, j, true
}

// ScanBool reads the literal true or false, which must end a value.
func ScanBool(b []byte, i int) (v bool, next int, ok bool) {
	switch {
	case len(b)-i >= 4 && string(b[i:i+4]) == "true" && EndsValue(b, i+4):
		return true, i + 4, true
	case len(b)-i >= 5 && string(b[i:i+5]) == "false" && EndsValue(b, i+5):
		return false, i + 5, true
	}
	return false, 0, false
}

// AppendString appends s to b as a JSON string. Quotes, backslashes and
// control characters are escaped and invalid UTF-8 becomes U+FFFD, because
// names and error texts may echo whatever a peer sent, and a raw newline
// would end the frame.
func AppendString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\':
				b = append(b, '\\', c)
			case c < 0x20:
				b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			default:
				b = append(b, c)
			}
			i++
			continue
		}
		r, n := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && n == 1 {
			b = append(b, `\ufffd`...)
		} else {
			b = append(b, s[i:i+n]...)
		}
		i += n
	}
	return append(b, '"')
}

// WalkObject walks one flat JSON object filling line: for each member it
// calls field with the key and the index of its value, and field returns the
// index after the value, or false to give up. It returns true when the line
// is exactly one object (surrounded by space at most) whose members field
// all accepted. field does not escape, so a closure passed here costs no
// allocation.
func WalkObject(line []byte, field func(key []byte, j int) (next int, ok bool)) bool {
	i := SkipSpace(line, 0)
	if i >= len(line) || line[i] != '{' {
		return false
	}
	i = SkipSpace(line, i+1)
	if i < len(line) && line[i] == '}' {
		return SkipSpace(line, i+1) == len(line)
	}
	for {
		key, j, ok := ScanString(line, i)
		if !ok {
			return false
		}
		j = SkipSpace(line, j)
		if j >= len(line) || line[j] != ':' {
			return false
		}
		if j, ok = field(key, SkipSpace(line, j+1)); !ok {
			return false
		}
		j = SkipSpace(line, j)
		if j >= len(line) {
			return false
		}
		switch line[j] {
		case ',':
			i = SkipSpace(line, j+1)
		case '}':
			return SkipSpace(line, j+1) == len(line)
		default:
			return false
		}
	}
}
