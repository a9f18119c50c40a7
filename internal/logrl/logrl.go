// SPDX-License-Identifier: Apache-2.0

package logrl

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"time"
)

// Defaults of Options.
const (
	DefaultBurst     = 5
	DefaultWindow    = 10 * time.Second
	DefaultMaxGroups = 4096
)

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
	key := h.scope + "\x00" + r.Level.String() + "\x00" + r.Message
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
