// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/loader/limits"
	"github.com/fairshare-dev/fairshare/sockdiag"
)

// The tests of this file hold the kernel side to its promise for inbound
// handshakes: a permit exists only while a handshake can still become a
// connection, that is while the kernel keeps a request socket (or the child
// socket) for it. They send raw segments from 127.0.0.1 and look at the
// request sockets with sock_diag.

// TCP flags of a segment.
const (
	tcpFIN = 0x01
	tcpSYN = 0x02
	tcpRST = 0x04
	tcpPSH = 0x08
	tcpACK = 0x10
	tcpURG = 0x20
)

// synSeq is the sequence number of sendSYN's SYN: the request socket then
// expects synSeq+1.
const synSeq = 12345

// resetHandshake sends the RST a client that gave up would send for
// sendSYN's handshake (its sequence number exact): the kernel drops the
// request socket.
func resetHandshake(t testing.TB, dst netip.AddrPort, sport uint16) {
	t.Helper()
	sendSeg(t, dst, sport, tcpRST, synSeq+1, 0)
}

// synRecv counts the request sockets (SYN_RECV) of local port port.
func synRecv(t testing.TB, port uint16) int {
	t.Helper()
	socks, err := sockdiag.List(sockdiag.Options{States: sockdiag.StateSynRecv.Mask()})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, s := range socks {
		if s.State == sockdiag.StateSynRecv && s.Src.Port() == port {
			n++
		}
	}
	return n
}

// sendSeg sends one TCP segment with the given flags from 127.0.0.1:sport
// with a raw socket, marked rawMark (silence lets it through).
func sendSeg(t testing.TB, dst netip.AddrPort, sport uint16, flags byte, seq, ack uint32) {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, rawMark); err != nil {
		t.Fatal(err)
	}
	src := [4]byte{127, 0, 0, 1}
	d := dst.Addr().As4()
	seg := make([]byte, 20)
	binary.BigEndian.PutUint16(seg[0:], sport)
	binary.BigEndian.PutUint16(seg[2:], dst.Port())
	binary.BigEndian.PutUint32(seg[4:], seq)
	binary.BigEndian.PutUint32(seg[8:], ack)
	seg[12] = 5 << 4 // data offset
	seg[13] = flags
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

// mixedFlags are segments that are not a handshake's: the kernel drops them
// at a listener (most with reason TCP_FLAGS, without an answer) or answers
// them with an RST, and keeps no request socket for any.
var mixedFlags = []struct {
	name  string
	flags byte
}{
	{"FIN", tcpFIN}, {"NULL", 0}, {"SYN|FIN", tcpSYN | tcpFIN}, {"RST|ACK", tcpRST | tcpACK},
	{"PSH", tcpPSH}, {"URG", tcpURG}, {"FIN|PSH|URG", tcpFIN | tcpPSH | tcpURG}, {"ACK", tcpACK}, {"RST", tcpRST},
}

// Regression (review of #15, finding 1): sk_lookup cannot see TCP flags, and
// took a reservation for every segment to a listener with room; the kernel
// drops a FIN, a NULL, a SYN|FIN ... with reason TCP_FLAGS and no answer, so
// the reservation sat out the TTL: ten FINs took a pool of ten, and another
// project holding nothing was refused. A segment that makes no request
// socket now takes nothing.
func TestNonSynSegmentsTakeNothing(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l, _ := openLimiterMono(t, root, pin, 10, 1, limits.MaxReservationTTL)
	srv := startHelper(t, mkProject(t, root, "srv"))
	addr := netip.MustParseAddrPort(listenAddr(t, srv.do("listen-backlog 127.0.0.1:0 16")))
	const base = 25000
	for i, c := range mixedFlags {
		sendSeg(t, addr, uint16(base+i), c.flags, 1000, 0)
	}
	for i := range 10 {
		sendSeg(t, addr, uint16(base+100+i), tcpFIN, 1000, 0)
	}
	time.Sleep(100 * time.Millisecond) // nothing to wait for: nothing may come
	if s := snap(t, l); s.InUse != 0 || s.Reservations != 0 {
		t.Fatalf("segments that are no handshake hold permits: %+v", s)
	}
	alpha := startHelper(t, mkProject(t, root, "alpha"))
	other := sink(t, "tcp4", "127.0.0.1:0")
	if r := alpha.dial("tcp4", other.Addr().String(), 2); r.ok != 2 {
		t.Fatalf("alpha after the segments: %+v; %+v", r, snap(t, l))
	}
	// A SYN still reserves: the listener is counted.
	sendSYN(t, addr, base+200)
	eventually(t, "the SYN's reservation", func() (bool, string) {
		s := snap(t, l)
		return s.Reservations == 1 && project(s, "srv").InUse == 1, fmt.Sprintf("%+v", s)
	})
	resetHandshake(t, addr, base+200)
}

// Regression (review of #15, finding 4): the reservation was undone at the
// first RST or bad ACK for its tuple, though only an RST with the exact
// sequence number ends a request socket; a client could keep request
// sockets without permits and complete them together. Now nothing a segment
// says ends a reservation: a bad ACK and RSTs with an inexact sequence number
// leave it (and the request socket), the expiry past the TTL keeps it while
// the request socket exists, and gives it back once the client's exact RST
// has ended it.
func TestHandshakeEndsOnlyWithRequestSocket(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	const ttl = limits.MaxReservationTTL
	l, mono := openLimiterMono(t, root, pin, 10, 1, ttl)
	srv := startHelper(t, mkProject(t, root, "srv"))
	addr := netip.MustParseAddrPort(listenAddr(t, srv.do("listen-backlog 127.0.0.1:0 16")))
	const base = 28000
	cases := []struct {
		name     string
		flags    byte
		seq, ack uint32
	}{
		{"bad ACK", tcpACK, synSeq + 1, 7},
		{"RST seq+1", tcpRST, synSeq + 2, 0},
		{"RST seq+2", tcpRST, synSeq + 3, 0},
		{"RST seq+1000", tcpRST, synSeq + 1001, 0},
		{"out-of-window RST", tcpRST, synSeq + 99999999, 0},
		{"out-of-window RST|ACK", tcpRST | tcpACK, synSeq + 99999999, 7},
	}
	silence(t, base, base+uint16(len(cases)))
	for i := range cases {
		sendSYN(t, addr, uint16(base+i))
	}
	n := len(cases)
	eventually(t, "reservations", func() (bool, string) {
		s := snap(t, l)
		return s.Reservations == n && synRecv(t, addr.Port()) == n, fmt.Sprintf("%+v", s)
	})
	for i, c := range cases {
		sendSeg(t, addr, uint16(base+i), c.flags, c.seq, c.ack)
	}
	time.Sleep(100 * time.Millisecond) // nothing to wait for: nothing may change
	if s, left := snap(t, l), synRecv(t, addr.Port()); s.Reservations != n || s.InUse != n || left != n {
		t.Fatalf("after segments that end no handshake: %d request sockets; %+v", left, s)
	}
	mono.advance(ttl + time.Second)
	if err := l.Tick(time.Now()); err != nil {
		t.Fatal(err)
	}
	if s := snap(t, l); s.Reservations != n || s.Events.Expired != 0 {
		t.Fatalf("the expiry ended reservations of live request sockets: %+v", s)
	}
	for i := range cases {
		resetHandshake(t, addr, uint16(base+i))
	}
	eventually(t, "request sockets gone", func() (bool, string) {
		left := synRecv(t, addr.Port())
		return left == 0, fmt.Sprintf("%d left", left)
	})
	if err := l.Tick(time.Now()); err != nil {
		t.Fatal(err)
	}
	if s := snap(t, l); s.Reservations != 0 || s.InUse != 0 || s.Events.Expired != uint64(n) {
		t.Fatalf("after the request sockets went: %+v", s)
	}
}

// Regression (review of #15, finding 3): a reservation was keyed by its
// 4-tuple alone, so a connection with the same tuple in another network
// namespace took it over (its child converted it, an RST there undid it),
// charging one project's handshake to another; a user with its own user and
// network namespaces could do it. Keyed by the request socket's cookie, a
// reservation belongs to its handshake: project a's two half-open
// handshakes keep their permits while project b, in a netns of its own,
// listens on the same address and port and connects from the same source
// ports, and a third netns's refused connect from one of them changes
// nothing.
func TestReservationStaysInItsNetns(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l, _ := openLimiterMono(t, root, pin, 10, 1, limits.MaxReservationTTL)
	a := startHelper(t, mkProject(t, root, "a"))
	port := freePort(t)
	addr := netip.MustParseAddrPort(listenAddr(t, a.do("listen-backlog 127.0.0.1:%d 16", port)))
	const e1, e2 = 27001, 27002
	silence(t, e1, e2)
	sendSYN(t, addr, e1)
	sendSYN(t, addr, e2)
	waitInUse(t, l, 2, map[string]int{"a": 2})

	b := startHelperNS(t, mkProject(t, root, "b"), true)
	listenAddr(t, b.do("listen 127.0.0.1:%d", port))
	if r := b.do("dialfrom tcp4 127.0.0.1:%d 127.0.0.1:%d", e1, port); r != "dialed ok" {
		t.Fatalf("b's connection in its netns: %s", r)
	}
	waitHeld(t, b, 1)
	// b holds its client's permit and its child's; a keeps both of its own.
	waitInUse(t, l, 4, map[string]int{"a": 2, "b": 2})

	c := startHelperNS(t, mkProject(t, root, "c"), true)
	if r := c.do("dialfrom tcp4 127.0.0.1:%d 127.0.0.1:%d", e2, port); !strings.Contains(r, "refused") {
		t.Fatalf("c's connect in a netns without a listener: %s", r)
	}
	b.do("close")
	waitHeld(t, b, 0)
	waitInUse(t, l, 2, map[string]int{"a": 2, "b": 0})
	if s := snap(t, l); s.Reservations != 2 || synRecv(t, port) != 2 {
		t.Fatalf("a's handshakes: %+v", s)
	}
	resetHandshake(t, addr, e1)
	resetHandshake(t, addr, e2)
}

// Regression (review of #15, finding 5): the slot of a reservation was freed
// with a compare-and-swap of a tag made from a hash of the 4-tuple, which a
// client could make collide: an expiry that read a reservation, was
// preempted while it was converted and another with the same tag took the
// slot, then ended that other one (two releases for the first project, a
// leaked permit for the second). The tag is now the request socket's cookie,
// never reused: an expiry naming a reservation that has ended leaves the
// slot's next holder alone, even one with the same stamp.
func TestExpiryEndsOnlyItsOwnReservation(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 10, 1)
	const proj = 1<<40 + 9
	const c1 = 1<<50 + 3
	const c2 = c1 + 256 // RESV_SLOTS later: the same slot
	take := func(cookie uint64) {
		t.Helper()
		if r, err := l.selftest(limiterFsSelftestArgs{Op: stTake, Delta: atSyn, Resv: limiterFsResv{Project: proj},
			Cookie: cookie, Cg: proj}); err != nil || r != taken {
			t.Fatalf("taking for %d: %d, %v", cookie, r, err)
		}
	}
	read := func() map[uint64]limiterFsResv {
		t.Helper()
		out := map[uint64]limiterFsResv{}
		if err := l.readResv(func(k limiterFsResvKey, v limiterFsResv) { out[k.Cookie] = v }); err != nil {
			t.Fatal(err)
		}
		return out
	}
	take(c1)
	first := read()[c1]
	// The expiry's read is done; c1 ends (converted), c2 takes the slot,
	// here with c1's very stamp.
	if r, err := l.adjust(limiterFsAdjustArgs{Op: opExpire, Key: limiterFsResvKey{Cookie: c1}, SinceNs: first.SinceNs}); err != nil || r != 1 {
		t.Fatalf("ending c1: %d, %v", r, err)
	}
	take(c2)
	var slot limiterFsResvSlot
	idx := uint32(c2 % 256)
	if err := l.objs.FsResvSlots.Lookup(idx, &slot); err != nil || slot.Tag != c2 {
		t.Fatalf("slot %d: %+v, %v; want c2 in c1's slot", idx, slot, err)
	}
	slot.Resv.SinceNs = first.SinceNs
	if err := l.objs.FsResvSlots.Put(idx, slot); err != nil {
		t.Fatal(err)
	}
	if r, err := l.adjust(limiterFsAdjustArgs{Op: opExpire, Key: limiterFsResvKey{Cookie: c1}, SinceNs: first.SinceNs}); err != nil || r != 0 {
		t.Fatalf("the stale expiry of c1: %d, %v; want 0", r, err)
	}
	if got := read(); len(got) != 1 || got[c2].Project != proj {
		t.Fatalf("reservations after the stale expiry: %+v", got)
	}
	if s := snap(t, l); s.InUse != 1 || s.Events.Expired != 1 {
		t.Fatalf("%+v", s)
	}
	if r, err := l.adjust(limiterFsAdjustArgs{Op: opExpire, Key: limiterFsResvKey{Cookie: c2}, SinceNs: first.SinceNs}); err != nil || r != 1 {
		t.Fatalf("ending c2: %d, %v", r, err)
	}
	if s := snap(t, l); s.InUse != 0 || s.Reservations != 0 {
		t.Fatalf("%+v", s)
	}
}
