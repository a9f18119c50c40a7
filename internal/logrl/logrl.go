// SPDX-License-Identifier: Apache-2.0

package logrl

import (
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
	"time"
)

// Defaults of Options.
const (
	DefaultBurst     = 5
	DefaultWindow    = 10 * time.Second
	DefaultMaxGroups = 1024
)

// DefaultKeyAttrs are the record attributes that tell one kind of line from
// another: which listener, why it refused, which pool, which protocol code,
// and the class of an error (see Options.KeyAttrs).
var DefaultKeyAttrs = []string{"listener", "reason", "pool", "code", "err", "error"}

// AuditKey is the attribute that marks an audit record (Audit).
const AuditKey = "audit"

// Audit marks a record as an audit event (a policy changed, a session
// opened): such records are always written and never counted.
func Audit() slog.Attr { return slog.Bool(AuditKey, true) }

// maxClassLen bounds the text of an error class in a group key.
const maxClassLen = 96

// Options tune New; zero values take the defaults.
type Options struct {
	// Burst is how many records of one group pass per window.
	Burst int
	// Window is the period over which Burst applies.
	Window time.Duration
	// MinLevel is the lowest level that is limited; records below it always
	// pass. The zero value (Info) leaves Debug unlimited.
	MinLevel slog.Level
	// MaxGroups bounds the groups tracked at once (at least 2); past it,
	// new kinds of line share one group.
	MaxGroups int
	// KeyAttrs name the record attributes whose values split a group
	// (nil: DefaultKeyAttrs). An error's value counts by its class (ErrClass),
	// not its text, which carries addresses and ports.
	KeyAttrs []string
	// Now is the clock; nil means time.Now. Tests set it together with
	// After.
	Now func() time.Time
	// After schedules the end-of-window summary; nil means time.AfterFunc.
	After func(time.Duration, func()) (stop func() bool)
}

// Handler is an slog.Handler that limits repeated records (see the package
// documentation). Handlers derived with WithAttrs and WithGroup share its
// groups and counts.
type Handler struct {
	inner slog.Handler
	scope string // the attributes and groups added by With*, for the group key
	st    *state
}

type state struct {
	opts Options

	mu     sync.Mutex // guards the fields below
	groups map[string]*group
}

// group is one kind of line and its current window.
type group struct {
	start      time.Time
	passed     int
	suppressed int
	last       slog.Record  // the latest suppressed record
	h          slog.Handler // the inner handler that record came through
	stop       func() bool  // the pending summary, if any
}

// New wraps h.
func New(h slog.Handler, opts Options) *Handler {
	if opts.Burst <= 0 {
		opts.Burst = DefaultBurst
	}
	if opts.Window <= 0 {
		opts.Window = DefaultWindow
	}
	if opts.MaxGroups < 2 {
		opts.MaxGroups = DefaultMaxGroups
	}
	if opts.KeyAttrs == nil {
		opts.KeyAttrs = DefaultKeyAttrs
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.After == nil {
		opts.After = func(d time.Duration, f func()) func() bool { return time.AfterFunc(d, f).Stop }
	}
	return &Handler{inner: h, st: &state{opts: opts, groups: map[string]*group{}}}
}

// Enabled reports whether the wrapped handler takes records at level.
func (h *Handler) Enabled(ctx context.Context, level slog.Level) bool {
	return h.inner.Enabled(ctx, level)
}

// WithAttrs returns a handler whose records carry as; they form their own
// groups (part=front and part=permits are different lines).
func (h *Handler) WithAttrs(as []slog.Attr) slog.Handler {
	var b strings.Builder
	b.WriteString(h.scope)
	for _, a := range as {
		b.WriteString(a.String())
		b.WriteByte(' ')
	}
	return &Handler{inner: h.inner.WithAttrs(as), scope: b.String(), st: h.st}
}

// WithGroup returns a handler that nests attributes under name.
func (h *Handler) WithGroup(name string) slog.Handler {
	return &Handler{inner: h.inner.WithGroup(name), scope: h.scope + "{" + name + " ", st: h.st}
}

// overflowKey is the group of every record past MaxGroups.
const overflowKey = "\x00overflow"

// Handle writes r, counts it as suppressed, or writes it with the count of
// the previous window's suppressed records of its group.
func (h *Handler) Handle(ctx context.Context, r slog.Record) error {
	st := h.st
	if r.Level < st.opts.MinLevel {
		return h.inner.Handle(ctx, r)
	}
	key, audit := st.keyOf(h.scope, r)
	if audit {
		return h.inner.Handle(ctx, r)
	}
	now := st.opts.Now()
	st.mu.Lock()
	g := st.groups[key]
	if g == nil {
		// One place stays for the shared overflow group.
		if len(st.groups) >= st.opts.MaxGroups-1 {
			st.sweepLocked(now)
		}
		if len(st.groups) >= st.opts.MaxGroups-1 {
			key = overflowKey
			g = st.groups[key]
		}
		if g == nil {
			g = &group{start: now}
			st.groups[key] = g
		}
	}
	var carried int
	if now.Sub(g.start) >= st.opts.Window {
		// A new window: a summary not yet written goes out with this
		// record instead of on its own.
		carried = g.suppressed
		g.resetLocked(now)
	}
	if g.passed < st.opts.Burst {
		g.passed++
		st.mu.Unlock()
		if carried > 0 {
			r = r.Clone()
			r.AddAttrs(slog.Int("suppressed", carried), slog.Duration("window", st.opts.Window))
		}
		return h.inner.Handle(ctx, r)
	}
	g.suppressed++
	g.last, g.h = r.Clone(), h.inner
	if g.stop == nil {
		g.stop = st.opts.After(g.start.Add(st.opts.Window).Sub(now), func() { st.flush(key, g) })
	}
	st.mu.Unlock()
	return nil
}

func (g *group) resetLocked(now time.Time) {
	if g.stop != nil {
		g.stop()
		g.stop = nil
	}
	g.start, g.passed, g.suppressed = now, 0, 0
	g.last, g.h = slog.Record{}, nil
}

// flush writes the summary of g's window, if g is still the group of key
// and still has one to write.
func (st *state) flush(key string, g *group) {
	st.mu.Lock()
	if st.groups[key] != g || g.suppressed == 0 {
		st.mu.Unlock()
		return
	}
	rec, h, n := g.last, g.h, g.suppressed
	g.stop = nil
	g.resetLocked(st.opts.Now())
	// The summary counts as this window's first line.
	g.passed = 1
	st.mu.Unlock()
	rec.AddAttrs(slog.Int("suppressed", n), slog.Duration("window", st.opts.Window))
	_ = h.Handle(context.Background(), rec)
}

// keyOf returns the group key of r, and whether r is an audit record.
func (st *state) keyOf(scope string, r slog.Record) (string, bool) {
	var b strings.Builder
	b.WriteString(scope)
	b.WriteByte(0)
	b.WriteString(r.Level.String())
	b.WriteByte(0)
	b.WriteString(r.Message)
	audit := false
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == AuditKey && a.Value.Kind() == slog.KindBool && a.Value.Bool() {
			audit = true
			return false
		}
		for _, k := range st.opts.KeyAttrs {
			if a.Key == k {
				b.WriteByte(0)
				b.WriteString(k)
				b.WriteByte('=')
				b.WriteString(valueClass(a.Value))
				break
			}
		}
		return true
	})
	return b.String(), audit
}

// valueClass is what a key attribute's value contributes to a group key.
func valueClass(v slog.Value) string {
	v = v.Resolve()
	if v.Kind() == slog.KindAny {
		if err, ok := v.Any().(error); ok {
			return ErrClass(err)
		}
	}
	s := v.String()
	if len(s) > maxClassLen {
		s = s[:maxClassLen]
	}
	return s
}

// ErrClass names the kind of an error for grouping log lines: the system
// error number when there is one (connection refused, too many open
// files), a timeout, the end of a stream, a cancellation; otherwise the
// type of the innermost error and its text without digits (which carry
// addresses, ports and counts), at most 96 bytes.
func ErrClass(err error) string {
	var errno syscall.Errno
	var ne net.Error
	switch {
	case err == nil:
		return "nil"
	case errors.As(err, &errno):
		return "errno:" + errno.Error()
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded),
		errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	case errors.Is(err, context.Canceled):
		return "canceled"
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return "eof"
	}
	inner := err
	for {
		u := errors.Unwrap(inner)
		if u == nil {
			break
		}
		inner = u
	}
	msg := strings.Map(func(r rune) rune {
		if r >= '0' && r <= '9' {
			return -1
		}
		return r
	}, inner.Error())
	s := fmt.Sprintf("%T:%s", inner, msg)
	if len(s) > maxClassLen {
		s = s[:maxClassLen]
	}
	return s
}

// sweepLocked drops groups whose window is over with nothing pending.
func (st *state) sweepLocked(now time.Time) {
	for k, g := range st.groups {
		if g.suppressed == 0 && now.Sub(g.start) >= st.opts.Window {
			delete(st.groups, k)
		}
	}
}

// Flush writes every pending summary now, for a logger about to stop.
func (h *Handler) Flush() {
	st := h.st
	st.mu.Lock()
	type pending struct {
		key string
		g   *group
	}
	var ps []pending
	for k, g := range st.groups {
		if g.suppressed > 0 {
			ps = append(ps, pending{k, g})
		}
	}
	st.mu.Unlock()
	for _, p := range ps {
		st.flush(p.key, p.g)
	}
}
