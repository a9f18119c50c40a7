// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"errors"
	"fmt"
	"maps"
	"reflect"
	"sort"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/loader"
	"github.com/fairshare-dev/fairshare/pools"
	"go.yaml.in/yaml/v3"
)

// Destination pools (docs/destination-pools.md): pools of the configuration
// with destinations, enforced by the kernel side beside the connections
// pool. The loader keeps them (SetDestPools); its Tick settles their active
// sets with the connections pool's, so they are not in d.pools: Status
// reads them from the maps (DestPools) after the others.

// destPoolsOf is the loader's form of cfg's destination pools. A pool
// named in sizes (a fleet pool) gets that size, its allotment, and the
// default floor of it: its configured size and floor are the fleet's.
func destPoolsOf(cfg config.Config, sizes map[string]int) ([]loader.DestPool, error) {
	dests, err := cfg.DestPools()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", config.ErrInvalid, err)
	}
	out := make([]loader.DestPool, 0, len(dests))
	for _, name := range cfg.PoolNames() {
		ds, ok := dests[name]
		if !ok {
			continue
		}
		p := cfg.Pools[name]
		dp := loader.DestPool{Name: name, Size: uint32(p.Size), Floor: uint32(p.Floor), Window: p.Window,
			DryRun: !p.Enforced(), Fleet: p.Fleet, Destinations: ds}
		if n, ok := sizes[name]; ok {
			dp.Size, dp.Floor = uint32(n), 0
		}
		out = append(out, dp)
	}
	return out, nil
}

// DestPools are the destination pools of snapshot s as status shows them:
// InUse and the totals are the sums over the projects of that read, so the
// rows add up. Dry-run admissions are counted per pool only (the kernel
// keeps no per-project count of them in a destination pool): they are
// under Forgotten.WouldRefuse.
func DestPools(s loader.Snapshot) []admin.Pool {
	out := make([]admin.Pool, 0, len(s.Dests))
	for _, d := range s.Dests {
		p := admin.Pool{Name: d.Name, Enforcer: "kernel", Size: d.Size, Floor: d.Floor, Active: d.KernelActive,
			Share: pools.Share(d.Size, d.Floor, d.KernelActive), Projects: []admin.Project{},
			Destinations: d.Destinations, Removed: d.Removed, DryRun: d.DryRun, WouldRefuse: d.Would,
			Forgotten: admin.Forgotten{WouldRefuse: d.Would}}
		for _, pc := range d.Projects {
			name := pc.Project
			if name == "" {
				name = fmt.Sprintf("#%d", pc.ID)
			}
			p.Projects = append(p.Projects, admin.Project{Project: name, Held: pc.InUse, Admitted: pc.Admitted,
				Refused: pc.Refused, Active: pc.Active})
			p.InUse += pc.InUse
			p.Admitted += pc.Admitted
			p.Refused += pc.Refused
		}
		out = append(out, p)
	}
	return out
}

// offDestPools are cfg's destination pools with the kernel side off:
// configured, not enforced.
func offDestPools(cfg config.Config) []admin.Pool {
	var out []admin.Pool
	for _, name := range cfg.PoolNames() {
		pc := cfg.Pools[name]
		if !pc.IsDestination() {
			continue
		}
		out = append(out, admin.Pool{Name: name, Enforcer: "off", Size: pc.Size, Floor: pools.EffectiveFloor(pc.Size, pc.Floor),
			Share: pc.Size, Projects: []admin.Project{}, Destinations: pc.Destinations})
	}
	return out
}

// destStatus adds the destination pools to a status's pools, in name order.
func (d *Daemon) destStatus(st *admin.Status) error {
	if d.kernel == nil {
		d.mu.Lock()
		cfg := config.Config{Pools: d.destCfg}
		d.mu.Unlock()
		st.Pools = append(st.Pools, offDestPools(cfg)...)
	} else {
		s, err := d.kernel.lim.Snapshot()
		if err != nil {
			return fmt.Errorf("reading the bpf maps: %w", err)
		}
		for _, p := range DestPools(s) {
			p.Fleet = d.fleet.status(p.Name)
			st.Pools = append(st.Pools, p)
		}
	}
	sort.SliceStable(st.Pools, func(i, j int) bool { return st.Pools[i].Name < st.Pools[j].Name })
	return nil
}

// errStopping is Reload's answer once the daemon has closed its kernel
// side: nothing is applied, as the daemon is stopping.
var errStopping = errors.New("the daemon is stopping")

// Reload applies cfg, read again from the same sources on SIGHUP: its
// destination pools, at once and keeping their counts (added, resized,
// removed). The rest of the configuration needs a restart; a change to it is
// logged and left. So do the fleet destination pools: their Members are
// made at start, so such a pool keeps the definition it started with (and
// its allotment), and a pool that becomes one is not added (or keeps the
// definition in force, if it was a destination pool). So does a pool
// that changes kind: a destination pool without destinations keeps the
// definition in force, and a pool of another kind given destinations stays
// as it started. A cfg that does not validate, or destination pools the
// kernel side refuses, change nothing.
func (d *Daemon) Reload(cfg config.Config) error {
	read := cfg
	if err := cfg.Validate(); err != nil {
		return err
	}
	if note, raised := config.LapseRaised(read, cfg); raised {
		d.log.Warn("reload: " + note)
	}
	// Resolved as New resolved the configuration it started with (floors,
	// windows, the projects root), so an unchanged file compares equal.
	cfg, _ = Effective(cfg)
	old := d.cfg // the configuration started with: only the destination pools change
	if keys := restartKeys(old, cfg); len(keys) > 0 {
		d.log.Warn("reload: a change to these settings needs a restart; they are not applied", "keys", keys)
	}
	// The fleet destination pools as started, each with its allotment,
	// under destMu until SetDestPools is done: a Member resizing in between
	// would be written over.
	d.destMu.Lock()
	defer d.destMu.Unlock()
	started := config.Config{Pools: map[string]config.Pool{}}
	for _, name := range old.FleetPools() {
		if old.Pools[name].IsDestination() {
			started.Pools[name] = old.Pools[name]
		}
	}
	kept, err := destPoolsOf(started, d.fleetSizes)
	if err != nil {
		return err
	}
	d.mu.Lock()
	inForce := maps.Clone(d.destCfg)
	d.mu.Unlock()
	mine := config.Config{Pools: map[string]config.Pool{}}
	// A pool that changes kind (a destination pool in force whose
	// destinations are gone, a pool of another kind given some) needs a
	// restart: the destination pools are the kernel's, the others
	// user-space ones, made at start. Such a pool keeps what is in force:
	// dropped from the kernel's pools, a destination pool's limit went
	// with it; added to them, a user-space pool was listed twice (and
	// every scrape of /metrics failed on the repeated series).
	changed := map[string]bool{}
	for _, name := range cfg.PoolNames() {
		p := cfg.Pools[name]
		o, dest := inForce[name]
		switch {
		case dest && !p.IsDestination():
			if _, fleet := started.Pools[name]; fleet {
				continue // the fleet's own warning below
			}
			d.log.Warn("reload: making a destination pool a pool of another kind needs a restart; it keeps the definition in force", "pool", name)
			mine.Pools[name], changed[name] = o, true
		case !dest && p.IsDestination():
			if op, ok := old.Pools[name]; ok && !op.IsDestination() {
				d.log.Warn("reload: making a pool a destination pool needs a restart; it is not applied", "pool", name)
				changed[name] = true
			}
		}
	}
	for _, name := range cfg.PoolNames() {
		p := cfg.Pools[name]
		if !p.IsDestination() || changed[name] {
			continue
		}
		if _, ok := started.Pools[name]; ok {
			continue
		}
		if p.Fleet {
			o, ok := inForce[name]
			if !ok {
				d.log.Warn("reload: a new fleet destination pool needs a restart; it is not added", "pool", name)
				continue
			}
			d.log.Warn("reload: making a destination pool a fleet pool needs a restart; it keeps the definition in force", "pool", name)
			p = o
		}
		mine.Pools[name] = p
	}
	for _, name := range started.PoolNames() {
		if p, ok := cfg.Pools[name]; !ok || !reflect.DeepEqual(p, started.Pools[name]) {
			d.log.Warn("reload: a change to a fleet destination pool (or its removal) needs a restart; it keeps the definition it started with",
				"pool", name)
		}
	}
	next, err := destPoolsOf(mine, nil)
	if err != nil {
		return err
	}
	next = append(next, kept...)
	sort.Slice(next, func(i, j int) bool { return next[i].Name < next[j].Name })
	for _, name := range cfg.PoolNames() {
		if cfg.Pools[name].IsDestination() || changed[name] {
			continue
		}
		if o, ok := old.Pools[name]; !ok || o.Size != cfg.Pools[name].Size || o.Floor != cfg.Pools[name].Floor ||
			o.Window != cfg.Pools[name].Window || o.Enforced() != cfg.Pools[name].Enforced() || o.IsDestination() {
			d.log.Warn("reload: a change to a pool that is not a destination pool needs a restart; it is not applied", "pool", name)
		}
	}
	// Under destMu, which closeParts takes to close the kernel side: a
	// SIGHUP that comes as the daemon stops applies to a kernel side
	// still open, or to none.
	if d.kernelClosed {
		return errStopping
	}
	if k := d.kernel; k != nil {
		if err := k.lim.SetDestPools(next); err != nil {
			return fmt.Errorf("%w: %w", config.ErrInvalid, err)
		}
	}
	maps.Copy(mine.Pools, started.Pools)
	d.mu.Lock()
	d.destCfg = mine.Pools
	d.mu.Unlock()
	d.log.Info("reloaded destination pools", "pools", len(next))
	return nil
}

// destOnly is cfg's destination pools.
func destOnly(cfg config.Config) map[string]config.Pool {
	out := map[string]config.Pool{}
	for n, p := range cfg.Pools {
		if p.IsDestination() {
			out[n] = p
		}
	}
	return out
}

// restartKeys lists the settings, as keys of the configuration file
// ("events.per_sec"), on which next differs from old, pools apart (Reload
// applies the destination pools and warns of the others one by one): a
// reload leaves them as they are, and says so rather than let the operator
// believe them applied. Two levels deep: a change below (a route of the
// front) names its section's key ("front.routes").
func restartKeys(old, next config.Config) []string {
	flat := func(c config.Config) map[string]any {
		c.Pools = nil
		b, err := yaml.Marshal(c)
		if err != nil {
			return nil
		}
		var m map[string]any
		if yaml.Unmarshal(b, &m) != nil {
			return nil
		}
		out := map[string]any{}
		for k, v := range m {
			if sub, ok := v.(map[string]any); ok {
				for k2, v2 := range sub {
					out[k+"."+k2] = v2
				}
				continue
			}
			out[k] = v
		}
		return out
	}
	a, b := flat(old), flat(next)
	var keys []string
	for k, v := range a {
		if w, ok := b[k]; !ok || !reflect.DeepEqual(v, w) {
			keys = append(keys, k)
		}
	}
	for k := range b {
		if _, ok := a[k]; !ok {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	return keys
}
