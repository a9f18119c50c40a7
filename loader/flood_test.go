// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"fmt"
	"math"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/loader/limits"
	"github.com/fairshare-dev/fairshare/sockdiag"
)

// liveSockets counts the sockets that may hold a permit: project sockets the
// kernel says should hold one (ShouldHold, by cgroup), and the request
// sockets (SYN_RECV) of the given project listening ports, which hold their
// reservation until the handshake ends.
func liveSockets(t testing.TB, l *Limiter, ports ...uint16) int {
	t.Helper()
	socks, err := sockdiag.List(sockdiag.Options{})
	if err != nil {
		t.Fatal(err)
	}
	index := memberIndex(t, l)
	n := 0
	for _, s := range socks {
		if _, ok := index[s.CgroupID]; ok && ShouldHold(s) {
			n++
			continue
		}
		for _, p := range ports {
			if s.State == sockdiag.StateSynRecv && s.Src.Port() == p {
				n++
			}
		}
	}
	return n
}

// within polls until in_use equals the live sockets and returns how long
// that took, or fails after d.
func inUseMatchesLive(t testing.TB, l *Limiter, d time.Duration, ports ...uint16) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		s := snap(t, l)
		live := liveSockets(t, l, ports...)
		if s.InUse == live {
			return time.Since(start)
		}
		if time.Since(start) > d {
			t.Fatalf("%v after the flood: in_use %d, live sockets %d; %+v", time.Since(start), s.InUse, live, s)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// The reproduction of the phantom permits (pool 64, floor 3): a project's
// server never accepts, and a process in no project floods it with
// connect()s that give up after 20 ms. No handshake the kernel drops may
// hold a permit: during the flood another project under its share is
// admitted, and within 100 ms of the flood's end the node's in_use equals
// the sockets that exist (project sockets, and request sockets of the
// port). The listener, per subtest:
//
//	listen0    listen(0): the accept queue fills with one connection, and
//	           the kernel drops every later SYN (before: the project held
//	           all 64 permits with no socket behind them)
//	reuseport  an SO_REUSEPORT group whose older member is listen(0) and
//	           never accepts while the newer accepts: the kernel steers
//	           some SYNs to the stuck one and drops them (before: only the
//	           newest member's queues were looked at, and the project held
//	           the whole pool with half of it phantom)
//	segments   listen(0), and the flood mixes in segments that are not a
//	           handshake's (FIN, NULL, SYN|FIN, RST|ACK, PSH, URG, ACK, RST),
//	           which the kernel drops or resets (before: each held a permit
//	           for the TTL)
//	cookies    listen(1) with its SYN queue full of two silent handshakes,
//	           so the kernel answers with SYN cookies (no request socket)
//	           until the accept queue is full too (needs tcp_syncookies=1)
func TestFloodNeverAcceptingListener(t *testing.T) {
	testutil.RequireRoot(t)
	for _, tc := range []string{"listen0", "reuseport", "segments", "cookies"} {
		t.Run(tc, func(t *testing.T) { floodListener(t, tc) })
	}
}

func floodListener(t *testing.T, kind string) {
	if kind == "cookies" {
		if b, err := os.ReadFile("/proc/sys/net/ipv4/tcp_syncookies"); err != nil || strings.TrimSpace(string(b)) != "1" {
			t.Skipf("needs net.ipv4.tcp_syncookies = 1 (%q, %v)", b, err)
		}
	}
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 64, 3)
	gamma := startHelper(t, mkProject(t, root, "gamma"))
	alpha := startHelper(t, mkProject(t, root, "alpha"))
	var target netip.AddrPort
	switch kind {
	case "listen0", "segments":
		target = netip.MustParseAddrPort(listenAddr(t, gamma.do("listen-backlog 127.0.0.1:0 0")))
	case "reuseport":
		target = netip.MustParseAddrPort(listenAddr(t, gamma.do("listen-backlog 127.0.0.1:0 0 reuseport")))
		listenAddr(t, gamma.do("listen-backlog %s 128 reuseport accept", target))
	case "cookies":
		target = netip.MustParseAddrPort(listenAddr(t, gamma.do("listen-backlog 127.0.0.1:0 1")))
		silence(t, 23200, 23201)
		sendSYN(t, target, 23200)
		sendSYN(t, target, 23201)
		waitInUse(t, l, 2, map[string]int{"gamma": 2})
	}
	other := sink(t, "tcp4", "127.0.0.1:0")

	// The flood comes from this process (in no project): 4 workers of 100
	// connect()s each, 20 ms timeout, connections that succeed kept open
	// until the end; with segments, each connect() comes with a raw segment
	// of each kind from a port of its own.
	const workers, per = 4, 100
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		conns    []net.Conn
		ok, fail int
	)
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	started := make(chan struct{})
	var once sync.Once
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range per {
				if i == per/4 {
					once.Do(func() { close(started) })
				}
				if kind == "segments" {
					for j, c := range mixedFlags {
						sendSeg(t, target, uint16(50000+j*1000+(w*per+i)%1000), c.flags, 1000, 0)
					}
				}
				c, err := net.DialTimeout("tcp4", target.String(), 20*time.Millisecond)
				mu.Lock()
				if err == nil {
					conns = append(conns, c)
					ok++
				} else {
					fail++
				}
				mu.Unlock()
			}
		}()
	}
	<-started
	// Mid-flood: alpha, under its share, is admitted every time. Its
	// connections are closed after each try: with reuseport the flood's
	// accepted connections are real and kept, gamma may hold up to
	// POOL - FLOOR of them, and alpha keeping all 8 would not fit beside.
	maxGamma := 0
	for range 4 {
		if r := alpha.dial("tcp4", other.Addr().String(), 2); r.ok != 2 {
			t.Errorf("alpha during the flood: %+v; %+v", r, snap(t, l))
		}
		alpha.do("close")
		maxGamma = max(maxGamma, project(snap(t, l), "gamma").InUse)
	}
	wg.Wait()
	took := inUseMatchesLive(t, l, 100*time.Millisecond, target.Port())
	s := snap(t, l)
	t.Logf("%s: %d connects ok, %d failed; gamma held at most %d during it; in_use %d = live after %v; events %+v",
		kind, ok, fail, maxGamma, s.InUse, took, s.Events)
	// cookies: the two silent handshakes and the children; the kernel
	// checks the accept queue of listen(1) (2 children) without a lock, so
	// cookie ACKs on several CPUs at once may make a third.
	limit := map[string]int{"listen0": 2, "segments": 2, "cookies": 2 + ok, "reuseport": 2 + ok}[kind]
	if g := project(s, "gamma").InUse; g > limit {
		t.Errorf("gamma holds %d permits, want at most %d", g, limit)
	}
	if kind == "cookies" && s.Events.Late == 0 {
		t.Errorf("no child of a SYN cookie was admitted at ESTABLISHED: %+v", s.Events)
	}
}

// A client that gives up on its handshake resets it (here the kernel answers
// the SYN-ACKs to a bare SYN from a raw socket): the request sockets are
// dropped, and the first Tick past the TTL finds them gone and gives their
// reservations back. The TTL is the shortest allowed: a permit of a
// vanished handshake is held at most the TTL plus a Tick period. The clock
// is held, first before the SYNs (a slow machine takes longer than the TTL
// to see the request sockets go), then where the oldest reservation is
// exactly the TTL old (kept), then past the TTL of the newest (given back).
func TestInboundClientGoneGivesBack(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l, mono := openLimiterMono(t, root, pin, 10, 1, limits.MinReservationTTL)
	srv := startHelper(t, mkProject(t, root, "srv"))
	addr := netip.MustParseAddrPort(listenAddr(t, srv.do("listen 127.0.0.1:0")))
	const n = 8
	mono.hold()
	for i := range n {
		sendSYN(t, addr, uint16(22000+i))
	}
	eventually(t, "request sockets reset", func() (bool, string) {
		s := snap(t, l)
		left := synRecv(t, addr.Port())
		return s.Events.AdmittedIn == n && s.Reservations == n && left == 0, fmt.Sprintf("%d request sockets; %+v", left, s)
	})
	oldest, newest := uint64(math.MaxUint64), uint64(0)
	if err := l.readResv(func(_ limiterFsResvKey, v limiterFsResv) {
		oldest, newest = min(oldest, v.SinceNs), max(newest, v.SinceNs)
	}); err != nil {
		t.Fatal(err)
	}
	kept := func(when string) {
		t.Helper()
		if err := l.Tick(time.Now()); err != nil {
			t.Fatal(err)
		}
		if s := snap(t, l); s.Reservations != n {
			t.Fatalf("given back before the TTL (%s; stamps %d..%d): %+v", when, oldest, newest, s)
		}
	}
	kept("clock held before the SYNs")
	mono.holdAt(time.Duration(oldest) + limits.MinReservationTTL)
	kept("the oldest exactly the TTL old")
	mono.holdAt(time.Duration(newest) + limits.MinReservationTTL + time.Millisecond)
	if err := l.Tick(time.Now()); err != nil {
		t.Fatal(err)
	}
	if s := snap(t, l); s.Events.Expired != n || s.InUse != 0 || s.Reservations != 0 {
		t.Fatalf("after the TTL: %+v", s)
	}
	// The listener still admits.
	c, err := net.DialTimeout("tcp4", addr.String(), 3*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	waitInUse(t, l, 0, map[string]int{"srv": 0})
}

// With SYN cookies (tcp_syncookies = 1) a listener whose SYN queue is full
// answers SYNs with a cookie and keeps no request socket: such a SYN takes no
// permit, the rule is still applied to it, and the child takes its permit
// when its ACK makes it; once the accept queue is full too, SYNs and cookie
// ACKs are dropped and take nothing. Throughout, in_use is the request
// sockets plus the children.
func TestInboundSynCookies(t *testing.T) {
	testutil.RequireRoot(t)
	if b, err := os.ReadFile("/proc/sys/net/ipv4/tcp_syncookies"); err != nil || strings.TrimSpace(string(b)) != "1" {
		t.Skipf("needs net.ipv4.tcp_syncookies = 1 (%q, %v)", b, err)
	}
	root, pin := newRoot(t), newPinDir(t)
	l, _ := openLimiterMono(t, root, pin, 10, 1, limits.MaxReservationTTL)
	srv := startHelper(t, mkProject(t, root, "srv"))
	// backlog 1: the SYN queue takes 2 request sockets, the accept queue 2
	// children.
	addr := netip.MustParseAddrPort(listenAddr(t, srv.do("listen-backlog 127.0.0.1:0 1")))
	silence(t, 23000, 23001)
	sendSYN(t, addr, 23000)
	sendSYN(t, addr, 23001)
	eventually(t, "two request sockets", func() (bool, string) {
		s := snap(t, l)
		return s.Reservations == 2 && s.InUse == 2, fmt.Sprintf("%+v", s)
	})
	var conns []net.Conn
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	for i := range 2 {
		c, err := net.DialTimeout("tcp4", addr.String(), 3*time.Second)
		if err != nil {
			t.Fatalf("cookie connection %d: %v; %+v", i, err, snap(t, l))
		}
		conns = append(conns, c)
	}
	waitInUse(t, l, 4, map[string]int{"srv": 4})
	// The accept queue is full: the SYN is dropped, the client gives up.
	if c, err := net.DialTimeout("tcp4", addr.String(), 200*time.Millisecond); err == nil {
		c.Close()
		t.Fatal("a connection got through a full accept queue")
	}
	inUseMatchesLive(t, l, 100*time.Millisecond, addr.Port())
	s := snap(t, l)
	if s.InUse != 4 || s.Reservations != 2 || s.Events.Late < 2 {
		t.Fatalf("%+v", s)
	}
}

// A refusal at the SYN is still an RST, also in cookie mode: with the pool
// full to the floor, a SYN cookie is not sent for a project that holds its
// floor.
func TestInboundSynCookieRefused(t *testing.T) {
	testutil.RequireRoot(t)
	if b, err := os.ReadFile("/proc/sys/net/ipv4/tcp_syncookies"); err != nil || strings.TrimSpace(string(b)) != "1" {
		t.Skipf("needs net.ipv4.tcp_syncookies = 1 (%q, %v)", b, err)
	}
	root, pin := newRoot(t), newPinDir(t)
	l, _ := openLimiterMono(t, root, pin, 3, 1, limits.MaxReservationTTL)
	srv := startHelper(t, mkProject(t, root, "srv"))
	addr := netip.MustParseAddrPort(listenAddr(t, srv.do("listen-backlog 127.0.0.1:0 1")))
	silence(t, 23100, 23101)
	sendSYN(t, addr, 23100)
	sendSYN(t, addr, 23101)
	waitInUse(t, l, 2, map[string]int{"srv": 2})
	_, err := net.DialTimeout("tcp4", addr.String(), 3*time.Second)
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("a SYN over the pool in cookie mode: %v, want ECONNREFUSED; %+v", err, snap(t, l))
	}
	if s := snap(t, l); s.InUse != 2 || s.Events.RefusedIn < 1 {
		t.Fatalf("%+v", s)
	}
}

// The reservation TTL is bounded: Open refuses one outside
// limits.MinReservationTTL..MaxReservationTTL before touching the kernel.
func TestReservationTTLBounds(t *testing.T) {
	for _, ttl := range []time.Duration{-time.Second, limits.MinReservationTTL - 1, limits.MaxReservationTTL + 1} {
		_, err := Open(Options{PoolSize: 10, ReservationTTL: ttl})
		if !errors.Is(err, ErrInvalidOptions) || !strings.Contains(err.Error(), "reservation TTL") {
			t.Errorf("TTL %s: %v, want ErrInvalidOptions naming the TTL", ttl, err)
		}
	}
}

// A SYN flood from hosts that never answer (spoofed sources: silence drops
// the kernel's resets, so every request socket stays, retransmitting its
// SYN-ACK for a minute) at the listeners of one project reserves at most
// POOL - FLOOR: inbound, a project is judged by the share it would have
// beside a newcomer, and past it takes no permit beyond POOL - FLOOR (the
// SYNs are reset, so every request socket holds its permit). A project that
// arrives during the flood finds its floor at once; before, the flood
// reserved the whole pool and every other project was refused until the
// request sockets died. A second project flooded is such a newcomer, and
// takes the last floor. The flooded project still takes the last floor with
// connect(), when alone.
func TestSynFloodLeavesNewcomerItsFloor(t *testing.T) {
	testutil.RequireRoot(t)
	const pool, floor, syns = 16, 2, 24
	setup := func(t *testing.T) (*Limiter, string) {
		root, pin := newRoot(t), newPinDir(t)
		l, _ := openLimiterMono(t, root, pin, pool, floor, limits.MaxReservationTTL)
		silence(t, 24200, 24200+2*syns-1)
		return l, root
	}
	// flood sends syns SYNs from silent ports from lo up to a listener of
	// project name, and returns the project's helper and the address.
	flood := func(t *testing.T, l *Limiter, root, name string, lo uint16) (*helper, netip.AddrPort) {
		h := startHelper(t, mkProject(t, root, name))
		addr := netip.MustParseAddrPort(listenAddr(t, h.do("listen 127.0.0.1:0")))
		for i := range syns {
			sendSYN(t, addr, lo+uint16(i))
		}
		return h, addr
	}
	// reserved waits until every SYN sent to addrs (syns each) is a
	// request socket or refused, want of them reserved and in_use with
	// them. A request socket may lack its permit only by the race between
	// sk_lookup and the reservation (two SYNs at the bound on two CPUs at
	// once): one per flooded listener at most, with two CPUs.
	reserved := func(t *testing.T, l *Limiter, want int, addrs ...netip.AddrPort) {
		eventually(t, "the flood's request sockets, each with its reservation", func() (bool, string) {
			s := snap(t, l)
			n := 0
			for _, a := range addrs {
				n += synRecv(t, a.Port())
			}
			return s.Reservations == want && s.InUse == want && n >= want && n <= want+len(addrs) &&
					int(s.Events.RefusedIn) == len(addrs)*syns-n,
				fmt.Sprintf("%d request sockets; %+v", n, s)
		})
	}
	// newcomer checks that a project arriving now gets its floor, and no
	// more: the pool is full then.
	newcomer := func(t *testing.T, l *Limiter, root string) {
		alpha := startHelper(t, mkProject(t, root, "alpha"))
		other := sink(t, "tcp4", "127.0.0.1:0")
		if r := alpha.dial("tcp4", other.Addr().String(), floor); r.ok != floor {
			t.Fatalf("alpha during the flood: %+v, want its floor (%d) admitted; %+v", r, floor, snap(t, l))
		}
		if r := alpha.dial("tcp4", other.Addr().String(), 1); r.refused != 1 {
			t.Errorf("alpha past the full pool: %+v, want refused", r)
		}
	}
	t.Run("newcomer", func(t *testing.T) {
		l, root := setup(t)
		if err := l.SetEvents(100, false); err != nil {
			t.Fatal(err)
		}
		ch := refusals(t, l)
		_, addr := flood(t, l, root, "beta", 24200)
		reserved(t, l, pool-floor, addr)
		// Alone, beta is under its share: the floor refused it. The
		// event's share is the one the SYN was judged by, beside a
		// newcomer.
		if e := nextRefusal(t, ch); e.Project != "beta" || e.Direction != "syn" || e.Reason != ReasonFloor ||
			e.Held != pool-floor || e.InUse != pool-floor || e.Share != max(pool/2, floor) {
			t.Errorf("the first SYN past POOL - FLOOR: %+v, want reason %q, share %d", e, ReasonFloor, max(pool/2, floor))
		}
		newcomer(t, l, root)
		// beta, past its share beside alpha, is refused at the SYN.
		if c, err := net.DialTimeout("tcp4", addr.String(), 3*time.Second); !errors.Is(err, syscall.ECONNREFUSED) {
			if c != nil {
				c.Close()
			}
			t.Errorf("a SYN for beta with the pool full: %v, want ECONNREFUSED", err)
		}
		waitInUse(t, l, pool, map[string]int{"alpha": floor, "beta": pool - floor})
	})
	t.Run("two-projects", func(t *testing.T) {
		// gamma, flooded after beta, is a newcomer then: its first
		// permits, under its floor, come from the last floor; its SYNs
		// past them are reset. The pool fills, never past POOL, and
		// every request socket holds its permit.
		l, root := setup(t)
		_, a := flood(t, l, root, "beta", 24200)
		reserved(t, l, pool-floor, a)
		_, b := flood(t, l, root, "gamma", 24200+syns)
		reserved(t, l, pool, a, b)
		waitInUse(t, l, pool, map[string]int{"beta": pool - floor, "gamma": floor})
	})
	t.Run("under-share", func(t *testing.T) {
		// No flood: alpha holds 10 by connect() (past its share of 8
		// once gamma asks), gamma serves. gamma is under its share, and
		// inbound it is judged by the share it would have beside a
		// newcomer (16/3: 5): admitted while it holds fewer than 5, up
		// to the full pool; then held to POOL - FLOOR, which in_use (15)
		// is past. The plain rule would admit a sixth, and capping every
		// project that holds its floor would have stopped it at 4.
		l, root := setup(t)
		alpha := startHelper(t, mkProject(t, root, "alpha"))
		other := sink(t, "tcp4", "127.0.0.1:0")
		if r := alpha.dial("tcp4", other.Addr().String(), 10); r.ok != 10 {
			t.Fatalf("alpha alone: %+v", r)
		}
		gamma := startHelper(t, mkProject(t, root, "gamma"))
		addr := listenAddr(t, gamma.do("listen 127.0.0.1:0"))
		if ok, refused := testutil.DialAll(t, addr, 7, 3*time.Second); ok != 5 || refused != 2 {
			t.Fatalf("gamma's inbound beside alpha: %d admitted, %d refused; want 5 and 2; %+v", ok, refused, snap(t, l))
		}
		waitInUse(t, l, 15, map[string]int{"alpha": 10, "gamma": 5})
	})
	t.Run("alone", func(t *testing.T) {
		l, root := setup(t)
		beta, addr := flood(t, l, root, "beta", 24200)
		reserved(t, l, pool-floor, addr)
		other := sink(t, "tcp4", "127.0.0.1:0")
		if r := beta.dial("tcp4", other.Addr().String(), floor+1); r.ok != floor || r.refused != 1 {
			t.Fatalf("beta's connects, alone beside its flood: %+v, want %d admitted and 1 refused; %+v", r, floor, snap(t, l))
		}
		waitInUse(t, l, pool, map[string]int{"beta": pool})
	})
}
