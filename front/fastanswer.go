// SPDX-License-Identifier: Apache-2.0

// The answer heads a fast path's loop writes itself: the upstream's plain
// answer with the front's own fields (appendAnswer), and the front's own
// answers (refusals, errors) captured from the ResponseWriter the front
// writes them to (captured, writeCaptured).

package front

import (
	"net/http"
	"strconv"

	"github.com/fairshare-dev/fairshare/internal/answerfield"
)

// writeCaptured writes the answer the front wrote into c.cw.
func (lp *loop) writeCaptured(c *fclient) {
	h := c.cw.h
	if h.Get("Connection") == "close" {
		c.closing = true
	}
	if h["Content-Length"] == nil {
		h["Content-Length"] = []string{strconv.Itoa(len(c.cw.body))}
	}
	lp.obuf = appendHead(lp.obuf[:0], c.cw.status, h, lp.dateNow())
	lp.obuf = append(lp.obuf, c.cw.body...)
	lp.writeClient(c, lp.obuf)
}

// appendAnswer appends the head of x's answer: the upstream's status and
// fields (fs) less the hop-by-hop ones and those the front sets or
// consumes, then the front's own (what annotate sets on net/http's path),
// and a Date if the upstream sent none.
func (lp *loop) appendAnswer(b []byte, status int, fs *plainFields, x *exchange) []byte {
	b = appendStatusLine(b, status)
	dated := false
	for _, f := range fs.f[:fs.n] {
		if lp.f.own(f.key) || answerfield.IsHopByHop(f.key) {
			continue
		}
		dated = dated || f.key == "Date"
		b = appendField(b, f.key, f.value)
	}
	for _, v := range classOf(x) {
		b = appendField(b, HeaderClass, v)
	}
	for _, v := range queueWaitOf(x) {
		b = appendField(b, HeaderQueueWait, v)
	}
	if !dated {
		b = appendField(b, "Date", lp.dateNow())
	}
	return append(b, "\r\n"...)
}

// appendStatusLine appends the status line net/http's server writes.
func appendStatusLine(b []byte, status int) []byte {
	b = append(b, "HTTP/1.1 "...)
	b = strconv.AppendInt(b, int64(status), 10)
	b = append(b, ' ')
	if t := http.StatusText(status); t != "" {
		b = append(b, t...)
	} else {
		b = append(b, "status code "...)
		b = strconv.AppendInt(b, int64(status), 10)
	}
	return append(b, "\r\n"...)
}

// appendField appends the field line "k: v".
func appendField[V string | []byte](b []byte, k string, v V) []byte {
	b = append(b, k...)
	b = append(b, ": "...)
	b = append(b, v...)
	return append(b, "\r\n"...)
}

// appendHead appends an HTTP/1.1 answer head, as net/http's server writes
// one (with a Date when the header has none).
func appendHead(b []byte, status int, h http.Header, date []byte) []byte {
	b = appendStatusLine(b, status)
	for k, vv := range h {
		for _, v := range vv {
			b = appendField(b, k, v)
		}
	}
	if h["Date"] == nil {
		b = appendField(b, "Date", date)
	}
	return append(b, "\r\n"...)
}

// dateNow is the Date of an answer now, formatted once a second.
func (lp *loop) dateNow() []byte {
	if sec := lp.now.Unix(); sec != lp.dateSec || lp.date == nil {
		lp.dateSec = sec
		lp.date = lp.now.UTC().AppendFormat(lp.date[:0], http.TimeFormat)
	}
	return lp.date
}

// captured is an http.ResponseWriter that keeps the answer the front
// writes (a refusal, an error) for the loop to send.
type captured struct {
	h      http.Header
	status int
	body   []byte
	abort  bool // no answer: the connection is closed (noAnswer)
}

func (w *captured) reset() {
	if w.h == nil {
		w.h = make(http.Header, 4)
	}
	clear(w.h) // the front writes it only while the loop holds it
	w.status, w.body, w.abort = 0, w.body[:0], false
}

func (w *captured) Header() http.Header { return w.h }

func (w *captured) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
}

func (w *captured) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	w.body = append(w.body, p...)
	return len(p), nil
}
