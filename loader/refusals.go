// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"
)

// Refusal is one refusal event of the programs (bpf/lib/events.h): a
// connect or a SYN refused, or admitted in dry-run (Would).
type Refusal struct {
	Project   string // the project's directory under the root; "" if gone
	CgroupID  uint64
	Time      time.Time
	Direction string // "connect" or "syn"
	// Local and Remote are the connection's ends; at connect the local
	// side is unset unless the socket was bound.
	Local, Remote netip.AddrPort
	// The rule's inputs at the decision: the project's permits, the
	// node's, the share (for ReasonFloor, the one beside one more
	// project, which the SYN was judged by) and POOL.
	Held, InUse int64
	Share, Pool uint32
	// Reason is one of ReasonOverShare, ReasonPoolFull, ReasonFloor,
	// ReasonExemptBudget, ReasonRateLimited, ReasonFleetCap (Share is then
	// the cap).
	Reason string
	// Would is set for a refusal dry-run admitted.
	Would bool
	// Lapsed is set (with Would) for a refusal admitted because
	// enforcement had lapsed: no daemon renewed its heartbeat within
	// Options.LapseAfter.
	Lapsed bool
	// DestPool names the destination pool that refused (dest.go); "" is
	// the node's connections pool. Held, InUse, Share and Pool are then
	// the destination pool's.
	DestPool string
}

// Reasons of a Refusal (the names package events uses).
const (
	ReasonOverShare    = "share"
	ReasonPoolFull     = "pool_full"
	ReasonExemptBudget = "exempt_budget"
	ReasonRateLimited  = "rate_limited"
	// ReasonFloor refuses an inbound connection of a project under its
	// share but not under the one it would have beside one more project,
	// while the pool is full to the floor: handshakes leave the last floor
	// to newcomers (see "Handshakes in flight" in the package doc).
	ReasonFloor = "floor"
	// ReasonFleetCap refuses a project that holds its fleet cap in the
	// pool (SetCaps): the node's part of its fleet allocation.
	ReasonFleetCap = "fleet_cap"
	// ReasonFleetSafe refuses in a fleet pool held to its safe slice: its
	// lease ended with no daemon to renew it (or cut off from etcd), and
	// the other nodes may have taken this one's part (fleetsafe.go).
	ReasonFleetSafe = "fleet_safe"
)

// reasonNames are enum fs_reason's names, by value.
var reasonNames = map[uint8]string{1: ReasonOverShare, 2: ReasonPoolFull, 3: ReasonExemptBudget, 4: ReasonRateLimited, 5: ReasonFloor, 6: ReasonFleetCap, 7: ReasonFleetSafe}

// fsEvWould is FS_EV_WOULD, fsEvLapsed FS_EV_LAPSED.
const (
	fsEvWould  = 1
	fsEvLapsed = 4
)

// eventSize is sizeof(struct fs_event), checked by a test.
const eventSize = 88

// SetEvents sets the bound of refusal events per project and second (0
// writes none) and the pool's dry-run: while on, the programs admit what
// the rule refuses and count it as would-refuse.
func (l *Limiter) SetEvents(perSec uint32, dryRun bool) error {
	return l.setEvents(EventSettings{PerSec: perSec, DryRun: dryRun})
}

// EventSettings are the refusal events' bound and the pool's dry-run, as
// SetEvents writes them (Options.Events).
type EventSettings struct {
	// PerSec bounds the events each project writes a second; 0 writes
	// none.
	PerSec uint32
	// DryRun puts the pool in dry-run: the programs admit what the rule
	// refuses, and count it.
	DryRun bool
}

func (l *Limiter) setEvents(e EventSettings) error {
	perSec, dryRun := e.PerSec, e.DryRun
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return ErrClosed
	}
	c := limiterFsEvcfg{PerSec: perSec}
	if dryRun {
		c.DryRun = 1
	}
	if err := l.objs.FsEvConfig.Put(uint32(0), &c); err != nil {
		return fmt.Errorf("writing fs_ev_config: %w", err)
	}
	return nil
}

// SetDryRunProjects puts exactly the named projects (directories under the
// root) in dry-run: the programs admit what the rule refuses them. A name
// without a directory yet is skipped; call it again (the control loop does,
// each tick) to catch projects created since.
func (l *Limiter) SetDryRunProjects(names map[string]bool) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return ErrClosed
	}
	want := map[uint64]bool{}
	for name := range names {
		id, err := l.projectID(name)
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				continue
			}
			return fmt.Errorf("project %s: %w", name, err)
		}
		want[id] = true
	}
	var id uint64
	var v uint32
	var stale []uint64
	it := l.objs.FsDryrun.Iterate()
	for it.Next(&id, &v) {
		if !want[id] {
			stale = append(stale, id)
		}
		delete(want, id)
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("reading fs_dryrun: %w", err)
	}
	for _, id := range stale {
		if err := l.objs.FsDryrun.Delete(id); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("writing fs_dryrun: %w", err)
		}
	}
	for id := range want {
		if err := l.objs.FsDryrun.Put(id, uint32(1)); err != nil {
			return fmt.Errorf("writing fs_dryrun: %w", err)
		}
	}
	return nil
}

// RefusalStats are the counters of the refusal events.
type RefusalStats struct {
	Emitted uint64 // events written
	Dropped uint64 // over a project's bound per second
	Lost    uint64 // the ring buffer was full
	// WouldOut and WouldIn count connects and SYNs dry-run admitted.
	WouldOut, WouldIn uint64
	// Projects are the per-project counts by cgroup id (of the projects
	// refused lately).
	Projects map[uint64]ProjectRefusals
}

// ProjectRefusals are one project's refusal counts.
type ProjectRefusals struct {
	Project        string // its directory under the root; "" if gone
	Dropped, Would uint64
}

// RefusalStats reads the counters.
func (l *Limiter) RefusalStats() (RefusalStats, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return RefusalStats{}, ErrClosed
	}
	var per []limiterFsEvstats
	if err := l.objs.FsEvStats.Lookup(uint32(0), &per); err != nil {
		return RefusalStats{}, fmt.Errorf("reading fs_ev_stats: %w", err)
	}
	var s RefusalStats
	for _, c := range per {
		s.Emitted += c.Emitted
		s.Dropped += c.Dropped
		s.Lost += c.Lost
		s.WouldOut += c.WouldOut
		s.WouldIn += c.WouldIn
	}
	s.Projects = map[uint64]ProjectRefusals{}
	var id uint64
	var v limiterFsEvproj
	it := l.objs.FsEvProjects.Iterate()
	for it.Next(&id, &v) {
		s.Projects[id] = ProjectRefusals{Dropped: v.Dropped, Would: v.Would}
	}
	if err := it.Err(); err != nil {
		return RefusalStats{}, fmt.Errorf("reading fs_ev_projects: %w", err)
	}
	if len(s.Projects) > 0 {
		names, err := l.projectNames()
		if err != nil {
			return RefusalStats{}, err
		}
		for id, p := range s.Projects {
			p.Project = names[id]
			s.Projects[id] = p
		}
	}
	return s, nil
}

// ReadRefusals reads the programs' refusal events until ctx ends, calling
// fn for each in the order they were written. It is the one reader of the
// ring buffer: call it once.
func (l *Limiter) ReadRefusals(ctx context.Context, fn func(Refusal)) error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return ErrClosed
	}
	rd, err := ringbuf.NewReader(l.objs.FsEvents)
	l.mu.Unlock()
	if err != nil {
		return fmt.Errorf("opening the refusal events ring buffer: %w", err)
	}
	var once sync.Once
	stop := context.AfterFunc(ctx, func() { once.Do(func() { rd.Close() }) })
	defer stop()
	defer once.Do(func() { rd.Close() })
	names := newNameCache(l)
	var rec ringbuf.Record
	for {
		if err := rd.ReadInto(&rec); err != nil {
			if errors.Is(err, ringbuf.ErrClosed) || ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("reading refusal events: %w", err)
		}
		var ev limiterFsEvent
		if err := binary.Read(bytes.NewReader(rec.RawSample), binary.NativeEndian, &ev); err != nil {
			continue // a short record: not ours to crash on
		}
		fn(l.refusal(&ev, names))
	}
}

func (l *Limiter) refusal(ev *limiterFsEvent, names *nameCache) Refusal {
	r := Refusal{
		Project: names.name(ev.Project), CgroupID: ev.Project,
		Time: monoToWall(l.mono(), ev.TimeNs),
		Held: ev.Held, InUse: ev.InUse, Share: ev.Share, Pool: ev.Pool,
		Would: ev.Flags&fsEvWould != 0, Lapsed: ev.Flags&fsEvLapsed != 0, Reason: reasonNames[ev.Reason],
		Local:  netip.AddrPortFrom(netip.AddrFrom16(ev.Tuple.Laddr).Unmap(), ev.Tuple.Lport),
		Remote: netip.AddrPortFrom(netip.AddrFrom16(ev.Tuple.Raddr).Unmap(), ev.Tuple.Rport),
	}
	if r.Reason == "" {
		r.Reason = fmt.Sprintf("reason_%d", ev.Reason)
	}
	if ev.Dest != 0 {
		if r.DestPool = l.DestPoolName(ev.Dest); r.DestPool == "" {
			r.DestPool = unnamedDestPool(ev.Dest)
		}
	}
	switch ev.Dir {
	case 1:
		r.Direction = "connect"
	case 2:
		r.Direction = "syn"
	}
	return r
}

// monoToWall turns a CLOCK_MONOTONIC stamp into wall time, by its age.
func monoToWall(monoNow, stamp uint64) time.Time {
	now := time.Now()
	if stamp == 0 || stamp > monoNow {
		return now
	}
	return now.Add(-time.Duration(monoNow - stamp))
}

// nameCache names projects by cgroup id. An id it does not know makes it
// read the root again, once a second at most for that id (a removed
// project's events are bounded per second by the programs anyway).
type nameCache struct {
	l       *Limiter
	names   map[uint64]string
	missing map[uint64]time.Time // ids not found, and when they were last looked for
}

func newNameCache(l *Limiter) *nameCache {
	return &nameCache{l: l, missing: map[uint64]time.Time{}}
}

func (c *nameCache) name(id uint64) string {
	if n, ok := c.names[id]; ok {
		return n
	}
	if t, ok := c.missing[id]; ok && time.Since(t) < time.Second {
		return ""
	}
	if names, err := c.l.projectNames(); err == nil {
		c.names = names
	}
	if n, ok := c.names[id]; ok {
		delete(c.missing, id)
		return n
	}
	if len(c.missing) > 4096 {
		clear(c.missing)
	}
	c.missing[id] = time.Now()
	return ""
}
