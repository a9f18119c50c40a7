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
	"github.com/fairshare-dev/fairshare/loader/limits"
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
	const ttl = limits.MaxReservationTTL
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
	const ttl = limits.MaxReservationTTL
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

// Regression: resv_put could store one tuple in the slot array and in the
// spill table when two CPUs raced on a freed slot. CPU A found k's slot held
// by another tuple and went to insert k into the spill table; meanwhile the
// slot was freed and CPU B, with the same tuple (a retransmitted SYN),
// claimed it, looked into the spill table before A's insert, and published
// k: two permits for one handshake until the TTL. Here B's claim and publish
// are the slot's contents, written as B leaves them, and A's insert is run
// on its own (fs_selftest): it must see the slot and back off.
func TestResvSpillBacksOffFromClaimedSlot(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 10, 1)
	k := loopKey(8080, 40123)
	r := limiterFsResv{Project: 4242, SinceNs: 1, Kind: 2}
	count := func() int {
		n := 0
		if err := l.readResv(func(rk limiterFsResvKey, _ limiterFsResv) {
			if rk == k {
				n++
			}
		}); err != nil {
			t.Fatal(err)
		}
		return n
	}
	for _, c := range []struct {
		name string
		tag  uint64
	}{
		{"published", resvTag(k)},
		{"being filled", resvTag(k) | slotBusy},
	} {
		slot := limiterFsResvSlot{Tag: c.tag, Key: k, Kind: r.Kind, Project: r.Project, SinceNs: r.SinceNs}
		if err := l.objs.FsResvSlots.Put(resvSlot(k), slot); err != nil {
			t.Fatal(err)
		}
		res, err := l.selftest(limiterFsSelftestArgs{Op: stResvSpill, Resv: r, Key: k})
		if err != nil {
			t.Fatal(err)
		}
		want := 0
		if c.tag&slotBusy == 0 {
			want = 1
		}
		if res != -int64(unix.EEXIST) || count() != want || nodeSpilled(t, l) != 0 {
			t.Errorf("%s slot: spill insert returned %d with %d reservations of the tuple, spilled %d; want -EEXIST, %d, 0",
				c.name, res, count(), nodeSpilled(t, l), want)
		}
	}
	// A slot that holds another tuple does not stop the spill.
	other := limiterFsResvSlot{Tag: resvTag(k) ^ 2, Key: loopKey(8080, 1), Project: 1, Kind: 2}
	if err := l.objs.FsResvSlots.Put(resvSlot(k), other); err != nil {
		t.Fatal(err)
	}
	if res, err := l.selftest(limiterFsSelftestArgs{Op: stResvSpill, Resv: r, Key: k}); err != nil || res != 0 || count() != 1 {
		t.Fatalf("spill beside another tuple: %d %v, %d reservations", res, err, count())
	}
	// Not real permits: clear them before the cleanup reconciles anything.
	if err := l.objs.FsReservations.Delete(k); err != nil {
		t.Fatal(err)
	}
	if err := l.objs.FsResvSlots.Put(resvSlot(k), limiterFsResvSlot{}); err != nil {
		t.Fatal(err)
	}
	var n limiterFsPool
	if err := l.objs.FsNode.Lookup(uint32(0), &n); err != nil {
		t.Fatal(err)
	}
	n.Spilled = 0
	if err := l.objs.FsNode.Put(uint32(0), n); err != nil {
		t.Fatal(err)
	}
}
