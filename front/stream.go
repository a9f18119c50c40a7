// SPDX-License-Identifier: Apache-2.0

package front

import (
	"net/http"
	"sync"
	"time"
)

// streamWriter bounds each write of an HTTP/2 answer by Config.WriteTimeout,
// as clientConn bounds HTTP/1's. An HTTP/2 stream's writes wait for the
// client's flow-control window, not for the socket: a client that never
// opens it (SETTINGS_INITIAL_WINDOW_SIZE 0 and no WINDOW_UPDATE) held each
// stream's handler, and its permit, for as long as it kept the connection,
// which itself never blocked, so no deadline of the connection fired. Here
// a write (or flush) that has not returned within writeFor resets its
// stream, and the write fails.
//
// Only a write in progress is bounded: net/http's own per-stream deadline
// resets the stream when it passes, writing or not, so it cannot stay armed
// while the handler waits for the upstream (a long poll, a sparse event
// stream). One timer per stream, armed at the first write and kept while
// writes follow, checks the write in progress.
type streamWriter struct {
	http.ResponseWriter
	rc       *http.ResponseController
	writeFor time.Duration

	mu    sync.Mutex
	since time.Time   // when the write in progress began; zero: none
	timer *time.Timer // nil until the first write
	armed bool        // timer is set
	done  bool        // the handler is returning: the stream is not touched again
}

func newStreamWriter(w http.ResponseWriter, writeFor time.Duration) *streamWriter {
	return &streamWriter{ResponseWriter: w, rc: http.NewResponseController(w), writeFor: writeFor}
}

func (w *streamWriter) begin() {
	w.mu.Lock()
	w.since = time.Now()
	if !w.armed && !w.done {
		w.armed = true
		if w.timer == nil {
			w.timer = time.AfterFunc(w.writeFor, w.check)
		} else {
			w.timer.Reset(w.writeFor)
		}
	}
	w.mu.Unlock()
}

func (w *streamWriter) end() {
	w.mu.Lock()
	w.since = time.Time{}
	w.mu.Unlock()
}

// check is the timer's: it resets the stream under a write that has taken
// writeFor, waits on for one that has not, and disarms while none is in
// progress (the next write arms it again).
func (w *streamWriter) check() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.done || w.since.IsZero() {
		w.armed = false
		return
	}
	if left := w.writeFor - time.Since(w.since); left > 0 {
		w.timer.Reset(left)
		return
	}
	w.armed = false
	// A deadline in the past resets the stream at once: the write
	// waiting for the window returns an error.
	_ = w.rc.SetWriteDeadline(time.Unix(1, 0))
}

// close ends the watch; called before the handler returns, after which the
// stream's writer must not be used.
func (w *streamWriter) close() {
	w.mu.Lock()
	w.done = true
	if w.timer != nil {
		w.timer.Stop()
	}
	w.mu.Unlock()
}

func (w *streamWriter) Write(p []byte) (int, error) {
	w.begin()
	defer w.end()
	return w.ResponseWriter.Write(p)
}

// FlushError flushes within writeFor, as Write writes.
func (w *streamWriter) FlushError() error {
	w.begin()
	defer w.end()
	return w.rc.Flush()
}

func (w *streamWriter) Flush() { _ = w.FlushError() }

// Unwrap lets http.ResponseController reach the server's writer.
func (w *streamWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
