// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// mapDump is every entry of a map, as bytes, for before/after comparisons.
func mapDump(t testing.TB, m *ebpf.Map) map[string]string {
	t.Helper()
	out := map[string]string{}
	var k, v []byte
	it := m.Iterate()
	for it.Next(&k, &v) {
		out[string(k)] = string(v)
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// Check against a running limiter writes no map and moves no link: the
// exempt set, the config, the counts and the programs in force are the same
// afterwards, and enforcement goes on.
func TestCheckLeavesRunningLimiterAlone(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	app := mkProject(t, root, "app")
	mkProject(t, app, "probes")
	l, err := openRoot(t, root, Options{PinDir: pin, PoolSize: 4, Floor: 1, Exempt: []string{filepath.Join(root, "app/probes")}, ExemptMax: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	h := startHelper(t, app)
	if r := h.dial("tcp4", ln.Addr().String(), 3); r.ok != 3 {
		t.Fatal(r)
	}
	maps := map[string]*ebpf.Map{"fs_config": l.objs.FsConfig, "fs_node": l.objs.FsNode, "fs_exempt": l.objs.FsExempt,
		"fs_projects": l.objs.FsProjects, "fs_listeners": l.objs.FsListeners, "fs_held": l.objs.FsHeld}
	before := map[string]map[string]string{}
	for name, m := range maps {
		before[name] = mapDump(t, m)
	}
	links := func() map[string]ebpf.ProgramID {
		out := map[string]ebpf.ProgramID{}
		for _, a := range l.attachments(root, &l.objs) {
			lk, err := link.LoadPinnedLink(filepath.Join(pin, a.name), nil)
			if err != nil {
				t.Fatal(err)
			}
			info, err := lk.Info()
			lk.Close()
			if err != nil {
				t.Fatal(err)
			}
			out[a.name] = info.Program
		}
		return out
	}
	linksBefore := links()

	// Another configured pool size and no exempt set: neither is applied.
	rep, err := Check(Options{PinDir: pin, PoolSize: 6})
	if err != nil {
		t.Fatal(err)
	}
	if !rep.Pinned || rep.Pool != 4 || rep.InUse != 3 || rep.Exempt != 1 || rep.ExemptMax != 2 ||
		!rep.Current || len(rep.Links) != 6 || len(rep.Attached) != 6 {
		t.Fatalf("report: %+v", rep)
	}
	for name, m := range maps {
		if after := mapDump(t, m); fmt.Sprint(after) != fmt.Sprint(before[name]) {
			t.Errorf("%s changed:\n before %q\n after  %q", name, before[name], after)
		}
	}
	if after := links(); fmt.Sprint(after) != fmt.Sprint(linksBefore) {
		t.Errorf("links moved: %v -> %v", linksBefore, after)
	}
	if r := h.dial("tcp4", ln.Addr().String(), 2); r.ok != 1 || r.refused != 1 {
		t.Fatalf("after the check: %+v; %+v", r, snap(t, l))
	}
	if s := snap(t, l); len(s.Exempt.Paths) != 1 || s.Exempt.Max != 2 {
		t.Fatalf("exempt set after the check: %+v", s.Exempt)
	}

	// A pool the pinned tables cannot hold: a start migrates them.
	if rep, err := Check(Options{PinDir: pin, PoolSize: 4096}); err != nil || !strings.Contains(rep.Migrate, "this start's needs 4096") {
		t.Errorf("check with a pool over the pinned capacity: %+v, %v; want a migration announced", rep, err)
	}
}

// A pin directory missing one of its maps (here the reservation slots) is
// incomplete: its maps cannot be reused as they are (a map made empty next
// to the others would disagree with them), so Check says the start will
// migrate, and Open migrates: fresh maps counting the live connections.
func TestCheckAndOpenMigrateIncompletePins(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	h := startHelper(t, mkProject(t, root, "app"))
	l := openLimiter(t, root, pin, 10, 1)
	if r := h.dial("tcp4", ln.Addr().String(), 2); r.ok != 2 {
		t.Fatal(r)
	}
	l.Close()
	missing := filepath.Join(pin, "fs_resv_slots")
	if err := os.Remove(missing); err != nil {
		t.Fatal(err)
	}
	rep, err := Check(Options{PinDir: pin, PoolSize: 10})
	if err != nil || !strings.Contains(rep.Migrate, "fs_resv_slots missing") {
		t.Fatalf("check without fs_resv_slots: %+v, %v; want a migration announced, naming the map", rep, err)
	}
	l2, err := openRoot(t, root, Options{PinDir: pin, PoolSize: 10, Floor: 1})
	if err != nil {
		t.Fatalf("open without fs_resv_slots: %v, want a migration", err)
	}
	defer l2.Close()
	if l2.mig == nil {
		t.Fatal("open without fs_resv_slots did not migrate")
	}
	if s := snap(t, l2); s.InUse != 2 || project(s, "app").InUse != 2 {
		t.Fatalf("after the migration: %+v, want the 2 connections counted", s)
	}
	if _, err := os.Stat(missing); err != nil {
		t.Fatalf("the migration did not pin the missing map: %v", err)
	}
	if rep, err := Check(Options{PinDir: pin, PoolSize: 10}); err != nil || rep.Migrate != "" {
		t.Fatalf("check after the migration: %+v, %v; want the pins reusable", rep, err)
	}
	h.do("close")
	waitInUse(t, l2, 0, map[string]int{"app": 0})
}

// Without pins, Check loads and attaches every hook and leaves nothing
// behind: no pin directory, no cgroup.
func TestCheckWithoutPins(t *testing.T) {
	testutil.RequireRoot(t)
	pin := filepath.Join("/sys/fs/bpf", fmt.Sprintf("fairshare-check-test-%d", time.Now().UnixNano()))
	rep, err := Check(Options{PinDir: pin, PoolSize: 10})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Pinned || len(rep.Attached) != 6 {
		t.Fatalf("%+v", rep)
	}
	if _, err := os.Stat(pin); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("check created %s: %v", pin, err)
	}
	mnt := testutil.Cgroup2Mount(t)
	left, _ := filepath.Glob(filepath.Join(mnt, "fairshare-check-*"))
	if len(left) != 0 {
		t.Errorf("probe cgroups left: %v", left)
	}
}

// A program the verifier refuses for what an older kernel lacks (a helper
// unknown to it or not allowed for the program's type, as a sockops
// bpf_get_netns_cookie before 5.15) and a feature the library finds missing
// are reported as ErrKernelTooOld, which names the kernel needed and wraps
// ebpf.ErrNotSupported; any other verifier refusal is reported as it is.
func TestLoadErrorNamesOldKernel(t *testing.T) {
	l := &Limiter{pinDir: "/sys/fs/bpf/x"}
	old := &ebpf.VerifierError{Log: []string{"0: R1=ctx()", "1: (85) call bpf_get_netns_cookie#122",
		"program of this type cannot use helper bpf_get_netns_cookie#122", "processed 2 insns"}}
	for _, err := range []error{
		fmt.Errorf("field FsSockops: program fs_sockops: load program: %w", old),
		fmt.Errorf("program fs_sk_lookup: %w", ebpf.ErrNotSupported),
	} {
		got := l.loadError(err)
		if !errors.Is(got, ErrKernelTooOld) || !errors.Is(got, ebpf.ErrNotSupported) || !strings.Contains(got.Error(), "Linux "+MinKernel) {
			t.Errorf("%v: %v, want ErrKernelTooOld naming Linux %s", err, got, MinKernel)
		}
	}
	if !strings.Contains(l.loadError(fmt.Errorf("x: %w", old)).Error(), "cannot use helper bpf_get_netns_cookie") {
		t.Error("the verifier's reason is not quoted")
	}
	bug := &ebpf.VerifierError{Log: []string{"R2 invalid mem access 'scalar'"}}
	if got := l.loadError(bug); errors.Is(got, ErrKernelTooOld) {
		t.Errorf("a verifier refusal of another kind: %v, taken for an old kernel", got)
	}
}
