// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bytes"
	"net/http"
	"net/textproto"
	"net/url"
)

// What plainRequest makes of the bytes it is given.
const (
	reqMore  = iota // no whole head yet, and it may still be plain
	reqPlain        // a plain request head: the fast path serves it
	reqOther        // anything else: net/http's server takes the connection
)

// maxPlainRequestFields bounds the fields of a plain request head.
const maxPlainRequestFields = 64

// plainRequest reads a client's request head from buf when it is plain, as
// most are: "METHOD /origin-form HTTP/1.1", a method that is a token other
// than CONNECT and HEAD, every line ended by CRLF, no folded line, field
// names that are tokens followed at once by the colon, values of printable
// ASCII and tab only, exactly one Host of host characters, at most one
// Content-Length of digits only (at most maxBody), and no Transfer-Encoding,
// Connection, Upgrade, Expect or Trailer field, at most maxHead bytes in
// all. It returns the request (its body not set), the length of the head,
// empty line included, and reqPlain; reqMore when the head is not all in
// buf yet and may still be plain; reqOther for anything else.
//
// It never accepts what http.ReadRequest refuses or reads otherwise
// (FuzzRequestHead); what it does not accept is left to net/http's server,
// which answers it as it always did (400, 431, an upgrade, HTTP/2), so the
// fast path is never looser than the server it stands in for.
func plainRequest(buf []byte, maxHead int, maxBody int64) (*http.Request, int, int) {
	end := bytes.Index(buf, []byte("\r\n\r\n"))
	if end < 0 {
		if len(buf) >= maxHead || bytes.IndexByte(buf, '\n') >= 0 && !crlfOnly(buf) {
			return nil, 0, reqOther
		}
		return nil, 0, reqMore
	}
	if end+4 > maxHead {
		return nil, 0, reqOther
	}
	head := buf[:end+2]
	if !crlfOnly(head) {
		return nil, 0, reqOther
	}
	line, _, _ := bytes.Cut(head, []byte("\r\n"))
	sp1 := bytes.IndexByte(line, ' ')
	if sp1 <= 0 || sp1 > 20 || !plainKey(line[:sp1]) {
		return nil, 0, reqOther
	}
	method := line[:sp1]
	if string(method) == http.MethodConnect || string(method) == http.MethodHead || string(method) == "PRI" {
		return nil, 0, reqOther
	}
	rest := line[sp1+1:]
	sp2 := bytes.IndexByte(rest, ' ')
	if sp2 <= 0 || string(rest[sp2+1:]) != "HTTP/1.1" || rest[0] != '/' {
		return nil, 0, reqOther
	}
	target := rest[:sp2]
	for _, c := range target {
		if c <= ' ' || c >= 0x7f {
			return nil, 0, reqOther
		}
	}
	s := string(head)
	r := &http.Request{Method: methodString(method), Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		RequestURI: s[sp1+1 : sp1+1+sp2], Header: make(http.Header, 8)}
	// The fields' values share one array: a field that comes twice
	// appends to a copy (len == cap).
	vals := make([]string, 0, bytes.Count(head, []byte("\r\n"))-1)
	u, err := url.ParseRequestURI(r.RequestURI)
	if err != nil {
		return nil, 0, reqOther
	}
	r.URL = u
	hosts, lengths, fields := 0, 0, 0
	for off := len(line) + 2; off < len(head); {
		l, _, _ := bytes.Cut(head[off:], []byte("\r\n"))
		colon := bytes.IndexByte(l, ':')
		if colon <= 0 || fields == maxPlainRequestFields || !plainKey(l[:colon]) {
			return nil, 0, reqOther
		}
		fields++
		vs, ve := colon+1, len(l)
		for vs < ve && (l[vs] == ' ' || l[vs] == '\t') {
			vs++
		}
		for ve > vs && (l[ve-1] == ' ' || l[ve-1] == '\t') {
			ve--
		}
		if !printable(l[vs:ve]) {
			return nil, 0, reqOther
		}
		k := textproto.CanonicalMIMEHeaderKey(s[off : off+colon])
		v := s[off+vs : off+ve]
		off += len(l) + 2
		switch k {
		case "Host":
			if hosts++; hosts > 1 || !plainHost(v) {
				return nil, 0, reqOther
			}
			r.Host = v
			continue
		case "Content-Length":
			n, ok := plainLength(v)
			if lengths++; lengths > 1 || !ok || n > maxBody {
				return nil, 0, reqOther
			}
			r.ContentLength = n
		case "Transfer-Encoding", "Connection", "Upgrade", "Expect", "Trailer":
			return nil, 0, reqOther
		}
		if vv := r.Header[k]; vv != nil {
			r.Header[k] = append(vv, v)
			continue
		}
		vals = append(vals, v)
		r.Header[k] = vals[len(vals)-1 : len(vals) : len(vals)]
	}
	if hosts != 1 {
		return nil, 0, reqOther
	}
	return r, end + 4, reqPlain
}

// methodString returns m as a string, without allocating for the
// common methods.
func methodString(m []byte) string {
	for _, k := range [...]string{http.MethodGet, http.MethodPost, http.MethodPut, http.MethodDelete, http.MethodPatch, http.MethodOptions} {
		if string(m) == k {
			return k
		}
	}
	return string(m)
}

// crlfOnly reports whether every LF in b follows a CR and every CR comes
// before an LF: no bare line ends of either kind.
func crlfOnly(b []byte) bool {
	for i, c := range b {
		switch c {
		case '\n':
			if i == 0 || b[i-1] != '\r' {
				return false
			}
		case '\r':
			if i+1 < len(b) && b[i+1] != '\n' {
				return false
			}
		}
	}
	return true
}

// printable reports whether v is printable ASCII and tabs only.
func printable(v []byte) bool {
	for _, c := range v {
		if c < ' ' && c != '\t' || c >= 0x7f {
			return false
		}
	}
	return true
}

// plainHost reports whether v is a host[:port] of letters, digits and
// '.', '-', '_', ':', '[', ']' only (a name, IPv4 or bracketed IPv6).
func plainHost(v string) bool {
	if v == "" {
		return false
	}
	for i := 0; i < len(v); i++ {
		c := v[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '-' || c == '_' || c == ':' || c == '[' || c == ']') {
			return false
		}
	}
	return true
}
