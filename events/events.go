// SPDX-License-Identifier: Apache-2.0

package events

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Sources of events.
const (
	SourceKernel    = "kernel"    // the BPF programs (connect, SYN)
	SourceFront     = "front"     // the HTTP front
	SourcePermits   = "permits"   // the permit API (flights, residents, named pools)
	SourceReconcile = "reconcile" // the daemon's comparison of the kernel's counts with its socket table
	SourceEvents    = "events"    // a stream's own notice that it fell behind (dropped)
)

// Kinds of events.
const (
	KindRefused     = "refused"      // a permit was refused (connect, SYN, request, acquire)
	KindWouldRefuse = "would_refuse" // dry-run: the rule would have refused, and admitted instead
	KindRateLimited = "rate_limited" // refused by the project's own rate (policy), not by the share
	KindEvicted     = "evicted"      // a resident object was put to sleep to make room
	KindAdopted     = "adopted"      // reconcile counted sockets the programs had not
	KindRepaired    = "repaired"     // reconcile corrected a count
	KindDropped     = "dropped"      // events lost (rate limit, a slow reader): Count says how many
	// KindLapsed: the rule would have refused, and the kernel admitted
	// because enforcement had lapsed (no daemon seen for
	// connections.lapse_after).
	KindLapsed = "lapsed"
	// KindAdoptedPast: reconcile adopted sockets the rule of Pool (the
	// connections pool, or a destination pool) would have refused (they
	// exist, so they count): Count says how many, and the pool's in_use
	// may exceed its size by them until they end. One per pool and
	// project: a socket past two pools' rules is in both events.
	KindAdoptedPast = "adopted_past_rule"
	// KindMovedPast: reconcile moved permits taken while a pod was
	// unclassified to the project it is classified in, and the rule of
	// Pool would have refused that project: Count says how many; they
	// count, and the project is refused there until it is back under its
	// limit. One per pool and project, as KindAdoptedPast.
	KindMovedPast = "moved_past_rule"
	// KindAbortedPast: of KindMovedPast's connections, those reconcile
	// aborted (connections.abort_moved_past): Count says how many, past
	// the connections pool's rule; their permits go back as they close.
	KindAbortedPast = "aborted_past_rule"
	// KindUnadopted: reconcile found project sockets holding no permit
	// that it could not adopt, the held-permit table having no room (only
	// a flood of connections older than the daemon fills it): Count says
	// how many; they count nowhere, so the project may take its share
	// again beside them, until a pass finds room. One per project, at
	// every pass while they last.
	KindUnadopted = "unadopted"
	KindFleet     = "fleet" // a fleet pool's link to etcd changed (connected, cut off): Reason says which
)

// Reasons for a refusal.
const (
	ReasonShare       = "share"              // over its share on a full node (the pool keeps a floor for others)
	ReasonPoolFull    = "pool_full"          // the pool is full and the project is under its share
	ReasonFloor       = "floor"              // inbound, past the share beside a newcomer, on a node full to the floor
	ReasonExempt      = "exempt_budget"      // exempt traffic past its budget, refused under the rule
	ReasonRate        = "rate"               // the project's requests or connections per second
	ReasonDebt        = "debt"               // the project's work units per second, spent ahead
	ReasonNoIdent     = "no_project"         // the front could not tell the request's project (400)
	ReasonUntrust     = "untrusted"          // the front refused a project header from an untrusted peer (403)
	ReasonWaiting     = "too_many_waiting"   // the permit API's bound on waiting operations
	ReasonResidents   = "too_many_residents" // nothing could be evicted in time
	ReasonRateLimited = "rate_limited"       // the kernel's per-project connection rate (#20)
	ReasonFleetCap    = "fleet_cap"          // at its fleet cap on this node: its part of its fleet allocation (the kernel's fleet pools)
	ReasonFleetSafe   = "fleet_safe"         // a kernel fleet pool held to its safe slice: its lease ended unrenewed (the daemon gone, or cut off)
)

// Event is one decision that matters to an operator. Fields that do not
// apply are left out of the JSON.
type Event struct {
	// Seq numbers the daemon's events in the order it published them (so a
	// stream that starts with the recent ones can skip what it already
	// sent); 0 until published.
	Seq     uint64    `json:"seq,omitempty"`
	Time    time.Time `json:"time"`
	Source  string    `json:"source"`
	Kind    string    `json:"kind"`
	Pool    string    `json:"pool,omitempty"`
	Project string    `json:"project,omitempty"`
	Reason  string    `json:"reason,omitempty"`
	// Direction of a connection: "connect" (outbound) or "syn" (inbound).
	Direction string `json:"direction,omitempty"`
	// Local and Remote are host:port of a connection, or the front's peer.
	Local  string `json:"local,omitempty"`
	Remote string `json:"remote,omitempty"`
	// The rule's inputs at the decision.
	Held     int `json:"held"`
	InUse    int `json:"in_use"`
	Share    int `json:"share"`
	PoolSize int `json:"pool_size"`
	// Evictions: the object put to sleep, its owner's session, and the
	// project whose spawn made room.
	Victim  string `json:"victim,omitempty"`
	Owner   string `json:"owner,omitempty"`
	Spawner string `json:"spawner,omitempty"`
	// Count is how many events this one stands for (KindDropped, or a
	// reconcile repair of several permits); 0 means one.
	Count uint64 `json:"count,omitempty"`
	// Detail is free text for what the fields above do not say.
	Detail string `json:"detail,omitempty"`
}

// Filter selects events; an empty field matches all.
type Filter struct {
	Project string
	Pool    string
}

// Match reports whether e passes f. Dropped notices of the stream itself
// (source "events") always pass: a reader must learn that it missed
// events. Another dropped notice passes for its project, and for its pool
// or, if it names none (the kernel's, counted per project), for any pool:
// it may stand for events the filter would have passed.
func (f Filter) Match(e Event) bool {
	if e.Kind == KindDropped {
		if e.Source == SourceEvents {
			return true
		}
		return (f.Project == "" || f.Project == e.Project) && (f.Pool == "" || e.Pool == "" || f.Pool == e.Pool)
	}
	return (f.Project == "" || f.Project == e.Project) && (f.Pool == "" || f.Pool == e.Pool)
}

// Hub fans events out to subscribers. Publishing never blocks: a
// subscriber that does not keep up loses events, and is told how many with
// a KindDropped event as soon as it has room again. Safe for concurrent use.
type Hub struct {
	mu   sync.Mutex // guards subs
	subs []*Sub

	published atomic.Uint64
	lost      atomic.Uint64
	now       func() time.Time
}

// NewHub returns an empty hub; now stamps events published without a time
// (nil: time.Now).
func NewHub(now func() time.Time) *Hub {
	if now == nil {
		now = time.Now
	}
	return &Hub{now: now}
}

// Sub is one subscriber's stream.
type Sub struct {
	// C delivers the events that match the subscriber's filter.
	C      chan Event
	filter Filter
	hub    *Hub
	lost   atomic.Uint64 // dropped since the last notice
	closed bool          // guarded by hub.mu
}

// Subscribe returns a stream of the events matching f, buffered to buf
// (at least 1). Close it when done.
func (h *Hub) Subscribe(f Filter, buf int) *Sub {
	s := &Sub{C: make(chan Event, max(buf, 1)), filter: f, hub: h}
	h.mu.Lock()
	h.subs = append(h.subs, s)
	h.mu.Unlock()
	return s
}

// Close ends the stream: C is closed and nothing more is sent on it.
func (s *Sub) Close() {
	h := s.hub
	h.mu.Lock()
	defer h.mu.Unlock()
	if s.closed {
		return
	}
	s.closed = true
	h.subs = slices.DeleteFunc(h.subs, func(x *Sub) bool { return x == s })
	close(s.C)
}

// TakeLost returns how many events the stream lost since it was last told
// and counts them as told: a reader that drained its stream calls it so
// that a loss is reported even when no event follows it.
func (s *Sub) TakeLost() uint64 {
	s.hub.mu.Lock()
	defer s.hub.mu.Unlock()
	return s.lost.Swap(0)
}

// DroppedNotice is the event that tells a stream it lost n events.
func DroppedNotice(t time.Time, n uint64) Event {
	return Event{Time: t, Source: SourceEvents, Kind: KindDropped, Count: n, Detail: "this stream fell behind and lost events"}
}

// Publish sends e to every subscriber whose filter matches.
func (h *Hub) Publish(e Event) {
	if e.Time.IsZero() {
		e.Time = h.now()
	}
	h.published.Add(1)
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, s := range h.subs {
		if !s.filter.Match(e) {
			continue
		}
		if n := s.lost.Load(); n > 0 {
			select {
			case s.C <- DroppedNotice(e.Time, n):
				s.lost.Store(0)
			default:
				s.lost.Add(1)
				h.lost.Add(1)
				continue
			}
		}
		select {
		case s.C <- e:
		default:
			s.lost.Add(1)
			h.lost.Add(1)
		}
	}
}

// Stats are the hub's counters.
type Stats struct {
	Published   uint64 `json:"published"`
	Lost        uint64 `json:"lost"` // deliveries dropped for slow subscribers
	Subscribers int    `json:"subscribers"`
}

// Stats reads the counters.
func (h *Hub) Stats() Stats {
	h.mu.Lock()
	n := len(h.subs)
	h.mu.Unlock()
	return Stats{Published: h.published.Load(), Lost: h.lost.Load(), Subscribers: n}
}
