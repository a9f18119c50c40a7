// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/membership"
	"github.com/fairshare-dev/fairshare/internal/netnsscan"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/loader"
	"github.com/fairshare-dev/fairshare/policy"
)

// runLoop runs the daemon's control loop until the test ends.
func runLoop(t testing.TB, d *Daemon) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { d.loop(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
}

// members renders the members in force as "project@cgroup(source)", the
// cgroups relative to top.
func members(d *Daemon, top string) []string {
	var out []string
	for _, e := range d.projects.membership().Members {
		out = append(out, fmt.Sprintf("%s@%s(%s)", e.Project, strings.TrimPrefix(e.Cgroup, top+"/"), e.Source))
	}
	return out
}

// holds is what an eventually condition returns: nil when ok, else what
// is awaited.
func holds(ok bool, what string) error {
	if ok {
		return nil
	}
	return errors.New("timed out waiting for " + what)
}

// TestRegistrations registers pods laid out as kubelet's cgroupfs driver
// does beside the directory source's projects: each registration is in
// force when Register returns, conflicts are refused with why (and nothing
// stored), paths are taken as directories or as /proc/<pid>/cgroup shows
// them, removal takes a project's cgroups out, and the registrations
// survive a restart of the daemon.
func TestRegistrations(t *testing.T) {
	testutil.RequireRoot(t)
	mount := testutil.Cgroup2Mount(t)
	top := testutil.TempCgroup(t, mount, "fairshare-projects-")
	root := testutil.MkCgroup(t, top, "fairshare")
	testutil.MkCgroup(t, root, "web")
	pods := testutil.KubeletCgroupfs(t, top, []string{"guaranteed", "burstable", "besteffort"}, 2)
	state := t.TempDir()
	edit := func(c *config.Config) {
		c.ProjectsRoot = root
		c.StateDir = state
		c.Tick = time.Minute // only a registration or inotify applies
	}
	d, _, _ := newTestDaemon(t, edit)
	runLoop(t, d)
	ctx := t.Context()
	if got := members(d, top); !slices.Equal(got, []string{"web@fairshare/web(directory)"}) {
		t.Fatalf("members %v", got)
	}
	reg, err := d.Register(ctx, "team-a", []string{pods[0].Cgroup, strings.TrimPrefix(pods[1].Cgroup, mount)})
	if err != nil || reg.Pending || len(reg.Added) != 2 || len(reg.Cgroups) != 2 {
		t.Fatalf("register = %+v, %v", reg, err)
	}
	rel := func(p testutil.Pod) string { return strings.TrimPrefix(p.Cgroup, top+"/") }
	want := []string{"web@fairshare/web(directory)", "team-a@" + rel(pods[1]) + "(registered)", "team-a@" + rel(pods[0]) + "(registered)"}
	slices.SortFunc(want, func(a, b string) int {
		return strings.Compare(a[strings.IndexByte(a, '@'):], b[strings.IndexByte(b, '@'):])
	})
	if got := members(d, top); !slices.Equal(got, want) {
		t.Fatalf("members %v\nwant    %v", got, want)
	}
	// Again: nothing new, nothing refused.
	if reg, err := d.Register(ctx, "team-a", []string{pods[0].Cgroup}); err != nil || len(reg.Added) != 0 {
		t.Fatalf("registering again: %+v %v", reg, err)
	}

	// Conflicts: a container of team-a's pod for team-b (below), the QoS
	// cgroup above team-a's burstable pod, a project's directory; and bad
	// paths. None is stored.
	for _, tc := range []struct {
		cgroups []string
		code    error
		want    string
	}{
		{[]string{pods[2].Cgroup, pods[0].Containers[1]}, membership.ErrRefused, "below " + pods[0].Cgroup + ", registered to project team-a"},
		{[]string{filepath.Dir(pods[1].Cgroup)}, membership.ErrRefused, "above " + pods[1].Cgroup},
		{[]string{filepath.Join(root, "web")}, membership.ErrRefused, "registered to project web by source directory"},
		{[]string{filepath.Join(top, "nope")}, admin.ErrInvalid, "is not a cgroup"},
		{[]string{"/etc"}, admin.ErrInvalid, "is not a cgroup"},
		{[]string{mount}, admin.ErrInvalid, "the root of the cgroup2 hierarchy"},
		{nil, admin.ErrInvalid, "name 1 to"},
	} {
		_, err := d.Register(ctx, "team-b", tc.cgroups)
		if !errors.Is(err, tc.code) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("register %v: %v, want %v naming %q", tc.cgroups, err, tc.code, tc.want)
		}
	}
	if _, err := d.Register(ctx, "bad name", []string{pods[2].Cgroup}); err == nil {
		t.Error("a bad project name was registered")
	}
	if regs, _ := d.store.Members(); len(regs) != 2 {
		t.Fatalf("refused registrations were stored: %v", regs)
	}
	if reg, err := d.Register(ctx, "team-b", []string{pods[2].Cgroup}); err != nil || reg.Pending {
		t.Fatalf("team-b: %+v %v", reg, err)
	}

	// A process in a container is in its pod's project.
	cmd := exec.Command("sleep", "60")
	testutil.StartInCgroup(t, cmd, pods[2].Containers[0])
	m, _ := cgroup.FindMount()
	cg, _ := m.OfPID(cmd.Process.Pid)
	if e, ok := d.projects.find(cg); !ok || e.Project != "team-b" {
		t.Fatalf("a process of team-b's pod is in %v %v", e, ok)
	}
	// The front's question, by cgroup id: a container of a registered
	// pod, a directory project's child, and a cgroup in no member.
	for dir, want := range map[string]string{pods[2].Containers[0]: "team-b", testutil.MkCgroup(t, filepath.Join(root, "web"), "workers"): "web",
		top: "", filepath.Dir(pods[2].Cgroup): ""} {
		id, err := cgroup.ID(dir)
		if err != nil {
			t.Fatal(err)
		}
		if got, err := d.projects.projectOf(id); got != want || err != nil {
			t.Errorf("projectOf(%s) = %q, %v; want %q", dir, got, err, want)
		}
	}

	// Removing one cgroup, then a cgroup not registered (404).
	if reg, err := d.Unregister(ctx, "team-a", []string{pods[1].Cgroup}); err != nil || len(reg.Removed) != 1 || len(reg.Cgroups) != 1 {
		t.Fatalf("unregister = %+v, %v", reg, err)
	}
	if _, err := d.Unregister(ctx, "team-a", []string{pods[1].Cgroup}); !errors.Is(err, policy.ErrNotRegistered) {
		t.Fatalf("unregister again: %v", err)
	}
	if e, ok := d.projects.find(pods[1].Containers[0]); ok {
		t.Fatalf("an unregistered pod's container is still in %v", e)
	}
	before := members(d, top)

	// A restart keeps the registrations.
	d.Close()
	d2, _, _ := newTestDaemon(t, edit)
	if got := members(d2, top); !slices.Equal(got, before) {
		t.Fatalf("after a restart: %v\nbefore:          %v", got, before)
	}
	runLoop(t, d2)
	if reg, err := d2.Unregister(ctx, "team-b", nil); err != nil || len(reg.Removed) != 1 || len(reg.Cgroups) != 0 {
		t.Fatalf("unregister all of team-b: %+v %v", reg, err)
	}
	if _, err := d2.Unregister(ctx, "team-b", nil); !errors.Is(err, policy.ErrNotRegistered) {
		t.Fatalf("unregister all again: %v", err)
	}
}

// TestDirectoryAtOnce: a directory made in the projects root is a project
// before any tick (inotify wakes the loop), and goes when removed.
func TestDirectoryAtOnce(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-projects-")
	d, _, _ := newTestDaemon(t, func(c *config.Config) { c.ProjectsRoot, c.Tick = top, time.Minute })
	runLoop(t, d)
	dir := testutil.MkCgroup(t, top, "fresh")
	eventually(t, func() error {
		e, ok := d.projects.find(filepath.Join(dir, "x"))
		return holds(ok && e.Project == "fresh", "the new directory as a project")
	})
	testutil.RemoveCgroup(t, dir)
	eventually(t, func() error { return holds(len(d.projects.membership().Members) == 0, "the removed directory to go") })
}

// TestSystemdProjects: with the systemd source, status and the membership
// name projects as the slices say (web-api for fairshare-web\x2dapi.slice),
// list the unit directly in the slice as refused with why, and a
// conflicting registration names the slice's project.
func TestSystemdProjects(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-projects-")
	units, slice := testutil.SystemdSlices(t, top, "fairshare.slice", map[string][]string{
		`fairshare-web\x2dapi.slice`: {"api.service"}, "fairshare-batch.slice": {"run-u7.scope"},
	})
	testutil.MkCgroup(t, slice, "stray.service")
	d, _, _ := newTestDaemon(t, func(c *config.Config) {
		c.ProjectsRoot = slice
		c.Projects.Sources = []string{"systemd", "registered"}
	})
	runLoop(t, d)
	m := d.projects.membership()
	var names []string
	for _, e := range m.Members {
		names = append(names, e.Project)
	}
	if !slices.Equal(names, []string{"batch", "web-api"}) {
		t.Fatalf("projects %v", names)
	}
	if len(m.Refused) != 1 || !strings.Contains(m.Refused[0].Reason, "Slice=fairshare-<name>.slice") || m.Refused[0].By != "sources" {
		t.Fatalf("refused %+v", m.Refused)
	}
	if len(m.Sources) != 2 || m.Sources[0].Name != "systemd" || m.Sources[0].Members != 2 || m.Sources[0].Refused != 1 {
		t.Fatalf("sources %+v", m.Sources)
	}
	_, err := d.Register(t.Context(), "other", []string{units[`fairshare-web\x2dapi.slice/api.service`]})
	if !errors.Is(err, membership.ErrRefused) || !strings.Contains(err.Error(), "registered to project web-api by source systemd") {
		t.Fatalf("a unit of web-api registered for another project: %v", err)
	}
	// A process of a unit in a project slice is in the project by its
	// name, not the slice's directory (the front's question).
	if id, err := cgroup.ID(units[`fairshare-web\x2dapi.slice/api.service`]); err != nil || first(d.projects.projectOf(id)) != "web-api" {
		t.Errorf("projectOf(api.service) = %q (%v), want web-api", first(d.projects.projectOf(id)), err)
	}
}

// TestNetnsOfMembers: the daemon finds the network namespace of a pod
// registered with it (a process in a namespace of its own in a container
// of the pod) at the next tick, lists it with its project in the
// membership, and forgets it when the pod's process ends.
func TestNetnsOfMembers(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-projects-")
	pods := testutil.KubeletSystemd(t, top, []string{"burstable"}, 1)
	d, _, _ := newTestDaemon(t, func(c *config.Config) { c.ProjectsRoot, c.Tick = filepath.Join(top, "none"), 20*time.Millisecond })
	runLoop(t, d)
	cmd := exec.Command("sleep", "60")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
	testutil.StartInCgroup(t, cmd, pods[0].Containers[0])
	if _, err := d.Register(t.Context(), "tenant", []string{pods[0].Cgroup}); err != nil {
		t.Fatal(err)
	}
	var ino uint64
	eventually(t, func() error {
		ns := d.projects.membership().Netns.Namespaces
		if len(ns) == 1 && slices.Equal(ns[0].Projects, []string{"tenant"}) {
			ino = ns[0].Inode
			return nil
		}
		return holds(false, "the pod's namespace")
	})
	var st syscall.Stat_t
	if err := syscall.Stat(fmt.Sprintf("/proc/%d/ns/net", cmd.Process.Pid), &st); err != nil || st.Ino != ino {
		t.Fatalf("found namespace %d, the pod's is %d (%v)", ino, st.Ino, err)
	}
	testutil.Stop(cmd)
	eventually(t, func() error {
		return holds(len(d.projects.membership().Netns.Namespaces) == 0, "the namespace to be forgotten")
	})

	// The pod goes; its registration stays, listed as missing.
	testutil.RemoveCgroup(t, pods[0].Cgroup)
	eventually(t, func() error {
		m := d.projects.membership().Missing
		return holds(len(m) == 1 && m[0].Cgroup == pods[0].Cgroup && m[0].Project == "tenant", "the pod's cgroup listed missing")
	})
}

// TestRegisterConcurrently: registrations arriving together are applied
// together (each waits for one apply, not one each) and none is lost.
func TestRegisterConcurrently(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-projects-")
	d, _, _ := newTestDaemon(t, func(c *config.Config) { c.ProjectsRoot, c.Tick = filepath.Join(top, "none"), time.Minute })
	runLoop(t, d)
	const n = 100
	dirs := make([]string, n)
	for i := range n {
		dirs[i] = testutil.MkCgroup(t, top, fmt.Sprintf("c%03d", i))
	}
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			reg, err := d.Register(context.Background(), fmt.Sprintf("p%02d", i%10), []string{dirs[i]})
			if err == nil && reg.Pending {
				err = fmt.Errorf("%s still pending", dirs[i])
			}
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if got := len(d.projects.membership().Members); got != n {
		t.Fatalf("%d members in force, want %d", got, n)
	}
}

// handOff records what the membership hands the kernel side: a stand-in
// for the loader's membership API (design17) until the loader has it. The
// kernel itself is tested with the loader.
type handOff struct {
	mu        sync.Mutex // guards the fields below
	seed      []membership.Member
	sets      [][]membership.Member
	refuse    string // a cgroup SetMembers refuses
	attached  []string
	settles   []settleCall
	settleErr error    // Settle's answer
	rewrite   []string // cgroups the next SetMembers writes again (a cgroup made again)
}

type settleCall struct {
	host  bool
	netns []uint64
}

func (h *handOff) Members() ([]membership.Member, error) { return h.seed, nil }
func (h *handOff) SetMembers(ms []membership.Member) (membersReport, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	prev := h.seed // the kernel's before the first call
	if len(h.sets) > 0 {
		prev = h.sets[len(h.sets)-1]
	}
	h.sets = append(h.sets, ms)
	var rep membersReport
	for _, m := range ms {
		if m.Cgroup == h.refuse {
			rep.Refused = append(rep.Refused, membership.Refusal{Entry: membership.Entry{Member: m}, Reason: "cgroup does not exist"})
		} else if slices.Contains(prev, m) && !slices.Contains(h.rewrite, m.Cgroup) {
			rep.Kept++
		} else {
			rep.Added++
			rep.Changed = append(rep.Changed, m.Cgroup)
		}
	}
	h.rewrite = nil
	return rep, nil
}
func (h *handOff) Settle(_ context.Context, host bool, netns []uint64) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.settles = append(h.settles, settleCall{host, slices.Clone(netns)})
	return h.settleErr
}
func (h *handOff) AttachNetns(ns *os.File, path string) (netnsInfo, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.attached = append(h.attached, path)
	var st syscall.Stat_t
	if err := syscall.Fstat(int(ns.Fd()), &st); err != nil {
		return netnsInfo{}, err
	}
	return netnsInfo{Cookie: 7, Inode: st.Ino, Path: path}, nil
}
func (h *handOff) DetachGone() ([]netnsInfo, error) { return nil, nil }

// TestKernelHandOff: the kernel's members seed the members in force (a
// newcomer above one of them loses, though its source comes first), the
// union goes to SetMembers at once and at every tick, the kernel's refusals
// show in the membership with their source, and a member's new network
// namespace is attached by a path that opens it.
func TestKernelHandOff(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-projects-")
	root := testutil.MkCgroup(t, top, "root")
	web := testutil.MkCgroup(t, root, "web")
	inner := testutil.MkCgroup(t, web, "inner")
	gone := filepath.Join(top, "gone")
	dir := t.TempDir()
	cfg := config.Default()
	cfg.ProjectsRoot, cfg.StateDir = root, dir
	st, err := policy.Open(dir, policy.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := st.AddMembers([]membership.Member{{Project: "inner", Cgroup: inner}, {Project: "ghost", Cgroup: gone}}, nil); err != nil {
		t.Fatal(err)
	}
	p, err := newProjects(cfg, st, false, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer p.close()
	h := &handOff{seed: []membership.Member{{Project: "inner", Cgroup: inner}}, refuse: gone}
	p.kernel = h
	p.apply(t.Context(), time.Now(), false)
	m := p.membership()
	var got []string
	for _, e := range m.Members {
		got = append(got, e.Project+"@"+e.Source)
	}
	if !slices.Equal(got, []string{"ghost@registered", "inner@registered"}) {
		t.Fatalf("members %v: the kernel's member did not win over the directory source's web", got)
	}
	if len(m.Refused) != 2 || m.Refused[0].By != "sources" || m.Refused[1].By != "kernel" || m.Refused[1].Source != "registered" {
		t.Fatalf("refused %+v", m.Refused)
	}
	if len(h.sets) != 1 || len(h.sets[0]) != 2 {
		t.Fatalf("SetMembers calls %v", h.sets)
	}
	// The kernel had inner, and refused ghost: nothing to settle.
	if len(h.settles) != 0 {
		t.Fatalf("Settle calls %+v with the kernel's members unchanged, want none", h.settles)
	}
	p.apply(t.Context(), time.Now(), false) // nothing changed, not a tick
	p.apply(t.Context(), time.Now(), true)  // a tick: again (cgroups made again keep their path, not their id)
	if len(h.sets) != 2 || len(h.settles) != 0 {
		t.Fatalf("SetMembers calls %d, want 2; Settle calls %+v with nothing changed, want none", len(h.sets), h.settles)
	}

	cmd := exec.Command("sleep", "60")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
	testutil.StartInCgroup(t, cmd, inner)
	p.apply(t.Context(), time.Now(), true)
	ns := p.membership().Netns.Namespaces
	if len(ns) != 1 || !ns[0].Attached || ns[0].Cookie != 7 || len(h.attached) != 1 {
		t.Fatalf("namespaces %+v, attached %v", ns, h.attached)
	}
	// A namespace attached: that one settled (its listeners counted), not
	// the host's.
	if len(h.settles) != 1 || h.settles[0].host || !slices.Equal(h.settles[0].netns, []uint64{7}) {
		t.Fatalf("Settle calls %+v after a namespace was attached, want one of cookie 7 alone", h.settles)
	}
	// inner written again (its cgroup made again under its path): the
	// host's namespace walked, and the namespace found in inner.
	h.rewrite = []string{inner}
	p.apply(t.Context(), time.Now(), true)
	if len(h.settles) != 2 || !h.settles[1].host || !slices.Equal(h.settles[1].netns, []uint64{7}) {
		t.Fatalf("Settle calls %+v after inner was written again, want the host's and cookie 7", h.settles)
	}

	// A kernel that had none of the members: they are added, and the
	// host's namespace settled before the membership is published; a
	// Settle that fails is made again at the next apply, and only then.
	fresh := &handOff{refuse: gone, settleErr: errors.New("no iterator")}
	q, err := newProjects(cfg, st, false, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer q.close()
	q.kernel = fresh
	q.apply(t.Context(), time.Now(), false)
	fresh.settleErr = nil
	q.apply(t.Context(), time.Now(), false)
	q.apply(t.Context(), time.Now(), false)
	if len(fresh.settles) != 2 || !fresh.settles[0].host || !fresh.settles[1].host {
		t.Fatalf("Settle calls %+v after members were added (the first failing), want two of the host", fresh.settles)
	}
}

// TestUnreadSourceHoldsKernel: after a restart, a polled source that has
// not answered yet (a container runtime slow to start) does not take its
// members out of the kernel: the kernel's members stay in force, and place
// peers, until it answers, or until unreadHold passes.
func TestUnreadSourceHoldsKernel(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-projects-")
	pod := testutil.MkCgroup(t, top, "pod1")
	ctr := testutil.MkCgroup(t, pod, "ctr")
	cfg := config.Default()
	cfg.StateDir = t.TempDir()
	cfg.Projects.Sources = []string{membership.SourceRegistered}
	st, err := policy.Open(cfg.StateDir, policy.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	pods := []membership.Member{{Project: "team-k", Cgroup: pod}}
	for _, expire := range []bool{false, true} {
		answer := make(chan struct{})
		src := membership.NewPolled("kubernetes", time.Minute, func(ctx context.Context) (membership.Found, error) {
			select {
			case <-answer:
				return membership.Found{Members: pods}, nil
			case <-ctx.Done():
				return membership.Found{}, ctx.Err()
			}
		})
		p, err := newProjects(cfg, st, false, slog.New(slog.DiscardHandler))
		if err != nil {
			t.Fatal(err)
		}
		p.sources = append(p.sources, src)
		p.closers = append(p.closers, src)
		h := &handOff{seed: pods}
		p.kernel = h
		start := time.Now()
		p.apply(t.Context(), start, false)
		p.apply(t.Context(), start.Add(time.Second), true)
		id, _ := cgroup.ID(ctr)
		if len(h.sets) != 0 || first(p.projectOf(id)) != "team-k" || len(p.membership().Members) != 1 {
			t.Fatalf("with the source unread: SetMembers %v, a pod's container in %q, members %+v",
				h.sets, first(p.projectOf(id)), p.membership().Members)
		}
		if expire {
			p.apply(t.Context(), start.Add(unreadHold), true)
			if len(h.sets) != 1 || len(h.sets[0]) != 0 {
				t.Fatalf("past the hold: SetMembers %v, want the unread source's members out", h.sets)
			}
			p.close()
			continue
		}
		close(answer)
		select {
		case <-src.Changed():
		case <-time.After(10 * time.Second):
			t.Fatal("the source never answered")
		}
		p.apply(t.Context(), start.Add(2*time.Second), false)
		m := p.membership()
		if len(h.sets) != 1 || !slices.Equal(h.sets[0], pods) || len(m.Members) != 1 || m.Members[0].Source != "kubernetes" {
			t.Fatalf("once read: SetMembers %v, members %+v", h.sets, m.Members)
		}
		p.close()
	}
}

// TestProjectsRootChecked: a projects root that does not suit its source is
// the configuration's error, found before anything is made: the systemd
// source at a directory that is no slice, a root off the cgroup2 mount (not
// created).
func TestProjectsRootChecked(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-projects-")
	off := filepath.Join(t.TempDir(), "projects")
	for _, tc := range []struct {
		root    string
		sources []string
		want    string
	}{
		{filepath.Join(top, "fairshare"), []string{"systemd"}, "needs projects_root at a slice's cgroup"},
		{off, []string{"directory"}, "is not a directory below the cgroup2 mount"},
	} {
		cfg := config.Default()
		cfg.ProjectsRoot, cfg.Projects.Sources, cfg.BPF = tc.root, tc.sources, true
		if err := CheckHost(cfg); !errors.Is(err, config.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("CheckHost %s %v: %v", tc.root, tc.sources, err)
		}
		if _, err := newProjects(cfg, nil, true, slog.New(slog.DiscardHandler)); !errors.Is(err, config.ErrInvalid) ||
			!strings.Contains(err.Error(), tc.want) {
			t.Errorf("newProjects %s %v: %v", tc.root, tc.sources, err)
		}
	}
	if _, err := os.Stat(off); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a root off the mount was made: %v", err)
	}
}

// A missing projects root below the mount is made, and said (a mistyped
// --projects-root would otherwise pass unseen); one that exists is not.
func TestProjectsRootMadeSaid(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-projects-")
	for _, root := range []string{filepath.Join(top, "typo"), top} {
		cfg := config.Default()
		cfg.ProjectsRoot, cfg.Projects.Sources, cfg.BPF = root, []string{"directory"}, true
		logs := &records{}
		p, err := newProjects(cfg, nil, true, slog.New(logs))
		if err != nil {
			t.Fatal(err)
		}
		p.close()
		said := len(logs.find("made the projects root: it did not exist")) == 1
		if made := root != top; said != made {
			t.Errorf("%s: said %v, want %v", root, said, made)
		}
	}
	testutil.RemoveCgroup(t, filepath.Join(top, "typo"))
}

// first is a project name without its error, for messages.
func first(name string, _ error) string { return name }

// TestOwnCgroupAtTheRootWarns: a daemon in the cgroup tree's root (started
// from a root shell without systemd) cannot register its own cgroup in no
// project, and says so at start instead of exempting nothing silently. A
// real process in the root cgroup shows what the daemon reads there (its
// cgroup is the mount point); one in a cgroup of its own is kept, unwarned.
func TestOwnCgroupAtTheRootWarns(t *testing.T) {
	testutil.RequireRoot(t)
	mnt := testutil.Cgroup2Mount(t)
	mount, err := cgroup.FindMount()
	if err != nil {
		t.Fatal(err)
	}
	own := testutil.TempCgroup(t, mnt, "fairshare-own-")
	for _, c := range []struct {
		dir, warn string
	}{
		{mnt, "the daemon runs in the root of the cgroup tree"},
		{own, ""},
	} {
		cmd := exec.Command("sleep", "60")
		testutil.StartInCgroup(t, cmd, c.dir)
		dir, err := mount.OfPID(cmd.Process.Pid)
		testutil.Stop(cmd)
		var logs testutil.Buffer
		got := ownCgroup(mount, dir, err, slog.New(slog.NewTextHandler(&logs, nil)))
		if c.warn != "" {
			if got != "" || !strings.Contains(logs.String(), "level=WARN") || !strings.Contains(logs.String(), c.warn) {
				t.Errorf("in %s (read %q %v): own cgroup %q, logged %q; want none and a warning", c.dir, dir, err, got, logs.String())
			}
			continue
		}
		if got != c.dir || logs.String() != "" {
			t.Errorf("in %s (read %q %v): own cgroup %q, logged %q", c.dir, dir, err, got, logs.String())
		}
	}
}

// TestSettleCancelled: a walk asked for while the daemon shuts down (its
// context cancelled) returns at once with the context's error, logs no
// failure and leaves the walk pending, as a walk that failed; with a live
// context the same walk runs.
func TestSettleCancelled(t *testing.T) {
	testutil.RequireRoot(t)
	root := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-settle-")
	pin := filepath.Join("/sys/fs/bpf", filepath.Base(root))
	t.Cleanup(func() { loader.Cleanup(pin) })
	d, _, logs := newTestDaemon(t, func(c *config.Config) {
		c.BPF, c.PinDir, c.ProjectsRoot, c.Tick = true, pin, root, time.Minute
		c.Projects.Sources = []string{"directory"}
	})
	before := len(logs.all())
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := d.kernel.settle(ctx, true, nil); !errors.Is(err, context.Canceled) {
		t.Fatalf("settle with a cancelled context: %v, want %v", err, context.Canceled)
	}
	d.projects.settleHost = true
	d.projects.settle(ctx)
	if !d.projects.settleHost {
		t.Error("a cancelled walk was marked done")
	}
	for _, rec := range logs.all()[before:] {
		if rec.Level >= slog.LevelWarn {
			t.Errorf("logged at %v for a cancelled walk: %s", rec.Level, rec.Message)
		}
	}
	d.projects.settle(t.Context())
	if d.projects.settleHost {
		t.Error("the walk made with a live context is still pending")
	}
}

// TestNetnsFoundWalks: which namespaces a read of the scan has walked. One
// attached already by the kubernetes source's word and first seen by the
// scan (New) is walked only if the scan found in it a process of another
// member than its pod's; one attached that the scan found joined by a
// member is walked; neither is attached twice.
func TestNetnsFoundWalks(t *testing.T) {
	const pod, other = "/sys/fs/cgroup/kubepods/pod1", "/sys/fs/cgroup/tenants/b"
	for _, tc := range []struct {
		name    string
		ch      netnsscan.Changes
		members []string
		walked  bool
	}{
		{"new, the pod's own processes", netnsscan.Changes{New: []netnsscan.Namespace{{Inode: 5, Members: []string{pod}}}}, nil, false},
		{"new, a container below the pod's cgroup", netnsscan.Changes{New: []netnsscan.Namespace{{Inode: 5, Members: []string{pod + "/c1"}}}}, nil, false},
		{"new, another member's process in it", netnsscan.Changes{New: []netnsscan.Namespace{{Inode: 5, Members: []string{pod, other}}}}, nil, true},
		{"joined", netnsscan.Changes{Joined: []netnsscan.Namespace{{Inode: 5, Members: []string{pod, other}}}}, nil, true},
		{"joined, not attached", netnsscan.Changes{Joined: []netnsscan.Namespace{{Inode: 6, Members: []string{pod, other}}}}, nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := &projects{log: slog.New(slog.DiscardHandler), settleNetns: map[uint64]bool{},
				attached: map[uint64]admin.Namespace{5: {Namespace: netnsscan.Namespace{Inode: 5, Cgroup: pod}, Attached: true, Cookie: 9}}}
			p.netnsFound(tc.ch)
			if p.settleNetns[9] != tc.walked || len(p.settleNetns) > 1 {
				t.Errorf("walks %v, want cookie 9 walked: %v", p.settleNetns, tc.walked)
			}
			if a := p.attached[5]; !a.Attached || a.Cookie != 9 {
				t.Errorf("namespace 5 is now %+v", a)
			}
		})
	}
}

// TestNetnsIDs: records and charges of one inode number are one
// namespace's only if their ids agree (the kernel gives a dead namespace's
// number to the next one made). A namespace gone leaves a record of
// another id alone; one found new or joined with another id than its
// record's is not taken for it (attached anew, not walked as it); a dead
// namespace's charge does not let one made with its number past the
// project's bound.
func TestNetnsIDs(t *testing.T) {
	const ino = 5
	record := func(id uint64) *projects {
		return &projects{log: slog.New(slog.DiscardHandler), settleNetns: map[uint64]bool{}, charged: map[uint64]netnsCharge{},
			projectFull: map[string]bool{}, netnsPerProject: 1,
			attached: map[uint64]admin.Namespace{ino: {Namespace: netnsscan.Namespace{Inode: ino, ID: id, Cgroup: "/pod"}, Attached: true, Cookie: 9}}}
	}
	p := record(2)
	p.netnsFound(netnsscan.Changes{Gone: []netnsscan.Namespace{{Inode: ino, ID: 1}}})
	if a, ok := p.attached[ino]; !ok || a.ID != 2 {
		t.Errorf("namespace 1 gone: the record of namespace 2 at its number is %+v, want kept", a)
	}
	p.netnsFound(netnsscan.Changes{Gone: []netnsscan.Namespace{{Inode: ino, ID: 2}}})
	if _, ok := p.attached[ino]; ok {
		t.Error("namespace 2 gone: its record kept")
	}
	p = record(1)
	p.netnsFound(netnsscan.Changes{New: []netnsscan.Namespace{{Inode: ino, ID: 2, Members: []string{"/pod"}}}})
	if a := p.attached[ino]; a.ID != 2 || a.Attached {
		t.Errorf("namespace 2 new at namespace 1's number: record %+v, want namespace 2's, not attached (no kernel here)", a)
	}
	p = record(1)
	p.netnsFound(netnsscan.Changes{Joined: []netnsscan.Namespace{{Inode: ino, ID: 2, Members: []string{"/pod", "/other"}}}})
	if p.settleNetns[9] || p.attached[ino].ID != 1 {
		t.Errorf("namespace 2 joined at namespace 1's number: walks %v, record %+v; want no walk of namespace 1's link", p.settleNetns, p.attached[ino])
	}
	// team-a holds one link (its bound), of namespace 1, dead but not
	// detached yet: namespace 2, made with its number, is refused; namespace
	// 1 itself would take no new link.
	p = record(1)
	p.charged[9] = netnsCharge{inode: ino, id: 1, projects: []string{"team-a"}}
	if err := p.projectCap([]string{"team-a"}, ino, 2); !errors.Is(err, errProjectNetnsFull) {
		t.Errorf("namespace 2 at the dead namespace 1's number: %v, want %v", err, errProjectNetnsFull)
	}
	if err := p.projectCap([]string{"team-a"}, ino, 1); err != nil {
		t.Errorf("namespace 1 itself: %v, want no new link", err)
	}
}

// TestHeldKernelTakesTheDaemonOut: while the kernel's members are held
// after a restart (a source not read yet), the daemon's own cgroup, which a
// restart into a new pod makes new, is made a no-project member at once,
// the kernel's other members kept as they are. Before, it was only at the
// first apply after the hold (up to unreadHold, 30 s), and the daemon's own
// connections counted in the pods' (unclassified) project meanwhile.
func TestHeldKernelTakesTheDaemonOut(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-projects-")
	pod := testutil.MkCgroup(t, top, "pod1")
	self := testutil.MkCgroup(t, top, "daemon")
	pods := []membership.Member{{Project: "team-k", Cgroup: pod}}
	src := membership.NewPolled("kubernetes", time.Minute, func(ctx context.Context) (membership.Found, error) {
		<-ctx.Done()
		return membership.Found{}, ctx.Err()
	})
	p := newTestProjects(t)
	p.sources = append(p.sources, src)
	p.closers = append(p.closers, src)
	p.root, p.self = top, self
	h := &handOff{seed: pods}
	p.kernel = h
	start := time.Now()
	p.apply(t.Context(), start, false)
	p.apply(t.Context(), start.Add(time.Second), true)
	want := append(slices.Clone(pods), membership.Member{Project: loader.NoProject, Cgroup: self})
	if len(h.sets) != 1 || !slices.Equal(h.sets[0], want) {
		t.Fatalf("held: SetMembers %v, want once %v (the kernel's members and the daemon out of every project)", h.sets, want)
	}
}

// TestUnplacedPodNotAHostProcess: a pod's cgroup that is in no project yet
// (not read from the runtime, or its project refused) is an error to the
// front, which refuses it, not a process of the host's, which routes and
// trusted addresses serve (and which could then name any project). A pod of
// no project (a system namespace's), the daemon's own cgroup and a process
// outside the pods stay outside every project.
func TestUnplacedPodNotAHostProcess(t *testing.T) {
	top, pods, member := podLayout(t)
	unplaced := testutil.MkCgroup(t, testutil.MkCgroup(t, pods, "podnew"), "ctr")
	system := testutil.MkCgroup(t, pods, "poddns")
	self := testutil.MkCgroup(t, pods, "poddaemon")
	host := testutil.MkCgroup(t, top, "host")
	p := podProjects(t, pods, member, func() []string { return []string{system} })
	p.self = self
	applyRead(t, p)
	for _, tc := range []struct {
		cg   string
		want string
		err  bool
	}{{member, "team-k", false}, {unplaced, "", true}, {system, "", false}, {self, "", false}, {host, "", false}} {
		id, err := cgroup.ID(tc.cg)
		if err != nil {
			t.Fatal(err)
		}
		got, err := p.projectOf(id)
		if got != tc.want || (err != nil) != tc.err || tc.err && !errors.Is(err, errPodUnplaced) {
			t.Errorf("projectOf(%s) = %q, %v; want %q, error %v", tc.cg, got, err, tc.want, tc.err)
		}
	}
}

// TestNoProjectPodReachesKernelAtOnce: a new pod of no project (a system
// namespace's) changes no member, and is written to the kernel at the apply
// the kubernetes source's signal brings, not at the next tick: until then
// the pod counted in (unclassified) and could be refused.
func TestNoProjectPodReachesKernelAtOnce(t *testing.T) {
	_, pods, member := podLayout(t)
	dns := testutil.MkCgroup(t, pods, "poddns")
	var mu sync.Mutex
	var none []string
	p := podProjects(t, pods, member, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(none)
	})
	h := &handOff{}
	p.kernel = h
	applyRead(t, p)
	h.mu.Lock()
	sets := len(h.sets)
	h.mu.Unlock()
	mu.Lock()
	none = []string{dns}
	mu.Unlock()
	p.apply(t.Context(), time.Now(), false) // the source's signal: no tick
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.sets) != sets+1 || !slices.Contains(h.sets[len(h.sets)-1], membership.Member{Project: loader.NoProject, Cgroup: dns}) {
		t.Fatalf("after a new pod of no project, at an apply with no tick: SetMembers %v", h.sets[sets:])
	}
}

// podProjects are projects whose kubernetes source (a polled source, no
// runtime) has one member, team-k's pod at member, below the pod root pods,
// with the pods of no project none gives, read by an apply.
func podProjects(t *testing.T, pods, member string, none func() []string) *projects {
	t.Helper()
	p := newTestProjects(t)
	src := membership.NewPolled("kubernetes", time.Minute, func(context.Context) (membership.Found, error) {
		return membership.Found{Members: []membership.Member{{Project: "team-k", Cgroup: member}}}, nil
	})
	p.sources = append(p.sources, src)
	p.closers = append(p.closers, src)
	rel, err := filepath.Rel(p.mount.Point, pods)
	if err != nil {
		t.Fatal(err)
	}
	p.setPodRoots([]string{rel})
	p.podsNone = none
	return p
}

// applyRead applies until the source's member is in force.
func applyRead(t *testing.T, p *projects) {
	t.Helper()
	eventually(t, func() error {
		p.apply(t.Context(), time.Now(), false)
		if m := p.membership().Members; len(m) != 1 {
			return fmt.Errorf("members %+v, want the pod's", m)
		}
		return nil
	})
}

// newTestProjects are the projects of the default configuration with the
// registered source alone, a store of the test's, closed when it ends.
func newTestProjects(t *testing.T) *projects {
	t.Helper()
	cfg := config.Default()
	cfg.StateDir = t.TempDir()
	cfg.Projects.Sources = []string{membership.SourceRegistered}
	st, err := policy.Open(cfg.StateDir, policy.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	p, err := newProjects(cfg, st, false, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.close() })
	return p
}

// podLayout makes a test's cgroup top (removed at its end), a pod root
// below it, and a pod of project team-k below that (podProjects' member).
func podLayout(t *testing.T) (top, pods, member string) {
	t.Helper()
	testutil.RequireRoot(t)
	top = testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-pods-")
	pods = testutil.MkCgroup(t, top, "kubepods")
	return top, pods, testutil.MkCgroup(t, pods, "podmember")
}
