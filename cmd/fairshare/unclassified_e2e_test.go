// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/crtest"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/loader"
)

// inUseWatch samples the pinned pool's in_use and the unclassified
// project's admissions every few milliseconds until stopped, from the pins
// (as 'fairshare status' reads them with no daemon).
type inUseWatch struct {
	max, unclassified atomic.Int64
	stop              chan struct{}
	wg                sync.WaitGroup
}

func watchInUse(t *testing.T, pin string) *inUseWatch {
	t.Helper()
	w := &inUseWatch{stop: make(chan struct{})}
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		for {
			select {
			case <-w.stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
			ro, err := loader.OpenReadOnly(pin)
			if err != nil {
				continue
			}
			if s, err := ro.Snapshot(); err == nil {
				if int64(s.InUse) > w.max.Load() {
					w.max.Store(int64(s.InUse))
				}
				for _, p := range s.Projects {
					if p.Project == loader.Unclassified && int64(p.Admitted) > w.unclassified.Load() {
						w.unclassified.Store(int64(p.Admitted))
					}
				}
			}
			ro.Close()
		}
	}()
	t.Cleanup(w.done)
	return w
}

func (w *inUseWatch) done() {
	select {
	case <-w.stop:
	default:
		close(w.stop)
	}
	w.wg.Wait()
}

// burst is a pod command that opens n connections to 127.0.0.1:port at
// once as it starts, each held for a minute.
func burst(port string, n int) []string {
	return []string{"/bin/sh", "-c", fmt.Sprintf("i=0; while [ $i -lt %d ]; do (sleep 60 | nc 127.0.0.1 %s) </dev/null >/dev/null 2>&1 & i=$((i+1)); done; sleep 3600", n, port)}
}

// TestKubernetesUnclassifiedPods runs the daemon on a real containerd: a
// pod whose container opens 100 connections the moment it starts, while
// team-a holds half a pool of 12, is under the rule before the daemon has
// seen it (the unclassified project: its share beside team-a, 6, plus the
// floor at most), and in_use never passes 12; the same with the daemon
// SIGKILLed before the pod starts, and with the pod started while the
// daemon restarts. team-a keeps what it holds throughout.
func TestKubernetesUnclassifiedPods(t *testing.T) {
	r := crtest.Start(t)
	h := hold(t)
	a := r.RunPod(t, crtest.PodSpec{Namespace: "team-a", Name: "a", HostNetwork: true})
	const size, floor = 12, 1
	// The tenants' pods run in the host's network namespace here (no CNI
	// needed): limit_host_network_pods limits them as pods of their own
	// namespaces are by default.
	n := kubeNode(t, r, fmt.Sprintf("pools: {connections: {size: %d, floor: %d}}\nconnections: {limit_host_network_pods: true}\n", size, floor))
	n.start()
	eventually(t, func() error {
		if m := n.members().Members; len(m) != 1 {
			return fmt.Errorf("members %+v, want team-a's pod", m)
		}
		return nil
	})
	counts := func() (teamA, unclassified int) {
		ro, err := loader.OpenReadOnly(n.pin)
		if err != nil {
			t.Fatal(err)
		}
		defer ro.Close()
		s, err := ro.Snapshot()
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range s.Projects {
			switch p.Project {
			case "team-a":
				teamA = p.InUse
			case loader.Unclassified:
				unclassified = int(p.Admitted)
			}
		}
		return teamA, unclassified
	}
	podConnect(t, r, a, "127.0.0.1", h.port(), size/2)
	eventually(t, func() error {
		if held, _ := counts(); held != size/2 {
			return fmt.Errorf("team-a holds %d, want %d", held, size/2)
		}
		return nil
	})
	// The most the rule lets a newcomer take beside team-a: its share
	// (two projects active) plus the floor.
	bound := int64(size/2 + floor)
	check := func(what string, w *inUseWatch, before int) {
		t.Helper()
		w.done()
		held, unclassified := counts()
		t.Logf("%s: the unclassified project admitted %d, in_use at most %d, team-a holds %d", what, unclassified-before, w.max.Load(), held)
		if m := w.max.Load(); m > size {
			t.Errorf("%s: in_use reached %d, past the pool's %d", what, m, size)
		}
		if got := int64(unclassified - before); got > bound {
			t.Errorf("%s: the unclassified project admitted %d, more than its share and the floor (%d)", what, got, bound)
		}
		if held != size/2 {
			t.Errorf("%s: team-a holds %d, want %d", what, held, size/2)
		}
	}

	// With the daemon running.
	_, u0 := counts()
	w := watchInUse(t, n.pin)
	b := r.RunPod(t, crtest.PodSpec{Namespace: "team-b", Name: "b", HostNetwork: true, Command: burst(h.port(), 100)})
	eventually(t, func() error {
		for _, m := range n.members().Members {
			if m.Project == "team-b" {
				return nil
			}
		}
		return fmt.Errorf("team-b not a member yet")
	})
	time.Sleep(time.Second) // the burst's last connects
	check("daemon running", w, u0)
	r.RemovePod(t, b)

	// The daemon SIGKILLed before the pod starts: nobody classifies it.
	eventually(t, func() error {
		if _, err := os.Stat(filepath.Join(n.pin, "fs_config")); err != nil {
			return err
		}
		return nil
	})
	n.stop(syscall.SIGKILL)
	_, u1 := counts()
	w = watchInUse(t, n.pin)
	c := r.RunPod(t, crtest.PodSpec{Namespace: "team-c", Name: "c", HostNetwork: true, Command: burst(h.port(), 100)})
	time.Sleep(2 * time.Second)
	_, u := counts()
	if u == u1 {
		t.Errorf("with no daemon the new pod's connections did not count for the unclassified project")
	}
	check("no daemon", w, u1)
	r.RemovePod(t, c)

	// The pod starts while the daemon restarts.
	_, u2 := counts()
	w = watchInUse(t, n.pin)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		d := r.RunPod(t, crtest.PodSpec{Namespace: "team-d", Name: "d", HostNetwork: true, Command: burst(h.port(), 100)})
		time.Sleep(2 * time.Second)
		r.RemovePod(t, d)
	}()
	n.start()
	wg.Wait()
	check("restart", w, u2)
}

// TestKubernetesHostNetworkSystemPodNeverRefused: with the defaults, a new
// pod of the host's network namespace (the API server's static pod, a CNI
// agent) is never refused before it is classified: a tenant holds the whole
// pool and the daemon is SIGKILLed (nobody classifies anything), and every
// connection a new kube-system hostNetwork pod opens goes through. A
// restarted daemon classifies it as a system pod: none of them counts.
func TestKubernetesHostNetworkSystemPodNeverRefused(t *testing.T) {
	r := crtest.Start(t)
	h := hold(t)
	a := r.RunPod(t, crtest.PodSpec{Namespace: "team-a", Name: "a", HostNetwork: true})
	const size = 4
	n := kubeNode(t, r, fmt.Sprintf("pools: {connections: {size: %d, floor: 1}}\n", size))
	n.start()
	teamAFillsPool(t, r, n, a, h, size)
	n.stop(syscall.SIGKILL)
	before := h.accepted.Load()
	sys := r.RunPod(t, crtest.PodSpec{Namespace: "kube-system", Name: "kube-apiserver-node", HostNetwork: true,
		Command: burst(h.port(), 10)})
	eventually(t, func() error {
		if got := h.accepted.Load() - before; got != 10 {
			return fmt.Errorf("%d of the system pod's 10 connections accepted, the pool full and no daemon", got)
		}
		return nil
	})
	n.start()
	eventually(t, func() error {
		st := n.status()
		if p := project(pool(st, "connections"), "team-a"); p.Held != size {
			return fmt.Errorf("team-a holds %d, want %d", p.Held, size)
		}
		if in := pool(st, "connections").InUse; in != size {
			return fmt.Errorf("in_use %d, want team-a's %d alone: the system pod's are no project's", in, size)
		}
		return nil
	})
	r.RemovePod(t, sys)
}

// TestKubernetesDaemonNeverRefused runs the daemon inside a pod of
// namespace fairshare-system (a real containerd's pod, the daemon's process
// started in a cgroup below the pod's, where the chart's container would
// be; not the chart's image run through the CRI): its namespace is found
// from its own cgroup and is no project, so with a tenant holding the whole
// pool every request to its /metrics succeeds, and so does every request
// through its front (its listener and its connections to the upstream are
// the daemon's own sockets).
func TestKubernetesDaemonNeverRefused(t *testing.T) {
	r := crtest.Start(t)
	h := hold(t)
	mnt := testutil.Cgroup2Mount(t)
	self := r.RunPod(t, crtest.PodSpec{Namespace: "fairshare-system", Name: "fairshare-x1", HostNetwork: true})
	a := r.RunPod(t, crtest.PodSpec{Namespace: "team-a", Name: "a", HostNetwork: true})
	dir := filepath.Join(mnt, self.CgroupParent, "fairshare")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(dir) })
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "up") }))
	defer up.Close()
	const size = 12
	// limit_host_network_pods: the daemon's pod, in the host's network
	// namespace, is never refused because it is the daemon's, not because
	// it is there.
	n := kubeNode(t, r, fmt.Sprintf("pools: {connections: {size: %d, floor: 1}}\n"+
		"front: {listen: '127.0.0.1:0', upstream: %q, trusted_peers: ['127.0.0.1']}\nconnections: {limit_host_network_pods: true}\n", size, up.URL))
	n.cgroup = dir
	n.start()
	teamAFillsPool(t, r, n, a, h, size)
	cl := &http.Client{Timeout: 5 * time.Second}
	for i := range 20 {
		resp, err := cl.Get("http://" + n.r.Metrics + "/metrics")
		if err != nil {
			t.Fatalf("request %d to the daemon's /metrics with the pool full: %v", i, err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d: %s", i, resp.Status)
		}
	}
	// The front is the daemon's too: its listener takes every client, and
	// its connections to the upstream are never refused.
	for i := range 20 {
		req, err := http.NewRequest("GET", "http://"+n.r.Front+"/", nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Fairshare-Project", "ops")
		req.Close = i%2 == 0 // a new connection to the front every other request
		resp, err := cl.Do(req)
		if err != nil {
			t.Fatalf("request %d through the daemon's front with the pool full: %v", i, err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d through the front: %s", i, resp.Status)
		}
	}
	if p := pool(n.status(), "connections"); p.InUse != size || project(p, "fairshare-system").Held != 0 {
		t.Errorf("the daemon's own connections counted: %+v", p)
	}
}

// TestLapseAfterDaemonKilled: with lapse_after 3s, the daemon SIGKILLed,
// after 3s a project past the pool is admitted and counted, 'fairshare
// status' (from the pins) says enforcement lapsed, and a restarted daemon
// refuses again within a tick.
func TestLapseAfterDaemonKilled(t *testing.T) {
	n := newNode(t, "pools: {connections: {size: 2, floor: 1}}\nconnections: {lapse_after: 3s}\n")
	n.start()
	ln := sink(t)
	p := n.connectFrom("alpha", ln, 3)
	defer p.close()
	if p.connected != 2 || p.refused != 1 {
		t.Fatalf("enforced: %d connected, %d refused", p.connected, p.refused)
	}
	n.stop(syscall.SIGKILL)
	killed := time.Now()
	deadline := killed.Add(15 * time.Second)
	for {
		st := n.status()
		if lp := pool(st, "connections").Lapse; lp != nil && lp.Lapsed {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not lapsed 15s after the daemon was killed: %+v", pool(st, "connections").Lapse)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// The last heartbeat came at most a tick (1s) before the kill.
	if since := time.Since(killed); since < 2*time.Second {
		t.Fatalf("lapsed %s after the daemon was killed, well before lapse_after", since)
	}
	q := n.connectFrom("alpha", ln, 3)
	defer q.close()
	if q.connected != 3 {
		t.Fatalf("lapsed: %d connected, %d refused", q.connected, q.refused)
	}
	out, _, code := n.cli("status")
	if code != 0 || !strings.Contains(out, "ENFORCEMENT LAPSED") {
		t.Errorf("status while lapsed (%d):\n%s", code, out)
	}
	// A start that is refused (a busy metrics port) renews nothing: a
	// daemon that never gets through its start does not end the lapse.
	busy, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	if _, errOut, code := runCLI(t, "run", "--config", n.cfg, "--metrics-listen", busy.Addr().String()); code == 0 {
		t.Fatalf("a start on a busy metrics port went on: %s", errOut)
	}
	if lp := pool(n.status(), "connections").Lapse; lp == nil || !lp.Lapsed {
		t.Fatalf("a refused start renewed the heartbeat: %+v", lp)
	}
	c := pool(n.status(), "connections")
	if c.InUse != 5 || c.Lapse == nil || c.Lapse.Admitted != 3 {
		t.Errorf("lapsed admissions not counted: in_use %d, lapse %+v", c.InUse, c.Lapse)
	}
	n.start()
	r := n.connectFrom("alpha", ln, 1)
	defer r.close()
	if r.refused != 1 {
		t.Fatalf("a restarted daemon admitted %d past the pool", r.connected)
	}
	if lp := pool(n.status(), "connections").Lapse; lp == nil || lp.Lapsed {
		t.Errorf("after the restart: %+v", lp)
	}
}

// teamAFillsPool waits for team-a's pod a to be the daemon's one member,
// then has it connect past the pool of size and waits until it holds the
// whole pool.
func teamAFillsPool(t *testing.T, r *crtest.Runtime, n *node, a *crtest.Pod, h *holdListener, size int) {
	t.Helper()
	eventually(t, func() error {
		if m := n.members().Members; len(m) != 1 || m[0].Project != "team-a" {
			return fmt.Errorf("members %+v, want team-a's pod alone", m)
		}
		return nil
	})
	podConnect(t, r, a, "127.0.0.1", h.port(), size+2)
	eventually(t, func() error {
		if p := project(pool(n.status(), "connections"), "team-a"); p.Held != size {
			return fmt.Errorf("team-a holds %d, want the pool's %d", p.Held, size)
		}
		return nil
	})
}
