// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/membership"
	projectname "github.com/fairshare-dev/fairshare/internal/project"
)

// Member is one registered cgroup: its sockets, and those of every cgroup
// below it, count for Project (an absolute cgroup2 directory). It is the
// membership package's type, which the daemon's sources share.
type Member = membership.Member

// MembersReport is what SetMembers did.
type MembersReport struct {
	Added, Removed, Kept int
	// Moved counts members kept with another project (also in Kept).
	Moved   int
	Refused []RefusedMember
	// Changed are the cgroups of the members written (added, moved, their
	// flags changed) or removed: what a walk of their sockets (Settle)
	// concerns. Set with an error too: what was written before it.
	Changed []string
}

// RefusedMember is a member SetMembers did not apply, and why.
type RefusedMember struct {
	Member Member
	Reason string
}

// ErrNoMember is wrapped by the errors of Members for a pinned member whose
// cgroup directory is gone.
var ErrNoMember = errors.New("no such member")

// memberExempt is MEMBER_EXEMPT of bpf/lib/project.h, memberWeak
// MEMBER_WEAK.
const (
	memberExempt = 1
	memberWeak   = 2
)

// Two project names no policy, label or CLI can take (they are not valid
// project names, internal/project.Validate) name the kernel's two special
// kinds of member:
const (
	// Unclassified is the project of the weak members: the cgroups the
	// pods are placed below (kubernetes.pod_cgroups). A socket below one
	// and below no other member counts for it, under the rule like any
	// project's, so a pod the daemon has not classified yet is limited
	// from its first connect and its first SYN, with or without a
	// daemon. A member below a weak one wins: a classified pod's own
	// cgroup, deeper, counts for its project. Permits taken under
	// Unclassified move to the pod's project at the next Reconcile after
	// it is classified (see the package doc, Unclassified pods).
	Unclassified = "(unclassified)"
	// NoProject members are cgroups in no project that may sit below a
	// weak member: their sockets are neither counted nor refused (the
	// pods of system namespaces, the daemon's own cgroup). Their kernel
	// entry has project id 0.
	NoProject = "(none)"
)

// reserved says whether name is one of the two special members' names.
func reserved(name string) bool { return name == Unclassified || name == NoProject }

// revalidate is how many kept members SetMembers re-reads from the file
// system per call (their cgroup may have been removed and made again under
// the same path, with a new id): all of them on a node with fewer, a round
// over every 50,000 in 7 calls.
const revalidate = 8192

// membership is the kernel's membership as user space keeps it in step:
// what SetMembers last wrote, read back from the pins at Open.
type kernelMembership struct {
	ids     map[string]uint32    // project name -> id
	names   []string             // id -> project name, "" for a free id
	members map[uint64]memberRec // registered cgroup id -> its entry
	paths   map[string]uint64    // registered cgroup path -> id
	cursor  int                  // where the next revalidation round starts
}

type memberRec struct {
	project uint32
	flags   uint32
	path    string // "" until known (a pin of an earlier run)
}

// loadMembership reads the names and the members the pins hold.
func (l *Limiter) loadMembership() error {
	l.memb = kernelMembership{ids: map[string]uint32{}, names: make([]string, l.maxProj),
		members: map[uint64]memberRec{}, paths: map[string]uint64{}}
	names, err := readNames(l.objs.FsNames, l.maxProj)
	if err != nil {
		return err
	}
	for id, n := range names {
		if n != "" && id != 0 {
			l.memb.names[id] = n
			l.memb.ids[n] = uint32(id)
			l.setName(uint32(id), n)
		}
	}
	var cg uint64
	var v limiterFsMember
	it := l.objs.FsMembers.Iterate()
	for it.Next(&cg, &v) {
		l.memb.members[cg] = memberRec{project: v.Project, flags: v.Flags}
		l.projHigh = max(l.projHigh, v.Project)
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("reading the members map: %w", err)
	}
	// The one full read of the projects table: an id an earlier run gave
	// may still count (its counters not zero) though it has no name now.
	id := uint32(0)
	err = readArray(l.objs.FsProjects, func(v limiterFsProject) {
		if v != (limiterFsProject{}) || int(id) < len(l.memb.names) && l.memb.names[id] != "" {
			l.projHigh = max(l.projHigh, id)
		}
		id++
	})
	if err != nil {
		return fmt.Errorf("reading projects map: %w", err)
	}
	// The paths of the pinned members (a restart's cost, ~3 us each); one
	// whose cgroup is gone keeps none and is listed by id.
	for id, r := range l.memb.members {
		if p, err := l.mnt.PathOf(id); err == nil {
			r.path = p
			l.memb.members[id] = r
			l.memb.paths[p] = id
		}
	}
	return nil
}

// readNames reads fs_names, n entries, with batch lookups.
func readNames(m *ebpf.Map, n uint32) ([]string, error) {
	out := make([]string, 0, n)
	keys := make([]uint32, 4096)
	vals := make([]limiterFsName, 4096)
	var cur ebpf.MapBatchCursor
	for {
		c, err := m.BatchLookup(&cur, keys, vals, nil)
		for i := range c {
			for uint32(len(out)) < keys[i] {
				out = append(out, "")
			}
			out = append(out, nameOf(vals[i]))
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("reading the names map: %w", err)
		}
	}
	for uint32(len(out)) < n {
		out = append(out, "")
	}
	return out, nil
}

func nameOf(v limiterFsName) string {
	b := make([]byte, len(v.Name))
	for i, c := range v.Name {
		b[i] = byte(c)
	}
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}

func fsName(name string) limiterFsName {
	var v limiterFsName
	for i := 0; i < len(name) && i < len(v.Name); i++ {
		v.Name[i] = int8(name[i])
	}
	return v
}

// Members lists the kernel's membership now, sorted by cgroup. A member
// whose cgroup directory could not be found (removed since it was
// registered by an earlier run) is listed with the cgroup "#<id>".
func (l *Limiter) Members() ([]Member, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil, ErrClosed
	}
	out := make([]Member, 0, len(l.memb.members))
	for cg, r := range l.memb.members {
		path := r.path
		if path == "" {
			path = fmt.Sprintf("#%d", cg)
		}
		name := l.memb.names[r.project]
		if r.project == 0 {
			name = NoProject
		}
		out = append(out, Member{Project: name, Cgroup: path})
	}
	slices.SortFunc(out, func(a, b Member) int { return strings.Compare(a.Cgroup, b.Cgroup) })
	return out, nil
}

// SetMembers makes the kernel's membership exactly ms: members not yet in
// it are added, those no longer in ms removed, those whose project changed
// moved, in one call; a project new to the kernel gets an id and its name
// first. It is idempotent, and cheap when nothing changed (a map of paths,
// no write; kept members are re-read from the file system in rounds of
// revalidate, so a cgroup removed and made again under its path is found
// within a few calls).
//
// A member is refused, with the reason in the report, when its project
// name is not valid, its cgroup is not a directory on cgroup2 (missing, or
// elsewhere), it sits outside the levels the programs look at
// (Options.BaseLevel and MaxDepth), it is listed twice, it is at, above or
// below a cgroup of another project in ms, or a table is full. The others
// are applied. Removing a member releases nothing: the permits its sockets
// hold end with them; new connections from its cgroup stop counting at once.
func (l *Limiter) SetMembers(ms []Member) (MembersReport, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return MembersReport{}, ErrClosed
	}
	changed := false
	rep, err := l.setMembers(ms, &changed)
	if changed {
		l.genOwed = true
	}
	return rep, errors.Join(err, l.payGen())
}

// membersChanged bumps fs_member_gen after a change of fs_members (done,
// even in part): the programs' memo of a cgroup's project
// (bpf/lib/project.h) then drops every answer found before the change. A
// bump that fails is owed (l.genOwed) and tried again at every change and
// at every SetMembers and Tick until it is done: the change that needed it
// is written already, and the next call may have nothing to write.
func (l *Limiter) membersChanged() error {
	l.genOwed = true
	return l.payGen()
}

// payGen bumps fs_member_gen if a bump is owed. l.mu is held.
func (l *Limiter) payGen() error {
	if !l.genOwed {
		return nil
	}
	l.adjustM.Lock()
	defer l.adjustM.Unlock()
	if _, err := bumpMemberGen(l.objs.FsAdjust, l.genFault); err != nil {
		return fmt.Errorf("bumping the members' generation (tried again at the next SetMembers or Tick): %w", err)
	}
	l.genOwed = false
	return nil
}

// bumpMemberGen adds one to fs_member_gen with fs_adjust (prog), an atomic
// add in the kernel: a read and a write from user space by two writers on
// the same pins could move it back, and answers remembered before a change
// would be current again. fault, if not nil, fails the bump (tests). It
// returns the new generation.
func bumpMemberGen(prog *ebpf.Program, fault func() error) (uint64, error) {
	if fault != nil {
		if err := fault(); err != nil {
			return 0, err
		}
	}
	g, err := runAdjust(prog, limiterFsAdjustArgs{Op: opMemberGen})
	if err != nil {
		return 0, err
	}
	if g <= 0 {
		return 0, errors.New("fs_adjust could not read fs_member_gen")
	}
	return uint64(g), nil
}

// setMembers is SetMembers under l.mu; *changed says whether it wrote
// fs_members.
func (l *Limiter) setMembers(ms []Member, changed *bool) (MembersReport, error) {
	var rep MembersReport
	want, refused := l.resolveMembers(ms)
	rep.Refused = refused

	// Projects: an id for each new one, its counters cleared and its name
	// written before any member points at it.
	need := 0
	for _, w := range want {
		if w.Project == NoProject {
			continue
		}
		if _, ok := l.memb.ids[w.Project]; !ok {
			need++
			l.memb.ids[w.Project] = 0 // placeholder, numbered below
		}
	}
	if need > 0 {
		if err := l.allocIDs(); err != nil {
			return rep, err
		}
	}
	// Members: puts first (adds and moves), then deletes.
	keep := make(map[uint64]bool, len(want))
	for cg, w := range want {
		keep[cg] = true
		id := l.memb.ids[w.Project]
		if id == 0 && w.Project != NoProject {
			rep.Refused = append(rep.Refused, RefusedMember{w.Member, "no room for another project (Options.MaxProjects)"})
			delete(keep, cg)
			continue
		}
		flags := uint32(0)
		if _, ok := l.exemptIDs[cg]; ok {
			flags = memberExempt
		}
		if w.Project == Unclassified {
			flags |= memberWeak
		}
		old, had := l.memb.members[cg]
		if had && old.project == id && old.flags == flags {
			rep.Kept++
			if old.path != w.Cgroup {
				l.setPath(cg, old.path, w.Cgroup)
			}
			continue
		}
		if !had && len(l.memb.members) >= int(l.maxMemb) {
			rep.Refused = append(rep.Refused, RefusedMember{w.Member, fmt.Sprintf("no room for another member (%d registered, Options.MaxMembers)", len(l.memb.members))})
			delete(keep, cg)
			continue
		}
		if err := l.objs.FsMembers.Put(cg, limiterFsMember{Project: id, Flags: flags}); err != nil {
			if errors.Is(err, unix.E2BIG) || errors.Is(err, unix.ENOMEM) {
				rep.Refused = append(rep.Refused, RefusedMember{w.Member, "the members map is full"})
				delete(keep, cg)
				continue
			}
			return rep, fmt.Errorf("writing member %s: %w", w.Cgroup, err)
		}
		*changed = true
		rep.Changed = append(rep.Changed, w.Cgroup)
		if had {
			rep.Kept++
			if old.project != id {
				rep.Moved++
			}
		} else {
			rep.Added++
		}
		l.memb.members[cg] = memberRec{project: id, flags: flags, path: old.path}
		l.setPath(cg, old.path, w.Cgroup)
	}
	for cg, r := range l.memb.members {
		if keep[cg] {
			continue
		}
		if err := l.objs.FsMembers.Delete(cg); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return rep, fmt.Errorf("removing member %s: %w", r.path, err)
		}
		*changed = true
		rep.Changed = append(rep.Changed, r.path)
		delete(l.memb.members, cg)
		if r.path != "" && l.memb.paths[r.path] == cg {
			delete(l.memb.paths, r.path)
		}
		rep.Removed++
	}
	// Projects that got no id (no room) are forgotten again; those whose
	// members all went keep theirs until Tick forgets them (idle, empty).
	for name, id := range l.memb.ids {
		if id == 0 {
			delete(l.memb.ids, name)
		}
	}
	slices.SortFunc(rep.Refused, func(a, b RefusedMember) int { return strings.Compare(a.Member.Cgroup, b.Member.Cgroup) })
	return rep, nil
}

func (l *Limiter) setPath(cg uint64, old, path string) {
	if old != "" && l.memb.paths[old] == cg {
		delete(l.memb.paths, old)
	}
	r := l.memb.members[cg]
	r.path = path
	l.memb.members[cg] = r
	l.memb.paths[path] = cg
}

// wanted is a member SetMembers resolved to its cgroup id.
type wanted struct {
	Member
	level uint32
}

// resolveMembers checks ms and resolves their cgroup ids: the members to
// apply by cgroup id, and the refused.
func (l *Limiter) resolveMembers(ms []Member) (map[uint64]wanted, []RefusedMember) {
	var refused []RefusedMember
	refuse := func(m Member, format string, args ...any) {
		refused = append(refused, RefusedMember{m, fmt.Sprintf(format, args...)})
	}
	byPath := make(map[string]wanted, len(ms))
	dup := map[string]bool{}
	for _, m := range ms {
		if err := projectname.Validate(m.Project); err != nil && !reserved(m.Project) {
			refuse(m, "%v", err)
			continue
		}
		p := filepath.Clean(m.Cgroup)
		if !filepath.IsAbs(m.Cgroup) || !l.mnt.Contains(p) || p == l.mnt.Point {
			refuse(m, "not a cgroup below the cgroup2 mount %s", l.mnt.Point)
			continue
		}
		m.Cgroup = p
		if prev, ok := byPath[p]; ok || dup[p] {
			if ok && prev.Project == m.Project {
				continue // the same member twice
			}
			dup[p] = true
			if ok {
				refuse(prev.Member, "registered twice (also for project %s)", m.Project)
				delete(byPath, p)
			}
			refuse(m, "registered twice")
			continue
		}
		rel, _ := filepath.Rel(l.mnt.Point, p)
		level := uint32(strings.Count(rel, "/") + 1)
		if level < l.base || level >= l.base+l.depth {
			refuse(m, "at cgroup level %d, outside the levels %d..%d the programs look at (base_level, max_depth)",
				level, l.base, l.base+l.depth-1)
			continue
		}
		byPath[p] = wanted{m, level}
	}
	// Nesting: a member at or below another project's member is refused,
	// and so is that other member (neither can say which one the sockets
	// below both belong to). The same project may nest. Anything may nest
	// below an Unclassified member (the walk goes on below it, and the
	// deeper member wins); an Unclassified or NoProject member below a
	// project's member would never be found (the walk stops at the
	// project's), and is refused alone; so is any member below a NoProject
	// one (the walk stops there).
	bad := map[string]string{}
	for p, w := range byPath {
		for a := filepath.Dir(p); len(a) > len(l.mnt.Point); a = filepath.Dir(a) {
			o, ok := byPath[a]
			if !ok || o.Project == w.Project || o.Project == Unclassified {
				continue
			}
			if o.Project == NoProject {
				bad[p] = fmt.Sprintf("nested in %s, a cgroup of no project", projectname.Display(a))
				continue
			}
			if reserved(w.Project) {
				bad[p] = fmt.Sprintf("nested in %s, a cgroup of project %s, which the programs find first", projectname.Display(a), o.Project)
				continue
			}
			{
				bad[p] = fmt.Sprintf("nested in %s, a cgroup of project %s", projectname.Display(a), o.Project)
				if _, done := bad[a]; !done {
					bad[a] = fmt.Sprintf("has %s of project %s below it", projectname.Display(p), w.Project)
				}
			}
		}
	}
	for p, reason := range bad {
		refuse(byPath[p].Member, "%s", reason)
		delete(byPath, p)
	}
	// Ids: a known path keeps its id, but a round of them is re-read.
	out := make(map[uint64]wanted, len(byPath))
	paths := make([]string, 0, len(byPath))
	for p := range byPath {
		paths = append(paths, p)
	}
	slices.Sort(paths)
	budget := revalidate
	start := 0
	if len(paths) > 0 {
		start = l.memb.cursor % len(paths)
	}
	for i := range paths {
		p := paths[(start+i)%len(paths)]
		w := byPath[p]
		id, known := l.memb.paths[p]
		if !known || budget > 0 {
			if known {
				budget--
			}
			var err error
			if id, err = cgroupID(p); err != nil {
				refuse(w.Member, "%v", err)
				continue
			}
		}
		if _, taken := out[id]; taken {
			refuse(w.Member, "the same cgroup as another member")
			continue
		}
		out[id] = w
	}
	l.memb.cursor = start + revalidate
	return out, refused
}

// cgroupID is the id of the cgroup2 directory p, with the reason a member
// cannot use it.
func cgroupID(p string) (uint64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(p, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return 0, fmt.Errorf("no such cgroup")
		}
		return 0, fmt.Errorf("cannot read the cgroup: %v", err)
	}
	if st.Type != unix.CGROUP2_SUPER_MAGIC {
		return 0, fmt.Errorf("not on cgroup2")
	}
	id, err := cgroup.ID(p)
	if err != nil {
		return 0, fmt.Errorf("cannot read the cgroup: %v", err)
	}
	return id, nil
}

// allocIDs numbers the projects of l.memb.ids that have the placeholder 0,
// lowest free id first, clearing each id's counters and writing its name.
// A project with no id left keeps 0 (SetMembers refuses its members).
func (l *Limiter) allocIDs() error {
	var news []string
	for name, id := range l.memb.ids {
		if id == 0 {
			news = append(news, name)
		}
	}
	slices.Sort(news)
	next := uint32(1)
	for _, name := range news {
		for next < uint32(len(l.memb.names)) && l.memb.names[next] != "" {
			next++
		}
		if next >= uint32(len(l.memb.names)) {
			return nil
		}
		if err := l.objs.FsProjects.Put(next, limiterFsProject{}); err != nil {
			return fmt.Errorf("clearing project %d: %w", next, err)
		}
		if err := l.objs.FsNames.Put(next, fsName(name)); err != nil {
			return fmt.Errorf("naming project %d: %w", next, err)
		}
		l.memb.names[next] = name
		l.memb.ids[name] = next
		l.projHigh = max(l.projHigh, next)
		l.setName(next, name)
		if err := l.capsOfNewLocked(name, next); err != nil {
			return err
		}
	}
	return nil
}

// freeLocked frees project id: its name goes and its counters are cleared,
// so the id can be given to another project.
func (l *Limiter) freeLocked(id uint32) error {
	if err := l.clearCapsOfLocked(id); err != nil {
		return err
	}
	if err := l.objs.FsNames.Put(id, limiterFsName{}); err != nil {
		return fmt.Errorf("unnaming project %d: %w", id, err)
	}
	if err := l.objs.FsProjects.Put(id, limiterFsProject{}); err != nil {
		return fmt.Errorf("clearing project %d: %w", id, err)
	}
	delete(l.memb.ids, l.memb.names[id])
	l.memb.names[id] = ""
	l.setName(id, "")
	return nil
}

// hasMember says which project ids have a member now.
func (l *Limiter) hasMember() map[uint32]bool {
	has := make(map[uint32]bool, len(l.memb.ids))
	for _, r := range l.memb.members {
		has[r.project] = true
	}
	return has
}

// projectNames maps the id of every named project to its name: the
// kernel's names now (read from the pins by a ReadOnly).
func (l *Limiter) projectNames() (map[uint64]string, error) {
	if l.readOnly {
		names, err := readNames(l.objs.FsNames, l.objs.FsNames.MaxEntries())
		if err != nil {
			return nil, err
		}
		out := map[uint64]string{}
		for id, n := range names {
			if n != "" {
				out[uint64(id)] = n
			}
		}
		return out, nil
	}
	l.namesMu.Lock()
	defer l.namesMu.Unlock()
	return maps.Clone(l.nameMap), nil
}

// projectID is the id of project name, an error wrapping os.ErrNotExist
// while the kernel has no such project (no member registered yet).
func (l *Limiter) projectID(name string) (uint64, error) {
	l.namesMu.Lock()
	defer l.namesMu.Unlock()
	for id, n := range l.nameMap {
		if n == name {
			return id, nil
		}
	}
	return 0, fmt.Errorf("project %s: %w", name, os.ErrNotExist)
}

// setName records id's name ("" frees it) for projectNames.
func (l *Limiter) setName(id uint32, name string) {
	l.namesMu.Lock()
	defer l.namesMu.Unlock()
	if l.nameMap == nil {
		l.nameMap = map[uint64]string{}
	}
	if name == "" {
		delete(l.nameMap, uint64(id))
	} else {
		l.nameMap[uint64(id)] = name
	}
}
