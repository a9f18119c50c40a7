// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// A lone project gets the whole pool, over IPv4, IPv6 and v4-mapped IPv6;
// the next connect fails at once with ECONNREFUSED; every close gives the
// permit back.
func TestOutboundCountRefuseRelease(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 10, 0)
	ln4 := sink(t, "tcp4", "127.0.0.1:0")
	ln6 := sink(t, "tcp6", "[::1]:0")
	port := ln4.Addr().String()[strings.LastIndex(ln4.Addr().String(), ":")+1:]

	h := startHelper(t, mkProject(t, root, "alpha"))
	if r := h.dial("tcp4", ln4.Addr().String(), 4); r.ok != 4 {
		t.Fatalf("ipv4: %+v", r)
	}
	if r := h.dial("tcp6", ln6.Addr().String(), 3); r.ok != 3 {
		t.Fatalf("ipv6: %+v", r)
	}
	if r := h.dial("mapped", "[::ffff:127.0.0.1]:"+port, 3); r.ok != 3 {
		t.Fatalf("v4-mapped: %+v", r)
	}
	if err := l.Tick(time.Now()); err != nil {
		t.Fatal(err)
	}
	s := snap(t, l)
	if s.InUse != 10 || project(s, "alpha").InUse != 10 || s.Active != 1 || s.Share != 10 {
		t.Fatalf("after 10 connects: %+v", s)
	}
	start := time.Now()
	if r := h.dial("tcp4", ln4.Addr().String(), 2); r.refused != 2 || r.ok != 0 {
		t.Fatalf("over the pool: %+v (want 2 refused with ECONNREFUSED)", r)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("refusal took %v; it must not wait for a timeout", d)
	}
	s = snap(t, l)
	if p := project(s, "alpha"); p.Refused != 2 || p.Admitted != 10 || s.Events.RefusedOut != 2 {
		t.Fatalf("counters: %+v %+v", p, s.Events)
	}
	h.do("close")
	waitInUse(t, l, 0, map[string]int{"alpha": 0})
	// Room again.
	if r := h.dial("tcp6", ln6.Addr().String(), 1); r.ok != 1 {
		t.Fatalf("after release: %+v", r)
	}
	h.do("rst")
	waitInUse(t, l, 0, map[string]int{"alpha": 0})
}

// Processes outside the root are not limited, and UDP connects take nothing.
func TestOutsideRootAndUDPNotCounted(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 1, 1)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	h := startHelper(t, mkProject(t, root, "p"))
	if r := h.dial("udp4", "127.0.0.1:9", 3); r.ok != 3 {
		t.Fatalf("udp: %+v", r)
	}
	// This process is outside the root: several connections, pool of 1.
	for range 3 {
		c, err := dialOutside(ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	if s := snap(t, l); s.InUse != 0 {
		t.Fatalf("counted outside connections: %+v", s)
	}
}

// Two active projects: the one past its share stops a floor short of the
// pool, and a late third project finds its floor at once.
func TestFloorKeptForLateProject(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 10, 2)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	addr := ln.Addr().String()
	big := startHelper(t, mkProject(t, root, "big"))
	small := startHelper(t, mkProject(t, root, "small"))
	if r := small.dial("tcp4", addr, 1); r.ok != 1 {
		t.Fatalf("small: %+v", r)
	}
	small.do("close")
	if r := big.dial("tcp4", addr, 1); r.ok != 1 {
		t.Fatalf("big: %+v", r)
	}
	if err := l.Tick(time.Now()); err != nil {
		t.Fatal(err)
	}
	if s := snap(t, l); s.Active != 2 || s.Share != 5 {
		t.Fatalf("two active projects: %+v", s)
	}
	// share 5: big is admitted to in_use < 10 while under 5, then only while
	// in_use < POOL-FLOOR = 8.
	if r := big.dial("tcp4", addr, 11); r.ok != 7 || r.refused != 4 {
		t.Fatalf("big past its share: %+v, want 8 admitted", r)
	}
	late := startHelper(t, mkProject(t, root, "late"))
	if r := late.dial("tcp4", addr, 3); r.ok != 2 || r.refused != 1 {
		t.Fatalf("late project: %+v, want its floor of 2", r)
	}
	s := snap(t, l)
	if s.InUse != 10 || project(s, "big").InUse != 8 || project(s, "late").InUse != 2 {
		t.Fatalf("%+v", s)
	}
	// Full node: big (over its share) is refused, late (under it) would not be.
	if r := big.dial("tcp4", addr, 1); r.refused != 1 {
		t.Fatalf("big on a full node: %+v", r)
	}
	big.do("close")
	waitInUse(t, l, 2, map[string]int{"big": 0})
}

// A project alone may fill the pool: it is never past its share (the whole
// pool) while it does, so nothing is kept for a newcomer, which is refused
// at once. From the newcomer's refusal on, the share is halved and the
// holder is over it: the next permit released goes to the newcomer, not
// back to the holder (docs/security.md, "Hostile local users").
func TestLoneProjectFillsPoolNewcomerGetsNextRelease(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 10, 2)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	addr := ln.Addr().String()
	dir := mkProject(t, root, "holder")
	holder, holder2 := startHelper(t, dir), startHelper(t, dir)
	newcomer := startHelper(t, mkProject(t, root, "newcomer"))
	if r := holder.dial("tcp4", addr, 9); r.ok != 9 {
		t.Fatalf("holder alone: %+v", r)
	}
	if r := holder2.dial("tcp4", addr, 2); r.ok != 1 || r.refused != 1 {
		t.Fatalf("holder alone up to the whole pool of 10: %+v; %+v", r, snap(t, l))
	}
	if r := newcomer.dial("tcp4", addr, 1); r.refused != 1 {
		t.Fatalf("newcomer on a pool its holder filled alone: %+v; %+v", r, snap(t, l))
	}
	if s := snap(t, l); s.Share != 5 || s.Active != 2 || s.InUse != 10 {
		t.Fatalf("after the newcomer asked: %+v", s)
	}
	holder2.do("close")
	waitInUse(t, l, 9, map[string]int{"holder": 9})
	// in_use 9 >= POOL - FLOOR (8) and holder (9) is over its share of 5.
	if r := holder.dial("tcp4", addr, 1); r.refused != 1 {
		t.Fatalf("holder took back the released permit: %+v; %+v", r, snap(t, l))
	}
	if r := newcomer.dial("tcp4", addr, 2); r.ok != 1 || r.refused != 1 {
		t.Fatalf("newcomer after one release: %+v, want the one released; %+v", r, snap(t, l))
	}
	holder.do("close")
	newcomer.do("close")
	waitInUse(t, l, 0, map[string]int{"holder": 0, "newcomer": 0})
}

// A node with room refuses nothing, even to a project far over its share.
func TestNodeWithRoomRefusesNothing(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 100, 0)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	addr := ln.Addr().String()
	var hs []*helper
	for _, name := range []string{"a", "b", "c"} {
		h := startHelper(t, mkProject(t, root, name))
		if r := h.dial("tcp4", addr, 1); r.ok != 1 {
			t.Fatal(r)
		}
		hs = append(hs, h)
	}
	if err := l.Tick(time.Now()); err != nil {
		t.Fatal(err)
	}
	if s := snap(t, l); s.Share != 33 || s.Active != 3 {
		t.Fatalf("%+v", s)
	}
	if r := hs[0].dial("tcp4", addr, 60); r.ok != 60 {
		t.Fatalf("a, over its share on a node with room: %+v", r)
	}
	if s := snap(t, l); s.InUse != 63 || s.Refused != 0 {
		t.Fatalf("%+v", s)
	}
}

// SIGKILL of a process holding connections gives its permits back.
func TestReleaseOnSIGKILL(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 50, 0)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	h := startHelper(t, mkProject(t, root, "k"))
	if r := h.dial("tcp4", ln.Addr().String(), 20); r.ok != 20 {
		t.Fatal(r)
	}
	waitInUse(t, l, 20, map[string]int{"k": 20})
	h.kill()
	waitInUse(t, l, 0, map[string]int{"k": 0})
}

// A socket created anywhere below a project counts for the project, and a
// full MPTCP connection (Go dialer with MPTCP on, to an MPTCP listener) takes
// one permit and gives it back.
func TestNestedCgroupAndMPTCP(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 10, 0)
	proj := mkProject(t, root, "nest")
	deep := mkProject(t, proj, "workers")
	deep = mkProject(t, deep, "1")
	var lc net.ListenConfig
	lc.SetMultipathTCP(true)
	ln, err := lc.Listen(t.Context(), "tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	testutil.Sink(t, ln)
	h := startHelper(t, deep)
	if r := h.dial("tcp4", ln.Addr().String(), 2); r.ok != 2 {
		t.Fatal(r)
	}
	if r := h.dial("mptcp", ln.Addr().String(), 3); r.ok != 3 {
		t.Fatal(r)
	}
	waitInUse(t, l, 5, map[string]int{"nest": 5})
	h.do("close")
	waitInUse(t, l, 0, map[string]int{"nest": 0})

	// A listener below the project counts its accepted connections for it.
	srv := startHelper(t, deep)
	addr := listenAddr(t, srv.do("listen 127.0.0.1:0"))
	c, err := net.DialTimeout("tcp4", addr, 3*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	waitInUse(t, l, 1, map[string]int{"nest": 1})
	c.Close()
	waitInUse(t, l, 0, map[string]int{"nest": 0})
}

// A restart with another pool size applies it at once, over the pinned
// counts; a size of 0, or one beyond the permit map the pins were made with,
// is refused. Cleanup detaches: nothing is counted or refused afterwards,
// and the pin directory is gone.
func TestPoolSizeAndCleanup(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l, err := openRoot(t, root, Options{PinDir: pin, PoolSize: 100})
	if err != nil {
		t.Fatal(err)
	}
	ln := sink(t, "tcp4", "127.0.0.1:0")
	h := startHelper(t, mkProject(t, root, "sp"))
	l.Close()
	if l, err = openRoot(t, root, Options{PinDir: pin, PoolSize: 3, Floor: 1}); err != nil {
		t.Fatal(err)
	}
	if r := h.dial("tcp4", ln.Addr().String(), 4); r.ok != 3 || r.refused != 1 {
		t.Fatalf("pool 3: %+v", r)
	}
	if _, err := openRoot(t, root, Options{PinDir: pin, PoolSize: 0}); !errors.Is(err, ErrInvalidOptions) {
		t.Fatalf("pool 0: %v, want ErrInvalidOptions", err)
	}
	h.do("close")
	l.Close()
	if _, err := l.Snapshot(); err != ErrClosed {
		t.Fatalf("snapshot after close: %v", err)
	}
	if err := Cleanup(pin); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(pin); !os.IsNotExist(err) {
		t.Fatalf("pin dir after cleanup: %v", err)
	}
	if r := h.dial("tcp4", ln.Addr().String(), 6); r.ok != 6 {
		t.Fatalf("after cleanup: %+v", r)
	}
}

// Concurrent connects from several projects never take the node past POOL,
// and every admitted connection is counted.
func TestConcurrentNeverOverPool(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 20, 1)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	var hs []*helper
	for _, name := range []string{"c1", "c2", "c3", "c4"} {
		hs = append(hs, startHelper(t, mkProject(t, root, name)))
	}
	results := make(chan dialResult, len(hs))
	for _, h := range hs {
		go func() { results <- h.dial("tcp4", ln.Addr().String(), 30) }()
	}
	ok := 0
	for range hs {
		r := <-results
		if r.other != 0 {
			t.Errorf("unexpected dial errors: %+v", r)
		}
		ok += r.ok
	}
	s := snap(t, l)
	if ok > 20 || s.InUse != ok {
		t.Fatalf("admitted %d, node in_use %d, pool 20", ok, s.InUse)
	}
	sum := 0
	for _, p := range s.Projects {
		sum += p.InUse
	}
	if sum != ok {
		t.Fatalf("projects hold %d, admitted %d", sum, ok)
	}
	t.Logf("admitted %d of 120 attempts on a pool of 20", ok)
}

// connect() called again on a socket that is still connecting (and holds
// the last permit) reports EALREADY, not a refusal.
func TestReconnectWhileConnectingKeepsPermit(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 1, 1)
	full := fullBacklogListener(t)
	h := startHelper(t, mkProject(t, root, "re"))
	if r := h.do("reconnect %s", full); r != "reconnect EINPROGRESS EALREADY" {
		t.Fatalf("%s; %+v", r, snap(t, l))
	}
	s := snap(t, l)
	if s.InUse != 1 || project(s, "re").Refused != 0 {
		t.Fatalf("%+v", s)
	}
	h.kill()
	waitInUse(t, l, 0, nil)
}
