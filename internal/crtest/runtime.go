// SPDX-License-Identifier: Apache-2.0

package crtest

import (
	"bufio"
	"context"
	"crypto/rand"
	"debug/elf"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	rt "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// Busybox is the static busybox the image is built from (Debian's
// busybox-static).
const Busybox = "/bin/busybox"

// cniPlugins is where Debian's containernetworking-plugins puts the plugins.
const cniPlugins = "/usr/lib/cni"

// Runtime is a private containerd started for one test: its own root, state,
// socket and CNI configuration, so it neither sees nor disturbs a containerd
// the host may run. Everything it made is removed when the test ends.
type Runtime struct {
	// Socket is the CRI endpoint (a unix socket path).
	Socket string
	// Client speaks CRI v1 to it.
	Client rt.RuntimeServiceClient
	// PodNetwork says whether pods may have their own network namespace
	// (the CNI bridge plugin is installed); otherwise only host-network
	// pods can run.
	PodNetwork bool

	dir    string
	bin    string // where containerd, its shim and ctr are; "": PATH
	bridge string
	subnet *subnetClaim // the bridge's /24, held until stop
	conn   *grpc.ClientConn
	cfg    string // containerd's config file
	cmd    *exec.Cmd
	waited chan struct{} // closed when cmd has exited
	// parents are the cgroup parents of the pods run, removed at the end
	// in every hierarchy (containerd leaves them behind).
	parents map[string]bool
}

// Requirements names what a test runtime needs and is missing on this
// machine, or "" if it can run. Tests skip with it; `make test` prints it.
func Requirements() string {
	var missing []string
	for _, b := range []string{"containerd", "containerd-shim-runc-v2", "runc", "ctr"} {
		if _, err := exec.LookPath(b); err != nil {
			missing = append(missing, b)
		}
	}
	if !isStatic(Busybox) {
		missing = append(missing, "a static "+Busybox)
	}
	if len(missing) == 0 {
		return ""
	}
	return "missing " + strings.Join(missing, ", ") +
		" (Debian: apt-get install containerd runc busybox-static containernetworking-plugins)"
}

// isStatic reports whether path is an ELF executable without an interpreter.
func isStatic(path string) bool {
	f, err := elf.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return false
		}
	}
	return true
}

// Start starts a containerd for the test, with the busybox image imported,
// and stops it (every pod removed) when the test ends. It skips the test when
// not root or when containerd cannot run on this machine.
func Start(t testing.TB) *Runtime {
	t.Helper()
	return start(t, "")
}

// Containerd2Env names a directory holding a containerd 2.x build
// (containerd, containerd-shim-runc-v2, ctr) for StartContainerd2, e.g.
//
//	GOBIN=/tmp/ctrd2 go install github.com/containerd/containerd/v2/cmd/{containerd,containerd-shim-runc-v2,ctr}@v2.4.2
//	FAIRSHARE_CONTAINERD2=/tmp/ctrd2 go test ./kube ./cmd/fairshare -run Events
const Containerd2Env = "FAIRSHARE_CONTAINERD2"

// StartContainerd2 is Start with the containerd 2.x build in the directory
// $FAIRSHARE_CONTAINERD2 (Debian has containerd 1.6 only); it skips the
// test when that is not set. containerd 2 reads the same configuration
// (version 2, which it migrates).
func StartContainerd2(t testing.TB) *Runtime {
	t.Helper()
	dir := os.Getenv(Containerd2Env)
	if dir == "" {
		t.Skipf("no containerd 2.x: set %s to a directory with containerd, containerd-shim-runc-v2 and ctr v2", Containerd2Env)
	}
	for _, b := range []string{"containerd", "containerd-shim-runc-v2", "ctr"} {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			t.Fatalf("%s=%s: %v", Containerd2Env, dir, err)
		}
	}
	return start(t, dir)
}

// start starts a containerd: the one on PATH, or the one in bin (its shim
// and ctr too).
func start(t testing.TB, bin string) *Runtime {
	t.Helper()
	testutil.RequireRoot(t)
	if why := Requirements(); why != "" {
		t.Skipf("containerd cannot run here: %s", why)
	}
	// A short path: unix socket paths are limited to 108 bytes.
	dir, err := os.MkdirTemp("", "fsctrd-")
	if err != nil {
		t.Fatal(err)
	}
	r := &Runtime{dir: dir, Socket: filepath.Join(dir, "containerd.sock"), parents: map[string]bool{}, bin: bin}
	t.Cleanup(func() { r.stop(t) })

	cniDir := filepath.Join(dir, "cni")
	if err := os.Mkdir(cniDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(cniPlugins, "bridge")); err == nil {
		sweepBridges()
		if r.subnet, err = claimSubnet(); err != nil {
			t.Fatal(err)
		}
		r.PodNetwork = true
		r.bridge = "fsb" + randHex(4)
		if err := os.WriteFile(filepath.Join(cniDir, "10-fairshare-test.conflist"), []byte(r.cniConfig()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	runc, err := exec.LookPath("runc")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "runc-cgroupns"), []byte(fmt.Sprintf(cgroupnsWrapper, runc)), 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(cfg, []byte(r.config(cniDir)), 0o644); err != nil {
		t.Fatal(err)
	}
	r.cfg = cfg
	r.up(t)
	r.conn, err = grpc.NewClient("unix://"+r.Socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	r.Client = rt.NewRuntimeServiceClient(r.conn)
	r.waitUp(t)

	img := filepath.Join(dir, "image.tar")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	err = writeImage(f, Busybox)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatalf("building the test image: %v", err)
	}
	r.ImportImage(t, img)
	return r
}

// ImportImage imports an OCI image layout archive (its images named by
// their io.containerd.image.name annotations) into the runtime's k8s.io
// namespace, where the CRI finds images, as an operator would with
// `ctr -n k8s.io images import`. The images go with the runtime's root
// when the test ends.
func (r *Runtime) ImportImage(t testing.TB, archive string) {
	t.Helper()
	out, err := r.command("ctr", "-a", r.Socket, "-n", "k8s.io", "images", "import", "--all-platforms", archive).CombinedOutput()
	if err != nil {
		t.Fatalf("importing the image %s: %v\n%s", archive, err, out)
	}
}

// up starts containerd, its output appended to containerd.log.
func (r *Runtime) up(t testing.TB) {
	t.Helper()
	logf, err := os.OpenFile(filepath.Join(r.dir, "containerd.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	r.cmd = r.command("containerd", "--config", r.cfg)
	r.cmd.Stdout, r.cmd.Stderr = logf, logf
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if err := r.cmd.Start(); err != nil {
		t.Fatalf("starting containerd: %v", err)
	}
	r.waited = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) { _ = cmd.Wait(); close(done) }(r.cmd, r.waited)
}

// command is the named program of r's containerd build; containerd finds
// its shim on PATH, so bin goes first there.
func (r *Runtime) command(name string, args ...string) *exec.Cmd {
	if r.bin == "" {
		return exec.Command(name, args...)
	}
	cmd := exec.Command(filepath.Join(r.bin, name), args...)
	cmd.Env = append(os.Environ(), "PATH="+r.bin+":"+os.Getenv("PATH"))
	return cmd
}

// Version is the runtime's name and version, as the CRI gives them.
func (r *Runtime) Version(t testing.TB) string {
	t.Helper()
	v, err := r.Client.Version(context.Background(), &rt.VersionRequest{})
	if err != nil {
		t.Fatal(err)
	}
	return v.RuntimeName + " " + v.RuntimeVersion
}

// waitUp waits until containerd answers.
func (r *Runtime) waitUp(t testing.TB) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := r.Client.Version(ctx, &rt.VersionRequest{})
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("containerd did not answer within 30s: %v\n%s", err, r.Log())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Down stops containerd and leaves its pods running (their shims outlive
// it, as on a node where containerd restarts): the CRI socket is gone
// until Up.
func (r *Runtime) Down(t testing.TB) {
	t.Helper()
	r.halt()
	if err := os.Remove(r.Socket); err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
}

// Up starts containerd again after Down; it finds the pods it ran.
func (r *Runtime) Up(t testing.TB) {
	t.Helper()
	r.up(t)
	r.waitUp(t)
}

// halt stops the containerd process (not the shims): SIGTERM, SIGKILL
// after 10s.
func (r *Runtime) halt() {
	if r.cmd == nil || r.cmd.Process == nil {
		return
	}
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-r.waited:
	case <-time.After(10 * time.Second):
		_ = syscall.Kill(-r.cmd.Process.Pid, syscall.SIGKILL)
		<-r.waited
	}
	r.cmd = nil
}

// Log returns containerd's log so far, for failure messages.
func (r *Runtime) Log() string {
	b, _ := os.ReadFile(filepath.Join(r.dir, "containerd.log"))
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

func (r *Runtime) config(cniDir string) string {
	return fmt.Sprintf(`version = 2
root = %q
state = %q

[grpc]
  address = %q

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.%s]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.%s.options]
        SystemdCgroup = false
        BinaryName = %q
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %q
    conf_dir = %q
`, filepath.Join(r.dir, "root"), filepath.Join(r.dir, "state"), r.Socket, ImageName,
		CgroupnsHandler, CgroupnsHandler, filepath.Join(r.dir, "runc-cgroupns"), cniPlugins, cniDir)
}

// CgroupnsHandler is a runtime handler (RunPodSandboxRequest's) that gives
// every container of its pods a cgroup namespace of its own, as containerd
// does for a non-privileged container on a cgroup v2 host: on a hybrid
// host, where containerd does not, a pod run with it sees what it would
// see on a v2 node (its own cgroup as "/", the host's hierarchy, bind
// mounted, above its namespace's root). It is runc behind a wrapper that
// adds the namespace to the bundle's configuration at create.
const CgroupnsHandler = "runc-cgroupns"

// cgroupnsWrapper is the wrapper's script; %s is runc's path. containerd
// writes config.json compact, so the namespaces list reads
// "namespaces":[ where the cgroup one is added (unless present, as on a
// v2 host, or privileged: containerd adds none for privileged containers,
// and neither does the wrapper, keeping the two hosts alike).
const cgroupnsWrapper = `#!/bin/sh
bundle=""
prev=""
for a in "$@"; do
	[ "$prev" = "--bundle" ] && bundle="$a"
	prev="$a"
done
cfg="$bundle/config.json"
if [ -n "$bundle" ] && [ -f "$cfg" ] && ! grep -q '"type":"cgroup"' "$cfg" && grep -q '"maskedPaths"' "$cfg"; then
	sed -i 's/"namespaces":\[/"namespaces":[{"type":"cgroup"},/' "$cfg"
fi
exec %s "$@"
`

// cniConfig is a bridge network private to this runtime, on the subnet it
// claimed. No masquerading and no address outside the bridge: the pods
// reach the host and each other only.
func (r *Runtime) cniConfig() string {
	return fmt.Sprintf(`{
  "cniVersion": "0.4.0",
  "name": "fairshare-test",
  "plugins": [
    {"type": "bridge", "bridge": %q, "isGateway": true, "ipMasq": false,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": %q}]], "dataDir": %q}},
    {"type": "loopback"}
  ]
}
`, r.bridge, r.subnet.prefix.String(), filepath.Join(r.dir, "ipam"))
}

// NewUID returns a fresh pod uid, in the form kubelet's have.
func NewUID() string {
	u := randHex(16)
	return u[:8] + "-" + u[8:12] + "-" + u[12:16] + "-" + u[16:20] + "-" + u[20:]
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// PodSpec describes a pod to run.
type PodSpec struct {
	Namespace, Name string
	// UID defaults to a fresh one.
	UID    string
	Labels map[string]string
	// HostNetwork runs the pod in the host's network namespace.
	HostNetwork bool
	// CgroupParent defaults to kubelet's cgroupfs layout for a Burstable
	// pod: /kubepods/burstable/pod<uid>.
	CgroupParent string
	// Command of the pod's one container; default: sleep forever.
	Command []string
}

// Pod is a running pod with one container.
type Pod struct {
	ID, UID, Namespace, Name string
	ContainerID              string
	// Pid is the container's main process.
	Pid int
	// CgroupParent is the pod's cgroup, as given to the runtime.
	CgroupParent string
	// ContainerCgroup is the container's cgroup path (runtimeSpec
	// linux.cgroupsPath), relative to the cgroup2 mount.
	ContainerCgroup string
	// IP is the pod's address ("" for host-network pods).
	IP string
	// Called is when RunPodSandbox was called, Ready when it returned (the
	// sandbox ready: the earliest a pod lister can see it).
	Called, Ready time.Time

	logPath string // the container's log file
}

// Log returns the end of the container's log (its output, in the CRI's
// log format), for failure messages.
func (p *Pod) Log() string {
	b, err := os.ReadFile(p.logPath)
	if err != nil {
		return fmt.Sprintf("(no container log: %v)", err)
	}
	if len(b) > 8000 {
		b = b[len(b)-8000:]
	}
	return string(b)
}

// RunPod runs a pod sandbox with one started container, as kubelet would
// through the CRI, and removes it when the test ends (unless removed before).
func (r *Runtime) RunPod(t testing.TB, s PodSpec) *Pod {
	t.Helper()
	if s.UID == "" {
		s.UID = NewUID()
	}
	if s.CgroupParent == "" {
		s.CgroupParent = "/kubepods/burstable/pod" + s.UID
	}
	if len(s.Command) == 0 {
		s.Command = []string{"/bin/sleep", "infinity"}
	}
	if !s.HostNetwork && !r.PodNetwork {
		t.Skipf("pods with their own network namespace need the CNI bridge plugin in %s (Debian: containernetworking-plugins)", cniPlugins)
	}
	labels := map[string]string{
		"io.kubernetes.pod.namespace": s.Namespace,
		"io.kubernetes.pod.name":      s.Name,
		"io.kubernetes.pod.uid":       s.UID,
	}
	for k, v := range s.Labels {
		labels[k] = v
	}
	netMode := rt.NamespaceMode_POD
	if s.HostNetwork {
		netMode = rt.NamespaceMode_NODE
	}
	sc := &rt.PodSandboxConfig{
		Metadata: &rt.PodSandboxMetadata{Name: s.Name, Namespace: s.Namespace, Uid: s.UID},
		Labels:   labels,
		Linux: &rt.LinuxPodSandboxConfig{
			CgroupParent: s.CgroupParent,
			SecurityContext: &rt.LinuxSandboxSecurityContext{
				NamespaceOptions: &rt.NamespaceOption{Network: netMode},
			},
		},
		LogDirectory: filepath.Join(r.dir, "logs", s.UID),
	}
	cc := &rt.ContainerConfig{
		Metadata: &rt.ContainerMetadata{Name: "main"},
		Image:    &rt.ImageSpec{Image: ImageName},
		Command:  s.Command,
		Linux:    &rt.LinuxContainerConfig{},
		LogPath:  "main.log",
	}
	return r.RunPodConfig(t, sc, cc, "")
}

// RunPodConfig runs a pod sandbox with one started container from the CRI
// requests' configurations as the caller made them (a kubelet's
// translation of a pod spec, say), and removes it when the test ends
// (unless removed before). The sandbox's metadata and cgroup parent are
// required; a missing log directory is one of the runtime's. A container
// that fails to start fails the test with its log. handler is the
// runtime handler ("": the default, runc; or CgroupnsHandler).
func (r *Runtime) RunPodConfig(t testing.TB, sc *rt.PodSandboxConfig, cc *rt.ContainerConfig, handler string) *Pod {
	t.Helper()
	md := sc.GetMetadata()
	parent := sc.GetLinux().GetCgroupParent()
	if md == nil || parent == "" {
		t.Fatal("RunPodConfig: the sandbox needs its metadata and a cgroup parent")
	}
	if sc.LogDirectory == "" {
		sc.LogDirectory = filepath.Join(r.dir, "logs", md.Uid)
	}
	if err := os.MkdirAll(sc.LogDirectory, 0o755); err != nil {
		t.Fatal(err)
	}
	r.parents[parent] = true
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	called := time.Now()
	run, err := r.Client.RunPodSandbox(ctx, &rt.RunPodSandboxRequest{Config: sc, RuntimeHandler: handler})
	if err != nil {
		t.Fatalf("RunPodSandbox %s/%s: %v\n%s", md.Namespace, md.Name, err, r.Log())
	}
	p := &Pod{ID: run.PodSandboxId, UID: md.Uid, Namespace: md.Namespace, Name: md.Name, CgroupParent: parent,
		Called: called, Ready: time.Now()}
	t.Cleanup(func() { r.RemovePod(t, p) })
	cr, err := r.Client.CreateContainer(ctx, &rt.CreateContainerRequest{PodSandboxId: p.ID, Config: cc, SandboxConfig: sc})
	if err != nil {
		t.Fatalf("CreateContainer in %s/%s: %v\n%s", md.Namespace, md.Name, err, r.Log())
	}
	p.ContainerID = cr.ContainerId
	p.logPath = filepath.Join(sc.LogDirectory, cc.LogPath)
	if _, err := r.Client.StartContainer(ctx, &rt.StartContainerRequest{ContainerId: p.ContainerID}); err != nil {
		t.Fatalf("StartContainer in %s/%s: %v\n%s", md.Namespace, md.Name, err, p.Log())
	}
	st, err := r.Client.ContainerStatus(ctx, &rt.ContainerStatusRequest{ContainerId: p.ContainerID, Verbose: true})
	if err != nil {
		t.Fatal(err)
	}
	var info struct {
		Pid         int `json:"pid"`
		RuntimeSpec struct {
			Linux struct {
				CgroupsPath string `json:"cgroupsPath"`
			} `json:"linux"`
		} `json:"runtimeSpec"`
	}
	if err := json.Unmarshal([]byte(st.Info["info"]), &info); err != nil {
		t.Fatalf("container status info: %v", err)
	}
	p.Pid, p.ContainerCgroup = info.Pid, info.RuntimeSpec.Linux.CgroupsPath
	ps, err := r.Client.PodSandboxStatus(ctx, &rt.PodSandboxStatusRequest{PodSandboxId: p.ID})
	if err != nil {
		t.Fatal(err)
	}
	if n := ps.GetStatus().GetNetwork(); n != nil {
		p.IP = n.Ip
	}
	return p
}

// Exec runs cmd in the pod's container and returns its output; a non-zero
// exit is an error carrying stderr.
func (r *Runtime) Exec(p *Pod, timeout time.Duration, cmd ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout+5*time.Second)
	defer cancel()
	res, err := r.Client.ExecSync(ctx, &rt.ExecSyncRequest{ContainerId: p.ContainerID, Cmd: cmd, Timeout: int64(timeout / time.Second)})
	if err != nil {
		return "", err
	}
	if res.ExitCode != 0 {
		return string(res.Stdout), fmt.Errorf("%s exited %d: %s", strings.Join(cmd, " "), res.ExitCode, res.Stderr)
	}
	return string(res.Stdout), nil
}

// RemovePod stops and removes the pod and the cgroups containerd leaves
// behind. Removing a removed pod does nothing.
func (r *Runtime) RemovePod(t testing.TB, p *Pod) {
	t.Helper()
	if r.cmd == nil {
		r.Up(t) // a test that took it down and failed before Up
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := r.Client.StopPodSandbox(ctx, &rt.StopPodSandboxRequest{PodSandboxId: p.ID}); err != nil && !notFound(err) {
		t.Errorf("StopPodSandbox %s: %v", p.ID, err)
	}
	if _, err := r.Client.RemovePodSandbox(ctx, &rt.RemovePodSandboxRequest{PodSandboxId: p.ID}); err != nil && !notFound(err) {
		t.Errorf("RemovePodSandbox %s: %v", p.ID, err)
	}
	removeCgroupEverywhere(t, p.CgroupParent)
}

func notFound(err error) bool {
	return err != nil && strings.Contains(err.Error(), "not found")
}

// stop removes every pod, stops containerd and its shims, unmounts what
// they left mounted below the runtime's directory and removes it, the CNI
// bridge and the cgroup parents.
func (r *Runtime) stop(t testing.TB) {
	if r.cmd == nil && r.Client != nil {
		r.up(t)
		r.waitUp(t)
	}
	if r.Client != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		if l, err := r.Client.ListPodSandbox(ctx, &rt.ListPodSandboxRequest{}); err == nil {
			for _, s := range l.Items {
				_, _ = r.Client.StopPodSandbox(ctx, &rt.StopPodSandboxRequest{PodSandboxId: s.Id})
				_, _ = r.Client.RemovePodSandbox(ctx, &rt.RemovePodSandboxRequest{PodSandboxId: s.Id})
			}
		}
		cancel()
	}
	if r.conn != nil {
		r.conn.Close()
	}
	r.halt()
	killShims(r.Socket)
	unmountBelow(r.dir)
	for parent := range r.parents {
		removeCgroupEverywhere(t, parent)
	}
	if r.bridge != "" {
		_ = exec.Command("ip", "link", "del", r.bridge).Run()
	}
	r.subnet.release()
	if err := os.RemoveAll(r.dir); err != nil {
		t.Errorf("removing the runtime's directory: %v", err)
	}
}

// killShims kills the runc shims serving the containerd at socket (a shim
// outlives its containerd by design).
func killShims(socket string) {
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, c := range procs {
		b, err := os.ReadFile(c)
		if err != nil || !strings.Contains(string(b), "containerd-shim") || !strings.Contains(string(b), socket) {
			continue
		}
		var pid int
		if _, err := fmt.Sscanf(filepath.Base(filepath.Dir(c)), "%d", &pid); err == nil {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// unmountBelow lazily unmounts every mount point below dir, deepest first.
func unmountBelow(dir string) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return
	}
	defer f.Close()
	var points []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && strings.HasPrefix(fields[4], dir+"/") {
			points = append(points, fields[4])
		}
	}
	sort.Slice(points, func(i, j int) bool { return len(points[i]) > len(points[j]) })
	for _, p := range points {
		_ = unix.Unmount(p, unix.MNT_DETACH)
	}
}

// cgroupMounts lists the mount points of every cgroup hierarchy (v2 and,
// on a hybrid host, each v1 one): runc makes a pod's cgroup in all of them.
func cgroupMounts() []string {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	var out []string
	for line := range strings.Lines(string(b)) {
		pre, post, ok := strings.Cut(line, " - ")
		if !ok {
			continue
		}
		if f := strings.Fields(post); len(f) > 0 && (f[0] == "cgroup2" || f[0] == "cgroup") {
			if pf := strings.Fields(pre); len(pf) >= 5 {
				out = append(out, pf[4])
			}
		}
	}
	return out
}

// removeCgroupEverywhere removes the cgroup path (cgroupfs form, e.g.
// /kubepods/burstable/pod<uid>) in every hierarchy, then its parents while
// they are empty.
func removeCgroupEverywhere(t testing.TB, path string) {
	if path == "" || path == "/" {
		return
	}
	for _, m := range cgroupMounts() {
		dir := filepath.Join(m, path)
		if _, err := os.Stat(dir); err == nil {
			testutil.RemoveCgroup(t, dir)
		}
		for p := filepath.Dir(path); p != "/" && p != "."; p = filepath.Dir(p) {
			if err := unix.Rmdir(filepath.Join(m, p)); err != nil && !errors.Is(err, unix.ENOENT) {
				break
			}
		}
	}
}
