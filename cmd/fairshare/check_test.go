// SPDX-License-Identifier: Apache-2.0

package main

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// TestCheckLeavesRunningDaemonAlone runs `fairshare run --check` beside a
// running daemon: the check must verify the pinned objects without rewriting
// them, so the daemon's exempt set, its budget and its counts survive.
func TestCheckLeavesRunningDaemonAlone(t *testing.T) {
	n := newNode(t, "pools: {connections: {size: 8}}\nconnections: {exempt: [alpha/probes], exempt_max: 3}\n")
	if err := os.MkdirAll(filepath.Join(n.root, "alpha", "probes"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(filepath.Join(n.root, "alpha", "probes")) })
	n.start()
	// The listener is outside the projects root: only alpha's ends count.
	addr := sink(t)
	conns := n.connectFrom("alpha", addr, 2)
	defer conns.close()
	before := pool(n.status(), "connections")
	if before.Exempt == nil || before.Exempt.Max != 3 || len(before.Exempt.Members) != 1 {
		t.Fatalf("daemon's exempt class before the check: %+v", before.Exempt)
	}
	if got := project(before, "alpha").Held; got != 2 {
		t.Fatalf("alpha holds %d connections before the check, want 2", got)
	}

	out, errOut, code := runCLI(t, "run", "--config", n.cfg, "--check")
	if code != 0 {
		t.Fatalf("run --check: exit %d\n%s%s", code, out, errOut)
	}
	if !strings.Contains(out, "left untouched") {
		t.Errorf("run --check did not report the pinned objects as verified:\n%s", out)
	}

	after := pool(n.status(), "connections")
	if !reflect.DeepEqual(before.Exempt.Members, after.Exempt.Members) || after.Exempt.Max != before.Exempt.Max {
		t.Errorf("exempt class changed by --check: before %+v, after %+v", before.Exempt, after.Exempt)
	}
	if after.Size != before.Size || after.Floor != before.Floor {
		t.Errorf("pool changed by --check: size %d->%d floor %d->%d", before.Size, after.Size, before.Floor, after.Floor)
	}
	if got := project(after, "alpha").Held; got != 2 {
		t.Errorf("alpha holds %d connections after the check, want 2", got)
	}

	// What the kernel does is what counts: the probes cgroup must still be
	// exempt, so its connections come from the exempt budget, not alpha's.
	probes := n.connectFrom("alpha/probes", addr, 3)
	defer probes.close()
	final := pool(n.status(), "connections")
	if final.Exempt == nil || final.Exempt.InUse != 3 || project(final, "alpha").Held != 2 {
		t.Errorf("after --check the kernel no longer treats alpha/probes as exempt: exempt %+v, alpha holds %d",
			final.Exempt, project(final, "alpha").Held)
	}
}

// A projects root outside the cgroup2 mount stops run with exit status 78;
// run --check said "ok" for it and named the root as the projects' (found
// by following the README on a host whose cgroup2 is at
// /sys/fs/cgroup/unified). It must refuse what run refuses, with run's
// status, and attach nothing.
func TestCheckRefusesWhatRunRefuses(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: run --check loads BPF programs once the configuration passes")
	}
	dir := t.TempDir()
	outside := filepath.Join(dir, "not-a-cgroup")
	if err := os.Mkdir(outside, 0o755); err != nil {
		t.Fatal(err)
	}
	pins := "/sys/fs/bpf/fs-check-" + filepath.Base(dir)
	t.Cleanup(func() { os.RemoveAll(pins) })
	args := []string{"--projects-root", outside, "--pin-dir", pins, "--admin-socket", filepath.Join(dir, "admin.sock"),
		"--state-dir", filepath.Join(dir, "state")}
	out, errOut, code := runCLI(t, append([]string{"run", "--check"}, args...)...)
	if code != 78 || !strings.Contains(errOut, "projects_root") {
		t.Fatalf("run --check with a projects root outside the cgroup2 mount: exit %d\n%s%s", code, out, errOut)
	}
	if strings.Contains(out, "ok:") {
		t.Errorf("run --check said ok for a configuration run refuses:\n%s", out)
	}
	_, errRun, codeRun := runCLI(t, append([]string{"run", "--print-config"}, args...)...)
	if codeRun != code {
		t.Errorf("run --print-config exits %d for the same configuration (%s), --check %d", codeRun, errRun, code)
	}
}
