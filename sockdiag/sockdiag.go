// SPDX-License-Identifier: Apache-2.0

package sockdiag

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"golang.org/x/sys/unix"
)

// Socket is one entry of the kernel's TCP socket table.
type Socket struct {
	Family   uint8          // unix.AF_INET or unix.AF_INET6
	State    State          // TCP state
	Src, Dst netip.AddrPort // local and remote end; an AF_INET6 socket may carry IPv4-mapped addresses
	Cookie   uint64         // socket cookie, equal to SO_COOKIE and bpf_get_socket_cookie()
	CgroupID uint64         // cgroup v2 id of the socket, 0 when the kernel gave none (TIME_WAIT, SYN_RECV)
	Inode    uint32         // inode of the socket file, 0 for sockets no process holds
	UID      uint32         // owner's uid in the caller's user namespace
}

// Options selects what List dumps. The zero value dumps every TCP socket of
// both families.
type Options struct {
	// Families to dump, unix.AF_INET and/or unix.AF_INET6; empty means both.
	Families []uint8
	// States is a mask of State.Mask bits; 0 means AllStates. Add
	// StateBoundInactive.Mask() to see sockets that are only bound.
	States uint32
}

// Sentinel errors callers may branch on.
var (
	// ErrFamily reports a family other than AF_INET and AF_INET6 in Options.
	ErrFamily = errors.New("sockdiag: unsupported address family")
	// ErrMalformed reports a reply the parser does not understand.
	ErrMalformed = errors.New("sockdiag: malformed netlink reply")
)

// Layout of the kernel structures (include/uapi/linux/inet_diag.h). The
// native byte order is little-endian on every architecture fairshare builds
// for; the port and address fields are big-endian (network order).
const (
	sizeofNlMsghdr      = unix.SizeofNlMsghdr // 16
	sizeofInetDiagReqV2 = 56                  // family, protocol, ext, pad, states u32, sockid (48)
	sizeofInetDiagMsg   = 72                  // family, state, timer, retrans, sockid (48), expires, rqueue, wqueue, uid, inode
	inetDiagCgroupID    = 21                  // INET_DIAG_CGROUP_ID, not in x/sys/unix
	recvBufSize         = 64 << 10            // larger reads mean fewer round trips; the kernel sizes its dump skbs by them
)

// List dumps the TCP sockets of the calling thread's network namespace (see
// the package documentation) that match opts.
func List(opts Options) ([]Socket, error) {
	families := opts.Families
	if len(families) == 0 {
		families = []uint8{unix.AF_INET, unix.AF_INET6}
	}
	for _, f := range families {
		if f != unix.AF_INET && f != unix.AF_INET6 {
			return nil, fmt.Errorf("listing family %d: %w", f, ErrFamily)
		}
	}
	states := opts.States
	if states == 0 {
		states = AllStates
	}

	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return nil, fmt.Errorf("opening sock_diag netlink socket: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return nil, fmt.Errorf("binding sock_diag netlink socket: %w", err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return nil, fmt.Errorf("reading netlink port id: %w", err)
	}
	nlsa, ok := sa.(*unix.SockaddrNetlink)
	if !ok {
		return nil, fmt.Errorf("netlink socket bound to %T: %w", sa, ErrMalformed)
	}

	d := dumper{fd: fd, pid: nlsa.Pid, buf: make([]byte, recvBufSize)}
	var socks []Socket
	for i, f := range families {
		seq := uint32(i + 1)
		socks, err = d.dump(socks, f, states, seq)
		if err != nil {
			return nil, fmt.Errorf("dumping TCP sockets of family %d: %w", f, err)
		}
	}
	return socks, nil
}

// dumper runs dump requests on one netlink socket.
type dumper struct {
	fd  int
	pid uint32 // our netlink port id, to drop replies meant for someone else
	buf []byte
}

// dump sends one SOCK_DIAG_BY_FAMILY dump request and appends its replies to
// socks.
func (d *dumper) dump(socks []Socket, family uint8, states, seq uint32) ([]Socket, error) {
	req := buildRequest(family, states, seq)
	if err := unix.Sendto(d.fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return socks, fmt.Errorf("sending request: %w", err)
	}
	for {
		n, _, err := unix.Recvfrom(d.fd, d.buf, 0)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return socks, fmt.Errorf("receiving reply: %w", err)
		}
		var done bool
		socks, done, err = parseReplies(socks, d.buf[:n], seq, d.pid)
		if err != nil || done {
			return socks, err
		}
	}
}

// buildRequest encodes the netlink header and inet_diag_req_v2 of a dump.
func buildRequest(family uint8, states, seq uint32) []byte {
	b := make([]byte, sizeofNlMsghdr+sizeofInetDiagReqV2)
	ne := binary.NativeEndian
	ne.PutUint32(b[0:], uint32(len(b)))                     // nlmsg_len
	ne.PutUint16(b[4:], unix.SOCK_DIAG_BY_FAMILY)           // nlmsg_type
	ne.PutUint16(b[6:], unix.NLM_F_REQUEST|unix.NLM_F_DUMP) // nlmsg_flags
	ne.PutUint32(b[8:], seq)                                // nlmsg_seq; pid 0 lets the kernel fill it in
	r := b[sizeofNlMsghdr:]
	r[0] = family
	r[1] = unix.IPPROTO_TCP
	// r[2] idiag_ext: no extension is needed, the cgroup id comes unasked.
	ne.PutUint32(r[4:], states)
	// sockid at r[8:56], cookie at r[48:56]: all zero except the cookie, which is
	// INET_DIAG_NOCOOKIE (all ones) so it never matches a socket by accident.
	ne.PutUint64(r[48:], ^uint64(0))
	return b
}

// parseReplies appends the sockets in one datagram of a dump to socks. done
// is true once the dump's NLMSG_DONE has been seen.
func parseReplies(socks []Socket, b []byte, seq, pid uint32) (_ []Socket, done bool, _ error) {
	ne := binary.NativeEndian
	for len(b) >= sizeofNlMsghdr {
		l := ne.Uint32(b[0:])
		typ := ne.Uint16(b[4:])
		mseq := ne.Uint32(b[8:])
		mpid := ne.Uint32(b[12:])
		if l < sizeofNlMsghdr || int(l) > len(b) {
			return socks, false, fmt.Errorf("message length %d of %d bytes: %w", l, len(b), ErrMalformed)
		}
		body := b[sizeofNlMsghdr:l]
		b = b[min(nlmAlign(l), uint32(len(b))):]
		if mseq != seq || (mpid != 0 && mpid != pid) {
			continue // a stale reply of an earlier request
		}
		switch typ {
		case unix.NLMSG_DONE:
			// A dump may end with a negative errno in place of the count.
			if len(body) >= 4 {
				if e := int32(ne.Uint32(body)); e < 0 {
					return socks, true, fmt.Errorf("dump ended with: %w", unix.Errno(-e))
				}
			}
			return socks, true, nil
		case unix.NLMSG_ERROR:
			if len(body) < 4 {
				return socks, true, fmt.Errorf("short NLMSG_ERROR: %w", ErrMalformed)
			}
			if e := int32(ne.Uint32(body)); e != 0 {
				return socks, true, fmt.Errorf("kernel refused request: %w", unix.Errno(-e))
			}
		case unix.SOCK_DIAG_BY_FAMILY:
			s, err := parseMsg(body)
			if err != nil {
				return socks, false, err
			}
			socks = append(socks, s)
		}
	}
	return socks, false, nil
}

// parseMsg decodes one inet_diag_msg and its attributes.
func parseMsg(b []byte) (Socket, error) {
	if len(b) < sizeofInetDiagMsg {
		return Socket{}, fmt.Errorf("inet_diag_msg of %d bytes: %w", len(b), ErrMalformed)
	}
	ne := binary.NativeEndian
	s := Socket{
		Family: b[0],
		State:  State(b[1]),
		UID:    ne.Uint32(b[64:]),
		Inode:  ne.Uint32(b[68:]),
		// The kernel stores the 64-bit cookie as two native u32, low half first.
		Cookie: uint64(ne.Uint32(b[44:])) | uint64(ne.Uint32(b[48:]))<<32,
	}
	sport := binary.BigEndian.Uint16(b[4:])
	dport := binary.BigEndian.Uint16(b[6:])
	switch s.Family {
	case unix.AF_INET:
		s.Src = netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[8:12])), sport)
		s.Dst = netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[24:28])), dport)
	case unix.AF_INET6:
		s.Src = netip.AddrPortFrom(netip.AddrFrom16([16]byte(b[8:24])), sport)
		s.Dst = netip.AddrPortFrom(netip.AddrFrom16([16]byte(b[24:40])), dport)
	default:
		return Socket{}, fmt.Errorf("socket family %d: %w", s.Family, ErrMalformed)
	}
	for a := b[sizeofInetDiagMsg:]; len(a) >= unix.SizeofRtAttr; {
		l := ne.Uint16(a[0:])
		typ := ne.Uint16(a[2:]) &^ (unix.NLA_F_NESTED | unix.NLA_F_NET_BYTEORDER)
		if l < unix.SizeofRtAttr || int(l) > len(a) {
			return Socket{}, fmt.Errorf("attribute length %d of %d bytes: %w", l, len(a), ErrMalformed)
		}
		if typ == inetDiagCgroupID && l == unix.SizeofRtAttr+8 {
			s.CgroupID = ne.Uint64(a[unix.SizeofRtAttr:])
		}
		a = a[min(int(rtaAlign(l)), len(a)):]
	}
	return s, nil
}

func nlmAlign(l uint32) uint32 { return (l + unix.NLMSG_ALIGNTO - 1) &^ (unix.NLMSG_ALIGNTO - 1) }
func rtaAlign(l uint16) uint16 { return (l + unix.RTA_ALIGNTO - 1) &^ (unix.RTA_ALIGNTO - 1) }
