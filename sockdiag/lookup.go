// SPDX-License-Identifier: Apache-2.0

package sockdiag

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"golang.org/x/sys/unix"
)

// ErrNotFound is returned by Lookup when no socket has the given ends.
var ErrNotFound = errors.New("sockdiag: no such socket")

// Lookup finds the one TCP socket of the calling thread's network namespace
// whose local end is src and remote end is dst, with a single exact request
// (no dump), so it costs one round trip however many sockets the host has.
// The front uses it to learn the cgroup of a loopback client from the
// accepted connection's addresses: the client's socket has the client's
// address as its local end. IPv4 addresses (plain or IPv4-mapped) are looked
// up in the IPv4 table, which also holds dual-stack sockets connected over
// IPv4.
func Lookup(src, dst netip.AddrPort) (Socket, error) {
	src = netip.AddrPortFrom(src.Addr().Unmap(), src.Port())
	dst = netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
	family := uint8(unix.AF_INET6)
	if src.Addr().Is4() && dst.Addr().Is4() {
		family = unix.AF_INET
	} else if src.Addr().Is4() || dst.Addr().Is4() {
		src = netip.AddrPortFrom(netip.AddrFrom16(src.Addr().As16()), src.Port())
		dst = netip.AddrPortFrom(netip.AddrFrom16(dst.Addr().As16()), dst.Port())
	}
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return Socket{}, fmt.Errorf("opening sock_diag netlink socket: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return Socket{}, fmt.Errorf("binding sock_diag netlink socket: %w", err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return Socket{}, fmt.Errorf("reading netlink port id: %w", err)
	}
	nlsa, ok := sa.(*unix.SockaddrNetlink)
	if !ok {
		return Socket{}, fmt.Errorf("netlink socket bound to %T: %w", sa, ErrMalformed)
	}
	req := buildLookup(family, src, dst)
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return Socket{}, fmt.Errorf("sending lookup: %w", err)
	}
	buf := make([]byte, 4096)
	for {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return Socket{}, fmt.Errorf("receiving lookup reply: %w", err)
		}
		// An exact request is answered by one message: the socket or an error.
		socks, _, err := parseReplies(nil, buf[:n], 1, nlsa.Pid)
		if errors.Is(err, unix.ENOENT) {
			return Socket{}, fmt.Errorf("tcp %v -> %v: %w", src, dst, ErrNotFound)
		}
		if err != nil {
			return Socket{}, fmt.Errorf("looking up tcp %v -> %v: %w", src, dst, err)
		}
		if len(socks) == 0 {
			continue
		}
		s := socks[0]
		// The kernel's lookup falls back to a listener on the local port;
		// only the exact connection is an answer.
		if s.Src.Addr().Unmap() != src.Addr().Unmap() || s.Src.Port() != src.Port() ||
			s.Dst.Addr().Unmap() != dst.Addr().Unmap() || s.Dst.Port() != dst.Port() {
			return Socket{}, fmt.Errorf("tcp %v -> %v: kernel answered %v -> %v: %w", src, dst, s.Src, s.Dst, ErrNotFound)
		}
		return s, nil
	}
}

// buildLookup encodes an exact SOCK_DIAG_BY_FAMILY request for one socket.
func buildLookup(family uint8, src, dst netip.AddrPort) []byte {
	b := buildRequest(family, AllStates, 1)
	ne := binary.NativeEndian
	ne.PutUint16(b[6:], unix.NLM_F_REQUEST) // exact: no NLM_F_DUMP
	id := b[sizeofNlMsghdr+8:]
	binary.BigEndian.PutUint16(id[0:], src.Port())
	binary.BigEndian.PutUint16(id[2:], dst.Port())
	if family == unix.AF_INET {
		a, d := src.Addr().As4(), dst.Addr().As4()
		copy(id[4:], a[:])
		copy(id[20:], d[:])
	} else {
		a, d := src.Addr().As16(), dst.Addr().As16()
		copy(id[4:], a[:])
		copy(id[20:], d[:])
	}
	return b
}
