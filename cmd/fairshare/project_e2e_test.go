// SPDX-License-Identifier: Apache-2.0

package main

import (
	"encoding/json"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// project runs 'fairshare project SUB --config ... ARGS'.
func (n *node) project(sub string, args ...string) (string, string, int) {
	n.t.Helper()
	return runCLI(n.t, append([]string{"project", sub, "--config", n.cfg}, args...)...)
}

func (n *node) members() admin.Membership {
	n.t.Helper()
	out, errOut, code := n.project("list", "--json")
	if code != 0 {
		n.t.Fatalf("project list: exit %d: %s", code, errOut)
	}
	var m admin.Membership
	if err := json.Unmarshal([]byte(out), &m); err != nil {
		n.t.Fatalf("project list --json: %v\n%s", err, out)
	}
	return m
}

// TestProjectCommands drives registrations through the CLI against the
// running daemon (BPF on): pods laid out as kubelet's systemd driver does
// are registered by directory and by the path /proc/<pid>/cgroup shows, a
// conflict exits 1 naming the other project and a path that is no cgroup
// exits 2, status and /metrics show the members by source, a registration
// survives the daemon's SIGKILL and restart, one written with no daemon
// running is in force when it starts, and removal takes them out.
func TestProjectCommands(t *testing.T) {
	n := newNode(t, "")
	mnt := testutil.Cgroup2Mount(t)
	top := testutil.TempCgroup(t, mnt, "fairshare-e2e-pods-")
	pods := testutil.KubeletSystemd(t, top, []string{"burstable", "besteffort", "guaranteed"}, 1)
	n.start()

	out, errOut, code := n.project("add", "team-a", "--cgroup", pods[0].Cgroup, "--cgroup", strings.TrimPrefix(pods[1].Cgroup, mnt))
	if code != 0 || !strings.Contains(out, "team-a: 2 registered cgroups, in force") {
		t.Fatalf("add: exit %d\n%s%s", code, out, errOut)
	}
	if _, errOut, code := n.project("add", "team-b", "--cgroup", pods[0].Containers[0]); code != 1 ||
		!strings.Contains(errOut, "below "+pods[0].Cgroup+", registered to project team-a") {
		t.Errorf("a container of team-a's pod for team-b: exit %d %s", code, errOut)
	}
	if _, errOut, code := n.project("add", "team-b", "--cgroup", filepath.Join(top, "nope")); code != 2 || !strings.Contains(errOut, "is not a cgroup") {
		t.Errorf("a path that is no cgroup: exit %d %s", code, errOut)
	}
	if _, errOut, code := n.project("add", "team-b"); code != 2 || !strings.Contains(errOut, "at least one --cgroup") {
		t.Errorf("no --cgroup: exit %d %s", code, errOut)
	}
	if _, errOut, code := n.project("add", "bad name", "--cgroup", pods[2].Cgroup); code != 2 || !strings.Contains(errOut, "may use only") {
		t.Errorf("a bad name: exit %d %s", code, errOut)
	}
	m := n.members()
	if len(m.Members) != 2 || m.Members[0].Project != "team-a" || m.Members[0].Source != "registered" {
		t.Fatalf("members %+v", m.Members)
	}
	st := n.status()
	if st.Membership == nil || len(st.Membership.Members) != 2 || st.Membership.Sources[1].Name != "registered" ||
		st.Membership.Sources[1].Members != 2 {
		t.Fatalf("status membership %+v", st.Membership)
	}
	// The kernel takes no members yet: registered pods outside the
	// projects root are shown, and said not to be limited in the kernel.
	if st.Membership.Kernel || st.Membership.KernelRoot == "" || st.Membership.Unenforced != 2 {
		t.Errorf("status says the kernel limits what it does not: kernel %v, kernel root %q, unenforced %d",
			st.Membership.Kernel, st.Membership.KernelRoot, st.Membership.Unenforced)
	}
	text, _, _ := runCLI(t, "status", "--config", n.cfg)
	if !strings.Contains(text, "members by source: directory 0, registered 2") || !strings.Contains(text, "team-a   registered  2") ||
		!strings.Contains(text, "2 of 2 members are elsewhere and are NOT limited in the kernel") {
		t.Errorf("status text:\n%s", text)
	}
	if out, _, _ := n.project("list"); !strings.Contains(out, "team-a   registered  no      "+pods[0].Cgroup) {
		t.Errorf("project list does not say the kernel leaves team-a's pods alone:\n%s", out)
	}
	if met := n.metrics(); !strings.Contains(met, `fairshare_membership_members{source="registered"} 2`) {
		t.Errorf("metrics lack the members:\n%s", met)
	}

	// SIGKILL and restart: the registrations are read back from the store.
	n.stop(syscall.SIGKILL)
	n.start()
	if m := n.members(); len(m.Members) != 2 {
		t.Fatalf("after a restart: %+v", m.Members)
	}

	// With no daemon, the store is written directly; the daemon puts it in
	// force when it starts.
	n.stop(syscall.SIGTERM)
	out, errOut, code = n.project("add", "team-c", "--cgroup", pods[2].Cgroup)
	if code != 0 || !strings.Contains(out, "stored; the daemon puts them in force when it starts") {
		t.Fatalf("add without a daemon: exit %d\n%s%s", code, out, errOut)
	}
	n.start()
	if m := n.members(); len(m.Members) != 3 {
		t.Fatalf("the registration made with no daemon is not in force: %+v", m.Members)
	}

	out, errOut, code = n.project("remove", "team-a")
	if code != 0 || !strings.Contains(out, "team-a: 0 registered cgroups, in force") {
		t.Fatalf("remove: exit %d\n%s%s", code, out, errOut)
	}
	if _, errOut, code := n.project("remove", "team-a"); code != 1 || !strings.Contains(errOut, "no registered cgroups") {
		t.Errorf("remove again: exit %d %s", code, errOut)
	}
	if m := n.members(); len(m.Members) != 1 || m.Members[0].Project != "team-c" {
		t.Fatalf("after remove: %+v", m.Members)
	}
}

// TestProjectSourcesFlag: a bad --project-sources is the configuration's
// error (exit 2, naming the key); a good one is what the daemon runs on.
func TestProjectSourcesFlag(t *testing.T) {
	for _, bad := range []string{"kube", "directory,systemd", "registered,registered"} {
		_, errOut, code := runCLI(t, "run", "--print-config", "--project-sources", bad)
		if code != 2 || !strings.Contains(errOut, "projects.sources") {
			t.Errorf("--project-sources %s: exit %d %q", bad, code, errOut)
		}
	}
	out, errOut, code := runCLI(t, "run", "--print-config", "--project-sources", "systemd,registered")
	if code != 0 || !strings.Contains(out, "sources:\n    - systemd\n    - registered") || !strings.Contains(out, "fairshare.slice") {
		t.Errorf("--project-sources systemd,registered: exit %d %s\n%s", code, errOut, out)
	}
}
