// SPDX-License-Identifier: Apache-2.0

package compare

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/fairshare-dev/fairshare/front"
	"github.com/fairshare-dev/fairshare/pools"
	"github.com/fairshare-dev/fairshare/scheduler"
)

// ProjectHeader names a request's project to every HTTP system.
const ProjectHeader = "X-Project"

// ServiceHeader tells the upstream how long to hold the request (a Go
// duration): the writer's service time, which differs between the
// projects of the heavy workload. Without it the upstream holds the run's
// Options.Service.
const ServiceHeader = "X-Service"

// HTTPSchemes are the systems over HTTP: each a proxy in front of one Go
// upstream that holds every request its service time and counts the seats
// in use per project; the writers are HTTP clients with keep-alive that
// obey Retry-After-Ms where an answer has it (the front's), else
// Retry-After (whole seconds), and otherwise retry a 429 or 503 after
// DefaultRetry. They run in real time only (real sockets, real processes).
var HTTPSchemes = []Scheme{
	{Name: "http-fairshare", How: "the fairshare front (net/http path) with the requests pool and the scheduler, MaxInFlight = pool; 429 with its Retry-After and Retry-After-Ms",
		Retry: "429: retries after Retry-After-Ms (the slot, to the millisecond)", New: newHTTPFairshare},
	{Name: "http-nginx", How: "nginx limit_conn keyed by the project header at pool/N, and one keyed by $server_port (the whole server) at the pool; 503 without Retry-After",
		Retry: "503 without a hint: retries after 10ms", New: newHTTPNginx},
	{Name: "http-haproxy", How: "HAProxy with maxconn = pool on the upstream server: the rest wait in its queue (FIFO)",
		Retry: "never refused here: waits in HAProxy's queue", New: newHTTPHAProxy},
}

// binder is a System whose seats are counted elsewhere (the upstream):
// Run hands it the recorder's hold.
type binder interface {
	bind(hold func(project string, d int))
}

// httpSystem is the client side every HTTP scheme shares, and the upstream.
type httpSystem struct {
	url    string
	client *http.Client
	up     *http.Server
	upLn   net.Listener

	mu   sync.Mutex // guards hold
	hold func(project string, d int)

	service time.Duration
	stop    []func() // in reverse order by Close
}

func newHTTPSystem(service time.Duration) (*httpSystem, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("upstream listen: %w", err)
	}
	h := &httpSystem{upLn: ln, service: service,
		client: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1024, IdleConnTimeout: time.Minute}}}
	h.up = &http.Server{Handler: http.HandlerFunc(h.serveUpstream), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = h.up.Serve(ln) }()
	return h, nil
}

func (h *httpSystem) upstreamURL() string { return "http://" + h.upLn.Addr().String() }

func (h *httpSystem) bind(hold func(string, int)) {
	h.mu.Lock()
	h.hold = hold
	h.mu.Unlock()
}

// serveUpstream holds a seat for the service time, or until the proxy
// drops the request (its client went away: a departing project's writers
// abandon the requests they are in). nginx and the front then free the
// request's place at once, and a seat the upstream kept would count
// against the pool they bound. HAProxy (without abortonclose) keeps the
// place until the answer, so it does not drop the request.
func (h *httpSystem) serveUpstream(w http.ResponseWriter, r *http.Request) {
	project := r.Header.Get(ProjectHeader)
	h.mu.Lock()
	hold := h.hold
	h.mu.Unlock()
	if hold != nil {
		hold(project, 1)
	}
	service := h.service
	if d, err := time.ParseDuration(r.Header.Get(ServiceHeader)); err == nil && d > 0 {
		service = d
	}
	t := time.NewTimer(service)
	select {
	case <-t.C:
	case <-r.Context().Done():
		t.Stop()
	}
	if hold != nil {
		hold(project, -1)
	}
	w.WriteHeader(http.StatusOK)
}

func (h *httpSystem) Do(ctx context.Context, project string, _ func()) (bool, time.Duration, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, h.url, nil)
	if err != nil {
		return false, 0, err
	}
	req.Header.Set(ProjectHeader, project)
	if d, ok := ServiceOf(ctx); ok {
		req.Header.Set(ServiceHeader, d.String())
	}
	resp, err := h.client.Do(req)
	if err != nil {
		return false, 0, err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
		return true, 0, nil
	case http.StatusTooManyRequests, http.StatusServiceUnavailable:
		return false, retryHint(resp.Header), nil
	}
	return false, 0, fmt.Errorf("status %d", resp.StatusCode)
}

// retryHint is the wait a refused client honours: Retry-After-Ms when the
// answer has it (the fairshare front's, as client libraries that know the
// header read it first), else Retry-After in whole seconds; 0 when neither
// is there.
func retryHint(h http.Header) time.Duration {
	if ms, err := strconv.ParseInt(h.Get(front.HeaderRetryAfterMs), 10, 64); err == nil && ms > 0 {
		return time.Duration(ms) * time.Millisecond
	}
	if s, err := strconv.Atoi(h.Get("Retry-After")); err == nil && s > 0 {
		return time.Duration(s) * time.Second
	}
	return 0
}

func (h *httpSystem) Close() {
	for i := len(h.stop) - 1; i >= 0; i-- {
		h.stop[i]()
	}
	h.client.CloseIdleConnections()
	_ = h.up.Close()
}

func newHTTPFairshare(o Options, _ Workload) (System, error) {
	size := o.Pool
	h, err := newHTTPSystem(o.Service)
	if err != nil {
		return nil, err
	}
	p, err := pools.New(pools.Config{Name: "requests", Size: size}, nil)
	if err != nil {
		h.Close()
		return nil, fmt.Errorf("fairshare pool: %w", err)
	}
	s, err := scheduler.New(scheduler.Config{MaxInFlight: size}, nil)
	if err != nil {
		h.Close()
		return nil, fmt.Errorf("fairshare scheduler: %w", err)
	}
	f, err := front.New(front.Config{Upstream: h.upstreamURL(), ProjectHeader: ProjectHeader, ForwardProject: true,
		TrustedPeers: []string{"127.0.0.1/32"}, MaxInFlight: size},
		front.Deps{Requests: p, Sched: s, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		h.Close()
		return nil, fmt.Errorf("fairshare front: %w", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		h.Close()
		return nil, fmt.Errorf("front listen: %w", err)
	}
	h.url = "http://" + ln.Addr().String() + "/"
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = s.Run(ctx) })
	wg.Go(func() { recomputeEverySecond(ctx, p) })
	wg.Go(func() { _ = f.Serve(ctx, ln) })
	h.stop = append(h.stop, func() { cancel(); wg.Wait() })
	return h, nil
}

// startProcess runs a proxy until Close, after its port answers.
func startProcess(h *httpSystem, addr string, name string, args ...string) error {
	cmd := exec.Command(name, args...)
	var out lockedBuf
	cmd.Stdout, cmd.Stderr = &out, &out
	// Its own process group, so that Close ends the workers with the
	// master (a killed nginx master leaves its worker holding our pipe).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.WaitDelay = 2 * time.Second
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", name, err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	h.stop = append(h.stop, func() { _ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL); <-done })
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		select {
		case err := <-done:
			done <- err
			return fmt.Errorf("%s exited before serving: %v: %s", name, err, out.String())
		default:
		}
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			return nil
		}
	}
	return fmt.Errorf("%s did not listen on %s within 5s: %s", name, addr, out.String())
}

type lockedBuf struct {
	mu sync.Mutex
	b  []byte
}

func (l *lockedBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.b) < 1<<16 {
		l.b = append(l.b, p...)
	}
	return len(p), nil
}

func (l *lockedBuf) String() string { l.mu.Lock(); defer l.mu.Unlock(); return string(l.b) }

// freeAddr picks a loopback port for a proxy to listen on.
func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// ErrMissingTool is returned when a proxy's binary is not installed.
var ErrMissingTool = errors.New("not installed")

func newHTTPNginx(o Options, w Workload) (System, error) {
	size := o.Pool
	bin, err := exec.LookPath("nginx")
	if err != nil {
		return nil, fmt.Errorf("nginx (Debian: nginx-light): %w", ErrMissingTool)
	}
	h, err := newHTTPSystem(o.Service)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "compare-nginx-")
	if err != nil {
		h.Close()
		return nil, err
	}
	h.stop = append(h.stop, func() { _ = os.RemoveAll(dir) })
	addr, err := freeAddr()
	if err != nil {
		h.Close()
		return nil, err
	}
	c := max(size/max(w.Planned, 1), 1)
	// nginx counts a request in a limit_conn zone only if the zone's key
	// is not empty. The server-wide zone is keyed by $server_port, which
	// every request has: $server_name is empty in a server block without
	// a server_name, and keyed by it the limit of the pool bounded nothing
	// (TestProxyServerCap).
	conf := fmt.Sprintf(`worker_processes 1;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log;
events { worker_connections 8192; }
http {
  access_log off;
  client_body_temp_path %[1]s/body; proxy_temp_path %[1]s/proxy; fastcgi_temp_path %[1]s/fcgi;
  uwsgi_temp_path %[1]s/uwsgi; scgi_temp_path %[1]s/scgi;
  limit_conn_zone $http_x_project zone=tenant:1m;
  limit_conn_zone $server_port zone=whole:1m;
  limit_conn_status 503;
  upstream up { server %[2]s; keepalive 256; }
  server {
    listen %[3]s;
    location / {
      limit_conn tenant %[4]d;
      limit_conn whole %[5]d;
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
}
`, dir, h.upLn.Addr().String(), addr, c, size)
	if err := os.WriteFile(filepath.Join(dir, "nginx.conf"), []byte(conf), 0o644); err != nil {
		h.Close()
		return nil, err
	}
	if err := startProcess(h, addr, bin, "-g", "daemon off;", "-e", filepath.Join(dir, "error.log"), "-p", dir, "-c", filepath.Join(dir, "nginx.conf")); err != nil {
		h.Close()
		return nil, err
	}
	h.url = "http://" + addr + "/"
	return h, nil
}

func newHTTPHAProxy(o Options, _ Workload) (System, error) {
	size := o.Pool
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		return nil, fmt.Errorf("haproxy: %w", ErrMissingTool)
	}
	h, err := newHTTPSystem(o.Service)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "compare-haproxy-")
	if err != nil {
		h.Close()
		return nil, err
	}
	h.stop = append(h.stop, func() { _ = os.RemoveAll(dir) })
	addr, err := freeAddr()
	if err != nil {
		h.Close()
		return nil, err
	}
	conf := fmt.Sprintf(`global
  maxconn 8192
defaults
  mode http
  timeout connect 5s
  timeout client 60s
  timeout server 60s
  timeout queue 60s
  option http-keep-alive
frontend fe
  bind %s
  default_backend be
backend be
  http-reuse always
  server up %s maxconn %d
`, addr, h.upLn.Addr().String(), size)
	if err := os.WriteFile(filepath.Join(dir, "haproxy.cfg"), []byte(conf), 0o644); err != nil {
		h.Close()
		return nil, err
	}
	if err := startProcess(h, addr, bin, "-db", "-f", filepath.Join(dir, "haproxy.cfg")); err != nil {
		h.Close()
		return nil, err
	}
	h.url = "http://" + addr + "/"
	return h, nil
}
