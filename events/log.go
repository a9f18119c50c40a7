// SPDX-License-Identifier: Apache-2.0

package events

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults of a Log.
const (
	DefaultLogMaxBytes  = 64 << 20
	DefaultLogKeep      = 3
	DefaultLogQueue     = 4096
	DefaultLogCloseWait = 5 * time.Second
)

// ErrLogClosed is Write's error once the log is closed.
var ErrLogClosed = errors.New("events log: closed")

// logBuffer: lines are written to the file this many bytes at most at
// once.
const logBuffer = 32 << 10

// rotateRetry is the time between tries of a rotation that failed (a
// variable for tests).
var rotateRetry = time.Second

// LogOptions are a Log's settings; a zero field takes the default.
type LogOptions struct {
	// MaxBytes: the file is rotated when a line would take it past it.
	MaxBytes int64
	// Keep is how many old files are kept (path.1 ... path.<Keep>).
	Keep int
	// Queue is how many events may wait for the file; past it they are
	// dropped and counted.
	Queue int
	// CloseWait bounds how long Close waits for the queued events to be
	// written.
	CloseWait time.Duration
	// Logger is told, once per cause, that the file failed (a write, a
	// rotation, events dropped) and once that it works again; nil: not
	// told.
	Logger *slog.Logger
}

// Log writes events as JSON lines to a file, rotated by size: when the file
// would grow past MaxBytes it is renamed path.1 (path.1 to path.2, and so on,
// keeping Keep old files) and a new one is started. Safe for concurrent use.
//
// Write never waits for the file: it queues the event for one goroutine
// that writes the events in the order they were queued. A file that does
// not keep up (a frozen or unreachable file system) fills the queue, and
// the events past it are dropped and counted. A write that fails (a full
// disk) loses the events of that write, counted, and cuts off any part of
// a line it left; the next write tries again. A rotation that fails (a
// rename refused, no descriptor left to open the new file) goes on writing
// to the old file and is tried again a second later.
type Log struct {
	path      string
	maxBytes  int64
	keep      int
	closeWait time.Duration
	log       *slog.Logger
	retry     time.Duration // between tries of a failed rotation

	mu     sync.Mutex // guards closed and the sends on q
	closed bool
	q      chan Event

	kick  chan struct{}      // Flush: write the buffer, try a pending rotation
	syncC chan chan struct{} // tests: wait until what was queued is written
	done  chan struct{}      // closed when the writer has ended
	// closeErr is the writer's last error (the final write, the close),
	// read after done.
	closeErr error

	written, failed, dropped atomic.Uint64

	errMu  sync.Mutex // guards errStr
	errStr string     // why the file fails now, "" when it works

	dropMu   sync.Mutex // guards the fields below (Flush's report of drops)
	dropSeen uint64
	dropFrom uint64
	dropping bool

	// The writer goroutine's own.
	f          *os.File
	fileSize   int64  // bytes in the file
	buf        []byte // lines not written yet
	ends       []int  // where each event's line ends in buf
	owe        bool   // the file ends mid-line: a newline goes first
	moved      bool   // the file was renamed path.1 and the new one is not open yet
	shifted    bool   // the older files were moved up for the rotation under way
	rotating   bool   // a rotation failed and is to be tried again
	nextRotate time.Time
	writeErr   string // the cause of failed writes last told, "" when writing
	rotateErr  string // the cause of failed rotations last told
	lostSince  uint64 // events lost since writeErr was told
}

// LogStats are a Log's counters.
type LogStats struct {
	Written uint64 // events written to the file
	Failed  uint64 // events lost to failed writes
	Dropped uint64 // events dropped because the queue was full
	Err     string // why the file fails now (a write, a rotation); "" when it works
}

// OpenLog opens (appending) the log at path and starts its writer. The
// file is created 0640. A file that ends mid-line (the daemon killed in a
// write) gets a newline before the first event.
func OpenLog(path string, o LogOptions) (*Log, error) {
	if path == "" {
		return nil, errors.New("events log: no path")
	}
	l := &Log{path: path, maxBytes: o.MaxBytes, keep: o.Keep, closeWait: o.CloseWait, log: o.Logger, retry: rotateRetry,
		kick: make(chan struct{}, 1), syncC: make(chan chan struct{}), done: make(chan struct{})}
	if l.maxBytes <= 0 {
		l.maxBytes = DefaultLogMaxBytes
	}
	if l.keep <= 0 {
		l.keep = DefaultLogKeep
	}
	if l.closeWait <= 0 {
		l.closeWait = DefaultLogCloseWait
	}
	if l.log == nil {
		l.log = slog.New(slog.DiscardHandler)
	}
	queue := o.Queue
	if queue <= 0 {
		queue = DefaultLogQueue
	}
	l.q = make(chan Event, queue)
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return nil, fmt.Errorf("events log: %w", err)
	}
	f, size, owe, err := openLogFile(path)
	if err != nil {
		return nil, err
	}
	l.f, l.fileSize, l.owe = f, size, owe
	go l.run()
	return l, nil
}

// openLogFile opens path for appending and tells its size and whether it
// ends mid-line.
func openLogFile(path string) (f *os.File, size int64, owe bool, err error) {
	f, err = os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_APPEND, 0o640)
	if err != nil {
		return nil, 0, false, fmt.Errorf("events log: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, 0, false, fmt.Errorf("events log: %w", err)
	}
	if !st.Mode().IsRegular() {
		f.Close()
		return nil, 0, false, fmt.Errorf("events log: %s is not a regular file", path)
	}
	if size = st.Size(); size > 0 {
		// A last byte that cannot be read is taken as a fragment: an empty
		// line costs less than an event glued to a fragment.
		var b [1]byte
		_, err := f.ReadAt(b[:], size-1)
		owe = err != nil || b[0] != '\n'
	}
	return f, size, owe, nil
}

// Write queues e to be appended as one line. It does not wait for the
// file: when the queue is full, e is dropped and counted (Stats). The only
// error is ErrLogClosed.
func (l *Log) Write(e Event) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return ErrLogClosed
	}
	select {
	case l.q <- e:
	default:
		l.dropped.Add(1)
	}
	return nil
}

// Flush asks the writer to write its buffer and to try again a rotation
// that failed, without waiting for it, and tells the Logger when events
// started to be dropped for a full queue, and when that ended (none
// dropped since the last Flush, the queue less than half full). The daemon
// calls it at each tick.
func (l *Log) Flush() {
	select {
	case l.kick <- struct{}{}:
	default:
	}
	d := l.dropped.Load()
	l.dropMu.Lock()
	defer l.dropMu.Unlock()
	switch {
	case d > l.dropSeen && !l.dropping:
		l.dropping, l.dropFrom = true, l.dropSeen
		l.log.Warn("events.log: the file does not keep up, events dropped", "path", l.path, "dropped", d-l.dropSeen)
	case d == l.dropSeen && l.dropping && len(l.q) < cap(l.q)/2:
		l.dropping = false
		l.log.Info("events.log: the file keeps up again", "path", l.path, "dropped", d-l.dropFrom)
	}
	l.dropSeen = d
}

// Stats reads the counters.
func (l *Log) Stats() LogStats {
	l.errMu.Lock()
	e := l.errStr
	l.errMu.Unlock()
	return LogStats{Written: l.written.Load(), Failed: l.failed.Load(), Dropped: l.dropped.Load(), Err: e}
}

// Close writes what is queued, waiting at most CloseWait for the file, and
// closes it. Write fails after it. If the file does not take the events in
// time, Close returns an error and the writer closes the file when the
// file lets it.
func (l *Log) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	close(l.q)
	l.mu.Unlock()
	t := time.NewTimer(l.closeWait)
	defer t.Stop()
	select {
	case <-l.done:
		return l.closeErr
	case <-t.C:
		return fmt.Errorf("events log: the file did not take the queued events in %v (%d still queued)", l.closeWait, len(l.q))
	}
}

// sync waits until what was queued before it is written (tests).
func (l *Log) sync() {
	c := make(chan struct{})
	select {
	case l.syncC <- c:
		<-c
	case <-l.done:
	}
}

// run is the writer: it takes the events off the queue in order and
// writes them in batches, when the queue is empty or the buffer full.
func (l *Log) run() {
	defer close(l.done)
	for {
		select {
		case e, ok := <-l.q:
			if !ok {
				l.finish()
				return
			}
			l.add(e)
			if len(l.q) == 0 || len(l.buf) >= logBuffer {
				l.flush()
			}
		case <-l.kick:
			l.flush()
			if l.rotating {
				l.rotate()
			}
		case c := <-l.syncC:
			for len(l.q) > 0 {
				l.add(<-l.q)
				if len(l.buf) >= logBuffer {
					l.flush()
				}
			}
			l.flush()
			close(c)
		}
	}
}

func (l *Log) finish() {
	l.flush()
	var err error
	if l.writeErr != "" {
		err = fmt.Errorf("events log: %s", l.writeErr)
	}
	if cerr := l.f.Close(); cerr != nil {
		err = errors.Join(err, fmt.Errorf("events log: %w", cerr))
	}
	l.closeErr = err
}

// add puts e's line in the buffer, rotating first if the line would take
// the file past its size.
func (l *Log) add(e Event) {
	b, err := json.Marshal(e)
	if err != nil {
		l.failed.Add(1)
		l.log.Error("events.log: event not written", "path", l.path, "err", err)
		return
	}
	b = append(b, '\n')
	if size := l.fileSize + int64(len(l.buf)); size > 0 && size+int64(len(b)) > l.maxBytes {
		l.rotate()
	}
	if len(l.buf) == 0 && l.owe {
		l.buf = append(l.buf, '\n')
	}
	l.buf = append(l.buf, b...)
	l.ends = append(l.ends, len(l.buf))
}

// flush writes the buffer to the file. On an error the buffer is dropped
// (its events counted as failed) and the next write starts afresh; what
// the write left of a line is cut off the file, or, if that fails, ended
// by a newline before the next line.
func (l *Log) flush() {
	if len(l.buf) == 0 {
		return
	}
	n, err := l.f.Write(l.buf)
	kept := n
	if err != nil && n > 0 && l.buf[n-1] != '\n' {
		// The fragment is the file's last n-k bytes (it is appended to):
		// cut from the file's size as it is, not as counted here, which a
		// copytruncate makes larger (a truncate to it would pad the file
		// with zeros).
		k := bytes.LastIndexByte(l.buf[:n], '\n') + 1
		if st, serr := l.f.Stat(); serr == nil && st.Size() >= int64(n-k) && l.f.Truncate(st.Size()-int64(n-k)) == nil {
			kept = k
		}
	}
	l.fileSize += int64(kept)
	if kept > 0 {
		l.owe = l.buf[kept-1] != '\n'
	}
	w := 0
	for w < len(l.ends) && l.ends[w] <= kept {
		w++
	}
	l.written.Add(uint64(w))
	lost := uint64(len(l.ends) - w)
	l.buf, l.ends = l.buf[:0], l.ends[:0]
	if err == nil {
		if l.writeErr != "" {
			l.log.Info("events.log: writing again", "path", l.path, "lost", l.lostSince)
			l.writeErr, l.lostSince = "", 0
			l.setErr()
		}
		return
	}
	l.failed.Add(lost)
	l.lostSince += lost
	if msg := err.Error(); msg != l.writeErr {
		l.writeErr = msg
		l.setErr()
		l.log.Error("events.log: events not written, trying again at the next", "path", l.path, "err", err, "lost", lost)
	}
}

// rotate starts a new file, unless a rotation failed less than retry ago.
// The old file stays open until the new one is: if the rename or the open
// fails, writing goes on to the old file.
func (l *Log) rotate() {
	now := time.Now()
	if l.rotating && now.Before(l.nextRotate) {
		return
	}
	l.flush()
	err := l.rotateFile()
	if err != nil {
		l.rotating, l.nextRotate = true, now.Add(l.retry)
		if msg := err.Error(); msg != l.rotateErr {
			l.rotateErr = msg
			l.setErr()
			l.log.Error("events.log: rotation failed, writing on to the old file and trying again", "path", l.path, "err", err)
		}
		return
	}
	l.rotating = false
	if l.rotateErr != "" {
		l.rotateErr = ""
		l.setErr()
		l.log.Info("events.log: rotating again", "path", l.path)
	}
}

// rename is os.Rename (a test's hook).
var rename = os.Rename

func (l *Log) rotateFile() error {
	if !l.moved {
		// The older files move once per rotation, not at each retry of
		// a rotation whose last rename fails (each retry would push one
		// more of them out).
		if !l.shifted {
			for i := l.keep - 1; i >= 1; i-- {
				_ = rename(l.path+"."+strconv.Itoa(i), l.path+"."+strconv.Itoa(i+1))
			}
			l.shifted = true
		}
		if err := rename(l.path, l.path+".1"); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("events log: %w", err)
		}
		l.moved = true
	}
	f, size, owe, err := openLogFile(l.path)
	if err != nil {
		return err
	}
	old := l.f
	l.f, l.fileSize, l.owe, l.moved, l.shifted = f, size, owe, false, false
	if err := old.Close(); err != nil {
		l.log.Warn("events.log: closing the rotated file", "path", l.path+".1", "err", err)
	}
	return nil
}

func (l *Log) setErr() {
	s := l.writeErr
	if l.rotateErr != "" {
		if s != "" {
			s += "; "
		}
		s += l.rotateErr
	}
	l.errMu.Lock()
	l.errStr = s
	l.errMu.Unlock()
}
