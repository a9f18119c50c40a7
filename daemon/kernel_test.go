// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/loader"
	"github.com/fairshare-dev/fairshare/metrics"
)

// The kernel's node-wide event counters reach the kernel's pool in status,
// and /metrics from there, as the snapshot has them.
func TestKernelPoolEvents(t *testing.T) {
	s := loader.Snapshot{Size: 4, Floor: 1,
		Events: loader.Events{Adopted: 1, Late: 2, Unaccounted: 3, Expired: 4, MapFull: 5, AdmittedIn: 9, Released: 8}}
	p := KernelPool(s, 0, admin.Forgotten{})
	want := admin.KernelEvents{Adopted: 1, Late: 2, Unaccounted: 3, Expired: 4, MapFull: 5}
	if p.KernelEvents == nil || *p.KernelEvents != want {
		t.Fatalf("kernel events %+v, want %+v", p.KernelEvents, want)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(metrics.New(func(context.Context) (admin.Status, error) {
		return admin.Status{Kernel: true, Pools: []admin.Pool{p}}, nil
	}, 4, nil))
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "fairshare_kernel_events_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "event" {
					got[l.GetValue()] = m.GetCounter().GetValue()
				}
			}
		}
	}
	for event, n := range map[string]float64{"adopted": 1, "late": 2, "unaccounted": 3, "expired": 4, "map_full": 5} {
		if got[event] != n {
			t.Errorf("fairshare_kernel_events_total{event=%q} = %v, want %v (all: %v)", event, got[event], n, got)
		}
	}
}

// A growth of the kernel's map_full counter is warned of at most once a
// minute, with the growth since the last warning; the first reading (what
// the pins counted before the daemon started) is only noted.
func TestWarnFullOncePerMinute(t *testing.T) {
	var logs bytes.Buffer
	k := &kernelSide{log: slog.New(slog.NewTextHandler(&logs, nil)), pinDir: "/sys/fs/bpf/fairshare"}
	t0 := time.Unix(1700000000, 0)
	warnings := func() []string {
		var out []string
		for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
			if strings.Contains(line, "a kernel table is full") {
				out = append(out, line)
			}
		}
		return out
	}
	for _, step := range []struct {
		at      time.Duration
		mapFull uint64
		want    string // the warning's counts, "" none
	}{
		{0, 7, ""}, // before the start: noted
		{time.Second, 7, ""},
		{2 * time.Second, 10, "grew=3 map_full_total=10"},
		{30 * time.Second, 15, ""}, // within the minute
		{61 * time.Second, 16, ""},
		{62 * time.Second, 19, "grew=9 map_full_total=19"},
		{5 * time.Minute, 19, ""}, // no growth
	} {
		logs.Reset()
		k.warnFull(step.mapFull, t0.Add(step.at))
		w := warnings()
		switch {
		case step.want == "" && len(w) != 0:
			t.Errorf("at %s, map_full %d: warned %q", step.at, step.mapFull, w)
		case step.want != "" && (len(w) != 1 || !strings.Contains(w[0], step.want) ||
			!strings.Contains(w[0], "pools.connections.size") || !strings.Contains(w[0], "level=WARN")):
			t.Errorf("at %s, map_full %d: warned %q, want one warning with %q naming pools.connections.size",
				step.at, step.mapFull, w, step.want)
		}
	}
}
