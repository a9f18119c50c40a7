// SPDX-License-Identifier: Apache-2.0

package events

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// lockedBuffer is a log's output, read by the test while the writer may
// log.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *lockedBuffer) count(s string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return strings.Count(b.b.String(), s)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

func testLogger() (*slog.Logger, *lockedBuffer) {
	b := &lockedBuffer{}
	return slog.New(slog.NewTextHandler(b, nil)), b
}

func numbered(i int) Event {
	return Event{Source: SourceFront, Kind: KindRefused, Project: "alpha", Count: uint64(i), Detail: strings.Repeat("x", 100)}
}

// readLines returns the lines of the files in order, and the events of
// those that parse.
func readLines(t *testing.T, names ...string) (lines []string, evs []Event) {
	t.Helper()
	for _, name := range names {
		b, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		if len(b) > 0 && b[len(b)-1] != '\n' {
			t.Errorf("%s ends mid-line: %q", name, b[max(0, len(b)-40):])
		}
		for _, line := range strings.Split(strings.TrimSuffix(string(b), "\n"), "\n") {
			if line == "" && len(b) == 0 {
				continue
			}
			lines = append(lines, line)
			var e Event
			if json.Unmarshal([]byte(line), &e) == nil {
				evs = append(evs, e)
			}
		}
	}
	return lines, evs
}

// inOrder checks that evs are numbered from..to-1 without a gap.
func inOrder(t *testing.T, evs []Event, from, to int) {
	t.Helper()
	if len(evs) != to-from {
		t.Fatalf("%d events in the files, want %d (%d to %d)", len(evs), to-from, from, to-1)
	}
	for i, e := range evs {
		if e.Count != uint64(from+i) {
			t.Fatalf("event %d is %d, want %d: events out of order or missing", i, e.Count, from+i)
		}
	}
}

// TestLogRecoversAfterENOSPC: a write the file refuses (here past
// RLIMIT_FSIZE, as on a full disk) loses its events, counted, and cuts the
// part of a line it left; once the file takes writes again, writing
// resumes and the file holds whole lines. The failure is told once, and
// so is the recovery.
func TestLogRecoversAfterENOSPC(t *testing.T) {
	signal.Ignore(syscall.SIGXFSZ)
	defer signal.Reset(syscall.SIGXFSZ)
	var old syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_FSIZE, &old); err != nil {
		t.Fatal(err)
	}
	restore := func() {
		if err := syscall.Setrlimit(syscall.RLIMIT_FSIZE, &old); err != nil {
			t.Fatalf("restoring RLIMIT_FSIZE: %v", err)
		}
	}
	defer restore()

	path := filepath.Join(t.TempDir(), "events.log")
	logger, out := testLogger()
	l, err := OpenLog(path, LogOptions{Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	lim := old
	lim.Cur = 2000
	if err := syscall.Setrlimit(syscall.RLIMIT_FSIZE, &lim); err != nil {
		t.Fatal(err)
	}
	n := 0
	for ; n < 1000 && l.Stats().Failed == 0; n++ {
		if err := l.Write(numbered(n)); err != nil {
			t.Fatal(err)
		}
		l.sync()
	}
	st := l.Stats()
	if st.Failed != 1 || !strings.Contains(st.Err, "file too large") {
		t.Fatalf("after %d writes past the limit: %+v, want one event failed and the cause", n, st)
	}
	full := n - 1 // the events in the file
	// Still full: the events are lost, and the cause is not told again.
	for range 3 {
		l.Write(numbered(n))
		n++
		l.sync()
	}
	if st := l.Stats(); st.Failed != 4 {
		t.Fatalf("while full: %+v, want 4 failed", st)
	}
	restore()
	from := n
	for range 5 {
		l.Write(numbered(n))
		n++
		l.sync()
	}
	st = l.Stats()
	if st.Err != "" || st.Written != uint64(full+5) || st.Failed != 4 {
		t.Fatalf("once the file takes writes: %+v, want %d written, 4 failed, no error", st, full+5)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	lines, evs := readLines(t, path)
	if len(lines) != len(evs) {
		t.Fatalf("%d lines of which %d parse: %q", len(lines), len(evs), lines)
	}
	inOrder(t, evs[:full], 0, full)
	inOrder(t, evs[full:], from, n)
	if c := out.count("events not written"); c != 1 {
		t.Errorf("the failure told %d times, want once:\n%s", c, out)
	}
	if c := out.count("writing again"); c != 1 || !strings.Contains(out.String(), "lost=4") {
		t.Errorf("the recovery told %d times, want once with lost=4:\n%s", c, out)
	}
}

// TestLogRotateFailureNotFatal: a rotation whose rename fails (a directory
// in the way of path.1) leaves the log writing to the old file, with the
// real cause in Stats; once the way is clear the rotation is tried again
// and succeeds, and no event was lost.
func TestLogRotateFailureNotFatal(t *testing.T) {
	defer func(d time.Duration) { rotateRetry = d }(rotateRetry)
	rotateRetry = 10 * time.Millisecond
	path := filepath.Join(t.TempDir(), "events.log")
	if err := os.MkdirAll(filepath.Join(path+".1", "in-the-way"), 0o750); err != nil {
		t.Fatal(err)
	}
	logger, out := testLogger()
	l, err := OpenLog(path, LogOptions{MaxBytes: 400, Keep: 1, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	n := 0
	for ; n < 10; n++ {
		if err := l.Write(numbered(n)); err != nil {
			t.Fatal(err)
		}
		l.sync()
	}
	st := l.Stats()
	if st.Written != 10 || st.Failed != 0 || !strings.Contains(st.Err, path+".1") {
		t.Fatalf("with path.1 in the way: %+v, want 10 written and the rename's error", st)
	}
	if err := os.RemoveAll(path + ".1"); err != nil {
		t.Fatal(err)
	}
	waitRotated(t, l)
	if fi, err := os.Stat(path + ".1"); err != nil || !fi.Mode().IsRegular() {
		t.Fatalf("path.1 after the rotation: %v %v", fi, err)
	}
	_, old := readLines(t, path+".1")
	inOrder(t, old, 0, n)
	// Rotations go on as usual.
	for ; n < 20; n++ {
		l.Write(numbered(n))
		l.sync()
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	_, evs := readLines(t, path+".1", path)
	inOrder(t, evs, 18, 20)
	if fi, _ := os.Stat(path); fi.Size() > 400 {
		t.Errorf("the new file is %d bytes, past 400: rotations stopped", fi.Size())
	}
	if c := out.count("rotation failed"); c != 1 {
		t.Errorf("the failure told %d times, want once:\n%s", c, out)
	}
	if c := out.count("rotating again"); c != 1 {
		t.Errorf("the recovery told %d times, want once:\n%s", c, out)
	}
}

// TestLogRotateReopenFails: a rotation whose new file cannot be opened (no
// descriptor left, as in a flood of connections) keeps writing to the old
// file, now path.1, and opens the new one once it can, without renaming
// again.
func TestLogRotateReopenFails(t *testing.T) {
	defer func(d time.Duration) { rotateRetry = d }(rotateRetry)
	rotateRetry = 10 * time.Millisecond
	path := filepath.Join(t.TempDir(), "events.log")
	l, err := OpenLog(path, LogOptions{MaxBytes: 400, Keep: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	n := 0
	for ; n < 2; n++ {
		l.Write(numbered(n))
		l.sync()
	}

	// Take every descriptor there is.
	var old syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &old); err != nil {
		t.Fatal(err)
	}
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	lim := old
	lim.Cur = uint64(len(fds) + 8)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	var held []int
	free := func() {
		for _, fd := range held {
			syscall.Close(fd)
		}
		held = nil
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &old); err != nil {
			t.Fatal(err)
		}
	}
	defer free()
	for len(held) < 1000 {
		fd, err := syscall.Open("/dev/null", syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
		if errors.Is(err, syscall.EMFILE) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, fd)
	}
	for ; n < 8; n++ {
		l.Write(numbered(n))
		l.sync()
	}
	st := l.Stats()
	free()
	if st.Written != 8 || st.Failed != 0 || !strings.Contains(st.Err, "too many open files") {
		t.Fatalf("out of descriptors: %+v, want 8 written and the open's error", st)
	}
	waitRotated(t, l)
	rotated := n
	l.Write(numbered(n))
	n++
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	// The old file took the events written meanwhile; nothing was shifted
	// twice.
	_, evs := readLines(t, path+".2", path+".1", path)
	inOrder(t, evs, 0, n)
	if _, cur := readLines(t, path); len(cur) != 1 || cur[0].Count != uint64(rotated) {
		t.Fatalf("the new file holds %+v, want event %d alone", cur, rotated)
	}
}

// TestLogTornTailEndsLine: a file left ending mid-line (the daemon killed
// in a write) gets a newline before the first new event, which is on a
// line of its own.
func TestLogTornTailEndsLine(t *testing.T) {
	path := filepath.Join(t.TempDir(), "events.log")
	first, _ := json.Marshal(numbered(1))
	fragment := `{"seq":2,"time":"2026-01-02T03:04:05Z","source":"ker`
	if err := os.WriteFile(path, []byte(string(first)+"\n"+fragment), 0o640); err != nil {
		t.Fatal(err)
	}
	l, err := OpenLog(path, LogOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Write(numbered(3)); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	lines, evs := readLines(t, path)
	if len(lines) != 3 || lines[1] != fragment {
		t.Fatalf("lines %q, want the old line, the fragment, the new event", lines)
	}
	if len(evs) != 2 || evs[0].Count != 1 || evs[1].Count != 3 {
		t.Fatalf("events %+v, want 1 and 3", evs)
	}
}

// TestLogCloseBounded: with a file that does not take writes, Write
// returns at once and drops past the queue, counted and told once; Close
// gives up after CloseWait and says so; the writer ends once the file
// takes its writes, having written whole lines in order.
func TestLogCloseBounded(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "events.log")
	logger, out := testLogger()
	l, err := OpenLog(path, LogOptions{Queue: 16, CloseWait: 200 * time.Millisecond, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	r := testutil.HangFile(t, path, filepath.Join(dir, "fifo"))
	defer r.Close()
	// Some events through, then a burst: the 4 KiB pipe fills and the
	// writer hangs in a write.
	const n = 2000
	i := 0
	for ; l.Stats().Written < 10; i++ {
		if err := l.Write(numbered(i)); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Millisecond)
	}
	for ; i < n/2; i++ {
		if err := l.Write(numbered(i)); err != nil {
			t.Fatal(err)
		}
	}
	l.Flush()
	// Dropping goes on: not told again.
	for ; i < n; i++ {
		l.Write(numbered(i))
	}
	l.Flush()
	if st := l.Stats(); st.Dropped == 0 {
		t.Fatalf("%+v: nothing dropped", st)
	}
	if c := out.count("does not keep up"); c != 1 {
		t.Errorf("the drops told %d times, want once:\n%s", c, out)
	}
	// Nothing more dropped, but the file still hung: not over.
	l.Flush()
	if c := out.count("keeps up again"); c != 0 {
		t.Errorf("told the file keeps up while it hangs:\n%s", out)
	}
	start := time.Now()
	if err := l.Close(); err == nil || !strings.Contains(err.Error(), "did not take") {
		t.Errorf("Close on a hung file: %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Close took %v", d)
	}
	if err := l.Write(numbered(n)); !errors.Is(err, ErrLogClosed) {
		t.Errorf("Write after Close: %v", err)
	}
	// The file takes writes again: the writer drains and closes it.
	b, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	<-l.done
	last := -1
	for _, line := range strings.Split(strings.TrimSuffix(string(b), "\n"), "\n") {
		var e Event
		if err := json.Unmarshal([]byte(line), &e); err != nil {
			t.Fatalf("line %q: %v", line, err)
		}
		if int(e.Count) <= last {
			t.Fatalf("event %d after %d", e.Count, last)
		}
		last = int(e.Count)
	}
	if st := l.Stats(); st.Written+st.Dropped != n || st.Failed != 0 {
		t.Errorf("%+v: written and dropped do not make %d", st, n)
	}
}

// A rotation whose last rename fails is tried again without moving the
// older files up again at each try: with keep 3, the files path.1 and path.2
// held become path.2 and path.3 once, whatever the retries (each retry
// pushed one more of them out).
func TestLogRotateRetryKeepsOlderFiles(t *testing.T) {
	defer func(d time.Duration) { rotateRetry = d }(rotateRetry)
	rotateRetry = 10 * time.Millisecond
	path := filepath.Join(t.TempDir(), "events.log")
	for i, c := range []string{"one\n", "two\n"} {
		if err := os.WriteFile(path+"."+strconv.Itoa(i+1), []byte(c), 0o640); err != nil {
			t.Fatal(err)
		}
	}
	var fails atomic.Int32
	fails.Store(5)
	defer func() { rename = os.Rename }()
	rename = func(from, to string) error {
		if from == path && fails.Add(-1) >= 0 {
			return errors.New("in the way")
		}
		return os.Rename(from, to)
	}
	l, err := OpenLog(path, LogOptions{MaxBytes: 200, Keep: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	deadline := time.Now().Add(10 * time.Second)
	for n := 0; fails.Load() >= 0 || l.Stats().Err != ""; n++ {
		if time.Now().After(deadline) {
			t.Fatalf("rotation not done: %+v", l.Stats())
		}
		l.Write(numbered(n))
		l.sync()
		time.Sleep(5 * time.Millisecond)
		l.Flush()
	}
	for i, want := range map[int]string{2: "one\n", 3: "two\n"} {
		if b, err := os.ReadFile(path + "." + strconv.Itoa(i)); err != nil || string(b) != want {
			t.Errorf("%s.%d: %q %v, want %q", path, i, b, err, want)
		}
	}
}

// waitRotated waits until l's failed rotation, tried again every
// rotateRetry, has gone through (its error cleared).
func waitRotated(t *testing.T, l *Log) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for l.Stats().Err != "" {
		if time.Now().After(deadline) {
			t.Fatalf("rotation not tried again: %+v", l.Stats())
		}
		time.Sleep(20 * time.Millisecond)
		l.Flush()
		l.sync()
	}
}
