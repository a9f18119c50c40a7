// SPDX-License-Identifier: Apache-2.0

package destination

import (
	"errors"
	"net/netip"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"10.0.0.5/32:5432", "10.0.0.5/32:5432"},
		{"10.0.1.0/24:5432", "10.0.1.0/24:5432"},
		{"[2001:db8::5]/128:5432", "[2001:db8::5]/128:5432"},
		{"10.9.0.0/16", "10.9.0.0/16"},
		{"10.0.0.5", "10.0.0.5/32"},
		{"10.0.0.5:80", "10.0.0.5/32:80"},
		{"[2001:db8::]/32", "[2001:db8::]/32"},
		{"[::ffff:10.0.0.5]/128:5432", "10.0.0.5/32:5432"},
		{"[::ffff:10.0.0.0]/120", "10.0.0.0/24"},
		{"0.0.0.0/0", "0.0.0.0/0"},
	} {
		d, err := Parse(tc.in)
		if err != nil {
			t.Errorf("Parse(%q): %v", tc.in, err)
			continue
		}
		if d.String() != tc.want {
			t.Errorf("Parse(%q) = %s, want %s", tc.in, d, tc.want)
		}
	}
	for _, in := range []string{"", "10.0.0.5/33", "10.0.1.5/24", "10.0.0.5:0", "10.0.0.5:70000", "2001:db8::5",
		"[2001:db8::5", "db.example:5432", "10.0.0.5/24x", "[::ffff:10.0.0.0]/64", "[fe80::1%eth0]/128", "10.0.0.5:80:81"} {
		if _, err := Parse(in); !errors.Is(err, ErrInvalid) {
			t.Errorf("Parse(%q) = %v, want ErrInvalid", in, err)
		}
	}
}

func TestMappedSameKey(t *testing.T) {
	a, _ := Parse("10.0.0.5/32:5432")
	b, _ := Parse("[::ffff:10.0.0.5]/128:5432")
	if keyOf(a) != keyOf(b) {
		t.Fatalf("%v and %v differ as keys", a, b)
	}
	addr, bits := a.Mapped()
	if bits != 128 || addr != netip.MustParseAddr("::ffff:10.0.0.5").As16() {
		t.Fatalf("Mapped = %v/%d", addr, bits)
	}
}

func TestCheck(t *testing.T) {
	p := func(ss ...string) []Destination {
		ds, err := ParseAll(ss)
		if err != nil {
			t.Fatal(err)
		}
		return ds
	}
	// Nested prefixes are fine: the longest wins.
	if err := Check(map[string][]Destination{"db": p("10.0.0.0/8:5432"), "cache": p("10.0.0.5/32:5432", "10.0.0.0/8")}); err != nil {
		t.Fatal(err)
	}
	err := Check(map[string][]Destination{"db": p("10.0.0.5/32:5432"), "other": p("[::ffff:10.0.0.5]/128:5432")})
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "pools.db and pools.other overlap") {
		t.Fatalf("overlap: %v", err)
	}
	if err := Check(map[string][]Destination{"db": p("10.0.0.0/24", "10.0.0.0/24")}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("twice in one pool: %v", err)
	}
}

func TestMatchPrecedence(t *testing.T) {
	pools := map[string][]Destination{}
	for n, ss := range map[string][]string{
		"wide": {"10.0.0.0/8:5432"}, "host": {"10.0.0.5/32"}, "net": {"10.0.0.0/24:5432"}, "v6": {"[2001:db8::]/32"},
	} {
		ds, err := ParseAll(ss)
		if err != nil {
			t.Fatal(err)
		}
		pools[n] = ds
	}
	for _, tc := range []struct{ to, want string }{
		{"10.0.0.5:5432", "net"}, // a pool naming the port wins over one of every port
		{"10.0.0.5:80", "host"},
		{"10.1.0.5:5432", "wide"},
		{"10.1.0.5:80", ""},
		{"[::ffff:10.0.0.9]:5432", "net"},
		{"[2001:db8::1]:1", "v6"},
	} {
		if got := Match(pools, netip.MustParseAddrPort(tc.to)); got != tc.want {
			t.Errorf("Match(%s) = %q, want %q", tc.to, got, tc.want)
		}
	}
}

// An IPv6 prefix covering the v4-mapped range covers IPv4 (the kernel keeps
// IPv4 v4-mapped); one that does not, does not.
func TestContainsMapped(t *testing.T) {
	all, _ := Parse("[::]/0")
	if !all.Contains(netip.MustParseAddrPort("10.1.2.3:80")) || !all.Contains(netip.MustParseAddrPort("[2001:db8::1]:80")) {
		t.Fatal("[::]/0 must cover IPv4 and IPv6")
	}
	doc, _ := Parse("[2001:db8::]/32")
	if doc.Contains(netip.MustParseAddrPort("10.1.2.3:80")) {
		t.Fatal("[2001:db8::]/32 covers no IPv4")
	}
}
