// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/internal/membership"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/policy"
)

// BenchmarkRegister100 is a second's worth of registrations at 100 a second
// on a node with 10,000 projects of 5 registered cgroups each (50,000, in
// the store): 100 concurrent Register calls (a CLI call each), each
// answered once its cgroup is in force. One op is the 100; the time must
// stay well inside a tick (1 s). Then they are removed, outside the timer.
func BenchmarkRegister100(b *testing.B) {
	d, top := bigNode(b)
	dirs := make([]string, 100)
	for i := range dirs {
		dirs[i] = testutil.MkCgroup(b, top, fmt.Sprintf("new%03d", i))
	}
	runLoop(b, d)
	var worst time.Duration
	b.ResetTimer()
	for range b.N {
		t0 := time.Now()
		var wg sync.WaitGroup
		for i, dir := range dirs {
			wg.Go(func() {
				reg, err := d.Register(context.Background(), fmt.Sprintf("new-%02d", i%20), []string{dir})
				if err != nil || reg.Pending {
					b.Errorf("%+v %v", reg, err)
				}
			})
		}
		wg.Wait()
		worst = max(worst, time.Since(t0))
		b.StopTimer()
		for i := range 20 {
			if _, err := d.Unregister(context.Background(), fmt.Sprintf("new-%02d", i), nil); err != nil {
				b.Fatal(err)
			}
		}
		b.StartTimer()
	}
	b.ReportMetric(float64(worst.Microseconds())/1000, "max-ms/op")
}

// BenchmarkApplySteady is the membership's share of a tick on that node
// when nothing changed: every source read again and compared with its last
// read, no union (the netns step is BenchmarkSweep's).
func BenchmarkApplySteady(b *testing.B) {
	d, _ := bigNode(b)
	ctx := context.Background()
	for b.Loop() {
		d.projects.apply(ctx, time.Now(), false)
	}
}

// bigNode is a daemon on a node with 10,000 projects of 5 registered
// cgroups each (50,000, in the store; their paths need not exist for the
// union) and no directory source.
func bigNode(b *testing.B) (*Daemon, string) {
	testutil.RequireRoot(b)
	top := testutil.TempCgroup(b, testutil.Cgroup2Mount(b), "fairshare-projects-bench-")
	state := b.TempDir()
	st, err := policy.Open(state, policy.Options{})
	if err != nil {
		b.Fatal(err)
	}
	var big []membership.Member
	for i := range 50_000 {
		big = append(big, membership.Member{Project: fmt.Sprintf("tenant-%05d", i/5),
			Cgroup: fmt.Sprintf("%s/kubepods/burstable/pod%08x-1f2e-4d3c-8b7a-%012x", top, i, i)})
	}
	if _, err := st.AddMembers(big, nil); err != nil {
		b.Fatal(err)
	}
	st.Close()
	d, _, _ := newTestDaemon(b, func(c *config.Config) {
		c.StateDir, c.ProjectsRoot, c.Tick = state, filepath.Join(top, "none"), time.Minute
	})
	if n := len(d.projects.membership().Members); n != 50_000 {
		b.Fatalf("%d members in force", n)
	}
	return d, top
}
