// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// mkdirs makes the cgroups root/rel (and their parents), removed with root.
func mkdirs(t testing.TB, root string, rels ...string) []string {
	t.Helper()
	var out []string
	for _, rel := range rels {
		p := filepath.Join(root, rel)
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		out = append(out, p)
	}
	return out
}

// openMembers opens a limiter whose walk starts below root and looks
// MaxDepth levels down, with the given members.
func openMembers(t testing.TB, root, pin string, pool uint32, ms []Member) *Limiter {
	t.Helper()
	o := rootOptions(t, root, Options{PinDir: pin, PoolSize: pool, Floor: 1})
	o.MaxDepth = DefaultMaxDepth
	l, err := Open(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	rep, err := l.SetMembers(ms)
	if err != nil || len(rep.Refused) > 0 {
		t.Fatalf("SetMembers: %+v %v", rep, err)
	}
	return l
}

// Layouts as kubelet (cgroupfs and systemd drivers) and systemd lay them
// out (testutil's, made with mkdir): the pods (or project slices) are
// registered, two to a project, at several depths, and the processes run in
// the leaves below them. Their connections count for the right project and
// the pool is enforced on them; a process in a cgroup outside every
// registration is neither counted nor limited.
func TestMembersLayouts(t *testing.T) {
	testutil.RequireRoot(t)
	qos := []string{"guaranteed", "burstable", "besteffort", "burstable"}
	for _, lay := range []struct {
		name string
		// make lays the node out below root and returns each project's
		// registered cgroups and a leaf below each of them.
		make func(t *testing.T, root string) (members []Member, leaves map[string][]string)
	}{
		{"kubelet-cgroupfs", func(t *testing.T, root string) ([]Member, map[string][]string) {
			return podMembers(testutil.KubeletCgroupfs(t, root, qos, 2))
		}},
		{"kubelet-systemd", func(t *testing.T, root string) ([]Member, map[string][]string) {
			return podMembers(testutil.KubeletSystemd(t, root, qos, 2))
		}},
		{"systemd-slices", func(t *testing.T, root string) ([]Member, map[string][]string) {
			units, top := testutil.SystemdSlices(t, root, "fairshare.slice", map[string][]string{
				"fairshare-alpha.slice":      {"web.service", "run-r1.scope"},
				"fairshare-beta-team1.slice": {"db.service"},
			})
			alpha := filepath.Join(top, "fairshare-alpha.slice")
			beta := filepath.Join(top, "fairshare-beta.slice", "fairshare-beta-team1.slice")
			return []Member{{Project: "alpha", Cgroup: alpha}, {Project: "beta-team1", Cgroup: beta}},
				map[string][]string{
					"alpha":      {units["fairshare-alpha.slice/web.service"], mkdirs(t, units["fairshare-alpha.slice/run-r1.scope"], "inner")[0]},
					"beta-team1": {units["fairshare-beta-team1.slice/db.service"]},
				}
		}},
	} {
		t.Run(lay.name, func(t *testing.T) {
			root, pin := newRoot(t), newPinDir(t)
			ms, leaves := lay.make(t, root)
			outside := mkdirs(t, root, "system.slice/sshd.service")[0]
			l := openMembers(t, root, pin, 4, ms)
			if got, _ := l.Members(); len(got) != len(ms) {
				t.Fatalf("members %+v, want %d", got, len(ms))
			}
			ln := sink(t, "tcp4", "127.0.0.1:0")
			projects := slices.Sorted(maps.Keys(leaves))
			// The first project alone on the node: the whole pool, no more.
			first := projects[0]
			h := startHelper(t, leaves[first][0])
			if r := h.dial("tcp4", ln.Addr().String(), 6); r.ok != 4 || r.refused != 2 {
				t.Fatalf("%s from %s: %+v; %+v", first, leaves[first][0], r, snap(t, l))
			}
			waitInUse(t, l, 4, map[string]int{first: 4})
			// Outside every registration: neither counted nor refused.
			o := startHelper(t, outside)
			if r := o.dial("tcp4", ln.Addr().String(), 6); r.ok != 6 {
				t.Fatalf("outside: %+v; %+v", r, snap(t, l))
			}
			waitInUse(t, l, 4, map[string]int{first: 4})
			h.do("close")
			waitInUse(t, l, 0, map[string]int{first: 0})
			// Every leaf counts for its project.
			for _, proj := range projects {
				for _, leaf := range leaves[proj] {
					h := startHelper(t, leaf)
					if r := h.dial("tcp4", ln.Addr().String(), 2); r.ok != 2 {
						t.Fatalf("%s from %s: %+v", proj, leaf, r)
					}
					waitInUse(t, l, 2, map[string]int{proj: 2})
					h.do("close")
					waitInUse(t, l, 0, map[string]int{proj: 0})
				}
			}
		})
	}
}

// podMembers registers pods two to a project (team-0: pods 0 and 1, team-1:
// pods 2 and 3), with the containers of each as its leaves.
func podMembers(pods []testutil.Pod) ([]Member, map[string][]string) {
	var ms []Member
	leaves := map[string][]string{}
	for i, p := range pods {
		proj := fmt.Sprintf("team-%d", i/2)
		ms = append(ms, Member{Project: proj, Cgroup: p.Cgroup})
		leaves[proj] = append(leaves[proj], p.Containers...)
	}
	return ms, leaves
}

// SetMembers refuses, with a reason each, what the programs could not apply
// or would apply ambiguously, and applies the rest; it moves a member to
// another project, and a member it removes stops counting new connections
// while the permits its sockets hold end with them.
func TestSetMembersRules(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	dirs := mkdirs(t, root, "a", "a/b", "c", "c/d", "e/f/g/h/i/j/k/l/m/n", "x")
	a, ab, c, cd, x := dirs[0], dirs[1], dirs[2], dirs[3], dirs[5]
	deep := dirs[4] + "/o"
	mkdirs(t, root, "e/f/g/h/i/j/k/l/m/n/o")
	l := openMembers(t, root, pin, 10, nil)

	rep, err := l.SetMembers([]Member{
		{Project: "p1", Cgroup: a}, {Project: "p2", Cgroup: ab}, // nested across projects: both refused
		{Project: "p3", Cgroup: c}, {Project: "p3", Cgroup: cd}, // nested in one project: fine
		{Project: "p4", Cgroup: filepath.Join(root, "missing")},
		{Project: "bad name!", Cgroup: x},
		{Project: "p5", Cgroup: deep}, // below the levels the walk looks at
		{Project: "p6", Cgroup: "relative/path"},
		{Project: "p7", Cgroup: t.TempDir()}, // not cgroup2
	})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Added != 2 || len(rep.Refused) != 7 {
		t.Fatalf("%+v", rep)
	}
	reasons := map[string]string{}
	for _, r := range rep.Refused {
		reasons[r.Member.Project] = r.Reason
	}
	for proj, want := range map[string]string{"p1": "has", "p2": "nested in", "p4": "no such cgroup", "bad name!": "",
		"p5": "outside the levels", "p6": "below the cgroup2 mount", "p7": "below the cgroup2 mount"} {
		if r, ok := reasons[proj]; !ok || !strings.Contains(r, want) {
			t.Errorf("%s: refused %v %q, want a reason with %q", proj, ok, r, want)
		}
	}

	// Idempotent and cheap when nothing changed.
	ms := []Member{{Project: "p3", Cgroup: c}, {Project: "p3", Cgroup: cd}, {Project: "p1", Cgroup: x}}
	if rep, err = l.SetMembers(ms); err != nil || rep.Added != 1 || rep.Kept != 2 || len(rep.Refused) != 0 {
		t.Fatalf("%+v %v", rep, err)
	}
	if rep, err = l.SetMembers(ms); err != nil || rep.Added != 0 || rep.Kept != 3 || rep.Removed != 0 {
		t.Fatalf("again: %+v %v", rep, err)
	}

	// Counting, then a move: new connections count for the new project.
	ln := sink(t, "tcp4", "127.0.0.1:0")
	h := startHelper(t, cd)
	if r := h.dial("tcp4", ln.Addr().String(), 2); r.ok != 2 {
		t.Fatal(r)
	}
	waitInUse(t, l, 2, map[string]int{"p3": 2})
	if rep, err = l.SetMembers([]Member{{Project: "p9", Cgroup: c}, {Project: "p9", Cgroup: cd}, {Project: "p1", Cgroup: x}}); err != nil || rep.Moved != 2 {
		t.Fatalf("move: %+v %v", rep, err)
	}
	if r := h.dial("tcp4", ln.Addr().String(), 1); r.ok != 1 {
		t.Fatal(r)
	}
	waitInUse(t, l, 3, map[string]int{"p3": 2, "p9": 1})

	// Removed: a new connection is not counted; those held end with their
	// sockets.
	if rep, err = l.SetMembers([]Member{{Project: "p1", Cgroup: x}}); err != nil || rep.Removed != 2 {
		t.Fatalf("remove: %+v %v", rep, err)
	}
	if r := h.dial("tcp4", ln.Addr().String(), 1); r.ok != 1 {
		t.Fatal(r)
	}
	waitInUse(t, l, 3, map[string]int{"p3": 2, "p9": 1})
	h.do("close")
	waitInUse(t, l, 0, map[string]int{"p3": 0, "p9": 0})
	if got, err := l.Members(); err != nil || len(got) != 1 || got[0] != (Member{Project: "p1", Cgroup: x}) {
		t.Fatalf("members %+v %v", got, err)
	}
}

// A project with no member left keeps its id and counters while it is
// recent (one that never asked is not: it is freed at the next Tick), and
// frees them once idle past the forget period: its name is gone
// from the pins and the id is given to the next new project.
func TestProjectIDsFreed(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	dirs := mkdirs(t, root, "a", "b")
	mono := &fakeMono{}
	o := rootOptions(t, root, Options{PinDir: pin, PoolSize: 10, Floor: 1, Monotonic: mono.now})
	l, err := Open(o)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if _, err := l.SetMembers([]Member{{Project: "old", Cgroup: dirs[0]}}); err != nil {
		t.Fatal(err)
	}
	id := l.memb.ids["old"]
	ln := sink(t, "tcp4", "127.0.0.1:0")
	h := startHelper(t, dirs[0])
	if r := h.dial("tcp4", ln.Addr().String(), 1); r.ok != 1 {
		t.Fatal(r)
	}
	h.do("close")
	waitInUse(t, l, 0, map[string]int{"old": 0})
	if _, err := l.SetMembers(nil); err != nil {
		t.Fatal(err)
	}
	if err := l.Tick(l.clock.Now()); err != nil {
		t.Fatal(err)
	}
	if _, ok := l.memb.ids["old"]; !ok {
		t.Fatal("a project without members was freed before it was idle")
	}
	mono.advance(2 * forgetAfter)
	if err := l.Tick(l.clock.Now()); err != nil {
		t.Fatal(err)
	}
	if _, ok := l.memb.ids["old"]; ok {
		t.Fatal("an idle project without members kept its id")
	}
	names, err := readNames(l.objs.FsNames, l.maxProj)
	if err != nil || names[id] != "" {
		t.Fatalf("pinned name of the freed id: %q %v", names[id], err)
	}
	if _, err := l.SetMembers([]Member{{Project: "new", Cgroup: dirs[1]}}); err != nil {
		t.Fatal(err)
	}
	if l.memb.ids["new"] != id {
		t.Fatalf("new project got id %d, want the freed %d", l.memb.ids["new"], id)
	}
	if s := snap(t, l); len(s.Projects) != 1 || s.Projects[0].Project != "new" || s.Projects[0].Admitted != 0 {
		t.Fatalf("%+v", s)
	}
}

// pinProcess keeps every thread of process pid on one CPU (threads it
// starts later inherit it), so that its connects all meet the same per-CPU
// state of the programs.
func pinProcess(t testing.TB, pid int) {
	t.Helper()
	var one unix.CPUSet
	one.Set(0)
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range tasks {
		tid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if err := unix.SchedSetaffinity(tid, &one); err != nil && err != unix.ESRCH {
			t.Fatal(err)
		}
	}
}

// The programs remember, per CPU, the project of the last cgroup they looked
// up (bpf/lib/project.h). A change of the members must reach the next
// connect of a cgroup all the same, on the CPU that remembers it: moved to
// another project, made exempt, and taken out of the projects.
func TestMemberMemoFollowsChanges(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	c := mkdirs(t, root, "c")[0]
	l := openMembers(t, root, pin, 16, []Member{{Project: "p1", Cgroup: c}})
	ln := sink(t, "tcp4", "127.0.0.1:0")
	h := startHelper(t, c)
	pinProcess(t, h.cmd.Process.Pid)
	dial := func() {
		t.Helper()
		if r := h.dial("tcp4", ln.Addr().String(), 1); r.ok != 1 {
			t.Fatal(r)
		}
	}
	// Twice: the second connect finds the project in the memo.
	dial()
	dial()
	waitInUse(t, l, 2, map[string]int{"p1": 2})

	if rep, err := l.SetMembers([]Member{{Project: "p2", Cgroup: c}}); err != nil || rep.Moved != 1 {
		t.Fatalf("move: %+v %v", rep, err)
	}
	dial()
	waitInUse(t, l, 3, map[string]int{"p1": 2, "p2": 1})

	if err := l.SetExempt([]string{c}, 4); err != nil {
		t.Fatal(err)
	}
	dial()
	if s := snap(t, l); s.Exempt.InUse != 1 || s.InUse != 3 {
		t.Fatalf("after the cgroup was made exempt: exempt in use %d, pool in use %d; want 1 and 3", s.Exempt.InUse, s.InUse)
	}
	if err := l.SetExempt(nil, 0); err != nil {
		t.Fatal(err)
	}

	if _, err := l.SetMembers(nil); err != nil {
		t.Fatal(err)
	}
	dial()
	if s := snap(t, l); s.InUse != 3 || s.Exempt.InUse != 1 {
		t.Fatalf("a connect of a cgroup taken out of the projects counted: pool in use %d, exempt %d; want 3 and 1", s.InUse, s.Exempt.InUse)
	}
	h.do("close")
	waitInUse(t, l, 0, nil)
}

// A bump of the members' generation that fails is owed and paid at the
// next SetMembers, though it has nothing to write, or at the next Tick:
// until then the memo of the CPU that connected last answers with the
// cgroup's project before the change.
func TestMemberGenOwed(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	c := mkdirs(t, root, "c")[0]
	l := openMembers(t, root, pin, 16, []Member{{Project: "p1", Cgroup: c}})
	ln := sink(t, "tcp4", "127.0.0.1:0")
	h := startHelper(t, c)
	pinProcess(t, h.cmd.Process.Pid)
	dial := func() {
		t.Helper()
		if r := h.dial("tcp4", ln.Addr().String(), 1); r.ok != 1 {
			t.Fatal(r)
		}
	}
	dial()
	waitInUse(t, l, 1, map[string]int{"p1": 1})
	gen := func() (g uint64) {
		t.Helper()
		if err := l.objs.FsMemberGen.Lookup(uint32(0), &g); err != nil {
			t.Fatal(err)
		}
		return g
	}
	fail := errors.New("injected")
	for i, pay := range []func() error{
		func() error { _, err := l.SetMembers([]Member{{Project: "p2", Cgroup: c}}); return err },
		func() error { return l.Tick(time.Now()) },
	} {
		proj := []string{"p2", "p1"}[i]
		l.mu.Lock()
		l.genFault = func() error { return fail }
		l.mu.Unlock()
		g0 := gen()
		if _, err := l.SetMembers([]Member{{Project: proj, Cgroup: c}}); !errors.Is(err, fail) {
			t.Fatalf("move to %s with the bump failing: %v, want the bump's error", proj, err)
		}
		if g := gen(); g != g0 {
			t.Fatalf("generation %d after a failed bump, want %d", g, g0)
		}
		l.mu.Lock()
		l.genFault = nil
		l.mu.Unlock()
		if err := pay(); err != nil {
			t.Fatal(err)
		}
		if g := gen(); g != g0+1 {
			t.Fatalf("generation %d after the owed bump was paid (call %d), want %d", g, i, g0+1)
		}
		if err := pay(); err != nil {
			t.Fatal(err)
		}
		if g := gen(); g != g0+1 {
			t.Fatalf("generation %d after a call that owed nothing, want %d", g, g0+1)
		}
		dial()
		want := map[string]int{"p1": 1, "p2": 1}
		if i == 1 {
			want = map[string]int{"p1": 2, "p2": 1}
		}
		waitInUse(t, l, 2+i, want)
	}
	h.do("close")
	waitInUse(t, l, 0, nil)
}

// Two writers on the same pins bumping the members' generation at once
// never lose a bump: a lost one could move the generation back to a value
// the memo has answers of.
func TestMemberGenBumpAtomic(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 16, 0)
	var g0 uint64
	if err := l.objs.FsMemberGen.Lookup(uint32(0), &g0); err != nil {
		t.Fatal(err)
	}
	const writers, bumps = 4, 3000
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	start := make(chan struct{})
	for range writers {
		wg.Go(func() {
			<-start
			for range bumps {
				if _, err := bumpMemberGen(l.objs.FsAdjust, nil); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	var g uint64
	if err := l.objs.FsMemberGen.Lookup(uint32(0), &g); err != nil {
		t.Fatal(err)
	}
	if g != g0+writers*bumps {
		t.Fatalf("generation %d after %d bumps from %d, want %d: %d lost", g, writers*bumps, g0, g0+writers*bumps, g0+writers*bumps-g)
	}
}

// TestRemovedMemberKeepsPermits: taking a cgroup out of the members, or
// moving it to another project, releases nothing: its live connections,
// outbound and accepted, keep the permits they hold until they end, and a
// reconcile pass does not take them for gone sockets' (it once did: the
// dump wrote out only the sockets of a project, so those of a cgroup no
// longer a member looked gone, and their permits were released while the
// connections lived on, leaving room past the pool).
func TestRemovedMemberKeepsPermits(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	dirs := mkdirs(t, root, "a")
	l := openLimiter(t, root, pin, 10, 1)
	out := sink(t, "tcp4", "127.0.0.1:0").Addr().String()
	h := startHelper(t, dirs[0])
	for _, step := range []struct {
		name    string
		members []Member
	}{
		{"removed", nil},
		{"moved", []Member{{Project: "new", Cgroup: dirs[0]}}},
	} {
		if _, err := l.SetMembers([]Member{{Project: "old", Cgroup: dirs[0]}}); err != nil {
			t.Fatal(err)
		}
		srv := strings.TrimPrefix(h.do("listen 127.0.0.1:0"), "listening ")
		h.dialOK("tcp4", out, 3, "old's client")
		var in []net.Conn
		for range 2 {
			c, err := net.DialTimeout("tcp4", srv, 3*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			in = append(in, c)
		}
		waitInUse(t, l, 5, map[string]int{"old": 5})
		if _, err := l.SetMembers(step.members); err != nil {
			t.Fatal(err)
		}
		for range 2 { // a repair needs two findings: two passes, four reads
			rep, err := l.Reconcile(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if rep.Orphans != 0 || len(rep.Repaired) != 0 || rep.Adopted != 0 {
				t.Fatalf("%s: the pass released %d permits of live sockets, repaired %v, adopted %d",
					step.name, rep.Orphans, rep.Repaired, rep.Adopted)
			}
		}
		waitInUse(t, l, 5, map[string]int{"old": 5, "new": 0})
		for _, c := range in {
			c.Close()
		}
		h.do("close")
		h.do("unlisten")
		waitInUse(t, l, 0, map[string]int{"old": 0})
	}
}

// TestSettle: a listener opened before its cgroup was a member is counted
// by a walk of its namespace's sockets alone (the programs saw its
// TCP_LISTEN while it was no project's): Settle walks the namespaces it is
// given and no other, counts the listeners there and adopts the open
// connections.
func TestSettle(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 10, 1)
	dirs := mkdirs(t, root, "host", "ns") // after Open: no members yet
	out := sink(t, "tcp4", "127.0.0.1:0").Addr().String()
	hh, hn := startHelper(t, dirs[0]), startHelperNS(t, dirs[1], true)
	listenAddr(t, hh.do("listen 127.0.0.1:0"))
	listenAddr(t, hn.do("listen 127.0.0.1:0"))
	hh.dialOK("tcp4", out, 2, "the host's helper before it is a member")
	info, err := l.AttachNetns(fmt.Sprintf("/proc/%d/ns/net", hn.cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.SetMembers([]Member{{Project: "early", Cgroup: dirs[0]}, {Project: "inner", Cgroup: dirs[1]}}); err != nil {
		t.Fatal(err)
	}
	counted := func() (host, ns int) {
		t.Helper()
		m, err := l.countedListeners()
		if err != nil {
			t.Fatal(err)
		}
		return len(m[l.netns]), len(m[info.Cookie])
	}
	for i, step := range []struct {
		host         bool
		netns        []uint64
		wantH, wantN int
		adopted      int
	}{
		{false, nil, 0, 0, 0},                          // nothing walked
		{false, []uint64{info.Cookie + 1000}, 0, 0, 0}, // no such namespace attached
		{false, []uint64{info.Cookie}, 0, 1, 0},        // the pod's
		{true, nil, 1, 1, 2},                           // the host's: its listener, its two connections
	} {
		rep, err := l.Settle(t.Context(), step.host, step.netns)
		if err != nil {
			t.Fatal(err)
		}
		if h, n := counted(); h != step.wantH || n != step.wantN || rep.Adopted != step.adopted {
			t.Fatalf("step %d: listeners counted %d in the host's namespace and %d in the pod's, %d adopted; want %d, %d, %d",
				i, h, n, rep.Adopted, step.wantH, step.wantN, step.adopted)
		}
	}
	waitInUse(t, l, 2, map[string]int{"early": 2})
}
