// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"fmt"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// BenchmarkSnapshot is what a status snapshot and a control-loop Tick cost,
// both with the limiter's lock held, on a node of 16 projects with the
// projects table at its default size (DefaultMaxProjects entries), for a
// pool of 64 and of 4096 (the permit and reservation tables are sized by
// the pool).
func BenchmarkSnapshot(b *testing.B) {
	testutil.RequireRoot(b)
	for _, pool := range []uint32{64, 4096} {
		root, pin := newRoot(b), newPinDir(b)
		l := openLimiter(b, root, pin, pool, 1)
		for i := range 16 {
			mkProject(b, root, fmt.Sprintf("p%02d", i))
		}
		if got := l.objs.FsProjects.MaxEntries(); got != DefaultMaxProjects {
			b.Fatalf("projects table of %d entries, want the default %d", got, DefaultMaxProjects)
		}
		b.Run(fmt.Sprintf("snapshot/pool=%d", pool), func(b *testing.B) {
			for b.Loop() {
				s, err := l.Snapshot()
				if err != nil {
					b.Fatal(err)
				}
				if len(s.Projects) != 16 {
					b.Fatalf("%d projects in the snapshot, want 16", len(s.Projects))
				}
			}
		})
		b.Run(fmt.Sprintf("tick/pool=%d", pool), func(b *testing.B) {
			for b.Loop() {
				if err := l.Tick(time.Now()); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestSnapshotReadsIDsInUse: a snapshot reads the projects table only up
// to the highest id given, yet sees every project, and an id that an
// earlier run gave and still counts (its name gone) is seen after a
// restart.
func TestSnapshotReadsIDsInUse(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l1 := openLimiter(t, root, pin, 8, 1)
	for i := range 3 {
		mkProject(t, root, fmt.Sprintf("p%d", i))
	}
	if l1.projHigh != 3 {
		t.Errorf("highest id %d after 3 projects, want 3", l1.projHigh)
	}
	if s := snap(t, l1); len(s.Projects) != 3 {
		t.Fatalf("snapshot of 3 projects: %+v", s.Projects)
	}
	// A leftover of an earlier run: id 200, no name, refusals counted.
	if err := l1.objs.FsProjects.Put(uint32(200), limiterFsProject{Refused: 7}); err != nil {
		t.Fatal(err)
	}
	if err := l1.Close(); err != nil {
		t.Fatal(err)
	}
	l2, err := Open(rootOptions(t, root, Options{PinDir: pin, PoolSize: 8, Floor: 1}))
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	defer l2.objs.FsProjects.Put(uint32(200), limiterFsProject{})
	if l2.projHigh != 200 {
		t.Errorf("highest id %d after a restart with id 200 counting, want 200", l2.projHigh)
	}
	s := snap(t, l2)
	found := false
	for _, p := range s.Projects {
		found = found || p.ID == 200 && p.Refused == 7
	}
	if !found || len(s.Projects) != 4 {
		t.Errorf("after a restart: %+v, want p0-p2 and id 200", s.Projects)
	}
}
