// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"crypto/tls"
	"fmt"
	"os"
	"sort"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/events"
	"github.com/fairshare-dev/fairshare/fleet"
	"github.com/fairshare-dev/fairshare/loader"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// fleetSide is the daemon's part in the fleet pools: one etcd client and
// one fleet.Member per pool marked fleet: true.
type fleetSide struct {
	client  *clientv3.Client
	node    string
	members map[string]*fleet.Member // by pool name
}

// buildFleet connects the fleet pools of the config (none: nothing). The
// etcd client dials lazily: an etcd that is not there yet is the Members'
// "waiting for etcd", not an error.
func (d *Daemon) buildFleet() error {
	names := d.cfg.FleetPools()
	if len(names) == 0 {
		return nil
	}
	fc := d.cfg.Fleet
	node := fc.Node
	if node == "" {
		h, err := os.Hostname()
		if err != nil {
			return fmt.Errorf("fleet.node is empty and the host name cannot be read: %w", err)
		}
		node = h
	}
	var tc *tls.Config
	if fc.TLS.CA != "" || fc.TLS.Cert != "" {
		info := transport.TLSInfo{TrustedCAFile: fc.TLS.CA, CertFile: fc.TLS.Cert, KeyFile: fc.TLS.Key}
		var err error
		if tc, err = info.ClientConfig(); err != nil {
			return fmt.Errorf("fleet.tls: %w", err)
		}
	}
	client, err := clientv3.New(clientv3.Config{Endpoints: fc.Etcd, DialTimeout: 2 * time.Second, TLS: tc,
		Logger: zap.NewNop(), DialKeepAliveTime: 5 * time.Second, DialKeepAliveTimeout: 2 * time.Second})
	if err != nil {
		return fmt.Errorf("fleet.etcd: %w", err)
	}
	f := &fleetSide{client: client, node: node, members: map[string]*fleet.Member{}}
	d.fleet = f
	log := d.log.With("part", "fleet")
	var pinned map[string]int
	if d.cfg.BPF {
		// Before the kernel side opens: it may not get as far as setting
		// its own (loader.PinnedFleetSafes).
		var err error
		if pinned, err = loader.PinnedFleetSafes(d.cfg.PinDir); err != nil {
			log.Warn("fleet: reading the safe slices the pins kept", "err", err)
		}
	}
	for _, name := range names {
		pc := d.cfg.Pools[name]
		var target fleet.Target
		var source fleet.Source
		switch {
		case name == config.PoolConnections:
			kt := kernelFleet{d}
			target, source = kt, kt
		case pc.IsDestination():
			dt := destFleet{d: d, name: name}
			target, source = dt, dt
		case name == config.PoolRequests:
			pt := fleet.PoolTarget{Pool: d.requests}
			target, source = pt, pt
		default:
			pt := fleet.PoolTarget{Pool: d.others[name]}
			target, source = pt, pt
		}
		mc := memberConfig(fc, name, pc, node, d.cfg.Connections.LapseAfter)
		mc.Client, mc.Target, mc.Source, mc.Log, mc.Clock, mc.OnState = client, target, source, log, d.opts.Clock, d.fleetState
		// A kernel pool's pins keep the safe slice the last run gave it:
		// the Member starts at no more than that (fleet.Config.LastSafe).
		// A user-space pool has nothing of the last run: it starts at the
		// floor (or size × safe_fraction).
		pinKey := name
		if name == config.PoolConnections {
			pinKey = ""
		}
		if n, ok := pinned[pinKey]; ok && (pc.IsDestination() || name == config.PoolConnections) {
			mc.LastSafe, mc.HasLastSafe = n, true
		}
		m, err := fleet.New(mc)
		if err != nil {
			return err
		}
		f.members[name] = m
		// The pool starts at the Member's safe slice rather than at the
		// fleet's size: until its first computation a node knows nothing
		// of the others, and the fleet's size on every node would let the
		// fleet hold nodes × size. The kernel side, opened after this,
		// opens its pools there; a user-space pool is resized here, as the
		// front and the permit API serve before the Members run (a
		// restart's backlog would be admitted at the fleet's size).
		safe := m.Status().Safe
		if mc.HasLastSafe {
			log.Info("fleet pool starts at no more than the safe slice its pins kept", "pool", name, "pinned_safe", mc.LastSafe, "safe", safe)
		}
		if pc.IsDestination() || name == config.PoolConnections {
			d.fleetSizes[name] = safe
		} else if err := target.SetSize(safe); err != nil {
			return fmt.Errorf("pool %s: %w", name, err)
		}
	}
	log.Info("fleet pools", "pools", names, "node", node, "prefix", fc.Prefix, "etcd", fc.Etcd)
	return nil
}

// fleetState turns a Member's change of state into an event.
func (d *Daemon) fleetState(s fleet.Status) {
	d.events.publish(events.Event{Time: time.Now(), Source: "daemon", Kind: events.KindFleet, Pool: s.Pool,
		Reason: s.State, PoolSize: s.Allotment, Share: s.Share,
		Detail: fmt.Sprintf("node %s: allotment %d of the fleet's %d, safe slice %d, %d nodes last seen", s.Node, s.Allotment, s.Size, s.Safe, s.Nodes)})
}

// run runs every Member until ctx ends.
func (f *fleetSide) run(ctx context.Context) error {
	done := make(chan struct{}, len(f.members))
	for _, m := range f.members {
		go func() { _ = m.Run(ctx); done <- struct{}{} }()
	}
	for range f.members {
		<-done
	}
	return nil
}

func (f *fleetSide) close() error { return f.client.Close() }

// status is the fleet view of pool name, nil when it is not a fleet pool.
func (f *fleetSide) status(name string) *admin.Fleet {
	if f == nil {
		return nil
	}
	m, ok := f.members[name]
	if !ok {
		return nil
	}
	s := m.Status()
	out := &admin.Fleet{Node: s.Node, State: s.State, Since: s.Since, Size: s.Size, Floor: s.Floor, Active: s.Active,
		Share: s.Share, Allotment: s.Allotment, Spare: s.Spare, Safe: s.Safe, Nodes: s.Nodes, Writes: s.Writes,
		Projects: make([]admin.FleetProject, 0, len(s.Projects))}
	for p, ps := range s.Projects {
		out.Projects = append(out.Projects, admin.FleetProject{Project: p, Alloc: ps.Alloc, FleetHeld: ps.FleetHeld,
			Nodes: ps.Nodes, Cap: ps.Cap, Held: ps.Held})
	}
	sort.Slice(out.Projects, func(i, j int) bool { return out.Projects[i].Project < out.Projects[j].Project })
	return out
}

// kernelFleet drives the kernel's connections pool: the allotment moves
// its POOL (loader.SetPool) and the caps are the projects' fleet caps in
// the kernel (loader.SetCaps; see package fleet, Locally).
// It reads the daemon's kernel side when used, as the fleet is built
// before the kernel side (which a start builds last) and runs after it.
type kernelFleet struct{ d *Daemon }

func (kf kernelFleet) SetSize(size int) error { return kf.d.kernel.lim.SetPool(uint32(size), 0) }

func (kf kernelFleet) SetCaps(caps map[string]int, others int) error {
	return kf.d.kernel.lim.SetCaps("", caps, others)
}

// SetSafe is the slice the programs hold the pool to once its lease has
// ended with no daemon to renew it (loader.SetFleetSafe): the other nodes
// may have taken this one's part back by then.
func (kf kernelFleet) SetSafe(safe int, leaseEnd time.Time) error {
	return kf.d.kernel.lim.SetFleetSafe("", uint32(safe), leaseEnd, kf.d.fleetLease())
}

func (kf kernelFleet) Usage() (map[string]fleet.Usage, error) {
	s, err := kf.d.kernel.lim.Snapshot()
	if err != nil {
		return nil, fmt.Errorf("reading the bpf maps: %w", err)
	}
	out := make(map[string]fleet.Usage, len(s.Projects))
	for _, p := range s.Projects {
		if p.Project == "" {
			continue
		}
		u := out[p.Project]
		u.Held += p.InUse
		u.Refused += p.Refused
		u.Active = u.Active || p.Active
		out[p.Project] = u
	}
	return out, nil
}

// destFleet drives a destination pool marked fleet: true: the allotment is
// the pool's size in the kernel (loader.SetDestPoolSize, with the default
// floor of it) and the caps the projects' fleet caps in it (loader.SetCaps),
// as kernelFleet does for the connections pool. It reads the daemon's
// kernel side when used, as kernelFleet does.
type destFleet struct {
	d    *Daemon
	name string
}

func (t destFleet) SetSize(size int) error {
	t.d.destMu.Lock()
	defer t.d.destMu.Unlock()
	if t.d.kernel == nil {
		return fmt.Errorf("destination pool %s: the kernel side is not open", t.name)
	}
	if err := t.d.kernel.lim.SetDestPoolSize(t.name, uint32(size)); err != nil {
		return err
	}
	t.d.fleetSizes[t.name] = size
	return nil
}

// SetSafe is kernelFleet.SetSafe for the destination pool.
func (t destFleet) SetSafe(safe int, leaseEnd time.Time) error {
	t.d.destMu.Lock()
	defer t.d.destMu.Unlock()
	if t.d.kernel == nil {
		return fmt.Errorf("destination pool %s: the kernel side is not open", t.name)
	}
	return t.d.kernel.lim.SetFleetSafe(t.name, uint32(safe), leaseEnd, t.d.fleetLease())
}

func (t destFleet) SetCaps(caps map[string]int, others int) error {
	if t.d.kernel == nil {
		return fmt.Errorf("destination pool %s: the kernel side is not open", t.name)
	}
	return t.d.kernel.lim.SetCaps(t.name, caps, others)
}

// Usage reads the pool's projects from the destination pool's counters:
// what each holds and was refused there, and whether it is active there.
func (t destFleet) Usage() (map[string]fleet.Usage, error) {
	if t.d.kernel == nil {
		return nil, fmt.Errorf("destination pool %s: the kernel side is not open", t.name)
	}
	s, err := t.d.kernel.lim.Snapshot()
	if err != nil {
		return nil, fmt.Errorf("reading the bpf maps: %w", err)
	}
	out := map[string]fleet.Usage{}
	for _, dp := range s.Dests {
		if dp.Name != t.name {
			continue
		}
		for _, p := range dp.Projects {
			if p.Project == "" {
				continue
			}
			u := out[p.Project]
			u.Held += p.InUse
			u.Refused += p.Refused
			u.Active = u.Active || p.Active
			out[p.Project] = u
		}
	}
	return out, nil
}

// fleetLease is the fleet's lease_ttl as the Members take it.
func (d *Daemon) fleetLease() time.Duration {
	if d.cfg.Fleet.LeaseTTL > 0 {
		return d.cfg.Fleet.LeaseTTL
	}
	return fleet.DefaultLeaseTTL
}

// memberConfig is what the configuration says of fleet pool name's Member:
// its keys, the fleet's size and floor, the safe fraction, the lease and
// the period; for a kernel pool (connections, a destination pool), how
// long a departed node's holdings stay counted: lapseAfter
// (connections.lapse_after), the time its kernel enforces without a
// daemon (0, for ever: the fleet's default, fleet.DefaultDepartedTTL,
// bounds it). A user-space pool's target is no Safer: it writes no record.
func memberConfig(fc config.Fleet, name string, pc config.Pool, node string, lapseAfter time.Duration) fleet.Config {
	c := fleet.Config{Prefix: fc.Prefix, Pool: name, Node: node, Size: pc.Size, Floor: pc.Floor,
		SafeFraction: fc.SafeFraction, LeaseTTL: fc.LeaseTTL, Period: fc.Period}
	if name == config.PoolConnections || pc.IsDestination() {
		c.DepartedTTL = lapseAfter
	}
	return c
}
