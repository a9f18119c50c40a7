// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// fullOldWith is fullOld with the old daemon's lapse_after, and set called
// on its limiter (the pool full) before it stops.
func fullOldWith(t *testing.T, pool uint32, lapse time.Duration, set func(*Limiter)) (root, pin, addr string, holder, prober *helper) {
	t.Helper()
	root, pin = newRoot(t), newPinDir(t)
	addr = sink(t, "tcp4", "127.0.0.1:0").Addr().String()
	dir := mkProject(t, root, "a")
	holder, prober = startHelper(t, dir), startHelper(t, dir)
	specEdit = oldLayout
	l, err := openRoot(t, root, Options{PinDir: pin, PoolSize: pool, LapseAfter: lapse})
	specEdit = nil
	if err != nil {
		t.Fatal(err)
	}
	if r := holder.dial("tcp4", addr, int(pool)); r.ok != int(pool) {
		t.Fatalf("filling the pool under the old layout: %+v", r)
	}
	set(l)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return root, pin, addr, holder, prober
}

// While a migration's new programs run beside the old ones (from
// attachStaged to the install), and after a crash that leaves them
// attached, they admit what the old ones admit past the rule: the pool in
// dry-run, a project in dry-run, enforcement lapsed. The new maps are not
// fresh there: the settings the old programs run with are carried over
// (fs_ev_config, fs_dryrun, fs_lapses), the events' bound with them.
func TestMigrateCarriesWhatAdmits(t *testing.T) {
	testutil.RequireRoot(t)
	const pool = 3
	for _, tc := range []struct {
		name  string
		lapse time.Duration
		set   func(*Limiter) error
		// enforced: the start's own settings refuse once it is done
		enforced bool
	}{
		{name: "pool-dry-run", set: func(l *Limiter) error { return l.SetEvents(7, true) }},
		{name: "project-dry-run", set: func(l *Limiter) error { return l.SetDryRunProjects(map[string]bool{"a": true}) }},
		{name: "lapsed", lapse: 300 * time.Millisecond, set: func(*Limiter) error { return nil }, enforced: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root, pin, addr, holder, prober := fullOldWith(t, pool, tc.lapse, func(l *Limiter) {
				if err := tc.set(l); err != nil {
					t.Fatal(err)
				}
			})
			time.Sleep(2 * tc.lapse)
			// The old programs alone admit past the rule.
			if r := prober.dial("tcp4", addr, 1); r.ok != 1 {
				t.Fatalf("under the old pins: %+v, want admitted", r)
			}
			prober.do("close")
			var during dialResult
			var staged Lapse
			var evcfg limiterFsEvcfg
			migrateFault = func(step string) error {
				if step != "counted" {
					return nil
				}
				// Both run: the old and the new programs must admit.
				during = prober.dial("tcp4", addr, 1)
				prober.do("close")
				m, err := ebpf.LoadPinnedMap(filepath.Join(pin, stagingDir, "fs_lapses"), nil)
				if err != nil {
					return err
				}
				defer m.Close()
				staged, err = (&Limiter{objs: limiterObjects{limiterMaps: limiterMaps{FsLapses: m}}}).Lapse()
				if err != nil {
					return err
				}
				e, err := ebpf.LoadPinnedMap(filepath.Join(pin, stagingDir, "fs_ev_config"), nil)
				if err != nil {
					return err
				}
				defer e.Close()
				return e.Lookup(uint32(0), &evcfg)
			}
			t.Cleanup(func() { migrateFault = func(string) error { return nil } })
			l, err := openRoot(t, root, Options{PinDir: pin, PoolSize: pool})
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			if l.mig == nil {
				t.Fatal("the start did not migrate")
			}
			if during.ok != 1 {
				t.Fatalf("while the old and the new programs both ran: %+v, want admitted as the old ones admit", during)
			}
			if tc.name == "pool-dry-run" && (evcfg.PerSec != 7 || evcfg.DryRun != 1) {
				t.Fatalf("the new programs' events settings %+v, want the old ones'", evcfg)
			}
			if tc.lapse != 0 && (staged.After != tc.lapse || !staged.Lapsed) {
				t.Fatalf("the new maps' lapse %+v, want the old pins' (after %v, lapsed)", staged, tc.lapse)
			}
			// Once the start is done: its own settings.
			r := prober.dial("tcp4", addr, 1)
			if tc.enforced && r.refused != 1 || !tc.enforced && r.ok != 1 {
				t.Fatalf("after the migration: %+v, want enforced %v", r, tc.enforced)
			}
			prober.do("close")
			holder.do("close")
			waitInUse(t, l, 0, map[string]int{"a": 0})
		})
	}
}

// Pins an interrupted cleanup left (it unpins in the directory's order:
// fs_caps and fs_config first, fs_held among the next) are not a fresh
// start: the next start migrates them, counting the live connections
// again, and replaces every leftover, whether their layout is this
// version's or another's (no "another process at work" refusal).
func TestStartOnCleanupLeftovers(t *testing.T) {
	testutil.RequireRoot(t)
	for _, tc := range []struct {
		name string
		old  bool   // the pins are of another layout
		last string // the last pin the cleanup removed
	}{
		// The permits' records gone, the counts kept.
		{"this-layout", false, "fs_held"},
		// The destination tables kept, of the other layout.
		{"old-layout", true, "fs_config"},
	} {
		old := tc.old
		t.Run(tc.name, func(t *testing.T) {
			const pool, held = 5, 3
			root, pin := newRoot(t), newPinDir(t)
			addr := sink(t, "tcp4", "127.0.0.1:0").Addr().String()
			h := startHelper(t, mkProject(t, root, "a"))
			if old {
				specEdit = oldLayout
			}
			l, err := openRoot(t, root, Options{PinDir: pin, PoolSize: pool})
			specEdit = nil
			if err != nil {
				t.Fatal(err)
			}
			if r := h.dial("tcp4", addr, held); r.ok != held {
				t.Fatal(r)
			}
			l.Close()
			// A cleanup interrupted after tc.last.
			ents, err := os.ReadDir(pin)
			if err != nil {
				t.Fatal(err)
			}
			for _, e := range ents {
				if strings.HasPrefix(e.Name(), "fs_") && e.Name() <= tc.last {
					if err := os.Remove(filepath.Join(pin, e.Name())); err != nil {
						t.Fatal(err)
					}
				}
			}
			if rep, err := Check(rootOptions(t, root, Options{PinDir: pin, PoolSize: pool})); err != nil || !strings.Contains(rep.Migrate, "fs_config missing") {
				t.Fatalf("check on the leftovers: %+v, %v; want a migration said", rep, err)
			}
			l2, err := openRoot(t, root, Options{PinDir: pin, PoolSize: pool})
			if err != nil {
				t.Fatalf("start on the leftovers: %v", err)
			}
			defer l2.Close()
			if s := snap(t, l2); s.InUse != held || project(s, "a").InUse != held {
				t.Fatalf("after the start: in_use %d, project %+v; want the %d connections counted once", s.InUse, project(s, "a"), held)
			}
			if l2.mig == nil {
				t.Fatal("the start did not migrate the leftovers")
			}
			spec, err := l2.spec()
			if err != nil {
				t.Fatal(err)
			}
			if why, err := l2.incompatible(spec); err != nil || why != "" {
				t.Fatalf("pins after the start: %q, %v; want this version's, complete", why, err)
			}
			if r := h.dial("tcp4", addr, pool); r.ok != pool-held || r.refused != held {
				t.Fatalf("after the start: %+v, want %d admitted and %d refused", r, pool-held, held)
			}
			h.do("close")
			waitInUse(t, l2, 0, map[string]int{"a": 0})
		})
	}
}

// A migration whose old pins lost the projects' names (fs_names) does not
// carry the members over without them: their ids would be given to other
// projects (allocIDs takes an unnamed id as free), whose counts the held
// connections of the first would then be released from. The projects get
// ids again from the daemon's members, and every count comes back to 0.
func TestMigrateMembersNeedNames(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	addr := sink(t, "tcp4", "127.0.0.1:0").Addr().String()
	specEdit = oldLayout
	l, err := openRoot(t, root, Options{PinDir: pin, PoolSize: 10})
	specEdit = nil
	if err != nil {
		t.Fatal(err)
	}
	// b gets id 1 and a id 2: in the other order than a start that names
	// them anew gives them.
	hb := startHelper(t, mkProject(t, root, "b"))
	ha := startHelper(t, mkProject(t, root, "a"))
	if ids := l.memb.ids; ids["b"] != 1 || ids["a"] != 2 {
		t.Fatalf("ids %v, want b 1 and a 2", ids)
	}
	if r := hb.dial("tcp4", addr, 2); r.ok != 2 {
		t.Fatal(r)
	}
	if r := ha.dial("tcp4", addr, 1); r.ok != 1 {
		t.Fatal(r)
	}
	l.Close()
	if err := os.Remove(filepath.Join(pin, "fs_names")); err != nil {
		t.Fatal(err)
	}
	l2, err := openRoot(t, root, Options{PinDir: pin, PoolSize: 10})
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	if l2.mig == nil {
		t.Fatal("the start did not migrate")
	}
	if s := snap(t, l2); s.InUse != 3 || project(s, "a").InUse != 1 || project(s, "b").InUse != 2 {
		t.Fatalf("after the migration: in_use %d, a %+v, b %+v; want 3, 1 and 2", s.InUse, project(s, "a"), project(s, "b"))
	}
	hb.do("close")
	ha.do("close")
	waitInUse(t, l2, 0, map[string]int{"a": 0, "b": 0})
	if _, err := os.Stat(filepath.Join(pin, stagingDir)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("staging left: %v", err)
	}
}

// Maps that never had a heartbeat (pins of a version before it, or with
// it never written) would never lapse: a migration from them starts the
// lapse's clock in its new maps before it attaches their programs, with
// this start's lapse_after, so that a daemon killed before its start ends
// leaves programs that lapse.
func TestMigrateStartsTheLapse(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	mkProject(t, root, "a")
	openOld(t, root, pin, 3, func() {})
	m, err := ebpf.LoadPinnedMap(filepath.Join(pin, "fs_lapses"), nil)
	if err != nil {
		t.Fatal(err)
	}
	err = m.Put(lapseSlot, limiterFsLapse{})
	m.Close()
	if err != nil {
		t.Fatal(err)
	}
	var staged Lapse
	migrateFault = func(step string) error {
		if step != "counted" {
			return nil
		}
		m, err := ebpf.LoadPinnedMap(filepath.Join(pin, stagingDir, "fs_lapses"), nil)
		if err != nil {
			return err
		}
		defer m.Close()
		staged, err = (&Limiter{objs: limiterObjects{limiterMaps: limiterMaps{FsLapses: m}}}).Lapse()
		return err
	}
	t.Cleanup(func() { migrateFault = func(string) error { return nil } })
	const after = 2 * time.Second
	l, err := openRoot(t, root, Options{PinDir: pin, PoolSize: 3, LapseAfter: after})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if l.mig == nil {
		t.Fatal("the start did not migrate")
	}
	if staged.Never || staged.After != after {
		t.Fatalf("the new maps' lapse while their programs ran beside the old: %+v, want a heartbeat, lapsing after %v", staged, after)
	}
}
