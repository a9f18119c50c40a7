// SPDX-License-Identifier: Apache-2.0

package daemon

// The network namespaces where inbound admission is attached: those of the
// projects' processes (found by the scan, stepNetns) and of pods (told by
// the runtime, attachPodNetns), each charged to the projects found in it
// and capped per node and per project (connections.max_netns and
// max_netns_per_project), detached once gone.

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/internal/netnsscan"
	"github.com/fairshare-dev/fairshare/kube"
)

// attachPodNetns attaches inbound admission in the network namespaces of
// the kubernetes source's pods as soon as the source lists them (the scan
// would find them at its next step, from the pods' processes), and forgets
// those of pods gone; the kernel side detaches a link whose namespace is
// gone (DetachGone).
func (p *projects) attachPodNetns(now time.Time, hints []kube.PodNetns) {
	live := make(map[uint64]bool, len(hints))
	budget := podNetnsPerApply
	held := p.heldLinks() // a pod whose project is at its bound takes no place of the budget
	for _, h := range hints {
		f, ino, err := p.openPodNetns(h)
		if err != nil {
			// The pod went (the next poll says so), its sandbox's pid
			// is another process's now, or the runtime's path is no
			// namespace of a pod: nothing is attached by it. Logged
			// once for the pod until the reason changes.
			if p.podRefused[h.Pod] != err.Error() {
				switch {
				case errors.Is(err, netnsscan.ErrNotThatProcess):
					p.log.Warn("a pod's network namespace is not opened: its sandbox's pid is not the pod's process",
						"pod", h.Pod, "project", h.Project, "pid", h.Pid, "err", err)
				case errors.Is(err, netnsscan.ErrNotNetns):
					p.log.Warn("a pod's network namespace is not opened: the runtime's path to it is not a network "+
						"namespace it mounted; the scan finds the namespace from the pod's processes",
						"pod", h.Pod, "project", h.Project, "path", h.Path, "err", err)
				case errors.Is(err, os.ErrNotExist):
					p.log.Debug("a pod's network namespace is gone", "pod", h.Pod, "path", h.Path)
				default:
					p.log.Warn("a pod's network namespace is not opened", "pod", h.Pod, "project", h.Project,
						"path", h.Path, "err", err)
				}
			}
			p.podRefused[h.Pod] = err.Error()
			continue
		}
		delete(p.podRefused, h.Pod)
		live[ino] = true
		// A record of a dead namespace whose number this one has (a
		// sandbox made again) is not this one's.
		// (An id that cannot be read: attached again, which the kernel
		// side makes a no-op for the same namespace.)
		id, idErr := netnsscan.ID(f)
		if a, ok := p.attached[ino]; ok && (idErr != nil || !sameNetns(a.Namespace, netnsscan.Namespace{Inode: ino, ID: id})) {
			delete(p.attached, ino)
		}
		// One tried already is tried again only if a cap refused it (the
		// scan's sweeps retry the others, when there is a scan).
		if a, ok := p.attached[ino]; ok && (a.Attached || !atACap(a.Error) ||
			p.capped(held, netnsscan.Namespace{Inode: ino, ID: id, Projects: []string{h.Project}})) || budget == 0 {
			f.Close()
			continue
		}
		budget--
		a := admin.Namespace{Namespace: netnsscan.Namespace{Inode: ino, ID: id, Path: h.Path, PID: h.Pid, Cgroup: h.Cgroup,
			Projects: []string{h.Project}, Since: now}}
		var info netnsInfo
		err = p.projectCap(a.Projects, ino, id)
		if err == nil {
			info, err = p.kernel.AttachNetns(f, h.Path)
		}
		f.Close()
		switch {
		case errors.Is(err, errProjectNetnsFull):
			a.Error = err.Error()
		case errors.Is(err, errNetnsFull):
			a.Error = err.Error()
			p.atCap(ino, []string{h.Project}, err)
		case err != nil:
			a.Error = err.Error()
			p.log.Warn("inbound admission not attached in a pod's network namespace", "pod", h.Pod, "project", h.Project,
				"inode", ino, "err", err)
		default:
			a.Attached, a.Cookie = true, info.Cookie
			p.settleNetns[info.Cookie] = true
			p.charge(info, id, a.Projects)
			held = p.heldLinks()
			p.belowCap(a.Projects)
			p.log.Info("inbound admission attached in a pod's network namespace", "pod", h.Pod, "project", h.Project,
				"inode", ino, "cookie", info.Cookie)
		}
		p.attached[ino] = a
		p.podNetns[ino] = true
	}
	for pod := range p.podRefused {
		if !slices.ContainsFunc(hints, func(h kube.PodNetns) bool { return h.Pod == pod }) {
			delete(p.podRefused, pod)
		}
	}
	for ino := range p.podNetns {
		if live[ino] {
			continue
		}
		delete(p.podNetns, ino)
		if p.scan == nil || !slices.ContainsFunc(p.scan.Namespaces(), func(n netnsscan.Namespace) bool { return n.Inode == ino }) {
			delete(p.attached, ino)
		}
	}
}

// openPodNetns opens a pod's network namespace: through its sandbox's pid
// while that is a process of the pod's cgroup (netnsscan.OpenPid), else by
// the runtime's path to it, only a network namespace mounted in the
// runtimes' directories (netnsscan.OpenPath: no link followed, no FIFO
// waited on). It returns the namespace's inode.
func (p *projects) openPodNetns(h kube.PodNetns) (*os.File, uint64, error) {
	if h.Pid > 0 {
		return netnsscan.OpenPid(h.Pid, p.mount, h.Cgroup)
	}
	return netnsscan.OpenPath(h.Path)
}

// stepNetns runs one step of the namespace scan and attaches inbound
// admission in the namespaces found (apply has detached it from the dead
// ones first: detachGone).
func (p *projects) stepNetns() {
	ch := p.scan.Step()
	p.netnsFound(ch)
	if !ch.Swept || p.kernel == nil {
		return
	}
	// At the end of each sweep, the namespaces not attached are tried
	// again (a few at a time: an attach loads a program): one refused at
	// the attach cap is attached once others have gone, one whose process
	// left is tried by the process the sweep saw last.
	// One whose projects are all at their bound is not tried (and takes
	// no place of the few): a tenant holding many such namespaces would
	// otherwise take every place, at every sweep, from another's that
	// failed for a passing reason.
	budget := podNetnsPerApply
	held := p.heldLinks()
	for _, n := range p.scan.Namespaces() {
		if a, ok := p.attached[n.Inode]; ok && a.Attached || p.capped(held, n) {
			continue
		}
		if budget == 0 {
			break
		}
		budget--
		p.attachFound(n)
		if p.attached[n.Inode].Attached {
			held = p.heldLinks()
		}
	}
}

// links is what the kernel side's links are charged to (charged), counted
// once for a pass over many namespaces.
type links struct {
	held   map[string]int      // links by project
	linked map[uint64][]uint64 // the namespaces with a link: ids by inode
}

// heldLinks counts the links the kernel side holds (charged).
func (p *projects) heldLinks() links {
	l := links{held: map[string]int{}, linked: map[uint64][]uint64{}}
	for _, c := range p.charged {
		for _, pr := range c.projects {
			l.held[pr]++
		}
		l.linked[c.inode] = append(l.linked[c.inode], c.id)
	}
	return l
}

// capped says whether projectCap would refuse namespace n, by l: each of
// its projects holds connections.max_netns_per_project links, none of them
// n's own.
func (p *projects) capped(l links, n netnsscan.Namespace) bool {
	if p.netnsPerProject <= 0 || len(n.Projects) == 0 {
		return false
	}
	if slices.ContainsFunc(l.linked[n.Inode], func(id uint64) bool { return sameNetns(netnsscan.Namespace{Inode: n.Inode, ID: id}, n) }) {
		return false
	}
	for _, pr := range n.Projects {
		if l.held[pr] < p.netnsPerProject {
			return false
		}
	}
	return true
}

// netnsFound attaches inbound admission in the namespaces a read of the scan
// found new, and has those attached already that it found joined walked.
func (p *projects) netnsFound(ch netnsscan.Changes) {
	// Gone first: a namespace whose inode number another has now is gone
	// and new in one read.
	for _, n := range ch.Gone {
		// Its link stays (DetachGone detaches it once the namespace is
		// dead), and so does its charge to its projects.
		if a, ok := p.attached[n.Inode]; ok && sameNetns(a.Namespace, n) {
			delete(p.attached, n.Inode)
		}
		p.log.Debug("network namespace without project processes, or dead", "inode", n.Inode, "id", n.ID)
	}
	for _, n := range ch.New {
		if a, ok := p.attached[n.Inode]; ok && a.Attached && sameNetns(a.Namespace, n) {
			// Attached already, by the kubernetes source's word: walked
			// if the scan found in it a process of another member than
			// the pod's, as for a namespace joined.
			if slices.ContainsFunc(n.Members, func(m string) bool { return !related(m, a.Cgroup) }) {
				p.settleNetns[a.Cookie] = true
			}
			a.Namespace = n
			p.attached[n.Inode] = a
			continue
		}
		p.attachFound(n)
	}
	for _, n := range ch.Joined {
		// A namespace attached already, in which a member's processes
		// were seen for the first time (a tenant's process that entered
		// another's namespace): that member's listeners there, opened
		// before it was one, are counted now, by a walk of it.
		if a, ok := p.attached[n.Inode]; ok && a.Attached && sameNetns(a.Namespace, n) {
			a.Namespace = n
			p.attached[n.Inode] = a
			p.settleNetns[a.Cookie] = true
		}
	}
}

// sameNetns says whether a and b, of one inode number, are one namespace:
// their ids are (where the kernel gives ids: a dead namespace's number is
// given to the next one made).
func sameNetns(a, b netnsscan.Namespace) bool {
	return a.Inode == b.Inode && (a.ID == 0 || b.ID == 0 || a.ID == b.ID)
}

// detachGone has the kernel side detach the links of dead namespaces, and
// ends their charge to their projects. A dead namespace's record goes with
// its link, here and in the scan: the kernel gives its inode number to the
// next namespace made (the lowest free), and a pod's sandbox made again, or
// a tenant's process unsharing again, would otherwise be taken for the
// dead one, shown attached and never attached (its SYNs admitted).
func (p *projects) detachGone() {
	gone, err := p.kernel.DetachGone()
	if err != nil {
		p.log.Warn("detaching from gone network namespaces failed", "err", err)
	}
	for _, g := range gone {
		delete(p.charged, g.Cookie)
		if a, ok := p.attached[g.Inode]; ok && a.Cookie == g.Cookie {
			delete(p.attached, g.Inode)
			delete(p.podNetns, g.Inode)
			if p.scan != nil {
				p.scan.Forget(g.Inode) // found again as new, if a namespace has its inode
			}
		}
		p.log.Info("inbound admission detached from a gone network namespace", "inode", g.Inode, "cookie", g.Cookie)
	}
}

// attachFound attaches inbound admission in a namespace the scan found,
// opened through its process's pidfd while the process is in the member's
// cgroup where the scan saw it: one that exited and whose pid was reused
// since names another namespace, maybe another tenant's, which must not get
// the link. A refusal at the attach cap is logged once until an attach
// succeeds again; another error once for the namespace until it changes.
func (p *projects) attachFound(n netnsscan.Namespace) {
	prev := p.attached[n.Inode]
	a := admin.Namespace{Namespace: n}
	if p.kernel == nil {
		p.attached[n.Inode] = a
		return
	}
	var info netnsInfo
	ino := n.Inode
	err := p.projectCap(n.Projects, n.Inode, n.ID)
	if err == nil {
		var f *os.File
		if f, ino, err = netnsscan.OpenPid(n.PID, p.mount, n.Cgroup); err == nil {
			if ino == n.Inode {
				info, err = p.kernel.AttachNetns(f, n.Path)
			}
			f.Close()
		}
	}
	switch {
	case errors.Is(err, errProjectNetnsFull):
		a.Error = err.Error()
	case errors.Is(err, netnsscan.ErrNotThatProcess) || err == nil && ino != n.Inode:
		// The process left, or its namespace: tried again after the
		// next sweep.
		a.Error = fmt.Sprintf("process %d left its namespace or its cgroup before the attach", n.PID)
	case errors.Is(err, errNetnsFull):
		a.Error = err.Error()
		p.atCap(n.Inode, n.Projects, err)
	case err != nil:
		a.Error = err.Error()
		if prev.Error != a.Error {
			p.log.Warn("inbound admission not attached in a network namespace", "inode", n.Inode, "path", n.Path,
				"projects", n.Projects, "err", err)
		}
	default:
		a.Attached, a.Cookie = true, info.Cookie
		p.settleNetns[info.Cookie] = true
		p.charge(info, n.ID, n.Projects)
		p.belowCap(n.Projects)
		p.log.Info("inbound admission attached in a network namespace", "inode", n.Inode, "cookie", info.Cookie,
			"projects", n.Projects)
	}
	p.attached[n.Inode] = a
}

// atCap logs, once until an attach succeeds again, that an attach met the
// cap on attached namespaces: a tenant that makes namespaces by the
// thousand costs one line, not one per namespace and sweep.
func (p *projects) atCap(ino uint64, projects []string, err error) {
	if p.netnsFull {
		return
	}
	p.netnsFull = true
	p.log.Warn("network namespaces are at the attach cap (connections.max_netns): new ones of the projects are not "+
		"enforced inbound until attached ones go, and are tried again at each sweep; those attached stay enforced "+
		"('fairshare project list' shows which are waiting)", "inode", ino, "projects", projects, "err", err)
}

// belowCap notes an attach that succeeded, for a namespace of projects.
func (p *projects) belowCap(projects []string) {
	if p.netnsFull {
		p.netnsFull = false
		p.log.Info("network namespaces are below the attach cap again: those waiting are attached at the next sweeps")
	}
	for _, pr := range projects {
		delete(p.projectFull, pr)
	}
}

// atACap says whether an attach's error is a refusal at max_netns or
// max_netns_per_project: one to try again once links have gone.
func atACap(err string) bool {
	return strings.Contains(err, errProjectNetnsFull.Error()) || strings.Contains(err, errNetnsFull.Error())
}

// netnsCharge is a link the kernel side holds: its namespace's inode and
// the projects it was attached for.
type netnsCharge struct {
	inode, id uint64 // id: the namespace's (Namespace.ID), 0 if unknown
	projects  []string
}

// charge charges the link of an attach to projects, for the link's life. A
// namespace attached already (AttachNetns is idempotent by namespace) adds
// the new projects to its charge; the daemon's own namespace has no link.
func (p *projects) charge(info netnsInfo, id uint64, projects []string) {
	if info.Cookie == 0 || info.Inode == p.ownNetns {
		return
	}
	c := p.charged[info.Cookie]
	c.inode, c.id = info.Inode, id
	for _, pr := range projects {
		if !slices.Contains(c.projects, pr) {
			c.projects = append(c.projects, pr)
		}
	}
	p.charged[info.Cookie] = c
}

// projectCap refuses the attach of a namespace of projects (inode ino) when
// each of them holds netnsPerProject links already, and logs it once for a
// project until one of its namespaces is attached again: a tenant making
// namespaces takes at most its bound of the attach cap from the others. A
// project holds a link from its attach until its namespace is dead, whether
// or not a process of the project is still in it (charged); the namespace
// ino (of id, 0 if unknown) itself, attached already, takes no new link. A
// dead namespace's charge, kept until its link is detached, is not the
// charge of one made since with its inode number.
func (p *projects) projectCap(projects []string, ino, id uint64) error {
	l := p.heldLinks()
	if !p.capped(l, netnsscan.Namespace{Inode: ino, ID: id, Projects: projects}) {
		return nil
	}
	held := l.held
	err := fmt.Errorf("%w: %s each %d", errProjectNetnsFull, strings.Join(projects, ", "), p.netnsPerProject)
	for _, pr := range projects {
		if !p.projectFull[pr] {
			p.projectFull[pr] = true
			p.log.Warn("a project is at its bound of attached network namespaces (connections.max_netns_per_project): "+
				"its new ones are not enforced inbound until some go; other projects' are", "project", pr,
				"attached", held[pr])
		}
	}
	return err
}

// errProjectNetnsFull refuses an attach for a namespace whose projects are
// each at connections.max_netns_per_project.
var errProjectNetnsFull = errors.New("network namespaces attached at connections.max_netns_per_project")
