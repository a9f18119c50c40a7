// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/pools"
	"github.com/fairshare-dev/fairshare/scheduler"
	"net/http/httptest"
)

// loadResult is one closed-loop load run.
type loadResult struct {
	rps      float64
	p50, p99 time.Duration
	errors   int
	genCPU   time.Duration // the generator's own CPU, when it is a process of its own (wrk); 0 otherwise
}

// loader is a closed-loop load generator for one target: conc clients, each
// sending the next request as soon as the previous answer is read, over
// keep-alive connections kept between runs. It accumulates over runs, so
// targets can take turns in short slices and share whatever else the
// machine is doing at the time.
type loader struct {
	url    string
	conc   int
	client *http.Client

	mu      sync.Mutex // guards the fields below
	lats    []time.Duration
	errs    int
	elapsed time.Duration
}

func newLoader(url string, conc int) *loader {
	tr := &http.Transport{MaxIdleConnsPerHost: conc, MaxConnsPerHost: conc, DisableCompression: true}
	return &loader{url: url, conc: conc, client: &http.Client{Transport: tr}}
}

func (l *loader) close() { l.client.CloseIdleConnections() }

// run loads the target for dur.
func (l *loader) run(dur time.Duration) {
	var wg sync.WaitGroup
	start := time.Now()
	deadline := start.Add(dur)
	for range l.conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			mine := make([]time.Duration, 0, 1024)
			bad := 0
			for time.Now().Before(deadline) {
				req := benchRequest(l.url)
				t0 := time.Now()
				resp, err := l.client.Do(req)
				if err != nil {
					bad++
					continue
				}
				_, err = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if err != nil || resp.StatusCode != http.StatusOK {
					bad++
					continue
				}
				mine = append(mine, time.Since(t0))
			}
			l.mu.Lock()
			l.lats = append(l.lats, mine...)
			l.errs += bad
			l.mu.Unlock()
		}()
	}
	wg.Wait()
	l.mu.Lock()
	l.elapsed += time.Since(start)
	l.mu.Unlock()
}

// result summarises every run so far and starts afresh.
func (l *loader) result() loadResult {
	l.mu.Lock()
	defer l.mu.Unlock()
	slices.Sort(l.lats)
	r := loadResult{rps: float64(len(l.lats)) / l.elapsed.Seconds(), errors: l.errs}
	if len(l.lats) > 0 {
		r.p50 = l.lats[len(l.lats)/2]
		r.p99 = l.lats[min(len(l.lats)-1, len(l.lats)*99/100)]
	}
	l.lats, l.errs, l.elapsed = l.lats[:0], 0, 0
	return r
}

// benchUpstream starts the upstream of the benchmark in its own process (the
// test binary again, see TestMain), so that its CPU time per request can be
// read behind each target, and returns its URL and pid.
func benchUpstream(b *testing.B, service time.Duration) (string, int) {
	b.Helper()
	return benchChild(b, os.Args[0], benchUpstreamEnv+"="+service.String())
}

// benchBodyEnv, set to a size in bytes, makes the benchmark's generators
// send POSTs with a body of that size instead of GETs: the path of requests
// with bodies (FAIRSHARE_BENCH_BODY=1024).
const benchBodyEnv = "FAIRSHARE_BENCH_BODY"

// benchBodySize is the request body size of the generated load: 0 for GETs.
func benchBodySize() int {
	n, _ := strconv.Atoi(os.Getenv(benchBodyEnv))
	return max(0, n)
}

// benchRequest is one request of the generated load (see benchBodyEnv).
func benchRequest(url string) *http.Request {
	var req *http.Request
	if n := benchBodySize(); n > 0 {
		req, _ = http.NewRequest(http.MethodPost, url, bytes.NewReader(bytes.Repeat([]byte("b"), n)))
	} else {
		req, _ = http.NewRequest(http.MethodGet, url, nil)
	}
	req.Header.Set(DefaultProjectHeader, "bench")
	return req
}

// serveBenchUpstream reads the request body and serves a two-byte one after service (0 = at once),
// prints its address and serves until stdin closes.
func serveBenchUpstream(service time.Duration) error {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	fmt.Println(l.Addr().String())
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := io.Copy(io.Discard, r.Body); err != nil {
			return
		}
		if service > 0 {
			time.Sleep(service)
		}
		_, _ = io.WriteString(w, "ok")
	})}
	go func() { _, _ = io.Copy(io.Discard, os.Stdin); _ = srv.Close() }()
	if err := srv.Serve(l); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// benchUpstreamEnv makes the test binary serve as the benchmark's upstream,
// its value the service time.
const benchUpstreamEnv = "FAIRSHARE_BENCH_UPSTREAM"

// benchRoleEnv makes the test binary serve as a front process for the
// benchmark (see TestMain): the front runs in its own process, as nginx
// does, so neither shares the load generator's Go runtime.
const benchRoleEnv = "FAIRSHARE_BENCH_FRONT"

// benchProfileEnv names a file prefix: each front process of the benchmark
// writes its CPU profile to PREFIX.front and PREFIX.nosched.
const benchProfileEnv = "FAIRSHARE_BENCH_FRONT_CPUPROFILE"

// benchBaselineEnv names another build of this test binary (go test -c of an
// earlier commit) whose full front joins the benchmark as target "baseline",
// so a change is measured before and after in one run, in the same turns
// (on its fast path with FAIRSHARE_BENCH_BASELINE_FAST=1).
const benchBaselineEnv = "FAIRSHARE_BENCH_BASELINE"

// benchFastLoopsEnv adds targets to BenchmarkOverhead: the fast path with
// each of the given numbers of loops (e.g. "1 2": targets fast1, fast2).
const benchFastLoopsEnv = "FAIRSHARE_BENCH_FAST_LOOPS"

// benchNginxWorkersEnv adds targets to BenchmarkOverhead: nginx with each of
// the given numbers of worker processes (e.g. "1": target nginx1), to set
// the fast path's loops beside nginx's workers.
const benchNginxWorkersEnv = "FAIRSHARE_BENCH_NGINX_WORKERS"

// benchLoopsEnv is a fast target's number of loops, in its process.
const benchLoopsEnv = "FAIRSHARE_BENCH_LOOPS"

// benchTargetsEnv keeps BenchmarkOverhead to the targets named (comma
// separated; direct always runs).
const benchTargetsEnv = "FAIRSHARE_BENCH_TARGETS"

// benchProjectsEnv, set to a number n over 1, has the saturating level's
// load come from n wrk processes, each in a cgroup of its own below a
// projects root the fronts are given (so each is a project of its own, as
// the front names a local client's), with 2 connections each; 1 (the
// default) is one wrk naming one project in the header. It needs root and
// cgroup2.
const benchProjectsEnv = "FAIRSHARE_BENCH_PROJECTS"

// benchProjectsRootEnv passes the projects root to the front processes.
const benchProjectsRootEnv = "FAIRSHARE_BENCH_PROJECTS_ROOT"

// TestMain runs the front process of the benchmark when asked to.
func TestMain(m *testing.M) {
	// FAIRSHARE_FRONT_FAST=1 runs every front of the tests on the fast
	// path.
	fastPathAlways = os.Getenv("FAIRSHARE_FRONT_FAST") == "1"
	// FAIRSHARE_FRONT_PLAIN_SENDS=1 has the fast path send without its
	// io_uring (Config.PlainSends).
	plainSendsAlways = os.Getenv("FAIRSHARE_FRONT_PLAIN_SENDS") == "1"
	if target := os.Getenv(clientRoleEnv); target != "" {
		if raw := os.Getenv(clientRawEnv); raw != "" {
			os.Exit(runRawClient(target, raw))
		}
		os.Exit(runTestClient(target, os.Getenv(clientHeaderEnv)))
	}
	if svc := os.Getenv(benchUpstreamEnv); svc != "" {
		d, err := time.ParseDuration(svc)
		if err == nil {
			err = serveBenchUpstream(d)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if up := os.Getenv(benchRoleEnv); up != "" {
		if prof := os.Getenv(benchProfileEnv); prof != "" {
			// The front runs in this process, not the benchmark's:
			// -cpuprofile there would not see it.
			f, err := os.Create(fmt.Sprintf("%s.%s", prof, map[string]string{"0": "nosched", "1": "front", "goproxy": "goproxy", "transport": "transport", "fast": "fast", "fastnosched": "fastnosched", "fastpool": "fastpool"}[os.Getenv("FAIRSHARE_BENCH_SCHED")]))
			if err == nil && pprof.StartCPUProfile(f) == nil {
				defer func() { pprof.StopCPUProfile(); f.Close() }()
			}
		}
		if err := serveBenchFront(up, os.Getenv("FAIRSHARE_BENCH_SCHED")); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		pprof.StopCPUProfile()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// serveBenchFront serves the front with a pool too big to refuse anything in
// front of upstream, prints its address and serves until stdin closes. mode
// "1" adds the scheduler (the full front), "fast" is the full front on its
// fast path (Config.FastPath), "0" leaves the scheduler out (pool and rate
// buckets only), to show what the scheduler's dispatch costs; "fastnosched"
// is "0" on the fast path, and "fastpool" the fast path with the pool alone
// (no rate buckets either: what nginx's limit_conn does); "goproxy"
// serves net/http's stock reverse proxy instead of the front, nothing else,
// as the floor of a proxy built on net/http.
func serveBenchFront(upstream, mode string) error {
	withSched := mode == "1" || mode == "transport" || mode == "fast"
	if mode == "goproxy" {
		u, err := url.Parse(upstream)
		if err != nil {
			return err
		}
		rp := httputil.NewSingleHostReverseProxy(u)
		rp.BufferPool = &bufferPool{}
		rp.Transport = &http.Transport{MaxIdleConnsPerHost: 1024}
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return err
		}
		fmt.Println(l.Addr().String())
		srv := &http.Server{Handler: rp}
		go func() { _, _ = io.Copy(io.Discard, os.Stdin); _ = srv.Close() }()
		if err := srv.Serve(l); !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	}
	pool, err := pools.New(pools.Config{Name: "requests", Size: 100000}, nil)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	deps := Deps{Requests: pool, Rates: pools.NewRates(nil)}
	if withSched {
		sched, err := scheduler.New(scheduler.Config{MaxInFlight: 1024}, nil)
		if err != nil {
			return err
		}
		go func() { _ = sched.Run(ctx) }()
		deps.Sched = sched
	}
	// The load generator is on loopback and names its project in the header.
	f, err := New(Config{Upstream: upstream, MaxInFlight: 1024, TrustedPeers: []string{"127.0.0.1"},
		ProjectsRoot: os.Getenv(benchProjectsRootEnv)}, deps)
	if err != nil {
		return err
	}
	if mode == "fastpool" {
		deps.Rates = nil
	}
	if strings.HasPrefix(mode, "fast") {
		f.cfg.FastPath = true
		f.fastLoops, _ = strconv.Atoi(os.Getenv(benchLoopsEnv))
	}
	if mode == "transport" {
		f.up = nil // every request through ReverseProxy and http.Transport
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	fmt.Println(l.Addr().String())
	go func() { _, _ = io.Copy(io.Discard, os.Stdin); cancel() }()
	return f.Serve(ctx, l)
}

// benchFront starts a front process (the test binary again) and returns its
// URL.
func benchFront(b *testing.B, upstream string, withSched bool) (string, int) {
	return benchFrontOf(b, os.Args[0], upstream, map[bool]string{false: "0", true: "1"}[withSched])
}

// benchFrontOf starts the front process of test binary bin in mode (see
// serveBenchFront).
func benchFrontOf(b *testing.B, bin, upstream, mode string) (string, int) {
	b.Helper()
	return benchChild(b, bin, benchRoleEnv+"="+upstream, "FAIRSHARE_BENCH_SCHED="+mode)
}

// benchChild starts test binary bin with env added, reads the address it
// prints and returns its URL and pid; it ends when the benchmark does.
func benchChild(b *testing.B, bin string, env ...string) (string, int) {
	b.Helper()
	cmd := exec.Command(bin, "-test.run=^$")
	cmd.Env = append(os.Environ(), env...)
	cmd.Stderr = os.Stderr
	stdin, stdout := testutil.Pipes(b, cmd)
	if err := cmd.Start(); err != nil {
		b.Fatalf("starting %v: %v", env, err)
	}
	b.Cleanup(func() {
		stdin.Close()
		if err := cmd.Wait(); err != nil {
			b.Errorf("process %v: %v", env, err)
		}
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		b.Fatalf("process %v did not start: %v", env, err)
	}
	return "http://" + strings.TrimSpace(line), cmd.Process.Pid
}

// benchNginx starts nginx on loopback proxying upstream with keep-alive and a
// limit_conn per project that never bites, or returns "" when nginx is not
// installed.
func benchNginx(b *testing.B, upstream string) (string, int) {
	return benchNginxWorkers(b, upstream, 2)
}

// benchNginxWorkers is benchNginx with the given number of worker processes.
func benchNginxWorkers(b *testing.B, upstream string, workers int) (string, int) {
	b.Helper()
	bin, err := exec.LookPath("nginx")
	if err != nil {
		for _, p := range []string{"/usr/sbin/nginx", "/usr/local/sbin/nginx"} {
			if _, err := os.Stat(p); err == nil {
				bin = p
			}
		}
	}
	if bin == "" {
		return "", 0
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	dir := b.TempDir()
	conf := fmt.Sprintf(`worker_processes %[4]d;
daemon off;
user root;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path %[1]s/body;
  proxy_temp_path %[1]s/proxy;
  fastcgi_temp_path %[1]s/fastcgi;
  uwsgi_temp_path %[1]s/uwsgi;
  scgi_temp_path %[1]s/scgi;
  limit_conn_zone $http_fairshare_project zone=perproject:1m;
  upstream up { server %[2]s; keepalive 256; }
  server {
    listen %[3]s;
    location / {
      limit_conn perproject 60000;
      limit_conn_status 429;
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
}
`, dir, upstream[len("http://"):], addr, workers)
	path := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command(bin, "-p", dir, "-c", path)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatalf("starting nginx: %v", err)
	}
	b.Cleanup(func() { stopPeer(cmd) })
	deadline := time.Now().Add(5 * time.Second)
	for {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("nginx did not listen on %s", addr)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return "http://" + addr, cmd.Process.Pid
}

// benchHAProxy starts HAProxy on loopback proxying upstream with two
// threads, as nginx has two workers, reusing its upstream connections for
// any client (http-reuse always) and the server's maxconn as the pool (the
// fronts' MaxInFlight), or returns "" when HAProxy is not installed.
func benchHAProxy(b *testing.B, upstream string) (string, int) {
	b.Helper()
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		for _, p := range []string{"/usr/sbin/haproxy", "/usr/local/sbin/haproxy"} {
			if _, err := os.Stat(p); err == nil {
				bin = p
			}
		}
	}
	if bin == "" {
		return "", 0
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	conf := fmt.Sprintf(`global
  nbthread 2
  maxconn 4096
defaults
  mode http
  timeout connect 5s
  timeout client 60s
  timeout server 60s
frontend fe
  bind %[1]s
  default_backend be
backend be
  http-reuse always
  server up %[2]s maxconn 1024
`, addr, upstream[len("http://"):])
	path := filepath.Join(b.TempDir(), "haproxy.cfg")
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command(bin, "-db", "-f", path)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatalf("starting haproxy: %v", err)
	}
	b.Cleanup(func() { stopPeer(cmd) })
	deadline := time.Now().Add(5 * time.Second)
	for {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("haproxy did not listen on %s", addr)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return "http://" + addr, cmd.Process.Pid
}

// benchProjects makes the cgroups of the saturating level's projects (see
// benchProjectsEnv) and hands their root to the front processes started
// after it; it returns none for one project.
func benchProjects(b *testing.B) []string {
	n, _ := strconv.Atoi(os.Getenv(benchProjectsEnv))
	if n <= 1 {
		return nil
	}
	testutil.RequireRoot(b)
	root := testutil.TempCgroup(b, testutil.Cgroup2Mount(b), "fairshare-bench-*")
	b.Setenv(benchProjectsRootEnv, root)
	dirs := make([]string, n)
	for i := range dirs {
		dirs[i] = testutil.MkCgroup(b, root, fmt.Sprintf("p%d", i))
	}
	return dirs
}

// selfCPU is the CPU time this process used so far.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// use is what processes used so far: CPU time, and how often their threads
// left a CPU, by blocking (sleeps: voluntary context switches) and by being
// preempted (involuntary ones). On a virtual machine a switch costs many
// microseconds: switches a request explain CPU a request that profiles of
// user code do not.
type use struct {
	cpu              time.Duration
	sleeps, preempts int64
}

func (u use) sub(v use) use {
	return use{u.cpu - v.cpu, u.sleeps - v.sleeps, u.preempts - v.preempts}
}

func (u use) add(v use) use {
	return use{u.cpu + v.cpu, u.sleeps + v.sleeps, u.preempts + v.preempts}
}

// procUse is what the processes pids and their direct children (nginx's
// workers) used so far, from /proc. The CPU time (user + system) is what a
// proxy costs per request regardless of how busy the rest of the machine
// is.
func procUse(pids ...int) use {
	want := map[int]bool{}
	for _, p := range pids {
		want[p] = true
	}
	var u use
	var ticks int64
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		raw, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// Fields after the command name, which may contain spaces.
		i := bytes.LastIndexByte(raw, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(raw[i+1:]))
		if len(f) < 13 {
			continue
		}
		ppid, _ := strconv.Atoi(f[1])
		if !want[pid] && !want[ppid] {
			continue
		}
		ut, _ := strconv.ParseInt(f[11], 10, 64)
		st, _ := strconv.ParseInt(f[12], 10, 64)
		ticks += ut + st
		// A process's own status counts only its main thread's switches;
		// a thread that ended meanwhile takes its counts with it (the
		// proxies and the upstream keep theirs).
		tasks, _ := filepath.Glob(filepath.Join("/proc", e.Name(), "task", "*", "status"))
		for _, t := range tasks {
			status, err := os.ReadFile(t)
			if err != nil {
				continue
			}
			for line := range strings.Lines(string(status)) {
				k, v, _ := strings.Cut(line, ":")
				n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
				switch k {
				case "voluntary_ctxt_switches":
					u.sleeps += n
				case "nonvoluntary_ctxt_switches":
					u.preempts += n
				}
			}
		}
	}
	// USER_HZ is 100 on Linux for every architecture Go supports here.
	u.cpu = time.Duration(ticks) * 10 * time.Millisecond
	return u
}

// BenchmarkRequest is one request at a time through a front with pool,
// rates and scheduler, in this process with its client and upstream. Its
// allocs/op, unlike the time of a loopback round trip on a shared machine,
// does not depend on what else runs: a change to the front's path shows up
// as a difference in it (client and upstream are the same on both sides).
func BenchmarkRequest(b *testing.B) {
	r := newRig(b, rigOpts{poolSize: 1024}, ok)
	b.ReportAllocs()
	for b.Loop() {
		if got := readAll(b, r.get(b, "bench", "/")); got != "ok\n" {
			b.Fatalf("answer %q", got)
		}
	}
}

// BenchmarkRequestLargeAnswer is BenchmarkRequest with an answer of 1 MiB
// (Content-Length and Content-Type: one the fast path relays itself), on
// each path: the cost of reading an answer's body, each of whose reads is
// bounded by UpstreamReadTimeout.
func BenchmarkRequestLargeAnswer(b *testing.B) {
	body := bytes.Repeat([]byte("a"), 1<<20)
	for _, path := range []struct {
		name  string
		tweak func(*Front)
	}{
		{"direct", nil},
		{"fast", func(f *Front) { f.cfg.FastPath = true }},
		{"fallback", func(f *Front) { f.up = nil }},
	} {
		b.Run(path.name, func(b *testing.B) {
			r := newRig(b, rigOpts{poolSize: 1024, tweak: path.tweak}, func(w http.ResponseWriter, _ *http.Request) {
				w.Header().Set("Content-Type", "application/octet-stream")
				w.Header().Set("Content-Length", strconv.Itoa(len(body)))
				_, _ = w.Write(body)
			})
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				resp := r.get(b, "bench", "/")
				n, err := io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if err != nil || n != int64(len(body)) {
					b.Fatalf("answer of %d bytes: %v", n, err)
				}
			}
		})
	}
}

// BenchmarkRequestBody is BenchmarkRequest with a POST of 1 KiB, which the
// upstream reads: the path of requests with bodies.
func BenchmarkRequestBody(b *testing.B) {
	r := newRig(b, rigOpts{poolSize: 1024}, func(w http.ResponseWriter, req *http.Request) {
		if _, err := io.Copy(io.Discard, req.Body); err == nil {
			ok(w, req)
		}
	})
	body := bytes.Repeat([]byte("b"), 1<<10)
	b.ReportAllocs()
	for b.Loop() {
		req, _ := http.NewRequest(http.MethodPost, r.url+"/", bytes.NewReader(body))
		req.Header.Set(DefaultProjectHeader, "bench")
		resp, err := r.client.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		if got := readAll(b, resp); got != "ok\n" {
			b.Fatalf("answer %q", got)
		}
	}
}

// benchTarget is one server the benchmark loads.
type benchTarget struct {
	name, url string
	pid       int // the proxy's process; 0 for direct
}

// benchTargets starts the proxies in front of up: the front (pool, rates and
// scheduler), nosched (the front without the scheduler), transport (the
// front with its direct path off: every request through ReverseProxy and
// http.Transport), fastnosched and fastpool (see serveBenchFront), baseline (the front
// of another build, with FAIRSHARE_BENCH_BASELINE), goproxy (net/http's
// stock httputil.ReverseProxy and nothing else), nginx and HAProxy when
// installed.
func benchTargets(b *testing.B, up string) []benchTarget {
	targets := []benchTarget{{name: "direct", url: up}}
	fr, frPID := benchFront(b, up, true)
	ns, nsPID := benchFront(b, up, false)
	tr, trPID := benchFrontOf(b, os.Args[0], up, "transport")
	fa, faPID := benchFrontOf(b, os.Args[0], up, "fast")
	fn, fnPID := benchFrontOf(b, os.Args[0], up, "fastnosched")
	fp, fpPID := benchFrontOf(b, os.Args[0], up, "fastpool")
	targets = append(targets, benchTarget{"front", fr, frPID}, benchTarget{"fast", fa, faPID}, benchTarget{"nosched", ns, nsPID}, benchTarget{"transport", tr, trPID},
		benchTarget{"fastnosched", fn, fnPID}, benchTarget{"fastpool", fp, fpPID})
	if base := os.Getenv(benchBaselineEnv); base != "" {
		mode := "1"
		if fastBaseline := os.Getenv("FAIRSHARE_BENCH_BASELINE_FAST") == "1"; fastBaseline {
			mode = "fast"
		}
		u, pid := benchFrontOf(b, base, up, mode)
		targets = append(targets, benchTarget{"baseline", u, pid})
	}
	for _, n := range strings.Fields(os.Getenv(benchFastLoopsEnv)) {
		u, pid := benchChild(b, os.Args[0], benchRoleEnv+"="+up, "FAIRSHARE_BENCH_SCHED=fast", benchLoopsEnv+"="+n)
		targets = append(targets, benchTarget{"fast" + n, u, pid})
	}
	gp, gpPID := benchFrontOf(b, os.Args[0], up, "goproxy")
	targets = append(targets, benchTarget{"goproxy", gp, gpPID})
	if ngx, pid := benchNginx(b, up); ngx != "" {
		targets = append(targets, benchTarget{"nginx", ngx, pid})
		for _, n := range strings.Fields(os.Getenv(benchNginxWorkersEnv)) {
			w, err := strconv.Atoi(n)
			if err != nil || w < 1 {
				b.Fatalf("%s: %q is not a number of workers", benchNginxWorkersEnv, n)
			}
			u, pid := benchNginxWorkers(b, up, w)
			targets = append(targets, benchTarget{"nginx" + n, u, pid})
		}
	} else {
		b.Log("nginx is not installed (apt-get install -y nginx): skipping the nginx comparison")
	}
	if hap, pid := benchHAProxy(b, up); hap != "" {
		targets = append(targets, benchTarget{"haproxy", hap, pid})
	} else {
		b.Log("haproxy is not installed (apt-get install -y haproxy): skipping the HAProxy comparison")
	}
	if only := os.Getenv(benchTargetsEnv); only != "" {
		var kept []benchTarget
		for _, tg := range targets {
			if tg.name == "direct" || slices.Contains(strings.Split(only, ","), tg.name) {
				kept = append(kept, tg)
			}
		}
		targets = kept
	}
	return targets
}

// useOf returns what a target's process used so far: for direct the
// benchmark's own CPU time (client and upstream together, nothing else runs
// in it while direct takes its turn).
func useOf(tg benchTarget) use {
	if tg.pid == 0 {
		return use{cpu: selfCPU()} // the generator's switches are in it: not reported
	}
	return procUse(tg.pid)
}

// BenchmarkOverhead measures the front against going straight to the
// upstream, and against nginx doing the same proxying with limit_conn, in
// one run: the same upstream, the same generator, the targets taking turns
// in short slices so that a burst of outside load hits every target alike.
// Generator, proxies and upstream share this machine's cores, as they would
// on a node. The upstream and the generator run in the benchmark's process;
// each proxy in its own. FAIRSHARE_BENCH_SECONDS sets each target's total
// time (default 2).
//
//	saturating: closed loop, 32 clients, an upstream that answers at once;
//	            throughput of each target as a ratio of direct's, and the
//	            CPU time each proxy process used per request (read from
//	            /proc, so robust to the rest of the machine being busy,
//	            unlike req/s; for direct, the benchmark process's own),
//	            the upstream's CPU per request behind each, and with wrk
//	            its own CPU per request (X-wrk-cpu-us/req) and how many of
//	            the cores proxy, upstream and wrk kept busy together
//	            (X-busy-cpus); how often a request made the proxy's threads
//	            block (X-sleeps/req) or be preempted (X-preempts/req), and
//	            the upstream's threads switch either way
//	            (X-upstream-switches/req)
//	moderate:   open loop at a fixed rate, a fifth of direct's saturating
//	            throughput as the saturating level just measured it, to an
//	            upstream with 5ms of service; the p50 and p99 each proxy
//	            adds over direct, per round of slices, as the median over
//	            rounds and its quartiles (the spread), and each target's
//	            completed requests/s as a ratio of direct's
//
// Targets, in turn: direct, front (pool, rates and scheduler, on net/http's
// server), fast (the same front on its fast path, as the daemon runs it by
// default), nosched (the front without the scheduler), transport,
// fastnosched and fastpool (the fast path without the scheduler, and with
// the pool alone: what each part of the front costs beside nginx's
// limit_conn), baseline (the front of another build, with
// FAIRSHARE_BENCH_BASELINE), goproxy (net/http's stock
// httputil.ReverseProxy alone), nginx, haproxy (two threads, http-reuse
// always: any client's request on any idle upstream connection). The
// saturating level reports fast/nginx and fast/haproxy (throughput) and
// fast-cpu/nginx-cpu and fast-cpu/haproxy-cpu (CPU a request), each of the
// run's own turns, and the same against the baseline.
// FAIRSHARE_BENCH_PROJECTS=20 has its load come from 20 wrk processes,
// each in a project cgroup of its own (see benchProjectsEnv).
func BenchmarkOverhead(b *testing.B) {
	dur := 2 * time.Second
	if s := os.Getenv("FAIRSHARE_BENCH_SECONDS"); s != "" {
		if d, err := time.ParseDuration(s + "s"); err == nil {
			dur = d
		}
	}
	var direct float64 // direct's saturating req/s; 0 if that level did not run
	b.Run("saturating", func(b *testing.B) { direct = benchSaturating(b, dur) })
	b.Run("moderate", func(b *testing.B) { benchModerate(b, dur, direct) })
}

// benchSaturating runs the saturating level and returns direct's req/s.
func benchSaturating(b *testing.B, dur time.Duration) float64 {
	const conc = 32
	projects := benchProjects(b)
	up, upPID := benchUpstream(b, 0)
	targets := benchTargets(b, up)
	gens := make([]generator, len(targets))
	for _, tg := range targets {
		b.Logf("target %s: pid %d (upstream pid %d)", tg.name, tg.pid, upPID)
	}
	wrk, _ := exec.LookPath("wrk")
	if wrk == "" {
		if len(projects) > 0 {
			b.Skipf("%s needs wrk (apt-get install -y wrk)", benchProjectsEnv)
		}
		b.Log("wrk is not installed (apt-get install -y wrk): the load comes from the Go generator in this process, which competes with the proxies for the CPU")
	}
	var script string
	if n := benchBodySize(); n > 0 && wrk != "" {
		script = filepath.Join(b.TempDir(), "post.lua")
		lua := fmt.Sprintf("wrk.method = \"POST\"\nwrk.body = string.rep(\"b\", %d)\n", n)
		if err := os.WriteFile(script, []byte(lua), 0o600); err != nil {
			b.Fatal(err)
		}
	}
	for i, tg := range targets {
		if wrk != "" {
			gens[i] = &wrkGen{bin: wrk, url: tg.url, conc: conc, script: script, cgroups: projects}
		} else {
			gens[i] = newLoader(tg.url, conc)
		}
		defer gens[i].close()
		gens[i].run(time.Second) // warm connections and code paths
		gens[i].result()
	}
	slice := time.Second // wrk's unit
	if wrk == "" {
		slice = 100 * time.Millisecond
	}
	var direct float64
	b.ResetTimer()
	for range b.N {
		used := make([]use, len(targets))
		upUsed := make([]use, len(targets))
		ran := time.Duration(0) // what each target ran: whole slices, dur or just over
		for elapsed := time.Duration(0); elapsed < dur; elapsed += slice {
			ran += slice
			for i, g := range gens {
				c0, u0 := useOf(targets[i]), procUse(upPID)
				g.run(slice)
				c1, u1 := useOf(targets[i]), procUse(upPID)
				used[i] = used[i].add(c1.sub(c0))
				upUsed[i] = upUsed[i].add(u1.sub(u0))
			}
		}
		res := map[string]loadResult{}
		for i, tg := range targets {
			r := gens[i].result()
			if r.errors > 0 {
				b.Errorf("%s: %d errors", tg.name, r.errors)
			}
			res[tg.name] = r
			n := r.rps * ran.Seconds()
			b.ReportMetric(r.rps, tg.name+"-req/s")
			b.ReportMetric(float64(r.p99.Microseconds()), tg.name+"-p99-us")
			if tg.name != "direct" {
				b.ReportMetric(r.rps/res["direct"].rps, tg.name+"/direct")
				b.ReportMetric(float64(used[i].cpu.Microseconds())/n, tg.name+"-cpu-us/req")
				b.ReportMetric(float64(used[i].sleeps)/n, tg.name+"-sleeps/req")
				b.ReportMetric(float64(used[i].preempts)/n, tg.name+"-preempts/req")
			}
			b.ReportMetric(float64(upUsed[i].cpu.Microseconds())/n, tg.name+"-upstream-cpu-us/req")
			b.ReportMetric(float64(upUsed[i].sleeps+upUsed[i].preempts)/n, tg.name+"-upstream-switches/req")
			if r.genCPU > 0 {
				// What wrk spends a request may differ with the proxy
				// in front of the upstream. With the three processes'
				// CPU a request, how many cores they kept busy (their
				// CPU a request times the throughput) tells a proxy
				// that costs more a request from one that leaves the
				// cores idler: the targets take turns, so the rest of
				// the machine weighs on each alike.
				b.ReportMetric(float64(r.genCPU.Microseconds())/n, tg.name+"-wrk-cpu-us/req")
				if tg.name != "direct" {
					b.ReportMetric((used[i].cpu+upUsed[i].cpu+r.genCPU).Seconds()/ran.Seconds(), tg.name+"-busy-cpus")
				}
			}
		}
		b.ReportMetric(res["front"].rps/res["goproxy"].rps, "front/goproxy")
		b.ReportMetric(res["front"].rps/res["transport"].rps, "front/transport")
		if bl, ok := res["baseline"]; ok {
			b.ReportMetric(res["front"].rps/bl.rps, "front/baseline")
		}
		for _, peer := range []string{"nginx", "haproxy", "baseline"} {
			p, ok := res[peer]
			if !ok {
				continue
			}
			b.ReportMetric(res["front"].rps/p.rps, "front/"+peer)
			fast, ok := res["fast"]
			if !ok {
				continue
			}
			b.ReportMetric(fast.rps/p.rps, "fast/"+peer)
			// CPU a request, this round's: the ratio the targets compare.
			if pi, fi := slices.IndexFunc(targets, func(t benchTarget) bool { return t.name == peer }),
				slices.IndexFunc(targets, func(t benchTarget) bool { return t.name == "fast" }); pi >= 0 && fi >= 0 && p.rps > 0 && fast.rps > 0 {
				b.ReportMetric((float64(used[fi].cpu)/fast.rps)/(float64(used[pi].cpu)/p.rps), "fast-cpu/"+peer+"-cpu")
			}
		}
		direct = res["direct"].rps
	}
	b.ReportMetric(0, "ns/op")
	return direct
}

// generator is a closed-loop load generator for one target that
// accumulates over runs (see loader).
type generator interface {
	run(dur time.Duration)
	result() loadResult
	close()
}

// wrkGen drives a target with wrk, one run per call (whole seconds), with
// conc keep-alive connections on one thread, naming the project in the
// header as the Go generator does; or, with cgroups, with one wrk in each
// (2 connections each, no header: the cgroup names the project) at once.
type wrkGen struct {
	bin, url string
	conc     int
	script   string   // a wrk script making the requests POSTs (see benchBodyEnv), or ""
	cgroups  []string // one wrk in each, or one wrk in none

	reqs, errs int
	elapsed    time.Duration
	cpu        time.Duration   // wrk's own, user and system
	p50, p99   []time.Duration // per run
}

func (w *wrkGen) run(dur time.Duration) {
	secs := max(1, int(dur.Round(time.Second)/time.Second))
	if len(w.cgroups) == 0 {
		args := []string{"-t1", "-c" + strconv.Itoa(w.conc), "-d" + strconv.Itoa(secs) + "s", "--latency",
			"-H", DefaultProjectHeader + ": bench"}
		w.add(w.wrk(args, ""))
		return
	}
	args := []string{"-t1", "-c2", "-d" + strconv.Itoa(secs) + "s", "--latency"}
	outs := make([]wrkOut, len(w.cgroups))
	var wg sync.WaitGroup
	for i, dir := range w.cgroups {
		wg.Go(func() { outs[i] = w.wrk(args, dir) })
	}
	wg.Wait()
	// The processes ran side by side: their rates add up, over the time
	// they ran together.
	var all wrkOut
	var rps float64
	var p50, p99 []time.Duration
	for _, o := range outs {
		all.reqs += o.reqs
		all.errs += o.errs
		all.cpu += o.cpu
		if o.elapsed > 0 {
			rps += float64(o.reqs) / o.elapsed.Seconds()
		}
		p50, p99 = append(p50, o.p50...), append(p99, o.p99...)
	}
	if rps > 0 {
		all.elapsed = time.Duration(float64(all.reqs) / rps * float64(time.Second))
	}
	if len(p50) > 0 {
		all.p50, all.p99 = []time.Duration{median(p50)}, []time.Duration{median(p99)}
	}
	w.add(all)
}

// wrkOut is what one wrk run reported.
type wrkOut struct {
	reqs, errs int
	elapsed    time.Duration
	cpu        time.Duration
	p50, p99   []time.Duration
}

// add counts o in w's runs.
func (w *wrkGen) add(o wrkOut) {
	w.reqs += o.reqs
	w.errs += o.errs
	w.elapsed += o.elapsed
	w.cpu += o.cpu
	w.p50, w.p99 = append(w.p50, o.p50...), append(w.p99, o.p99...)
}

// wrk runs wrk with args against w.url, in the cgroup dir unless it is "".
func (w *wrkGen) wrk(args []string, dir string) wrkOut {
	var o wrkOut
	if w.script != "" {
		args = append(args, "-s", w.script)
	}
	cmd := exec.Command(w.bin, append(args, w.url)...)
	if dir != "" {
		fd, err := unix.Open(dir, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			o.errs++
			return o
		}
		defer unix.Close(fd)
		cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: fd}
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		o.errs++
		return o
	}
	o.cpu = cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
	for line := range strings.Lines(string(out)) {
		f := strings.Fields(line)
		switch {
		case len(f) >= 4 && f[1] == "requests" && f[2] == "in":
			n, _ := strconv.Atoi(f[0])
			d, _ := time.ParseDuration(strings.TrimSuffix(f[3], ","))
			o.reqs += n
			o.elapsed += d
		case len(f) == 5 && f[0] == "Non-2xx":
			n, _ := strconv.Atoi(f[4])
			o.errs += n
		case len(f) >= 2 && f[0] == "Socket" && f[1] == "errors:":
			o.errs++
		case len(f) == 2 && f[0] == "50%":
			d, _ := time.ParseDuration(f[1])
			o.p50 = append(o.p50, d)
		case len(f) == 2 && f[0] == "99%":
			d, _ := time.ParseDuration(f[1])
			o.p99 = append(o.p99, d)
		}
	}
	return o
}

// result summarises the runs so far (latencies as the median over runs)
// and starts afresh.
func (w *wrkGen) result() loadResult {
	r := loadResult{errors: w.errs, genCPU: w.cpu}
	if w.elapsed > 0 {
		r.rps = float64(w.reqs) / w.elapsed.Seconds()
	}
	if len(w.p50) > 0 {
		r.p50, r.p99 = median(w.p50), median(w.p99)
	}
	w.reqs, w.errs, w.elapsed, w.cpu, w.p50, w.p99 = 0, 0, 0, 0, nil, nil
	return r
}

func (*wrkGen) close() {}

// moderateShare is the moderate level's rate as a share of direct's
// saturating throughput: well below what the machine can serve, so a queue
// forms nowhere and what a proxy adds is its own path, not waiting. An
// open-loop request costs two to four times the CPU of a closed-loop one
// (each arrives alone and wakes its threads from idle), so the share is
// small: at a fifth of direct, the machine was 66-76% busy during the
// front's turns (busy-% in the output), not moderate; at a twentieth,
// 25-31%.
const moderateShare = 0.05

// moderateSlice is one target's turn at the moderate level: long enough for
// a p99 of a few hundred requests, short enough for many rounds.
const moderateSlice = 200 * time.Millisecond

// benchModerate runs the moderate level at moderateShare of direct, direct's
// saturating req/s, measuring that first when it is 0 (the level runs
// alone).
func benchModerate(b *testing.B, dur time.Duration, direct float64) {
	if direct == 0 {
		// The saturating level's measure of direct, without the other
		// targets' turns in between (so it may come out higher).
		up, _ := benchUpstream(b, 0)
		sat := newLoader(up, 32)
		sat.run(200 * time.Millisecond)
		sat.result()
		for range 10 {
			sat.run(100 * time.Millisecond)
		}
		direct = sat.result().rps
		sat.close()
	}
	rate := moderateShare * direct

	up, _ := benchUpstream(b, 5*time.Millisecond)
	targets := benchTargets(b, up)
	gens := make([]*openLoader, len(targets))
	for i, tg := range targets {
		gens[i] = newOpenLoader(tg.url, rate)
		defer gens[i].close()
		gens[i].run(200 * time.Millisecond) // warm connections and code paths
	}
	rounds := max(1, int(dur/moderateSlice))
	b.ResetTimer()
	for range b.N {
		p50 := make([][]time.Duration, len(targets)) // [target][round]
		p99 := make([][]time.Duration, len(targets))
		done := make([]int, len(targets))
		cpu := make([]time.Duration, len(targets))
		busy := make([]machineTime, len(targets))
		var elapsed time.Duration
		for r := range rounds {
			// Each round starts with the next target, so none always
			// follows the same one (a proxy's leftover work, or its GC).
			for k := range gens {
				i := (r + k) % len(gens)
				c0, m0 := useOf(targets[i]), readMachineTime()
				s := gens[i].run(moderateSlice)
				cpu[i] += useOf(targets[i]).sub(c0).cpu
				busy[i] = busy[i].add(readMachineTime().sub(m0))
				if s.errors > 0 {
					b.Errorf("%s: %d errors", targets[i].name, s.errors)
				}
				p50[i] = append(p50[i], s.quantile(0.50))
				p99[i] = append(p99[i], s.quantile(0.99))
				done[i] += len(s.lats)
			}
			elapsed += moderateSlice
		}
		b.ReportMetric(rate, "offered-req/s")
		for i, tg := range targets {
			rps := float64(done[i]) / elapsed.Seconds()
			b.ReportMetric(rps, tg.name+"-req/s")
			b.ReportMetric(float64(median(p99[i]).Microseconds()), tg.name+"-p99-us")
			b.ReportMetric(float64(cpu[i].Microseconds())/float64(done[i]), tg.name+"-cpu-us/req")
			b.ReportMetric(busy[i].busyPercent(), tg.name+"-busy-%")
			if i == 0 {
				continue
			}
			b.ReportMetric(rps*elapsed.Seconds()/float64(done[0]), tg.name+"/direct")
			for _, q := range []struct {
				name string
				of   [][]time.Duration
			}{{"p50", p50}, {"p99", p99}} {
				added := make([]time.Duration, rounds)
				for r := range rounds {
					added[r] = q.of[i][r] - q.of[0][r]
				}
				slices.Sort(added)
				b.ReportMetric(float64(added[rounds/2].Microseconds()), tg.name+"-added-"+q.name+"-us")
				if q.name == "p99" {
					b.ReportMetric(float64(added[rounds/4].Microseconds()), tg.name+"-added-p99-q1-us")
					b.ReportMetric(float64(added[rounds*3/4].Microseconds()), tg.name+"-added-p99-q3-us")
				}
			}
		}
	}
	b.ReportMetric(0, "ns/op")
}

// machineTime is the whole machine's CPU time from /proc/stat, in ticks:
// busy (user, nice, system, irq, softirq, steal) and all (busy, idle and
// iowait too).
type machineTime struct{ busy, all uint64 }

func readMachineTime() machineTime {
	raw, err := os.ReadFile("/proc/stat")
	if err != nil {
		return machineTime{}
	}
	line, _, _ := strings.Cut(string(raw), "\n")
	f := strings.Fields(line) // "cpu" user nice system idle iowait irq softirq steal ...
	var m machineTime
	for i := 1; i < len(f) && i <= 8; i++ {
		v, _ := strconv.ParseUint(f[i], 10, 64)
		m.all += v
		if i != 4 && i != 5 {
			m.busy += v
		}
	}
	return m
}

func (m machineTime) sub(o machineTime) machineTime {
	return machineTime{m.busy - o.busy, m.all - o.all}
}
func (m machineTime) add(o machineTime) machineTime {
	return machineTime{m.busy + o.busy, m.all + o.all}
}

// busyPercent is the share of the machine's CPU time that was busy, or -1
// without /proc/stat.
func (m machineTime) busyPercent() float64 {
	if m.all == 0 {
		return -1
	}
	return 100 * float64(m.busy) / float64(m.all)
}

// median returns the middle of ds (sorted in place).
func median(ds []time.Duration) time.Duration {
	slices.Sort(ds)
	return ds[len(ds)/2]
}

// openLoader is an open-loop load generator: requests start at a fixed rate
// whether or not earlier ones were answered, each on its own goroutine, as
// independent clients arrive. Unlike a closed loop, a slow answer does not
// slow the arrivals, so latency is measured at the load named, not at
// whatever load the target lets through.
type openLoader struct {
	url    string
	every  time.Duration
	client *http.Client
}

func newOpenLoader(url string, rate float64) *openLoader {
	tr := &http.Transport{MaxIdleConnsPerHost: 1024, DisableCompression: true}
	return &openLoader{url: url, every: time.Duration(float64(time.Second) / rate), client: &http.Client{Transport: tr}}
}

func (o *openLoader) close() { o.client.CloseIdleConnections() }

// slice is one open-loop run's latencies (sorted) and failures.
type slice struct {
	lats   []time.Duration
	errors int
}

func (s slice) quantile(q float64) time.Duration {
	if len(s.lats) == 0 {
		return 0
	}
	return s.lats[min(len(s.lats)-1, int(float64(len(s.lats))*q))]
}

// run starts requests at the rate for dur and waits for their answers. A
// latency runs from the request's start to the end of its answer: if the
// generator itself is late (the machine is busy), the requests due start
// at once and the delay is not charged to the target.
func (o *openLoader) run(dur time.Duration) slice {
	var (
		wg  sync.WaitGroup
		mu  sync.Mutex
		out slice
	)
	start := time.Now()
	for n := time.Duration(0); n*o.every < dur; n++ {
		if d := time.Until(start.Add(n * o.every)); d > 0 {
			time.Sleep(d)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			req := benchRequest(o.url)
			t0 := time.Now()
			resp, err := o.client.Do(req)
			ok := err == nil
			if ok {
				_, err = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				ok = err == nil && resp.StatusCode == http.StatusOK
			}
			lat := time.Since(t0)
			mu.Lock()
			if ok {
				out.lats = append(out.lats, lat)
			} else {
				out.errors++
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	slices.Sort(out.lats)
	return out
}

// BenchmarkRefusedShare is one request refused by the requests pool (a
// pool of one, held by another project), served in this goroutine without
// a network: what a flood over its share costs the front per request.
func BenchmarkRefusedShare(b *testing.B) {
	pool, err := pools.New(pools.Config{Name: "requests", Size: 1}, nil)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := pool.TryAcquire("hog"); err != nil {
		b.Fatal(err)
	}
	f, err := New(Config{Upstream: "http://upstream.test", TrustedPeers: []string{"192.0.2.1"}}, Deps{Requests: pool})
	if err != nil {
		b.Fatal(err)
	}
	req := httptest.NewRequest("GET", "http://front.test/", nil)
	req.Header.Set(DefaultProjectHeader, "flood")
	b.ReportAllocs()
	for b.Loop() {
		w := httptest.NewRecorder()
		f.ServeHTTP(w, req)
		if w.Code != http.StatusTooManyRequests {
			b.Fatalf("status %d", w.Code)
		}
	}
}

// BenchmarkIdleConnMemory measures what an open client connection costs the
// front: heap and goroutine stacks per connection, with 1,000 keep-alive
// connections each idle after one request. The daemon budgets its
// connection caps with it (package daemon, connCost). The client ends are in
// the same process; their share (a net.Conn and a bufio buffer each) is
// counted too, so the number is an upper bound.
//
//	go test -run '^$' -bench IdleConnMemory -count 5 ./front
func BenchmarkIdleConnMemory(b *testing.B) {
	const n = 1000
	r := newRig(b, rigOpts{poolSize: 8}, func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok") })
	addr := strings.TrimPrefix(r.url, "http://")
	for range b.N {
		runtime.GC()
		var before runtime.MemStats
		runtime.ReadMemStats(&before)
		conns := make([]net.Conn, 0, n)
		for range n {
			c, err := net.Dial("tcp", addr)
			if err != nil {
				b.Fatal(err)
			}
			conns = append(conns, c)
			io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\nFairshare-Project: p\r\n\r\n")
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				b.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		runtime.GC()
		var after runtime.MemStats
		runtime.ReadMemStats(&after)
		used := (after.HeapInuse + after.StackInuse) - (before.HeapInuse + before.StackInuse)
		b.ReportMetric(float64(used)/n, "B/conn")
		for _, c := range conns {
			c.Close()
		}
	}
}

// stopPeer ends a peer proxy: SIGTERM (a fast stop for nginx and HAProxy
// both; SIGINT is ignored by a child started from a shell without job
// control, and the benchmark hung there), then SIGKILL if it is still up
// after five seconds.
func stopPeer(cmd *exec.Cmd) {
	_ = cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		_ = cmd.Process.Kill()
		<-done
	}
}
