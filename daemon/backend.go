// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"fmt"
	"sort"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/policy"
	"github.com/fairshare-dev/fairshare/pools"
	"github.com/fairshare-dev/fairshare/scheduler"
)

// Status implements admin.Backend: the whole node, read now.
func (d *Daemon) Status(context.Context) (admin.Status, error) {
	st := admin.Status{Version: d.opts.Version, Time: time.Now(), Kernel: d.lim != nil}
	if d.lim != nil {
		s, err := d.lim.Snapshot()
		if err != nil {
			return admin.Status{}, fmt.Errorf("reading the bpf maps: %w", err)
		}
		p := admin.Pool{Name: config.PoolConnections, Enforcer: "kernel", Size: s.Size, Floor: s.Floor,
			InUse: s.InUse, Active: s.Active, Share: s.Share, Admitted: s.Admitted, Refused: s.Refused,
			Projects: []admin.Project{}}
		if len(s.Exempt.Paths) > 0 || s.Exempt.InUse > 0 || s.Exempt.Admitted > 0 {
			p.Exempt = &admin.Exempt{Members: s.Exempt.Paths, Max: s.Exempt.Max, InUse: s.Exempt.InUse,
				Admitted: s.Exempt.Admitted, OverBudget: s.Exempt.OverBudget}
		}
		for _, pc := range s.Projects {
			name := pc.Project
			if name == "" {
				name = fmt.Sprintf("#%d", pc.CgroupID) // its cgroup is gone
			}
			p.Projects = append(p.Projects, admin.Project{Project: name, Held: pc.InUse,
				Admitted: pc.Admitted, Refused: pc.Refused, Active: pc.Active, LastSeen: pc.LastSeen})
		}
		st.Pools = append(st.Pools, p)
	} else {
		c := d.cfg.Pools[config.PoolConnections]
		floor := c.Floor
		if floor == 0 {
			floor = pools.DefaultFloor(c.Size)
		}
		st.Pools = append(st.Pools, admin.Pool{Name: config.PoolConnections, Enforcer: "off", Size: c.Size,
			Floor: floor, Share: c.Size, Projects: []admin.Project{}})
	}
	if d.requests != nil {
		st.Pools = append(st.Pools, fromPool(d.requests.Snapshot(), nil))
	}
	if d.residents != nil {
		rs := d.residents.Snapshot()
		st.Pools = append(st.Pools, fromPool(rs.Snapshot, &rs))
	}
	for _, p := range d.others {
		st.Pools = append(st.Pools, fromPool(p.Snapshot(), nil))
	}
	sort.SliceStable(st.Pools, func(i, j int) bool { return st.Pools[i].Name < st.Pools[j].Name })

	st.Rates = d.rateStatus()
	list, err := d.store.List()
	if err != nil {
		return admin.Status{}, fmt.Errorf("reading the policy store: %w", err)
	}
	st.Policies = list
	if st.Policies == nil {
		st.Policies = []admin.Entry{}
	}
	st.DefaultPolicy = d.defPolicy
	ss := d.sched.Snapshot()
	sch := &admin.Scheduler{InFlight: ss.InFlight, Dispatched: classes(ss.Dispatched),
		Participants: []admin.Participant{},
		Wait:         admin.Histogram{Bounds: ss.Wait.Bounds, Counts: ss.Wait.Counts, Count: ss.Wait.Count, Sum: ss.Wait.Sum}}
	for _, p := range ss.Participants {
		ap := admin.Participant{Participant: p.Participant, Tier: p.Policy.Tier.String(), Shares: p.Policy.Shares,
			Queue: p.Queue, P1: p.P1, P2: p.P2, Dispatched: classes(p.Dispatched)}
		if p.LastClass != 0 {
			ap.LastClass = p.LastClass.String()
		}
		sch.Participants = append(sch.Participants, ap)
	}
	st.Scheduler = sch
	return st, nil
}

// rateStatus lists every project with rate buckets, and those whose buckets
// were deleted, with refusals counted over both (so they never go down).
func (d *Daemon) rateStatus() []admin.Rate {
	d.mu.Lock()
	rs := d.rates.Snapshot()
	gone := make(map[string]uint64, len(d.limitedGone))
	for k, v := range d.limitedGone {
		gone[k] = v
	}
	d.mu.Unlock()
	out := make([]admin.Rate, 0, len(rs)+len(gone))
	for _, r := range rs {
		out = append(out, admin.Rate{Project: r.Project, RequestsPerSec: r.Limits.RequestsPerSec,
			WorkPerSec: r.Limits.WorkPerSec, RequestTokens: r.RequestTokens, WorkTokens: r.WorkTokens,
			Limited: r.Limited + gone[r.Project]})
		delete(gone, r.Project)
	}
	for project, n := range gone {
		out = append(out, admin.Rate{Project: project, Limited: n})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Project < out[j].Project })
	return out
}

func classes(c [4]uint64) map[string]uint64 {
	return map[string]uint64{scheduler.P1.String(): c[1], scheduler.P2.String(): c[2], scheduler.P3.String(): c[3]}
}

func fromPool(s pools.Snapshot, rs *pools.ResidentsSnapshot) admin.Pool {
	p := admin.Pool{Name: s.Name, Enforcer: "daemon", Size: s.Size, Floor: s.Floor, InUse: s.InUse,
		Active: s.Active, Share: s.Share, Projects: []admin.Project{}}
	for _, ps := range s.Projects {
		ap := admin.Project{Project: ps.Project, Held: ps.Held, Admitted: ps.Admitted, Refused: ps.Refused,
			Active: ps.Active, LastSeen: ps.LastSeen}
		if rs != nil {
			ap.Sleeping = rs.Sleeping[ps.Project]
			ap.Evictions = rs.Evictions[ps.Project]
		}
		p.Projects = append(p.Projects, ap)
	}
	// The pool's own totals: a sum over projects would drop when an idle
	// project is forgotten.
	p.Admitted, p.Refused = s.Admitted, s.Refused
	return p
}

// Policies implements admin.Backend.
func (d *Daemon) Policies() ([]admin.Entry, error) { return d.store.List() }

// Policy implements admin.Backend.
func (d *Daemon) Policy(project string) (policy.Policy, bool, error) { return d.store.Get(project) }

// PatchPolicy implements admin.Backend: store (fsynced), then apply.
func (d *Daemon) PatchPolicy(project string, pt policy.Patch) (policy.Policy, error) {
	p, err := d.store.Patch(project, pt, d.defPolicy)
	if err != nil {
		return policy.Policy{}, err
	}
	d.apply(project, p)
	return p, nil
}

// DeletePolicy implements admin.Backend: the project falls back to the
// default policy and unbounded rates.
func (d *Daemon) DeletePolicy(project string) (bool, error) {
	found, err := d.store.Delete(project)
	if err != nil || !found {
		return found, err
	}
	d.unapply(project)
	return true, nil
}
