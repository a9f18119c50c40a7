// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/loader"
	"github.com/fairshare-dev/fairshare/metrics"
	"github.com/fairshare-dev/fairshare/policy"
	"github.com/fairshare-dev/fairshare/pools"
	"github.com/prometheus/client_golang/prometheus"
	bolt "go.etcd.io/bbolt"
)

// deadAddr is a loopback address nothing listens on.
func deadAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// An upstream outage under load: 1,499 requests fail in a row. The log says
// so in a handful of lines and a count, not one line per request (1,499
// WARN lines in a second before).
func TestUpstreamOutageLogIsSummarised(t *testing.T) {
	dir := t.TempDir()
	cfg := config.Default()
	cfg.BPF = false
	cfg.StateDir, cfg.AdminSocket = filepath.Join(dir, "state"), filepath.Join(dir, "admin.sock")
	cfg.Permits.Socket, cfg.Metrics.Listen = "", ""
	cfg.Front.Listen, cfg.Front.Upstream = "127.0.0.1:0", "http://"+deadAddr(t)
	cfg.Front.Routes = map[string]string{"outage.example": "alpha"}
	logs := &records{}
	d, err := New(Options{Config: cfg, Version: "test", Log: slog.New(logs)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go d.sched.Run(ctx)
	const n = 1499
	for range n {
		w := httptest.NewRecorder()
		d.front.ServeHTTP(w, httptest.NewRequest("GET", "http://outage.example/", nil))
		if w.Code != http.StatusBadGateway {
			t.Fatalf("answer %d, want 502", w.Code)
		}
	}
	d.Close()
	d.logrl.Flush()
	recs := logs.find("upstream error")
	written, suppressed := len(recs), 0
	for _, r := range recs {
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "suppressed" {
				suppressed += int(a.Value.Int64())
			}
			return true
		})
	}
	if written > 10 || suppressed == 0 || written+suppressed < n {
		t.Fatalf("%d lines written, %d counted as suppressed, for %d failures", written, suppressed, n)
	}
	t.Logf("%d failed requests: %d lines, the last saying %d more were not written", n, written, suppressed)
}

// Under churn (projects asking, holding, idling out, forgotten and coming
// back), every status and every scrape add up: each pool's in_use is the sum
// of its projects' held, its totals the sums of their counts plus the
// forgotten ones', and on /metrics the per-project series of a pool sum to
// its total. Before, forgetting dropped counts from the sums (+15/+12 after
// a minute of churn).
func TestStatusAndMetricsAddUpUnderChurn(t *testing.T) {
	d, clk, _ := newTestDaemon(t, func(c *config.Config) {
		c.Pools[config.PoolFlights] = config.Pool{Size: 16, Window: time.Second}
		c.Metrics.MaxProjects = 4
	})
	fl := d.others[config.PoolFlights]
	col := metrics.New(d.Status, 4, nil)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(col)
	rng := rand.New(rand.NewPCG(4, 2))
	var held []pools.Permit
	forgot := false
	for step := range 600 {
		switch r := rng.IntN(10); {
		case r < 5:
			if pm, err := fl.TryAcquire(fmt.Sprintf("p%d", rng.IntN(12))); err == nil {
				held = append(held, pm)
			}
		case r < 8 && len(held) > 0:
			i := rng.IntN(len(held))
			fl.Release(held[i])
			held = append(held[:i], held[i+1:]...)
		case r < 9:
			clk.Advance(500 * time.Millisecond)
			d.tick(clk.Now())
		default:
			for _, pm := range held {
				fl.Release(pm)
			}
			held = nil
			for range 3 {
				clk.Advance(time.Second)
				d.tick(clk.Now())
			}
			clk.Advance(2 * pools.DefaultForget)
			d.tick(clk.Now())
		}
		st := status(t, d)
		for _, p := range st.Pools {
			if err := p.Consistent(); err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
		}
		p := poolOf(t, st, config.PoolFlights)
		forgot = forgot || p.Forgotten.Projects > 0
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		var total, series float64
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				if len(m.GetLabel()) == 0 || m.GetLabel()[0].GetName() != "pool" || m.GetLabel()[0].GetValue() != config.PoolFlights {
					continue
				}
				switch mf.GetName() {
				case "fairshare_pool_admitted_total":
					total = m.GetCounter().GetValue()
				case "fairshare_project_admitted_total":
					series += m.GetCounter().GetValue()
				}
			}
		}
		if series != total || total != float64(p.Admitted) {
			t.Fatalf("step %d: /metrics project series sum to %v, pool total %v, status %d", step, series, total, p.Admitted)
		}
	}
	if !forgot {
		t.Fatal("no project was forgotten")
	}
}

// The kernel's pool keeps what entries the loader forgot had counted, and
// its rows add up within one read; active and share are the kernel's pair.
func TestKernelPoolAddsUp(t *testing.T) {
	b := kernelBook{last: map[uint64]kernelCounts{}}
	snap := func(ps ...loader.ProjectCounters) loader.Snapshot {
		return loader.Snapshot{Size: 64, Floor: 3, InUse: 999, Share: 1, Projects: ps}
	}
	s1 := snap(loader.ProjectCounters{Project: "a", CgroupID: 1, InUse: 2, Admitted: 10, Refused: 1},
		loader.ProjectCounters{CgroupID: 2, Admitted: 5, Refused: 4})
	b.note(s1)
	s2 := snap(loader.ProjectCounters{Project: "a", CgroupID: 1, InUse: 3, Admitted: 11, Refused: 1})
	b.note(s2)
	p := KernelPool(s2, 2, b.forgotten)
	if err := p.Consistent(); err != nil {
		t.Fatal(err)
	}
	if p.Admitted != 16 || p.Refused != 5 || p.InUse != 3 || p.Active != 2 || p.Share != 32 || p.Forgotten.Projects != 1 {
		t.Fatalf("pool %+v", p)
	}
}

// A problem found only when the parts are built is still the configuration's:
// the daemon reports it as config.ErrInvalid (exit 2), naming the key.
func TestPartErrorsAreConfigErrors(t *testing.T) {
	dir := t.TempDir()
	base := func() config.Config {
		cfg := config.Default()
		cfg.BPF = false
		cfg.StateDir, cfg.AdminSocket = filepath.Join(dir, "state"), filepath.Join(dir, "admin.sock")
		cfg.Metrics.Listen = ""
		cfg.Permits.Socket = filepath.Join(dir, "permits.sock")
		return cfg
	}
	cfg := base()
	cfg.Permits.Group = "no-such-group-fairshare-test"
	if _, err := New(Options{Config: cfg}); !errors.Is(err, config.ErrInvalid) || !strings.Contains(err.Error(), "permits.group") {
		t.Errorf("unknown group: %v", err)
	}
	cfg = base()
	cfg.Front.Listen, cfg.Front.Upstream = "127.0.0.1:0", "http://127.0.0.1:1"
	cfg.Front.TrustedPeers = []string{"/not/under/the/cgroup/mount"}
	cfg.ProjectsRoot = "/sys/fs/cgroup/fairshare"
	if _, err := New(Options{Config: cfg}); !errors.Is(err, config.ErrInvalid) || !strings.Contains(err.Error(), "front") {
		t.Errorf("trusted cgroup outside the mount: %v", err)
	}
}

// The caps fit the open-files limit with room for the daemon, the upstream,
// /metrics and the admin socket, whichever listeners are on; a configured
// cap beyond that is flagged.
func TestBudgetCapsFit(t *testing.T) {
	cfg := config.Default()
	cfg.Front.Listen, cfg.Front.Socket, cfg.Front.Upstream = "127.0.0.1:0", "/run/f.sock", "http://x"
	for _, nofile := range []uint64{1024, 20000, 524288} {
		c := BudgetCaps(cfg, nofile)
		used := 3*c.PerListener + c.Admin + c.Metrics + fdOwn
		if c.Over || uint64(used) > nofile || c.PerUID > c.PerListener/4 || c.PerUID < 1 {
			t.Errorf("nofile %d: %+v uses %d", nofile, c, used)
		}
	}
	cfg.Listeners.MaxConns = 5000
	if c := BudgetCaps(cfg, 1024); !c.Over || c.PerListener != 5000 {
		t.Errorf("a configured cap past the limit: %+v", c)
	}
}

// A rate an older version stored below today's minimum (1e-12 passed
// validation once) is written back at the minimum the buckets enforce, with
// a warning naming the project, and a later 'policy set' of another field
// works. Before, the store kept showing 1e-12 while 0.001 was enforced, and
// every patch of the project failed validation on the rate it did not touch.
func TestStoredRatesBroughtInBounds(t *testing.T) {
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	st, err := policy.Open(state, policy.Options{})
	if err != nil {
		t.Fatal(err)
	}
	st.Close()
	db, err := bolt.Open(filepath.Join(state, policy.FileName), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket([]byte("policies")).Put([]byte("slow"), []byte(`{"tier":"pro","shares":2,"requests_per_sec":1e-12,"work_per_sec":5e12}`))
	})
	db.Close()
	if err != nil {
		t.Fatal(err)
	}
	d, _, logs := newTestDaemon(t, func(c *config.Config) { c.StateDir = state })
	want := policy.Policy{Tier: "pro", Shares: 2, RequestsPerSec: policy.MinRate, WorkPerSec: policy.MaxRate}
	if p, _, err := d.store.Get("slow"); err != nil || p != want {
		t.Errorf("stored %+v (%v), want %+v", p, err, want)
	}
	if r := d.rates.State("slow"); r.Limits.RequestsPerSec != policy.MinRate {
		t.Errorf("enforced %+v", r.Limits)
	}
	if w := logs.find("stored policy was out of bounds; stored and enforced within them"); len(w) != 1 {
		t.Errorf("%d warnings, want 1", len(w))
	}
	shares := 3
	if _, err := d.PatchPolicy("slow", policy.Patch{Shares: &shares}); err != nil {
		t.Errorf("policy set --shares after the repair: %v", err)
	}
}
