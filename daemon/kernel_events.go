// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"fmt"
	"maps"
	"net/netip"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/events"
	"github.com/fairshare-dev/fairshare/loader"
)

// setDryRun puts a project in dry-run in the kernel, or back (written at
// once, and again at each tick for projects whose cgroup came later).
func (k *kernelSide) setDryRun(project string, on bool) {
	k.mu.Lock()
	if on {
		k.dry[project] = true
	} else {
		delete(k.dry, project)
	}
	k.mu.Unlock()
	k.syncDryRun()
}

func (k *kernelSide) syncDryRun() {
	k.syncMu.Lock()
	defer k.syncMu.Unlock()
	k.mu.Lock()
	dry := maps.Clone(k.dry)
	k.mu.Unlock()
	if err := k.lim.SetDryRunProjects(dry); err != nil {
		k.log.Error("dry-run projects not written into the bpf maps: the kernel enforces them", "err", err)
	}
}

// readRefusals feeds the programs' refusal events into the sink until ctx
// ends. Events are for diagnosis: a reader that fails is logged, and the
// daemon goes on enforcing.
func (k *kernelSide) readRefusals(ctx context.Context, sink *eventSink) error {
	err := k.lim.ReadRefusals(ctx, func(r loader.Refusal) { sink.publish(kernelEvent(r)) })
	if err != nil {
		k.log.Error("kernel refusal events are not read: 'fairshare events' shows none from the kernel; the counters in /metrics still count", "err", err)
	}
	return nil
}

// kernelEvent is a refusal of the programs as an event.
func kernelEvent(r loader.Refusal) events.Event {
	e := events.Event{Time: r.Time, Source: events.SourceKernel, Kind: events.KindRefused, Pool: config.PoolConnections,
		Project: r.Project, Reason: r.Reason, Direction: r.Direction,
		Local: addrText(r.Local), Remote: addrText(r.Remote),
		Held: int(r.Held), InUse: int(r.InUse), Share: int(r.Share), PoolSize: int(r.Pool)}
	if e.Project == "" {
		e.Project = fmt.Sprintf("#%d", r.CgroupID) // its cgroup is gone
	}
	if r.DestPool != "" {
		e.Pool = r.DestPool // a destination pool refused (its numbers)
	}
	switch {
	case r.Lapsed:
		e.Kind = events.KindLapsed
		e.Detail = "admitted: enforcement lapsed, no daemon renewed its heartbeat within connections.lapse_after"
	case r.Would:
		e.Kind = events.KindWouldRefuse
	case r.Reason == loader.ReasonRateLimited:
		e.Kind = events.KindRateLimited
	}
	return e
}

// addrText is an end of a connection, "" while unset (a connect's local
// side before the kernel picks it).
func addrText(a netip.AddrPort) string {
	if !a.IsValid() || a.Port() == 0 && a.Addr().IsUnspecified() {
		return ""
	}
	return a.String()
}

// refusalStats reads the programs' event counters: the would-be refusals
// per project for Status, and the events dropped since the last read for
// the sink's dropped notices.
func (k *kernelSide) refusalStats() (map[string]uint64, error) {
	sink := k.events
	st, err := k.lim.RefusalStats()
	if err != nil {
		return nil, err
	}
	would := map[string]uint64{}
	k.mu.Lock()
	defer k.mu.Unlock()
	for id, p := range st.Projects {
		name := p.Project
		if name == "" {
			name = fmt.Sprintf("#%d", id)
		}
		would[name] = p.Would
		if last := k.dropped[id]; p.Dropped > last {
			sink.countKernelDropped(name, p.Dropped-last)
		}
		k.dropped[id] = p.Dropped
	}
	if st.Lost > k.lost {
		sink.countKernelDropped("", st.Lost-k.lost)
		k.lost = st.Lost
	}
	return would, nil
}

// withWould adds dry-run to the kernel's pool: the pool's setting, the
// projects', and the would-be refusals (the pool's are the sum over its
// projects, so the rows add up).
func withWould(p admin.Pool, would map[string]uint64, dryPool bool, dry map[string]bool) admin.Pool {
	p.DryRun = dryPool
	for i := range p.Projects {
		pr := &p.Projects[i]
		pr.WouldRefuse = would[pr.Project]
		pr.DryRun = dry[pr.Project]
		p.WouldRefuse += pr.WouldRefuse
	}
	return p
}
