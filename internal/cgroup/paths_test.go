// SPDX-License-Identifier: Apache-2.0

package cgroup_test

import (
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// stepClock is a clock the test moves.
type stepClock struct{ ns atomic.Int64 }

func (c *stepClock) Now() time.Time      { return time.Unix(0, c.ns.Load()) }
func (c *stepClock) add(d time.Duration) { c.ns.Add(int64(d)) }

// Paths answers from what it kept within its ttl, asks the kernel again
// after it, and keeps no error: a removed cgroup is an error once its ttl
// is over. That a cgroup's path cannot change under it (cgroup2 refuses
// renames) is checked too: Paths relies on it.
func TestPathsKept(t *testing.T) {
	testutil.RequireRoot(t)
	root := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-paths-")
	dir := testutil.MkCgroup(t, root, "a")
	id, err := cgroup.ID(dir)
	if err != nil {
		t.Fatal(err)
	}
	clk := &stepClock{}
	p := cgroup.NewPaths(mountOf(t), time.Second, clk)
	if got, err := p.PathOf(id); got != dir || err != nil {
		t.Fatalf("PathOf = %q, %v; want %s", got, err, dir)
	}
	if err := os.Rename(dir, filepath.Join(root, "b")); err == nil {
		t.Fatal("cgroup2 renamed a cgroup: a kept path can be stale")
	}
	clk.add(time.Second)
	if got, err := p.PathOf(id); got != dir || err != nil {
		t.Errorf("after the ttl: %q, %v; want %s", got, err, dir)
	}
	// Concurrent askers (run with -race).
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 100 {
				if got, err := p.PathOf(id); got != dir || err != nil {
					t.Errorf("concurrent PathOf = %q, %v", got, err)
					return
				}
			}
		})
	}
	wg.Wait()
	testutil.RemoveCgroup(t, dir)
	if got, _ := p.PathOf(id); got != dir {
		t.Errorf("removed within the ttl: %q, want the kept %s", got, dir)
	}
	clk.add(time.Second)
	for i := range 2 {
		if got, err := p.PathOf(id); err == nil {
			t.Fatalf("ask %d after the removal: %q", i, got)
		}
	}
}

// BenchmarkPathOf: the kernel's answer (Mount.PathOf) against a kept one
// (Paths.PathOf within its ttl).
func BenchmarkPathOf(b *testing.B) {
	testutil.RequireRoot(b)
	root := testutil.TempCgroup(b, testutil.Cgroup2Mount(b), "fairshare-paths-")
	id, err := cgroup.ID(root)
	if err != nil {
		b.Fatal(err)
	}
	m, err := cgroup.FindMount()
	if err != nil {
		b.Fatal(err)
	}
	b.Run("kernel", func(b *testing.B) {
		for b.Loop() {
			if _, err := m.PathOf(id); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("kept", func(b *testing.B) {
		p := cgroup.NewPaths(m, time.Hour, nil)
		for b.Loop() {
			if _, err := p.PathOf(id); err != nil {
				b.Fatal(err)
			}
		}
	})
}
