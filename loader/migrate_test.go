// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// oldLayout makes pins as the version before 86ff0ff made them: its maps
// were not mmapable (that commit made the destination tables a matching
// connect reads so), which this version cannot reuse. (The tests check
// that the start migrated: a version with no mmapable map left would need
// another difference here.)
func oldLayout(spec *ebpf.CollectionSpec) {
	for _, ms := range spec.Maps {
		ms.Flags &^= unix.BPF_F_MMAPABLE
	}
}

// fullOld is pins of the old layout (openOld) whose pool a project's
// helper (holder) fills with connections to a sink at addr; prober is a
// second helper in the same project, to connect while the pins migrate.
func fullOld(t *testing.T, pool uint32) (root, pin, addr string, holder, prober *helper, oldProgs []ebpf.ProgramID) {
	t.Helper()
	root, pin = newRoot(t), newPinDir(t)
	addr = sink(t, "tcp4", "127.0.0.1:0").Addr().String()
	dir := mkProject(t, root, "a")
	holder, prober = startHelper(t, dir), startHelper(t, dir)
	oldProgs = openOld(t, root, pin, pool, func() {
		if r := holder.dial("tcp4", addr, int(pool)); r.ok != int(pool) {
			t.Fatalf("filling the pool under the old layout: %+v", r)
		}
	})
	return root, pin, addr, holder, prober, oldProgs
}

// openOld opens a limiter on pin with the old layout (oldLayout), as the
// daemon of the previous version did, and closes it again: what it leaves
// pinned enforces on its own, as when that daemon is stopped for the
// upgrade. It returns the ids of the old programs its links run.
func openOld(t *testing.T, root, pin string, pool uint32, hold func()) []ebpf.ProgramID {
	t.Helper()
	specEdit = oldLayout
	defer func() { specEdit = nil }()
	l, err := openRoot(t, root, Options{PinDir: pin, PoolSize: pool})
	if err != nil {
		t.Fatal(err)
	}
	hold()
	var ids []ebpf.ProgramID
	for _, lk := range l.links {
		info, err := lk.Info()
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, info.Program)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return ids
}

// An upgrade whose maps have another layout migrates by itself: the start
// succeeds, the held connections are counted in the new maps (the pool
// refuses past its size counting them), a project connecting in a loop all
// through the migration is never admitted past the rule, the old programs
// are detached and their pins gone, permits come back exactly, and the next
// start reuses the new pins.
func TestMigrateFromAnotherLayout(t *testing.T) {
	testutil.RequireRoot(t)
	const pool = 5
	root, pin, addr, holder, prober, oldProgs := fullOld(t, pool)
	// The old pins alone enforce: the pool is full.
	if r := prober.dial("tcp4", addr, 1); r.refused != 1 {
		t.Fatalf("under the old pins, daemon stopped: %+v, want refused", r)
	}
	if _, err := Check(rootOptions(t, root, Options{PinDir: pin, PoolSize: pool})); err != nil {
		t.Fatalf("check on pins of another layout: %v", err)
	}

	// When the new maps have counted the live connections, the old
	// programs must still run on every hook the kernel can list: a gap of
	// a few milliseconds would slip between the prober's connects.
	var stillAttached error
	migrateFault = func(step string) error {
		if step == "counted" {
			stillAttached = attachedIn(t, oldProgs)
		}
		return nil
	}
	t.Cleanup(func() { migrateFault = func(string) error { return nil } })

	// The prober connects in a loop from before the start until after it:
	// the pool is full all along, so every connect must be refused.
	type churned struct{ r churnResult }
	done := make(chan churned, 1)
	go func() { done <- churned{prober.churn("tcp4", addr, 3*time.Second, 200*time.Microsecond)} }()
	time.Sleep(300 * time.Millisecond)
	var logged testutil.Buffer
	began := time.Now()
	// A destination pool over the held connections' address: the
	// migration counts them in it too (TestDestPoolAdoptsExisting).
	dbs := []DestPool{destPoolOf(t, "db", pool, 1, strings.Replace(addr, ":", "/32:", 1))}
	l, err := openRoot(t, root, Options{PinDir: pin, PoolSize: pool, DestPools: dbs, Logger: slog.New(slog.NewTextHandler(&logged, nil))})
	if err != nil {
		t.Fatalf("start on pins of another layout: %v", err)
	}
	t.Logf("the start that migrated took %v", time.Since(began))
	t.Cleanup(func() { l.Close() })
	c := <-done
	if c.r.ok() != 0 || c.r.refused == 0 {
		t.Fatalf("connecting through the migration with the pool full: %d admitted, %d refused, %d failed otherwise; want none admitted",
			c.r.ok(), c.r.refused, c.r.other)
	}
	if l.mig == nil || l.reused {
		t.Fatalf("the start did not migrate (mig %v, reused %v)", l.mig, l.reused)
	}
	if stillAttached != nil {
		t.Fatalf("when the new maps had counted the connections: %v", stillAttached)
	}
	var warned string
	for _, line := range strings.Split(logged.String(), "\n") {
		if strings.Contains(line, `level=WARN msg="migrated from pins of another layout`) {
			warned = line
		}
	}
	// Past the rule or not depends on the active count at that moment (a
	// project counted twice until a Tick, pool_seen): any count, said.
	if !regexp.MustCompile(fmt.Sprintf(`adopted=%d adopted_past_rule=[0-9]+ `, pool)).MatchString(warned) || !strings.Contains(warned, "rate tokens") {
		t.Fatalf("the migration's warning %q; want it to say the %d connections counted and what was lost\n%s", warned, pool, logged.String())
	}
	t.Log(warned)
	// The start's report, which a daemon publishes, says it too.
	if sr := l.StartReport(); sr.Adopted != pool || sr.Held["a"] != pool || sr.Dests["db"] != pool {
		t.Fatalf("the start's report %+v; want the %d held connections adopted and held, in db too", sr, pool)
	}
	s := snap(t, l)
	if s.InUse != pool || project(s, "a").InUse != pool {
		t.Fatalf("after the migration: node in_use %d, project %+v; want the %d held connections counted", s.InUse, project(s, "a"), pool)
	}
	if d := destSnap(t, l, "db"); d.InUse != pool || destProj(d, "a").InUse != pool {
		t.Fatalf("after the migration: destination pool %+v; want the %d held connections counted", d, pool)
	}
	if r := prober.dial("tcp4", addr, 1); r.refused != 1 {
		t.Fatalf("after the migration: %+v, want refused (the held connections fill the pool)", r)
	}
	// The new layout is pinned, nothing of the old or of the migration is
	// left, and the old programs are detached (freed: no link holds them).
	for _, d := range []string{stagingDir, readyDir} {
		if _, err := os.Stat(filepath.Join(pin, d)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s left in the pin directory (%v)", d, err)
		}
	}
	spec, err := l.spec()
	if err != nil {
		t.Fatal(err)
	}
	if why, err := l.incompatible(spec); err != nil || why != "" {
		t.Fatalf("pins after the migration: %q, %v; want this version's layout", why, err)
	}
	oldGone(t, oldProgs)

	// Permits come back exactly.
	holder.do("close")
	waitInUse(t, l, 0, map[string]int{"a": 0})
	if r := holder.dial("tcp4", addr, pool); r.ok != pool {
		t.Fatalf("after the releases: %+v, want the whole pool", r)
	}
	if r := prober.dial("tcp4", addr, 1); r.refused != 1 {
		t.Fatalf("pool full again: %+v, want refused", r)
	}

	// The next start reuses the new pins.
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	l2 := openLimiter(t, root, pin, pool, 0)
	if !l2.reused || l2.mig != nil {
		t.Fatalf("second start: reused %v, migrated %v; want the pins reused", l2.reused, l2.mig != nil)
	}
	if s := snap(t, l2); s.InUse != pool {
		t.Fatalf("second start: in_use %d, want %d", s.InUse, pool)
	}
	holder.do("close")
	waitInUse(t, l2, 0, map[string]int{"a": 0})
}

// A migration that fails before its commit removes its pins and leaves the
// old ones enforcing; a process killed before the commit leaves the staging
// pins, which the next start discards before it migrates again; one killed
// after it (or while it moves them) leaves the new pins, which the next
// start moves in place. Each
// way, enforcement never stops, the counts are right after the next start,
// and nothing is left over.
func TestMigrateInterrupted(t *testing.T) {
	testutil.RequireRoot(t)
	for _, tc := range []struct {
		name, step string
		crash      bool   // the process dies at step; else Open fails there
		left       string // the directory the interruption leaves
	}{
		{"failed-before-commit", "counted", false, ""},
		{"killed-before-commit", "counted", true, stagingDir},
		{"killed-after-commit", "committed", true, readyDir},
		{"killed-while-installing", "installing", true, readyDir},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const pool = 4
			root, pin, addr, holder, prober, oldProgs := fullOld(t, pool)
			if tc.crash {
				crashMigration(t, tc.step, root, pin, pool)
			} else {
				fail := errors.New("fault")
				migrateFault = func(s string) error {
					if s == tc.step {
						return fail
					}
					return nil
				}
				_, err := openRoot(t, root, Options{PinDir: pin, PoolSize: pool})
				migrateFault = func(string) error { return nil }
				if !errors.Is(err, fail) {
					t.Fatalf("interrupted start: %v, want the fault", err)
				}
			}
			for _, d := range []string{stagingDir, readyDir} {
				if _, err := os.Stat(filepath.Join(pin, d)); (err == nil) != (d == tc.left) {
					t.Fatalf("after the interruption: %s present %v, want %v", d, err == nil, d == tc.left)
				}
			}
			step := tc.name
			// The killed process's programs, attached by the links it
			// pinned: gone once the next start has discarded or taken
			// up its pins (a taken-up link runs that start's programs).
			if tc.left != "" {
				ents, _ := os.ReadDir(filepath.Join(pin, tc.left))
				for _, e := range ents {
					if lk, err := link.LoadPinnedLink(filepath.Join(pin, tc.left, e.Name()), nil); err == nil {
						if info, err := lk.Info(); err == nil {
							oldProgs = append(oldProgs, info.Program)
						}
						lk.Close()
					}
				}
			}
			// Enforcing meanwhile: the old programs, or both.
			if r := prober.dial("tcp4", addr, 1); r.refused != 1 {
				t.Fatalf("after a crash at %s: %+v, want refused", step, r)
			}
			l := openLimiter(t, root, pin, pool, 0)
			if s := snap(t, l); s.InUse != pool || project(s, "a").InUse != pool {
				t.Fatalf("start after a crash at %s: in_use %d, project %+v; want %d", step, s.InUse, project(s, "a"), pool)
			}
			if r := prober.dial("tcp4", addr, 1); r.refused != 1 {
				t.Fatalf("start after a crash at %s: %+v, want refused", step, r)
			}
			for _, d := range []string{stagingDir, readyDir} {
				if _, err := os.Stat(filepath.Join(pin, d)); err == nil {
					t.Errorf("%s left after the start that followed a crash at %s", d, step)
				}
			}
			// Each hook's pin runs this start's program, and the old
			// programs are detached.
			for _, a := range l.attachments(l.root, &l.objs) {
				lk, err := link.LoadPinnedLink(filepath.Join(pin, a.name), nil)
				if err != nil {
					t.Fatalf("%s: %v", a.name, err)
				}
				li, err := lk.Info()
				lk.Close()
				pi, _ := a.prog.Info()
				id, _ := pi.ID()
				if err != nil || li.Program != id {
					t.Fatalf("%s runs program %d (%v), want this start's %d", a.name, li.Program, err, id)
				}
			}
			oldGone(t, oldProgs)
			holder.do("close")
			waitInUse(t, l, 0, map[string]int{"a": 0})
		})
	}
}

// oldGone waits for the programs ids to be freed: no link runs them.
func oldGone(t *testing.T, ids []ebpf.ProgramID) {
	t.Helper()
	eventually(t, "the old programs detached", func() (bool, string) {
		for _, id := range ids {
			if p, err := ebpf.NewProgramFromID(id); err == nil {
				p.Close()
				return false, fmt.Sprintf("program %d still loaded", id)
			}
		}
		return true, ""
	})
}

// The connections of a project in a network namespace of its own (a pod's)
// are counted by the migration too, before the old programs go: the
// migration's passes enter every namespace a process of the host is in,
// not only the daemon's and those it attached.
func TestMigrateCountsOtherNetns(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	h := startHelperNS(t, mkProject(t, root, "pod"), true)
	const pool = 6
	var addr string
	openOld(t, root, pin, pool, func() {
		addr = listenAddr(t, h.do("listen 127.0.0.1:0"))
		// 3 outbound and their 3 accepted children: the pool.
		if r := h.dial("tcp4", addr, 3); r.ok != 3 {
			t.Fatalf("filling the pool under the old layout: %+v", r)
		}
	})
	l := openLimiter(t, root, pin, pool, 0)
	if l.mig == nil {
		t.Fatal("the start did not migrate")
	}
	if s := snap(t, l); s.InUse != pool || project(s, "pod").InUse != pool {
		t.Fatalf("after the migration: node in_use %d, project %+v; want the pod's %d permits counted", s.InUse, project(s, "pod"), pool)
	}
	if r := h.dial("tcp4", addr, 1); r.refused != 1 {
		t.Fatalf("after the migration: %+v, want refused", r)
	}
	h.do("close")
	waitInUse(t, l, 0, map[string]int{"pod": 0})
}

// Cleanup removes an interrupted migration's pins too: after a crash past
// the commit (old and new links both pinned), it leaves no directory and no
// program attached, old or new.
func TestCleanupAfterInterruptedMigration(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	h := startHelper(t, mkProject(t, root, "a"))
	progs := openOld(t, root, pin, 3, func() {
		if r := h.dial("tcp4", ln.Addr().String(), 1); r.ok != 1 {
			t.Fatalf("under the old layout: %+v", r)
		}
	})
	migrateFault = func(s string) error {
		if s == "committed" {
			return errors.New("crash")
		}
		return nil
	}
	_, err := openRoot(t, root, Options{PinDir: pin, PoolSize: 3})
	migrateFault = func(string) error { return nil }
	if err == nil {
		t.Fatal("the interrupted start succeeded")
	}
	ready, err := os.ReadDir(filepath.Join(pin, readyDir))
	if err != nil || len(ready) == 0 {
		t.Fatalf("no committed migration to clean up: %v %v", ready, err)
	}
	for _, e := range ready {
		if lk, err := link.LoadPinnedLink(filepath.Join(pin, readyDir, e.Name()), nil); err == nil {
			info, err := lk.Info()
			lk.Close()
			if err != nil {
				t.Fatal(err)
			}
			progs = append(progs, info.Program)
		}
	}
	if err := Cleanup(pin); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(pin); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the pin directory is still there after cleanup: %v", err)
	}
	oldGone(t, progs)
	if r := h.dial("tcp4", ln.Addr().String(), 3); r.ok != 3 {
		t.Fatalf("after cleanup: %+v, want nothing enforced", r)
	}
}

// A pool larger than the pinned permit tables hold (a larger pool
// configured since they were made) migrates them to tables of its size:
// the start succeeds, the held connections stay counted, and the larger
// pool admits up to its size.
func TestMigrateToALargerPool(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	addr := ln.Addr().String()
	h := startHelper(t, mkProject(t, root, "a"))
	l := openLimiter(t, root, pin, 3, 0)
	if r := h.dial("tcp4", addr, 3); r.ok != 3 {
		t.Fatal(r)
	}
	small := l.held
	l.Close()
	// Pool 3 sized the permit tables at 1024 entries.
	const pool = 1500
	l2 := openLimiter(t, root, pin, pool, 0)
	if l2.mig == nil || l2.held <= small || l2.held < pool {
		t.Fatalf("pool %d on tables of %d: migrated %v, tables of %d", pool, small, l2.mig != nil, l2.held)
	}
	if s := snap(t, l2); s.InUse != 3 || project(s, "a").InUse != 3 {
		t.Fatalf("after the migration: %+v, want the 3 connections counted", s)
	}
	h.do("close")
	waitInUse(t, l2, 0, map[string]int{"a": 0})
}

// crashMigration runs a migration of the pins in pin in a process of its
// own (this test binary again) that dies at step, as a daemon killed there.
func crashMigration(t *testing.T, step, root, pin string, pool int) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestMigrateCrashHelper$")
	cmd.Env = append(os.Environ(), fmt.Sprintf("FAIRSHARE_LOADER_MIGRATE_CRASH=%s %s %s %d", step, root, pin, pool))
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 3 {
		t.Fatalf("the migrating process did not die at %s: %v\n%s", step, err, out)
	}
}

// TestMigrateCrashHelper is crashMigration's process: it opens the limiter
// on pins of another layout and exits (status 3, nothing closed or
// removed) when the migration reaches the step named.
func TestMigrateCrashHelper(t *testing.T) {
	f := strings.Fields(os.Getenv("FAIRSHARE_LOADER_MIGRATE_CRASH"))
	if len(f) != 4 {
		t.Skip("helper process only")
	}
	migrateFault = func(s string) error {
		if s == f[0] {
			os.Exit(3)
		}
		return nil
	}
	pool, _ := strconv.Atoi(f[3])
	_, err := Open(rootOptions(t, f[1], Options{PinDir: f[2], PoolSize: uint32(pool)}))
	fmt.Fprintf(os.Stderr, "the migration did not reach %s: %v\n", f[0], err)
	os.Exit(1)
}

// A migration happens only under the pin directory's lock: while another
// open file holds it (a daemon running on the pins), Open leaves the pins
// alone and fails with ErrPinsLocked; given that file as Options.PinLock
// (the daemon's own lock), it migrates.
func TestMigrateOnlyUnderTheLock(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	mkProject(t, root, "a")
	openOld(t, root, pin, 3, func() {})
	f, err := os.Open(pin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		t.Fatal(err)
	}
	if _, err := openRoot(t, root, Options{PinDir: pin, PoolSize: 3}); !errors.Is(err, ErrPinsLocked) {
		t.Fatalf("migration under another's lock: %v, want ErrPinsLocked", err)
	}
	if _, err := os.Stat(filepath.Join(pin, stagingDir)); err == nil {
		t.Fatal("a staging directory was made under another's lock")
	}
	l, err := openRoot(t, root, Options{PinDir: pin, PoolSize: 3, PinLock: f})
	if err != nil {
		t.Fatalf("migration under the caller's lock: %v", err)
	}
	defer l.Close()
	if l.mig == nil {
		t.Fatal("the start did not migrate")
	}
}

// attachedIn says which of the programs of the old links (ids, in the
// order of attachments) were not attached to their hook any more: the
// cgroup hooks at the cgroup2 root and sk_lookup in this namespace (the
// kernel cannot list the tracing hook's).
func attachedIn(t *testing.T, ids []ebpf.ProgramID) error {
	mnt := testutil.Cgroup2Mount(t)
	cg, err := os.Open(mnt)
	if err != nil {
		return err
	}
	defer cg.Close()
	ns, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		return err
	}
	defer ns.Close()
	var errs []error
	for i, a := range (&Limiter{}).attachments("", &limiterObjects{}) {
		target, typ := int(cg.Fd()), ebpf.AttachNone
		switch a.name {
		case "link_sock_release":
			typ = ebpf.AttachCgroupInetSockRelease
		case "link_sockops":
			typ = ebpf.AttachCGroupSockOps
		case "link_connect4":
			typ = ebpf.AttachCGroupInet4Connect
		case "link_connect6":
			typ = ebpf.AttachCGroupInet6Connect
		case "link_sk_lookup":
			target, typ = int(ns.Fd()), ebpf.AttachSkLookup
		default:
			continue
		}
		res, err := link.QueryPrograms(link.QueryOptions{Target: target, Attach: typ})
		if err != nil {
			return fmt.Errorf("listing the programs of %s: %w", a.name, err)
		}
		if !slices.ContainsFunc(res.Programs, func(p link.AttachedProgram) bool { return p.ID == ids[i] }) {
			errs = append(errs, fmt.Errorf("the old program of %s (%d) is detached", a.name, ids[i]))
		}
	}
	return errors.Join(errs...)
}
