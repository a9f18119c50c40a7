// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/textproto"

	"github.com/fairshare-dev/fairshare/internal/answerfield"
)

// maxPlainFields bounds the fields of a plain head; a longer one is left to
// http.ReadResponse.
const maxPlainFields = 32

// plainHead reads the upstream's answer to a request other than HEAD from br when its head is
// plain, as most are: HTTP/1.1, a status of 200 to 599 other than 204 and
// 304, exactly one Content-Length, no Transfer-Encoding, Connection or
// Trailer field, no field twice, no line folding, no control characters, and
// the whole head already in br's buffer. Its fields go straight into dst,
// the client's header, which must be empty; hop-by-hop fields are dropped,
// as serveDirect drops them from any answer.
//
// Anything else is left unread (ok false) for http.ReadResponse, which knows
// every case. What this saves is ReadResponse's header map, transfer and
// body readers and the copy of the fields into dst: six allocations of a
// request (BenchmarkRequest); in the front's CPU profile under saturating
// load, reading the answer's head fell from 5.0% to 3.5% of the samples.
func plainHead(br *bufio.Reader, method string, dst http.Header) (status int, length int64, ok bool) {
	buf, _ := br.Peek(br.Buffered())
	status, length, n, ok := plainHeadBytes(buf, method, dst)
	if ok {
		_, _ = br.Discard(n)
	}
	return status, length, ok
}

// plainHeadBytes is plainHead on the bytes buf holds: n is the length of
// the head, empty line included.
func plainHeadBytes(buf []byte, method string, dst http.Header) (status int, length int64, n int, ok bool) {
	if len(dst) != 0 {
		return 0, 0, 0, false
	}
	var fs plainFields
	status, length, n, ok = fs.parse(buf, method)
	if !ok {
		return 0, 0, 0, false
	}
	vals := make([]string, fs.n)
	for i, f := range fs.f[:fs.n] {
		if answerfield.IsHopByHop(f.key) {
			continue
		}
		vals[i] = f.value
		dst[f.key] = vals[i : i+1 : i+1] // len == cap: an append copies
	}
	return status, length, n, true
}

// plainField is one field of a plain head: its key in canonical form.
type plainField struct{ key, value string }

// plainFields are the fields of a plain head, in the order it gave them,
// hop-by-hop ones included; no key comes twice.
type plainFields struct {
	f [maxPlainFields]plainField
	n int
}

// get returns the value of the field with canonical key k and whether fs
// has one.
func (fs *plainFields) get(k string) (string, bool) {
	for _, f := range fs.f[:fs.n] {
		if f.key == k {
			return f.value, true
		}
	}
	return "", false
}

// parse reads the head at the start of buf into fs if it is plain (see
// plainHead): n is the length of the head, empty line included.
func (fs *plainFields) parse(buf []byte, method string) (status int, length int64, n int, ok bool) {
	fs.n = 0
	if method == http.MethodHead {
		return 0, 0, 0, false
	}
	end := bytes.Index(buf, []byte("\r\n\r\n"))
	if end < 0 {
		return 0, 0, 0, false
	}
	head := buf[:end+2] // every line with its CRLF
	line, _, _ := bytes.Cut(head, []byte("\r\n"))
	if status, ok = plainStatus(line); !ok {
		return 0, 0, 0, false
	}
	// Fields as offsets into head until all of it is known to be plain;
	// then one string holds every key and value.
	var spans [maxPlainFields][4]int
	nf := 0
	for off := len(line) + 2; off < len(head); {
		line, _, _ = bytes.Cut(head[off:], []byte("\r\n"))
		colon := bytes.IndexByte(line, ':')
		if colon <= 0 || nf == maxPlainFields || !plainKey(line[:colon]) {
			return 0, 0, 0, false
		}
		vs, ve := colon+1, len(line)
		for vs < ve && (line[vs] == ' ' || line[vs] == '\t') {
			vs++
		}
		for ve > vs && (line[ve-1] == ' ' || line[ve-1] == '\t') {
			ve--
		}
		if !plainValue(line[vs:ve]) {
			return 0, 0, 0, false
		}
		spans[nf] = [4]int{off, off + colon, off + vs, off + ve}
		nf++
		off += len(line) + 2
	}
	s := string(head)
	length = -1
	for i := range nf {
		k := textproto.CanonicalMIMEHeaderKey(s[spans[i][0]:spans[i][1]])
		for _, seen := range fs.f[:i] {
			if k == seen.key {
				return 0, 0, 0, false
			}
		}
		fs.f[i] = plainField{k, s[spans[i][2]:spans[i][3]]}
		switch k {
		case "Transfer-Encoding", "Connection", "Trailer":
			return 0, 0, 0, false
		case "Content-Length":
			if length, ok = plainLength(fs.f[i].value); !ok {
				return 0, 0, 0, false
			}
		}
	}
	if length < 0 {
		return 0, 0, 0, false
	}
	fs.n = nf
	return status, length, end + 4, true
}

// plainStatus reads "HTTP/1.1 NNN" and an optional reason.
func plainStatus(line []byte) (int, bool) {
	rest, ok := bytes.CutPrefix(line, []byte("HTTP/1.1 "))
	if !ok || len(rest) < 3 || (len(rest) > 3 && rest[3] != ' ') || !plainValue(rest) {
		return 0, false
	}
	code := 0
	for _, c := range rest[:3] {
		if c < '0' || c > '9' {
			return 0, false
		}
		code = code*10 + int(c-'0')
	}
	if code < 200 || code > 599 || code == http.StatusNoContent || code == http.StatusNotModified {
		return 0, false
	}
	return code, true
}

// plainKey reports whether k is a token (RFC 9110 5.6.2), as a field name
// must be.
func plainKey(k []byte) bool {
	for _, c := range k {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || bytes.IndexByte([]byte("!#$%&'*+-.^_`|~"), c) >= 0) {
			return false
		}
	}
	return true
}

// plainValue reports whether v holds no control character but tab (so no
// bare CR or LF either).
func plainValue(v []byte) bool {
	for _, c := range v {
		if c < ' ' && c != '\t' || c == 0x7f {
			return false
		}
	}
	return true
}

// plainLength reads a Content-Length of 1 to 18 digits.
func plainLength(v string) (int64, bool) {
	if len(v) == 0 || len(v) > 18 {
		return 0, false
	}
	var n int64
	for i := 0; i < len(v); i++ {
		c := v[i]
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int64(c-'0')
	}
	return n, true
}

// plainBody is the body of a plain answer: exactly Content-Length bytes of
// the connection, an error if it ends before.
type plainBody struct{ io.LimitedReader }

func (b *plainBody) Read(p []byte) (int, error) {
	n, err := b.LimitedReader.Read(p)
	if err == io.EOF && b.N > 0 {
		err = io.ErrUnexpectedEOF
	}
	return n, err
}

func (*plainBody) Close() error { return nil }

// strictHead checks a whole answer head (status line, fields, the empty
// line) that http.ReadResponse accepted, for what a proxy must not pass on
// or guess at (RFC 9112 sections 2.2, 5.2, 6.1 and 6.3): every line ends in
// CRLF, no line is folded, field names are tokens followed at once by the
// colon, values hold no control character but tab, there is at most one
// Content-Length and it is digits only, and not both Content-Length and
// Transfer-Encoding. The status is in 100-599. net/http tolerates some of
// these (bare LF, folding, a repeated Content-Length of one value, both
// framings, a status like 000); the front answers 502 and closes the
// connection instead, as a disagreement about framing is how one answer's
// bytes end up in another's.
func strictHead(raw []byte) error {
	line, rest, ok := bytes.Cut(raw, []byte("\r\n"))
	if !ok || bytes.IndexByte(line, '\n') >= 0 {
		return errors.New("upstream status line not ended by CRLF")
	}
	proto, code, _ := bytes.Cut(line, []byte(" "))
	if !bytes.Equal(proto, []byte("HTTP/1.1")) && !bytes.Equal(proto, []byte("HTTP/1.0")) {
		return fmt.Errorf("upstream protocol %q", proto)
	}
	if len(code) > 3 && code[3] != ' ' || len(code) < 3 || !plainValue(code) {
		return fmt.Errorf("upstream status line %q", line)
	}
	status := 0
	for _, c := range code[:3] {
		if c < '0' || c > '9' {
			return fmt.Errorf("upstream status %q", code[:3])
		}
		status = status*10 + int(c-'0')
	}
	if status < 100 || status > 599 {
		return fmt.Errorf("upstream status %d outside 100-599", status)
	}
	lengths, encodings := 0, 0
	for len(rest) > 0 {
		line, rest, ok = bytes.Cut(rest, []byte("\r\n"))
		if !ok {
			return errors.New("upstream head not ended by CRLF")
		}
		if len(line) == 0 {
			if len(rest) > 0 {
				return errors.New("bytes after the end of the upstream head")
			}
			break
		}
		if line[0] == ' ' || line[0] == '\t' {
			return errors.New("folded line in the upstream head")
		}
		colon := bytes.IndexByte(line, ':')
		if colon <= 0 || !plainKey(line[:colon]) {
			return fmt.Errorf("bad upstream field %q", truncate(line))
		}
		v := bytes.Trim(line[colon+1:], " \t")
		if !plainValue(v) {
			return fmt.Errorf("control character in upstream field %q", line[:colon])
		}
		switch textproto.CanonicalMIMEHeaderKey(string(line[:colon])) {
		case "Content-Length":
			lengths++
			if _, ok := plainLength(string(v)); !ok {
				return fmt.Errorf("upstream Content-Length %q", truncate(v))
			}
		case "Transfer-Encoding":
			encodings++
		}
	}
	if lengths > 1 {
		return errors.New("upstream sent Content-Length more than once")
	}
	if lengths > 0 && encodings > 0 {
		return errors.New("upstream sent both Content-Length and Transfer-Encoding")
	}
	return nil
}

// truncate shortens a field for an error message.
func truncate(b []byte) string {
	if len(b) > 64 {
		return string(b[:64]) + "..."
	}
	return string(b)
}
