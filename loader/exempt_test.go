// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/loader/limits"
)

// fillNode has a helper in project "bulk" take the whole pool, and checks
// that one more connect is refused.
func fillNode(t *testing.T, l *Limiter, root, addr string, pool int) *helper {
	t.Helper()
	bulk := startHelper(t, mkProject(t, root, "bulk"))
	if r := bulk.dial("tcp4", addr, pool+1); r.ok != pool || r.refused != 1 {
		t.Fatalf("filling the node: %+v; %+v", r, snap(t, l))
	}
	return bulk
}

// On a full node, a nested exempt cgroup (<project>/probes) still connects,
// without taking pool permits, up to the exempt budget; beyond the budget it
// is under the rule like its project (refused: the node is full); its
// non-exempt sibling is refused; closing gives the exempt permits back.
func TestExemptOutboundOnFullNode(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	const pool = 4
	l := openLimiter(t, root, pin, pool, 1)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	app := mkProject(t, root, "app")
	probes := mkProject(t, app, "probes")
	if err := l.SetExempt([]string{filepath.Join(root, "app/probes")}, 2); err != nil {
		t.Fatal(err)
	}
	bulk := fillNode(t, l, root, ln.Addr().String(), pool)

	p := startHelper(t, probes)
	if r := p.dial("tcp4", ln.Addr().String(), 2); r.ok != 2 {
		t.Fatalf("exempt connects on a full node: %+v; %+v", r, snap(t, l))
	}
	s := snap(t, l)
	if s.InUse != pool || project(s, "app").InUse != 0 || s.Exempt.InUse != 2 || s.Exempt.Admitted != 2 {
		t.Fatalf("exempt permits counted in the pool: %+v", s)
	}
	// Over the budget: under the rule, and the node is full.
	if r := p.dial("tcp4", ln.Addr().String(), 1); r.refused != 1 {
		t.Fatalf("exempt connect over the budget: %+v (want refused)", r)
	}
	sib := startHelper(t, app)
	if r := sib.dial("tcp4", ln.Addr().String(), 1); r.refused != 1 {
		t.Fatalf("non-exempt sibling on a full node: %+v (want refused)", r)
	}
	s = snap(t, l)
	if s.Exempt.OverBudget != 1 || s.Exempt.InUse != 2 || project(s, "app").Refused != 2 || s.InUse != pool {
		t.Fatalf("after the refusals: %+v", s)
	}

	// With room in the pool, an over-budget exempt socket takes a pool
	// permit of its project.
	bulk.do("close")
	waitInUse(t, l, 0, map[string]int{"bulk": 0})
	if r := p.dial("tcp4", ln.Addr().String(), 1); r.ok != 1 {
		t.Fatalf("exempt connect over the budget with room: %+v", r)
	}
	s = snap(t, l)
	if s.InUse != 1 || project(s, "app").InUse != 1 || s.Exempt.InUse != 2 {
		t.Fatalf("over-budget connect not under the rule: %+v", s)
	}
	p.do("close")
	waitInUse(t, l, 0, map[string]int{"app": 0})
	eventually(t, "exempt released", func() (bool, string) {
		s := snap(t, l)
		return s.Exempt.InUse == 0 && s.Exempt.Released == 2, fmt.Sprintf("%+v", s.Exempt)
	})
	rep, err := l.Reconcile(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if rep.Exempt != 0 || len(rep.Repaired) != 0 || rep.Orphans != 0 {
		t.Fatalf("reconcile after close: %+v", rep)
	}
}

// A whole project can be exempt; removing it from the set puts its new
// connections back under the rule, while the ones it holds keep their
// exempt permit until they close. Over IPv6 too.
func TestExemptWholeProjectAndChange(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	// Open takes an exempt cgroup that does not exist yet, as missing.
	l, err := openRoot(t, root, Options{PinDir: pin, PoolSize: 2, Floor: 1,
		Exempt: []string{filepath.Join(root, "ops")}, ExemptMax: 3})
	if err != nil {
		t.Fatalf("Open with a missing exempt cgroup: %v", err)
	}
	if e := snap(t, l).Exempt; len(e.Paths) != 0 || !slices.Equal(e.Missing, []string{filepath.Join(root, "ops")}) {
		t.Fatalf("exempt at Open: %+v", e)
	}
	l.Close()
	ops := mkProject(t, root, "ops")
	l, err = openRoot(t, root, Options{PinDir: pin, PoolSize: 2, Floor: 1,
		Exempt: []string{ops}, ExemptMax: 3})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	ln := sink(t, "tcp6", "[::1]:0")
	h := startHelper(t, ops)
	if r := h.dial("tcp6", ln.Addr().String(), 3); r.ok != 3 {
		t.Fatalf("exempt project: %+v", r)
	}
	if s := snap(t, l); s.InUse != 0 || s.Exempt.InUse != 3 || len(s.Exempt.Paths) != 1 {
		t.Fatalf("%+v", s)
	}
	if err := l.SetExempt(nil, 0); err != nil {
		t.Fatal(err)
	}
	if r := h.dial("tcp6", ln.Addr().String(), 3); r.ok != 2 || r.refused != 1 {
		t.Fatalf("after the set was emptied: %+v (want 2 under the pool, 1 refused)", r)
	}
	s := snap(t, l)
	if s.InUse != 2 || project(s, "ops").InUse != 2 || s.Exempt.InUse != 3 || s.Exempt.Max != 1 {
		t.Fatalf("%+v", s)
	}
	h.do("close")
	waitInUse(t, l, 0, map[string]int{"ops": 0})
	eventually(t, "exempt released", func() (bool, string) {
		s := snap(t, l)
		return s.Exempt.InUse == 0, fmt.Sprintf("%+v", s.Exempt)
	})
}

// A listener in an exempt cgroup accepts on a full node, up to the budget;
// beyond it the SYN is refused like any of its project's.
func TestExemptInbound(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	const pool = 3
	l := openLimiter(t, root, pin, pool, 1)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	web := mkProject(t, root, "web")
	health := mkProject(t, web, "health")
	if err := l.SetExempt([]string{filepath.Join(root, "web/health")}, 2); err != nil {
		t.Fatal(err)
	}
	fillNode(t, l, root, ln.Addr().String(), pool)

	srv := startHelper(t, health)
	addr := listenAddr(t, srv.do("listen 127.0.0.1:0"))
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for range 2 {
		c, err := net.DialTimeout("tcp4", addr, 3*time.Second)
		if err != nil {
			t.Fatalf("exempt listener on a full node: %v; %+v", err, snap(t, l))
		}
		conns = append(conns, c)
	}
	waitHeld(t, srv, 2)
	s := snap(t, l)
	if s.InUse != pool || project(s, "web").InUse != 0 || s.Exempt.InUse != 2 || s.Reservations != 0 {
		t.Fatalf("%+v", s)
	}
	if _, err := net.DialTimeout("tcp4", addr, 3*time.Second); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("over the exempt budget: %v, want ECONNREFUSED", err)
	}
	for _, c := range conns {
		c.Close()
	}
	conns = nil
	waitHeld(t, srv, 0)
	eventually(t, "exempt released", func() (bool, string) {
		s := snap(t, l)
		return s.Exempt.InUse == 0 && s.InUse == pool, fmt.Sprintf("%+v", s)
	})
}

func TestSetExemptValidation(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 10, 1)
	mkProject(t, root, "a")
	outside := t.TempDir()
	too := make([]string, limits.ExemptCap+1)
	for i := range too {
		too[i] = "a"
	}
	for _, c := range []struct {
		name  string
		paths []string
	}{
		{"cgroup2 root", []string{testutil.Cgroup2Mount(t)}},
		{"dot", []string{"."}},
		{"escapes", []string{"../x"}},
		{"not cgroup2", []string{outside}},
		{"empty", []string{""}},
		{"too many", too},
	} {
		if err := l.SetExempt(c.paths, 1); !errors.Is(err, ErrBadExempt) {
			t.Errorf("%s: %v, want ErrBadExempt", c.name, err)
		}
	}
	if err := l.SetExempt([]string{filepath.Join(root, "a"), filepath.Join(root, "a", ".")}, 0); err != nil {
		t.Fatal(err)
	}
	if s := snap(t, l); len(s.Exempt.Paths) != 1 || s.Exempt.Max != 1 {
		t.Fatalf("duplicates or default budget: %+v", s.Exempt)
	}
	// The map is made to hold limits.ExemptCap: a full set fits.
	full := make([]string, limits.ExemptCap)
	for i := range full {
		full[i] = mkProject(t, filepath.Join(root, "a"), fmt.Sprintf("e%d", i))
	}
	if err := l.SetExempt(full, 0); err != nil {
		t.Fatalf("%d exempt cgroups: %v", len(full), err)
	}
	if s := snap(t, l); len(s.Exempt.Paths) != limits.ExemptCap {
		t.Fatalf("%d exempt paths, want %d", len(s.Exempt.Paths), limits.ExemptCap)
	}
}

// Reconcile repairs the exempt budget's use like a project's count: drift
// seen twice is taken back, the permits really held stay.
func TestReconcileRepairsExemptDrift(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 10, 1)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	dir := mkProject(t, root, "ops")
	if err := l.SetExempt([]string{filepath.Join(root, "ops")}, 5); err != nil {
		t.Fatal(err)
	}
	h := startHelper(t, dir)
	if r := h.dial("tcp4", ln.Addr().String(), 2); r.ok != 2 {
		t.Fatal(r)
	}
	if _, err := l.adjust(limiterFsAdjustArgs{Op: opExempt, Delta: 3}); err != nil {
		t.Fatal(err)
	}
	if s := snap(t, l); s.Exempt.InUse != 5 {
		t.Fatalf("invented drift: %+v", s.Exempt)
	}
	rep, err := l.Reconcile(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if rep.ExemptDrift != 3 || rep.ExemptRepaired != -3 || rep.Exempt != 2 {
		t.Fatalf("report: %+v", rep)
	}
	if s := snap(t, l); s.Exempt.InUse != 2 {
		t.Fatalf("after repair: %+v", s.Exempt)
	}
	// Nothing left to repair.
	if rep, err = l.Reconcile(t.Context()); err != nil || rep.ExemptRepaired != 0 {
		t.Fatalf("second reconcile: %+v %v", rep, err)
	}
	h.do("close")
	eventually(t, "exempt released", func() (bool, string) {
		s := snap(t, l)
		return s.Exempt.InUse == 0, fmt.Sprintf("%+v", s.Exempt)
	})
}

// TestExemptMissingUntilMade: an exempt path where no cgroup exists yet is
// no error: it is listed as missing and out of force (the budget off while
// nothing is in force) until RefreshExempt finds it; one removed goes out
// of force, one made again is followed to its new cgroup id.
func TestExemptMissingUntilMade(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	const pool = 4
	l := openLimiter(t, root, pin, pool, 1)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	app := mkProject(t, root, "app")
	probes := filepath.Join(app, "probes")
	t.Cleanup(func() { os.Remove(probes) })
	if err := l.SetExempt([]string{probes}, 2); err != nil {
		t.Fatalf("a missing exempt cgroup: %v", err)
	}
	if e := snap(t, l).Exempt; len(e.Paths) != 0 || !slices.Equal(e.Missing, []string{probes}) {
		t.Fatalf("exempt %+v, want none in force and %s missing", e, probes)
	}
	if up, gone, err := l.RefreshExempt(); err != nil || up != nil || gone != nil {
		t.Fatalf("a refresh with nothing made: %v %v %v", up, gone, err)
	}
	bulk := fillNode(t, l, root, ln.Addr().String(), pool)
	defer bulk.do("close")
	for round := range 3 {
		mkProject(t, app, "probes")
		if up, gone, err := l.RefreshExempt(); err != nil || !slices.Equal(up, []string{probes}) || gone != nil {
			t.Fatalf("round %d: made: in force %v, gone %v, %v", round, up, gone, err)
		}
		if e := snap(t, l).Exempt; !slices.Equal(e.Paths, []string{probes}) || len(e.Missing) != 0 {
			t.Fatalf("round %d: exempt %+v", round, e)
		}
		p := startHelper(t, probes)
		if r := p.dial("tcp4", ln.Addr().String(), 1); r.ok != 1 {
			t.Fatalf("round %d: an exempt connect on a full node: %+v", round, r)
		}
		p.do("close")
		p.kill()
		eventually(t, "the probe's exit", func() (bool, string) {
			err := os.Remove(probes)
			return err == nil, fmt.Sprint(err)
		})
		if up, gone, err := l.RefreshExempt(); err != nil || up != nil || !slices.Equal(gone, []string{probes}) {
			t.Fatalf("round %d: removed: in force %v, gone %v, %v", round, up, gone, err)
		}
		if e := snap(t, l).Exempt; len(e.Paths) != 0 || !slices.Equal(e.Missing, []string{probes}) {
			t.Fatalf("round %d: after the removal: %+v", round, e)
		}
	}
}
