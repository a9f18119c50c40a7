// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/crtest"
	"github.com/fairshare-dev/fairshare/internal/membership"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/policy"
)

// scanUntil scans until ok says the result is the one waited for.
func scanUntil(t *testing.T, s *Source, what string, ok func(membership.Found, error) bool) (membership.Found, error) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		f, err := s.Scan(context.Background())
		if ok(f, err) {
			return f, err
		}
		if time.Now().After(deadline) {
			t.Fatalf("waiting for %s: scan %v, %v", what, f.Members, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func read(f membership.Found, err error) bool { return err == nil }

// TestSource runs pods on a real containerd and reads them as members: the
// namespace's project, the label's, none for kube-system; a removed pod's
// member goes at the next poll; a runtime that goes away is one error
// whatever the attempt, and the members last read are the next run's Last;
// it is read again when the runtime is back.
func TestSource(t *testing.T) {
	r := crtest.Start(t)
	mount := testutil.Cgroup2Mount(t)
	a := r.RunPod(t, crtest.PodSpec{Namespace: "team-a", Name: "a", HostNetwork: true})
	b := r.RunPod(t, crtest.PodSpec{Namespace: "team-b", Name: "b"})
	l := r.RunPod(t, crtest.PodSpec{Namespace: "team-a", Name: "l", HostNetwork: true, Labels: map[string]string{DefaultProjectLabel: "billing"}})
	sys := r.RunPod(t, crtest.PodSpec{Namespace: "kube-system", Name: "dns", HostNetwork: true})
	bad := r.RunPod(t, crtest.PodSpec{Namespace: "team-b", Name: "bad", HostNetwork: true, Labels: map[string]string{DefaultProjectLabel: "../x"}})

	cri, err := DialCRI(r.Socket)
	if err != nil {
		t.Fatal(err)
	}
	cache := filepath.Join(t.TempDir(), "pods.json")
	s := NewSource(SourceOptions{CRI: cri, Rules: labelledRules(), Mount: mount, Every: 50 * time.Millisecond, Cache: cache})
	defer s.Close()
	cg := func(p *crtest.Pod) string { return filepath.Join(mount, p.CgroupParent) }
	want := []membership.Member{{Project: "team-a", Cgroup: cg(a)}, {Project: "team-b", Cgroup: cg(b)},
		{Project: "billing", Cgroup: cg(l)}, {Project: "team-b", Cgroup: cg(bad)}}
	slices.SortFunc(want, func(x, y membership.Member) int { return strings.Compare(x.Cgroup, y.Cgroup) })
	// Until every pod's status came in time (a loaded machine's runtime
	// may miss a poll's time for one: it is asked again at the next).
	scanUntil(t, s, "the pods as members", func(f membership.Found, err error) bool { return err == nil && slices.Equal(f.Members, want) })
	if s.System() != 1 {
		t.Errorf("%d pods of system namespaces, want 1 (%s)", s.System(), sys.ID)
	}
	ns := s.Netns()
	if len(ns) != 1 || ns[0].Project != "team-b" || ns[0].Pod != "team-b/b" {
		t.Fatalf("network namespaces %+v, want team-b/b's only", ns)
	}
	st1, err1 := os.Stat(ns[0].Path)
	st2, err2 := os.Stat(filepath.Join("/proc", strconv.Itoa(b.Pid), "ns/net"))
	if err1 != nil || err2 != nil || !os.SameFile(st1, st2) {
		t.Errorf("netns %s is not the pod's (%v %v)", ns[0].Path, err1, err2)
	}

	r.RemovePod(t, l)
	want = slices.DeleteFunc(want, func(m membership.Member) bool { return m.Project == "billing" })
	scanUntil(t, s, "the removed pod gone", func(f membership.Found, err error) bool { return err == nil && slices.Equal(f.Members, want) })

	r.Down(t)
	_, err = scanUntil(t, s, "the runtime's absence", func(_ membership.Found, err error) bool { return err != nil })
	// The next run starts from the members last read.
	cri2, err2 := DialCRI(r.Socket)
	if err2 != nil {
		t.Fatal(err2)
	}
	s2 := NewSource(SourceOptions{CRI: cri2, Rules: labelledRules(), Mount: mount, Cache: cache})
	if last, ok := s2.Last(); !ok || !slices.Equal(last.Members, want) {
		t.Errorf("the next run's Last: %v %v\nwant %v", last.Members, ok, want)
	}
	// And the system pods stay in no project: before the cache kept them,
	// the kernel counted kube-system's sockets as unclassified once the
	// daemon stopped waiting for the runtime.
	if none := s2.NoProject(); !slices.Equal(none, []string{cg(sys)}) {
		t.Errorf("the next run's NoProject before a poll: %v, want the system pod's %s", none, cg(sys))
	}
	s2.Close()
	if !errors.Is(err, ErrRuntime) || !strings.Contains(err.Error(), r.Socket+" is not answering") {
		t.Fatalf("scan without the runtime: %v", err)
	}
	// The same cause is the same error, poll after poll: reported once.
	time.Sleep(300 * time.Millisecond)
	if _, err2 := s.Scan(context.Background()); err2 == nil || err2.Error() != err.Error() {
		t.Errorf("the error changed from %v to %v", err, err2)
	}
	r.Up(t)
	scanUntil(t, s, "the runtime back", func(f membership.Found, err error) bool { return err == nil && slices.Equal(f.Members, want) })
}

// TestSourceAbsent: a runtime that is not there at start is the first
// poll's error, naming why, and Close returns.
func TestSourceAbsent(t *testing.T) {
	cri, err := DialCRI(filepath.Join(t.TempDir(), "none.sock"))
	if err != nil {
		t.Fatal(err)
	}
	s := NewSource(SourceOptions{CRI: cri, Rules: labelledRules(), Mount: "/sys/fs/cgroup"})
	_, err = scanUntil(t, s, "the first poll", func(_ membership.Found, err error) bool { return !errors.Is(err, membership.ErrNotRead) })
	if !errors.Is(err, ErrRuntime) || !strings.Contains(err.Error(), "no such file or directory") {
		t.Errorf("first scan: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Error(err)
	}
}

// TestSourceMembers: the rules applied to listed pods, without a runtime:
// with namespaces off, an unlabelled pod is in no project and one whose
// label is no project name is skipped with why, as is a pod whose status
// the runtime could not give usably (the others stay); a pod's namespace is opened
// through its sandbox's pid, else the runtime's path, and host-network pods
// have none of their own.
func TestSourceMembers(t *testing.T) {
	s := &Source{o: SourceOptions{Mount: "/mnt", Log: slog.New(slog.DiscardHandler),
		Rules: Rules{ProjectLabel: DefaultProjectLabel, System: []string{"kube-system"}, Validate: policy.ValidateProject}},
		warned: map[string]bool{}, refused: map[string]string{}, checked: map[string]int{}}
	s.o.CheckPid = func(pid int, dir string) error { return nil } // the pids are made up; TestSandboxPidInPodCgroup checks real ones
	pods := []Pod{
		{ID: "1", UID: "1", Namespace: "team-a", Name: "plain", Cgroup: "/kubepods/pod1", Pid: 10},
		{ID: "2", UID: "2", Namespace: "team-a", Name: "bad", Cgroup: "/kubepods/pod2", Labels: map[string]string{DefaultProjectLabel: "a b"}},
		{ID: "3", UID: "3", Namespace: "team-a", Name: "pid", Cgroup: "/kubepods/pod3", Pid: 30, NetNS: "/var/run/netns/cni-3",
			Labels: map[string]string{DefaultProjectLabel: "web"}},
		{ID: "4", UID: "4", Namespace: "team-a", Name: "path", Cgroup: "/kubepods/pod4", NetNS: "/var/run/netns/cni-4",
			Labels: map[string]string{DefaultProjectLabel: "web"}},
		{ID: "5", UID: "5", Namespace: "team-b", Name: "host", Cgroup: "/kubepods/pod5", HostNetwork: true, Pid: 50,
			Labels: map[string]string{DefaultProjectLabel: "db"}},
		{ID: "6", UID: "6", Namespace: "kube-system", Name: "dns", Cgroup: "/kubepods/pod6", Labels: map[string]string{DefaultProjectLabel: "web"}},
		{ID: "7", Namespace: "team-c", Name: "vm", Unusable: "unusable sandbox status: sandbox 7: no usable cgroup"},
	}
	f, netns, system, _, _ := s.members(pods)
	want := []membership.Member{{Project: "web", Cgroup: "/mnt/kubepods/pod3"}, {Project: "web", Cgroup: "/mnt/kubepods/pod4"},
		{Project: "db", Cgroup: "/mnt/kubepods/pod5"}}
	if !slices.Equal(f.Members, want) {
		t.Errorf("members %v\nwant %v", f.Members, want)
	}
	if len(f.Skipped) != 2 || f.Skipped[0].Cgroup != "" || f.Skipped[0].Reason != "pod team-c/vm: unusable sandbox status: sandbox 7: no usable cgroup" ||
		f.Skipped[1].Cgroup != "/mnt/kubepods/pod2" || !strings.Contains(f.Skipped[1].Reason, "team-a/bad: label fairshare.io/project") {
		t.Errorf("skipped %+v", f.Skipped)
	}
	wantNS := []PodNetns{{Path: "/proc/30/ns/net", Project: "web", Pid: 30, Cgroup: "/mnt/kubepods/pod3", Pod: "team-a/pid"},
		{Path: "/var/run/netns/cni-4", Project: "web", Cgroup: "/mnt/kubepods/pod4", Pod: "team-a/path"}}
	if !slices.Equal(netns, wantNS) {
		t.Errorf("netns %+v\nwant %+v", netns, wantNS)
	}
	if system != 1 {
		t.Errorf("%d pods of system namespaces, want 1", system)
	}
}

// TestSourceSelfNamespace: the namespace of the pod the daemon runs in
// (found from its own cgroup, SourceOptions.Self) is never a project,
// whatever the rules say, like kube-system; the pods of no project are
// listed for the kernel side (NoProject), so that below the pod roots,
// which count for the unclassified project, they count for none.
func TestSourceSelfNamespace(t *testing.T) {
	s := &Source{o: SourceOptions{Mount: "/mnt", Log: slog.New(slog.DiscardHandler), Self: "/mnt/kubepods/burstable/pod8/ctr",
		Rules: Rules{ProjectLabel: DefaultProjectLabel, Namespaces: true, System: []string{"kube-system"}, Validate: policy.ValidateProject}},
		warned: map[string]bool{}, refused: map[string]string{}, checked: map[string]int{}}
	s.o.CheckPid = func(pid int, dir string) error { return nil }
	pods := []Pod{
		{ID: "1", UID: "1", Namespace: "team-a", Name: "web", Cgroup: "/kubepods/pod1", HostNetwork: true},
		{ID: "6", UID: "6", Namespace: "kube-system", Name: "dns", Cgroup: "/kubepods/pod6", HostNetwork: true},
		{ID: "8", UID: "8", Namespace: "fairshare-system", Name: "fairshare-abcde", Cgroup: "/kubepods/burstable/pod8", HostNetwork: true,
			Labels: map[string]string{DefaultProjectLabel: "sneaky"}},
		{ID: "9", UID: "9", Namespace: "fairshare-system", Name: "other", Cgroup: "/kubepods/pod9", HostNetwork: true},
	}
	f, _, system, none, self := s.members(pods)
	if want := []membership.Member{{Project: "team-a", Cgroup: "/mnt/kubepods/pod1"}}; !slices.Equal(f.Members, want) {
		t.Errorf("members %v, want %v", f.Members, want)
	}
	if want := []string{"/mnt/kubepods/burstable/pod8", "/mnt/kubepods/pod6", "/mnt/kubepods/pod9"}; !slices.Equal(none, want) {
		t.Errorf("no project %v, want %v", none, want)
	}
	if self != "fairshare-system" || system != 3 {
		t.Errorf("self namespace %q, %d system pods", self, system)
	}
	// Outside every pod, nothing changes.
	s.o.Self = "/mnt/system.slice/fairshare.service"
	if f, _, _, _, self := s.members(pods); self != "" || len(f.Members) != 3 {
		t.Errorf("daemon in no pod: self %q, members %v", self, f.Members)
	}
}
