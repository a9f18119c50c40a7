// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// TestNetnsCapFlood: an unprivileged user of one tenant (nobody, in
// team-b's pod) makes network namespaces past the attach cap
// (connections.max_netns: 3). The daemon attaches up to the cap, logs
// the cap once however many sweeps see the flood, and keeps running;
// team-a's namespace, attached before, stays enforced; a namespace team-a
// makes during the flood waits, and is attached and enforced once the
// flood's namespaces are gone.
func TestNetnsCapFlood(t *testing.T) {
	n := newNode(t, "pools: {connections: {size: 5}}\nconnections: {max_netns: 3}\ntick: 200ms\n")
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-e2e-netnscap-")
	pods := testutil.KubeletCgroupfs(t, top, []string{"burstable", "besteffort"}, 2)
	clients := testutil.MkCgroup(t, top, "clients")
	n.start()
	for i, name := range []string{"team-a", "team-b"} {
		if out, errOut, code := n.project("add", name, "--cgroup", pods[i].Cgroup); code != 0 {
			t.Fatalf("add %s: exit %d\n%s%s", name, code, out, errOut)
		}
	}
	victim := startPodServer(t, pods[0].Containers[0])
	n.waitAttached(victim.pid, 15*time.Second)

	// nobody makes namespaces of its own (a user namespace each), in
	// team-b's container.
	const flood = 8
	var flooders []*exec.Cmd
	for range flood {
		cmd := exec.Command("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "unshare", "-rn", "sleep", "120")
		testutil.StartInCgroup(t, cmd, pods[1].Containers[0])
		flooders = append(flooders, cmd)
	}
	waiting := func(m admin.Membership, project string) (attached, full int) {
		for _, ns := range m.Netns.Namespaces {
			if !strings.Contains(strings.Join(ns.Projects, ","), project) {
				continue
			}
			if ns.Attached {
				attached++
			} else if strings.Contains(ns.Error, "too many network namespaces attached") {
				full++
			}
		}
		return attached, full
	}
	eventually(t, func() error {
		if a, f := waiting(n.members(), "team-b"); a != 2 || f != flood-2 {
			return fmt.Errorf("team-b's namespaces: %d attached, %d at the cap; want 2 and %d", a, f, flood-2)
		}
		return nil
	})
	// team-a makes a namespace during the flood: it waits.
	late := startPodServer(t, pods[0].Containers[1])
	eventually(t, func() error {
		for _, ns := range n.members().Netns.Namespaces {
			if ns.PID == late.pid && !ns.Attached && strings.Contains(ns.Error, "too many network namespaces attached") {
				return nil
			}
		}
		return fmt.Errorf("team-a's new namespace not shown waiting at the cap")
	})
	time.Sleep(time.Second) // several sweeps at the cap

	// The namespace attached before the flood is enforced as before.
	if ok, refused := connectIn(t, victim, clients, 6); ok != 4 || refused != 2 {
		t.Fatalf("client in team-a's namespace during the flood: %d connected, %d refused; want 4 and 2 with a pool of 5 (inbound, a floor short)", ok, refused)
	}
	if n.cmd == nil || n.cmd.ProcessState != nil {
		t.Fatal("the daemon is not running")
	}
	capLines := func() int {
		k := 0
		for line := range strings.Lines(n.log.String()) {
			var rec struct{ Level, Msg string }
			if json.Unmarshal([]byte(line), &rec) == nil && strings.Contains(rec.Msg, "attach cap") && rec.Level == "WARN" {
				k++
			}
		}
		return k
	}
	if k := capLines(); k != 1 {
		t.Errorf("%d log lines about the cap during the flood, want 1:\n%s", k, n.log)
	}
	if k := strings.Count(n.log.String(), "inbound admission not attached"); k != 0 {
		t.Errorf("%d lines per namespace not attached, want none (the cap's one line says it)", k)
	}

	// The flood ends: its namespaces go, the late one is attached and
	// enforced.
	for _, cmd := range flooders {
		testutil.Stop(cmd)
	}
	n.waitAttached(late.pid, 15*time.Second)
	for _, c := range n.status().Pools {
		if c.Name == "connections" {
			if pr := project(c, "team-a"); pr.Held != 4 {
				t.Fatalf("team-a holds %d before the late namespace's connections, want 4", pr.Held)
			}
		}
	}
	if ok, refused := connectIn(t, late, clients, 2); ok != 0 || refused != 2 {
		t.Errorf("client in team-a's late namespace, the pool full: %d connected, %d refused; want 0 and 2", ok, refused)
	}
	if !strings.Contains(n.log.String(), "below the attach cap again") {
		t.Errorf("no line says the cap was left")
	}
}

// TestNetnsCapPerProject: one tenant making namespaces takes at most its
// bound of the attach cap (connections.max_netns_per_project: 2 of 4), so a
// namespace another tenant makes during the flood is attached and enforced
// at once; the bound is logged once for the flooding project.
func TestNetnsCapPerProject(t *testing.T) {
	n := newNode(t, "pools: {connections: {size: 5}}\nconnections: {max_netns: 4, max_netns_per_project: 2}\ntick: 200ms\n")
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-e2e-netnsproj-")
	pods := testutil.KubeletCgroupfs(t, top, []string{"burstable", "besteffort"}, 2)
	clients := testutil.MkCgroup(t, top, "clients")
	n.start()
	for i, name := range []string{"team-a", "team-b"} {
		if out, errOut, code := n.project("add", name, "--cgroup", pods[i].Cgroup); code != 0 {
			t.Fatalf("add %s: exit %d\n%s%s", name, code, out, errOut)
		}
	}
	victim := startPodServer(t, pods[0].Containers[0])
	n.waitAttached(victim.pid, 15*time.Second)
	const flood = 8
	for range flood {
		cmd := exec.Command("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "unshare", "-rn", "sleep", "120")
		testutil.StartInCgroup(t, cmd, pods[1].Containers[0])
	}
	eventually(t, func() error {
		attached, bounded := 0, 0
		for _, ns := range n.members().Netns.Namespaces {
			if !strings.Contains(strings.Join(ns.Projects, ","), "team-b") {
				continue
			}
			if ns.Attached {
				attached++
			} else if strings.Contains(ns.Error, "max_netns_per_project") {
				bounded++
			}
		}
		if attached != 2 || bounded != flood-2 {
			return fmt.Errorf("team-b's namespaces: %d attached, %d at its bound; want 2 and %d", attached, bounded, flood-2)
		}
		return nil
	})
	late := startPodServer(t, pods[0].Containers[1])
	n.waitAttached(late.pid, 15*time.Second)
	time.Sleep(time.Second) // several sweeps with team-b at its bound
	if ok, refused := connectIn(t, victim, clients, 4); ok != 4 || refused != 0 {
		t.Fatalf("client in team-a's first namespace: %d connected, %d refused; want 4 and 0", ok, refused)
	}
	if ok, refused := connectIn(t, late, clients, 2); ok != 0 || refused != 2 {
		t.Errorf("client in team-a's namespace made during the flood, the pool full: %d connected, %d refused; want 0 and 2", ok, refused)
	}
	if k := strings.Count(n.log.String(), "bound of attached network namespaces"); k != 1 {
		t.Errorf("%d log lines about team-b's bound, want 1:\n%s", k, n.log)
	}
}

// TestNetnsCapPerProjectHeldByFd: a namespace whose processes are gone but
// which a tenant keeps alive by an open file keeps its link in the kernel,
// and so still counts toward its project's bound
// (connections.max_netns_per_project: 2 of 4). nobody in team-b's pod makes
// two namespaces, holds each by a file and ends its process (the scan no
// longer sees them); its third is refused at the bound, and team-a's new
// namespace is attached. Counting only the namespaces the scan sees gave
// team-b 3 links of the 4 and left team-a's new namespace unenforced.
func TestNetnsCapPerProjectHeldByFd(t *testing.T) {
	n := newNode(t, "pools: {connections: {size: 5}}\nconnections: {max_netns: 4, max_netns_per_project: 2}\ntick: 100ms\n")
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-e2e-netnsfd-")
	pods := testutil.KubeletCgroupfs(t, top, []string{"burstable", "besteffort"}, 2)
	n.start()
	for i, name := range []string{"team-a", "team-b"} {
		if out, errOut, code := n.project("add", name, "--cgroup", pods[i].Cgroup); code != 0 {
			t.Fatalf("add %s: exit %d\n%s%s", name, code, out, errOut)
		}
	}
	victim := startPodServer(t, pods[0].Containers[0])
	n.waitAttached(victim.pid, 15*time.Second)

	// Each line read makes a namespace (its process's pid is written
	// back), and the next ends its process while a file holds it.
	script := `i=20
while read cmd; do
  [ -n "$pid" ] && { kill $pid; wait $pid 2>/dev/null; }
  [ "$cmd" = end ] && break
  unshare -rn sleep 120 & pid=$!
  while [ "$(readlink /proc/$pid/ns/net)" = "$(readlink /proc/self/ns/net)" ]; do sleep 0.02; done
  i=$((i+1)); eval "exec $i</proc/$pid/ns/net"
  echo $pid
done
sleep 120`
	cmd := exec.Command("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", "-c", script)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	testutil.StartInCgroup(t, cmd, pods[1].Containers[0])
	rd := bufio.NewReader(stdout)
	next := func() int {
		t.Helper()
		fmt.Fprintln(stdin, "go")
		line, err := rd.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		pid, err := strconv.Atoi(strings.TrimSpace(line))
		if err != nil {
			t.Fatal(err)
		}
		return pid
	}
	state := func(pid int) (admin.Namespace, bool) {
		for _, ns := range n.members().Netns.Namespaces {
			if ns.PID == pid {
				return ns, true
			}
		}
		return admin.Namespace{}, false
	}
	var held []int
	for range 2 {
		pid := next()
		n.waitAttached(pid, 15*time.Second)
		held = append(held, pid)
	}
	third := next() // ends the second's process
	eventually(t, func() error {
		for _, pid := range held {
			if ns, ok := state(pid); ok {
				return fmt.Errorf("team-b's emptied namespace is still seen: %+v", ns)
			}
		}
		return nil
	})
	eventually(t, func() error {
		ns, ok := state(third)
		if !ok || ns.Attached || !strings.Contains(ns.Error, "max_netns_per_project") {
			return fmt.Errorf("team-b's third namespace, two held by files: %+v (seen %v); want refused at max_netns_per_project", ns, ok)
		}
		return nil
	})
	late := startPodServer(t, pods[0].Containers[1])
	n.waitAttached(late.pid, 15*time.Second)
	fmt.Fprintln(stdin, "end")
}
