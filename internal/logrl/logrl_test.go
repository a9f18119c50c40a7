// SPDX-License-Identifier: Apache-2.0

package logrl

import (
	"bytes"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeTime is a clock and a timer queue that the test moves by hand.
type fakeTime struct {
	mu     sync.Mutex
	now    time.Time
	timers []*fakeTimer
}

type fakeTimer struct {
	at      time.Time
	f       func()
	stopped bool
}

func (ft *fakeTime) Now() time.Time {
	ft.mu.Lock()
	defer ft.mu.Unlock()
	return ft.now
}

func (ft *fakeTime) After(d time.Duration, f func()) func() bool {
	ft.mu.Lock()
	defer ft.mu.Unlock()
	t := &fakeTimer{at: ft.now.Add(d), f: f}
	ft.timers = append(ft.timers, t)
	return func() bool {
		ft.mu.Lock()
		defer ft.mu.Unlock()
		was := !t.stopped
		t.stopped = true
		return was
	}
}

// advance moves the clock and runs the timers that are due.
func (ft *fakeTime) advance(d time.Duration) {
	ft.mu.Lock()
	ft.now = ft.now.Add(d)
	var due []func()
	rest := ft.timers[:0]
	for _, t := range ft.timers {
		switch {
		case t.stopped:
		case !t.at.After(ft.now):
			t.stopped = true
			due = append(due, t.f)
		default:
			rest = append(rest, t)
		}
	}
	ft.timers = rest
	ft.mu.Unlock()
	for _, f := range due {
		f()
	}
}

func newLogger(t *testing.T) (*slog.Logger, *bytes.Buffer, *fakeTime) {
	t.Helper()
	var buf bytes.Buffer
	ft := &fakeTime{now: time.Unix(1000, 0)}
	h := New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}), Options{Now: ft.Now, After: ft.After})
	return slog.New(h), &buf, ft
}

func lines(buf *bytes.Buffer) []string {
	return strings.Split(strings.TrimSpace(buf.String()), "\n")
}

// An outage: one line per failed request, 1,499 of them in one second. Five
// are written, then one summary with the count of the rest when the window
// ends; another kind of line and another part are limited separately.
func TestOutageIsSummarised(t *testing.T) {
	log, buf, ft := newLogger(t)
	front := log.With("part", "front")
	for i := range 1499 {
		front.Warn("upstream error", "project", "p", "n", i)
	}
	front.Warn("other line")
	log.With("part", "permits").Warn("upstream error")
	if got := len(lines(buf)); got != DefaultBurst+2 {
		t.Fatalf("%d lines during the burst, want %d:\n%s", got, DefaultBurst+2, buf)
	}
	ft.advance(DefaultWindow)
	ls := lines(buf)
	last := ls[len(ls)-1]
	if len(ls) != DefaultBurst+3 || !strings.Contains(last, "suppressed=1494") || !strings.Contains(last, "n=1498") ||
		!strings.Contains(last, "part=front") || !strings.Contains(last, "window=10s") {
		t.Fatalf("after the window:\n%s", buf)
	}
	// The next window starts afresh, and the summary was its first line.
	for range 10 {
		front.Warn("upstream error")
	}
	if got := len(lines(buf)); got != DefaultBurst+3+DefaultBurst-1 {
		t.Fatalf("%d lines in the next window:\n%s", got, buf)
	}
}

// A record after the window ended, before the timer ran, carries the count.
func TestCountCarriedByNextRecord(t *testing.T) {
	log, buf, ft := newLogger(t)
	for range DefaultBurst + 3 {
		log.Error("accept failed")
	}
	ft.mu.Lock()
	ft.now = ft.now.Add(DefaultWindow) // the timer is due but has not run
	ft.mu.Unlock()
	log.Error("accept failed", "k", "v")
	ls := lines(buf)
	if last := ls[len(ls)-1]; len(ls) != DefaultBurst+1 || !strings.Contains(last, "suppressed=3") || !strings.Contains(last, "k=v") {
		t.Fatalf("got:\n%s", buf)
	}
	ft.advance(0) // the stale timer must not write the count again
	if got := len(lines(buf)); got != DefaultBurst+1 {
		t.Fatalf("the count was written twice:\n%s", buf)
	}
}

func TestDebugIsNotLimited(t *testing.T) {
	log, buf, _ := newLogger(t)
	for range 50 {
		log.Debug("reconcile pass")
	}
	if got := len(lines(buf)); got != 50 {
		t.Fatalf("%d debug lines, want 50", got)
	}
}

func TestFlushAndGroupBound(t *testing.T) {
	var buf bytes.Buffer
	ft := &fakeTime{now: time.Unix(1000, 0)}
	h := New(slog.NewTextHandler(&buf, nil), Options{Now: ft.Now, After: ft.After, MaxGroups: 4, Burst: 1})
	log := slog.New(h)
	for i := range 100 {
		log.Info("line " + string(rune('a'+i%26)))
	}
	if n := len(h.st.groups); n > 4 {
		t.Fatalf("%d groups tracked, bound 4", n)
	}
	before := len(lines(&buf))
	h.Flush()
	if len(lines(&buf)) <= before || !strings.Contains(buf.String(), "suppressed=") {
		t.Fatalf("Flush wrote no summary:\n%s", buf.String())
	}
}
