// SPDX-License-Identifier: Apache-2.0

package crtest

import (
	"net"
	"net/netip"
	"runtime"
	"sync"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// TestSubnetClaimsExclusive: runtimes claiming at once never share a
// subnet, a held one is refused to the next claimer, and a released one
// can be claimed again. (The kernel binds an abstract name once per network
// namespace, whichever process asks, so what holds for goroutines here
// holds for the test processes of a suite.)
func TestSubnetClaimsExclusive(t *testing.T) {
	const n = 48
	claims := make([]*subnetClaim, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { claims[i], errs[i] = claimSubnet() })
	}
	wg.Wait()
	defer func() {
		for _, c := range claims {
			c.release()
		}
	}()
	seen := map[netip.Prefix]bool{}
	for i, c := range claims {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		if seen[c.prefix] {
			t.Fatalf("%s claimed twice among %d runtimes starting at once", c.prefix, n)
		}
		seen[c.prefix] = true
	}
	p := claims[0].prefix
	if c, err := tryClaim(p); c != nil || err != nil {
		c.release()
		t.Fatalf("%s claimed while held: %v, %v", p, c, err)
	}
	claims[0].release()
	c, err := tryClaim(p)
	if err != nil || c == nil {
		// Another suite's runtime may have taken it in between, or the
		// host routed it: only an error is a failure.
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s taken by someone else once released", p)
		return
	}
	c.release()
}

// TestSubnetHostCovers, in a network namespace of its own: an address in a
// /24, or a route as narrow or narrower into it, makes it taken; a wider
// route (a default, a 10.0.0.0/8) does not.
func TestSubnetHostCovers(t *testing.T) {
	inNewNetns(t)
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		t.Fatal(err)
	}
	cidr := func(s string) *net.IPNet {
		_, n, err := net.ParseCIDR(s)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	addr, _ := netlink.ParseAddr("10.209.7.1/24")
	if err := netlink.AddrAdd(lo, addr); err != nil {
		t.Fatal(err)
	}
	host, _ := netlink.ParseAddr("10.209.9.77/16") // an address in .9 on a wider net
	if err := netlink.AddrAdd(lo, host); err != nil {
		t.Fatal(err)
	}
	for _, r := range []string{"10.209.8.128/25", "10.0.0.0/8", "0.0.0.0/0"} {
		if err := netlink.RouteAdd(&netlink.Route{LinkIndex: lo.Attrs().Index, Dst: cidr(r)}); err != nil {
			t.Fatalf("route %s: %v", r, err)
		}
	}
	for s, want := range map[string]bool{
		"10.209.7.0/24":  true,  // an address's /24
		"10.209.8.0/24":  true,  // a narrower route into it
		"10.209.9.0/24":  true,  // an address in it, on a wider network
		"10.209.10.0/24": false, // only the /16, the /8 and the default reach it
	} {
		got, err := hostCovers(netip.MustParsePrefix(s))
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("hostCovers(%s) = %v, want %v", s, got, want)
		}
	}
}

// TestSweepBridges, in a network namespace of its own (abstract socket
// names are per namespace too): a pod bridge whose subnet no runtime claims
// is a killed test's leftover and is deleted; one whose subnet is claimed,
// one with no address yet and a bridge not named as ours are kept.
func TestSweepBridges(t *testing.T) {
	inNewNetns(t)
	mk := func(name, addr string) {
		br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: name}}
		if err := netlink.LinkAdd(br); err != nil {
			t.Fatal(err)
		}
		if addr != "" {
			a, _ := netlink.ParseAddr(addr)
			if err := netlink.AddrAdd(br, a); err != nil {
				t.Fatal(err)
			}
		}
	}
	mk("fsb00000001", "10.209.1.1/24")  // left by a killed test
	mk("fsb00000002", "10.209.2.1/24")  // a live runtime's
	mk("fsb00000003", "")               // being made
	mk("other0", "10.209.4.1/24")       // not ours
	mk("fsbr0", "10.209.5.1/24")        // not ours: the name is not fsb and 8 hex digits
	mk("fsb0000000f", "192.168.9.1/24") // not ours: outside 10.209.0.0/16
	fd, err := bindClaim(netip.MustParsePrefix("10.209.2.0/24"))
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	sweepBridges()
	for name, want := range map[string]bool{"fsb00000001": false, "fsb00000002": true, "fsb00000003": true, "other0": true,
		"fsbr0": true, "fsb0000000f": true} {
		_, err := netlink.LinkByName(name)
		if got := err == nil; got != want {
			t.Errorf("%s: exists %v after the sweep, want %v (%v)", name, got, want, err)
		}
	}
}

// inNewNetns moves the test's goroutine, locked to its thread, into a new
// network namespace until the test ends (a thread that cannot come back is
// left locked, and ends with the goroutine).
func inNewNetns(t *testing.T) {
	testutil.RequireRoot(t)
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	ns, err := netns.New()
	if err != nil {
		orig.Close()
		runtime.UnlockOSThread()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ns.Close()
		defer orig.Close()
		if err := netns.Set(orig); err != nil {
			t.Errorf("back to the test's network namespace: %v (the thread is left locked)", err)
			return
		}
		runtime.UnlockOSThread()
	})
}
