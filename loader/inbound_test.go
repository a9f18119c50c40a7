// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

func listenAddr(t testing.TB, reply string) string {
	t.Helper()
	a, ok := strings.CutPrefix(reply, "listening ")
	if !ok {
		t.Fatalf("helper: %q", reply)
	}
	return a
}

func waitHeld(t testing.TB, h *helper, n int) {
	t.Helper()
	eventually(t, "server held", func() (bool, string) {
		r := h.do("held")
		return r == "held "+strconv.Itoa(n), r
	})
}

// An accepted connection takes a permit for the listener's project (a Go
// listener: MPTCP socket, TCP fallback). Over the pool, the SYN is answered
// with an RST: the client's connect fails with ECONNREFUSED and the server's
// accept() never sees it.
func TestInboundCountRefuseRelease(t *testing.T) {
	testutil.RequireRoot(t)
	for _, tc := range []struct{ name, listen, dial, network string }{
		{"ipv4", "127.0.0.1:0", "", "tcp4"},
		{"ipv6", "[::1]:0", "", "tcp6"},
		{"dualstack-v4", ":0", "127.0.0.1", "tcp4"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root, pin := newRoot(t), newPinDir(t)
			l := openLimiter(t, root, pin, 5, 1)
			srv := startHelper(t, mkProject(t, root, "srv"))
			addr := listenAddr(t, srv.do("listen %s", tc.listen))
			if tc.dial != "" {
				_, port, _ := net.SplitHostPort(addr)
				addr = net.JoinHostPort(tc.dial, port)
			}
			var conns []net.Conn
			defer func() {
				for _, c := range conns {
					c.Close()
				}
			}()
			for range 5 {
				c, err := net.DialTimeout(tc.network, addr, 3*time.Second)
				if err != nil {
					t.Fatalf("%v; %+v", err, snap(t, l))
				}
				conns = append(conns, c)
			}
			waitHeld(t, srv, 5)
			s := snap(t, l)
			if s.InUse != 5 || project(s, "srv").InUse != 5 || s.Reservations != 0 || s.Events.AdmittedIn != 5 {
				t.Fatalf("%+v", s)
			}
			start := time.Now()
			_, err := net.DialTimeout(tc.network, addr, 3*time.Second)
			if !errors.Is(err, syscall.ECONNREFUSED) {
				t.Fatalf("sixth connection: %v, want ECONNREFUSED", err)
			}
			if d := time.Since(start); d > 2*time.Second {
				t.Errorf("refusal took %v", d)
			}
			waitHeld(t, srv, 5)
			if s := snap(t, l); s.Events.RefusedIn != 1 || project(s, "srv").Refused != 1 || s.InUse != 5 {
				t.Fatalf("%+v", s)
			}
			for _, c := range conns {
				c.Close()
			}
			conns = nil
			waitInUse(t, l, 0, map[string]int{"srv": 0})
			waitHeld(t, srv, 0)
		})
	}
}

// Children still queued when their listener closes are reset and give their
// permits back (they never get a sock_release).
func TestInboundListenerClosedWithQueuedChildren(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 10, 1)
	srv := startHelper(t, mkProject(t, root, "q"))
	addr := listenAddr(t, srv.do("listen-noaccept 127.0.0.1:0"))
	for range 4 {
		c, err := net.DialTimeout("tcp4", addr, 3*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	waitInUse(t, l, 4, map[string]int{"q": 4})
	srv.do("unlisten")
	waitInUse(t, l, 0, map[string]int{"q": 0})
}

// Handshakes in flight hold a reservation: with half-open handshakes (a raw
// SYN from a client that then vanishes without a word), node-wide in_use
// stays within POOL, SYNs over it are reset, and Tick gives the stale
// reservations back after the TTL (the kernel keeps the request sockets
// longer). The TTL is the longest allowed, on a monotonic clock the test
// moves on, so a slow machine cannot expire them early and the test does not
// sleep.
func TestInboundReservationsBoundAndExpire(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	const ttl = MaxReservationTTL
	l, mono := openLimiterMono(t, root, pin, 3, 1, ttl)
	srv := startHelper(t, mkProject(t, root, "syn"))
	addr := netip.MustParseAddrPort(listenAddr(t, srv.do("listen 127.0.0.1:0")))

	// The kernel would answer the SYN-ACKs with resets (no socket), which
	// drop the request sockets and their reservations at once
	// (TestInboundClientGoneGivesBack); silenced, the clients look gone.
	silence(t, 40000, 40005)
	for i := range 6 {
		sendSYN(t, addr, uint16(40000+i))
	}
	eventually(t, "reservations", func() (bool, string) {
		s := snap(t, l)
		return s.Reservations == 3 && s.InUse == 3 && s.Events.RefusedIn == 3, fmt.Sprintf("%+v", s)
	})
	// No more room: a real connect is refused.
	if _, err := net.DialTimeout("tcp4", addr.String(), 3*time.Second); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("connect while reservations fill the pool: %v", err)
	}
	mono.advance(ttl - time.Minute)
	if err := l.Tick(time.Now()); err != nil {
		t.Fatal(err)
	}
	if s := snap(t, l); s.Reservations != 3 || s.Events.Expired != 0 {
		t.Fatalf("expired before the TTL: %+v", s)
	}
	// An expiry names the stamp it read: a reservation the tuple made since
	// (another stamp) is left alone, the one read is ended.
	var seen []limiterFsAdjustArgs
	if err := l.readResv(func(k limiterFsResvKey, v limiterFsResv) {
		seen = append(seen, limiterFsAdjustArgs{Op: opExpire, Key: k, SinceNs: v.SinceNs})
	}); err != nil || len(seen) != 3 {
		t.Fatalf("reading reservations: %d, %v", len(seen), err)
	}
	stale := seen[0]
	stale.SinceNs--
	if r, err := l.adjust(stale); err != nil || r != 0 {
		t.Fatalf("expiry with another stamp: result %d, %v; want 0 (left alone)", r, err)
	}
	if s := snap(t, l); s.Reservations != 3 || s.InUse != 3 || s.Events.Expired != 0 {
		t.Fatalf("a reservation with another stamp was ended: %+v", s)
	}
	if r, err := l.adjust(seen[0]); err != nil || r != 1 {
		t.Fatalf("expiry with the stamp read: result %d, %v; want 1", r, err)
	}
	if s := snap(t, l); s.Reservations != 2 || s.InUse != 2 || s.Events.Expired != 1 {
		t.Fatalf("after one expiry: %+v", s)
	}
	mono.advance(2 * time.Minute)
	if err := l.Tick(time.Now()); err != nil {
		t.Fatal(err)
	}
	s := snap(t, l)
	if s.Reservations != 0 || s.InUse != 0 || s.Events.Expired != 3 {
		t.Fatalf("after the TTL: %+v", s)
	}
	c, err := net.DialTimeout("tcp4", addr.String(), 3*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	waitInUse(t, l, 0, nil)
}

// A reservation whose slot another handshake holds goes to the spill table.
// The test places tuples with the programs' own hash (resvSlot): half-open
// handshakes (silent clients) fill distinct slots, more from other ports land
// on slots already taken and spill, and so do completed handshakes. A
// retransmitted SYN finds its reservation in either table and takes nothing
// more, a completed handshake is converted from either, reconcile counts
// both, and the expiry gives every one back exactly once.
func TestInboundReservationsSpill(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	const ttl = MaxReservationTTL
	const pool, first, spill, dials = 400, 200, 100, 50
	const open = first + spill
	l, mono := openLimiterMono(t, root, pin, pool, 1, ttl)
	srv := startHelper(t, mkProject(t, root, "srv"))
	addr := netip.MustParseAddrPort(listenAddr(t, srv.do("listen 127.0.0.1:0")))
	const base = 20000
	silence(t, base, base+1999)
	// Source ports: first in distinct slots, spill and dials on taken ones.
	used := map[uint32]uint16{}
	var firstPorts, spillPorts, dialPorts []uint16
	for p := uint16(base); len(firstPorts) < first; p++ {
		if s := resvSlot(loopKey(addr.Port(), p)); used[s] == 0 {
			used[s] = p
			firstPorts = append(firstPorts, p)
		}
	}
	for p := uint16(base + 1000); len(spillPorts) < spill; p++ {
		if used[resvSlot(loopKey(addr.Port(), p))] != 0 {
			spillPorts = append(spillPorts, p)
		}
	}
	for p := uint16(base + 2000); len(dialPorts) < dials; p++ {
		if used[resvSlot(loopKey(addr.Port(), p))] != 0 {
			dialPorts = append(dialPorts, p)
		}
	}
	for range 2 { // the second round is the SYNs' retransmission
		for _, p := range append(firstPorts, spillPorts...) {
			sendSYN(t, addr, p)
		}
		eventually(t, "reservations", func() (bool, string) {
			s := snap(t, l)
			return s.Reservations == open && s.InUse == open, fmt.Sprintf("%+v", s)
		})
	}
	// The slots hold the first tuples where resvSlot says they go.
	for s, p := range used {
		var slot limiterFsResvSlot
		if err := l.objs.FsResvSlots.Lookup(s, &slot); err != nil {
			t.Fatal(err)
		}
		if slot.Key != loopKey(addr.Port(), p) {
			t.Fatalf("slot %d holds %+v, want the tuple from port %d", s, slot.Key, p)
		}
	}
	if n := nodeSpilled(t, l); n < spill {
		t.Fatalf("%d reservations spilled, want %d", n, spill)
	}
	var conns []net.Conn
	for _, p := range dialPorts {
		d := net.Dialer{
			Timeout:   3 * time.Second,
			LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: int(p)},
			// The port may be in TIME_WAIT from an earlier run.
			Control: sockOpt(unix.SO_REUSEADDR),
		}
		c, err := d.Dial("tcp4", addr.String())
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	waitHeld(t, srv, dials)
	waitInUse(t, l, open+dials, map[string]int{"srv": open + dials})
	rep, err := l.Reconcile(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if rep.Reservations["srv"] != open || rep.Held["srv"] != dials || len(rep.Repaired) != 0 {
		t.Fatalf("reconcile: %+v", rep)
	}
	for _, c := range conns {
		c.Close()
	}
	waitInUse(t, l, open, map[string]int{"srv": open})
	mono.advance(ttl + time.Minute)
	if err := l.Tick(time.Now()); err != nil {
		t.Fatal(err)
	}
	s := snap(t, l)
	// A non-SYN segment may reserve and be undone at its RST (Stray).
	if s.Reservations != 0 || s.InUse != 0 || s.Events.Expired != open || s.Events.AdmittedIn-s.Events.Stray != open+dials {
		t.Fatalf("after the TTL: %+v", s)
	}
	if n := nodeSpilled(t, l); n != 0 {
		t.Fatalf("spilled %d after the expiry", n)
	}
}

// sendSYN sends one bare TCP SYN from 127.0.0.1:sport with a raw socket.
func sendSYN(t testing.TB, dst netip.AddrPort, sport uint16) {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	src := [4]byte{127, 0, 0, 1}
	d := dst.Addr().As4()
	seg := make([]byte, 20)
	binary.BigEndian.PutUint16(seg[0:], sport)
	binary.BigEndian.PutUint16(seg[2:], dst.Port())
	binary.BigEndian.PutUint32(seg[4:], 12345)
	seg[12] = 5 << 4 // data offset
	seg[13] = 0x02   // SYN
	binary.BigEndian.PutUint16(seg[14:], 65535)
	// Checksum over the pseudo-header and the segment.
	var sum uint32
	pseudo := append(append(append([]byte{}, src[:]...), d[:]...), 0, unix.IPPROTO_TCP, 0, 20)
	for _, b := range [][]byte{pseudo, seg} {
		for i := 0; i+1 < len(b); i += 2 {
			sum += uint32(binary.BigEndian.Uint16(b[i:]))
		}
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(seg[16:], ^uint16(sum))
	if err := unix.Sendto(fd, seg, 0, &unix.SockaddrInet4{Addr: d}); err != nil {
		t.Fatal(err)
	}
}

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
	for i, to := range []netip.AddrPort{addrA, addrB} {
		if err := dial(to); !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("dial %s over the pool: %v, want ECONNREFUSED", to, err)
		}
		s := snap(t, l)
		if ra, rb := project(s, "a").Refused, project(s, "b").Refused; ra != 1 || rb != uint64(i) {
			t.Fatalf("after refusing %s: refused a %d b %d", to, ra, rb)
		}
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
		return len(cookies)
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
