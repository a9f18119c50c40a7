// SPDX-License-Identifier: Apache-2.0

package deploy

import (
	"context"
	"crypto/rand"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	rt "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/crtest"
	"github.com/fairshare-dev/fairshare/loader"
)

// chartPodRequests is how many requests each of /healthz and /metrics gets
// with the pool held (a probe's every period for minutes, in a few
// seconds).
const chartPodRequests = 20

// TestChartPodNeverRefused runs the daemon as the chart's pod, as an
// operator's node would: its image built as deploy/Dockerfile builds it
// (TestDockerfileShape), imported into a private containerd 1.6, and the
// DaemonSet's pod, rendered from the chart (on private pin, state and run
// directories, runtime socket and metrics port), run through the CRI with
// the chart's security context, mounts and resources as kubelet would
// (kubelet_test.go). With a tenant pod (team-a) holding the whole
// connections pool, every request to /healthz and /metrics on the node's
// address, where kubelet's probes and Prometheus go, is answered 200; the
// daemon still refuses team-a past the pool and classifies a new team-b
// pod; `/fairshare status` exec'd in its container answers.
func TestChartPodNeverRefused(t *testing.T) {
	began := time.Now()
	r := crtest.Start(t) // skips without root, containerd or runc
	// The daemon makes its default projects root, <cgroup2>/fairshare, on
	// the node's cgroup file system, as a real node's daemon would: the
	// test removes it afterwards (after the pod: cleanups run last
	// first) if it was not there before (an empty directory only: rmdir
	// of a cgroup with children fails, and says so).
	if mnt, err := cgroup.FindMount(); err == nil {
		root := filepath.Join(mnt.Point, "fairshare")
		if _, err := os.Stat(root); os.IsNotExist(err) {
			t.Cleanup(func() {
				if err := os.Remove(root); err != nil && !os.IsNotExist(err) {
					t.Errorf("removing the daemon's projects root %s: %v", root, err)
				}
			})
		}
	}
	dir := t.TempDir()
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	pin := fmt.Sprintf("/sys/fs/bpf/fairshare-chartpod-%x", rnd)
	nodeName, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	ip := nodeIP()
	port := freePort(t, ip)
	runDir, stateDir := filepath.Join(dir, "run"), filepath.Join(dir, "state")
	// The node's bpffs and cgroup file systems, mounted with shared
	// propagation as systemd mounts everything on a node: the chart's
	// HostToContainer mounts need it (runc refuses a private one). Here
	// they are bound to the test's directory and made shared there, so
	// the host's own mounts are left as they are.
	bpffs, cgroupfs := sharedBind(t, "/sys/fs/bpf", filepath.Join(dir, "bpffs")), sharedBind(t, "/sys/fs/cgroup", filepath.Join(dir, "cgroup"))
	if err := os.MkdirAll("/run/netns", 0o755); err != nil { // as the chart's DirectoryOrCreate would
		t.Fatal(err)
	}
	netns := sharedBind(t, "/run/netns", filepath.Join(dir, "netns"))
	const size = 12
	values := map[string]any{
		"pinDir":     pin,
		"hostPaths":  map[string]any{"state": stateDir, "run": runDir, "bpffs": bpffs, "cgroup": cgroupfs, "netns": netns},
		"kubernetes": map[string]any{"runtimeSocket": r.Socket},
		"metrics":    map[string]any{"port": port},
		"pools":      map[string]any{"connections": map[string]any{"size": size, "floor": 1}},
	}
	const namespace = "fairshare-system"
	stream, err := Render(ChartDir, "fairshare", namespace, values)
	if err != nil {
		t.Fatal(err)
	}
	o := decode(t, stream)
	tpl := o.daemonSet.Spec.Template
	img := tpl.Spec.Containers[0].Image
	version := img[strings.LastIndex(img, ":")+1:] // the chart's appVersion
	built := time.Now()
	archive, _ := buildImage(t, dir, img, version)
	r.ImportImage(t, archive)
	t.Logf("the image %s: built and imported in %s", img, time.Since(built).Round(time.Millisecond))

	// Removed after the daemon's pod (cleanups run last first): the pins
	// outlive the pod by design.
	t.Cleanup(func() {
		if err := loader.Cleanup(pin); err != nil {
			t.Errorf("removing the pins %s: %v", pin, err)
		}
	})
	h := hold(t)
	a := r.RunPod(t, crtest.PodSpec{Namespace: "team-a", Name: "a", HostNetwork: true})

	k := &kubelet{t: t, node: nodeName, ip: ip, podDir: filepath.Join(dir, "pod"), configMaps: o.configMaps, cmDirs: map[string]string{}}
	uid := crtest.NewUID()
	sc := k.sandbox(tpl, namespace, "fairshare-"+uid[:5], uid)
	cc := k.container(tpl, sc)
	// On a cgroup v2 node (kubelet 1.35 wants one) containerd gives the
	// non-privileged container a cgroup namespace of its own; on a hybrid
	// host like CI's it does not, and the handler does as a v2 node's
	// would, so the daemon sees its own cgroup as "/" either way.
	d := r.RunPodConfig(t, sc, cc, crtest.CgroupnsHandler)
	exited := func() string {
		st, err := r.Client.ContainerStatus(context.Background(), &rt.ContainerStatusRequest{ContainerId: d.ContainerID})
		if err != nil || st.Status.State != rt.ContainerState_CONTAINER_EXITED {
			return ""
		}
		return fmt.Sprintf("the daemon's container exited %d (%s): %s\n%s", st.Status.ExitCode, st.Status.Reason, st.Status.Message, d.Log())
	}

	// The probes as kubelet runs them: an HTTP GET of the probe's path on
	// the pod's address (the node's) and its port, on a new connection
	// each time.
	c := tpl.Spec.Containers[0]
	probe := func(p *corev1.Probe) string {
		if p == nil || p.HTTPGet == nil {
			t.Fatalf("a probe that is not an HTTP GET: %+v", p)
		}
		pn := p.HTTPGet.Port.IntValue()
		for _, cp := range c.Ports {
			if cp.Name == p.HTTPGet.Port.String() {
				pn = int(cp.ContainerPort)
			}
		}
		return "http://" + net.JoinHostPort(ip, strconv.Itoa(pn)) + p.HTTPGet.Path
	}
	healthz := probe(c.StartupProbe)
	for _, p := range []*corev1.Probe{c.LivenessProbe, c.ReadinessProbe} {
		if probe(p) != healthz {
			t.Errorf("the probes go to %s and %s", healthz, probe(p))
		}
	}
	metrics := strings.TrimSuffix(healthz, "/healthz") + "/metrics"
	cl := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	get := func(url string) (int, error) {
		resp, err := cl.Get(url)
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	// Started: the startup probe's budget, polled faster.
	startBy := time.Now().Add(time.Duration(c.StartupProbe.PeriodSeconds*c.StartupProbe.FailureThreshold) * time.Second)
	for {
		code, err := get(healthz)
		if code == http.StatusOK {
			break
		}
		if why := exited(); why != "" {
			t.Fatal(why)
		}
		if time.Now().After(startBy) {
			t.Fatalf("%s did not answer 200 within the startup probe's budget: %d %v\n%s", healthz, code, err, d.Log())
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("the daemon's pod answered %s %s after RunPodSandbox", healthz, time.Since(d.Called).Round(time.Millisecond))

	ad := admin.NewClient(filepath.Join(runDir, "admin.sock"))
	status := func() admin.Status {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		st, err := ad.Status(ctx)
		if err != nil {
			t.Fatalf("the daemon's status through its admin socket: %v\n%s", err, d.Log())
		}
		return st
	}
	conns := func(st admin.Status) admin.Pool {
		for _, p := range st.Pools {
			if p.Name == "connections" {
				return p
			}
		}
		t.Fatalf("no connections pool: %+v", st.Pools)
		return admin.Pool{}
	}
	project := func(p admin.Pool, name string) admin.Project {
		for _, pr := range p.Projects {
			if pr.Project == name {
				return pr
			}
		}
		return admin.Project{}
	}
	member := func(st admin.Status, name string) bool {
		if st.Membership == nil {
			return false
		}
		for _, m := range st.Membership.Members {
			if m.Project == name {
				return true
			}
		}
		return false
	}
	eventually(t, d, func() error {
		if st := status(); !st.Kernel || !member(st, "team-a") {
			return fmt.Errorf("the kernel side is not on (%v), or team-a's pod is no member: %+v", st.Kernel, st.Membership)
		}
		return nil
	})

	// team-a takes the whole pool, and two more are refused.
	podConnect(t, r, a, "127.0.0.1", h.port(), size+2)
	eventually(t, d, func() error {
		if ta := project(conns(status()), "team-a"); ta.Held != size || ta.Refused != 2 || h.accepted.Load() != size {
			return fmt.Errorf("team-a holds %d, refused %d, %d accepted; want %d, 2, %d", ta.Held, ta.Refused, h.accepted.Load(), size, size)
		}
		return nil
	})
	held := time.Now()

	for _, url := range []string{healthz, metrics} {
		ok := 0
		var failed []string
		for range chartPodRequests {
			code, err := get(url)
			if code == http.StatusOK {
				ok++
			} else {
				failed = append(failed, fmt.Sprintf("%d %v", code, err))
			}
		}
		t.Logf("with team-a holding %d of %d: %s answered 200 to %d of %d", size, size, url, ok, chartPodRequests)
		if ok != chartPodRequests {
			t.Errorf("%s with the pool held: %d of %d answered 200; the others: %v", url, ok, chartPodRequests, failed)
		}
	}

	// Still enforcing: team-a past the pool is refused, a new pod of
	// team-b is classified.
	podConnect(t, r, a, "127.0.0.1", h.port(), 2)
	eventually(t, d, func() error {
		if ta := project(conns(status()), "team-a"); ta.Held != size || ta.Refused != 4 || h.accepted.Load() != size {
			return fmt.Errorf("team-a past the pool: holds %d, refused %d, %d accepted; want %d, 4, %d", ta.Held, ta.Refused, h.accepted.Load(), size, size)
		}
		return nil
	})
	b := r.RunPod(t, crtest.PodSpec{Namespace: "team-b", Name: "b", HostNetwork: true})
	eventually(t, d, func() error {
		if !member(status(), "team-b") {
			return fmt.Errorf("team-b's new pod %s is no member", b.Name)
		}
		return nil
	})

	// The daemon ran in a cgroup namespace of its own.
	own, err1 := os.Readlink(fmt.Sprintf("/proc/%d/ns/cgroup", d.Pid))
	host, err2 := os.Readlink("/proc/self/ns/cgroup")
	if err1 != nil || err2 != nil || own == host {
		t.Errorf("the daemon's cgroup namespace %s (%v), the host's %s (%v): want its own", own, err1, host, err2)
	}
	// The daemon's own pod is in no project, by construction.
	st := status()
	if member(st, namespace) || project(conns(st), namespace).Held != 0 {
		t.Errorf("the daemon's namespace %s is a project: %+v", namespace, st.Membership)
	}
	// The CLI in the image, as `kubectl exec ds/fairshare -- /fairshare status`.
	out, err := r.Exec(d, 20*time.Second, "/fairshare", "status", "--config", "/etc/fairshare/config.yaml")
	if err != nil || !strings.Contains(out, "team-a") || !strings.Contains(out, "connections") {
		t.Errorf("/fairshare status in the daemon's container: %v\n%s", err, out)
	}
	if out, err := r.Exec(d, 10*time.Second, "/fairshare", "version"); err != nil || strings.TrimSpace(out) != version {
		t.Errorf("/fairshare version in the image: %q %v, want the chart's appVersion %s", out, err, version)
	}
	if why := exited(); why != "" {
		t.Fatal(why)
	}
	log := d.Log()
	if !strings.Contains(log, "the daemon runs in a pod") || !strings.Contains(log, namespace) {
		t.Errorf("the daemon did not say it found its own pod in %s:\n%s", namespace, log)
	}
	if strings.Contains(log, `"level":"ERROR"`) {
		t.Errorf("the daemon logged errors:\n%s", log)
	}
	for line := range strings.Lines(log) {
		if strings.Contains(line, `"level":"WARN"`) {
			t.Logf("the daemon warned: %s", strings.TrimSpace(line))
		}
	}
	t.Logf("the pool held for %s; the test took %s", time.Since(held).Round(time.Millisecond), time.Since(began).Round(time.Millisecond))
}

// sharedBind binds the mount tree at src (with its submounts) at dst, made
// shared there, and unmounts it when the test ends; it returns dst.
func sharedBind(t *testing.T, src, dst string) string {
	t.Helper()
	if err := os.Mkdir(dst, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(src, dst, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		t.Fatalf("binding %s at %s: %v", src, dst, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dst, unix.MNT_DETACH); err != nil {
			t.Errorf("unmounting %s: %v", dst, err)
		}
	})
	if err := unix.Mount("", dst, "", unix.MS_SHARED|unix.MS_REC, ""); err != nil {
		t.Fatalf("making %s shared: %v", dst, err)
	}
	return dst
}

// eventually retries f for up to 20s, failing with its last error and the
// daemon's log.
func eventually(t *testing.T, d *crtest.Pod, f func() error) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%v\nthe daemon's log:\n%s", err, d.Log())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// nodeIP is the node's address as kubelet reports it (the first IPv4
// address of an interface that is up, not loopback); 127.0.0.1 on a
// machine with none.
func nodeIP() string {
	ifs, _ := net.Interfaces()
	for _, i := range ifs {
		if i.Flags&net.FlagUp == 0 || i.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, _ := i.Addrs()
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && n.IP.IsGlobalUnicast() {
				return n.IP.String()
			}
		}
	}
	return "127.0.0.1"
}

// freePort is a TCP port free on ip now.
func freePort(t *testing.T, ip string) int {
	ln, err := net.Listen("tcp4", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
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
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
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
