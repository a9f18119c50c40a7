// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"fmt"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/loader/limits"
)

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
