// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/loader/limits"
)

// SetExempt replaces the exempt set and its budget (max 0 means FLOOR).
// Each path names a cgroup, absolute or relative to the cgroup2 mount: a
// registered cgroup (a member), which exempts every socket below it, or any
// other cgroup, which exempts the sockets made in it exactly (a probe's
// cgroup nested in a member, say). The cgroup2 root cannot be exempt. An
// empty set turns the exemption off.
//
// A path where no cgroup exists yet (after a boot, before its project's
// cgroup is made) is not an error: it is left out of the set in force and
// listed in Exempt.Missing, and RefreshExempt puts it in once it exists.
//
// Exempt sockets take a permit from the exempt budget instead of the pool:
// they are neither refused by the rule nor counted in the pool's or their
// project's in_use. At most max are held at a time node-wide; an exempt
// socket beyond that takes a pool permit under the rule like any other
// socket of its project. So the connections of all projects together stay
// within POOL + max, whatever the set names. Sockets already holding an
// exempt permit keep it until they close when the set changes.
func (l *Limiter) SetExempt(paths []string, max uint32) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return ErrClosed
	}
	x, err := l.resolveExemptLocked(paths, max)
	if err != nil {
		return err
	}
	return l.setExemptLocked(x)
}

// exemptSet is an exempt set resolved, nothing written yet (SetExempt):
// the paths as given, their cgroups' ids, the absolute paths of those where
// none exists yet, and the budget.
type exemptSet struct {
	paths   []string
	ids     map[uint64]string
	missing []string
	max     uint32
}

// resolveExemptLocked checks and resolves an exempt set (SetExempt's
// arguments) without writing anything: Open does it before it writes the
// rest of the configuration, so that a bad set refuses the start with
// nothing written.
func (l *Limiter) resolveExemptLocked(paths []string, max uint32) (exemptSet, error) {
	if max == 0 {
		max = l.floor
	}
	if len(paths) > limits.ExemptCap {
		return exemptSet{}, fmt.Errorf("%d exempt cgroups, at most %d: %w", len(paths), limits.ExemptCap, ErrBadExempt)
	}
	ids, missing, err := l.exemptIDsOf(paths)
	if err != nil {
		return exemptSet{}, err
	}
	return exemptSet{paths: slices.Clone(paths), ids: ids, missing: missing, max: max}, nil
}

// setExemptLocked writes the resolved exempt set x: the map, the budget and
// the members' flags.
func (l *Limiter) setExemptLocked(x exemptSet) error {
	ids, max := x.ids, x.max
	l.exemptWant, l.exemptMissing = x.paths, x.missing
	var stale []uint64 // entries of the old set (a restart's too) not in the new
	var id uint64
	var v uint32
	it := l.objs.FsExempt.Iterate()
	for it.Next(&id, &v) {
		if _, ok := ids[id]; !ok {
			stale = append(stale, id)
		}
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("reading exempt map: %w", err)
	}
	// 0 in the map tells the programs the set is empty: they skip the
	// lookups on every connect.
	budget := uint32(0)
	if len(ids) > 0 {
		budget = max
	}
	// Add first, then turn on (or change) the budget, then drop the old
	// entries: a socket sees either set, never a half-written one. A new
	// set that does not fit in the map beside the old one is written with
	// the exemption off meanwhile: for that instant exempt sockets go under
	// the rule, and still see no mixed set.
	off := len(ids)+len(stale) > int(l.objs.FsExempt.MaxEntries())
	if off {
		if err := l.setExemptMax(0); err != nil {
			return err
		}
		if err := l.deleteExempt(stale); err != nil {
			return err
		}
	}
	one := uint32(1)
	for id := range ids {
		if err := l.objs.FsExempt.Put(id, one); err != nil {
			return fmt.Errorf("writing exempt map: %w", err)
		}
	}
	if err := l.setExemptMax(budget); err != nil {
		return err
	}
	if !off {
		if err := l.deleteExempt(stale); err != nil {
			return err
		}
	}
	l.exemptIDs, l.exemptMax = ids, max
	// A registered cgroup in the set exempts everything below it: its
	// member entry says so (MEMBER_EXEMPT), so the programs need one lookup.
	changed := false
	for cg, r := range l.memb.members {
		flags := r.flags &^ memberExempt
		if _, ok := ids[cg]; ok {
			flags |= memberExempt
		}
		if r.flags == flags {
			continue
		}
		err := l.objs.FsMembers.Put(cg, limiterFsMember{Project: r.project, Flags: flags})
		if err == nil {
			r.flags = flags
			l.memb.members[cg] = r
			changed = true
			continue
		}
		err = fmt.Errorf("writing member %s: %w", r.path, err)
		if changed {
			err = errors.Join(err, l.membersChanged())
		}
		return err
	}
	if changed {
		if err := l.membersChanged(); err != nil {
			return err
		}
	}
	l.exempt = l.exempt[:0]
	for _, p := range ids {
		l.exempt = append(l.exempt, p)
	}
	slices.Sort(l.exempt)
	return nil
}

// exemptIDsOf resolves paths to their cgroups' ids; those where no cgroup
// exists are returned apart, as absolute paths.
func (l *Limiter) exemptIDsOf(paths []string) (map[uint64]string, []string, error) {
	ids := make(map[uint64]string, len(paths))
	var missing []string
	for _, p := range paths {
		abs, err := l.exemptPath(p)
		if errors.Is(err, errExemptMissing) {
			missing = append(missing, abs)
			continue
		}
		if err != nil {
			return nil, nil, err
		}
		id, err := cgroup.ID(abs)
		if errors.Is(err, os.ErrNotExist) {
			missing = append(missing, abs)
			continue
		}
		if err != nil {
			return nil, nil, fmt.Errorf("exempt cgroup %q: %w (%w)", p, ErrBadExempt, err)
		}
		ids[id] = abs
	}
	slices.Sort(missing)
	return ids, missing, nil
}

// RefreshExempt applies the exempt set again if what its paths name has
// changed: a cgroup that did not exist now does, or one was removed or made
// again (a new cgroup id). It returns the paths that came into force and
// those that went out of it; a set whose paths all name what they named is
// left alone. The daemon calls it every tick: a stat of each path.
func (l *Limiter) RefreshExempt() (appeared, gone []string, err error) {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil, nil, ErrClosed
	}
	want, max := l.exemptWant, l.exemptMax
	ids, _, err := l.exemptIDsOf(want)
	same := err == nil && maps.Equal(ids, l.exemptIDs)
	old := slices.Clone(l.exempt)
	l.mu.Unlock()
	if err != nil || same {
		return nil, nil, err
	}
	if err := l.SetExempt(want, max); err != nil {
		return nil, nil, err
	}
	l.mu.Lock()
	now := slices.Clone(l.exempt)
	l.mu.Unlock()
	for _, p := range now {
		if !slices.Contains(old, p) {
			appeared = append(appeared, p)
		}
	}
	for _, p := range old {
		if !slices.Contains(now, p) {
			gone = append(gone, p)
		}
	}
	return appeared, gone, nil
}

// setExemptMax writes the exempt budget into the config map.
func (l *Limiter) setExemptMax(v uint32) error {
	var cfg limiterFsSettings
	if err := l.objs.FsConfig.Lookup(uint32(0), &cfg); err != nil {
		return fmt.Errorf("reading config map: %w", err)
	}
	cfg.ExemptMax = v
	if err := l.objs.FsConfig.Put(uint32(0), &cfg); err != nil {
		return fmt.Errorf("writing config map: %w", err)
	}
	return nil
}

// deleteExempt deletes ids from the exempt map.
func (l *Limiter) deleteExempt(ids []uint64) error {
	for _, id := range ids {
		if err := l.objs.FsExempt.Delete(id); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("deleting from exempt map: %w", err)
		}
	}
	return nil
}

// exemptPath resolves p against the cgroup2 mount and checks that it is a
// cgroup strictly below it.
func (l *Limiter) exemptPath(p string) (string, error) { return exemptPath(l.root, p) }

// errExemptMissing: no cgroup exists at an exempt path (yet).
var errExemptMissing = errors.New("no such cgroup yet")

// CheckExempt checks an exempt set as Open would, without loading anything:
// at most limits.ExemptCap paths, each strictly below the cgroup2 mount
// (relative paths are relative to the mount) and, where something exists
// there, a cgroup2 directory; a path where nothing exists yet is no error
// (SetExempt). The daemon calls it before it creates anything, so a bad set
// refuses the start with nothing pinned. Errors wrap ErrBadExempt.
func CheckExempt(paths []string) error {
	if len(paths) > limits.ExemptCap {
		return fmt.Errorf("%d exempt cgroups, at most %d: %w", len(paths), limits.ExemptCap, ErrBadExempt)
	}
	if len(paths) == 0 {
		return nil
	}
	mnt, err := cgroup.FindMount()
	if err != nil {
		return err
	}
	for _, p := range paths {
		if _, err := exemptPath(mnt.Point, p); err != nil && !errors.Is(err, errExemptMissing) {
			return err
		}
	}
	return nil
}

func exemptPath(root, p string) (string, error) {
	if p == "" {
		return "", fmt.Errorf("empty exempt path: %w", ErrBadExempt)
	}
	abs := p
	if !filepath.IsAbs(p) {
		abs = filepath.Join(root, p)
	}
	abs = filepath.Clean(abs)
	rel, err := filepath.Rel(root, abs)
	if err != nil || rel == "." || rel == ".." || strings.HasPrefix(rel, "../") {
		return "", fmt.Errorf("exempt cgroup %q is not below the cgroup2 mount %s: %w", p, root, ErrBadExempt)
	}
	st, err := os.Stat(abs)
	if errors.Is(err, os.ErrNotExist) {
		return abs, fmt.Errorf("exempt cgroup %q: %w", p, errExemptMissing)
	}
	if err != nil {
		return "", fmt.Errorf("exempt cgroup %q: %w (%w)", p, ErrBadExempt, err)
	}
	var sfs unix.Statfs_t
	if !st.IsDir() || unix.Statfs(abs, &sfs) != nil || sfs.Type != unix.CGROUP2_SUPER_MAGIC {
		return "", fmt.Errorf("exempt path %q is not a cgroup2 directory: %w", p, ErrBadExempt)
	}
	return abs, nil
}

// Exempt is the state of the exempt budget.
type Exempt struct {
	// Paths is the exempt set in force (absolute cgroup paths, sorted).
	Paths []string
	// Missing are the paths of the set where no cgroup exists yet (sorted):
	// in force once one does (RefreshExempt).
	Missing []string
	// Max is the budget: exempt permits held at most at a time.
	Max int
	// InUse is the exempt permits held now, reservations included.
	InUse int
	// Admitted counts exempt permits taken, OverBudget exempt sockets that
	// found the budget spent and went under the rule, Released exempt
	// permits given back.
	Admitted, OverBudget, Released uint64
}
