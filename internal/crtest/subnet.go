// SPDX-License-Identifier: Apache-2.0

package crtest

import (
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os/exec"
	"strconv"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// subnetClaim is a /24 of 10.209.0.0/16 held by one runtime for its pods'
// bridge. Runtimes of other test processes (another package's, another
// clone's suite beside this one) pick theirs at the same time: two bridges
// with one subnet give the host two routes to it, and the pods behind the
// second are unreachable ("no route to host": the ARP goes out on the first
// bridge). The claim is an abstract unix socket named after the subnet,
// bound for the runtime's life: the kernel lets one process bind a name,
// and frees it when the process ends however it ends, so a crashed test
// leaves nothing to clean.
type subnetClaim struct {
	prefix netip.Prefix
	fd     int
}

// claimSubnet claims a /24 of 10.209.0.0/16 that no other runtime holds and
// that no address or route of the host's already covers, starting at a
// random one.
func claimSubnet() (*subnetClaim, error) {
	start := rand.IntN(256)
	for i := range 256 {
		p := netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 209, byte((start + i) % 256), 0}), 24)
		c, err := tryClaim(p)
		if c != nil || err != nil {
			return c, err
		}
	}
	return nil, fmt.Errorf("no /24 of 10.209.0.0/16 is free for the pods' bridge: each is claimed by another test runtime or covered by a route or address of the host's")
}

// tryClaim claims p, or returns nil if another runtime holds it or the
// host already reaches into it.
func tryClaim(p netip.Prefix) (*subnetClaim, error) {
	fd, err := bindClaim(p)
	if err == unix.EADDRINUSE {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("claiming the pod subnet %s: %w", p, err)
	}
	if used, err := hostCovers(p); err != nil || used {
		unix.Close(fd)
		return nil, err
	}
	return &subnetClaim{prefix: p, fd: fd}, nil
}

// bindClaim binds the abstract unix socket that claims p, or returns
// EADDRINUSE if another runtime holds it.
func bindClaim(p netip.Prefix) (int, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	// A leading NUL (written @): the abstract namespace, no file.
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: "@fairshare-crtest-" + p.String()}); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// hostCovers says whether the host already reaches into p: an address of
// its in p, or a route as narrow as p or narrower that overlaps it (a
// leftover bridge's, another network's). A wider route (the default, a
// 10.0.0.0/8 of the machine's) is no conflict: the bridge's /24 is more
// specific and wins for p.
func hostCovers(p netip.Prefix) (bool, error) {
	addrs, err := netlink.AddrList(nil, netlink.FAMILY_V4)
	if err != nil {
		return false, fmt.Errorf("listing the host's addresses: %w", err)
	}
	for _, a := range addrs {
		if narrowOverlap(a.IPNet, p) {
			return true, nil
		}
		if ip, ok := netip.AddrFromSlice(a.IP.To4()); ok && p.Contains(ip) {
			return true, nil
		}
	}
	routes, err := netlink.RouteListFiltered(netlink.FAMILY_V4, &netlink.Route{Table: unix.RT_TABLE_UNSPEC}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return false, fmt.Errorf("listing the host's routes: %w", err)
	}
	for _, r := range routes {
		if narrowOverlap(r.Dst, p) {
			return true, nil
		}
	}
	return false, nil
}

// narrowOverlap says whether n is an IPv4 network at least as narrow as p
// that overlaps it.
func narrowOverlap(n *net.IPNet, p netip.Prefix) bool {
	if n == nil {
		return false
	}
	a, ok := netip.AddrFromSlice(n.IP.To4())
	if !ok {
		return false
	}
	ones, bits := n.Mask.Size()
	return bits == 32 && ones >= p.Bits() && netip.PrefixFrom(a, ones).Masked().Overlaps(p)
}

// podSubnets is where the runtimes' bridges take their /24.
var podSubnets = netip.MustParsePrefix("10.209.0.0/16")

// ourBridge says whether name is a runtime's bridge: "fsb" and 8 hex digits.
func ourBridge(name string) bool {
	hexDigits, ok := strings.CutPrefix(name, "fsb")
	if !ok || len(hexDigits) != 8 {
		return false
	}
	_, err := hex.DecodeString(hexDigits)
	return err == nil
}

// sweepBridges deletes the pod bridges ("fsb" and 8 hex digits, on a /24 of
// 10.209.0.0/16) that
// runtimes of killed test processes left, with their routes: a bridge
// whose subnet no live runtime claims. A live runtime claims its subnet
// before CNI makes its bridge and releases it only after deleting it, so
// a claim found free means the bridge's runtime is gone. A bridge with no
// address yet is left alone (CNI may be making it).
func sweepBridges() {
	links, err := netlink.LinkList()
	if err != nil {
		return
	}
	for _, link := range links {
		if _, ok := link.(*netlink.Bridge); !ok || !ourBridge(link.Attrs().Name) {
			continue
		}
		addrs, err := netlink.AddrList(link, netlink.FAMILY_V4)
		if err != nil || len(addrs) == 0 {
			continue
		}
		ip, ok := netip.AddrFromSlice(addrs[0].IP.To4())
		if !ok || !podSubnets.Contains(ip) {
			continue
		}
		p, err := ip.Prefix(24)
		if err != nil {
			continue
		}
		fd, err := bindClaim(p)
		if err != nil {
			continue // a live runtime's
		}
		_ = netlink.LinkDel(link)
		unix.Close(fd)
	}
}

// release frees the subnet for other runtimes.
func (c *subnetClaim) release() {
	if c != nil && c.fd >= 0 {
		unix.Close(c.fd)
		c.fd = -1
	}
}

// NetState describes how the host reaches the pod, for a failure message
// when it cannot be reached: the host's route to the pod, its IPv4 routes,
// neighbours and links, and inside the pod's network namespace its
// addresses, routes, neighbours and link counters (an ARP left unanswered
// shows as INCOMPLETE or FAILED on the host).
func (p *Pod) NetState() string {
	var b strings.Builder
	run := func(name string, args ...string) {
		out, err := exec.Command(name, args...).CombinedOutput()
		fmt.Fprintf(&b, "$ %s %s\n%s", name, strings.Join(args, " "), out)
		if err != nil {
			fmt.Fprintf(&b, "(%v)\n", err)
		}
	}
	run("ip", "-4", "route", "get", p.IP)
	run("ip", "-4", "route", "show", "table", "all")
	run("ip", "-4", "neigh", "show")
	run("ip", "-s", "-d", "link", "show")
	pod := []string{"-t", strconv.Itoa(p.Pid), "-n", "ip"}
	run("nsenter", append(pod, "-4", "addr", "show")...)
	run("nsenter", append(pod, "-4", "route", "show")...)
	run("nsenter", append(pod, "-4", "neigh", "show")...)
	run("nsenter", append(pod, "-s", "-d", "link", "show")...)
	return b.String()
}
