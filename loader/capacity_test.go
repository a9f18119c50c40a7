// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// bigNode makes projects cgroups below root, each with per-1 children, and
// returns the members: every project cgroup and every child, registered to
// the project (nesting within one project is allowed). The cgroups are made
// by 8 goroutines (a cgroup2 mkdir costs ~0.2 ms of kernel time) and go with
// root.
func bigNode(t testing.TB, root string, projects, per int) []Member {
	t.Helper()
	ms := make([]Member, 0, projects*per)
	for p := range projects {
		dir := filepath.Join(root, fmt.Sprintf("p%05d", p))
		name := fmt.Sprintf("proj-%05d", p)
		ms = append(ms, Member{Project: name, Cgroup: dir})
		for c := 1; c < per; c++ {
			ms = append(ms, Member{Project: name, Cgroup: filepath.Join(dir, fmt.Sprintf("c%d", c))})
		}
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for p := w; p < projects; p += 8 {
				for c := range per {
					if err := os.Mkdir(ms[p*per+c].Cgroup, 0o755); err != nil {
						errs <- err
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
	return ms
}

// Capacity: 10,000 projects and 50,000 registered cgroups fit the tables
// sized for them, are applied in one call and kept by an idempotent one; one
// project more and one member more are refused with the reason, and the
// connections of a member deep in the set count for its project.
func TestCapacity(t *testing.T) {
	testutil.RequireRoot(t)
	if testing.Short() {
		t.Skip("makes 50,000 cgroups")
	}
	root, pin := newRoot(t), newPinDir(t)
	const projects, per = 10000, 5
	start := time.Now()
	ms := bigNode(t, root, projects, per)
	extra := mkdirs(t, root, "extra", "p00000/more")
	t.Logf("%d cgroups made in %s", len(ms)+2, time.Since(start).Round(time.Millisecond))
	o := rootOptions(t, root, Options{PinDir: pin, PoolSize: 100, Floor: 1, MaxProjects: projects + 1, MaxMembers: projects * per})
	o.MaxDepth = 2
	l, err := Open(o)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()

	start = time.Now()
	rep, err := l.SetMembers(ms)
	if err != nil || rep.Added != len(ms) || len(rep.Refused) != 0 {
		t.Fatalf("%d members: added %d, refused %d (%v), %v", len(ms), rep.Added, len(rep.Refused), rep.Refused[:min(3, len(rep.Refused))], err)
	}
	t.Logf("SetMembers of %d members, %d projects: %s", len(ms), projects, time.Since(start).Round(time.Millisecond))
	if rep, err = l.SetMembers(ms); err != nil || rep.Kept != len(ms) || rep.Added+rep.Removed != 0 {
		t.Fatalf("again: %+v %v", rep, err)
	}
	got, err := l.Members()
	if err != nil || len(got) != len(ms) {
		t.Fatalf("Members: %d %v", len(got), err)
	}
	if s := snap(t, l); len(s.Projects) != projects {
		t.Fatalf("%d projects in the snapshot", len(s.Projects))
	}

	// The tables are full: one project more, one member more.
	more := append(append([]Member(nil), ms...), Member{Project: "one-too-many", Cgroup: extra[0]})
	rep, err = l.SetMembers(more)
	if err != nil || len(rep.Refused) != 1 || !strings.Contains(rep.Refused[0].Reason, "no room for another project") {
		t.Fatalf("a project over the table: %+v %v", rep.Refused, err)
	}
	more[len(more)-1] = Member{Project: "proj-00000", Cgroup: extra[1]}
	rep, err = l.SetMembers(more)
	if err != nil || len(rep.Refused) != 1 || !strings.Contains(rep.Refused[0].Reason, "no room for another member") {
		t.Fatalf("a member over the table: %+v %v", rep.Refused, err)
	}

	// A member deep in the set counts for its project.
	deep := ms[len(ms)-1]
	ln := sink(t, "tcp4", "127.0.0.1:0")
	h := startHelper(t, deep.Cgroup)
	if r := h.dial("tcp4", ln.Addr().String(), 3); r.ok != 3 {
		t.Fatal(r)
	}
	waitInUse(t, l, 3, map[string]int{deep.Project: 3})
	h.do("close")
	waitInUse(t, l, 0, map[string]int{deep.Project: 0})
}

// BenchmarkSetMembers is the kernel side's share of the registrations of a
// tick on a node with 50,000 members in 10,000 projects: "steady" applies
// the same set (the tick with nothing new), "add100" adds 100 new members
// (100 registrations in a second) and removes them again, one call each.
func BenchmarkSetMembers(b *testing.B) {
	testutil.RequireRoot(b)
	root, pin := newRoot(b), newPinDir(b)
	ms := bigNode(b, root, 10000, 5)
	adds := make([]string, 100)
	for i := range adds {
		adds[i] = fmt.Sprintf("new/n%03d", i)
	}
	news := mkdirs(b, root, adds...)
	o := rootOptions(b, root, Options{PinDir: pin, PoolSize: 100})
	o.MaxDepth = 2
	l, err := Open(o)
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	if _, err := l.SetMembers(ms); err != nil {
		b.Fatal(err)
	}
	with := append([]Member(nil), ms...)
	for i, p := range news {
		with = append(with, Member{Project: fmt.Sprintf("new-%03d", i), Cgroup: p})
	}
	b.Run("steady", func(b *testing.B) {
		for b.Loop() {
			if rep, err := l.SetMembers(ms); err != nil || rep.Added+rep.Removed != 0 {
				b.Fatalf("%+v %v", rep, err)
			}
		}
	})
	b.Run("add100", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if rep, err := l.SetMembers(with); err != nil || rep.Added != 100 {
				b.Fatalf("%+v %v", rep.Added, err)
			}
			b.StopTimer()
			if rep, err := l.SetMembers(ms); err != nil || rep.Removed != 100 {
				b.Fatalf("%+v %v", rep.Removed, err)
			}
			b.StartTimer()
		}
	})
}
