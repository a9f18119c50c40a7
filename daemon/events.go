// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"cmp"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/events"
)

// eventSink is where every part of the daemon sends its events: it bounds
// each project's events per second (config events.per_sec; the kernel's are
// bounded by the programs), numbers them, keeps the most recent for 'fairshare events' without
// --follow, queues them for events.log if configured, and fans them out
// through the Hub to the streams of the admin API. Publishing never blocks
// and never fails the decision that made the event: neither the Hub nor the
// log waits for a reader or for the file (a log whose file does not keep
// up drops events and counts them).
type eventSink struct {
	hub    *events.Hub
	file   *events.Log // nil: no events.log
	perSec int
	log    *slog.Logger

	mu  sync.Mutex // guards the fields below
	seq uint64
	// ring holds the last len(ring) events; next is where the next goes.
	ring []events.Event
	next int
	n    int
	// sec is the second the counts are for; counts the events of each
	// project in it (so memory is the projects of one second).
	sec    int64
	counts map[string]int
	// dropped counts, per source, pool and project, events over the
	// per-second bound since the last notice (flush). The kernel's are per
	// project only (its pool "": any of its pools).
	dropped map[[3]string]uint64
	stats   admin.Events
	// toldClosed: a write refused by the closed log was logged (once).
	toldClosed bool
}

func newEventSink(cfg config.Events, log *slog.Logger) (*eventSink, error) {
	s := &eventSink{
		hub: events.NewHub(nil), perSec: cfg.PerSec, log: log,
		ring: make([]events.Event, cfg.Recent), counts: map[string]int{}, dropped: map[[3]string]uint64{},
	}
	if cfg.Log != "" {
		f, err := events.OpenLog(cfg.Log, events.LogOptions{MaxBytes: cfg.LogMaxBytes, Keep: cfg.LogKeep, Logger: log})
		if err != nil {
			return nil, pathError("events.log", err)
		}
		s.file = f
		s.stats.Log = cfg.Log
	}
	return s, nil
}

// publish records e; see eventSink.
func (s *eventSink) publish(e events.Event) {
	if s == nil {
		return
	}
	if e.Time.IsZero() {
		e.Time = time.Now()
	}
	s.mu.Lock()
	// The kernel's events come bounded by the programs already.
	if e.Kind != events.KindDropped && e.Source != events.SourceKernel {
		if sec := e.Time.Unix(); sec != s.sec {
			s.sec = sec
			clear(s.counts)
		}
		if s.counts[e.Project] >= s.perSec {
			s.dropped[[3]string{e.Source, e.Pool, e.Project}]++
			s.stats.Dropped++
			s.mu.Unlock()
			return
		}
		s.counts[e.Project]++
	}
	s.seq++
	e.Seq = s.seq
	s.ring[s.next] = e
	s.next = (s.next + 1) % len(s.ring)
	s.n = min(s.n+1, len(s.ring))
	s.stats.Published++
	if e.Kind == events.KindWouldRefuse {
		s.stats.WouldRefuse++
	}
	// Published in Seq order (the hub never blocks): a follower drops what
	// it has seen by Seq, and events published out of order were lost
	// (195 of 160,000 from 8 goroutines before).
	s.hub.Publish(e)
	// Queued in Seq order too, without waiting for the file; the log
	// refuses only once closed (a part still finishing at shutdown).
	if s.file != nil {
		if err := s.file.Write(e); err != nil {
			s.stats.LogClosed++
			if !s.toldClosed {
				s.toldClosed = true
				s.log.Warn("events.log: events published after it closed are not written", "err", err)
			}
		}
	}
	s.mu.Unlock()
}

// countKernelDropped adds the refusal events the BPF programs dropped over
// their per-project bound (read from the maps at each tick).
func (s *eventSink) countKernelDropped(project string, n uint64) {
	if s == nil || n == 0 {
		return
	}
	s.mu.Lock()
	s.dropped[[3]string{events.SourceKernel, "", project}] += n
	s.stats.KernelDropped += n
	s.mu.Unlock()
}

// flush, at each tick of the control loop, publishes one dropped notice
// per source, pool and project that lost events to the bound, and asks the log
// to write its buffer and to try again a rotation that failed (without
// waiting for the file).
func (s *eventSink) flush() {
	if s == nil {
		return
	}
	s.mu.Lock()
	keys := make([][3]string, 0, len(s.dropped))
	for k := range s.dropped {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b [3]string) int {
		return cmp.Or(cmp.Compare(a[0], b[0]), cmp.Compare(a[1], b[1]), cmp.Compare(a[2], b[2]))
	})
	notices := make([]events.Event, 0, len(keys))
	for _, k := range keys {
		notices = append(notices, events.Event{Source: k[0], Kind: events.KindDropped, Pool: k[1], Project: k[2], Count: s.dropped[k],
			Detail: "over the bound of events per project and second (events.per_sec)"})
	}
	clear(s.dropped)
	s.mu.Unlock()
	for _, e := range notices {
		s.publish(e)
	}
	if s.file != nil {
		s.file.Flush()
	}
}

// recent returns the kept events that match f, oldest first.
func (s *eventSink) recent(f events.Filter) []events.Event {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]events.Event, 0, s.n)
	start := (s.next - s.n + len(s.ring)) % len(s.ring)
	for i := range s.n {
		if e := s.ring[(start+i)%len(s.ring)]; f.Match(e) {
			out = append(out, e)
		}
	}
	return out
}

// status is the sink's counters. LogErrors counts the events events.log
// did not write: lost to failed writes, dropped for a file that did not
// keep up, or published after it closed.
func (s *eventSink) status() *admin.Events {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	st := s.stats
	s.mu.Unlock()
	hs := s.hub.Stats()
	st.StreamLost, st.Subscribers = hs.Lost, hs.Subscribers
	if s.file != nil {
		ls := s.file.Stats()
		st.LogFailed, st.LogDropped = ls.Failed, ls.Dropped
		st.LogErrors = st.LogFailed + st.LogDropped + st.LogClosed
	}
	return &st
}

func (s *eventSink) close() error {
	if s == nil || s.file == nil {
		return nil
	}
	return s.file.Close()
}

// RecentEvents implements admin.EventSource.
func (d *Daemon) RecentEvents(f events.Filter) []events.Event { return d.events.recent(f) }

// SubscribeEvents implements admin.EventSource.
func (d *Daemon) SubscribeEvents(f events.Filter, buf int) *events.Sub {
	return d.events.hub.Subscribe(f, buf)
}
