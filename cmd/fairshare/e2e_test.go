// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/daemon"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/loader"
	"github.com/fairshare-dev/fairshare/policy"
)

// binary is the fairshare binary built once by TestMain.
var binary string

// With connectEnv set to "ADDR N", the test binary is a project's process: it
// opens N connections to ADDR, prints "ok <connected> <refused>", and holds
// them until its stdin closes.
const connectEnv = "FAIRSHARE_E2E_CONNECT"

func TestMain(m *testing.M) {
	if os.Getenv(panicEnv) != "" {
		panic("a daemon's bug")
	}
	if spec := os.Getenv(connectEnv); spec != "" {
		connectHelper(spec)
		return
	}
	if spec := os.Getenv(floodEnv); spec != "" {
		floodHelper(spec)
		return
	}
	if spec := os.Getenv(churnEnv); spec != "" {
		churnHelper(spec)
		return
	}
	if addr := os.Getenv(rateEnv); addr != "" {
		rateHelper(addr)
		return
	}
	if spec := os.Getenv(waitFloodEnv); spec != "" {
		waitFloodHelper(spec)
		return
	}
	if os.Getenv(listenEnv) != "" {
		listenHelper()
		return
	}
	if addr := os.Getenv(podListenEnv); addr != "" {
		podListenHelper(addr)
		return
	}
	if sock := os.Getenv(permitEnv); sock != "" {
		permitHelper(sock)
		return
	}
	dir, err := os.MkdirTemp("", "fairshare-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "fairshare")
	// Built as deploy/Dockerfile builds the image's binary (static,
	// trimmed, stripped): the binary the tests run is the one shipped, and
	// deploy's TestChartPodNeverRefused, which builds it the same way,
	// finds its packages compiled.
	build := exec.Command("go", "build", "-trimpath", "-ldflags", "-s -w -X main.version=e2e", "-o", binary, ".")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := build.CombinedOutput()
	if err != nil {
		fmt.Fprintf(os.Stderr, "building fairshare: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func connectHelper(spec string) {
	addr, nStr, _ := strings.Cut(spec, " ")
	n, _ := strconv.Atoi(nStr)
	var conns []net.Conn
	refused := 0
	for range n {
		c, err := net.DialTimeout("tcp4", addr, 5*time.Second)
		if errors.Is(err, syscall.ECONNREFUSED) {
			refused++
			continue
		}
		if err != nil {
			fmt.Println("error", err)
			os.Exit(1)
		}
		conns = append(conns, c)
	}
	fmt.Printf("ok %d %d\n", len(conns), refused)
	io.Copy(io.Discard, os.Stdin) // hold until the test closes stdin
	for _, c := range conns {
		c.Close()
	}
	os.Exit(0)
}

// runCLI runs the binary and returns stdout, stderr and the exit code.
func runCLI(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.Env = cleanEnv()
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("running %v: %v", args, err)
	}
	return stdout.String(), stderr.String(), code
}

// cleanEnv drops FAIRSHARE_* so the host's environment cannot steer a test.
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "FAIRSHARE_") {
			env = append(env, kv)
		}
	}
	return env
}

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: BPF, cgroups and the admin socket")
	}
}

// node is one test's daemon environment.
type node struct {
	t                                       *testing.T
	dir, state, sock, pin, root, cfg, ready string
	cmd                                     *exec.Cmd
	done                                    chan error
	log                                     *testutil.Buffer
	r                                       daemon.Ready
	// prefix, if set, runs the daemon through another command (prlimit).
	prefix []string
	// args are more arguments of 'run' (the chart's --detach-on-exit).
	args []string
	// cgroup, if set, is the cgroup the daemon is started in (a pod's,
	// say); "" is the test's own.
	cgroup string
}

func newNode(t *testing.T, poolYAML string) *node {
	needRoot(t)
	mnt := testutil.Cgroup2Mount(t)
	dir := t.TempDir()
	// The temporary directory's parent is named after the test with a
	// random suffix (its own name is 001, 002...): pins and cgroups must
	// not collide with another test's, or another run's on this machine.
	unique := "fairshare-e2e-" + filepath.Base(filepath.Dir(dir)) + "-" + filepath.Base(dir)
	n := &node{t: t, dir: dir, state: filepath.Join(dir, "state"), sock: filepath.Join(dir, "run", "admin.sock"),
		pin: filepath.Join("/sys/fs/bpf", unique), root: filepath.Join(mnt, unique),
		cfg: filepath.Join(dir, "fairshare.yaml"), ready: filepath.Join(dir, "ready.json")}
	cfg := fmt.Sprintf("state_dir: %s\nadmin_socket: %s\npin_dir: %s\nprojects_root: %s\npermits: {socket: %s}\nmetrics: {listen: '127.0.0.1:0'}\n%s",
		n.state, n.sock, n.pin, n.root, filepath.Join(dir, "run", "permits.sock"), poolYAML)
	if err := os.WriteFile(n.cfg, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		n.stop(syscall.SIGKILL)
		if err := loader.Cleanup(n.pin); err != nil {
			t.Errorf("cleanup of %s: %v", n.pin, err)
		}
		// Projects first, then the root; their processes are gone by now.
		entries, _ := os.ReadDir(n.root)
		for _, e := range entries {
			if e.IsDir() {
				os.Remove(filepath.Join(n.root, e.Name()))
			}
		}
		os.Remove(n.root)
	})
	return n
}

func (n *node) start() {
	t := n.t
	t.Helper()
	os.Remove(n.ready)
	n.log = &testutil.Buffer{}
	args := append(append([]string{}, n.prefix...), binary, "run", "--config", n.cfg, "--ready-file", n.ready, "--log-format", "json")
	args = append(args, n.args...)
	n.cmd = exec.Command(args[0], args[1:]...)
	n.cmd.Env = cleanEnv()
	n.cmd.Stdout, n.cmd.Stderr = n.log, n.log
	if n.cgroup != "" {
		testutil.InCgroup(t, n.cmd, n.cgroup)
	}
	if err := n.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	n.done = make(chan error, 1)
	go func(cmd *exec.Cmd, done chan error) { done <- cmd.Wait() }(n.cmd, n.done)
	deadline := time.Now().Add(30 * time.Second)
	for {
		if raw, err := os.ReadFile(n.ready); err == nil {
			if err := json.Unmarshal(raw, &n.r); err != nil {
				t.Fatal(err)
			}
			return
		}
		select {
		case err := <-n.done:
			n.cmd = nil
			t.Fatalf("daemon exited before it was ready: %v\n%s", err, n.log)
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("daemon not ready after 30s:\n%s", n.log)
		}
	}
}

// stop sends sig to the daemon and waits for it to exit.
func (n *node) stop(sig syscall.Signal) error {
	if n.cmd == nil {
		return nil
	}
	n.cmd.Process.Signal(sig)
	var err error
	select {
	case err = <-n.done:
	case <-time.After(20 * time.Second):
		n.cmd.Process.Kill()
		err = <-n.done
		n.t.Errorf("daemon ignored %v for 20s", sig)
	}
	n.cmd = nil
	return err
}

// waitExit waits for the daemon to exit by itself and returns its exit
// status.
func (n *node) waitExit() int {
	n.t.Helper()
	select {
	case err := <-n.done:
		n.cmd = nil
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode()
		}
		if err != nil {
			n.t.Fatalf("waiting for the daemon: %v", err)
		}
		return 0
	case <-time.After(20 * time.Second):
		n.t.Fatalf("the daemon still runs after 20s:\n%s", n.log)
		return -1
	}
}

func (n *node) cli(args ...string) (string, string, int) {
	n.t.Helper()
	words := 1 // the command's words come before its flags
	if args[0] == "policy" {
		words = 2
	}
	return runCLI(n.t, append(args[:words:words], append([]string{"--config", n.cfg}, args[words:]...)...)...)
}

func (n *node) status() admin.Status {
	n.t.Helper()
	out, errOut, code := runCLI(n.t, "status", "--config", n.cfg, "--json")
	if code != 0 {
		n.t.Fatalf("status: %d %s", code, errOut)
	}
	var st admin.Status
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		n.t.Fatalf("status --json: %v\n%s", err, out)
	}
	return st
}

func (n *node) metrics() string {
	n.t.Helper()
	resp, err := http.Get("http://" + n.r.Metrics + "/metrics")
	if err != nil {
		n.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

func pool(st admin.Status, name string) admin.Pool {
	for _, p := range st.Pools {
		if p.Name == name {
			return p
		}
	}
	return admin.Pool{}
}

func project(p admin.Pool, name string) admin.Project {
	for _, pr := range p.Projects {
		if pr.Project == name {
			return pr
		}
	}
	return admin.Project{}
}

// projectProc is a helper process inside a project's cgroup holding
// connections.
type projectProc struct {
	cmd                *exec.Cmd
	stdin              io.WriteCloser
	connected, refused int
}

// connectFrom starts a process in project (a cgroup under the node's root,
// created if missing) that opens n connections to addr.
// mkProject makes the project's cgroup below the projects root and, with
// the daemon running, waits until the daemon has made it (or a cgroup above
// it) a member: the
// kernel counts a cgroup once the daemon registered it, within a tick of
// the mkdir (at once with inotify), not at the mkdir itself.
func (n *node) mkProject(project string) string {
	t := n.t
	t.Helper()
	cg := filepath.Join(n.root, project)
	if err := os.MkdirAll(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	if n.cmd == nil {
		return cg
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		for _, m := range n.members().Members {
			if m.Cgroup == cg || strings.HasPrefix(cg, m.Cgroup+"/") {
				return cg
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s is not a member after 10s: %+v", cg, n.members())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (n *node) connectFrom(project, addr string, count int) *projectProc {
	t := n.t
	t.Helper()
	cg := n.mkProject(project)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self, "-test.run=^$")
	cmd.Env = append(cleanEnv(), connectEnv+"="+addr+" "+strconv.Itoa(count))
	stdin, out := testutil.Pipes(t, cmd)
	testutil.StartInCgroup(t, cmd, cg)
	p := &projectProc{cmd: cmd, stdin: stdin}
	line, err := bufio.NewReader(out).ReadString('\n')
	if _, serr := fmt.Sscanf(line, "ok %d %d", &p.connected, &p.refused); err != nil || serr != nil {
		t.Fatalf("project helper said %q (%v)", line, err)
	}
	return p
}

func (p *projectProc) close() {
	p.stdin.Close()
	p.cmd.Wait()
}

// eventually retries f until it returns nil or 10s pass.
func eventually(t *testing.T, f func() error) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestEndToEnd(t *testing.T) {
	n := newNode(t, "pools: {connections: {size: 4}}\n")
	n.start()
	if !n.r.Kernel {
		t.Fatal("the daemon runs without BPF")
	}

	// A policy through the CLI, which goes through the admin API.
	if out, errOut, code := n.cli("policy", "set", "--tier", "pro", "--shares", "3", "--requests-per-sec", "50", "alpha"); code != 0 {
		t.Fatalf("policy set: %d %s %s", code, out, errOut)
	} else if strings.Contains(errOut, "no daemon answers") {
		t.Errorf("policy set through the daemon noted it was only stored: %q", errOut)
	}

	addr := sink(t)

	// Alone on the node, alpha gets the whole pool of 4 and is refused past it.
	a := n.connectFrom("alpha", addr, 6)
	if a.connected != 4 || a.refused != 2 {
		t.Fatalf("alpha connected %d, refused %d; want 4 and 2 with a pool of 4", a.connected, a.refused)
	}
	eventually(t, func() error {
		st := n.status()
		c := pool(st, "connections")
		pr := project(c, "alpha")
		if c.Size != 4 || c.InUse != 4 || pr.Held != 4 || pr.Refused != 2 {
			return fmt.Errorf("status: pool %+v", c)
		}
		return nil
	})
	m := n.metrics()
	for _, want := range []string{
		`fairshare_project_permits_held{pool="connections",project="alpha"} 4`,
		`fairshare_project_refused_total{pool="connections",project="alpha"} 2`,
		`fairshare_pool_size{pool="connections"} 4`,
		`fairshare_kernel_enforcement 1`,
	} {
		if !strings.Contains(m, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	st := n.status()
	if len(st.Rates) != 1 || st.Rates[0].Project != "alpha" || st.Rates[0].RequestsPerSec != 50 {
		t.Errorf("policy not applied to the rates: %+v", st.Rates)
	}

	// SIGKILL the daemon: enforcement stays pinned (for the members it had
	// registered), then a restart finds the policy and the counts where
	// they were.
	n.mkProject("beta")
	n.stop(syscall.SIGKILL)
	b := n.connectFrom("beta", addr, 1)
	if b.connected != 0 || b.refused != 1 {
		t.Errorf("with the daemon dead and the pool full, beta connected %d refused %d; want refused", b.connected, b.refused)
	}
	b.close()
	n.start()
	out, _, code := n.cli("policy", "get", "--json", "alpha")
	var e policy.Entry
	if code != 0 || json.Unmarshal([]byte(out), &e) != nil || e.Policy != (policy.Policy{Tier: "pro", Shares: 3, RequestsPerSec: 50}) {
		t.Errorf("after restart: policy get = %d %q", code, out)
	}
	st = n.status()
	if c := pool(st, "connections"); c.InUse != 4 || project(c, "alpha").Held != 4 {
		t.Errorf("after restart the connections pool is %+v", c)
	}
	if len(st.Rates) != 1 || st.Rates[0].RequestsPerSec != 50 {
		t.Errorf("after restart the rates are %+v", st.Rates)
	}

	// Closing alpha's connections frees its permits.
	a.close()
	eventually(t, func() error {
		if c := pool(n.status(), "connections"); c.InUse != 0 {
			return fmt.Errorf("after alpha closed, in_use = %d", c.InUse)
		}
		return nil
	})

	// A clean stop leaves the programs pinned; cleanup removes them.
	if err := n.stop(syscall.SIGTERM); err != nil {
		t.Errorf("SIGTERM: %v\n%s", err, n.log)
	}
	if _, err := os.Stat(n.pin); err != nil {
		t.Errorf("pins gone after a plain stop: %v", err)
	}
	if out, errOut, code := runCLI(t, "cleanup", "--pin-dir", n.pin); code != 0 {
		t.Errorf("cleanup: %d %s %s", code, out, errOut)
	}
	if _, err := os.Stat(n.pin); !os.IsNotExist(err) {
		t.Errorf("pins still there after cleanup: %v", err)
	}
	if strings.Contains(n.log.String(), `"level":"ERROR"`) {
		t.Errorf("the daemon logged errors:\n%s", n.log)
	}
}

// The HTTP front runs inside the daemon with the requests pool, the rate
// buckets and the scheduler the admin API feeds; /metrics carries both the
// daemon's collector and the front's.
func TestFrontThroughDaemon(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Fairshare-Work-Units", "2")
		io.WriteString(w, "hello")
	}))
	t.Cleanup(up.Close)
	// The test is its own edge on loopback: it trusts 127.0.0.1 to name the
	// project. The unix socket trusts nobody.
	sock := filepath.Join(t.TempDir(), "front.sock")
	n := newNode(t, fmt.Sprintf("front: {listen: '127.0.0.1:0', socket: %q, upstream: %q, trusted_peers: ['127.0.0.1'], exempt: {projects: [probe]}}\n", sock, up.URL))
	n.start()
	// The test process is outside the projects root: over the socket its
	// header is a claim from an untrusted peer.
	overSock := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	req, _ := http.NewRequest("GET", "http://front/x", nil)
	req.Header.Set("Fairshare-Project", "alpha")
	if resp, err := overSock.Do(req); err != nil {
		t.Fatal(err)
	} else {
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusForbidden {
			t.Errorf("header from an untrusted unix peer: %d, want 403", resp.StatusCode)
		}
	}
	req, _ = http.NewRequest("GET", "http://"+n.r.Front+"/x", nil)
	req.Header.Set("Fairshare-Project", "probe")
	if resp, err := http.DefaultClient.Do(req); err != nil {
		t.Fatal(err)
	} else {
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || resp.Header.Get("Fairshare-Class") != "exempt" {
			t.Errorf("exempt probe: %d class %q", resp.StatusCode, resp.Header.Get("Fairshare-Class"))
		}
	}
	if _, errOut, code := n.cli("policy", "set", "--tier", "pro", "--requests-per-sec", "2", "alpha"); code != 0 {
		t.Fatalf("policy set: %s", errOut)
	}
	codes := map[int]int{}
	for range 5 {
		req, _ := http.NewRequest("GET", "http://"+n.r.Front+"/x", nil)
		req.Header.Set("Fairshare-Project", "alpha")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		codes[resp.StatusCode]++
		if resp.StatusCode == 200 && resp.Header.Get("Fairshare-Class") == "" {
			t.Error("a proxied answer lacks Fairshare-Class")
		}
	}
	// A burst of one second's worth at 2/s: 2 pass, the rest are refused.
	if codes[200] != 2 || codes[429] != 3 {
		t.Errorf("answers %v; want 2 x 200 and 3 x 429 at 2 requests/s", codes)
	}
	st := n.status()
	if r := pool(st, "requests"); project(r, "alpha").Admitted != 2 {
		t.Errorf("requests pool: %+v", r)
	}
	if len(st.Rates) != 1 || st.Rates[0].Limited != 3 {
		t.Errorf("rates: %+v", st.Rates)
	}
	if s := st.Scheduler; s == nil || s.Dispatched["P1"]+s.Dispatched["P2"]+s.Dispatched["P3"] != 2 || len(s.Participants) != 1 || s.Participants[0].Tier != "pro" {
		t.Errorf("scheduler: %+v", st.Scheduler)
	}
	m := n.metrics()
	for _, want := range []string{`fairshare_project_rate_limited_total{project="alpha"} 3`, `fairshare_scheduler_wait_seconds_count 2`,
		`fairshare_front_requests_total{outcome="exempt",project="probe"} 1`, `fairshare_front_untrusted_requests_total 1`,
		`fairshare_front_exempt_requests_in_flight 0`} {
		if !strings.Contains(m, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
}
