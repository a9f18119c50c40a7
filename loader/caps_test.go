// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"maps"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// TestSetCaps: fleet caps in the running programs, on the connections pool
// and on a destination pool: a capped project is refused at its cap (reason
// fleet_cap, the event's share its cap) whatever its share, in place of the
// share and the floor up to the pool's size; the projects not named get
// the others' cap; a project numbered after SetCaps gets its cap; a cap
// under what is held refuses and takes nothing back; nil removes the caps
// (the rule again), and a new Open starts with none.
func TestSetCaps(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 10, 0)
	if err := l.SetEvents(100, false); err != nil {
		t.Fatal(err)
	}
	ch := refusals(t, l)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	db := sink(t, "tcp4", "127.0.0.1:0")
	if err := l.SetDestPools([]DestPool{destPoolOf(t, "db", 10, 0, "127.0.0.1/32:"+portOf(db))}); err != nil {
		t.Fatal(err)
	}
	alpha := startHelper(t, mkProject(t, root, "alpha"))
	syncDir(t, l, root)

	// Connections pool: alpha capped at 3, beta (no id yet) at 9, the
	// others at 1.
	if err := l.SetCaps("", map[string]int{"alpha": 3, "beta": 9}, 1); err != nil {
		t.Fatal(err)
	}
	if r := alpha.dial("tcp4", ln.Addr().String(), 5); r.ok != 3 || r.refused != 2 {
		t.Fatalf("alpha capped at 3: %+v", r)
	}
	if e := nextRefusal(t, ch); e.Reason != ReasonFleetCap || e.Project != "alpha" || e.Held != 3 || e.Share != 3 || e.DestPool != "" {
		t.Fatalf("the refusal at the cap: %+v", e)
	}
	nextRefusal(t, ch)
	// beta gets its id now, and its cap: 9 is past its share and the
	// floor's limit (POOL - FLOOR = 9 with alpha's 3), but under the
	// pool: 7 fit.
	beta := startHelper(t, mkProject(t, root, "beta"))
	syncDir(t, l, root)
	if r := beta.dial("tcp4", ln.Addr().String(), 9); r.ok != 7 || r.refused != 2 {
		t.Fatalf("beta capped at 9 beside alpha's 3 in a pool of 10: %+v", r)
	}
	if e := nextRefusal(t, ch); e.Reason != ReasonPoolFull || e.Project != "beta" {
		t.Fatalf("beta's refusal by the full pool: %+v", e)
	}
	nextRefusal(t, ch)
	beta.do("close")
	waitInUse(t, l, 3, map[string]int{"alpha": 3, "beta": 0})
	// gamma, not named: the others' cap, 1.
	gamma := startHelper(t, mkProject(t, root, "gamma"))
	syncDir(t, l, root)
	if r := gamma.dial("tcp4", ln.Addr().String(), 3); r.ok != 1 || r.refused != 2 {
		t.Fatalf("gamma at the others' cap 1: %+v", r)
	}
	// A cap under what alpha holds: refused, nothing taken back.
	if err := l.SetCaps("", map[string]int{"alpha": 1}, 1); err != nil {
		t.Fatal(err)
	}
	if r := alpha.dial("tcp4", ln.Addr().String(), 1); r.refused != 1 {
		t.Fatalf("alpha holding 3 with a cap of 1: %+v", r)
	}
	if s := snap(t, l); project(s, "alpha").InUse != 3 {
		t.Fatalf("alpha's permits were taken back: %+v", project(s, "alpha"))
	}
	// No caps: the rule (alone past the share... three active, share 3).
	if err := l.SetCaps("", nil, 0); err != nil {
		t.Fatal(err)
	}
	gamma.dialOK("tcp4", ln.Addr().String(), 1, "gamma without caps, under its share")
	alpha.do("close")
	gamma.do("close")
	waitInUse(t, l, 0, map[string]int{"alpha": 0, "gamma": 0})
	for len(ch) > 0 {
		<-ch
	}

	// A destination pool: alpha capped at 2 there, the others at 0; the
	// node's pool has no caps.
	if err := l.SetCaps("db", map[string]int{"alpha": 2}, 0); err != nil {
		t.Fatal(err)
	}
	if r := alpha.dial("tcp4", db.Addr().String(), 4); r.ok != 2 || r.refused != 2 {
		t.Fatalf("alpha capped at 2 in db: %+v", r)
	}
	// The node pool's refusals above may still be on their way (the
	// drain above ran before the reader delivered them): db's is the first
	// of db's.
	e := nextRefusal(t, ch)
	for e.DestPool == "" {
		e = nextRefusal(t, ch)
	}
	if e.Reason != ReasonFleetCap || e.DestPool != "db" || e.Held != 2 || e.Share != 2 {
		t.Fatalf("db's refusal at the cap: %+v", e)
	}
	if r := gamma.dial("tcp4", db.Addr().String(), 1); r.refused != 1 {
		t.Fatalf("gamma at the others' cap 0 in db: %+v", r)
	}
	gamma.dialOK("tcp4", ln.Addr().String(), 4, "gamma elsewhere, no caps in the node's pool")
	if err := l.SetCaps("nope", nil, 0); !errors.Is(err, ErrNoDestPool) {
		t.Fatalf("caps of an unknown pool: %v", err)
	}
	alpha.do("close")
	gamma.do("close")
	waitInUse(t, l, 0, map[string]int{"alpha": 0, "gamma": 0})
	if err := l.Tick(time.Now()); err != nil {
		t.Fatal(err)
	}
	// A daemon starting on these pins has no view of the fleet: no caps.
	l.Close()
	l = openLimiter(t, root, pin, 10, 0)
	if err := l.SetDestPools([]DestPool{destPoolOf(t, "db", 10, 0, "127.0.0.1/32:"+portOf(db))}); err != nil {
		t.Fatal(err)
	}
	syncDir(t, l, root)
	alpha.dialOK("tcp4", db.Addr().String(), 4, "after a new Open, the caps of the last one")
}

// A socket adopted past a fleet cap is reported as one past the rule is, in
// the node's pool and in a destination pool, naming the pool: alpha, capped
// at 2 on the node, beta, capped at 1 in db, and gamma, capped at 1 in both,
// each open their connections before their cgroups are members, under
// their shares but one past their caps (gamma's second past both).
func TestAdoptedPastFleetCap(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 10, 0)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	db := sink(t, "tcp4", "127.0.0.1:0")
	if err := l.SetDestPools([]DestPool{destPoolOf(t, "db", 10, 0, "127.0.0.1/32:"+portOf(db))}); err != nil {
		t.Fatal(err)
	}
	if err := l.SetCaps("", map[string]int{"alpha": 2, "gamma": 1}, 10); err != nil {
		t.Fatal(err)
	}
	if err := l.SetCaps("db", map[string]int{"beta": 1, "gamma": 1}, 10); err != nil {
		t.Fatal(err)
	}
	// Made without mkProject, which makes them members at once.
	dirs := mkdirs(t, root, "alpha", "beta", "gamma")
	alpha, beta, gamma := startHelper(t, dirs[0]), startHelper(t, dirs[1]), startHelper(t, dirs[2])
	alpha.dialOK("tcp4", ln.Addr().String(), 3, "alpha, no member yet")
	beta.dialOK("tcp4", db.Addr().String(), 2, "beta, no member yet")
	gamma.dialOK("tcp4", db.Addr().String(), 2, "gamma, no member yet")
	syncDir(t, l, root)
	rep, err := l.Reconcile(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if rep.Adopted != 7 || !maps.Equal(rep.AdoptedPast, map[string]int{"alpha": 1, "beta": 1, "gamma": 1}) {
		t.Fatalf("adopted %d, past the rule %v; want 7, alpha 1 (its third, past its cap of 2), beta 1 (its second in db, past its cap of 1), gamma 1",
			rep.Adopted, rep.AdoptedPast)
	}
	if in := rep.AdoptedPastIn; len(in) != 2 || !maps.Equal(in[ConnectionsPool], map[string]int{"alpha": 1, "gamma": 1}) ||
		!maps.Equal(in["db"], map[string]int{"beta": 1, "gamma": 1}) {
		t.Fatalf("past the rule by pool %v; want the node's: alpha 1, gamma 1; db's: beta 1, gamma 1", in)
	}
	if d := destSnap(t, l, "db"); destProj(d, "beta").InUse != 2 || destProj(d, "gamma").InUse != 2 {
		t.Fatalf("db after the adoption: %+v", d)
	}
	alpha.do("close")
	beta.do("close")
	gamma.do("close")
	waitInUse(t, l, 0, map[string]int{"alpha": 0, "beta": 0, "gamma": 0})
	waitDest(t, l, "db", 0, map[string]int{"beta": 0, "gamma": 0})
}
