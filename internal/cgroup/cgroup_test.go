// SPDX-License-Identifier: Apache-2.0

package cgroup_test

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"golang.org/x/sys/unix"
)

func TestParseMountInfo(t *testing.T) {
	const hybrid = `25 30 0:23 / /sys rw,nosuid shared:7 - sysfs sysfs rw
33 25 0:28 / /sys/fs/cgroup ro shared:9 - tmpfs tmpfs ro,mode=755
34 33 0:29 / /sys/fs/cgroup/unified rw shared:10 - cgroup2 cgroup2 rw,nsdelegate
35 33 0:30 / /sys/fs/cgroup/cpu rw shared:11 - cgroup cgroup rw,cpu
`
	m, err := cgroup.ParseMountInfo(strings.NewReader(hybrid))
	if err != nil || m.Point != "/sys/fs/cgroup/unified" || m.Root != "/" {
		t.Fatalf("hybrid: %+v %v", m, err)
	}
	if lvl, err := m.Level("/sys/fs/cgroup/unified/fairshare"); err != nil || lvl != 1 {
		t.Fatalf("level %d %v, want 1", lvl, err)
	}
	const ns = `40 30 0:29 /kubepods/pod\0401 /sys/fs/cgroup rw - cgroup2 cgroup2 rw
`
	m, err = cgroup.ParseMountInfo(strings.NewReader(ns))
	if err != nil || m.Point != "/sys/fs/cgroup" || m.Root != "/kubepods/pod 1" {
		t.Fatalf("namespaced: %+v %v", m, err)
	}
	if lvl, err := m.Level("/sys/fs/cgroup/fairshare"); err != nil || lvl != 3 {
		t.Fatalf("level %d %v, want 3", lvl, err)
	}
	if _, err := m.Level("/tmp/x"); !errors.Is(err, cgroup.ErrNotCgroup2) {
		t.Fatalf("a directory outside the mount has a level (%v)", err)
	}
	const spaced = `41 30 0:29 / /run/my\040cgroups rw - cgroup2 cgroup2 rw
`
	if m, err := cgroup.ParseMountInfo(strings.NewReader(spaced)); err != nil || m.Point != "/run/my cgroups" {
		t.Fatalf("a mount point with a space: %+v %v", m, err)
	}
	if _, err := cgroup.ParseMountInfo(strings.NewReader("25 30 0:23 / /sys rw - sysfs sysfs rw\n")); err != cgroup.ErrNoCgroup2 {
		t.Fatalf("no cgroup2: %v", err)
	}
}

func TestPath(t *testing.T) {
	m := cgroup.Mount{Point: "/sys/fs/cgroup/unified", Root: "/"}
	for raw, want := range map[string]string{
		"/sys/fs/cgroup/unified/kubepods/pod1": "/sys/fs/cgroup/unified/kubepods/pod1",
		"/sys/fs/cgroup/unified/a/../b/":       "/sys/fs/cgroup/unified/b",
		"/system.slice/x.service":              "/sys/fs/cgroup/unified/system.slice/x.service",
		"kubepods/burstable/pod1":              "/sys/fs/cgroup/unified/kubepods/burstable/pod1",
		"/sys/fs/cgroup/system.slice":          "/sys/fs/cgroup/unified/sys/fs/cgroup/system.slice",
		"../../etc":                            "/sys/fs/cgroup/unified/etc",
		"/sys/fs/cgroup/unified/../../../etc":  "/sys/fs/cgroup/unified/sys/etc",
		"/":                                    "/sys/fs/cgroup/unified",
		"/sys/fs/cgroup/unified":               "/sys/fs/cgroup/unified",
	} {
		if got := m.Path(raw); got != want {
			t.Errorf("Path(%q) = %s, want %s", raw, got, want)
		}
	}
}

func TestContains(t *testing.T) {
	m := cgroup.Mount{Point: "/sys/fs/cgroup", Root: "/"}
	for dir, want := range map[string]bool{
		"/sys/fs/cgroup": true, "/sys/fs/cgroup/a/b": true, "/sys/fs/cgroupx": false, "/sys/fs": false,
	} {
		if got := m.Contains(dir); got != want {
			t.Errorf("Contains(%s) = %v, want %v", dir, got, want)
		}
	}
	if !(cgroup.Mount{Point: "/"}).Contains("/a") {
		t.Error("a mount at / does not contain /a")
	}
}

// TestTree builds root/{a,b} with nested children in the real hierarchy:
// Walk sees every cgroup once with its id, ProjectIndex maps each to its
// top-level project and leaves root out, and OfPID finds a process started
// in a nested cgroup.
func TestTree(t *testing.T) {
	testutil.RequireRoot(t)
	mount := testutil.Cgroup2Mount(t)
	root := testutil.TempCgroup(t, mount, "fairshare-cgroup-")
	want := map[string]string{} // relative path -> project
	for _, p := range []string{"a", "a/x", "a/x/y", "a/z", "b", "b/w"} {
		testutil.MkCgroup(t, root, p)
		want[p], _, _ = strings.Cut(p, "/")
	}
	walked := map[string]uint64{}
	if err := cgroup.Walk(root, func(path string, id uint64) { walked[path] = id }); err != nil {
		t.Fatal(err)
	}
	if len(walked) != len(want)+1 {
		t.Errorf("walked %d cgroups, want %d: %v", len(walked), len(want)+1, walked)
	}
	index, err := cgroup.ProjectIndex(root)
	if err != nil {
		t.Fatal(err)
	}
	if len(index) != len(want) {
		t.Errorf("index has %d cgroups, want %d: %v", len(index), len(want), index)
	}
	for rel, project := range want {
		dir := filepath.Join(root, rel)
		id, err := cgroup.ID(dir)
		if err != nil {
			t.Fatal(err)
		}
		if walked[dir] != id {
			t.Errorf("%s: walked id %d, ID %d", rel, walked[dir], id)
		}
		if got, ok := index[id]; !ok || got != project {
			t.Errorf("%s (id %d) -> %q, %v; want %q", rel, id, got, ok, project)
		}
	}
	for dir, id := range walked {
		if got, err := mountOf(t).PathOf(id); err != nil || got != dir {
			t.Errorf("PathOf(%d) = %q, %v; want %s", id, got, err, dir)
		}
	}
	if id, _ := cgroup.ID(root); walked[root] != id || index[id] != "" {
		t.Errorf("root: walked id %d, ID %d, project %q", walked[root], id, index[id])
	}
	if err := cgroup.OnCgroup2(root); err != nil {
		t.Error(err)
	}
	if err := cgroup.OnCgroup2(t.TempDir()); !errors.Is(err, cgroup.ErrNotCgroup2) {
		t.Errorf("a temporary directory: %v", err)
	}
	// A file inside a cgroup is on cgroup2 too, and is not a cgroup.
	if err := cgroup.OnCgroup2(filepath.Join(root, "cgroup.procs")); !errors.Is(err, cgroup.ErrNotCgroup2) {
		t.Errorf("cgroup.procs: %v", err)
	}

	m, err := cgroup.FindMount()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sleep", "60")
	testutil.StartInCgroup(t, cmd, filepath.Join(root, "a/x/y"))
	if got, err := m.OfPID(cmd.Process.Pid); err != nil || got != filepath.Join(root, "a/x/y") {
		t.Errorf("OfPID = %q, %v; want %s", got, err, filepath.Join(root, "a/x/y"))
	}
}

func TestMissing(t *testing.T) {
	if _, err := cgroup.ProjectIndex(filepath.Join(t.TempDir(), "nope")); !errors.Is(err, unix.ENOENT) {
		t.Errorf("ProjectIndex(missing) = %v, want ENOENT", err)
	}
	if err := cgroup.RemoveTree(filepath.Join(t.TempDir(), "nope")); err != nil {
		t.Errorf("RemoveTree(missing) = %v", err)
	}
}

// TestRemoveTreeKillsLeftovers: a process nobody stopped does not keep its
// cgroup, or its parent, from being removed.
func TestRemoveTreeKillsLeftovers(t *testing.T) {
	testutil.RequireRoot(t)
	root := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-cgroup-")
	child := testutil.MkCgroup(t, root, "child")
	cmd := exec.Command("sleep", "60")
	testutil.InCgroup(t, cmd, child)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	if err := cgroup.RemoveTree(root); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(root); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("cgroup %s left behind: %v", root, err)
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the leftover process still runs")
	}
}

func mountOf(t *testing.T) cgroup.Mount {
	t.Helper()
	m, err := cgroup.FindMount()
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestPathOfGone: the id of a removed cgroup finds nothing.
func TestPathOfGone(t *testing.T) {
	testutil.RequireRoot(t)
	root := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-cgroup-")
	dir := testutil.MkCgroup(t, root, "gone")
	id, err := cgroup.ID(dir)
	if err != nil {
		t.Fatal(err)
	}
	testutil.RemoveCgroup(t, dir)
	if p, err := mountOf(t).PathOf(id); err == nil {
		t.Fatalf("a removed cgroup's id found %s", p)
	}
}

// TestOfPIDCgroupns: a reader in a private cgroup namespace (a container's,
// with the host's hierarchy mounted: Root "/../..") places processes
// outside its namespace's subtree ("0::/../other") and inside it by their
// real directories. Joining the path to the mount point dropped the "..":
// a process of top/other was placed at <mount>/other, which is no cgroup.
func TestOfPIDCgroupns(t *testing.T) {
	if want := os.Getenv("FS_TEST_CGNS"); want != "" {
		ofPIDInNamespace(t, want) // the reader, run by the test below
		return
	}
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-cgns-")
	nsRoot := testutil.MkCgroup(t, top, "ns")
	other := testutil.MkCgroup(t, testutil.MkCgroup(t, top, "other"), "c")
	inner := testutil.MkCgroup(t, nsRoot, "inner")
	var want []string
	for _, dir := range []string{other, inner, top} {
		cmd := exec.Command("sleep", "60")
		testutil.StartInCgroup(t, cmd, dir)
		want = append(want, strconv.Itoa(cmd.Process.Pid)+"="+dir)
	}
	reader := exec.Command("unshare", "-C", os.Args[0], "-test.run=^TestOfPIDCgroupns$", "-test.v")
	reader.Env = append(os.Environ(), "FS_TEST_CGNS="+strings.Join(want, ";"))
	testutil.InCgroup(t, reader, nsRoot)
	out, err := reader.CombinedOutput()
	if err != nil {
		t.Fatalf("the reader in a cgroup namespace rooted at %s: %v\n%s", nsRoot, err, out)
	}
	t.Logf("the reader in a cgroup namespace rooted at %s:\n%s", nsRoot, out)
}

// ofPIDInNamespace checks, in a private cgroup namespace, OfPID of each
// "pid=dir" of want.
func ofPIDInNamespace(t *testing.T, want string) {
	m := mountOf(t)
	self, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(m.Root, "/..") || !strings.Contains(string(self), "0::/\n") {
		t.Fatalf("not in a private cgroup namespace: mount %+v, /proc/self/cgroup %q", m, self)
	}
	t.Logf("mount %+v", m)
	for _, pd := range strings.Split(want, ";") {
		pid, dir, _ := strings.Cut(pd, "=")
		n, _ := strconv.Atoi(pid)
		shown, _ := os.ReadFile("/proc/" + pid + "/cgroup")
		got, err := m.OfPID(n)
		if err != nil || got != dir {
			t.Errorf("OfPID(%d) (%q) = %q, %v; want %s", n, strings.TrimSpace(string(shown)), got, err, dir)
		} else {
			t.Logf("OfPID(%d) (%q) = %s", n, strings.TrimSpace(string(shown)), got)
		}
	}
	if got, err := m.OfPID(os.Getpid()); err != nil || filepath.Base(got) != "ns" {
		t.Errorf("OfPID of the reader itself = %q, %v; want the namespace's root", got, err)
	}
}
