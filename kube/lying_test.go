// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/membership"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/policy"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	rt "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// lyingRuntime is a CRI server that reports whatever cgroups it is told:
// a runtime is not trusted with the pods' cgroups, so what is under test is
// what the source makes of them.
type lyingRuntime struct {
	rt.UnimplementedRuntimeServiceServer
	mu   sync.Mutex
	pods map[string]lyingPod // by sandbox id
}

type lyingPod struct {
	name, namespace           string // namespace: team-a when empty
	cgroupParent, cgroupsPath string
	uid                       string // "uid-<sandbox id>" when empty
}

func (l *lyingRuntime) Version(context.Context, *rt.VersionRequest) (*rt.VersionResponse, error) {
	return &rt.VersionResponse{RuntimeName: "liar", RuntimeVersion: "1"}, nil
}

func (l *lyingRuntime) ListPodSandbox(context.Context, *rt.ListPodSandboxRequest) (*rt.ListPodSandboxResponse, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var r rt.ListPodSandboxResponse
	for id, p := range l.pods {
		uid := p.uid
		if uid == "" {
			uid = "uid-" + id
		}
		ns := p.namespace
		if ns == "" {
			ns = "team-a"
		}
		r.Items = append(r.Items, &rt.PodSandbox{Id: id, State: rt.PodSandboxState_SANDBOX_READY,
			Labels: map[string]string{LabelNamespace: ns, LabelName: p.name, LabelUID: uid}})
	}
	return &r, nil
}

func (l *lyingRuntime) PodSandboxStatus(_ context.Context, req *rt.PodSandboxStatusRequest) (*rt.PodSandboxStatusResponse, error) {
	l.mu.Lock()
	p := l.pods[req.PodSandboxId]
	l.mu.Unlock()
	var info sandboxInfo
	info.Config.Linux.CgroupParent = p.cgroupParent
	info.RuntimeSpec.Linux.CgroupsPath = p.cgroupsPath
	raw, err := json.Marshal(info)
	if err != nil {
		return nil, err
	}
	return &rt.PodSandboxStatusResponse{
		Status: &rt.PodSandboxStatus{Id: req.PodSandboxId, State: rt.PodSandboxState_SANDBOX_READY,
			Linux: &rt.LinuxPodSandboxStatus{Namespaces: &rt.Namespace{Options: &rt.NamespaceOption{Network: rt.NamespaceMode_NODE}}}},
		Info: map[string]string{"info": string(raw)},
	}, nil
}

// serveCRI serves runtime on a unix socket of the test's and returns a
// client of it; the server stops when the test ends.
func serveCRI(t *testing.T, runtime rt.RuntimeServiceServer) *CRI {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "cri.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	rt.RegisterRuntimeServiceServer(srv, runtime)
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	cri, err := DialCRI(sock)
	if err != nil {
		t.Fatal(err)
	}
	return cri
}

// TestSourceLyingRuntime: a runtime that reports a pod's cgroup as the
// root, empty, with "..", outside the pods' cgroups, or the pods' cgroup
// itself makes that pod no member (else every socket of the node, or
// another tenant's, would count for the pod's project): each is skipped
// with why and logged once, naming the pod, however many polls see it;
// pods below the kubepods cgroups, in both drivers' layouts, are members.
func TestSourceLyingRuntime(t *testing.T) {
	liar := &lyingRuntime{pods: map[string]lyingPod{
		"good":        {name: "good", cgroupParent: "/kubepods/burstable/podgood", uid: "good"},
		"goodsystemd": {name: "goodsystemd", cgroupParent: "kubepods-besteffort-podgood_2.slice", uid: "good-2"},
		"goodspec":    {name: "goodspec", cgroupsPath: "kubepods-podgood_3.slice:cri-containerd:abc", uid: "good-3"},
		"otherpods":   {name: "otherpods", cgroupParent: "/kubepods/burstable/podgood"},
		"otherslice":  {name: "otherslice", cgroupParent: "kubepods-besteffort-podgood_2.slice"},
		"root":        {name: "root", cgroupParent: "/"},
		"rootslice":   {name: "rootslice", cgroupParent: "-.slice"},
		"empty":       {name: "empty"},
		"specroot":    {name: "specroot", cgroupsPath: "/abc"},
		"dotdot":      {name: "dotdot", cgroupParent: "/kubepods/../system.slice"},
		"dotdotend":   {name: "dotdotend", cgroupParent: "/kubepods/burstable/.."},
		"outside":     {name: "outside", cgroupParent: "/fairshare/team-b"},
		"prefix":      {name: "prefix", cgroupParent: "/kubepodsx/pod1"},
		"kubepods":    {name: "kubepods", cgroupParent: "/kubepods"},
		"podsslice":   {name: "podsslice", cgroupParent: "kubepods.slice"},
	}}
	cri := serveCRI(t, liar)
	var logs testutil.Buffer
	s := NewSource(SourceOptions{CRI: cri, Rules: labelledRules(), Mount: "/mnt",
		Every: 20 * time.Millisecond, Log: slog.New(slog.NewTextHandler(&logs, nil))})
	defer s.Close()
	f, _ := scanUntil(t, s, "the first poll", read)
	// Polls go on; each refusal must still be one line.
	time.Sleep(200 * time.Millisecond)
	f, _ = scanUntil(t, s, "a later poll", read)

	want := []membership.Member{
		{Project: "team-a", Cgroup: "/mnt/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-podgood_2.slice"},
		{Project: "team-a", Cgroup: "/mnt/kubepods.slice/kubepods-podgood_3.slice"},
		{Project: "team-a", Cgroup: "/mnt/kubepods/burstable/podgood"},
	}
	if len(f.Members) != len(want) {
		t.Fatalf("members %v\nwant %v", f.Members, want)
	}
	for i := range want {
		if f.Members[i] != want[i] {
			t.Errorf("member %d: %v, want %v", i, f.Members[i], want[i])
		}
	}
	lines := strings.Split(logs.String(), "\n")
	for id, p := range liar.pods {
		if strings.HasPrefix(id, "good") {
			continue
		}
		skipped := 0
		for _, sk := range f.Skipped {
			if strings.HasPrefix(sk.Reason, "pod team-a/"+p.name+": ") {
				skipped++
			}
		}
		if skipped != 1 {
			t.Errorf("pod %s (cgroup_parent %q, cgroupsPath %q) skipped %d times, want once: %+v", p.name, p.cgroupParent, p.cgroupsPath, skipped, f.Skipped)
		}
		logged := 0
		for _, l := range lines {
			// The refusal's (on a loaded machine a status may also come
			// late once: a line of its own, "could not be read").
			if strings.Contains(l, "level=WARN") && strings.Contains(l, "is refused") && strings.Contains(l, "pod=team-a/"+p.name+" ") {
				logged++
			}
		}
		if logged != 1 {
			t.Errorf("pod %s: %d warnings, want 1:\n%s", p.name, logged, logs.String())
		}
	}
}

// TestCheckPodCgroup: only a clean absolute path strictly below a pods'
// cgroup is a pod's.
func TestCheckPodCgroup(t *testing.T) {
	for cg, ok := range map[string]bool{
		"/kubepods/burstable/pod1": true, "/kubepods/pod1": true,
		"/kubepods.slice/kubepods-pod1.slice": true,
		"":                                    false, "/": false, "/kubepods": false, "/kubepods.slice": false,
		"kubepods/pod1": false, "/kubepods/pod1/": false, "/kubepods//pod1": false, "/kubepods/./pod1": false,
		"/kubepods/../etc": false, "/kubepods/pod1/..": false, "/kubepodsx/pod1": false, "/system.slice/x.service": false,
		// Another pod's cgroup, and one the pod's is merely a prefix of.
		"/kubepods/pod2": false, "/kubepods/pod12": false, "/kubepods.slice/kubepods-pod2.slice": false,
		"/kubepods/pod1/ctr": false,
	} {
		if err := CheckPodCgroup(cg, "1", nil); (err == nil) != ok {
			t.Errorf("CheckPodCgroup(%q, 1) = %v, want ok %v", cg, err, ok)
		}
	}
	// A uid's dashes are underscores in a systemd slice, only there.
	uid := "0b5f-77c1"
	for cg, ok := range map[string]bool{
		"/kubepods/besteffort/pod0b5f-77c1":                                                true,
		"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0b5f_77c1.slice": true,
		"/kubepods/besteffort/pod0b5f_77c1":                                                false,
		"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0b5f-77c1.slice": false,
	} {
		if err := CheckPodCgroup(cg, uid, nil); (err == nil) != ok {
			t.Errorf("CheckPodCgroup(%q, %s) = %v, want ok %v", cg, uid, err, ok)
		}
	}
	// A uid is what kubelet makes (letters, digits, dashes): one with an
	// underscore would match another pod's slice.
	for _, uid := range []string{"", "0b5f_77c1", "../x", "a b"} {
		if err := CheckPodCgroup("/kubepods.slice/kubepods-pod0b5f_77c1.slice", uid, nil); err == nil {
			t.Errorf("uid %q: accepted", uid)
		}
	}
	if err := CheckPodCgroup("/kubelet/kubepods/pod1", "1", []string{"/kubelet/kubepods"}); err != nil {
		t.Errorf("below a configured root: %v", err)
	}
	if err := CheckPodCgroup("/kubepods/pod1", "1", []string{"/kubelet/kubepods"}); err == nil {
		t.Error("below a root not configured: accepted")
	}
}

// TestSandboxPidInPodCgroup: a runtime that names, for a pod, another
// pod's cgroup with a uid that matches it (a runtime lying consistently:
// CheckPodCgroup alone passes it) is caught by the pod's sandbox's process,
// which is not in that cgroup: the pod is refused, listed with why and
// logged once; a pod whose sandbox's process is in its cgroup (below it,
// in its sandbox container's) is a member. Before, the liar was a member
// too, in its own project, of its victim's cgroup.
func TestSandboxPidInPodCgroup(t *testing.T) {
	testutil.RequireRoot(t)
	mount := testutil.Cgroup2Mount(t)
	top := testutil.TempCgroup(t, mount, "fairshare-kube-pid-")
	pods := testutil.KubeletCgroupfs(t, top, []string{"burstable", "besteffort"}, 1)
	var pids []int
	for _, p := range pods {
		cmd := exec.Command("sleep", "60")
		testutil.StartInCgroup(t, cmd, p.Containers[0])
		pids = append(pids, cmd.Process.Pid)
	}
	rel := func(dir string) string { return strings.TrimPrefix(dir, mount) }
	logs := &strings.Builder{}
	s := &Source{o: SourceOptions{Mount: mount, Log: slog.New(slog.NewTextHandler(logs, nil)),
		PodCgroups: []string{rel(filepath.Join(top, "kubepods"))}, CheckPid: checkPidBelow(mount),
		Rules: Rules{ProjectLabel: DefaultProjectLabel, Validate: policy.ValidateProject}},
		warned: map[string]bool{}, refused: map[string]string{}, checked: map[string]int{}}
	list := []Pod{
		{ID: "honest", UID: pods[0].UID, Namespace: "team-a", Name: "honest", Cgroup: rel(pods[0].Cgroup), Pid: pids[0],
			Labels: map[string]string{DefaultProjectLabel: "web"}},
		// The liar's process is team-b's (pods[1]); it claims team-a's pod.
		{ID: "liar", UID: pods[0].UID, Namespace: "team-b", Name: "liar", Cgroup: rel(pods[0].Cgroup), Pid: pids[1],
			Labels: map[string]string{DefaultProjectLabel: "evil"}},
	}
	for range 3 {
		f, _, _, _, _ := s.members(list)
		if want := []membership.Member{{Project: "web", Cgroup: pods[0].Cgroup}}; !slices.Equal(f.Members, want) {
			t.Fatalf("members %v, want %v", f.Members, want)
		}
		if len(f.Skipped) != 1 || !strings.Contains(f.Skipped[0].Reason, "pod team-b/liar: its sandbox's process") {
			t.Fatalf("skipped %+v, want team-b/liar", f.Skipped)
		}
	}
	if k := strings.Count(logs.String(), "sandbox=liar"); k != 1 {
		t.Errorf("%d log lines about the liar, want 1:\n%s", k, logs)
	}
	t.Logf("%s", logs)
}

// stallingRuntime is lyingRuntime whose status of some sandboxes hangs
// (until the caller gives up: a hung shim, which containerd asks for the
// verbose status) or fails.
type stallingRuntime struct {
	lyingRuntime
	mu   sync.Mutex
	hang map[string]bool
	fail map[string]bool
}

func (s *stallingRuntime) PodSandboxStatus(ctx context.Context, req *rt.PodSandboxStatusRequest) (*rt.PodSandboxStatusResponse, error) {
	s.mu.Lock()
	hang, fail := s.hang[req.PodSandboxId], s.fail[req.PodSandboxId]
	s.mu.Unlock()
	if hang {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	if fail {
		return nil, status.Error(codes.Internal, "failed to get task status: ttrpc: closed")
	}
	return s.lyingRuntime.PodSandboxStatus(ctx, req)
}

// TestSourceStallingSandbox: one sandbox whose status hangs or fails used to
// fail the whole list, every poll (it is never cached): every new pod of
// every tenant stayed unclassified. Now the others are listed (more than
// the statuses asked at once), the bad ones are skipped with why, and
// become members once the runtime answers for them.
func TestSourceStallingSandbox(t *testing.T) {
	rtm := &stallingRuntime{lyingRuntime: lyingRuntime{pods: map[string]lyingPod{
		"hung": {name: "hung", cgroupParent: "/kubepods/podhung", uid: "hung"},
		"fail": {name: "fail", cgroupParent: "/kubepods/podfail", uid: "fail"},
	}}, hang: map[string]bool{"hung": true}, fail: map[string]bool{"fail": true}}
	for i := range 2 * statusWorkers {
		id := fmt.Sprintf("good%d", i)
		rtm.pods[id] = lyingPod{name: id, cgroupParent: "/kubepods/pod" + id, uid: id}
	}
	cri := serveCRI(t, rtm)
	var logs testutil.Buffer
	s := NewSource(SourceOptions{CRI: cri, Rules: labelledRules(), Mount: "/mnt",
		Every: 300 * time.Millisecond, Log: slog.New(slog.NewTextHandler(&logs, nil))})
	defer s.Close()
	members := func(f membership.Found) map[string]bool {
		m := map[string]bool{}
		for _, x := range f.Members {
			m[filepath.Base(x.Cgroup)] = true
		}
		return m
	}
	f, _ := scanUntil(t, s, "the good pods", func(f membership.Found, err error) bool { return err == nil && len(f.Members) == 2*statusWorkers })
	for i := range 2 * statusWorkers {
		if !members(f)[fmt.Sprintf("podgood%d", i)] {
			t.Errorf("good%d is not a member: %v", i, f.Members)
		}
	}
	for _, bad := range []string{"hung", "fail"} {
		n := 0
		for _, sk := range f.Skipped {
			if strings.HasPrefix(sk.Reason, "pod team-a/"+bad+": no status from the runtime yet: ") {
				n++
			}
		}
		if n != 1 || members(f)["pod"+bad] {
			t.Errorf("%s: skipped %d times (want once), member %v: %+v", bad, n, members(f)["pod"+bad], f.Skipped)
		}
	}
	rtm.mu.Lock()
	rtm.hang, rtm.fail = nil, nil
	rtm.mu.Unlock()
	f, _ = scanUntil(t, s, "the runtime answers for all", func(f membership.Found, err error) bool { return err == nil && len(f.Members) == 2*statusWorkers+2 })
	if len(f.Skipped) != 0 {
		t.Errorf("still skipped: %+v", f.Skipped)
	}
}

// TestSourcePendingKeepsKnown: after a restart every sandbox is new to the
// client, so a runtime slow to answer for pods it listed before made them
// Pending, the poll counted as good, and they left their projects (and
// kube-system's pods the no-project list), the cache rewritten without
// them. A Pending pod known from the last run keeps what it had; a new one
// is skipped; each is logged once, however many polls see it.
func TestSourcePendingKeepsKnown(t *testing.T) {
	rtm := &stallingRuntime{lyingRuntime: lyingRuntime{pods: map[string]lyingPod{
		"known": {name: "known", cgroupParent: "/kubepods/podknown", uid: "known"},
		"sys":   {name: "sys", namespace: "kube-system", cgroupParent: "/kubepods/podsys", uid: "sys"},
	}}}
	cache := filepath.Join(t.TempDir(), "pods.json")
	rules := labelledRules()
	s1 := NewSource(SourceOptions{CRI: serveCRI(t, rtm), Rules: rules, Mount: "/mnt", Every: 50 * time.Millisecond, Cache: cache})
	scanUntil(t, s1, "the first run's poll", func(f membership.Found, err error) bool { return err == nil && len(f.Members) == 1 })
	if none := s1.NoProject(); !slices.Equal(none, []string{"/mnt/kubepods/podsys"}) {
		t.Fatalf("no project %v", none)
	}
	s1.Close()

	rtm.mu.Lock()
	rtm.pods["fresh"] = lyingPod{name: "fresh", cgroupParent: "/kubepods/podfresh", uid: "fresh"}
	rtm.hang = map[string]bool{"known": true, "sys": true, "fresh": true}
	rtm.mu.Unlock()
	var logs testutil.Buffer
	s2 := NewSource(SourceOptions{CRI: serveCRI(t, rtm), Rules: rules, Mount: "/mnt", Every: 50 * time.Millisecond, Cache: cache,
		Log: slog.New(slog.NewTextHandler(&logs, nil))})
	defer s2.Close()
	f, _ := scanUntil(t, s2, "the restart's poll", read)
	time.Sleep(300 * time.Millisecond) // polls go on
	f, _ = scanUntil(t, s2, "a later poll", read)
	if want := []membership.Member{{Project: "team-a", Cgroup: "/mnt/kubepods/podknown"}}; !slices.Equal(f.Members, want) {
		t.Errorf("members %v, want %v (kept while its status hangs)", f.Members, want)
	}
	if none := s2.NoProject(); !slices.Equal(none, []string{"/mnt/kubepods/podsys"}) {
		t.Errorf("no project %v, want the system pod's kept", none)
	}
	if len(f.Skipped) != 1 || !strings.HasPrefix(f.Skipped[0].Reason, "pod team-a/fresh: no status from the runtime yet: ") {
		t.Errorf("skipped %+v, want the new pod only", f.Skipped)
	}
	for _, pod := range []string{"team-a/known", "kube-system/sys", "team-a/fresh"} {
		if n := strings.Count(logs.String(), "pod="+pod+" "); n != 1 {
			t.Errorf("%s: %d log lines, want 1:\n%s", pod, n, logs.String())
		}
	}
}

// TestSourceSignalsNoProjectPods: a new pod of a system namespace changes
// no member and no skipped cgroup, and is signalled all the same, so the
// daemon takes it out of every project at once rather than at its next
// tick: until then it counted in the pods' (unclassified) project and could
// be refused.
func TestSourceSignalsNoProjectPods(t *testing.T) {
	liar := &lyingRuntime{pods: map[string]lyingPod{
		"good": {name: "good", cgroupParent: "/kubepods/burstable/podgood", uid: "good"},
	}}
	cri := serveCRI(t, liar)
	s := NewSource(SourceOptions{CRI: cri, Rules: labelledRules(), Mount: "/mnt", Every: 20 * time.Millisecond})
	defer s.Close()
	scanUntil(t, s, "the first poll", read)
	time.Sleep(100 * time.Millisecond) // later polls: nothing changes
	for drained := false; !drained; {
		select {
		case <-s.Changed():
		default:
			drained = true
		}
	}
	liar.mu.Lock()
	liar.pods["dns"] = lyingPod{name: "dns", namespace: "kube-system", cgroupParent: "/kubepods/burstable/poddns", uid: "dns"}
	liar.mu.Unlock()
	want := "/mnt/kubepods/burstable/poddns"
	deadline := time.After(10 * time.Second)
	for !slices.Contains(s.NoProject(), want) {
		select {
		case <-s.Changed():
		case <-deadline:
			t.Fatalf("a new system pod was never signalled: NoProject %v", s.NoProject())
		}
	}
}

// versionHangingRuntime answers the pod list but not its version until
// released.
type versionHangingRuntime struct {
	lyingRuntime
	asked    chan struct{} // closed at the first Version
	once     sync.Once
	release  chan struct{}
	returned atomic.Bool // a Version has returned
}

func (v *versionHangingRuntime) Version(ctx context.Context, req *rt.VersionRequest) (*rt.VersionResponse, error) {
	v.once.Do(func() { close(v.asked) })
	defer v.returned.Store(true)
	select {
	case <-v.release:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return v.lyingRuntime.Version(ctx, req)
}

// TestSlowVersionDoesNotHoldTheSource: a runtime that answers the pod list
// and hangs on its version (asked once, at the first good poll) keeps
// NoProject and Netns, which the daemon's control loop calls every tick,
// answering: the source's lock is not held across the call.
func TestSlowVersionDoesNotHoldTheSource(t *testing.T) {
	rtm := &versionHangingRuntime{lyingRuntime: lyingRuntime{pods: map[string]lyingPod{
		"sys": {name: "sys", namespace: "kube-system", cgroupParent: "/kubepods/podsys", uid: "sys"},
	}}, asked: make(chan struct{}), release: make(chan struct{})}
	s := NewSource(SourceOptions{CRI: serveCRI(t, rtm), Rules: labelledRules(), Mount: "/mnt", Every: time.Hour,
		Cache: filepath.Join(t.TempDir(), "pods.json")})
	defer s.Close()
	defer close(rtm.release)
	select {
	case <-rtm.asked:
	case <-time.After(30 * time.Second):
		t.Fatal("the source never asked the runtime's version")
	}
	// The poll's pods are kept before the version is asked: NoProject
	// gives them while the version hangs.
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			s.Netns()
			if slices.Equal(s.NoProject(), []string{"/mnt/kubepods/podsys"}) {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	select {
	case <-done:
		// CRI.Ping bounds the call (2 s): answered before any version
		// call ended, or it waited for one.
		if rtm.returned.Load() {
			t.Fatal("NoProject answered only once the runtime's version call ended")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("NoProject waited for the runtime's version")
	}
}
