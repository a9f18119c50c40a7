// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"fmt"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/pools"
)

// pool is one pool as the control loop and Status see it, whoever enforces
// it: a user-space pool (userPool, residentsPool), the kernel's connections
// pool (kernelSide) or that pool with the kernel side off (offPool).
type pool interface {
	name() string
	// recompute settles the pool's active set and share at now (a
	// user-space pool reads its own clock).
	recompute(now time.Time) error
	// status reads the pool as one snapshot whose rows add up.
	status() (admin.Pool, error)
}

// userPool is a user-space pool of package pools.
type userPool struct{ p *pools.Pool }

func (u userPool) name() string                { return u.p.Name() }
func (u userPool) recompute(time.Time) error   { u.p.Recompute(); return nil }
func (u userPool) status() (admin.Pool, error) { return fromPool(u.p.Snapshot(), nil), nil }

// residentsPool is the residents pool.
type residentsPool struct{ r *pools.Residents }

func (r residentsPool) name() string              { return config.PoolResidents }
func (r residentsPool) recompute(time.Time) error { r.r.Recompute(); return nil }
func (r residentsPool) status() (admin.Pool, error) {
	rs := r.r.Snapshot()
	return fromPool(rs.Snapshot, &rs), nil
}

// offPool is the connections pool when the kernel side is off: configured,
// not enforced.
type offPool struct{ c config.Pool }

func (o offPool) name() string              { return config.PoolConnections }
func (o offPool) recompute(time.Time) error { return nil }
func (o offPool) status() (admin.Pool, error) {
	return admin.Pool{Name: config.PoolConnections, Enforcer: "off", Size: o.c.Size,
		Floor: pools.EffectiveFloor(o.c.Size, o.c.Floor), Share: o.c.Size, Projects: []admin.Project{}}, nil
}

// buildPools builds the user-space pools of cfg: requests for the front,
// residents, flights and the extra pools for the permit API. With the
// connections pool (the kernel's, or offPool), they are d.pools, by name
// (PoolNames' order).
func (d *Daemon) buildPools() error {
	var err error
	for _, name := range d.cfg.PoolNames() {
		pc := d.cfg.Pools[name]
		if pc.IsDestination() {
			continue // the kernel side's (dests.go)
		}
		pcfg := pools.Config{Name: name, Size: pc.Size, Floor: pc.Floor, Window: pc.Window}
		switch name {
		case config.PoolConnections:
			// New puts the kernel side here once it is open.
			d.connectionsAt = len(d.pools)
			d.pools = append(d.pools, offPool{pc})
			continue
		case config.PoolResidents:
			d.residents, err = pools.NewResidents(pcfg, d.opts.Clock)
			if err == nil {
				d.pools = append(d.pools, residentsPool{d.residents})
			}
		default:
			var p *pools.Pool
			p, err = pools.New(pcfg, d.opts.Clock)
			if err == nil {
				p.SetDryRun("", !pc.Enforced())
				d.pools = append(d.pools, userPool{p})
			}
			if name == config.PoolRequests {
				d.requests = p
			} else {
				d.others[name] = p
			}
		}
		if err != nil {
			return fmt.Errorf("pool %s: %w", name, err)
		}
	}
	return nil
}

func fromPool(s pools.Snapshot, rs *pools.ResidentsSnapshot) admin.Pool {
	p := admin.Pool{Name: s.Name, Enforcer: "daemon", Size: s.Size, Floor: s.Floor, InUse: s.InUse,
		Active: s.Active, Share: s.Share, Projects: []admin.Project{}}
	for _, ps := range s.Projects {
		ap := admin.Project{Project: ps.Project, Held: ps.Held, Admitted: ps.Admitted, Refused: ps.Refused,
			WouldRefuse: ps.WouldRefuse, DryRun: ps.DryRun, Active: ps.Active, LastSeen: ps.LastSeen}
		if rs != nil {
			ap.Sleeping = rs.Sleeping[ps.Project]
			ap.Evictions = rs.Evictions[ps.Project]
		}
		p.Projects = append(p.Projects, ap)
	}
	// The pool's own totals, the sums over the projects plus the forgotten
	// ones' (one snapshot, under the pool's lock).
	p.Admitted, p.Refused, p.WouldRefuse, p.DryRun = s.Admitted, s.Refused, s.WouldRefuse, s.DryRun
	p.Forgotten = admin.Forgotten{Projects: s.Forgotten.Projects, Admitted: s.Forgotten.Admitted, Refused: s.Forgotten.Refused,
		WouldRefuse: s.Forgotten.WouldRefuse}
	return p
}
