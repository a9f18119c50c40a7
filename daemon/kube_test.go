// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/internal/crtest"
	"github.com/fairshare-dev/fairshare/internal/membership"
	"github.com/fairshare-dev/fairshare/internal/netnsscan"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/kube"
	"github.com/fairshare-dev/fairshare/loader"
	"github.com/fairshare-dev/fairshare/policy"
)

// testProjects builds the projects part of cfg over a policy store of its
// own (in cfg.StateDir, a fresh directory if unset), logging to log
// (discarded if nil); both are closed when the test ends.
func testProjects(t *testing.T, cfg config.Config, log slog.Handler) *projects {
	t.Helper()
	if cfg.StateDir == "" {
		cfg.StateDir = t.TempDir()
	}
	st, err := policy.Open(cfg.StateDir, policy.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	if log == nil {
		log = slog.DiscardHandler
	}
	p, err := newProjects(cfg, st, false, slog.New(log))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.close() })
	return p
}

// kubeConfig is a configuration whose one source is the kubernetes one, on
// runtime r, ticking every 100 ms.
func kubeConfig(t *testing.T, r *crtest.Runtime) config.Config {
	t.Helper()
	cfg := config.Default()
	cfg.StateDir, cfg.Projects.Sources, cfg.Tick = t.TempDir(), []string{membership.SourceKubernetes}, 100*time.Millisecond
	cfg.Kubernetes.RuntimeEndpoint = r.Socket
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	return cfg
}

// TestKubernetesSource: with projects.sources [kubernetes], a real
// containerd's pods are the members (kube-system's none), a pod's own
// network namespace is handed to the kernel side in the apply that
// registers the pod, before any scan step, and only once; a removed pod's
// member and namespace go.
func TestKubernetesSource(t *testing.T) {
	r := crtest.Start(t)
	mount := testutil.Cgroup2Mount(t)
	a := r.RunPod(t, crtest.PodSpec{Namespace: "team-a", Name: "a", HostNetwork: true})
	b := r.RunPod(t, crtest.PodSpec{Namespace: "team-b", Name: "b"})
	r.RunPod(t, crtest.PodSpec{Namespace: "kube-system", Name: "dns"})
	p := testProjects(t, kubeConfig(t, r), nil)
	h := &handOff{}
	p.kernel = h
	members := func() []string {
		var got []string
		for _, e := range p.membership().Members {
			got = append(got, e.Project+"@"+e.Source+":"+e.Cgroup)
		}
		slices.Sort(got) // the membership's order is the cgroups'
		return got
	}
	want := []string{"team-a@kubernetes:" + filepath.Join(mount, a.CgroupParent), "team-b@kubernetes:" + filepath.Join(mount, b.CgroupParent)}
	slices.Sort(want)
	// Not a tick: no scan step. The source answers at its first poll.
	eventually(t, func() error {
		p.apply(t.Context(), time.Now(), false)
		if got := members(); !slices.Equal(got, want) {
			return fmt.Errorf("members %v, want %v", got, want)
		}
		return nil
	})
	bNetns := "/proc/" + strconv.Itoa(b.Pid) + "/ns/net"
	ino, err := netnsscan.Inode(bNetns)
	if err != nil {
		t.Fatal(err)
	}
	h.mu.Lock()
	attached := slices.Clone(h.attached)
	h.mu.Unlock()
	if len(attached) != 1 {
		t.Fatalf("attached %v at the first apply, want team-b/b's namespace", attached)
	}
	if got, _ := netnsscan.Inode(attached[0]); got != ino {
		t.Fatalf("attached %s, not team-b/b's namespace %s", attached[0], bNetns)
	}
	// The scan finds the same namespace from the pod's processes: not
	// attached twice, and shown attached.
	for range 3 {
		p.apply(t.Context(), time.Now(), true)
	}
	h.mu.Lock()
	n := len(h.attached)
	h.mu.Unlock()
	if n != 1 {
		t.Errorf("%d attaches, want 1", n)
	}
	if ns := p.membership().Netns.Namespaces; len(ns) != 1 || ns[0].Inode != ino || !ns[0].Attached {
		t.Errorf("namespaces %+v, want team-b/b's attached", ns)
	}

	r.RemovePod(t, b)
	eventually(t, func() error {
		p.apply(t.Context(), time.Now(), true)
		if got := members(); !slices.Equal(got, want[:1]) {
			return fmt.Errorf("members %v after team-b/b was removed", got)
		}
		if len(p.podNetns) != 0 {
			return fmt.Errorf("pod namespaces %v after team-b/b was removed", p.podNetns)
		}
		return nil
	})
}

// TestPodNetnsOpenedByPidfd: a pod's network namespace is attached by its
// sandbox's pid only while that pid is a process of the pod's cgroup (the
// runtime's pid may be a poll old, and reused by another tenant's process
// in another namespace); the refusal is logged once, naming the pod.
func TestPodNetnsOpenedByPidfd(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-podnetns-")
	pod := testutil.MkCgroup(t, top, "podA")
	sandboxCg := testutil.MkCgroup(t, pod, "sandbox")
	other := testutil.MkCgroup(t, top, "podB")
	start := func(dir string) *exec.Cmd {
		cmd := exec.Command("sleep", "60")
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
		testutil.StartInCgroup(t, cmd, dir)
		return cmd
	}
	sandbox, stranger := start(sandboxCg), start(other)
	cfg := config.Default()
	cfg.Projects.Sources = []string{membership.SourceRegistered}
	var logs strings.Builder
	p := testProjects(t, cfg, slog.NewTextHandler(&logs, nil))
	h := &handOff{}
	p.kernel = h
	hint := func(pid int) kube.PodNetns {
		return kube.PodNetns{Path: "/proc/" + strconv.Itoa(pid) + "/ns/net", Pid: pid, Cgroup: pod, Project: "team-a", Pod: "team-a/web"}
	}
	// The runtime's pid is now the stranger's: refused, however often.
	for range 3 {
		p.attachPodNetns(time.Now(), []kube.PodNetns{hint(stranger.Process.Pid)})
	}
	if len(h.attached) != 0 || len(p.attached) != 0 {
		t.Fatalf("attached %v (%+v) by a pid of another cgroup", h.attached, p.attached)
	}
	if n := strings.Count(logs.String(), "pod=team-a/web"); n != 1 {
		t.Errorf("%d log lines name the pod, want 1:\n%s", n, logs.String())
	}
	// The sandbox's own pid: attached, in its namespace.
	p.attachPodNetns(time.Now(), []kube.PodNetns{hint(sandbox.Process.Pid)})
	ino, _ := netnsscan.Inode(hint(sandbox.Process.Pid).Path)
	if a, ok := p.attached[ino]; len(h.attached) != 1 || !ok || !a.Attached {
		t.Fatalf("the sandbox's namespace %d: attached %v, %+v", ino, h.attached, p.attached)
	}
}

// TestPodNetnsPathNotANamespace: a runtime that gives a pod no pid and, as
// its namespace, a FIFO (or any file that is not a network namespace it
// mounted) gets nothing attached, the membership loop does not wait on it,
// and the refusal is logged once for the pod. os.Open of the FIFO blocked
// attachPodNetns, and with it the loop, for ever.
func TestPodNetnsPathNotANamespace(t *testing.T) {
	testutil.RequireRoot(t)
	dir := t.TempDir()
	fifo := filepath.Join(dir, "netns")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := config.Default()
	cfg.StateDir, cfg.Projects.Sources = dir, []string{membership.SourceRegistered}
	logs := &records{}
	p := testProjects(t, cfg, logs)
	h := &handOff{}
	p.kernel = h
	hints := []kube.PodNetns{{Path: fifo, Project: "team-a", Pod: "team-a/liar"}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range 3 {
			p.attachPodNetns(time.Now(), hints)
		}
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("attachPodNetns still blocked after 5 s on a FIFO the runtime named as a pod's namespace")
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.attached) != 0 || len(p.attached) != 0 {
		t.Errorf("attached %v (%v) by a FIFO", h.attached, p.attached)
	}
	const msg = "a pod's network namespace is not opened: the runtime's path to it is not a network " +
		"namespace it mounted; the scan finds the namespace from the pod's processes"
	if k := len(logs.find(msg)); k != 1 {
		t.Errorf("%d log lines about team-a/liar's path, want 1", k)
	}
}

// goneKernel is a handOff whose DetachGone reports the namespaces of
// cookies put in gone, each once.
type goneKernel struct {
	handOff
	gone []netnsInfo
}

func (g *goneKernel) AttachNetns(ns *os.File, path string) (netnsInfo, error) {
	info, err := g.handOff.AttachNetns(ns, path)
	info.Cookie = info.Inode // one link per namespace
	return info, err
}

func (g *goneKernel) DetachGone() ([]netnsInfo, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	gone := g.gone
	g.gone = nil
	return gone, nil
}

// goneProjects is the projects of a registered source (the configuration
// edited by edit, if not nil) over a goneKernel.
func goneProjects(t *testing.T, edit func(*config.Config)) (*projects, *goneKernel) {
	t.Helper()
	cfg := config.Default()
	cfg.Projects.Sources = []string{membership.SourceRegistered}
	if edit != nil {
		edit(&cfg)
	}
	p := testProjects(t, cfg, nil)
	k := &goneKernel{}
	p.kernel = k
	return p, k
}

// TestPodNetnsChargedUntilDetached: a pod's namespace counts toward its
// project's connections.max_netns_per_project (1 here) after its pod is
// gone, as long as the kernel side holds its link, and stops counting when
// DetachGone reports it, with or without the namespace scan (here without).
func TestPodNetnsChargedUntilDetached(t *testing.T) {
	testutil.RequireRoot(t)
	var paths []string
	for i := range 2 {
		name := fmt.Sprintf("fairshare-charge-%d-%d-%d", os.Getpid(), time.Now().UnixNano(), i)
		if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
			t.Fatalf("ip netns add: %v\n%s", err, out)
		}
		t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
		paths = append(paths, "/run/netns/"+name)
	}
	p, k := goneProjects(t, func(c *config.Config) { c.Connections.MaxNetnsPerProject = 1 })
	p.scan = nil
	hint := func(i int) []kube.PodNetns {
		return []kube.PodNetns{{Path: paths[i], Project: "team-a", Pod: fmt.Sprintf("team-a/p%d", i)}}
	}
	p.attachPodNetns(time.Now(), hint(0))
	first, _ := netnsscan.Inode(paths[0])
	if a := p.attached[first]; !a.Attached {
		t.Fatalf("the first pod's namespace: %+v, want attached", a)
	}
	// The first pod is gone; its namespace lives on (a file holds it).
	p.apply(t.Context(), time.Now(), true)
	p.attachPodNetns(time.Now(), hint(1))
	second, _ := netnsscan.Inode(paths[1])
	if a := p.attached[second]; a.Attached || !strings.Contains(a.Error, "max_netns_per_project") {
		t.Fatalf("the second pod's namespace, the first's link held: %+v, want refused at the project's bound", a)
	}
	k.mu.Lock()
	k.gone = []netnsInfo{{Cookie: first, Inode: first}}
	k.mu.Unlock()
	p.apply(t.Context(), time.Now(), true) // a tick: DetachGone
	p.attachPodNetns(time.Now(), hint(1))
	if a := p.attached[second]; !a.Attached {
		t.Errorf("the second pod's namespace, the first's link detached: %+v, want attached", a)
	}
}

// TestKubernetesKernelExtras: under Kubernetes the kernel side gets, beside
// the pods in force, the pod roots and their QoS children as weak members
// of the reserved unclassified project (a pod not classified yet counts for
// it), the cgroups of pods in no project (kube-system's) as members of no
// project below them, and the daemon's own cgroup as one of no project;
// the kernel's extras found at a restart are not taken for members in
// force.
func TestKubernetesKernelExtras(t *testing.T) {
	r := crtest.Start(t)
	mount := testutil.Cgroup2Mount(t)
	a := r.RunPod(t, crtest.PodSpec{Namespace: "team-a", Name: "a", HostNetwork: true})
	dns := r.RunPod(t, crtest.PodSpec{Namespace: "kube-system", Name: "dns", HostNetwork: true})
	p := testProjects(t, kubeConfig(t, r), nil)
	h := &handOff{seed: []membership.Member{{Project: loader.Unclassified, Cgroup: filepath.Join(mount, "kubepods")}}}
	p.kernel = h
	want := []membership.Member{
		{Project: "team-a", Cgroup: filepath.Join(mount, a.CgroupParent)},
		{Project: loader.Unclassified, Cgroup: filepath.Join(mount, "kubepods")},
		{Project: loader.Unclassified, Cgroup: filepath.Join(mount, "kubepods/burstable")},
		{Project: loader.NoProject, Cgroup: filepath.Join(mount, dns.CgroupParent)},
	}
	if p.self != "" {
		want = append(want, membership.Member{Project: loader.NoProject, Cgroup: p.self})
	}
	eventually(t, func() error {
		p.apply(t.Context(), time.Now(), true)
		h.mu.Lock()
		defer h.mu.Unlock()
		if len(h.sets) == 0 {
			return fmt.Errorf("no members handed to the kernel")
		}
		got := h.sets[len(h.sets)-1]
		for _, w := range want {
			if !slices.Contains(got, w) {
				return fmt.Errorf("kernel members %v lack %v", got, w)
			}
		}
		return nil
	})
	for _, m := range p.membership().Members {
		if m.Project == loader.Unclassified || m.Project == loader.NoProject {
			t.Errorf("the kernel's extra %v is a member in force", m)
		}
	}
}

// TestNetnsInodeReused: once the kernel side reports a namespace's link gone
// (its namespace died), a namespace found with the same inode (the kernel
// gives a dead namespace's number to the next one made: a pod's sandbox
// made again, a tenant's process unsharing again) is attached as a new one,
// not taken for the dead one and left without inbound admission.
func TestNetnsInodeReused(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-reuse-")
	cg := testutil.MkCgroup(t, top, "pod")
	cmd := exec.Command("sleep", "60")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
	testutil.StartInCgroup(t, cmd, cg)
	ino, err := netnsscan.Inode(fmt.Sprintf("/proc/%d/ns/net", cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	p, k := goneProjects(t, nil)
	p.scan.SetMembers([]membership.Entry{{Member: membership.Member{Project: "team-a", Cgroup: cg}, Source: membership.SourceRegistered}})
	attaches := func() int {
		k.mu.Lock()
		defer k.mu.Unlock()
		return len(k.attached)
	}
	tick := func() { p.netns(time.Now(), true, false) } // apply's, without the sources
	tick()
	if a := p.attached[ino]; !a.Attached || attaches() != 1 {
		t.Fatalf("the pod's namespace: %+v after %d attaches, want attached once", a, attaches())
	}
	// Its link reported gone while a namespace of that inode lives: to the
	// daemon, a namespace made again with the dead one's number.
	k.mu.Lock()
	k.gone = []netnsInfo{{Cookie: ino, Inode: ino}}
	k.mu.Unlock()
	tick()
	if a := p.attached[ino]; !a.Attached || attaches() != 2 {
		t.Fatalf("the namespace with the dead one's inode: %+v after %d attaches, want attached again at the same tick", a, attaches())
	}
}

// TestSettleChangedAsScanned: a change of a member whose process the scan
// found in an attached namespace walks that namespace, though the record of
// the attach does not name the member (made by the kubernetes source's
// word, which knows the pod alone): the scan's members of it count.
func TestSettleChangedAsScanned(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-asscanned-")
	pod, other := testutil.MkCgroup(t, top, "pod"), testutil.MkCgroup(t, top, "other")
	sandbox := exec.Command("sleep", "60")
	sandbox.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
	testutil.StartInCgroup(t, sandbox, pod)
	ns := fmt.Sprintf("/proc/%d/ns/net", sandbox.Process.Pid)
	ino, err := netnsscan.Inode(ns)
	if err != nil {
		t.Fatal(err)
	}
	guest := exec.Command("nsenter", "--net="+ns, "sleep", "60")
	testutil.StartInCgroup(t, guest, other)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if got, _ := netnsscan.Inode(fmt.Sprintf("/proc/%d/ns/net", guest.Process.Pid)); got == ino {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the guest did not enter the pod's namespace")
		}
	}
	cfg := config.Default()
	cfg.Projects.Sources = []string{membership.SourceRegistered}
	p := testProjects(t, cfg, nil)
	p.scan.SetMembers([]membership.Entry{
		{Member: membership.Member{Project: "team-b", Cgroup: other}, Source: membership.SourceRegistered},
		{Member: membership.Member{Project: "team-a", Cgroup: pod}, Source: membership.SourceRegistered},
	})
	p.scan.Step()
	p.attached[ino] = admin.Namespace{Namespace: netnsscan.Namespace{Inode: ino, Cgroup: pod, Projects: []string{"team-a"}},
		Attached: true, Cookie: 42}
	p.settleChanged([]string{other})
	if !p.settleNetns[42] {
		t.Errorf("team-b's member changed: walks %v, want the pod's namespace (cookie 42), where the scan found its process", p.settleNetns)
	}
}

// TestPodNetnsOfAnotherID: the kubernetes source names a pod's namespace
// whose inode number has the record of a dead namespace (another id): it is
// attached as a new one, not skipped as attached already.
func TestPodNetnsOfAnotherID(t *testing.T) {
	testutil.RequireRoot(t)
	name := fmt.Sprintf("fairshare-id-%d-%d", os.Getpid(), time.Now().UnixNano())
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v\n%s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
	path := "/run/netns/" + name
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	id, err := netnsscan.ID(f)
	f.Close()
	if err != nil || id == 0 {
		t.Skipf("no namespace ids on this kernel (%d, %v)", id, err)
	}
	ino, err := netnsscan.Inode(path)
	if err != nil {
		t.Fatal(err)
	}
	p, k := goneProjects(t, nil)
	p.scan = nil
	p.attached[ino] = admin.Namespace{Namespace: netnsscan.Namespace{Inode: ino, ID: id + 1000}, Attached: true, Cookie: 77}
	p.attachPodNetns(time.Now(), []kube.PodNetns{{Path: path, Project: "team-a", Pod: "team-a/p"}})
	k.mu.Lock()
	attached := len(k.attached)
	k.mu.Unlock()
	if a := p.attached[ino]; attached != 1 || !a.Attached || a.ID != id {
		t.Fatalf("after %d attaches the record is %+v, want the pod's namespace (id %d) attached", attached, a, id)
	}
}

// flakyKernel is a goneKernel whose AttachNetns fails for the namespaces of
// the inodes in fail, as many times as given, with err (if not nil).
type flakyKernel struct {
	goneKernel
	fail map[uint64]int
	err  error
}

func (f *flakyKernel) AttachNetns(ns *os.File, path string) (netnsInfo, error) {
	var st syscall.Stat_t
	if err := syscall.Fstat(int(ns.Fd()), &st); err != nil {
		return netnsInfo{}, err
	}
	f.mu.Lock()
	if f.fail[st.Ino] > 0 {
		f.fail[st.Ino]--
		f.mu.Unlock()
		if f.err != nil {
			return netnsInfo{}, f.err
		}
		return netnsInfo{}, errors.New("a passing failure")
	}
	f.mu.Unlock()
	return f.goneKernel.AttachNetns(ns, path)
}

// TestNetnsRetryNotStarved: at the end of a sweep the namespaces not
// attached are tried again, a few at a time. A tenant at its bound of
// attached namespaces (1 here) holding many more, of lower inode numbers,
// does not take those few places from another tenant's namespace whose
// attach failed for a passing reason: that one is attached at the next
// sweep's end, here the same tick's.
func TestNetnsRetryNotStarved(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-starve-")
	var es []membership.Entry
	var greedy []uint64
	start := func(project, cg string) uint64 {
		cmd := exec.Command("sleep", "60")
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
		testutil.StartInCgroup(t, cmd, cg)
		es = append(es, membership.Entry{Member: membership.Member{Project: project, Cgroup: cg}, Source: membership.SourceRegistered})
		ino, err := netnsscan.Inode(fmt.Sprintf("/proc/%d/ns/net", cmd.Process.Pid))
		if err != nil {
			t.Fatal(err)
		}
		return ino
	}
	for i := range 2*podNetnsPerApply + 1 {
		greedy = append(greedy, start("team-t", testutil.MkCgroup(t, top, fmt.Sprintf("t%02d", i))))
	}
	victim := start("team-u", testutil.MkCgroup(t, top, "u"))
	if victim < slices.Max(greedy) {
		t.Skipf("the victim's namespace (inode %d) is not above the greedy tenant's (up to %d): the kernel gave a lower number", victim, slices.Max(greedy))
	}
	slices.SortFunc(es, membership.Compare)
	p, _ := goneProjects(t, func(c *config.Config) { c.Connections.MaxNetnsPerProject = 1 })
	k := &flakyKernel{fail: map[uint64]int{victim: 1}}
	p.kernel = k
	p.scan.SetMembers(es)
	for tick := range 3 {
		p.netns(time.Now(), true, false)
		if p.attached[victim].Attached {
			t.Logf("the victim's namespace attached at tick %d", tick+1)
			return
		}
	}
	t.Fatalf("the victim's namespace, its first attach failed, is still not attached after 3 sweeps: %+v", p.attached[victim])
}

// TestPodNetnsRetryNotStarved: the kubernetes source's pods' namespaces
// refused at a cap are tried again at each apply, a few at a time. A tenant
// at its bound (1 here) with many pods listed first does not take those few
// places from another tenant's pod refused once at the node's cap.
func TestPodNetnsRetryNotStarved(t *testing.T) {
	testutil.RequireRoot(t)
	var hints []kube.PodNetns
	add := func(project string, i int) uint64 {
		name := fmt.Sprintf("fairshare-starve-%d-%d-%d", os.Getpid(), time.Now().UnixNano(), i)
		if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
			t.Fatalf("ip netns add: %v\n%s", err, out)
		}
		t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
		hints = append(hints, kube.PodNetns{Path: "/run/netns/" + name, Project: project, Pod: project + "/" + name})
		ino, err := netnsscan.Inode("/run/netns/" + name)
		if err != nil {
			t.Fatal(err)
		}
		return ino
	}
	for i := range 2*podNetnsPerApply + 1 {
		add("team-t", i)
	}
	victim := add("team-u", 99)
	p, _ := goneProjects(t, func(c *config.Config) { c.Connections.MaxNetnsPerProject = 1 })
	k := &flakyKernel{fail: map[uint64]int{victim: 1}, err: errNetnsFull}
	p.kernel, p.scan = k, nil
	for apply := range 6 {
		p.attachPodNetns(time.Now(), hints)
		if p.attached[victim].Attached {
			t.Logf("the victim's namespace attached at apply %d", apply+1)
			return
		}
	}
	t.Fatalf("the victim's namespace, refused once at the node's cap, is still not attached after 6 applies: %+v", p.attached[victim])
}
