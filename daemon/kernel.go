// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"fmt"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/loader"
	"github.com/fairshare-dev/fairshare/pools"
)

// kernelReadEvery is how often the control loop reads the kernel's project
// entries for kernelBook: well under the minute after which the loader
// forgets an idle entry of a removed cgroup.
const kernelReadEvery = 15 * time.Second

type kernelCounts struct{ admitted, refused uint64 }

// kernelBook keeps the connections pool's totals equal to the sums over its
// projects after the loader forgets an entry. An entry is deleted only after
// a minute without an ask, so its counts have stopped moving well before:
// the last counts seen of an entry that disappears are its final ones, and
// they go into forgotten. The book lives in the daemon; a restarted daemon
// starts it again from the entries it finds (the kernel keeps those).
type kernelBook struct {
	last      map[uint64]kernelCounts // cgroup id -> counts last seen
	forgotten admin.Forgotten
}

// noteKernel records a snapshot's entries and moves those gone to forgotten.
func (d *Daemon) noteKernel(s loader.Snapshot) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.kernel.note(s)
}

func (b *kernelBook) note(s loader.Snapshot) {
	now := make(map[uint64]bool, len(s.Projects))
	for _, p := range s.Projects {
		now[p.CgroupID] = true
		b.last[p.CgroupID] = kernelCounts{p.Admitted, p.Refused}
	}
	for id, c := range b.last {
		if !now[id] {
			b.forgotten.Projects++
			b.forgotten.Admitted += c.admitted
			b.forgotten.Refused += c.refused
			delete(b.last, id)
		}
	}
}

// KernelPool is the connections pool as status shows it, from one read of
// the maps: InUse is the sum of what the projects hold in that read, and the
// totals the sums of their counts plus forgotten's, so the rows add up
// (the node-wide counters are read apart from the entries and can be a
// connection ahead or behind under churn); Active is the programs' own
// count (kernelActive) and Share the share it gives, the pair the kernel
// enforces.
func KernelPool(s loader.Snapshot, kernelActive int, forgotten admin.Forgotten) admin.Pool {
	p := admin.Pool{Name: config.PoolConnections, Enforcer: "kernel", Size: s.Size, Floor: s.Floor,
		Active: kernelActive, Share: pools.Share(s.Size, s.Floor, kernelActive),
		Projects: []admin.Project{}, Forgotten: forgotten}
	if len(s.Exempt.Paths) > 0 || s.Exempt.InUse > 0 || s.Exempt.Admitted > 0 {
		p.Exempt = &admin.Exempt{Members: s.Exempt.Paths, Max: s.Exempt.Max, InUse: s.Exempt.InUse,
			Admitted: s.Exempt.Admitted, OverBudget: s.Exempt.OverBudget}
	}
	p.Admitted, p.Refused = forgotten.Admitted, forgotten.Refused
	for _, pc := range s.Projects {
		name := pc.Project
		if name == "" {
			name = fmt.Sprintf("#%d", pc.CgroupID) // its cgroup is gone
		}
		p.Projects = append(p.Projects, admin.Project{Project: name, Held: pc.InUse,
			Admitted: pc.Admitted, Refused: pc.Refused, Active: pc.Active, LastSeen: pc.LastSeen})
		p.InUse += pc.InUse
		p.Admitted += pc.Admitted
		p.Refused += pc.Refused
	}
	return p
}

// kernelStatus reads the kernel's pool for Status.
func (d *Daemon) kernelStatus() (admin.Pool, error) {
	s, err := d.lim.Snapshot()
	if err != nil {
		return admin.Pool{}, fmt.Errorf("reading the bpf maps: %w", err)
	}
	active, err := d.lim.KernelActive()
	if err != nil {
		return admin.Pool{}, fmt.Errorf("reading the bpf maps: %w", err)
	}
	d.mu.Lock()
	d.kernel.note(s)
	forgotten := d.kernel.forgotten
	d.mu.Unlock()
	return KernelPool(s, active, forgotten), nil
}
