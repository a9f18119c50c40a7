// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"fmt"
	"sort"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/internal/listen"
	"github.com/fairshare-dev/fairshare/policy"
	"github.com/fairshare-dev/fairshare/scheduler"
)

// Version is the daemon's version, for the admin API's health check
// (admin.Versioner).
func (d *Daemon) Version() string { return d.opts.Version }

var _ admin.Versioner = (*Daemon)(nil)

// Status implements admin.Backend: the whole node, read now.
func (d *Daemon) Status(context.Context) (admin.Status, error) {
	st := admin.Status{Version: d.opts.Version, Time: time.Now(), Kernel: d.kernel != nil, Source: "daemon",
		Membership: d.projects.membership()}
	for _, p := range d.pools {
		ps, err := p.status()
		if err != nil {
			return admin.Status{}, err
		}
		ps.Fleet = d.fleet.status(ps.Name)
		st.Pools = append(st.Pools, ps)
	}
	if err := d.destStatus(&st); err != nil {
		return admin.Status{}, err
	}
	if d.kernel != nil {
		st.Reconcile = d.kernel.record()
	}
	st.Listeners = d.listenerStatus()
	st.Events = d.events.status()

	st.Rates = d.rateStatus()
	list, err := d.Policies()
	if err != nil {
		return admin.Status{}, fmt.Errorf("reading the policy store: %w", err)
	}
	st.Policies = list
	st.PoliciesFile = d.file.status()
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

// listenerStatus lists the listeners serving, by name; the permit API's
// socket is its own server's.
func (d *Daemon) listenerStatus() []admin.Listener {
	d.mu.Lock()
	ls := append([]*listen.Listener(nil), d.listeners...)
	d.mu.Unlock()
	var stats []listen.Stats
	for _, l := range ls {
		stats = append(stats, l.Stats())
	}
	if d.permits != nil {
		if s, ok := d.permits.ListenerStats(); ok {
			stats = append(stats, s)
		}
	}
	out := make([]admin.Listener, 0, len(stats))
	for _, s := range stats {
		out = append(out, admin.Listener{Name: s.Name, Open: s.Open, MaxConns: s.MaxConns, MaxPerPeer: s.MaxPerPeer, Peers: s.Peers,
			Accepted: s.Accepted, Refused: s.Refused, AcceptErrors: s.AcceptErrors})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Policies implements admin.Backend: the policies in force, from the
// store and the policies file (which wins for the projects it names).
func (d *Daemon) Policies() ([]admin.Entry, error) {
	list, err := d.store.List()
	if err != nil {
		return nil, err
	}
	return d.file.merge(list), nil
}

// Policy implements admin.Backend.
func (d *Daemon) Policy(project string) (admin.Entry, bool, error) {
	if p, ok := d.file.owns(project); ok {
		return admin.Entry{Project: project, Policy: p, Source: policy.SourceFile}, true, nil
	}
	p, found, err := d.store.Get(project)
	return admin.Entry{Project: project, Policy: p}, found, err
}

// PatchPolicy implements admin.Backend: store (fsynced), then apply. A
// project the policies file names is refused: the file owns it.
func (d *Daemon) PatchPolicy(project string, pt policy.Patch) (policy.Policy, error) {
	d.polMu.Lock()
	defer d.polMu.Unlock()
	if err := d.file.refuse(project); err != nil {
		return policy.Policy{}, err
	}
	p, err := d.store.Patch(project, pt, d.defPolicy)
	if err != nil {
		return policy.Policy{}, err
	}
	d.apply(project, p)
	return p, nil
}

// DeletePolicy implements admin.Backend: the project falls back to the
// default policy and unbounded rates. A project the policies file names is
// refused, as in PatchPolicy.
func (d *Daemon) DeletePolicy(project string) (bool, error) {
	d.polMu.Lock()
	defer d.polMu.Unlock()
	if err := d.file.refuse(project); err != nil {
		return false, err
	}
	found, err := d.store.Delete(project)
	if err != nil || !found {
		return found, err
	}
	d.unapply(project)
	return true, nil
}
