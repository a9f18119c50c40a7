// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/membership"
	"github.com/fairshare-dev/fairshare/policy"
)

// Projects implements admin.Backend.
func (d *Daemon) Projects(context.Context) (admin.Membership, error) {
	return *d.projects.membership(), nil
}

// Register implements admin.Backend: the cgroups are checked (each a
// cgroup2 directory, none registered already or nested in another
// project's member, registered or pending), stored all or nothing, and in
// force when it returns, unless the apply took longer than applyWait
// (Pending).
func (d *Daemon) Register(ctx context.Context, project string, paths []string) (admin.Registration, error) {
	p := d.projects
	if err := policy.ValidateProject(project); err != nil {
		return admin.Registration{}, err
	}
	if p.reg == nil {
		return admin.Registration{}, fmt.Errorf("%w: registered is not one of projects.sources, so registrations are not read", admin.ErrInvalid)
	}
	if len(paths) == 0 || len(paths) > admin.MaxRegister {
		return admin.Registration{}, fmt.Errorf("%w: name 1 to %d cgroups, got %d", admin.ErrInvalid, admin.MaxRegister, len(paths))
	}
	var ms []membership.Member
	for _, raw := range paths {
		cg, err := p.resolve(raw, true)
		if err != nil {
			return admin.Registration{}, err
		}
		if !slices.ContainsFunc(ms, func(m membership.Member) bool { return m.Cgroup == cg }) {
			ms = append(ms, membership.Member{Project: project, Cgroup: cg})
		}
	}

	p.regMu.Lock()
	var added []string
	err := func() error {
		defer p.regMu.Unlock()
		tree := p.tree.Load()
		pendTree := membership.NewTree(p.pending)
		var refused []string
		for _, m := range ms {
			e := membership.Entry{Member: m, Source: membership.SourceRegistered}
			if slices.Contains(p.regs, m) {
				continue // registered already: nothing to do
			}
			for _, t := range []*membership.Tree{tree, pendTree} {
				if t == nil {
					continue
				}
				if why := t.Check(e); why != "" {
					refused = append(refused, fmt.Sprintf("%s: %s", m.Cgroup, why))
					break
				}
			}
			added = append(added, m.Cgroup)
		}
		if len(refused) > 0 {
			added = nil
			return fmt.Errorf("%w: %s", membership.ErrRefused, strings.Join(refused, "; "))
		}
		if len(added) == 0 {
			return nil
		}
		if _, err := p.store.AddMembers(ms, nil); err != nil {
			added = nil
			return err
		}
		for _, cg := range added {
			m := membership.Member{Project: project, Cgroup: cg}
			p.regs = insertMember(p.regs, m)
			p.pending = append(p.pending, membership.Entry{Member: m, Source: membership.SourceRegistered})
		}
		p.reg.Set(p.regs)
		return nil
	}()
	if err != nil {
		return admin.Registration{}, err
	}
	reg := admin.Registration{Project: project, Added: added}
	if len(added) > 0 {
		reg.Pending = !p.waitApply(ctx)
	}
	d.registration(&reg)
	return reg, nil
}

// Unregister implements admin.Backend: the registrations named (or all of
// the project's) are removed from the store, then from the members in
// force before it returns (unless that took longer than applyWait).
// Nothing held is released: permits end with their sockets.
func (d *Daemon) Unregister(ctx context.Context, project string, paths []string) (admin.Registration, error) {
	p := d.projects
	if err := policy.ValidateProject(project); err != nil {
		return admin.Registration{}, err
	}
	if p.reg == nil {
		return admin.Registration{}, fmt.Errorf("%w: registered is not one of projects.sources, so there are no registrations", admin.ErrInvalid)
	}
	var cgs []string
	for _, raw := range paths {
		cg, err := p.resolve(raw, false)
		if err != nil {
			return admin.Registration{}, err
		}
		cgs = append(cgs, cg)
	}
	p.regMu.Lock()
	removed, err := p.store.RemoveMembers(project, cgs)
	if err == nil && len(removed) > 0 {
		gone := make(map[membership.Member]bool, len(removed))
		for _, m := range removed {
			gone[m] = true
		}
		p.regs = slices.DeleteFunc(p.regs, func(m membership.Member) bool { return gone[m] })
		p.reg.Set(p.regs)
	}
	p.regMu.Unlock()
	if err != nil {
		return admin.Registration{}, err
	}
	if len(paths) == 0 && len(removed) == 0 {
		return admin.Registration{}, fmt.Errorf("%w: project %s has no registered cgroups", policy.ErrNotRegistered, project)
	}
	reg := admin.Registration{Project: project}
	for _, m := range removed {
		reg.Removed = append(reg.Removed, m.Cgroup)
	}
	if len(removed) > 0 {
		reg.Pending = !p.waitApply(ctx)
	}
	d.registration(&reg)
	return reg, nil
}

// registration fills in the project's registrations now and those refused.
func (d *Daemon) registration(reg *admin.Registration) {
	p := d.projects
	p.regMu.Lock()
	for _, m := range p.regs {
		if m.Project == reg.Project {
			reg.Cgroups = append(reg.Cgroups, m.Cgroup)
		}
	}
	p.regMu.Unlock()
	if reg.Cgroups == nil {
		reg.Cgroups = []string{}
	}
	for _, r := range p.membership().Refused {
		if r.Project == reg.Project && (r.Source == membership.SourceRegistered || r.By == "kernel") {
			reg.Refused = append(reg.Refused, r)
		}
	}
}

// waitApply waits for the next apply (which includes what was stored
// before the call) and reports whether it ended within applyWait.
func (p *projects) waitApply(ctx context.Context) bool {
	t := time.NewTimer(applyWait)
	defer t.Stop()
	select {
	case <-p.nextApply():
		return true
	case <-t.C:
	case <-ctx.Done():
	case <-p.applies:
	}
	return false
}

// resolve turns a cgroup as the operator wrote it into a member's path
// (cgroup.Mount.Path). With exist, it must be a cgroup2 directory now
// (registering a typo would register nothing).
func (p *projects) resolve(raw string, exist bool) (string, error) {
	if p.mount.Point == "" {
		return "", fmt.Errorf("%w: there is no cgroup2 mount on this node", admin.ErrInvalid)
	}
	if strings.TrimSpace(raw) == "" || strings.ContainsRune(raw, 0) {
		return "", fmt.Errorf("%w: an empty cgroup path", admin.ErrInvalid)
	}
	mnt := p.mount.Point
	cg := p.mount.Path(raw)
	if cg == filepath.Clean(mnt) {
		return "", fmt.Errorf("%w: %q is the root of the cgroup2 hierarchy, which holds every process of the node", admin.ErrInvalid, raw)
	}
	if err := membership.ValidCgroup(cg); err != nil {
		return "", fmt.Errorf("%w: %w", admin.ErrInvalid, err)
	}
	if exist {
		if err := cgroup.OnCgroup2(cg); err != nil {
			return "", fmt.Errorf("%w: %q is not a cgroup: %s is not a directory on the cgroup2 mount %s (write a cgroup's directory, "+
				"or its path as /proc/<pid>/cgroup shows it)", admin.ErrInvalid, raw, cg, mnt)
		}
	}
	return cg, nil
}

// insertMember inserts m into ms, sorted by cgroup as the store lists them.
func insertMember(ms []membership.Member, m membership.Member) []membership.Member {
	i, _ := slices.BinarySearchFunc(ms, m.Cgroup, func(x membership.Member, cg string) int { return strings.Compare(x.Cgroup, cg) })
	return slices.Insert(ms, i, m)
}
