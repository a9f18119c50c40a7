// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/membership"
	"github.com/fairshare-dev/fairshare/internal/netnsscan"
	"github.com/fairshare-dev/fairshare/internal/project"
	"github.com/fairshare-dev/fairshare/kube"
	"github.com/fairshare-dev/fairshare/loader"
	"github.com/fairshare-dev/fairshare/policy"
)

// logEach bounds the lines one apply logs per kind of change (members
// added, removed, refused); the rest are one summary line.
const logEach = 20

// unreadHold bounds how long, after the daemon starts with a kernel that
// holds members, those members are left as they are while a source has not
// been read once (a container runtime that is slow to answer): the union
// without that source would take its members out of the kernel until it
// answers. Past it the sources read are applied.
const unreadHold = 30 * time.Second

// applyWait bounds how long a registration waits for the apply that puts
// it in force before it answers Pending.
const applyWait = 5 * time.Second

// projects is the daemon's membership: the sources, their union in force,
// the network namespaces of the members' processes, and the view Status
// and the admin API read. The control loop applies it: at each tick (the
// sources read again, the union, the kernel's members, one step of the
// namespace scan) and at once when a source reports a change (without the
// scan step). Registrations through the admin API are stored, then wait
// for the next apply.
type projects struct {
	log     *slog.Logger
	mount   cgroup.Mount  // Point "" without cgroup2
	paths   *cgroup.Paths // mount's PathOf, its answers kept a second (projectOf)
	root    string        // projects_root of the directory or systemd source, "" without one
	sources []membership.Source
	reg     *membership.Static // the registered source; nil when not configured
	kube    *kube.Source       // the kubernetes source; nil when not configured
	store   *policy.Store
	scan    *netnsscan.Scanner // nil when the scan could not start
	kernel  memberKernel       // nil without BPF (kernel.go)
	// netnsPerProject is connections.max_netns_per_project.
	netnsPerProject int
	wake            chan struct{}
	closers         []io.Closer

	regMu   sync.Mutex // serialises registrations; guards the fields below
	regs    []membership.Member
	pending []membership.Entry // stored, and not read by an apply yet

	waitMu  sync.Mutex      // guards the field below
	waiters []chan struct{} // closed when the next apply ends

	applyMu  sync.Mutex // serialises apply; guards the fields below
	found    map[string]*sourceState
	applied  bool      // an apply ran
	first    time.Time // the first apply's time
	holding  bool      // the kernel's members are held for an unread source
	inForce  membership.Result
	changed  time.Time
	logged   map[membership.Refusal]bool // refusals reported, so each is logged once
	kRefused []membership.Refusal        // refused by the kernel side
	kErr     string
	attached map[uint64]admin.Namespace // by inode: attach attempts and results
	podNetns map[uint64]bool            // attached by the kubernetes source's word, by inode
	// charged is, by cookie, each link the kernel side holds and the
	// projects it was attached for, from the attach until DetachGone
	// reports the namespace dead: what max_netns_per_project counts (a
	// namespace kept alive by an open file, with no process left in it,
	// leaves the scan but keeps its link and its slot of max_netns).
	charged map[uint64]netnsCharge
	// self is the daemon's own cgroup (a directory below mount), "" if
	// unknown; podRoots are kubernetes.pod_cgroups.
	self     string
	selfHeld bool // holdSelf has made self a member
	// podsNone lists the pods of no project (the kubernetes source's
	// NoProject); nil without the kubernetes source. none is that list as
	// the last apply read it: what the kernel's extras and the front's
	// placing (inPodRoot) use, so that neither waits on the source.
	podsNone func() []string
	// applies is closed (done) once the control loop, which applies,
	// stops (set by Daemon.Run before the admin API serves); nil before.
	applies <-chan struct{}
	none    atomic.Pointer[[]string]
	// noPodRootWarned: no pod root was found (logged once).
	noPodRootWarned bool
	podRoots        []string
	podRootDirs     []string // podRoots below the mount's point, as paths
	podRootsBelow   []string // podRootDirs each with a trailing '/'

	// ownNetns is the inode of the daemon's own network namespace, which
	// the kernel side attaches at Open: no project's.
	ownNetns uint64
	// pods whose namespace was not opened, and why (logged once)
	podRefused map[string]string
	// an attach met the cap, and none succeeded since (logged once)
	netnsFull bool
	// What the kernel side has to settle (memberKernel.Settle) before the
	// membership is published: the host's namespace after the kernel's
	// members changed, and the attached namespaces a change concerns (newly
	// attached, or found in a cgroup whose member changed), by cookie. Kept
	// until a Settle succeeds.
	settleHost  bool
	settleNetns map[uint64]bool
	// projects whose attach met connections.max_netns_per_project, and
	// none of theirs succeeded since (logged once)
	projectFull map[string]bool

	view atomic.Pointer[admin.Membership]
	tree atomic.Pointer[membership.Tree]
}

// ownCgroup is the daemon's own cgroup dir (err: why it is unknown), as
// kernelExtras registers it in no project, or "" when it cannot be: unknown,
// or the mount point itself (a daemon started from a root shell without
// systemd, or in a container without a cgroup of its own). The mount point
// cannot be a member (it is every cgroup's ancestor), so the daemon's own
// connections and listeners are then out of the projects only while no
// project claims the cgroup tree's root, and under Kubernetes its own
// namespace is not found: both are warned of at start.
func ownCgroup(mount cgroup.Mount, dir string, err error, log *slog.Logger) string {
	switch {
	case err != nil:
		log.Warn("the daemon's own cgroup is unknown: its own connections are not kept out of the projects", "err", err)
		return ""
	case dir == mount.Point:
		log.Warn("the daemon runs in the root of the cgroup tree, not in a cgroup of its own: it cannot exempt itself "+
			"(its connections and listeners stay out of the projects only while no project's member is above it, and under "+
			"Kubernetes its own namespace is not found); run it from its systemd unit, or in a scope of its own "+
			"(systemd-run --scope fairshare run ...)", "cgroup", dir)
		return ""
	}
	return dir
}

// lastFound is a source that keeps its last good scan across restarts
// (kube.Source).
type lastFound interface {
	Last() (membership.Found, bool)
}

type sourceState struct {
	found   membership.Found
	err     string
	scanned time.Time
	read    bool // a scan succeeded
}

// newProjects builds the sources of cfg.Projects. A projects root that is
// not on cgroup2 or cannot be made is the configuration's error. With create
// (BPF on: the daemon owns the root, as the kernel side used to), the
// directory source makes a missing root.
func newProjects(cfg config.Config, store *policy.Store, create bool, log *slog.Logger) (*projects, error) {
	if err := checkProjects(cfg); err != nil {
		return nil, err // before the directory source makes a missing root
	}
	p := &projects{log: log.With("part", "projects"), store: store, wake: make(chan struct{}, 1),
		found: map[string]*sourceState{}, logged: map[membership.Refusal]bool{}, attached: map[uint64]admin.Namespace{},
		podNetns: map[uint64]bool{}, charged: map[uint64]netnsCharge{}, podRefused: map[string]string{}, projectFull: map[string]bool{},
		settleNetns:     map[uint64]bool{},
		netnsPerProject: cfg.Connections.MaxNetnsPerProject}
	var st syscall.Stat_t
	if syscall.Stat("/proc/thread-self/ns/net", &st) == nil {
		p.ownNetns = st.Ino
	}
	mount, err := cgroup.FindMount()
	if err != nil {
		p.log.Warn("no cgroup2 mount: no project has members, so nothing is placed in a project by its cgroup", "err", err)
	}
	p.mount = mount
	p.paths = cgroup.NewPaths(mount, time.Second, nil)
	if mount.Point != "" {
		d, err := mount.OfPID(os.Getpid())
		p.self = ownCgroup(mount, d, err, p.log)
	}
	// A source is a case here and a name in config.ProjectSources; the
	// order of the list is its priority in a conflict. A source that polls
	// something slow is a membership.Polled appended to p.sources and
	// p.closers, so the loop's Scan never waits on it (the kubernetes
	// source, kube.Source, is one).
	for _, name := range cfg.Projects.Sources {
		switch name {
		case membership.SourceDirectory, membership.SourceSystemd:
			if mount.Point == "" {
				continue
			}
			root, err := ProjectsRoot(cfg)
			if err != nil {
				return nil, err
			}
			var src *membership.Children
			if name == membership.SourceDirectory {
				_, statErr := os.Stat(root)
				src, err = membership.NewDirectory(root, create)
				if err == nil && errors.Is(statErr, fs.ErrNotExist) {
					// Said, so that a mistyped --projects-root is seen.
					p.log.Info("made the projects root: it did not exist", "projects_root", root)
				}
			} else {
				src, err = membership.NewSystemd(root)
			}
			if err != nil {
				p.close()
				return nil, fmt.Errorf("%w: projects_root: %w", config.ErrInvalid, err)
			}
			if name == membership.SourceDirectory && filepath.Ext(root) == ".slice" {
				p.log.Warn("projects_root is a systemd slice but the source is directory: projects are named fairshare-<name>.slice; "+
					"use projects.sources [systemd, registered] to name them <name>", "projects_root", root)
			}
			p.root = root
			p.sources = append(p.sources, src)
			p.closers = append(p.closers, src)
		case membership.SourceRegistered:
			p.reg = membership.NewStatic(membership.SourceRegistered)
			regs, err := store.Members()
			if err != nil {
				p.close()
				return nil, err
			}
			p.regs = regs
			p.reg.Set(regs)
			p.sources = append(p.sources, p.reg)
		case membership.SourceKubernetes:
			if mount.Point == "" {
				continue
			}
			p.setPodRoots(cfg.Kubernetes.PodCgroups)
			src, err := newKube(cfg, mount, p.self, p.log)
			if err != nil {
				p.close()
				return nil, err
			}
			p.kube, p.podsNone = src, src.NoProject
			p.sources = append(p.sources, src)
			p.closers = append(p.closers, src)
		}
	}
	if p.scan, err = netnsscan.New(netnsscan.Options{}); err != nil {
		p.log.Warn("network namespaces of the projects are not looked for", "err", err)
	} else if !p.scan.Stats().NamespaceIDs {
		p.log.Info("this kernel gives network namespaces no ids (NS_GET_ID, Linux 6.18): they are told apart by inode " +
			"number, which a namespace made after one died can have; the dead one's link is detached first at each tick")
	}
	p.publish()
	return p, nil
}

// checkProjects checks the projects root as newProjects will take it,
// without making it: a slice for the systemd source, and on cgroup2 (or
// below the cgroup2 mount, if it is not made yet).
func checkProjects(cfg config.Config) error {
	dirs := cfg.Projects.Has(membership.SourceDirectory)
	slice := cfg.Projects.Has(membership.SourceSystemd)
	if !dirs && !slice {
		return nil
	}
	mount, err := cgroup.FindMount()
	if err != nil {
		return nil // newProjects runs without these sources, and says so
	}
	root, err := ProjectsRoot(cfg)
	if err != nil {
		return err
	}
	if slice {
		if _, err := membership.SliceRoot(root); err != nil {
			return fmt.Errorf("%w: projects_root: %w", config.ErrInvalid, err)
		}
	}
	if err := cgroup.OnCgroup2(root); errors.Is(err, cgroup.ErrNotCgroup2) || err != nil && !mount.Contains(root) {
		return fmt.Errorf("%w: projects_root: %s is not a directory below the cgroup2 mount %s", config.ErrInvalid, root, mount.Point)
	}
	return nil
}

func (p *projects) close() error {
	var errs []error
	for _, c := range p.closers {
		errs = append(errs, c.Close())
	}
	p.closers = nil
	return errors.Join(errs...)
}

// watch forwards the sources' change notifications to the loop's wake
// channel until ctx is done.
func (p *projects) watch(ctx context.Context) {
	for _, s := range p.sources {
		n, ok := s.(membership.Notifier)
		if !ok || s == membership.Source(p.reg) {
			continue // the registered source wakes the loop itself
		}
		go func() {
			for {
				select {
				case <-ctx.Done():
					return
				case <-n.Changed():
					p.kick()
				}
			}
		}()
	}
}

// kick asks the loop for an apply.
func (p *projects) kick() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// applied returns a channel closed when an apply that begins after the
// call has ended, and asks the loop for one.
func (p *projects) nextApply() <-chan struct{} {
	ch := make(chan struct{})
	p.waitMu.Lock()
	p.waiters = append(p.waiters, ch)
	p.waitMu.Unlock()
	p.kick()
	return ch
}

// apply reads the sources, and when what they say changed, unions them and
// hands the members in force to the kernel side and the namespace scan.
// With tick, it also gives the kernel its members again (a cgroup made
// again at the same path has a new id) and runs one step of the scan.
func (p *projects) apply(ctx context.Context, now time.Time, tick bool) {
	p.waitMu.Lock()
	waiters := p.waiters
	p.waiters = nil
	p.waitMu.Unlock()
	defer func() {
		for _, w := range waiters {
			close(w)
		}
	}()
	p.regMu.Lock()
	covered := len(p.pending) // the pending registrations this apply reads
	p.regMu.Unlock()

	p.applyMu.Lock()
	defer p.applyMu.Unlock()
	// A new pod of no project (a system namespace's) changes no member:
	// the kernel's extras are written again for it at once all the same.
	noneChanged := false
	if p.podsNone != nil {
		if cur := p.podsNone(); p.none.Load() == nil || !slices.Equal(cur, *p.none.Load()) {
			p.none.Store(&cur)
			noneChanged = true
		}
	}
	changed := !p.applied
	if !p.applied && p.kernel != nil {
		// After a restart the kernel's members are the ones in force: a
		// newcomer that conflicts with one loses, as it did before.
		// They carry no source (Source ""); their tree places peers while
		// an unread source holds them (unreadHold).
		if ms, err := p.kernel.Members(); err == nil {
			// The extras are the daemon's own (kernelExtras), no source's.
			ms = slices.DeleteFunc(ms, func(m membership.Member) bool {
				return m.Project == loader.Unclassified || m.Project == loader.NoProject
			})
			p.inForce = membership.Resolve([]membership.Input{{Found: membership.Found{Members: ms}}}, nil)
			p.tree.Store(p.inForce.Tree)
			if p.scan != nil {
				p.scan.SetMembers(p.inForce.Accepted)
			}
		} else {
			p.log.Warn("the kernel's members could not be read; conflicts are settled by source order", "err", err)
		}
	}
	if !p.applied {
		p.first = now
	}
	p.applied = true
	inputs := make([]membership.Input, 0, len(p.sources))
	var unread []string
	for _, s := range p.sources {
		st := p.found[s.Name()]
		if st == nil {
			st = &sourceState{}
			if l, ok := s.(lastFound); ok {
				// Until it is read, the source's members of the last run
				// stay in force (a runtime away while the daemon restarts).
				st.found, _ = l.Last()
			}
			p.found[s.Name()] = st
		}
		f, err := s.Scan(ctx)
		st.scanned = now
		switch {
		case err != nil:
			if st.err != err.Error() && !errors.Is(err, membership.ErrNotRead) {
				p.log.Warn("a source of members could not be read; its last members stay in force", "source", s.Name(), "err", err)
			}
			st.err = err.Error()
		default:
			st.read = true
			if st.err != "" {
				p.log.Info("a source of members is read again", "source", s.Name())
				st.err = ""
				changed = true
			}
			if !foundEqual(st.found, f) {
				st.found = f
				changed = true
			}
		}
		inputs = append(inputs, membership.Input{Source: s.Name(), Found: st.found})
		if !st.read {
			unread = append(unread, s.Name())
		}
	}
	// After a restart, the kernel's members stay as they are (and the
	// members in force are those) until every source has been read once, or
	// unreadHold passes.
	hold := p.kernel != nil && len(unread) > 0 && now.Sub(p.first) < unreadHold
	switch {
	case hold && !p.holding:
		p.log.Info("the kernel's members are kept as they are until every source has been read once",
			"unread", unread, "at_most", unreadHold)
	case !hold && p.holding:
		p.log.Info("every source has been read, or the wait is over: applying the members", "unread", unread)
		changed = true
	}
	p.holding = hold
	if hold {
		changed = false
	}
	if changed {
		res := membership.Resolve(inputs, p.inForce.Accepted)
		ch := membership.Diff(p.inForce.Accepted, res.Accepted)
		p.logChanges(ch, len(res.Accepted))
		p.logRefusals(res.Refused)
		p.inForce = res
		p.tree.Store(res.Tree)
		if !ch.Empty() {
			p.changed = now
		}
		if p.scan != nil {
			p.scan.SetMembers(res.Accepted)
		}
	}
	switch {
	case p.kernel != nil && !hold && (changed || tick || noneChanged):
		p.setKernelMembers()
	case p.kernel != nil && hold:
		p.holdSelf()
	}
	p.regMu.Lock()
	p.pending = p.pending[covered:]
	p.regMu.Unlock()
	p.netns(now, tick, changed)
	p.settle(ctx)
	p.publish()
}

// netns follows the members' network namespaces at an apply: at a tick,
// first the links of dead namespaces are detached and their records
// dropped (a namespace made since with one's inode number is then a new one
// to the reads below, not the dead one); then the kubernetes source's pods'
// namespaces are attached, and the scan steps (at a tick) or reads the new
// members (at a change: a namespace of theirs is attached, or, shared,
// walked, before the change is shown).
func (p *projects) netns(now time.Time, tick, changed bool) {
	if tick && p.kernel != nil {
		p.detachGone()
	}
	if p.kube != nil && p.kernel != nil {
		p.attachPodNetns(now, p.kube.Netns())
	}
	switch {
	case tick && p.scan != nil:
		p.stepNetns()
	case changed && p.scan != nil:
		p.netnsFound(p.scan.ReadNew())
	}
}

// settleChanged notes the cgroups whose kernel members were written or
// removed: the host's namespace is walked, and each attached namespace
// whose processes were found at, below or above one of them.
func (p *projects) settleChanged(cgroups []string) {
	if len(cgroups) == 0 {
		return
	}
	p.settleHost = true
	for _, a := range p.attached {
		if !a.Attached {
			continue
		}
		// Where a process in it was found, and the members whose
		// processes were found in it (a namespace shared by several): as
		// recorded at its attach or last join, and as the scan knows
		// them now (a record the kubernetes source made has none).
		var scanned []string
		if p.scan != nil {
			scanned = p.scan.MembersOf(a.Inode)
		}
		if slices.ContainsFunc(cgroups, func(cg string) bool {
			in := func(m string) bool { return related(m, cg) }
			return related(a.Cgroup, cg) || slices.ContainsFunc(a.Members, in) || slices.ContainsFunc(scanned, in)
		}) {
			p.settleNetns[a.Cookie] = true
		}
	}
}

// related says cgroup a is b, or above or below it.
func related(a, b string) bool {
	return a != "" && b != "" && (a == b || strings.HasPrefix(a, b+"/") || strings.HasPrefix(b, a+"/"))
}

// settle has the kernel side count what the changes of this apply (or of
// one whose Settle failed) concern, before the membership is published: a
// member or namespace shown in force has its listeners counted.
func (p *projects) settle(ctx context.Context) {
	if p.kernel == nil || !p.settleHost && len(p.settleNetns) == 0 {
		return
	}
	if err := p.kernel.Settle(ctx, p.settleHost, slices.Collect(maps.Keys(p.settleNetns))); err != nil {
		return // logged by the kernel side; tried again at the next apply
	}
	p.settleHost = false
	clear(p.settleNetns)
}

// kubePollMin bounds how often the runtime is asked for its pods, whatever
// the tick: a poll may take as long as the period between two (Polled), and
// a list of a hundred sandboxes needs more than the 10ms the tick can be.
const kubePollMin = 200 * time.Millisecond

// kubeCache is the file in state_dir where the kubernetes source keeps the
// pods it last read.
const kubeCache = "kubernetes-pods.json"

// newKube starts the kubernetes source: the pods of the runtime at
// kubernetes.runtime_endpoint, polled each tick. A runtime that is not
// there is no error here: the source reports it, and is read when it comes.
func newKube(cfg config.Config, mount cgroup.Mount, self string, log *slog.Logger) (*kube.Source, error) {
	k := cfg.Kubernetes
	cri, err := kube.DialCRI(k.Endpoint())
	if err != nil {
		return nil, fmt.Errorf("%w: kubernetes.runtime_endpoint: %w", config.ErrInvalid, err)
	}
	// A pod's sandbox's process must be in the cgroup the runtime reports
	// for the pod, placed through the mount as the daemon sees it (in a
	// private cgroup namespace too).
	checkPid := func(pid int, dir string) error { return netnsscan.CheckPid(pid, mount, dir) }
	src := kube.NewSource(kube.SourceOptions{CRI: cri, Rules: kubeRules(cfg), Mount: mount.Point, PodCgroups: k.PodCgroups,
		CheckPid: checkPid, Every: max(cfg.Tick, kubePollMin), Self: self,
		Log: log.With("source", membership.SourceKubernetes), Cache: filepath.Join(cfg.StateDir, kubeCache)})
	log.Info("pods are read from the container runtime over the CRI, each tick and at its container events where it has them",
		"endpoint", cri.Endpoint(), "project_label", k.ProjectLabel, "namespace_projects", k.NamespaceProjects,
		"system_namespaces", k.SystemNamespaces, "pod_cgroups", k.PodCgroups)
	return src, nil
}

// kubeRules are the project rules of the kubernetes section; the front's
// exempt projects are reserved: a pod label may not name one.
func kubeRules(cfg config.Config) kube.Rules {
	k := cfg.Kubernetes
	return kube.Rules{ProjectLabel: k.ProjectLabel, Namespaces: k.NamespaceProjects, System: k.SystemNamespaces,
		Validate: project.Validate, Reserved: cfg.Front.Exempt.Projects}
}

// CheckKubernetes asks the runtime of the kubernetes source for its pods,
// for 'run --check': what it found, or why it does not answer (an error the
// daemon would run with: it reads the pods once the runtime answers).
func CheckKubernetes(ctx context.Context, cfg config.Config) (string, error) {
	k := cfg.Kubernetes
	cri, err := kube.DialCRI(k.Endpoint())
	if err != nil {
		return "", err
	}
	defer cri.Close()
	version, err := cri.Ping(ctx)
	if err != nil {
		return "", err
	}
	pods, err := cri.Pods(ctx)
	if err != nil {
		return "", err
	}
	rules := kubeRules(cfg)
	projects := map[string]bool{}
	in, system, unusable, pending := 0, 0, 0, 0
	for _, p := range pods {
		if p.Pending != "" {
			pending++
			continue
		}
		if p.Unusable != "" || kube.CheckPodCgroup(p.Cgroup, p.UID, k.PodCgroups) != nil {
			unusable++
			continue
		}
		switch name, _ := rules.Project(p); {
		case name != "":
			in++
			projects[name] = true
		case slices.Contains(k.SystemNamespaces, p.Namespace):
			system++
		}
	}
	line := fmt.Sprintf("the container runtime at %s answers (%s): %d ready pods, %d of them in %d projects, %d of system namespaces",
		cri.Endpoint(), version, len(pods), in, len(projects), system)
	if unusable > 0 {
		line += fmt.Sprintf(", %d whose status has no usable cgroup, or one outside kubernetes.pod_cgroups ('fairshare project list' says why)", unusable)
	}
	if pending > 0 {
		line += fmt.Sprintf(", %d whose status the runtime did not give in time or failed to give (asked again at each poll)", pending)
	}
	// How fast a new pod is classified: at its sandbox's start, or at the
	// next poll (kube.Source.follow).
	if name, v, err := cri.Version(ctx); err == nil {
		if why := kube.EventsShared(name, v); why != "" {
			line += "; new pods are found by the polls, each tick (its container events are not followed: " + why + ")"
		} else {
			line += "; new pods are read at its container events, as their sandbox starts"
		}
	}
	return line, nil
}

// podNetnsPerApply bounds the pods' namespaces attached in one apply: an
// attach loads a program (tens of milliseconds), and a node whose hundred
// pods are all new (the daemon's first start) must not stall the loop for
// seconds; the rest follow at the next applies, or from the scan.
const podNetnsPerApply = 8

// foundEqual compares two scans.
func foundEqual(a, b membership.Found) bool {
	return slices.Equal(a.Members, b.Members) && slices.Equal(a.Skipped, b.Skipped)
}

// logChanges logs what the union changed: each member added, removed or
// moved at Info up to logEach of each, the rest counted in one line.
func (p *projects) logChanges(ch membership.Changes, total int) {
	for i, e := range ch.Added {
		if i == logEach {
			p.log.Info("more members added", "count", len(ch.Added)-logEach)
			break
		}
		p.log.Info("member added", "project", e.Project, "cgroup", e.Cgroup, "source", e.Source)
	}
	for i, e := range ch.Removed {
		if i == logEach {
			p.log.Info("more members removed", "count", len(ch.Removed)-logEach)
			break
		}
		p.log.Info("member removed", "project", e.Project, "cgroup", e.Cgroup, "source", e.Source)
	}
	// A member the kernel had (no source) now named by its source is no
	// change to speak of.
	ch.Moved = slices.DeleteFunc(ch.Moved, func(m membership.Move) bool {
		return m.From.Source == "" && m.From.Member == m.To.Member
	})
	for i, m := range ch.Moved {
		if i == logEach {
			p.log.Info("more members moved", "count", len(ch.Moved)-logEach)
			break
		}
		p.log.Info("member moved", "cgroup", m.To.Cgroup, "from", m.From.Project, "to", m.To.Project,
			"from_source", m.From.Source, "to_source", m.To.Source)
	}
	if !ch.Empty() {
		p.log.Debug("members in force", "count", total)
	}
}

// logRefusals logs each refusal once, when it first appears, and says when
// one is no more.
func (p *projects) logRefusals(rs []membership.Refusal) {
	now := make(map[membership.Refusal]bool, len(rs))
	fresh := 0
	for _, r := range rs {
		now[r] = true
		if p.logged[r] {
			continue
		}
		if fresh++; fresh <= logEach {
			p.log.Warn("member refused", "project", r.Project, "cgroup", r.Cgroup, "source", r.Source, "reason", r.Reason)
		}
	}
	if fresh > logEach {
		p.log.Warn("more members refused; 'fairshare project list' shows them all", "count", fresh-logEach)
	}
	for r := range p.logged {
		if !now[r] {
			p.log.Info("member no longer refused", "project", r.Project, "cgroup", r.Cgroup, "source", r.Source)
		}
	}
	p.logged = now
}

// kernelExtras are the kernel's members besides those in force, which no
// source reports and no conflict can take away:
//
//   - under Kubernetes, the pod roots (kubernetes.pod_cgroups) and their QoS
//     children, weak members of loader.Unclassified: a pod not classified
//     yet (new, or while no daemon runs) counts for it, under the rule;
//   - the cgroups of the pods the rules put in no project (system
//     namespaces, the daemon's own namespace), loader.NoProject below them;
//   - the daemon's own cgroup, loader.NoProject: its own connections and
//     listeners (/metrics, /healthz, the front) are never refused.
func (p *projects) kernelExtras() []membership.Member {
	var out []membership.Member
	if p.podsNone != nil {
		found := false
		for i, root := range p.podRoots {
			dir := p.podRootDirs[i]
			if _, err := os.Stat(dir); err != nil {
				continue
			}
			found = true
			out = append(out, membership.Member{Project: loader.Unclassified, Cgroup: dir})
			for _, qos := range qosChildren(root) {
				q := filepath.Join(dir, qos)
				if _, err := os.Stat(q); err == nil {
					out = append(out, membership.Member{Project: loader.Unclassified, Cgroup: q})
				}
			}
		}
		for _, cg := range p.noneList() {
			out = append(out, membership.Member{Project: loader.NoProject, Cgroup: cg})
		}
		if !found && !p.noPodRootWarned {
			// Pods elsewhere (kubelet's cgroup v1 hierarchy on a hybrid
			// host, other pod_cgroups) are counted in no project until
			// the runtime has been read for them: nothing holds them
			// from their first connect.
			p.noPodRootWarned = true
			p.log.Warn("none of kubernetes.pod_cgroups is a directory of the cgroup2 mount: a new pod is not limited until the container runtime has been read for it",
				"pod_cgroups", p.podRoots, "mount", p.mount.Point)
		}
	}
	if self, ok := p.selfMember(); ok && !slices.ContainsFunc(out, func(m membership.Member) bool { return m.Cgroup == p.self }) {
		out = append(out, self)
	}
	return out
}

// selfMember is the daemon's own cgroup as a no-project member, where it
// could be counted in a project otherwise (in a pod, or below the projects
// root): its own connections are never refused.
func (p *projects) selfMember() (membership.Member, bool) {
	if p.self != "" && (p.kube != nil || p.root != "" && strings.HasPrefix(p.self, p.root+"/")) {
		return membership.Member{Project: loader.NoProject, Cgroup: p.self}, true
	}
	return membership.Member{}, false
}

// holdSelf makes the daemon's own cgroup a no-project member of the kernel
// while the kernel's members are held (a source unread after a restart),
// once: a daemon started again in a new pod (a rollout) has a cgroup the
// kernel's members do not name, and until every source has been read (up
// to unreadHold) its own connections and listeners would otherwise count in
// the pods' (unclassified) project, and could be refused. The other
// members stay as they are, but for those of cgroups gone since (the
// kernel lists them by id, and they are written no more). Tried once: a
// failure is logged, and the apply after the hold writes every member.
func (p *projects) holdSelf() {
	self, ok := p.selfMember()
	if !ok || p.selfHeld {
		return
	}
	cur, err := p.kernel.Members()
	if err == nil && !slices.Contains(cur, self) {
		cur = slices.DeleteFunc(slices.Clone(cur), func(m membership.Member) bool { return m.Cgroup == self.Cgroup })
		var rep membersReport
		rep, err = p.kernel.SetMembers(append(cur, self))
		p.settleChanged(rep.Changed)
	}
	p.selfHeld = true
	if err != nil {
		p.log.Warn("the daemon's own cgroup could not be taken out of every project while the members are held", "cgroup", self.Cgroup, "err", err)
	}
}

// qosChildren are the QoS cgroups kubelet makes below a pod root: the
// cgroupfs driver's and the systemd driver's names. The walk goes on below
// the root itself (a weak member); they are registered too for a root above
// the levels the programs look at (a projects root deeper than it).
func qosChildren(root string) []string {
	if strings.HasSuffix(root, ".slice") {
		base := strings.TrimSuffix(filepath.Base(root), ".slice")
		return []string{base + "-burstable.slice", base + "-besteffort.slice"}
	}
	return []string{"burstable", "besteffort"}
}

// setKernelMembers makes the kernel's members those in force, and the
// extras (kernelExtras), which win over a member in force at the same
// cgroup. The cgroups it changed are to be walked (settleChanged).
func (p *projects) setKernelMembers() {
	extras := p.kernelExtras()
	ms := membership.Members(p.inForce.Accepted)
	if len(extras) > 0 {
		taken := make(map[string]bool, len(extras))
		for _, e := range extras {
			taken[e.Cgroup] = true
		}
		ms = slices.DeleteFunc(ms, func(m membership.Member) bool { return taken[m.Cgroup] })
		ms = append(ms, extras...)
	}
	rep, err := p.kernel.SetMembers(ms)
	// With an error too: what was written before it.
	p.settleChanged(rep.Changed)
	if err != nil {
		if p.kErr != err.Error() {
			p.log.Error("the kernel's members were not updated: the last ones stay in force", "err", err)
		}
		p.kErr = err.Error()
		return
	}
	if p.kErr != "" {
		p.log.Info("the kernel's members are updated again")
	}
	p.kErr = ""
	for i, r := range rep.Refused {
		if e, ok := p.inForce.Tree.Find(r.Cgroup); ok && e.Cgroup == r.Cgroup && r.Source == "" {
			rep.Refused[i].Source = e.Source
		}
	}
	if !slices.Equal(p.kRefused, rep.Refused) {
		for _, r := range rep.Refused {
			if !slices.Contains(p.kRefused, r) {
				p.log.Warn("member refused by the kernel side", "project", r.Project, "cgroup", r.Cgroup, "reason", r.Reason)
			}
		}
		p.kRefused = rep.Refused
	}
	if rep.Added+rep.Removed > 0 {
		p.log.Debug("kernel members", "added", rep.Added, "removed", rep.Removed, "kept", rep.Kept)
	}
}

// publish rebuilds the view Status and the admin API read. It holds the
// slices of the union in force, which are not changed after.
func (p *projects) publish() {
	m := &admin.Membership{Members: p.inForce.Accepted, Refused: []admin.Refused{}, Changed: p.changed, Kernel: p.kernel != nil}
	if m.Members == nil {
		m.Members = []admin.Member{}
	}
	counts := map[string][2]int{}
	for _, e := range p.inForce.Accepted {
		c := counts[e.Source]
		c[0]++
		counts[e.Source] = c
	}
	for _, r := range p.inForce.Refused {
		m.Refused = append(m.Refused, admin.Refused{Refusal: r, By: "sources"})
		c := counts[r.Source]
		c[1]++
		counts[r.Source] = c
	}
	for _, r := range p.kRefused {
		m.Refused = append(m.Refused, admin.Refused{Refusal: r, By: "kernel"})
	}
	for _, s := range p.sources {
		ms := admin.MemberSource{Name: s.Name(), Members: counts[s.Name()][0], Refused: counts[s.Name()][1]}
		if st := p.found[s.Name()]; st != nil {
			ms.Error, ms.Scanned = st.err, st.scanned
		}
		m.Sources = append(m.Sources, ms)
	}
	if m.Sources == nil {
		m.Sources = []admin.MemberSource{}
	}
	if p.scan != nil {
		nets := &admin.Netns{Scan: p.scan.Stats(), Namespaces: []admin.Namespace{}}
		for _, n := range p.scan.Namespaces() {
			a := p.attached[n.Inode]
			a.Namespace = n
			nets.Namespaces = append(nets.Namespaces, a)
		}
		m.Netns = nets
		for _, cg := range p.scan.Missing() {
			if e, ok := p.inForce.Tree.Find(cg); ok && e.Cgroup == cg {
				m.Missing = append(m.Missing, e)
			}
		}
	}
	p.view.Store(m)
}

// membership returns the view.
func (p *projects) membership() *admin.Membership { return p.view.Load() }

// find returns the member a cgroup (a path below the mount) is in.
func (p *projects) find(path string) (membership.Entry, bool) {
	return p.tree.Load().Find(path)
}

// projectOf is the project of the cgroup whose id is id (a peer's, as the
// front finds it: sock_diag's cgroup id, or the cgroup of the process
// SO_PEERCRED names): the member it is in, at any depth, whatever the
// source; "" when it is in none. The front asks at each request: the
// cgroup's path is kept a second (cgroup.Paths: 53 ns a kept answer
// against 2.7 us for the kernel's, BenchmarkPathOf), and the member found
// from it each time, so a change of membership applies to the next
// request. For a second after a cgroup is removed, a socket that outlived
// it is still placed by its old path (and by the member of a cgroup made
// again at that path within the second); after it, such a socket cannot
// be placed. The front's identity
// uses it (front.Deps.ProjectOf): a cgroup that cannot be placed (gone
// since the client connected) is an error, which the front refuses for a
// local peer rather than take it for one outside every project.
func (p *projects) projectOf(id uint64) (string, error) {
	if id == 0 || p.mount.Point == "" {
		return "", nil
	}
	path, err := p.paths.PathOf(id)
	if err != nil {
		return "", fmt.Errorf("placing cgroup %d: %w", id, err)
	}
	if e, ok := p.find(path); ok {
		return e.Project, nil
	}
	if p.inPodRoot(path) {
		return "", fmt.Errorf("cgroup %s: %w", path, errPodUnplaced)
	}
	return "", nil
}

// errPodUnplaced is projectOf's error for a pod's cgroup that is in no
// project yet (not read from the runtime yet, or refused one): the kernel
// counts it in (unclassified), and the front refuses it rather than take it
// for a process of the host, which routes and trusted addresses serve.
var errPodUnplaced = errors.New("a pod in no project yet (not read from the container runtime, or its project refused)")

// inPodRoot says whether path is below a pod root (kubernetes.pod_cgroups)
// and neither the daemon's own nor a pod of no project's (a system
// namespace's).
func (p *projects) inPodRoot(path string) bool {
	if p.podsNone == nil {
		return false
	}
	below := func(dir string) bool { return path == dir || strings.HasPrefix(path, dir+"/") }
	if !slices.ContainsFunc(p.podRootsBelow, func(root string) bool { return strings.HasPrefix(path, root) }) {
		return false
	}
	return !(p.self != "" && below(p.self)) && !slices.ContainsFunc(p.noneList(), below)
}

// setPodRoots sets the pod roots (kubernetes.pod_cgroups, relative to the
// mount) and their paths.
func (p *projects) setPodRoots(roots []string) {
	p.podRoots, p.podRootDirs, p.podRootsBelow = roots, nil, nil
	for _, root := range roots {
		dir := filepath.Join(p.mount.Point, root)
		p.podRootDirs = append(p.podRootDirs, dir)
		p.podRootsBelow = append(p.podRootsBelow, dir+"/")
	}
}

// noneList is the pods of no project as the last apply read them.
func (p *projects) noneList() []string {
	if l := p.none.Load(); l != nil {
		return *l
	}
	return nil
}
