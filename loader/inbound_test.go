// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

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
			l := openLimiter(t, root, pin, 6, 1) // inbound, 5: a floor short of the pool
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
			// At least once: an nftables rule with a socket expression at
			// input (as BenchmarkConnectAcceptClose's peer installs while it
			// runs) looks the SYN up again, sk_lookup included.
			if s := snap(t, l); s.Events.RefusedIn < 1 || project(s, "srv").Refused < 1 || s.InUse != 5 {
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
// SYN from a client that then goes silent), node-wide in_use stays within
// POOL - FLOOR (the project is alone, and inbound it is judged by the share
// it would have beside a newcomer) and SYNs over it are reset. A reservation is given back only when its
// request socket is gone: Tick past the TTL keeps the reservations of
// request sockets that still exist (the handshake can still complete), and
// gives back those the client reset. The TTL is the longest allowed, on a
// monotonic clock the test moves on, so a slow machine cannot expire them
// early and the test does not sleep.
func TestInboundReservationsBoundAndExpire(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	const ttl = limits.MaxReservationTTL
	l, mono := openLimiterMono(t, root, pin, 4, 1, ttl)
	srv := startHelper(t, mkProject(t, root, "syn"))
	addr := netip.MustParseAddrPort(listenAddr(t, srv.do("listen 127.0.0.1:0")))

	// The kernel would answer the SYN-ACKs with resets (no socket), which
	// drop the request sockets; silenced, the clients look gone.
	silence(t, 30000, 30005)
	for i := range 6 {
		sendSYN(t, addr, uint16(30000+i))
	}
	eventually(t, "reservations", func() (bool, string) {
		s := snap(t, l)
		return s.Reservations == 3 && s.InUse == 3 && s.Events.RefusedIn >= 3, fmt.Sprintf("%+v", s)
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
	// An expiry names the stamp it read: a reservation stamped otherwise is
	// left alone, the one read is ended.
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
	// Past the TTL: the request sockets still exist, so do the reservations.
	mono.advance(2 * time.Minute)
	if err := l.Tick(time.Now()); err != nil {
		t.Fatal(err)
	}
	if s := snap(t, l); s.Reservations != 2 || s.InUse != 2 || s.Events.Expired != 1 {
		t.Fatalf("reservations of live request sockets given back: %+v", s)
	}
	// The clients reset their handshakes: the next Tick gives back.
	for i := range 3 {
		resetHandshake(t, addr, uint16(30000+i))
	}
	eventually(t, "request sockets gone", func() (bool, string) {
		n := synRecv(t, addr.Port())
		return n == 0, fmt.Sprintf("%d left", n)
	})
	if err := l.Tick(time.Now()); err != nil {
		t.Fatal(err)
	}
	s := snap(t, l)
	if s.Reservations != 0 || s.InUse != 0 || s.Events.Expired != 3 {
		t.Fatalf("after the request sockets went: %+v", s)
	}
	c, err := net.DialTimeout("tcp4", addr.String(), 3*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	waitInUse(t, l, 0, nil)
}

// A reservation whose slot another handshake holds goes to the spill table.
// More half-open handshakes (silent clients) than fs_resv_slots has slots
// fill every slot and spill the rest; completed handshakes are converted
// from either table, reconcile counts both, a request socket that still
// exists keeps its reservation past the TTL, and once the request sockets
// are gone (reset by their clients) the expiry gives every one back exactly
// once.
func TestInboundReservationsSpill(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	const ttl = limits.MaxReservationTTL
	const pool, open, dials = 400, 300, 50 // open > RESV_SLOTS (256)
	l, mono := openLimiterMono(t, root, pin, pool, 1, ttl)
	srv := startHelper(t, mkProject(t, root, "srv"))
	addr := netip.MustParseAddrPort(listenAddr(t, srv.do("listen 127.0.0.1:0")))
	const base = 20000
	silence(t, base, base+open-1)
	for range 2 { // the second round is the SYNs' retransmission
		for p := range uint16(open) {
			sendSYN(t, addr, base+p)
		}
		eventually(t, "reservations", func() (bool, string) {
			s := snap(t, l)
			return s.Reservations == open && s.InUse == open, fmt.Sprintf("%+v", s)
		})
	}
	if n := nodeSpilled(t, l); n < open-256 {
		t.Fatalf("%d reservations spilled, want at least %d", n, open-256)
	}
	var conns []net.Conn
	for range dials {
		c, err := net.DialTimeout("tcp4", addr.String(), 3*time.Second)
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
	// Past the TTL, but every request socket still exists: kept.
	mono.advance(ttl + time.Minute)
	if err := l.Tick(time.Now()); err != nil {
		t.Fatal(err)
	}
	if s := snap(t, l); s.Reservations != open || s.Events.Expired != 0 {
		t.Fatalf("reservations of live request sockets expired: %+v", s)
	}
	for p := range uint16(open) {
		resetHandshake(t, addr, base+p)
	}
	eventually(t, "request sockets gone", func() (bool, string) {
		n := synRecv(t, addr.Port())
		return n == 0, fmt.Sprintf("%d left", n)
	})
	if err := l.Tick(time.Now()); err != nil {
		t.Fatal(err)
	}
	s := snap(t, l)
	if s.Reservations != 0 || s.InUse != 0 || s.Events.Expired != open || s.Events.AdmittedIn != open+dials {
		t.Fatalf("after the request sockets went: %+v", s)
	}
	if n := nodeSpilled(t, l); n != 0 {
		t.Fatalf("spilled %d after the expiry", n)
	}
}

// sendSYN sends one bare TCP SYN from 127.0.0.1:sport with a raw socket.
func sendSYN(t testing.TB, dst netip.AddrPort, sport uint16) {
	t.Helper()
	sendSeg(t, dst, sport, tcpSYN, synSeq, 0)
}
