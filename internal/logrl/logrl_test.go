// SPDX-License-Identifier: Apache-2.0

package logrl

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
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

// A flood of refusals on one listener does not hide the first refusal on
// another, nor a refusal for another reason; the summary of each says its
// own listener. Before, every listener logged through part=listen with one
// message, so a flood on front_socket suppressed the first refusal on the
// admin socket, and the summary showed only the flood's last record.
func TestFloodDoesNotHideOtherListeners(t *testing.T) {
	log, buf, ft := newLogger(t)
	l := log.With("part", "listen")
	for uid := range 1000 {
		l.Warn("connection refused: too many open connections", "listener", "front_socket", "reason", "peer_full", "uid", uid)
	}
	l.Warn("connection refused: too many open connections", "listener", "admin", "reason", "peer_full", "uid", 65534)
	l.Warn("connection refused: too many open connections", "listener", "front_socket", "reason", "listener_full", "uid", 7)
	out := buf.String()
	if !strings.Contains(out, "listener=admin") || !strings.Contains(out, "reason=listener_full") {
		t.Fatalf("the first refusal on admin, or for another reason, was not written:\n%s", out)
	}
	if got := len(lines(buf)); got != DefaultBurst+2 {
		t.Fatalf("%d lines, want %d:\n%s", got, DefaultBurst+2, out)
	}
	ft.advance(DefaultWindow)
	last := lines(buf)[len(lines(buf))-1]
	if !strings.Contains(last, "listener=front_socket") || !strings.Contains(last, "suppressed=995") {
		t.Fatalf("summary %q", last)
	}
}

// Errors split by class, not by text: a new kind of upstream error is
// written at once, while refused connections to a thousand ports are one
// kind.
func TestErrorClassesSplit(t *testing.T) {
	log, buf, _ := newLogger(t)
	for port := range 1000 {
		err := &net.OpError{Op: "dial", Net: "tcp", Addr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 1000 + port},
			Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
		log.Warn("upstream error", "project", fmt.Sprint("p", port), "err", err)
	}
	log.Warn("upstream error", "err", fmt.Errorf("reading head: %w", os.ErrDeadlineExceeded))
	log.Warn("upstream error", "err", fmt.Errorf("reading body: %w", io.ErrUnexpectedEOF))
	log.Warn("upstream error", "err", errors.New("upstream sent 3 informational answers, more than 2"))
	log.Warn("upstream error", "err", errors.New("upstream sent 9 informational answers, more than 2"))
	out := buf.String()
	for _, want := range []string{"i/o timeout", "unexpected EOF", "sent 3 informational"} {
		if !strings.Contains(out, want) {
			t.Errorf("the first %q was not written:\n%s", want, out)
		}
	}
	if got := len(lines(buf)); got != DefaultBurst+4 {
		t.Errorf("%d lines, want %d:\n%s", got, DefaultBurst+4, out)
	}
	for _, tt := range []struct {
		err  error
		want string
	}{
		{os.NewSyscallError("accept4", syscall.EMFILE), "errno:too many open files"},
		{context.DeadlineExceeded, "timeout"},
		{fmt.Errorf("x: %w", context.Canceled), "canceled"},
		{errors.New("port 1234 busy"), "*errors.errorString:port  busy"},
	} {
		if got := ErrClass(tt.err); got != tt.want {
			t.Errorf("ErrClass(%v) = %q, want %q", tt.err, got, tt.want)
		}
	}
}

// Audit records are always written and never counted: a policy change
// made the sixth time in ten seconds is in the log. Before, they were
// limited like any other line.
func TestAuditNeverSuppressed(t *testing.T) {
	log, buf, ft := newLogger(t)
	for i := range 100 {
		log.Info("policy set", "project", fmt.Sprint("p", i), "shares", i, Audit())
	}
	if got := len(lines(buf)); got != 100 {
		t.Fatalf("%d audit lines written of 100", got)
	}
	ft.advance(DefaultWindow)
	if strings.Contains(buf.String(), "suppressed") {
		t.Fatalf("audit lines counted as suppressed:\n%s", buf)
	}
}

// However many kinds of line there are, the groups tracked stay bounded.
func TestGroupsBounded(t *testing.T) {
	var buf bytes.Buffer
	ft := &fakeTime{now: time.Unix(1000, 0)}
	h := New(slog.NewTextHandler(&buf, nil), Options{Now: ft.Now, After: ft.After, MaxGroups: 64})
	log := slog.New(h)
	for i := range 10000 {
		log.Warn("accept failed", "listener", fmt.Sprint("l", i), "err", fmt.Errorf("error %d of a kind %d", i, i))
	}
	if n := len(h.st.groups); n > 64 {
		t.Fatalf("%d groups tracked, bound 64", n)
	}
	if got := len(lines(&buf)); got > 64+DefaultBurst {
		t.Fatalf("%d lines written for 10000 records", got)
	}
}

// With the real clock: the summary is written by the timer when the window
// ends, with nothing else logged.
func TestSummaryOnRealClock(t *testing.T) {
	var buf testutil.Buffer
	h := New(slog.NewTextHandler(&buf, nil), Options{Window: 50 * time.Millisecond})
	log := slog.New(h)
	for range 20 {
		log.Warn("upstream error", "err", io.EOF)
	}
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(buf.String(), "suppressed=15") {
		if time.Now().After(deadline) {
			t.Fatalf("no summary after the window:\n%s", buf.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
}
