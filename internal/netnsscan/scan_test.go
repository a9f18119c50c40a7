// SPDX-License-Identifier: Apache-2.0

package netnsscan_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/membership"
	"github.com/fairshare-dev/fairshare/internal/netnsscan"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"golang.org/x/sys/unix"
)

// inNewNetns starts sleep in the cgroup dir and in a network namespace of
// its own (as a pod's sandbox is).
func inNewNetns(t *testing.T, dir string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("sleep", "60")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
	testutil.StartInCgroup(t, cmd, dir)
	return cmd
}

// joining starts sleep in the cgroup dir, in the network namespace of pid
// (a second container of the pod).
func joining(t *testing.T, dir string, pid int) *exec.Cmd {
	t.Helper()
	ns := "/proc/" + strconv.Itoa(pid) + "/ns/net"
	cmd := exec.Command("nsenter", "--net="+ns, "sleep", "60")
	testutil.StartInCgroup(t, cmd, dir)
	waitIn(t, cmd.Process.Pid, ns)
	return cmd
}

// waitIn waits until process pid has entered the namespace at ns (nsenter
// and ip netns exec enter it after they start).
func waitIn(t *testing.T, pid int, ns string) {
	t.Helper()
	want := inodeOf(t, ns)
	for deadline := time.Now().Add(10 * time.Second); inode(t, pid) != want; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("process %d did not enter %s", pid, ns)
		}
	}
}

func inode(t *testing.T, pid int) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/net", pid), &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

func inodes(ns []netnsscan.Namespace) []uint64 {
	var out []uint64
	for _, n := range ns {
		out = append(out, n.Inode)
	}
	slices.Sort(out)
	return out
}

func sorted(xs ...uint64) []uint64 { slices.Sort(xs); return xs }

// TestScan lays out four pods as kubelet's cgroupfs driver does: two with a
// network namespace of their own (one with two containers in it), one
// whose namespace is a named one (ip netns), and a host-network pod. The
// scanner finds the three namespaces, each once, with its project, and not
// the host's; when a pod's processes end, the next sweep reports its
// namespace gone.
func TestScan(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-netns-")
	pods := testutil.KubeletCgroupfs(t, top, []string{"guaranteed", "burstable", "besteffort", "burstable"}, 2)
	a := inNewNetns(t, pods[0].Containers[0])
	b := inNewNetns(t, pods[1].Containers[0])
	b2 := joining(t, pods[1].Containers[1], b.Process.Pid)
	name := fmt.Sprintf("fairshare-test-%d", os.Getpid())
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v %s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	c := exec.Command("ip", "netns", "exec", name, "sleep", "60")
	testutil.StartInCgroup(t, c, pods[2].Containers[1])
	waitIn(t, c.Process.Pid, "/run/netns/"+name)
	host := exec.Command("sleep", "60")
	testutil.StartInCgroup(t, host, pods[3].Containers[0])

	s, err := netnsscan.New(netnsscan.Options{})
	if err != nil {
		t.Fatal(err)
	}
	var es []membership.Entry
	for i, p := range pods {
		es = append(es, membership.Entry{Member: membership.Member{Project: fmt.Sprintf("team-%d", i), Cgroup: p.Cgroup}, Source: "registered"})
	}
	slices.SortFunc(es, membership.Compare)
	s.SetMembers(es)
	ch := s.Step()
	want := sorted(inode(t, a.Process.Pid), inode(t, b.Process.Pid), inode(t, c.Process.Pid))
	if got := inodes(ch.New); !slices.Equal(got, want) {
		t.Fatalf("new %v, want %v", got, want)
	}
	if inode(t, b2.Process.Pid) != inode(t, b.Process.Pid) || inode(t, host.Process.Pid) != s.Host() {
		t.Fatal("the test's namespaces are not laid out as meant")
	}
	for _, n := range s.Namespaces() {
		var want string
		switch n.Inode {
		case inode(t, a.Process.Pid):
			want = "team-0"
		case inode(t, b.Process.Pid):
			want = "team-1"
		case inode(t, c.Process.Pid):
			want = "team-2"
		}
		if !slices.Equal(n.Projects, []string{want}) || n.PID == 0 {
			t.Errorf("namespace %d: projects %v pid %d, want %s", n.Inode, n.Projects, n.PID, want)
		}
		if got := inodeOf(t, n.Path); got != n.Inode {
			t.Errorf("namespace %d: its path %s opens %d", n.Inode, n.Path, got)
		}
	}
	if ch := s.Step(); len(ch.New) != 0 || len(ch.Gone) != 0 {
		t.Fatalf("a step with nothing new: %+v", ch)
	}

	// Pod 0 ends; pod 1 loses one of its two containers (its namespace
	// stays); the named namespace outlives its process but no registered
	// process is in it any more.
	gone := sorted(inode(t, a.Process.Pid), inode(t, c.Process.Pid))
	testutil.Stop(a)
	testutil.Stop(b2)
	testutil.Stop(c)
	var got []netnsscan.Namespace
	for range 3 {
		ch := s.Step()
		got = append(got, ch.Gone...)
		if ch.Swept && len(got) > 0 {
			break
		}
	}
	if !slices.Equal(inodes(got), gone) {
		t.Fatalf("gone %v, want %v", inodes(got), gone)
	}
	if left := inodes(s.Namespaces()); !slices.Equal(left, []uint64{inode(t, b.Process.Pid)}) {
		t.Fatalf("left %v", left)
	}

	// Members that leave take their namespaces with them at the end of
	// the next sweep.
	s.SetMembers(es[:0])
	got = nil
	for range 2 {
		got = append(got, s.Step().Gone...)
	}
	if !slices.Equal(inodes(got), []uint64{inode(t, b.Process.Pid)}) || len(s.Namespaces()) != 0 {
		t.Fatalf("members gone: gone %v, left %v", inodes(got), s.Namespaces())
	}
}

func inodeOf(t *testing.T, path string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// TestBudget: with more members than a step's budget reads, a step reads at
// most the budget (whole members, so at most one member's tree more), a
// sweep takes several steps, a new member is read at its first step
// wherever the sweep is, and a namespace appearing in any member is found
// within one sweep.
func TestBudget(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-netns-")
	var es []membership.Entry
	for i := range 40 {
		dir := testutil.MkCgroup(t, top, fmt.Sprintf("m%02d", i))
		testutil.MkCgroup(t, dir, "ctr") // two directories per member
		es = append(es, membership.Entry{Member: membership.Member{Project: "p", Cgroup: dir}, Source: "registered"})
	}
	s, err := netnsscan.New(netnsscan.Options{Budget: 10, Fresh: 1})
	if err != nil {
		t.Fatal(err)
	}
	s.SetMembers(es) // the first members: no fresh reads
	steps := 0
	for {
		ch := s.Step()
		steps++
		if ch.Dirs > 10+1 {
			// One member's tree past the budget at most.
			t.Fatalf("a step read %d directories, budget 10", ch.Dirs)
		}
		if ch.Swept || steps > 20 {
			break
		}
	}
	// A sweep from the start: 80 directories at 10 a step.
	steps = 0
	for {
		steps++
		if s.Step().Swept {
			break
		}
	}
	if steps < 8 || steps > 9 {
		t.Errorf("a sweep of 80 directories at 10 a step took %d steps", steps)
	}

	// A new member is read at once.
	dir := testutil.MkCgroup(t, top, "new")
	p := inNewNetns(t, dir)
	s.SetMembers(append(slices.Clone(es), membership.Entry{Member: membership.Member{Project: "q", Cgroup: dir}, Source: "registered"}))
	if ch := s.Step(); !slices.Equal(inodes(ch.New), []uint64{inode(t, p.Process.Pid)}) {
		t.Fatalf("a new member's namespace not found at once: %+v", ch)
	}
	// Many new at once (a restart of the source): fresh reads stay within
	// the budget too, the rest wait their turn.
	more := slices.Clone(es)
	more = append(more, membership.Entry{Member: membership.Member{Project: "q", Cgroup: dir}, Source: "registered"})
	for i := range 20 {
		d := testutil.MkCgroup(t, top, fmt.Sprintf("n%02d", i))
		testutil.MkCgroup(t, d, "ctr")
		more = append(more, membership.Entry{Member: membership.Member{Project: "p", Cgroup: d}, Source: "registered"})
	}
	slices.SortFunc(more, membership.Compare)
	s.SetMembers(more)
	if ch := s.Step(); ch.Dirs > 2*(10+2) {
		t.Fatalf("a step with 20 new members read %d directories, budget 10 (fresh) + 10 (sweep)", ch.Dirs)
	}
	es = more
	// A process that enters a new namespace in an old member is found
	// within a sweep.
	late := inNewNetns(t, filepath.Join(es[37].Cgroup, "ctr"))
	found := false
	for range 20 {
		if slices.Contains(inodes(s.Step().New), inode(t, late.Process.Pid)) {
			found = true
			break
		}
	}
	if !found {
		t.Fatal("a namespace in an old member was not found within a sweep")
	}
	if st := s.Stats(); st.Members != 61 || st.Namespaces != 2 || st.Sweeps < 2 || st.Errors != 0 {
		t.Errorf("stats %+v", st)
	}
}

// TestFreshThenSwept: a member read as new in a step where a sweep ends and
// the next begins is seen in both sweeps, so its namespace is not reported
// gone while its process lives (a small node sweeps every member at every
// step).
func TestFreshThenSwept(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-netns-")
	dir := testutil.MkCgroup(t, top, "pod")
	p := inNewNetns(t, dir)
	s, err := netnsscan.New(netnsscan.Options{Fresh: 1})
	if err != nil {
		t.Fatal(err)
	}
	s.SetMembers(nil)
	s.Step()
	// Registered now: new.
	s.SetMembers([]membership.Entry{{Member: membership.Member{Project: "p", Cgroup: dir}, Source: "registered"}})
	for i := range 4 {
		ch := s.Step()
		if len(ch.Gone) != 0 {
			t.Fatalf("step %d: %v reported gone while its process lives", i, inodes(ch.Gone))
		}
	}
	if got := inodes(s.Namespaces()); !slices.Equal(got, []uint64{inode(t, p.Process.Pid)}) {
		t.Fatalf("namespaces %v", got)
	}
}

// TestJoined: a namespace found through one member is reported Joined
// when a process of another member is first seen in it (a tenant's
// process in another's namespace: registered later, or entering it
// later), with both members and projects; not again while they stay, not
// for a second container of a member already seen in it, and the member
// that left is dropped at the end of the sweep after.
func TestJoined(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-netns-")
	podA, podB, podC := testutil.MkCgroup(t, top, "a"), testutil.MkCgroup(t, top, "b"), testutil.MkCgroup(t, top, "c")
	subA := testutil.MkCgroup(t, podA, "second")
	a := inNewNetns(t, podA)
	ns := inode(t, a.Process.Pid)
	s, err := netnsscan.New(netnsscan.Options{})
	if err != nil {
		t.Fatal(err)
	}
	member := func(project, cg string) membership.Entry {
		return membership.Entry{Member: membership.Member{Project: project, Cgroup: cg}, Source: "registered"}
	}
	es := []membership.Entry{member("team-a", podA)}
	s.SetMembers(es)
	if ch := s.Step(); !slices.Equal(inodes(ch.New), []uint64{ns}) || len(ch.Joined) != 0 {
		t.Fatalf("first step: new %v joined %v, want new %d", inodes(ch.New), inodes(ch.Joined), ns)
	}
	// A second container of the pod: no news.
	joining(t, subA, a.Process.Pid)
	if ch := s.Step(); len(ch.New)+len(ch.Joined)+len(ch.Gone) != 0 {
		t.Fatalf("a second container of the member: %+v", ch)
	}
	// Another tenant's process in it, registered after it entered.
	b := joining(t, podB, a.Process.Pid)
	s.SetMembers(append(es, member("team-b", podB)))
	ch := s.Step()
	if len(ch.New) != 0 || len(ch.Joined) != 1 {
		t.Fatalf("a member registered in a known namespace: new %v joined %v, want %d joined", inodes(ch.New), inodes(ch.Joined), ns)
	}
	if j := ch.Joined[0]; j.Inode != ns || !slices.Equal(j.Members, []string{podA, podB}) || !slices.Equal(j.Projects, []string{"team-a", "team-b"}) {
		t.Fatalf("joined %+v, want %d with members %s and %s, projects team-a and team-b", j, ns, podA, podB)
	}
	for i := range 3 {
		if ch := s.Step(); len(ch.New)+len(ch.Joined)+len(ch.Gone) != 0 {
			t.Fatalf("step %d with nothing new: %+v", i, ch)
		}
	}
	// A registered member's process entering it later: joined too.
	es = append(es, member("team-b", podB), member("team-c", podC))
	slices.SortFunc(es, membership.Compare)
	s.SetMembers(es)
	s.Step()
	joining(t, podC, a.Process.Pid)
	var joined []netnsscan.Namespace
	for range 3 {
		joined = append(joined, s.Step().Joined...)
	}
	if !slices.Equal(inodes(joined), []uint64{ns}) || !slices.Contains(joined[0].Members, podC) {
		t.Fatalf("a member's process entering it: joined %+v", joined)
	}
	// b's process ends: team-b leaves its members within two sweeps.
	testutil.Stop(b)
	for range 4 {
		s.Step()
	}
	got := s.Namespaces()
	if len(got) != 1 || !slices.Equal(got[0].Members, []string{podA, podC}) || !slices.Equal(got[0].Projects, []string{"team-a", "team-c"}) {
		t.Fatalf("after b's process ended: %+v", got)
	}
}

// TestReadNew: a change's read finds the namespace of a member registered
// with its process running, reads each new member once (within its budget:
// the rest at the next), and leaves the
// fresh reads of the steps after as they were: a process the member starts
// later in a namespace of its own is found by the next step's fresh read
// (with a budget of one directory, which the sweep would spend on another
// member), and a member a step has read is not read again by ReadNew.
func TestReadNew(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-netns-")
	first, late := testutil.MkCgroup(t, top, "a"), testutil.MkCgroup(t, top, "z")
	running := testutil.MkCgroup(t, top, "m")
	r := inNewNetns(t, running)
	s, err := netnsscan.New(netnsscan.Options{Fresh: 1, Budget: 1})
	if err != nil {
		t.Fatal(err)
	}
	member := func(project, cg string) membership.Entry {
		return membership.Entry{Member: membership.Member{Project: project, Cgroup: cg}, Source: "registered"}
	}
	// b, c and d: the sweep's, between a and m.
	old := []membership.Entry{member("a", first)}
	for _, name := range []string{"b", "c", "d"} {
		old = append(old, member(name, testutil.MkCgroup(t, top, name)))
	}
	s.SetMembers(old)
	s.Step()
	s.SetMembers(append(old, member("m", running), member("z", late)))
	ch := s.ReadNew()
	if !slices.Equal(inodes(ch.New), []uint64{inode(t, r.Process.Pid)}) || ch.Swept || len(ch.Gone) != 0 {
		t.Fatalf("ReadNew: %+v, want the running member's namespace new", ch)
	}
	// z, past the budget of the first: the second's; nothing for a third.
	if ch := s.ReadNew(); ch.Dirs != 1 || len(ch.New) != 0 {
		t.Fatalf("a second ReadNew: %+v, want z's one directory read", ch)
	}
	if ch := s.ReadNew(); ch.Dirs != 0 {
		t.Fatalf("a third ReadNew read %d directories, want none", ch.Dirs)
	}
	z := inNewNetns(t, late)
	var found []netnsscan.Namespace
	for range 2 { // m's fresh read, then z's
		found = append(found, s.Step().New...)
	}
	if !slices.Equal(inodes(found), []uint64{inode(t, z.Process.Pid)}) {
		t.Fatalf("the steps after ReadNew found %v, want z's namespace %d by its fresh read", inodes(found), inode(t, z.Process.Pid))
	}
	// A member a step read first (a change at a tick) is no news to
	// ReadNew, though it is read again at the next steps.
	s2, err := netnsscan.New(netnsscan.Options{Fresh: 3})
	if err != nil {
		t.Fatal(err)
	}
	s2.SetMembers(old)
	s2.Step()
	s2.SetMembers(append(old, member("m", running)))
	s2.Step()
	if ch := s2.ReadNew(); ch.Dirs != 0 {
		t.Fatalf("ReadNew after a step read the new member read %d directories, want none", ch.Dirs)
	}
}

// TestNumberReused: a namespace dies and another gets its inode number (the
// kernel gives the lowest free one) in the same member's cgroup: the next
// read reports the dead one gone and the new one new, told apart by their
// ids (NS_GET_ID), with the new id. Skipped on a kernel without ids.
func TestNumberReused(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-netns-")
	pod := testutil.MkCgroup(t, top, "pod")
	first := inNewNetns(t, pod)
	f, err := os.Open(fmt.Sprintf("/proc/%d/ns/net", first.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	id, err := netnsscan.ID(f)
	f.Close()
	if err != nil || id == 0 {
		t.Skipf("no namespace ids on this kernel (NS_GET_ID: %d, %v)", id, err)
	}
	s, err := netnsscan.New(netnsscan.Options{})
	if err != nil {
		t.Fatal(err)
	}
	s.SetMembers([]membership.Entry{{Member: membership.Member{Project: "p", Cgroup: pod}, Source: "registered"}})
	ch := s.Step()
	dead := inode(t, first.Process.Pid)
	if len(ch.New) != 1 || ch.New[0].Inode != dead || ch.New[0].ID != id {
		t.Fatalf("first step: %+v, want %d new with id %d", ch.New, dead, id)
	}
	testutil.Stop(first)
	// Others made meanwhile live on: each holds a number below the dead
	// one's, so the next gets the next.
	var again *exec.Cmd
	for try := 0; again == nil; try++ {
		if try == 100 {
			t.Skipf("no namespace got the dead one's inode %d: another process took it", dead)
		}
		c := inNewNetns(t, pod)
		if inode(t, c.Process.Pid) == dead {
			again = c
		}
	}
	var gone, found []netnsscan.Namespace
	for range 2 { // a step's read, and the end of its sweep
		ch := s.Step()
		gone, found = append(gone, ch.Gone...), append(found, ch.New...)
	}
	if !slices.ContainsFunc(gone, func(n netnsscan.Namespace) bool { return n.Inode == dead && n.ID == id }) {
		t.Errorf("gone %v, want %d with id %d (the dead one)", inodes(gone), dead, id)
	}
	i := slices.IndexFunc(found, func(n netnsscan.Namespace) bool { return n.Inode == dead })
	if i < 0 || found[i].ID == id || found[i].ID == 0 {
		t.Fatalf("%d new, none with the dead one's inode %d and another id than %d", len(found), dead, id)
	}
}

// TestTruncated: a member with more cgroups below it than the budget (as a
// tenant with a delegated subtree can make) is read in part and counted,
// and the step stays within its budget.
func TestTruncated(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-netns-")
	big := testutil.MkCgroup(t, top, "big")
	for i := range 30 {
		testutil.MkCgroup(t, big, fmt.Sprintf("c%02d", i))
	}
	s, err := netnsscan.New(netnsscan.Options{Budget: 10})
	if err != nil {
		t.Fatal(err)
	}
	s.SetMembers([]membership.Entry{{Member: membership.Member{Project: "p", Cgroup: big}, Source: "registered"}})
	if ch := s.Step(); ch.Dirs > 10 {
		t.Fatalf("a step read %d directories of a 31-cgroup member, budget 10", ch.Dirs)
	}
	if st := s.Stats(); st.Truncated != 1 || st.LastTruncated != big {
		t.Fatalf("stats %+v", st)
	}
}

// TestMissing: a member whose cgroup does not exist (a registration that
// outlived its pod) is listed, and no longer once it exists or leaves.
func TestMissing(t *testing.T) {
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-netns-")
	gone := filepath.Join(top, "gone")
	s, err := netnsscan.New(netnsscan.Options{})
	if err != nil {
		t.Fatal(err)
	}
	es := []membership.Entry{{Member: membership.Member{Project: "p", Cgroup: gone}, Source: "registered"}}
	s.SetMembers(es)
	s.Step()
	if got := s.Missing(); !slices.Equal(got, []string{gone}) {
		t.Fatalf("missing %v", got)
	}
	testutil.MkCgroup(t, top, "gone")
	s.Step()
	if got := s.Missing(); len(got) != 0 {
		t.Fatalf("missing %v after the cgroup was made", got)
	}
	testutil.RemoveCgroup(t, gone)
	s.Step()
	s.SetMembers(nil)
	if got := s.Missing(); len(got) != 0 {
		t.Fatalf("missing %v after the member left", got)
	}
	if st := s.Stats(); st.Errors != 0 {
		t.Fatalf("a missing cgroup counted as an error: %+v", st)
	}
}
