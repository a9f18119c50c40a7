// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/loader/limits"
)

// take_permit (bpf/lib/rule.h), run on its own in the kernel (fs_selftest)
// for a handshake (AT_SYN) and a child admitted late (AT_CHILD), from the
// pool and from the exempt budget. A permit taken is recorded and counted
// once. Taking again for a holder that has its permit takes nothing: the
// permit just taken goes back without a release counted (the node never
// counted it admitted; the project's admitted, bumped at the admission,
// did), and with the pool full it is no refusal. A refusal is counted where
// the rule says: nowhere for a request socket (it exists; sk_lookup refused
// what it could), unaccounted for a child.
func TestTakePermit(t *testing.T) {
	testutil.RequireRoot(t)
	for _, at := range []int32{atSyn, atChild} {
		t.Run(map[int32]string{atSyn: "syn", atChild: "child"}[at], func(t *testing.T) {
			root, pin := newRoot(t), newPinDir(t)
			// POOL 4, FLOOR 2: a project's inbound permits stop at 2,
			// a floor short of the pool, as its permits at connect()
			// would beside a project past its share.
			l := openLimiter(t, root, pin, 4, 2)
			mkProject(t, root, "ex")
			if err := l.SetExempt([]string{filepath.Join(root, "ex")}, 1); err != nil {
				t.Fatal(err)
			}
			var ex uint64
			for id := range l.exemptIDs {
				ex = id
			}
			mkProject(t, root, "p")
			proj := uint64(l.memb.ids["p"]) // take_permit needs no member, only an id given
			exProj := uint64(l.memb.ids["ex"])
			take := func(project uint64, holder uint16) int64 {
				t.Helper()
				cg := project
				if project == ex {
					project, cg = exProj, ex // the exempt set names cgroups
				}
				res, err := l.selftest(limiterFsSelftestArgs{Op: stTake, Delta: at,
					Resv: limiterFsResv{Project: project}, Cookie: 1<<50 + uint64(holder), Cg: cg})
				if err != nil {
					t.Fatal(err)
				}
				return res
			}
			for i, s := range []struct {
				project uint64
				holder  uint16
				want    int64
			}{
				{proj, 1, taken}, {proj, 1, notTaken}, {proj, 2, taken},
				{proj, 3, refused}, {proj, 1, notTaken}, // full to the floor
				{ex, 4, taken}, {ex, 4, notTaken},
			} {
				if got := take(s.project, s.holder); got != s.want {
					t.Fatalf("step %d (project %d, holder %d): %d, want %d; %+v", i, s.project, s.holder, got, s.want, snap(t, l))
				}
			}
			s := snap(t, l)
			var p ProjectCounters
			for _, pc := range s.Projects {
				if uint64(pc.ID) == proj {
					p = pc
				}
			}
			e := s.Events
			// At a request socket a refusal refuses nothing (the handshake
			// goes on; its child is judged at ESTABLISHED): not counted.
			refusedAt := map[int32]uint64{atSyn: e.RefusedIn, atChild: e.Unaccounted}[at]
			wantRefused := map[int32]uint64{atSyn: 0, atChild: 1}[at]
			if s.InUse != 2 || p.InUse != 2 || p.Admitted != 3 || p.Refused != wantRefused || e.AdmittedIn != 2 || refusedAt != wantRefused ||
				e.Released != 0 || s.Exempt.InUse != 1 || e.ExemptAdmitted != 1 || e.ExemptReleased != 0 || e.MapFull != 0 {
				t.Fatalf("after the takes: %+v", s)
			}
			// Give the permits back through the programs' own paths.
			if at == atSyn {
				var ends []limiterFsAdjustArgs
				if err := l.readResv(func(k limiterFsResvKey, v limiterFsResv) {
					ends = append(ends, limiterFsAdjustArgs{Op: opExpire, Key: k, SinceNs: v.SinceNs})
				}); err != nil {
					t.Fatal(err)
				}
				for _, a := range ends {
					if _, err := l.adjust(a); err != nil {
						t.Fatal(err)
					}
				}
			} else {
				for _, h := range []uint64{1, 2, 4} {
					if _, err := l.adjust(limiterFsAdjustArgs{Op: opDrop, Project: 1<<50 + h}); err != nil {
						t.Fatal(err)
					}
				}
			}
			if s := snap(t, l); s.InUse != 0 || s.Exempt.InUse != 0 || s.Events.Released != 2 || s.Events.ExemptReleased != 1 {
				t.Fatalf("after the releases: %+v", s)
			}
		})
	}
}

// A newcomer shrinks the share at its first connect, as in package pools,
// without waiting for a Tick: the incumbent, now over its share, is held to
// POOL - FLOOR at once. Tick later takes out a project that left the window.
func TestNewcomerShrinksShareWithoutTick(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l, mono := openLimiterMono(t, root, pin, 10, 2, limits.MaxReservationTTL)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	big := startHelper(t, mkProject(t, root, "big"))
	small := startHelper(t, mkProject(t, root, "small"))

	if r := big.dial("tcp4", ln.Addr().String(), 7); r.ok != 7 {
		t.Fatalf("big alone: %+v", r)
	}
	if s := snap(t, l); s.Share != 10 {
		t.Fatalf("one active project: share %d, want 10; %+v", s.Share, s)
	}
	if r := small.dial("tcp4", ln.Addr().String(), 1); r.ok != 1 {
		t.Fatalf("newcomer: %+v", r)
	}
	if s := snap(t, l); s.Share != 5 {
		t.Fatalf("after the newcomer's first connect: share %d, want 5; %+v", s.Share, s)
	}
	// in_use 8 = POOL - FLOOR, and big (7) is over its share of 5: refused,
	// where the old share (10) would have let it fill the pool.
	if r := big.dial("tcp4", ln.Addr().String(), 1); r.refused != 1 {
		t.Fatalf("big over its new share with in_use at POOL-FLOOR: %+v; %+v", r, snap(t, l))
	}
	// small, under its share, still gets the floor.
	if r := small.dial("tcp4", ln.Addr().String(), 2); r.ok != 2 {
		t.Fatalf("small within the floor: %+v; %+v", r, snap(t, l))
	}

	// small lets go and leaves the window: Tick takes it out of the count.
	small.do("close")
	waitInUse(t, l, 7, map[string]int{"small": 0})
	mono.advance(time.Minute)
	if err := l.Tick(time.Now()); err != nil {
		t.Fatal(err)
	}
	if s := snap(t, l); s.Share != 10 || s.Active != 1 {
		t.Fatalf("after small left the window: %+v", s)
	}
	if r := big.dial("tcp4", ln.Addr().String(), 3); r.ok != 3 {
		t.Fatalf("big alone again: %+v; %+v", r, snap(t, l))
	}
}

// Several newcomers asking at once are each counted once, and a project
// asking again within the window is not counted again.
func TestActiveCountedOncePerWindow(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l, _ := openLimiterMono(t, root, pin, 100, 1, limits.MaxReservationTTL)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	var hs []*helper
	for i := range 4 {
		hs = append(hs, startHelper(t, mkProject(t, root, fmt.Sprintf("p%d", i))))
	}
	done := make(chan dialResult, len(hs))
	for _, h := range hs {
		go func() { done <- h.dial("tcp4", ln.Addr().String(), 5) }()
	}
	for range hs {
		if r := <-done; r.ok != 5 {
			t.Errorf("dial: %+v", r)
		}
	}
	var n limiterFsPool
	if err := l.objs.FsNode.Lookup(uint32(0), &n); err != nil {
		t.Fatal(err)
	}
	if n.Active != 4 {
		t.Fatalf("kernel active count %d, want 4", n.Active)
	}
	if s := snap(t, l); s.Share != 25 || s.Active != 4 {
		t.Fatalf("%+v", s)
	}
}
