// SPDX-License-Identifier: Apache-2.0

package sockdiag

import (
	"errors"
	"net"
	"net/netip"
	"testing"
)

// TestLookup finds both ends of a loopback connection by their addresses,
// with the cookie and cgroup List reports, and refuses ends that do not
// exist (including the listener the kernel's lookup would fall back to).
func TestLookup(t *testing.T) {
	for _, network := range []string{"tcp4", "tcp6"} {
		t.Run(network, func(t *testing.T) {
			addr := "127.0.0.1:0"
			if network == "tcp6" {
				addr = "[::1]:0"
			}
			ln, err := net.Listen(network, addr)
			if err != nil {
				t.Skip(err)
			}
			t.Cleanup(func() { ln.Close() })
			c, err := net.Dial(network, ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			s, err := ln.Accept()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			client := c.LocalAddr().(*net.TCPAddr).AddrPort()
			server := c.RemoteAddr().(*net.TCPAddr).AddrPort()

			got, err := Lookup(client, server)
			if err != nil {
				t.Fatalf("Lookup(%v, %v): %v", client, server, err)
			}
			if got.Src != client || got.Dst != server || got.State != StateEstablished || got.CgroupID == 0 {
				t.Errorf("Lookup client end: %+v", got)
			}
			listed := mustList(t, Options{})
			var found bool
			for _, l := range listed {
				if l.Src == client && l.Dst == server {
					found = true
					if l.Cookie != got.Cookie || l.CgroupID != got.CgroupID {
						t.Errorf("Lookup %+v disagrees with List %+v", got, l)
					}
				}
			}
			if !found {
				t.Errorf("List has no socket %v -> %v", client, server)
			}
			if _, err := Lookup(server, client); err != nil {
				t.Errorf("Lookup of the accepted end: %v", err)
			}
			gone := netip.AddrPortFrom(client.Addr(), 1)
			if _, err := Lookup(gone, server); !errors.Is(err, ErrNotFound) {
				t.Errorf("Lookup of a connection that does not exist: %v, want ErrNotFound", err)
			}
			// Local end = the listener's port: the kernel would answer with the
			// listener; Lookup must not.
			if s, err := Lookup(server, netip.AddrPortFrom(client.Addr(), 9)); !errors.Is(err, ErrNotFound) {
				t.Errorf("Lookup that matches only the listener: %+v, %v; want ErrNotFound", s, err)
			}
		})
	}
}

// BenchmarkLookup is the front's cost per local TCP connection to learn the
// client's cgroup: one exact sock_diag request.
func BenchmarkLookup(b *testing.B) {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	c, err := net.Dial("tcp4", ln.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	s, err := ln.Accept()
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	client := c.LocalAddr().(*net.TCPAddr).AddrPort()
	server := c.RemoteAddr().(*net.TCPAddr).AddrPort()
	b.Run("socket-per-call", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := Lookup(client, server); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("handle", func(b *testing.B) {
		h, err := NewHandle()
		if err != nil {
			b.Fatal(err)
		}
		defer h.Close()
		b.ReportAllocs()
		for b.Loop() {
			if _, err := h.Lookup(client, server); err != nil {
				b.Fatal(err)
			}
		}
	})
}
