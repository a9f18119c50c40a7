// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/loader/limits"
)

// portOwned says whether sk_lookup finds port's listener in the port entry
// (its owner is valid) rather than in the listener hash.
func portOwned(t testing.TB, l *Limiter, port uint16) bool {
	t.Helper()
	var p limiterFsPort
	if err := l.objs.FsPorts.Lookup(uint32(port), &p); err != nil {
		t.Fatal(err)
	}
	if p.Specific+p.Wildcard != 1 || p.Sk == 0 || p.Check != ownerCheck(p.Sk, p.Cookie, p.Project, p.Cgroup) {
		return false
	}
	var k limiterFsListenKey
	var v limiterFsListener
	it := l.objs.FsListeners.Iterate()
	for it.Next(&k, &v) {
		if k.Port == uint32(port) && v.Sk == p.Sk && v.Cookie == p.Cookie && v.Project == p.Project {
			return true
		}
	}
	return false
}

// The port entry names the listener of a port with one listening address;
// a SYN to another address of that port is not the listener's. With two
// addresses on one port (two projects), sk_lookup falls back to the hash:
// each connection counts, and is refused, for the project listening on its
// address, also after one of them closes.
func TestInboundOneAddressOwnerAndFallback(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 3, 1)
	a := startHelper(t, mkProject(t, root, "a"))
	b := startHelper(t, mkProject(t, root, "b"))
	addrA := netip.MustParseAddrPort(listenAddr(t, a.do("listen 127.0.0.1:0")))
	port := addrA.Port()
	if !portOwned(t, l, port) {
		t.Fatal("a port with one listening address has no owner")
	}
	// Another address of the port, outside the projects: not a's.
	addrB := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.2"), port)
	other := sink(t, "tcp4", addrB.String())
	c, err := net.DialTimeout("tcp4", addrB.String(), 3*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if s := snap(t, l); s.Events.AdmittedIn != 0 || project(s, "a").InUse != 0 {
		t.Fatalf("a connection to another address counted for the listener: %+v", s)
	}
	other.Close()

	if got := listenAddr(t, b.do("listen %s", addrB)); got != addrB.String() {
		t.Fatalf("b listens on %s, want %s", got, addrB)
	}
	if portOwned(t, l, port) {
		t.Fatal("a port with two listening addresses has an owner")
	}
	var conns []net.Conn
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	dial := func(addr netip.AddrPort) error {
		c, err := net.DialTimeout("tcp4", addr.String(), 3*time.Second)
		if err == nil {
			conns = append(conns, c)
		}
		return err
	}
	// POOL 3: a takes two while alone, b one as the second active project.
	for _, to := range []netip.AddrPort{addrA, addrA, addrB} {
		if err := dial(to); err != nil {
			t.Fatalf("dial %s: %v; %+v", to, err, snap(t, l))
		}
	}
	waitInUse(t, l, 3, map[string]int{"a": 2, "b": 1})
	// Each refusal is charged to the project of the address: at least once
	// (an nftables socket expression at input, as a benchmark's peer
	// installs, looks the SYN up again, sk_lookup included), and never to
	// the other.
	var ra0 uint64
	for i, to := range []netip.AddrPort{addrA, addrB} {
		if err := dial(to); !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("dial %s over the pool: %v, want ECONNREFUSED", to, err)
		}
		s := snap(t, l)
		ra, rb := project(s, "a").Refused, project(s, "b").Refused
		if (i == 0 && (ra < 1 || rb != 0)) || (i == 1 && (ra != ra0 || rb < 1)) {
			t.Fatalf("after refusing %s: refused a %d b %d", to, ra, rb)
		}
		ra0 = ra
	}
	for _, c := range conns {
		c.Close()
	}
	conns = nil
	waitInUse(t, l, 0, map[string]int{"a": 0, "b": 0})

	// b closes: a's address is the port's only one again, found in the hash.
	b.do("unlisten")
	eventually(t, "b's address forgotten", func() (bool, string) {
		var p limiterFsPort
		err := l.objs.FsPorts.Lookup(uint32(port), &p)
		return err == nil && p.Specific == 1, fmt.Sprintf("%+v %v", p, err)
	})
	if err := dial(addrB); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("dial %s with nobody listening: %v", addrB, err)
	}
	if err := dial(addrA); err != nil {
		t.Fatal(err)
	}
	waitInUse(t, l, 1, map[string]int{"a": 1, "b": 0})
}

// A listener whose close the programs missed (they were detached, as while
// a restart into a new version swaps the tracepoint link) stays counted for
// its port and project. Reconcile finds it missing from the kernel's socket
// table and uncounts it, once, and leaves a live listener counted.
func TestReconcileUncountsGoneListeners(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 10, 1)
	gone := startHelper(t, mkProject(t, root, "gone"))
	kept := startHelper(t, mkProject(t, root, "kept"))
	gonePort := netip.MustParseAddrPort(listenAddr(t, gone.do("listen 127.0.0.1:0"))).Port()
	keptAddr := listenAddr(t, kept.do("listen 127.0.0.1:0"))
	counted := func() int {
		cookies, err := l.countedListeners()
		if err != nil {
			t.Fatal(err)
		}
		return len(cookies[l.netns])
	}
	eventually(t, "both listeners counted", func() (bool, string) {
		return counted() == 2, fmt.Sprint(counted())
	})

	detachLinks(t, l)
	if r := gone.do("unlisten"); r != "unlistened" {
		t.Fatal(r)
	}
	attachLinks(t, l, &l.objs)
	if n := counted(); n != 2 {
		t.Fatalf("%d listeners counted after a close the programs missed, want 2 (the test needs the stale one)", n)
	}
	var port limiterFsPort
	if err := l.objs.FsPorts.Lookup(uint32(gonePort), &port); err != nil || port.Specific != 1 {
		t.Fatalf("port %d before reconcile: %+v, %v; want one address counted", gonePort, port, err)
	}

	rep, err := l.Reconcile(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if rep.StaleListeners != 1 || counted() != 1 {
		t.Fatalf("reconcile: %d stale listeners uncounted, %d still counted; want 1 and 1", rep.StaleListeners, counted())
	}
	if err := l.objs.FsPorts.Lookup(uint32(gonePort), &port); err != nil || port.Specific != 0 || port.Wildcard != 0 {
		t.Fatalf("port %d after reconcile: %+v, %v; want no address counted", gonePort, port, err)
	}
	if rep, err := l.Reconcile(t.Context()); err != nil || rep.StaleListeners != 0 {
		t.Fatalf("second reconcile: %d stale, %v; want none", rep.StaleListeners, err)
	}
	// The live listener still counts its connections for its project.
	c, err := net.DialTimeout("tcp4", keptAddr, 3*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	waitInUse(t, l, 1, map[string]int{"kept": 1})
}

// Two SO_REUSEPORT listeners on one address, closed in the order they were
// opened: the remaining one still has its connections counted and refused.
func TestReuseportListenersRefcounted(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 4, 1) // inbound, 3: a floor short of the pool
	srv := startHelper(t, mkProject(t, root, "rp"))
	a := listenAddr(t, srv.do("listen-reuseport 127.0.0.1:0"))
	if b := listenAddr(t, srv.do("listen-reuseport %s", a)); b != a {
		t.Fatalf("second listener on %s, want %s", b, a)
	}
	refs := func() int {
		var k limiterFsListenKey
		var v limiterFsListener
		n, it := 0, l.objs.FsListeners.Iterate()
		for it.Next(&k, &v) {
			n += int(v.Refs)
		}
		return n
	}
	eventually(t, "two refs", func() (bool, string) { return refs() == 2, fmt.Sprint(refs()) })
	// The reconcile dump sees both listeners again: not counted twice.
	if _, err := l.Reconcile(t.Context()); err != nil {
		t.Fatal(err)
	}
	if n := refs(); n != 2 {
		t.Fatalf("after a reconcile: %d refs, want 2", n)
	}
	srv.do("unlisten-first")
	eventually(t, "one ref", func() (bool, string) { return refs() == 1, fmt.Sprint(refs()) })
	var conns []net.Conn
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	for range 3 {
		c, err := net.DialTimeout("tcp4", a, 3*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	waitInUse(t, l, 3, map[string]int{"rp": 3})
	if _, err := net.DialTimeout("tcp4", a, 3*time.Second); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("fourth connection to the remaining listener: %v, want ECONNREFUSED", err)
	}
	for _, c := range conns {
		c.Close()
	}
	conns = nil
	waitInUse(t, l, 0, map[string]int{"rp": 0})
	// The last listener closes: the address and its port count go.
	srv.do("unlisten")
	eventually(t, "address forgotten", func() (bool, string) {
		var k limiterFsListenKey
		var v limiterFsListener
		n, it := 0, l.objs.FsListeners.Iterate()
		for it.Next(&k, &v) {
			n++
		}
		var port limiterFsPort
		if err := l.objs.FsPorts.Lookup(k.Port, &port); err != nil {
			return false, err.Error()
		}
		return n == 0 && port.Specific == 0 && port.Wildcard == 0, fmt.Sprintf("%d listener entries left, port %+v", n, port)
	})
}

// Regression: the port's owner could outlive its listener, so a SYN to
// the port was reserved for a listener that no longer took it and the
// reservation sat out the TTL. The kernel unhashes a listener before its
// close reaches the state tracepoint; here the close is missed altogether
// (the programs are detached while it happens), which keeps the stale owner
// until a reconcile. A SYN to the port is reset by the kernel and must leave
// nothing reserved.
func TestStaleOwnerReservesNothing(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l, _ := openLimiterMono(t, root, pin, 5, 1, limits.MaxReservationTTL)
	srv := startHelper(t, mkProject(t, root, "gone"))
	addr := netip.MustParseAddrPort(listenAddr(t, srv.do("listen-backlog 127.0.0.1:0 16")))
	eventually(t, "owner", func() (bool, string) { return portOwned(t, l, addr.Port()), "no owner" })
	detachLinks(t, l)
	srv.do("unlisten")
	attachLinks(t, l, &l.objs)
	var p limiterFsPort
	if err := l.objs.FsPorts.Lookup(uint32(addr.Port()), &p); err != nil || p.Specific != 1 || p.Sk == 0 {
		t.Fatalf("port after the missed close: %+v %v; the test needs the stale owner", p, err)
	}
	_, err := net.DialTimeout("tcp4", addr.String(), 3*time.Second)
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("dial with no listener: %v, want ECONNREFUSED", err)
	}
	if s := snap(t, l); s.InUse != 0 || s.Reservations != 0 || s.Events.AdmittedIn != 0 {
		t.Fatalf("a SYN to a closed listener's port was reserved: %+v", s)
	}
}

// Regression: port_change skipped a decrement that came before its
// increment (an on_listen and the listener's close racing: the close's
// unlisten deletes the address and decrements between on_listen's insert
// and its increment). The port then stayed "listened" for good and never got
// an owner again. The two steps are run in that order here (fs_selftest);
// afterwards the port counts nothing, and a listener opened on it is its
// owner and has its connections counted.
func TestPortCountsSurviveEarlyDecrement(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 5, 1)
	port := freePort(t)
	k := limiterFsListenKey{Netns: l.netns, Port: uint32(port), Scope: 1, Addr: [16]byte{10: 0xff, 11: 0xff, 12: 127, 15: 1}}
	for _, d := range []int32{-1, 1} {
		if _, err := l.selftest(limiterFsSelftestArgs{Op: stPortChange, Delta: d, Lkey: k}); err != nil {
			t.Fatal(err)
		}
	}
	var p limiterFsPort
	if err := l.objs.FsPorts.Lookup(uint32(port), &p); err != nil || p.Specific != 0 || p.Wildcard != 0 {
		t.Fatalf("port %d after a removal and its addition: %+v %v; want no address counted", port, p, err)
	}
	srv := startHelper(t, mkProject(t, root, "late"))
	a := listenAddr(t, srv.do("listen 127.0.0.1:%d", port))
	eventually(t, "owner", func() (bool, string) { return portOwned(t, l, port), "no owner" })
	c, err := net.DialTimeout("tcp4", a, 3*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	waitInUse(t, l, 1, map[string]int{"late": 1})
}

// Regression: 0.0.0.0 and [::] shared the all-zero listener key, so an
// IPv4 SYN to a v6-only [::] listener's port (or IPv6 to a 0.0.0.0 one) was
// reserved for that listener's project, though the kernel resets it, and the
// reservation sat out the TTL; and two such listeners of two projects on one
// port were counted as one. The key carries the families an address takes.
func TestWildcardScopes(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l, _ := openLimiterMono(t, root, pin, 10, 1, limits.MaxReservationTTL)
	v6 := startHelper(t, mkProject(t, root, "v6"))
	port := freePort(t)
	listenAddr(t, v6.do("listen-backlog [::]:%d 16 v6only", port))
	v4addr := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), port)
	if _, err := net.DialTimeout("tcp4", v4addr.String(), 3*time.Second); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("IPv4 to a v6-only listener's port: %v, want ECONNREFUSED", err)
	}
	if s := snap(t, l); s.InUse != 0 || s.Reservations != 0 || s.Events.AdmittedIn != 0 {
		t.Fatalf("an IPv4 SYN was reserved for the v6-only listener: %+v", s)
	}
	// An IPv4 listener of another project on the same port.
	v4 := startHelper(t, mkProject(t, root, "v4"))
	listenAddr(t, v4.do("listen-backlog 0.0.0.0:%d 16", port))
	var conns []net.Conn
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	for _, d := range []struct{ network, addr string }{
		{"tcp4", v4addr.String()}, {"tcp6", netip.AddrPortFrom(netip.IPv6Loopback(), port).String()},
		{"tcp6", netip.AddrPortFrom(netip.IPv6Loopback(), port).String()},
	} {
		c, err := net.DialTimeout(d.network, d.addr, 3*time.Second)
		if err != nil {
			t.Fatalf("%s %s: %v", d.network, d.addr, err)
		}
		conns = append(conns, c)
	}
	waitInUse(t, l, 3, map[string]int{"v4": 1, "v6": 2})
	if s := snap(t, l); s.Reservations != 0 {
		t.Fatalf("%+v", s)
	}
}

// Regression: the port's owner was several words under a sequence lock
// whose reads relied on x86 keeping loads in order; elsewhere a reader could
// mix two owners' fields (one's address, the other's project). The owner's
// words now carry a check word mixed from them, and the socket they name is
// checked against its cookie: words of two writes fail the first, a socket
// that is not the one named fails the second, and either way the SYN goes to
// the hash. Here such mixes are written into the port entry (claiming one
// address), and each connection still counts for the project listening on
// its address.
func TestOwnerCheckedAgainstSocket(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 10, 1)
	a := startHelper(t, mkProject(t, root, "a"))
	b := startHelper(t, mkProject(t, root, "b"))
	addrA := netip.MustParseAddrPort(listenAddr(t, a.do("listen-backlog 127.0.0.1:0 16")))
	port := addrA.Port()
	addrB := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.2"), port)
	listenAddr(t, b.do("listen-backlog %s 16", addrB))
	by := map[byte]limiterFsListener{}
	eventually(t, "two listeners", func() (bool, string) {
		var k limiterFsListenKey
		var v limiterFsListener
		it := l.objs.FsListeners.Iterate()
		for it.Next(&k, &v) {
			if k.Port == uint32(port) {
				by[k.Addr[15]] = v
			}
		}
		return len(by) == 2, fmt.Sprint(by)
	})
	la, lb := by[1], by[2]
	var orig limiterFsPort
	if err := l.objs.FsPorts.Lookup(uint32(port), &orig); err != nil || orig.Specific != 2 {
		t.Fatalf("port %+v %v", orig, err)
	}
	t.Cleanup(func() { _ = l.objs.FsPorts.Put(uint32(port), orig) })
	var conns []net.Conn
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	owner := func(sk, cookie, project, cgroup uint64, check bool) limiterFsPort {
		p := limiterFsPort{Specific: 1, Version: orig.Version, Sk: sk, Cookie: cookie, Project: project, Cgroup: cgroup}
		p.Check = ownerCheck(lb.Sk, lb.Cookie, lb.Project, lb.Cgroup) // b's, as b's write left it
		if check {
			p.Check = ownerCheck(sk, cookie, project, cgroup)
		}
		return p
	}
	for i, c := range []struct {
		name string
		port limiterFsPort
		to   netip.AddrPort
		want map[string]int
	}{
		// b's address and cookie, a's project, b's check: torn words.
		{"torn", owner(lb.Sk, lb.Cookie, la.Project, la.Cgroup, false), addrB, map[string]int{"a": 0, "b": 1}},
		// a's project with a check that matches, over b's socket and a's
		// cookie: not the socket it names.
		{"wrong socket", owner(lb.Sk, la.Cookie, la.Project, la.Cgroup, true), addrB, map[string]int{"a": 0, "b": 2}},
		// The words of a consistent owner are believed: a's socket and
		// cookie with b's project take a's connection for b. (A listener
		// entry says a: were the owner ignored, a would be charged.)
		{"consistent", owner(la.Sk, la.Cookie, lb.Project, lb.Cgroup, true), addrA, map[string]int{"a": 0, "b": 3}},
	} {
		if err := l.objs.FsPorts.Put(uint32(port), c.port); err != nil {
			t.Fatal(err)
		}
		conn, err := net.DialTimeout("tcp4", c.to.String(), 3*time.Second)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		conns = append(conns, conn)
		waitInUse(t, l, i+1, c.want)
	}
}

// ownerCheck is owner_check in bpf/lib/listen.h.
func ownerCheck(sk, cookie, id, cg uint64) uint64 {
	h := (sk ^ 0x5bd1e9955bd1e995) * 0x9e3779b97f4a7c15
	h = (h ^ (h >> 29) ^ cookie) * 0xbf58476d1ce4e5b9
	h = (h ^ (h >> 31) ^ id) * 0x94d049bb133111eb
	h = (h ^ (h >> 29) ^ cg) * 0x9e3779b97f4a7c15
	return h ^ (h >> 32)
}

// A project's listener that finds a listener table full goes uncounted: no
// port entry, so the rule neither counts nor refuses its inbound
// connections. The programs count it in Events.MapFull (which the daemon
// exports and warns of), at its listen and again at a reconcile pass that
// finds the table still full. fs_listen_socks (an entry per listening
// socket) fills first; fs_listeners (one per address) is shrunk alone too.
func TestListenerTableFullCounted(t *testing.T) {
	testutil.RequireRoot(t)
	for _, table := range []string{"fs_listen_socks", "fs_listeners"} {
		t.Run(table, func(t *testing.T) {
			specEdit = func(s *ebpf.CollectionSpec) { s.Maps[table].MaxEntries = 2 }
			t.Cleanup(func() { specEdit = nil })
			root, pin := newRoot(t), newPinDir(t)
			l := openLimiter(t, root, pin, 4, 1)
			specEdit = nil
			m := map[string]*ebpf.Map{"fs_listen_socks": l.objs.FsListenSocks, "fs_listeners": l.objs.FsListeners}[table]
			if n := m.MaxEntries(); n != 2 {
				t.Fatalf("%s has %d entries, want 2 (specEdit)", table, n)
			}
			srv := startHelper(t, mkProject(t, root, "many"))
			listened := func(port uint16) bool {
				var p limiterFsPort
				if err := l.objs.FsPorts.Lookup(uint32(port), &p); err != nil {
					t.Fatal(err)
				}
				return p.Specific+p.Wildcard > 0
			}
			for range 2 {
				a := netip.MustParseAddrPort(listenAddr(t, srv.do("listen 127.0.0.1:0")))
				if !listened(a.Port()) {
					t.Fatalf("listener %s uncounted with room in the tables", a)
				}
			}
			if e := snap(t, l).Events; e.MapFull != 0 {
				t.Fatalf("map_full %d with room in the tables", e.MapFull)
			}
			a := netip.MustParseAddrPort(listenAddr(t, srv.do("listen 127.0.0.1:0")))
			if listened(a.Port()) {
				t.Fatalf("listener %s counted in a full %s", a, table)
			}
			eventually(t, "the uncounted listener counted as map_full", func() (bool, string) {
				e := snap(t, l).Events
				return e.MapFull == 1, fmt.Sprintf("map_full %d, want 1", e.MapFull)
			})
			// The pass sees it again and tries again: the table is still full.
			if _, err := l.Reconcile(t.Context()); err != nil {
				t.Fatal(err)
			}
			if e, err := l.Events(); err != nil || e.MapFull != 2 {
				t.Fatalf("after a reconcile pass: map_full %d (%v), want 2", e.MapFull, err)
			}
			if listened(a.Port()) {
				t.Fatalf("listener %s counted in a full %s after a reconcile pass", a, table)
			}
		})
	}
}
