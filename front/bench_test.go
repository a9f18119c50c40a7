// SPDX-License-Identifier: Apache-2.0

package front

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/pools"
	"github.com/fairshare-dev/fairshare/scheduler"
)

// loadResult is one closed-loop load run.
type loadResult struct {
	rps      float64
	p50, p99 time.Duration
	errors   int
}

// closedLoop runs conc clients against url for dur, each sending the next
// request as soon as the previous answer is read.
func closedLoop(url string, conc int, dur time.Duration) loadResult {
	tr := &http.Transport{MaxIdleConnsPerHost: conc, MaxConnsPerHost: conc, DisableCompression: true}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	var (
		mu   sync.Mutex // guards lats and errs
		lats []time.Duration
		errs int
		wg   sync.WaitGroup
	)
	deadline := time.Now().Add(dur)
	for range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			mine := make([]time.Duration, 0, 4096)
			bad := 0
			for time.Now().Before(deadline) {
				req, _ := http.NewRequest(http.MethodGet, url, nil)
				req.Header.Set(DefaultProjectHeader, "bench")
				t0 := time.Now()
				resp, err := client.Do(req)
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
			mu.Lock()
			lats = append(lats, mine...)
			errs += bad
			mu.Unlock()
		}()
	}
	wg.Wait()
	slices.Sort(lats)
	r := loadResult{rps: float64(len(lats)) / dur.Seconds(), errors: errs}
	if len(lats) > 0 {
		r.p50 = lats[len(lats)/2]
		r.p99 = lats[min(len(lats)-1, len(lats)*99/100)]
	}
	return r
}

// benchUpstream serves a two-byte body after service (0 = at once).
func benchUpstream(b *testing.B, service time.Duration) string {
	b.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		if service > 0 {
			time.Sleep(service)
		}
		_, _ = io.WriteString(w, "ok")
	})}
	go func() { _ = srv.Serve(l) }()
	b.Cleanup(func() { _ = srv.Close() })
	return "http://" + l.Addr().String()
}

// benchFront is the front with a pool too big to refuse anything, in front
// of upstream; withSched adds the scheduler (the full front) or leaves it out
// (pool and rate buckets only), to show what the scheduler's dispatch costs.
func benchFront(b *testing.B, upstream string, withSched bool) string {
	b.Helper()
	pool, err := pools.New(pools.Config{Name: "requests", Size: 100000}, nil)
	if err != nil {
		b.Fatal(err)
	}
	deps := Deps{Requests: pool, Rates: pools.NewRates(nil)}
	if withSched {
		sched, err := scheduler.New(scheduler.Config{MaxInFlight: 1024}, nil)
		if err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); _ = sched.Run(ctx) }()
		b.Cleanup(func() { cancel(); <-done })
		deps.Sched = sched
	}
	f, err := New(Config{Upstream: upstream, MaxInFlight: 1024}, deps)
	if err != nil {
		b.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	srv := f.Server()
	go func() { _ = srv.Serve(l) }()
	b.Cleanup(func() { _ = srv.Close(); f.CloseIdle() })
	return "http://" + l.Addr().String()
}

// benchNginx starts nginx on loopback proxying upstream with keep-alive and a
// limit_conn per project that never bites, or returns "" when nginx is not
// installed.
func benchNginx(b *testing.B, upstream string) string {
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
		return ""
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	dir := b.TempDir()
	conf := fmt.Sprintf(`worker_processes 2;
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
`, dir, upstream[len("http://"):], addr)
	path := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command(bin, "-p", dir, "-c", path)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatalf("starting nginx: %v", err)
	}
	b.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		_ = cmd.Wait()
	})
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
	return "http://" + addr
}

// BenchmarkOverhead measures the front against going straight to the
// upstream, and nginx doing the same proxying with limit_conn, in one run,
// each target loaded by the same in-process closed-loop generator for the
// same time (all of it on this machine's cores: generator, proxy and
// upstream compete for CPU, as they would on a node).
//
//	saturating: 32 clients, an upstream that answers at once (throughput)
//	moderate:   8 clients, an upstream with 5ms of service, so the cores are
//	            not saturated (added p99, throughput should match direct)
//
// Targets, one after the other for the same time: direct, front (pool, rates
// and scheduler), nosched (the front without the scheduler), nginx. Reported:
// req/s and p99 per target, each target's throughput as a ratio of direct,
// front/nginx, and the p99 the front adds over direct.
func BenchmarkOverhead(b *testing.B) {
	dur := 2 * time.Second
	if s := os.Getenv("FAIRSHARE_BENCH_SECONDS"); s != "" {
		if d, err := time.ParseDuration(s + "s"); err == nil {
			dur = d
		}
	}
	for _, lv := range []struct {
		name    string
		conc    int
		service time.Duration
	}{{"saturating", 32, 0}, {"moderate", 8, 5 * time.Millisecond}} {
		b.Run(lv.name, func(b *testing.B) {
			up := benchUpstream(b, lv.service)
			targets := []struct{ name, url string }{
				{"direct", up},
				{"front", benchFront(b, up, true)},
				{"nosched", benchFront(b, up, false)},
			}
			if ngx := benchNginx(b, up); ngx != "" {
				targets = append(targets, struct{ name, url string }{"nginx", ngx})
			} else {
				b.Log("nginx is not installed (apt-get install -y nginx): skipping the nginx comparison")
			}
			// Warm connections and code paths.
			for _, tg := range targets {
				closedLoop(tg.url, lv.conc, 200*time.Millisecond)
			}
			b.ResetTimer()
			for range b.N {
				res := map[string]loadResult{}
				for _, tg := range targets {
					r := closedLoop(tg.url, lv.conc, dur)
					if r.errors > 0 {
						b.Errorf("%s: %d errors", tg.name, r.errors)
					}
					res[tg.name] = r
					b.ReportMetric(r.rps, tg.name+"-req/s")
					b.ReportMetric(float64(r.p99.Microseconds()), tg.name+"-p99-us")
					if tg.name != "direct" {
						b.ReportMetric(r.rps/res["direct"].rps, tg.name+"/direct")
					}
				}
				b.ReportMetric(float64((res["front"].p99 - res["direct"].p99).Microseconds()), "front-added-p99-us")
				if n, ok := res["nginx"]; ok {
					b.ReportMetric(res["front"].rps/n.rps, "front/nginx")
				}
			}
			b.ReportMetric(0, "ns/op")
		})
	}
}
