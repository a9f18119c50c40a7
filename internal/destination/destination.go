// SPDX-License-Identifier: Apache-2.0

package destination

import (
	"errors"
	"fmt"
	"net/netip"
	"sort"
	"strconv"
	"strings"
)

// ErrInvalid is wrapped by every error of Parse and Check.
var ErrInvalid = errors.New("invalid destination")

// Destination is a prefix and a port; Port 0 is every port.
type Destination struct {
	Prefix netip.Prefix // IPv4 for an IPv4 or v4-mapped destination
	Port   uint16
}

// String is the destination as the configuration writes it.
func (d Destination) String() string {
	var s string
	if d.Prefix.Addr().Is4() {
		s = d.Prefix.String()
	} else {
		s = "[" + d.Prefix.Addr().String() + "]/" + strconv.Itoa(d.Prefix.Bits())
	}
	if d.Port != 0 {
		s += ":" + strconv.Itoa(int(d.Port))
	}
	return s
}

// Mapped is the destination's address as 16 bytes (IPv4 v4-mapped) and its
// prefix length in them: the kernel side's form.
func (d Destination) Mapped() ([16]byte, int) {
	a := d.Prefix.Addr()
	bits := d.Prefix.Bits()
	if a.Is4() {
		bits += 96
	}
	return a.As16(), bits
}

// Contains says whether a connection to addr:port matches d alone (without
// the precedence between pools: see Match). It compares as the kernel side
// does, in IPv6 with IPv4 v4-mapped: an IPv6 prefix that covers
// ::ffff:0:0/96 ([::]/0, [::]/64) covers every IPv4 address too.
func (d Destination) Contains(addr netip.AddrPort) bool {
	if d.Port != 0 && d.Port != addr.Port() {
		return false
	}
	a, bits := d.Mapped()
	return netip.PrefixFrom(netip.AddrFrom16(a), bits).Contains(netip.AddrFrom16(addr.Addr().As16()))
}

// Parse reads "10.0.0.5/32:5432", "10.0.1.0/24", "[2001:db8::5]/128:5432",
// "[2001:db8::]/32", or an address without a prefix length (the address
// alone). Host bits past the prefix are refused, so a typo does not widen
// or narrow a pool silently.
func Parse(s string) (Destination, error) {
	bad := func(format string, a ...any) (Destination, error) {
		return Destination{}, fmt.Errorf("%q: %s: %w", s, fmt.Sprintf(format, a...), ErrInvalid)
	}
	var addrPart, rest string
	if strings.HasPrefix(s, "[") {
		end := strings.IndexByte(s, ']')
		if end < 0 {
			return bad("no closing ]")
		}
		addrPart, rest = s[1:end], s[end+1:]
	} else {
		if strings.Count(s, ":") > 1 {
			return bad("an IPv6 address is written in brackets: [2001:db8::5]/128:5432")
		}
		addrPart, rest = s, ""
		if i := strings.IndexByte(s, ':'); i >= 0 {
			addrPart, rest = s[:i], s[i:]
		}
		if i := strings.IndexByte(addrPart, '/'); i >= 0 {
			addrPart, rest = addrPart[:i], addrPart[i:]+rest
		}
	}
	addr, err := netip.ParseAddr(addrPart)
	if err != nil || addr.Zone() != "" {
		return bad("not an IP address: %q", addrPart)
	}
	addr = addr.Unmap()
	bits := addr.BitLen()
	if lenPart, ok := strings.CutPrefix(rest, "/"); ok {
		lenStr := lenPart
		if i := strings.IndexByte(lenPart, ':'); i >= 0 {
			lenStr, rest = lenPart[:i], lenPart[i:]
		} else {
			rest = ""
		}
		n, err := strconv.Atoi(lenStr)
		if err != nil || n < 0 || n > 128 {
			return bad("prefix length %q is not a number of bits", lenStr)
		}
		// A v4-mapped prefix written as IPv6 counts its 96 leading bits.
		if strings.HasPrefix(s, "[") && addr.Is4() {
			if n < 96 {
				return bad("a v4-mapped prefix is at least /96")
			}
			n -= 96
		}
		if n > addr.BitLen() {
			return bad("prefix length %d past the address's %d bits", n, addr.BitLen())
		}
		bits = n
	}
	var port uint16
	if portPart, ok := strings.CutPrefix(rest, ":"); ok {
		p, err := strconv.Atoi(portPart)
		if err != nil || p < 1 || p > 65535 {
			return bad("port %q is not in 1..65535", portPart)
		}
		port = uint16(p)
	} else if rest != "" {
		return bad("unexpected %q (CIDR, then an optional :port)", rest)
	}
	pfx := netip.PrefixFrom(addr, bits)
	if pfx.Masked() != pfx {
		return bad("host bits set past /%d (did you mean %s?)", bits, pfx.Masked())
	}
	return Destination{Prefix: pfx, Port: port}, nil
}

// ParseAll parses a pool's list.
func ParseAll(list []string) ([]Destination, error) {
	out := make([]Destination, 0, len(list))
	for i, s := range list {
		d, err := Parse(s)
		if err != nil {
			return nil, fmt.Errorf("[%d] %w", i, err)
		}
		out = append(out, d)
	}
	return out, nil
}

// key is a destination as the kernel keeps it.
type key struct {
	addr [16]byte
	bits int
	port uint16
}

func keyOf(d Destination) key {
	a, b := d.Mapped()
	return key{a, b, d.Port}
}

// Check refuses a destination listed twice: in two pools (naming both) or
// twice in one. pools maps a pool's name to its destinations.
func Check(pools map[string][]Destination) error {
	names := make([]string, 0, len(pools))
	for n := range pools {
		names = append(names, n)
	}
	sort.Strings(names)
	seen := map[key]string{}
	for _, n := range names {
		for _, d := range pools[n] {
			k := keyOf(d)
			if other, ok := seen[k]; ok {
				if other == n {
					return fmt.Errorf("pools.%s lists %s twice: %w", n, d, ErrInvalid)
				}
				return fmt.Errorf("pools.%s and pools.%s overlap: both list %s (a connection counts in one destination pool): %w",
					other, n, d, ErrInvalid)
			}
			seen[k] = n
		}
	}
	return nil
}

// Match is the pool a connection to addr matches, "" if none, with the
// kernel's precedence: a destination naming the port before one of every
// port, then the longest prefix.
func Match(pools map[string][]Destination, addr netip.AddrPort) string {
	best, bestBits, bestPort := "", -1, false
	for n, ds := range pools {
		for _, d := range ds {
			if !d.Contains(addr) {
				continue
			}
			_, bits := d.Mapped()
			withPort := d.Port != 0
			if (withPort && !bestPort) || (withPort == bestPort && bits > bestBits) {
				best, bestBits, bestPort = n, bits, withPort
			}
		}
	}
	return best
}
