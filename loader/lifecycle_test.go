// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"fmt"
	"log/slog"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/fairshare-dev/fairshare/sockdiag"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// The daemon dies (its Limiter is closed without Cleanup): the kernel keeps
// counting and refusing; a new Open reuses the pinned maps and links with the
// counts unchanged.
func TestRestartKeepsCountsAndEnforcement(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	l1, err := openRoot(t, root, Options{PinDir: pin, PoolSize: 5})
	if err != nil {
		t.Fatal(err)
	}
	h := startHelper(t, mkProject(t, root, "r"))
	if r := h.dial("tcp4", ln.Addr().String(), 5); r.ok != 5 {
		t.Fatal(r)
	}
	if err := l1.Close(); err != nil {
		t.Fatal(err)
	}
	// Nobody holds an fd now; the pins alone keep enforcing.
	if r := h.dial("tcp4", ln.Addr().String(), 1); r.refused != 1 {
		t.Fatalf("while the daemon is down: %+v, want refused", r)
	}
	l2 := openLimiter(t, root, pin, 5, 0)
	if !l2.reused {
		t.Fatal("second Open did not reuse the pinned objects")
	}
	s := snap(t, l2)
	if s.InUse != 5 || project(s, "r").InUse != 5 || project(s, "r").Refused != 1 {
		t.Fatalf("after restart: %+v", s)
	}
	rep, err := l2.Reconcile(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Drift) != 0 || rep.Held["r"] != 5 || rep.Kernel["r"] != 5 || rep.Adopted != 0 {
		t.Fatalf("reconcile after restart: %+v", rep)
	}
	h.do("close")
	waitInUse(t, l2, 0, map[string]int{"r": 0})
}

// TestRestartRecountsActive: the daemon dies (no Tick runs) while a
// project is active, and comes back once the project has left the window.
// The pinned active counts, the node's and a destination pool's, still
// count the project, which nothing took out; Open recounts them, so the
// project's next ask counts it once, as the lone project it is, and it gets
// the whole pool. Kept as pinned until the first Tick, the count was 2 at
// that ask: a share of half the pool, the project refused past 3 of 4.
func TestRestartRecountsActive(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	db := sink(t, "tcp4", "127.0.0.1:0")
	const window = 300 * time.Millisecond
	opts := Options{PinDir: pin, PoolSize: 4, Window: window, ReservationTTL: 2 * time.Second,
		DestPools: []DestPool{destPoolOf(t, "db", 4, 0, "127.0.0.1/32:"+portOf(db))}}
	l1, err := openRoot(t, root, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l1.Close() })
	h := startHelper(t, mkProject(t, root, "r"))
	if r := h.dial("tcp4", db.Addr().String(), 1); r.ok != 1 {
		t.Fatalf("r's first connect: %+v", r)
	}
	h.do("close")
	waitInUse(t, l1, 0, map[string]int{"r": 0})
	waitDest(t, l1, "db", 0, map[string]int{"r": 0})
	if a, err := l1.KernelActive(); err != nil || a != 1 || destSnap(t, l1, "db").KernelActive != 1 {
		t.Fatalf("before the restart: kernel active %d (%v), db's %d; want 1 and 1", a, err, destSnap(t, l1, "db").KernelActive)
	}
	if err := l1.Close(); err != nil {
		t.Fatal(err)
	}
	// The daemon down past the window: r has left it, and no Tick took it
	// out of the counts.
	time.Sleep(window + 100*time.Millisecond)
	l2, err := openRoot(t, root, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l2.Close() })
	if a, err := l2.KernelActive(); err != nil || a != 0 || destSnap(t, l2, "db").KernelActive != 0 {
		t.Fatalf("after the restart: kernel active %d (%v), db's %d; want 0 and 0 (r left the window)",
			a, err, destSnap(t, l2, "db").KernelActive)
	}
	// r alone: the whole of both pools (a connect to db counts in both).
	if r := h.dial("tcp4", db.Addr().String(), 5); r.ok != 4 || r.refused != 1 {
		t.Fatalf("r alone after the restart: %+v, want 4 admitted (the whole pool) and 1 refused", r)
	}
	if a, err := l2.KernelActive(); err != nil || a != 1 || destSnap(t, l2, "db").KernelActive != 1 {
		t.Fatalf("r back: kernel active %d (%v), db's %d; want 1 and 1", a, err, destSnap(t, l2, "db").KernelActive)
	}
	h.do("close")
	waitInUse(t, l2, 0, map[string]int{"r": 0})
	waitDest(t, l2, "db", 0, map[string]int{"r": 0})
}

// Connections and listeners that predate the programs are adopted by the
// first reconcile, and drift in the maps is repaired.
func TestAdoptAndRepair(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	cli := startHelper(t, mkProject(t, root, "old"))
	srv := startHelper(t, mkProject(t, root, "oldsrv"))
	if r := cli.dial("tcp4", ln.Addr().String(), 3); r.ok != 3 {
		t.Fatal(r)
	}
	addr := listenAddr(t, srv.do("listen 127.0.0.1:0"))

	l := openLimiter(t, root, pin, 10, 0)
	s := snap(t, l)
	if s.InUse != 3 || project(s, "old").InUse != 3 || s.Events.Adopted != 3 {
		t.Fatalf("after adoption: %+v", s)
	}
	// The pre-existing listener was found too: its connections count.
	c, err := net.DialTimeout("tcp4", addr, 3*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	waitInUse(t, l, 4, map[string]int{"oldsrv": 1})

	// Invent drift: two permits nobody holds.
	if _, err := l.adjust(limiterFsAdjustArgs{Op: opAdd, Project: uint64(project(s, "old").ID), Delta: 2}); err != nil {
		t.Fatal(err)
	}
	rep, err := l.Reconcile(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if rep.Repaired["old"] != -2 || rep.Drift["old"] != 2 {
		t.Fatalf("repair: %+v", rep)
	}
	waitInUse(t, l, 4, map[string]int{"old": 3})

	// A permit held for a socket of this netns that no longer exists is
	// released; one of another netns cannot be checked and is kept.
	id := uint64(project(s, "old").ID)
	// Cookies whose slots are free: a real socket's cookie may have taken
	// slot 0 or 1 (CI under load: an adopted connection in slot 0).
	var free []uint64
	for i := uint64(0); len(free) < 2 && i < uint64(l.held); i++ {
		var sl limiterFsSlot
		if err := l.objs.FsSlots.Lookup(uint32(i), &sl); err == nil && sl.Cookie == 0 {
			free = append(free, 1<<62+i)
		}
	}
	if len(free) < 2 {
		t.Fatal("no two free slots")
	}
	for _, e := range []struct{ cookie, netns uint64 }{{free[0], l.netns}, {free[1], l.netns + 1}} {
		// In the cookie's slot, as the programs would put it.
		idx := uint32(e.cookie & uint64(l.held-1))
		var old limiterFsSlot
		if err := l.objs.FsSlots.Lookup(idx, &old); err != nil || old.Cookie != 0 {
			t.Fatalf("slot %d: %+v %v", idx, old, err)
		}
		slot := limiterFsSlot{Cookie: e.cookie, Sock: limiterFsSock{Project: id, Netns: e.netns, Kind: 1}}
		if err := l.objs.FsSlots.Put(idx, slot); err != nil {
			t.Fatal(err)
		}
		if _, err := l.adjust(limiterFsAdjustArgs{Op: opAdd, Project: id, Delta: 1}); err != nil {
			t.Fatal(err)
		}
	}
	rep, err = l.Reconcile(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if rep.Orphans != 1 || len(rep.Repaired) != 0 || rep.Held["old"] != 4 {
		t.Fatalf("orphans: %+v", rep)
	}
	waitInUse(t, l, 5, map[string]int{"old": 4})
	if _, err := l.adjust(limiterFsAdjustArgs{Op: opDrop, Project: free[1]}); err != nil {
		t.Fatal(err)
	}
	waitInUse(t, l, 4, map[string]int{"old": 3})
	cli.do("close")
	c.Close()
	waitInUse(t, l, 0, map[string]int{"old": 0, "oldsrv": 0})
}

// Thousands of connections through every way a connection ends; afterwards
// the maps, the sockets' own flags and the kernel's socket table agree on
// zero.
func TestNoLeakAcrossLifecycles(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l, mono := openLimiterMono(t, root, pin, 400, 0, 2*time.Second)
	out := sink(t, "tcp4", "127.0.0.1:0").Addr().String()
	out6 := sink(t, "tcp6", "[::1]:0").Addr().String()
	closed := closedPort(t)
	full := fullBacklogListener(t)

	cli := startHelper(t, mkProject(t, root, "cli"))
	srv := startHelper(t, mkProject(t, root, "srv"))
	srvAddr := listenAddr(t, srv.do("listen 127.0.0.1:0"))
	total := 0
	for round := range 5 {
		// Outbound: orderly close and RST, both families.
		total += cli.dial("tcp4", out, 150).ok
		total += cli.dial("tcp6", out6, 50).ok
		cli.do("close")
		total += cli.dial("tcp4", out, 100).ok
		cli.do("rst")
		// Connect to a closed port (the kernel answers RST).
		if r := cli.dial("tcp4", closed, 50); r.refused != 50 {
			t.Fatalf("closed port: %+v", r)
		}
		// Refused by the limiter: more than the pool. srv (active from the
		// last round) leaves the window first, so that cli, alone, may
		// take the whole pool.
		mono.advance(time.Minute)
		if err := l.Tick(time.Now()); err != nil {
			t.Fatal(err)
		}
		r := cli.dial("tcp4", out, 450)
		if r.ok != 400 || r.refused != 50 {
			t.Fatalf("round %d over the pool: %+v", round, r)
		}
		cli.do("close")
		waitInUse(t, l, 0, nil)
		// Inbound: the test process is the client; half closed by the client,
		// half reset.
		var conns []net.Conn
		for range 100 {
			c, err := net.DialTimeout("tcp4", srvAddr, 3*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			conns = append(conns, c)
		}
		for i, c := range conns {
			if i%2 == 0 {
				c.(*net.TCPConn).SetLinger(0)
			}
			c.Close()
		}
		total += 100
		// The server closes its ends when it reads EOF: wait, so that the next
		// round's over-the-pool step starts from an empty node.
		waitInUse(t, l, 0, nil)
	}
	// Timeouts: SYNs to a full accept queue are dropped.
	if r := cli.dialTimeout("tcp4", full, 5, 200*time.Millisecond); r.other != 5 {
		t.Fatalf("timeouts: %+v", r)
	}
	// SIGKILL of a client and of a server holding connections.
	if r := cli.dial("tcp4", out, 50); r.ok != 50 {
		t.Fatal(r)
	}
	var conns []net.Conn
	for range 50 {
		c, err := net.DialTimeout("tcp4", srvAddr, 3*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		conns = append(conns, c)
	}
	waitInUse(t, l, 100, nil)
	cli.kill()
	srv.kill()
	// Listener closed with queued children.
	q := startHelper(t, mkProject(t, root, "queue"))
	qAddr := listenAddr(t, q.do("listen-noaccept 127.0.0.1:0"))
	for range 20 {
		c, err := net.DialTimeout("tcp4", qAddr, 3*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	waitInUse(t, l, 20, map[string]int{"queue": 20})
	q.do("unlisten")
	total += 1000 + 100

	waitInUse(t, l, 0, map[string]int{"cli": 0, "srv": 0, "queue": 0})
	if err := l.Tick(time.Now()); err != nil {
		t.Fatal(err)
	}
	rep, err := l.Reconcile(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	zero := func(m map[string]int) bool {
		for _, n := range m {
			if n != 0 {
				return false
			}
		}
		return true
	}
	if !zero(rep.Held) || !zero(rep.Kernel) || len(rep.Drift) != 0 || rep.Adopted != 0 {
		t.Fatalf("after churn: %+v", rep)
	}
	// The kernel's own table: no project socket that should hold a permit.
	socks, err := sockdiag.List(sockdiag.Options{})
	if err != nil {
		t.Fatal(err)
	}
	idx, err := cgroup.ProjectIndex(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range socks {
		if _, ok := idx[s.CgroupID]; ok && ShouldHold(s) {
			t.Errorf("project socket still holding: %+v", s)
		}
	}
	s := snap(t, l)
	t.Logf("%d connections; events %+v; reservations %d", total, s.Events, s.Reservations)
	if s.Events.Unaccounted != 0 || s.Events.MapFull != 0 {
		t.Errorf("events: %+v", s.Events)
	}
}

// closedPort returns an address nothing listens on.
func closedPort(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// fullBacklogListener returns the address of a listener (outside every
// project) whose accept queue is full, so that further SYNs are dropped and
// connects time out.
func fullBacklogListener(t testing.TB) string {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	addr := (&net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: sa.(*unix.SockaddrInet4).Port}).String()
	// Fill the queue (backlog 0 admits one).
	for range 2 {
		c, err := net.DialTimeout("tcp4", addr, 200*time.Millisecond)
		if err == nil {
			t.Cleanup(func() { c.Close() })
		}
	}
	return addr
}

// A project working in its own network namespace: its connections are
// counted both ways (inbound is admitted when the handshake completes, as
// sk_lookup is attached to the daemon's namespace only), and reconcile from
// the daemon's namespace neither drops nor "repairs" them.
func TestOtherNetnsCountedAndKept(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 10, 0)
	h := startHelperNS(t, mkProject(t, root, "ns"), true)
	addr := listenAddr(t, h.do("listen 127.0.0.1:0"))
	if r := h.dial("tcp4", addr, 3); r.ok != 3 {
		t.Fatal(r)
	}
	// 3 outbound + 3 accepted.
	waitInUse(t, l, 6, map[string]int{"ns": 6})
	rep, err := l.Reconcile(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if rep.Orphans != 0 || len(rep.Repaired) != 0 || rep.Held["ns"] != 6 || rep.Kernel["ns"] != 0 {
		t.Fatalf("reconcile: %+v", rep)
	}
	waitInUse(t, l, 6, map[string]int{"ns": 6})
	h.do("close")
	waitInUse(t, l, 0, map[string]int{"ns": 0})
}

// A permit whose cookie's slot is taken by a longer-lived socket goes to the
// spill table; it is counted, released exactly once, and the spill count
// returns to zero.
func TestSpilledPermits(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	const pool = 500 // 1024 slots
	l := openLimiter(t, root, pin, pool, 1)
	if l.held != 1024 {
		t.Fatalf("slots %d, want 1024", l.held)
	}
	ln := sink(t, "tcp4", "127.0.0.1:0")
	h := startHelper(t, mkProject(t, root, "spill"))
	// Its connects and burns from one CPU's cookies: spread over two, the
	// burns moved the other CPU's sequence on, the connects' cookies took
	// consecutive slots, and none collided (CI, once, under load).
	h.pinOneCPU()
	spilled := func() int64 { return nodeSpilled(t, l) }
	held := 0
	for held < pool-50 && spilled() < 10 {
		if r := h.dial("tcp4", ln.Addr().String(), 50); r.ok != 50 {
			t.Fatalf("dial: %+v; %+v", r, snap(t, l))
		}
		held += 50
		h.do("burn 300")
	}
	if spilled() == 0 {
		t.Fatalf("no permit spilled with %d held", held)
	}
	if s := snap(t, l); s.InUse != held || project(s, "spill").InUse != held {
		t.Fatalf("held %d: %+v", held, s)
	}
	rep, err := l.Reconcile(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if rep.Held["spill"] != held || len(rep.Repaired) != 0 || rep.Orphans != 0 {
		t.Fatalf("reconcile with %d spilled: %+v", spilled(), rep)
	}
	t.Logf("%d held, %d spilled", held, spilled())
	h.do("close")
	waitInUse(t, l, 0, map[string]int{"spill": 0})
	if n := spilled(); n != 0 {
		t.Fatalf("spilled %d after close", n)
	}
}

// Connections older than the programs past what the held-permit tables hold
// (1024 slots and 1024 spill entries for a small pool): the pass adopts what
// fits and reports the rest, by project, uncounted; nothing is given back
// for them when they end, and a later pass adopts them once others end.
func TestUnadoptedWhenTablesFull(t *testing.T) {
	testutil.RequireRoot(t)
	// Both ends of 2200 connections in this process and the helpers' (Go
	// raises the soft limit to the hard one).
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil || lim.Max < 5000 {
		t.Skipf("needs 5000 open files, the hard limit is %d (%v)", lim.Max, err)
	}
	root, pin := newRoot(t), newPinDir(t)
	var logged testutil.Buffer
	l, err := openRoot(t, root, Options{PinDir: pin, PoolSize: 2, Logger: slog.New(slog.NewTextHandler(&logged, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if l.held != 1024 {
		t.Fatalf("slots %d, want 1024", l.held)
	}
	ln := sink(t, "tcp4", "127.0.0.1:0")
	// Made without mkProject: no member yet, so no program counts them.
	dir := mkdirs(t, root, "flood")[0]
	many, few := startHelper(t, dir), startHelper(t, dir)
	const nMany, nFew = 2000, 200
	if r := many.dial("tcp4", ln.Addr().String(), nMany); r.ok != nMany {
		t.Fatalf("dials %+v", r)
	}
	if r := few.dial("tcp4", ln.Addr().String(), nFew); r.ok != nFew {
		t.Fatalf("dials %+v", r)
	}
	setMembers(t, l, []Member{{Project: "flood", Cgroup: dir}})
	rep, err := l.Reconcile(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	un := rep.Unadopted["flood"]
	if rep.Adopted+un != nMany+nFew || un < nMany+nFew-2*int(l.held) || len(rep.Unadopted) != 1 {
		t.Fatalf("adopted %d, not adopted %v; want %d in all, at least %d not adopted", rep.Adopted, rep.Unadopted,
			nMany+nFew, nMany+nFew-2*int(l.held))
	}
	if s := snap(t, l); s.InUse != rep.Adopted || project(s, "flood").InUse != rep.Adopted || rep.Held["flood"] != rep.Adopted {
		t.Fatalf("adopted %d: held %v, %+v", rep.Adopted, rep.Held, s)
	}
	want := fmt.Sprintf(`project=flood count=%d permits_held=%d slots=1024 spill_entries=1024`, un, rep.Adopted)
	if !strings.Contains(logged.String(), "could not be adopted") || !strings.Contains(logged.String(), want) {
		t.Fatalf("log lacks the warning %q:\n%s", want, logged.String())
	}
	t.Logf("adopted %d, not adopted %d", rep.Adopted, un)
	// Room again: the next pass adopts the rest, exactly, and no pass
	// finds a count to repair (nothing was given back for a socket that
	// held no permit, nor kept for one that ended).
	many.do("close")
	eventually(t, "the next pass", func() (bool, string) {
		rep, err := l.Reconcile(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if len(rep.Drift) != 0 || len(rep.Repaired) != 0 || rep.Orphans != 0 {
			t.Fatalf("a pass after the close repaired: drift %v, repaired %v, orphans %d", rep.Drift, rep.Repaired, rep.Orphans)
		}
		s := snap(t, l)
		return len(rep.Unadopted) == 0 && rep.Kernel["flood"] == nFew && s.InUse == nFew && project(s, "flood").InUse == nFew,
			fmt.Sprintf("unadopted %v, kernel %v, %+v", rep.Unadopted, rep.Kernel, s)
	})
	few.do("close")
	waitInUse(t, l, 0, map[string]int{"flood": 0})
}

// A second Open over pinned links moves them to the programs it loaded (a
// fixed limiter.c takes effect across a restart), and enforcement goes on.
func TestReopenUpdatesPinnedLinks(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	l1 := openLimiter(t, root, pin, 3, 1)
	h := startHelper(t, mkProject(t, root, "up"))
	if r := h.dial("tcp4", ln.Addr().String(), 2); r.ok != 2 {
		t.Fatal(r)
	}
	l2 := openLimiter(t, root, pin, 3, 1)
	for _, a := range l2.attachments(root, &l2.objs) {
		lk, err := link.LoadPinnedLink(filepath.Join(pin, a.name), nil)
		if err != nil {
			t.Fatalf("%s: %v", a.name, err)
		}
		info, err := lk.Info()
		lk.Close()
		if err != nil {
			t.Fatalf("%s: %v", a.name, err)
		}
		want, old := progID(t, a.prog), progID(t, progByName(l1, a.name))
		if info.Program != want || want == old {
			t.Errorf("%s runs program %d, want the new %d (old %d)", a.name, info.Program, want, old)
		}
	}
	l1.Close()
	// Counts carried over; the new programs admit, refuse and release.
	if r := h.dial("tcp4", ln.Addr().String(), 2); r.ok != 1 || r.refused != 1 {
		t.Fatalf("after the update: %+v; %+v", r, snap(t, l2))
	}
	h.do("close")
	waitInUse(t, l2, 0, map[string]int{"up": 0})
}

func progID(t testing.TB, p *ebpf.Program) ebpf.ProgramID {
	t.Helper()
	info, err := p.Info()
	if err != nil {
		t.Fatal(err)
	}
	id, ok := info.ID()
	if !ok {
		t.Fatal("program info without id")
	}
	return id
}

func progByName(l *Limiter, name string) *ebpf.Program {
	for _, a := range l.attachments(l.root, &l.objs) {
		if a.name == name {
			return a.prog
		}
	}
	return nil
}
