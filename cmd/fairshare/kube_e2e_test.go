// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/internal/crtest"
	"github.com/fairshare-dev/fairshare/internal/netnsscan"
	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// kubeNode is a node whose projects are the pods of the runtime r (and
// registrations), polled each tick.
func kubeNode(t *testing.T, r *crtest.Runtime, extra string) *node {
	return newNode(t, fmt.Sprintf("projects: {sources: [kubernetes, registered]}\nkubernetes: {runtime_endpoint: %s, project_label: fairshare.io/project}\n%s", r.Socket, extra))
}

// kubeMembers are the kubernetes source's members: "project cgroup"
// (the cgroup relative to the cgroup2 mount), sorted. Members of no source
// are the kernel's, held after a restart until every source is read.
func kubeMembers(m admin.Membership, mnt string) []string {
	var out []string
	for _, e := range m.Members {
		if e.Source == "kubernetes" || e.Source == "" {
			out = append(out, e.Project+" "+strings.TrimPrefix(e.Cgroup, mnt))
		}
	}
	slices.Sort(out)
	return out
}

func podMember(project string, p *crtest.Pod) string { return project + " " + p.CgroupParent }

func kubeSource(m admin.Membership) admin.MemberSource {
	for _, s := range m.Sources {
		if s.Name == "kubernetes" {
			return s
		}
	}
	return admin.MemberSource{}
}

// TestKubernetesPods runs the daemon binary on a real containerd: the pods
// of namespaces team-a and team-b are members of projects team-a and
// team-b, a labelled pod of its label's project, a kube-system pod of none,
// and the front places their requests so;
// a new pod is in force within a tick or so (the time is logged), a removed
// pod is not; a runtime that goes away is reported once (log, status,
// fairshare_membership_source_up 0) while the pods stay members, even
// across a restart of the daemon, and read again when it is back; after
// SIGKILL the restarted daemon has the same members from its first status
// on.
func TestKubernetesPods(t *testing.T) {
	r := crtest.Start(t)
	mnt := testutil.Cgroup2Mount(t)
	a1 := r.RunPod(t, crtest.PodSpec{Namespace: "team-a", Name: "a1", HostNetwork: true})
	a2 := r.RunPod(t, crtest.PodSpec{Namespace: "team-a", Name: "a2"})
	b := r.RunPod(t, crtest.PodSpec{Namespace: "team-b", Name: "b", HostNetwork: true})
	l := r.RunPod(t, crtest.PodSpec{Namespace: "team-a", Name: "l", HostNetwork: true, Labels: map[string]string{"fairshare.io/project": "billing"}})
	r.RunPod(t, crtest.PodSpec{Namespace: "kube-system", Name: "dns", HostNetwork: true})
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	defer up.Close()
	n := kubeNode(t, r, fmt.Sprintf("front: {listen: '127.0.0.1:0', upstream: %q}\n", up.URL))
	n.start()

	want := []string{podMember("team-a", a1), podMember("team-a", a2), podMember("team-b", b), podMember("billing", l)}
	slices.Sort(want)
	var m admin.Membership
	eventually(t, func() error { // the first poll
		m = n.members()
		if got := kubeMembers(m, mnt); !slices.Equal(got, want) {
			return fmt.Errorf("members at start %v\nwant %v", got, want)
		}
		return nil
	})
	if s := kubeSource(m); s.Members != 4 || s.Error != "" {
		t.Errorf("kubernetes source %+v", s)
	}
	// The front places a pod's request by the pod's cgroup: the label's
	// project for l, the namespace's for a1.
	for _, p := range []*crtest.Pod{a1, l} {
		if out, err := r.Exec(p, 10*time.Second, "/bin/busybox", "wget", "-q", "-O-", "http://"+n.r.Front+"/"); err != nil || out != "ok" {
			t.Fatalf("a request from %s/%s through the front: %q %v", p.Namespace, p.Name, out, err)
		}
	}
	if rq := pool(n.status(), "requests"); project(rq, "team-a").Admitted != 1 || project(rq, "billing").Admitted != 1 {
		t.Errorf("the front did not place the pods' requests in their projects: %+v", rq.Projects)
	}
	out, errOut, code := runCLI(t, "run", "--check", "--config", n.cfg)
	if w := "ok: the container runtime at " + r.Socket + " answers (containerd"; code != 0 || !strings.Contains(out, w) ||
		!strings.Contains(out, "5 ready pods, 4 of them in 3 projects, 1 of system namespaces") {
		t.Errorf("run --check: exit %d, want a line %q and the pods counted\n%s%s", code, w, out, errOut)
	}
	met := n.metrics()
	for _, w := range []string{`fairshare_membership_members{source="kubernetes"} 4`, `fairshare_membership_source_up{source="kubernetes"} 1`} {
		if !strings.Contains(met, w) {
			t.Errorf("/metrics lacks %s", w)
		}
	}

	// A new pod: from its start (the sandbox ready, the container started)
	// to its member in force, as the admin API shows it.
	started := time.Now()
	c := r.RunPod(t, crtest.PodSpec{Namespace: "team-c", Name: "c", HostNetwork: true})
	ready := time.Now()
	for !slices.Contains(kubeMembers(n.members(), mnt), podMember("team-c", c)) {
		if time.Since(ready) > 10*time.Second {
			t.Fatal("a new pod is no member after 10s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Logf("new pod: RunPod took %s; its member was in force %s after the container started (tick 1s)",
		ready.Sub(started).Round(time.Millisecond), time.Since(ready).Round(time.Millisecond))
	want = append(want, podMember("team-c", c))
	slices.Sort(want)

	r.RemovePod(t, l)
	want = slices.DeleteFunc(want, func(s string) bool { return strings.HasPrefix(s, "billing ") })
	eventually(t, func() error {
		if got := kubeMembers(n.members(), mnt); !slices.Equal(got, want) {
			return fmt.Errorf("members after a pod was removed %v\nwant %v", got, want)
		}
		return nil
	})

	r.Down(t)
	eventually(t, func() error {
		if s := kubeSource(n.members()); !strings.Contains(s.Error, "is not answering") {
			return fmt.Errorf("kubernetes source with the runtime away: %+v", s)
		}
		return nil
	})
	time.Sleep(2500 * time.Millisecond) // two more ticks: still one line
	if got := kubeMembers(n.members(), mnt); !slices.Equal(got, want) {
		t.Errorf("members with the runtime away %v\nwant %v (the last ones)", got, want)
	}
	if !strings.Contains(n.metrics(), `fairshare_membership_source_up{source="kubernetes"} 0`) {
		t.Error("/metrics: the kubernetes source is not down")
	}
	if k := strings.Count(n.log.String(), "a source of members could not be read"); k != 1 {
		t.Errorf("the runtime's absence logged %d times, want once:\n%s", k, n.log)
	}
	if out, errOut, code := runCLI(t, "run", "--check", "--config", n.cfg); code != 0 || !strings.Contains(out, "note: kubernetes: ") ||
		!strings.Contains(out, "the daemon starts anyway") {
		t.Errorf("run --check with the runtime away: exit %d\n%s%s", code, out, errOut)
	}
	// A restart while the runtime is away starts from the pods last read.
	n.stop(syscall.SIGKILL)
	n.start()
	m = n.members()
	if got := kubeMembers(m, mnt); !slices.Equal(got, want) {
		t.Errorf("members after a restart with the runtime away %v\nwant %v (the last ones)", got, want)
	}
	if s := kubeSource(m); !strings.Contains(s.Error, "is not answering") {
		t.Errorf("kubernetes source after a restart with the runtime away: %+v", s)
	}
	r.Up(t)
	eventually(t, func() error {
		if s := kubeSource(n.members()); s.Error != "" || s.Members != len(want) {
			return fmt.Errorf("kubernetes source with the runtime back: %+v", s)
		}
		return nil
	})

	n.stop(syscall.SIGKILL)
	n.start()
	if got := kubeMembers(n.members(), mnt); !slices.Equal(got, want) {
		t.Errorf("members after SIGKILL and restart %v\nwant %v", got, want)
	}
	if strings.Contains(n.log.String(), `"level":"ERROR"`) {
		t.Errorf("the daemon logged errors:\n%s", n.log)
	}
}

// holdListener accepts and holds every connection until the test ends,
// counting them.
type holdListener struct {
	ln       net.Listener
	accepted atomic.Int64
	mu       sync.Mutex
	conns    []net.Conn
}

func hold(t *testing.T) *holdListener {
	ln, err := net.Listen("tcp4", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	h := &holdListener{ln: ln}
	t.Cleanup(func() {
		ln.Close()
		h.mu.Lock()
		for _, c := range h.conns {
			c.Close()
		}
		h.mu.Unlock()
	})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			h.accepted.Add(1)
			h.mu.Lock()
			h.conns = append(h.conns, c)
			h.mu.Unlock()
		}
	}()
	return h
}

func (h *holdListener) port() string { return strconv.Itoa(h.ln.Addr().(*net.TCPAddr).Port) }

// podConnect opens count connections from the pod's container to host:port
// with busybox nc, each held open for a minute, one after the other.
func podConnect(t *testing.T, r *crtest.Runtime, p *crtest.Pod, host, port string, count int) {
	t.Helper()
	script := fmt.Sprintf("i=0; while [ $i -lt %d ]; do (sleep 60 | nc %s %s) </dev/null >/dev/null 2>&1 & sleep 0.05; i=$((i+1)); done", count, host, port)
	if out, err := r.Exec(p, 30*time.Second, "/bin/sh", "-c", script); err != nil {
		t.Fatalf("connecting from %s/%s: %v %s", p.Namespace, p.Name, err, out)
	}
}

// gateway is the host's address on the pods' bridge, as a pod with its own
// network namespace reaches it (the bridge is the gateway, .1).
func gateway(t *testing.T, p *crtest.Pod) string {
	ip := net.ParseIP(p.IP).To4()
	if ip == nil {
		t.Fatalf("pod %s/%s has no IPv4 address (%q)", p.Namespace, p.Name, p.IP)
	}
	ip[3] = 1
	return ip.String()
}

// kernelMembersMissing fails the kernel-side tests of pods when the daemon
// reports that its kernel side takes no members (SetMembers, AttachNetns):
// pods' connections would not be counted.
const kernelMembersMissing = "the daemon's kernel side takes no members: pods' connections are not counted"

// TestKubernetesConnections: connections from the containers of pods count
// for their projects in the kernel and the fair-share rule holds between
// them (pool 12, three projects active: a share of 4 each); a labelled
// pod's count for the label's project; a kube-system pod's are neither
// counted nor refused; after SIGKILL the restarted daemon finds the pods
// and the same counts; a removed pod's connections and member go. The time
// from a pod's start to its first counted connection is logged. (Its body
// was run once against the kernel as it is, with the pods' cgroups placed
// in directories of projects_root named as their projects, and passed.)
func TestKubernetesConnections(t *testing.T) {
	r := crtest.Start(t)
	h := hold(t)
	a := r.RunPod(t, crtest.PodSpec{Namespace: "team-a", Name: "a", HostNetwork: true})
	b := r.RunPod(t, crtest.PodSpec{Namespace: "team-b", Name: "b"})
	l := r.RunPod(t, crtest.PodSpec{Namespace: "team-a", Name: "l", HostNetwork: true, Labels: map[string]string{"fairshare.io/project": "billing"}})
	sys := r.RunPod(t, crtest.PodSpec{Namespace: "kube-system", Name: "dns", HostNetwork: true})
	n := kubeNode(t, r, "pools: {connections: {size: 12, floor: 1}}\n")
	n.start()
	eventually(t, func() error {
		if m := n.members().Members; len(m) != 3 {
			return fmt.Errorf("members %+v, want 3", m)
		}
		return nil
	})
	kernel := n.members().Kernel

	// The pods reach the host: on its network and through the bridge.
	podConnect(t, r, l, "127.0.0.1", h.port(), 1)
	podConnect(t, r, b, gateway(t, b), h.port(), 2)
	eventually(t, func() error {
		if k := h.accepted.Load(); k != 3 {
			return fmt.Errorf("%d connections from the pods accepted, want 3", k)
		}
		return nil
	})
	if !kernel {
		t.Fatal(kernelMembersMissing)
	}
	counts := func(name string) admin.Project { return project(pool(n.status(), "connections"), name) }
	eventually(t, func() error {
		if c, d := counts("billing"), counts("team-b"); c.Held != 1 || d.Held != 2 {
			return fmt.Errorf("billing holds %d (want 1), team-b %d (want 2)", c.Held, d.Held)
		}
		return nil
	})
	// Three projects active, a share of 4 each. team-a, past its share, is
	// admitted only while the pool has more than a floor left: 8 of 10,
	// in_use 11 of 12. At that same occupancy team-b, under its share, is
	// admitted.
	podConnect(t, r, a, "127.0.0.1", h.port(), 10)
	eventually(t, func() error {
		if ca := counts("team-a"); ca.Held != 8 || ca.Refused != 2 {
			return fmt.Errorf("team-a %d held %d refused, want 8 and 2 (pool 12, floor 1, 3 held by others)", ca.Held, ca.Refused)
		}
		return nil
	})
	podConnect(t, r, b, gateway(t, b), h.port(), 1)
	eventually(t, func() error {
		if cb := counts("team-b"); cb.Held != 3 || cb.Refused != 0 {
			return fmt.Errorf("team-b %d held %d refused, want 3 and 0: under its share it takes the floor team-a may not", cb.Held, cb.Refused)
		}
		return nil
	})
	before := h.accepted.Load()
	inUse := pool(n.status(), "connections").InUse
	podConnect(t, r, sys, "127.0.0.1", h.port(), 3)
	eventually(t, func() error {
		if k := h.accepted.Load() - before; k != 3 {
			return fmt.Errorf("kube-system's pod got %d of 3 connections through", k)
		}
		return nil
	})
	if c := pool(n.status(), "connections"); c.InUse != inUse || project(c, "kube-system").Held != 0 {
		t.Errorf("kube-system's connections counted: in_use %d -> %d, %+v", inUse, c.InUse, c.Projects)
	}

	// Start to first counted connection: a pod opening one connection every
	// 50ms from its start.
	started := time.Now()
	e := r.RunPod(t, crtest.PodSpec{Namespace: "team-e", Name: "e", HostNetwork: true,
		Command: []string{"/bin/sh", "-c", "while :; do (sleep 60 | nc 127.0.0.1 " + h.port() + ") </dev/null >/dev/null 2>&1 & sleep 0.05; done"}})
	for {
		if c := counts("team-e"); c.Held+int(c.Refused) > 0 {
			break
		}
		if time.Since(started) > 10*time.Second {
			t.Fatal("no connection of a new pod counted within 10s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("a new pod's first counted connection %s after RunPod began", time.Since(started).Round(time.Millisecond))
	r.RemovePod(t, e)

	n.stop(syscall.SIGKILL)
	n.start()
	eventually(t, func() error {
		if ca, cb := counts("team-a"), counts("team-b"); ca.Held != 8 || cb.Held != 3 || len(n.members().Members) != 3 {
			return fmt.Errorf("after SIGKILL and restart team-a holds %d, team-b %d (want 8, 3); members %+v", ca.Held, cb.Held, n.members().Members)
		}
		return nil
	})

	r.RemovePod(t, a)
	eventually(t, func() error {
		if c := counts("team-a"); c.Held != 0 {
			return fmt.Errorf("team-a holds %d after its pod was removed", c.Held)
		}
		for _, m := range n.members().Members {
			if m.Project == "team-a" {
				return fmt.Errorf("team-a still a member: %+v", m)
			}
		}
		return nil
	})
}

// TestKubernetesPodListener: a listener in a pod's own network namespace
// is counted for the pod's project and refused at the SYN past its share;
// removing the pod takes its member and its namespace's link away.
func TestKubernetesPodListener(t *testing.T) {
	r := crtest.Start(t)
	srv := r.RunPod(t, crtest.PodSpec{Namespace: "team-d", Name: "srv",
		Command: []string{"/bin/nc", "-ll", "-p", "8080", "-e", "/bin/sleep", "60"}})
	n := kubeNode(t, r, "pools: {connections: {size: 5, floor: 1}}\n")
	n.start()
	ino, err := netnsscan.Inode(filepath.Join("/proc", strconv.Itoa(srv.Pid), "ns/net"))
	if err != nil {
		t.Fatal(err)
	}
	if !n.members().Kernel {
		t.Fatal(kernelMembersMissing)
	}
	eventually(t, func() error {
		nets := n.members().Netns
		if nets == nil || !slices.ContainsFunc(nets.Namespaces, func(a admin.Namespace) bool { return a.Inode == ino && a.Attached }) {
			return fmt.Errorf("the pod's namespace %d is not attached: %+v", ino, nets)
		}
		return nil
	})
	// What the host and the daemon saw, while the pod still runs.
	state := func() string {
		out, _, _ := n.cli("status", "--json")
		ev, _, _ := n.cli("events", "--json")
		return fmt.Sprintf("%s\nstatus:\n%s\nevents:\n%s\ndaemon log:\n%s", srv.NetState(), out, ev, n.log)
	}
	ok, refused, err := testutil.TryDialAll(t, net.JoinHostPort(srv.IP, "8080"), 6, 5*time.Second)
	if err != nil || ok != 4 || refused != 2 {
		t.Errorf("to the pod's listener: %d connected, %d refused (%v); want 4 and 2 with a pool of 5 (inbound, a floor short)\n%s", ok, refused, err, state())
	}
	// The pod's side is counted when its handshake ends, which the
	// client's connect does not wait for.
	eventually(t, func() error {
		if c := project(pool(n.status(), "connections"), "team-d"); c.Held != 4 || c.Refused != 2 {
			return fmt.Errorf("team-d %+v, want 4 held, 2 refused", c)
		}
		return nil
	})
	r.RemovePod(t, srv)
	eventually(t, func() error {
		m := n.members()
		if len(m.Members) != 0 {
			return fmt.Errorf("members after the pod was removed: %+v", m.Members)
		}
		if m.Netns != nil && slices.ContainsFunc(m.Netns.Namespaces, func(a admin.Namespace) bool { return a.Inode == ino }) {
			return fmt.Errorf("the removed pod's namespace is still listed: %+v", m.Netns.Namespaces)
		}
		return nil
	})
}
