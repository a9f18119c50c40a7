// SPDX-License-Identifier: Apache-2.0

package membership_test

import (
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/membership"
	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// scan runs one source's scan through Resolve, as the daemon does.
func scan(t *testing.T, s membership.Source) membership.Result {
	t.Helper()
	f, err := s.Scan(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return membership.Resolve([]membership.Input{{Source: s.Name(), Found: f}}, nil)
}

func projects(r membership.Result) map[string]string {
	out := map[string]string{}
	for _, e := range r.Accepted {
		out[e.Cgroup] = e.Project
	}
	return out
}

// waitChanged waits for a source's change notification.
func waitChanged(t *testing.T, n membership.Notifier, what string) {
	t.Helper()
	select {
	case <-n.Changed():
	case <-time.After(5 * time.Second):
		t.Fatalf("no change notification after %s", what)
	}
}

// drain takes a pending notification, if any.
func drain(n membership.Notifier) {
	select {
	case <-n.Changed():
	default:
	}
}

// sleeper starts a process in dir and returns the cgroup the kernel
// reports it in.
func sleeper(t *testing.T, mount cgroup.Mount, dir string) (*exec.Cmd, string) {
	t.Helper()
	cmd := exec.Command("sleep", "60")
	testutil.StartInCgroup(t, cmd, dir)
	got, err := mount.OfPID(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	return cmd, got
}

func findMount(t *testing.T) cgroup.Mount {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.Cgroup2Mount(t)
	m, err := cgroup.FindMount()
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestDirectorySource: every child of the root is a project, a new one is
// reported at once by inotify and found by the next scan, a removed one
// goes, a process anywhere below a project is in it, and a root that does
// not exist is created (create) or reported (not).
func TestDirectorySource(t *testing.T) {
	mount := findMount(t)
	top := testutil.TempCgroup(t, mount.Point, "fairshare-member-")
	root := filepath.Join(top, "fairshare")
	src, err := membership.NewDirectory(root, true)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if err := cgroup.OnCgroup2(root); err != nil {
		t.Fatalf("the root was not created: %v", err)
	}
	testutil.MkCgroup(t, root, "alpha")
	deep := testutil.MkCgroup(t, testutil.MkCgroup(t, testutil.MkCgroup(t, root, "beta"), "workers"), "1")
	waitChanged(t, src, "mkdir")
	r := scan(t, src)
	want := map[string]string{filepath.Join(root, "alpha"): "alpha", filepath.Join(root, "beta"): "beta"}
	if got := projects(r); !mapsEqual(got, want) || len(r.Refused) != 0 {
		t.Fatalf("members %v refused %v, want %v", got, r.Refused, want)
	}
	_, cg := sleeper(t, mount, deep)
	if e, ok := membership.NewTree(r.Accepted).Find(cg); !ok || e.Project != "beta" {
		t.Fatalf("a process in %s is in %v %v, want beta", cg, e, ok)
	}

	drain(src)
	gamma := testutil.MkCgroup(t, root, "gamma")
	waitChanged(t, src, "mkdir gamma")
	if got := projects(scan(t, src)); got[gamma] != "gamma" {
		t.Fatalf("gamma not found: %v", got)
	}
	drain(src)
	testutil.RemoveCgroup(t, gamma)
	waitChanged(t, src, "rmdir gamma")
	if got := projects(scan(t, src)); got[gamma] != "" || len(got) != 2 {
		t.Fatalf("gamma still found: %v", got)
	}

	// A name that is no project's is refused with why, the others kept.
	testutil.MkCgroup(t, root, "bad name")
	r = scan(t, src)
	if len(r.Accepted) != 2 || len(r.Refused) != 1 || !strings.Contains(r.Refused[0].Reason, "invalid project name") {
		t.Fatalf("accepted %v refused %v", r.Accepted, r.Refused)
	}

	// A root that went is no members, said so; made again, it is watched
	// again.
	other := filepath.Join(top, "other")
	src2, err := membership.NewDirectory(other, false)
	if err != nil {
		t.Fatal(err)
	}
	defer src2.Close()
	f, err := src2.Scan(context.Background())
	if err != nil || len(f.Members) != 0 || len(f.Skipped) != 1 || !strings.Contains(f.Skipped[0].Reason, "does not exist") {
		t.Fatalf("missing root: %+v %v", f, err)
	}
	testutil.MkCgroup(t, top, "other")
	if _, err := src2.Scan(context.Background()); err != nil { // puts the watch in place
		t.Fatal(err)
	}
	drain(src2)
	testutil.MkCgroup(t, other, "delta")
	waitChanged(t, src2, "mkdir in a root made after the source")
	if got := projects(scan(t, src2)); got[filepath.Join(other, "delta")] != "delta" {
		t.Fatalf("delta not found: %v", got)
	}

	if _, err := membership.NewDirectory(t.TempDir(), false); err == nil {
		t.Fatal("a root that is not on cgroup2 was accepted")
	}
}

// TestSystemdSource lays out fairshare.slice as systemd does for units with
// Slice=fairshare-<name>.slice (and systemd-run --slice ... --scope): each
// fairshare-<name>.slice is the project <name> with \x2d unescaped; a
// nested slice (fairshare-gamma-team1.slice, inside fairshare-gamma.slice)
// and the units in it are part of gamma; a unit directly in fairshare.slice
// and a slice with a dash made by hand are no project, and say why.
func TestSystemdSource(t *testing.T) {
	mount := findMount(t)
	top := testutil.TempCgroup(t, mount.Point, "fairshare-member-")
	units, slice := testutil.SystemdSlices(t, top, "fairshare.slice", map[string][]string{
		`fairshare-alpha.slice`:           {"web.service", "run-u42.scope"},
		`fairshare-web\x2dapi.slice`:      {"api.service"},
		`fairshare-gamma-team1.slice`:     {"batch.service"},
		`fairshare-gamma.slice`:           {},
		`fairshare-cgroup\x2eprocs.slice`: {},
	})
	stray := testutil.MkCgroup(t, slice, "stray.service")
	byHand := testutil.MkCgroup(t, slice, "fairshare-x-y.slice")
	src, err := membership.NewSystemd(slice)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	r := scan(t, src)
	want := map[string]string{
		filepath.Join(slice, "fairshare-alpha.slice"):      "alpha",
		filepath.Join(slice, `fairshare-web\x2dapi.slice`): "web-api",
		filepath.Join(slice, "fairshare-gamma.slice"):      "gamma",
	}
	if got := projects(r); !mapsEqual(got, want) {
		t.Fatalf("members %v, want %v", got, want)
	}
	reasons := map[string]string{}
	for _, f := range r.Refused {
		reasons[f.Cgroup] = f.Reason
	}
	for cg, want := range map[string]string{
		stray:  "a unit directly in fairshare.slice is in no project: give it Slice=fairshare-<name>.slice",
		byHand: `a dash nests in systemd, so this slice belongs inside fairshare-x.slice`,
		filepath.Join(slice, `fairshare-cgroup\x2eprocs.slice`): "invalid project name",
	} {
		if !strings.Contains(reasons[cg], want) {
			t.Errorf("%s: reason %q, want %q", cg, reasons[cg], want)
		}
	}
	if len(r.Refused) != 3 {
		t.Errorf("refused %v", r.Refused)
	}

	// Processes: one started in a service, one moved into a scope as
	// systemd-run --scope does, one in the nested team slice.
	tree := membership.NewTree(r.Accepted)
	_, cg := sleeper(t, mount, units["fairshare-alpha.slice/web.service"])
	moved := exec.Command("sleep", "60")
	if err := moved.Start(); err != nil {
		t.Fatal(err)
	}
	defer testutil.Stop(moved)
	testutil.MoveToCgroup(t, moved.Process.Pid, units["fairshare-alpha.slice/run-u42.scope"])
	movedCg, err := mount.OfPID(moved.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	_, teamCg := sleeper(t, mount, units["fairshare-gamma-team1.slice/batch.service"])
	_, apiCg := sleeper(t, mount, units[`fairshare-web\x2dapi.slice/api.service`])
	_, strayCg := sleeper(t, mount, stray)
	for cg, want := range map[string]string{cg: "alpha", movedCg: "alpha", teamCg: "gamma", apiCg: "web-api", strayCg: ""} {
		if e, _ := tree.Find(cg); e.Project != want {
			t.Errorf("a process in %s is in %q, want %q", cg, e.Project, want)
		}
	}

	drain(src)
	delta := testutil.MkCgroup(t, slice, "fairshare-delta.slice")
	waitChanged(t, src, "a new slice")
	if got := projects(scan(t, src)); got[delta] != "delta" {
		t.Fatalf("delta not found: %v", got)
	}

	for _, bad := range []string{filepath.Join(top, "fairshare"), filepath.Join(top, ".slice"), filepath.Join(top, "-.slice")} {
		if _, err := membership.NewSystemd(bad); err == nil {
			t.Errorf("NewSystemd(%s) accepted a root that is not a slice", bad)
		}
	}
}

func TestSliceNames(t *testing.T) {
	for project, slice := range map[string]string{
		"alpha": "fairshare-alpha.slice", "web-api": `fairshare-web\x2dapi.slice`, "a.b_c": "fairshare-a.b_c.slice",
	} {
		if got := membership.SliceName("fairshare.slice", project); got != slice {
			t.Errorf("SliceName(%s) = %s, want %s", project, got, slice)
		}
	}
	for in, want := range map[string]string{`web\x2dapi`: "web-api", "plain": "plain", `a\x2d\x2db`: "a--b"} {
		if got, err := membership.Unescape(in); err != nil || got != want {
			t.Errorf("Unescape(%s) = %q %v, want %q", in, got, err, want)
		}
	}
	for _, bad := range []string{`a\`, `a\x2`, `a\y2d`, `a\xzz`} {
		if _, err := membership.Unescape(bad); err == nil {
			t.Errorf("Unescape(%s) accepted", bad)
		}
	}
}

// TestKubeletLayouts registers pod cgroups laid out as kubelet's two cgroup
// drivers lay them out (the registered source; a container runtime source
// registers the same cgroups): a process in any container of a pod is in
// the pod's project, one in a QoS cgroup outside every pod is in none, and
// registering a QoS cgroup for another project is refused (above a pod).
func TestKubeletLayouts(t *testing.T) {
	mount := findMount(t)
	for _, driver := range []string{"cgroupfs", "systemd"} {
		t.Run(driver, func(t *testing.T) {
			top := testutil.TempCgroup(t, mount.Point, "fairshare-member-")
			qos := []string{"guaranteed", "burstable", "besteffort", "burstable"}
			var pods []testutil.Pod
			if driver == "cgroupfs" {
				pods = testutil.KubeletCgroupfs(t, top, qos, 2)
			} else {
				pods = testutil.KubeletSystemd(t, top, qos, 2)
			}
			reg := membership.NewStatic("registered")
			var ms []membership.Member
			for i, p := range pods {
				ms = append(ms, membership.Member{Project: []string{"team-a", "team-b"}[i%2], Cgroup: p.Cgroup})
			}
			reg.Set(ms)
			inForce := scan(t, reg).Accepted
			// Registered later, above the pods in force.
			qosDir := filepath.Dir(pods[1].Cgroup) // burstable
			reg.Set(append(ms, membership.Member{Project: "intruder", Cgroup: qosDir}))
			f, err := reg.Scan(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			r := membership.Resolve([]membership.Input{{Source: reg.Name(), Found: f}}, inForce)
			if len(r.Accepted) != 4 || len(r.Refused) != 1 || r.Refused[0].Cgroup != qosDir ||
				!strings.HasPrefix(r.Refused[0].Reason, "above ") {
				t.Fatalf("accepted %v refused %v", r.Accepted, r.Refused)
			}
			tree := membership.NewTree(r.Accepted)
			for i, p := range pods {
				for _, ctr := range p.Containers {
					_, cg := sleeper(t, mount, ctr)
					if e, _ := tree.Find(cg); e.Project != ms[i].Project || e.Cgroup != p.Cgroup {
						t.Errorf("pod %d (%s): a process in %s is in %v, want %s", i, p.QoS, cg, e, ms[i].Project)
					}
				}
			}
			outside := exec.Command("sleep", "60")
			if err := outside.Start(); err != nil {
				t.Fatal(err)
			}
			defer testutil.Stop(outside)
			testutil.MoveToCgroup(t, outside.Process.Pid, qosDir)
			cg, _ := mount.OfPID(outside.Process.Pid)
			if e, ok := tree.Find(cg); ok {
				t.Errorf("a process in the QoS cgroup %s is in %v", cg, e)
			}
		})
	}
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}
