// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// TestFleetSafeWithoutDaemon: a fleet pool in the kernel, the connections
// pool or a destination pool, falls to its safe slice, without its caps,
// once the daemon's heartbeat is older than the fleet's lease, and comes
// back to its allotment (and caps) with the next heartbeat. Rounds draw the
// pool, what the project holds before the heartbeat ages (0-8 of 10), the
// safe slice (0-5), and whether the project has a cap (which would admit
// up to 10, or refuse at 1, with the daemon there): the programs admit the
// project exactly up to the safe slice (the lower of the two once both are
// fleet pools: a connect to the destination counts in both). A SetDestPools (a reload) keeps a
// destination pool's safe slice, and so does a restart.
func TestFleetSafeWithoutDaemon(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 10, 0)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	db := sink(t, "tcp4", "127.0.0.1:0")
	dbPool := destPoolOf(t, "db", 10, 0, "127.0.0.1/32:"+portOf(db))
	dbPool.Fleet = true
	// Both pools are fleet pools, with safe slices by pool ("" the
	// connections pool). The daemon there: every lease an hour from its
	// end; gone: pool's lease ended (as one does a moment after its
	// node's daemon is killed), which puts every fleet pool at its slice.
	safes := map[string]int{"": 10, "db": 10}
	there := func(pool string, safe int) {
		t.Helper()
		safes[pool] = safe
		for p, sf := range safes {
			if err := l.SetFleetSafe(p, uint32(sf), time.Now().Add(time.Hour), time.Hour); err != nil {
				t.Fatal(err)
			}
		}
	}
	gone := func(pool string, safe int) {
		t.Helper()
		safes[pool] = safe
		if err := l.SetFleetSafe(pool, uint32(safe), time.Now().Add(time.Millisecond), time.Hour); err != nil {
			t.Fatal(err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := l.SetDestPools([]DestPool{dbPool}); err != nil {
		t.Fatal(err)
	}
	alpha := startHelper(t, mkProject(t, root, "alpha"))
	syncDir(t, l, root)
	if err := l.SetEvents(1_000_000, false); err != nil {
		t.Fatal(err)
	}
	ch := refusals(t, l)

	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(uint64(seed), 0))
	for round := range 40 {
		pool, addr := "", ln.Addr().String()
		if rng.IntN(2) == 1 {
			pool, addr = "db", db.Addr().String()
		}
		held, safe := rng.IntN(9), rng.IntN(13)
		var caps map[string]int
		switch rng.IntN(3) {
		case 1:
			caps = map[string]int{"alpha": 10}
		case 2:
			caps = map[string]int{"alpha": 1}
		}
		what := func() string {
			return fmt.Sprintf("round %d: pool %q, holding %d, safe slice %d, caps %v", round, pool, held, safe, caps)
		}
		// The daemon there: the allotment of 10.
		there(pool, safe)
		alpha.dialOK("tcp4", addr, held, what())
		if err := l.SetCaps(pool, caps, -1); err != nil {
			t.Fatal(err)
		}
		// The daemon gone: the lease ended, no heartbeat since. The
		// pool has the lower of its size and its slice, and no caps.
		gone(pool, safe)
		// A connect to db counts in both pools.
		limit := min(safe, 10, safes[""])
		want := max(limit-held, 0)
		r := alpha.dial("tcp4", addr, 11)
		if r.ok != want || r.refused != 11-want {
			t.Fatalf("%s: without a daemon %+v, want %d admitted and the rest refused", what(), r, want)
		}
		// The refusals say why: the pool at its safe slice, where the
		// slice binds, the slice as the pool; else the rule (no caps).
		if e := nextRefusal(t, ch); safes[e.DestPool] < 10 && (e.Reason != ReasonFleetSafe || e.Pool != uint32(safes[e.DestPool])) ||
			safes[e.DestPool] >= 10 && (e.Reason == ReasonFleetSafe || e.Reason == ReasonFleetCap || e.Pool != 10) {
			t.Fatalf("%s: the first refusal %+v, want reason %s and the slice where it binds, the rule's reason else",
				what(), e, ReasonFleetSafe)
		}
		if lp, err := l.Lapse(); err != nil || !lp.FleetSafe || lp.FleetAfter > time.Millisecond {
			t.Fatalf("%s: the lapse as read: %+v, %v", what(), lp, err)
		}
		// The daemon back: its allotment, and its caps.
		there(pool, safe)
		now := held + want
		wantBack := 1
		if c, ok := caps["alpha"]; ok && now >= c || now >= 10 {
			wantBack = 0
		}
		back := alpha.dial("tcp4", addr, 1)
		if back.ok != wantBack {
			t.Fatalf("%s: with the daemon back, holding %d: %+v, want %d admitted", what(), now, back, wantBack)
		}
		// Each refused connect writes one event: the round's others are
		// read here, so that the next round's first refusal is its own
		// (a late event of this round's, read as the next round's first,
		// would carry this round's reason).
		for range r.refused - 1 + back.refused {
			nextRefusal(t, ch)
		}
		alpha.do("close")
		if err := l.SetCaps(pool, nil, 0); err != nil {
			t.Fatal(err)
		}
		waitInUse(t, l, 0, map[string]int{"alpha": 0})
	}

	// A reload keeps the destination pool's safe slice; so does a
	// restart (read back from the pins). The connections pool's slice
	// is its size: no lower than the allotment, it holds nothing back.
	there("", 10)
	gone("db", 2)
	if err := l.SetDestPools([]DestPool{dbPool}); err != nil {
		t.Fatal(err)
	}
	if r := alpha.dial("tcp4", db.Addr().String(), 4); r.ok != 2 || r.refused != 2 {
		t.Fatalf("after a reload, without a daemon: %+v, want 2 admitted", r)
	}
	alpha.do("close")
	waitInUse(t, l, 0, map[string]int{"alpha": 0})
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	// The daemon down past the active window (a second): alpha has left
	// it, though the pinned count, which no Tick lowered, still has it.
	// Open recounts it (TestRestartRecountsActive), so alpha's next ask
	// counts it once, alone, whenever that ask comes.
	time.Sleep(time.Second + 100*time.Millisecond)
	l = openLimiter(t, root, pin, 10, 0)
	if got := l.dests["db"].fleetSafe; got != 3 {
		t.Fatalf("the safe slice read back at a restart: %d, want 2 + 1", got)
	}
	// After the restart the connections pool is held to its slice again
	// once its lease ends. Open keeps the pinned slice but clears the flag
	// the programs read it by; the first SetFleetSafe took the kept slice
	// for a flag already set, and the pool stayed at its size.
	// (db is no pool of this limiter until SetDestPools below.)
	if err := l.SetFleetSafe("", 2, time.Now().Add(time.Hour), time.Hour); err != nil {
		t.Fatal(err)
	}
	gone("", 2)
	// Alpha alone: the whole slice of 2. (Before Open recounted the
	// active projects, the pinned count still had alpha, its ask counted
	// it again, and the rule gave it half the slice, 1, past its floor.)
	if r := alpha.dial("tcp4", ln.Addr().String(), 4); r.ok != 2 || r.refused != 2 {
		t.Fatalf("after a restart, the daemon gone: %+v, want the safe slice of 2 admitted, the rest refused", r)
	}
	if a, err := l.KernelActive(); err != nil || a != 1 {
		t.Fatalf("after a restart, alpha alone: kernel active %d (%v), want 1", a, err)
	}
	alpha.do("close")
	waitInUse(t, l, 0, map[string]int{"alpha": 0})
	// The pool no longer a fleet pool (a restart with fleet: false):
	// no safe slice, whatever the connections pool's lease says.
	delete(safes, "db")
	there("", 10)
	notFleet := dbPool
	notFleet.Fleet = false
	if err := l.SetDestPools([]DestPool{notFleet}); err != nil {
		t.Fatal(err)
	}
	gone("", 10)
	if r := alpha.dial("tcp4", db.Addr().String(), 4); r.ok != 4 {
		t.Fatalf("a pool no longer a fleet pool, the daemon gone: %+v, want 4 admitted", r)
	}
	alpha.do("close")
	if err := l.SetFleetSafe("db", 2, time.Now(), time.Hour); !errors.Is(err, ErrNoDestPool) {
		t.Fatalf("the safe slice of a pool that is not a fleet pool: %v", err)
	}
}

// TestSetFleetSafeRefusesBadInput: a lease of 0 or past the field, a safe
// slice past the largest pool, and an unknown destination pool are
// refused.
func TestSetFleetSafeRefusesBadInput(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 10, 0)
	for _, c := range []struct {
		pool  string
		safe  uint32
		after time.Duration
		want  error
	}{{"", 1, 0, ErrInvalidOptions}, {"", 1, 1 << 62, ErrInvalidOptions}, {"", 1 << 30, time.Second, ErrInvalidOptions},
		{"nope", 1, time.Second, ErrNoDestPool}} {
		if err := l.SetFleetSafe(c.pool, c.safe, time.Now().Add(time.Hour), c.after); !errors.Is(err, c.want) {
			t.Errorf("SetFleetSafe(%q, %d, %v): %v, want %v", c.pool, c.safe, c.after, err, c.want)
		}
	}
	if lp, err := l.Lapse(); err != nil || lp.FleetAfter != 0 {
		t.Fatalf("a refused call wrote the lease: %+v, %v", lp, err)
	}
}

// TestRenewHeartbeatKeepsLeaseEnd: a heartbeat renewed from outside the
// daemon (RenewHeartbeat) keeps the end of the fleet's leases where it was:
// fleet_after counts from the heartbeat, and carried over as it was it moved
// the end later by the old heartbeat's age.
func TestRenewHeartbeatKeepsLeaseEnd(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 10, 0)
	if err := l.SetFleetSafe("", 2, time.Now().Add(400*time.Millisecond), time.Hour); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if err := RenewHeartbeat(pin, time.Minute); err != nil {
		t.Fatal(err)
	}
	if lp, err := l.Lapse(); err != nil || lp.FleetAfter > 200*time.Millisecond || lp.FleetAfter == 0 {
		t.Fatalf("the lease's end after a renewal from outside: %+v, %v; want about 100ms from the heartbeat", lp, err)
	}
	time.Sleep(150 * time.Millisecond)
	if err := RenewHeartbeat(pin, time.Minute); err != nil {
		t.Fatal(err)
	}
	if lp, err := l.Lapse(); err != nil || lp.FleetAfter != time.Millisecond {
		t.Fatalf("an end passed, after a renewal from outside: %+v, %v; want it at once", lp, err)
	}
}
