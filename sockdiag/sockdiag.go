// SPDX-License-Identifier: Apache-2.0

package sockdiag

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
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
	// ErrClosed reports the use of a closed Handle.
	ErrClosed = errors.New("sockdiag: handle is closed")
)

// Layout of the kernel structures (include/uapi/linux/inet_diag.h). The
// native byte order is little-endian on every architecture fairshare builds
// for; the port and address fields are big-endian (network order).
const (
	sizeofInetDiagReqV2 = 56 // family, protocol, ext, pad, states u32, sockid (48)
	sizeofInetDiagMsg   = 72 // family, state, timer, retrans, sockid (48), expires, rqueue, wqueue, uid, inode
	inetDiagCgroupID    = 21 // INET_DIAG_CGROUP_ID: netlink v1.3.1 names it but never parses it
	handleTimeout       = 10 * time.Second
)

// Handle is a sock_diag netlink socket that belongs to one network namespace
// for its whole life, whichever thread later uses it: the way to read the
// socket table of a namespace the caller is not in (a pod's) without
// entering it per call. A Handle may be used by several goroutines; their
// requests take turns on the one socket. The framing (requests, multipart
// dumps, NLMSG_DONE and NLMSG_ERROR, sequence and port checks) is the
// vishvananda/netlink nl package's; this package adds only the
// inet_diag_req_v2 request and the decoding of the replies, for the
// cgroup-id attribute netlink.Handle does not expose.
type Handle struct {
	sh *nl.SocketHandle
}

// NewHandle opens a Handle in the calling thread's network namespace.
func NewHandle() (*Handle, error) { return NewHandleAt(netns.None()) }

// NewHandleAt opens a Handle in the network namespace ns (netns.None() for the
// calling thread's). The calling goroutine's thread enters ns only while the
// socket is created, and comes back.
func NewHandleAt(ns netns.NsHandle) (*Handle, error) {
	s, err := nl.GetNetlinkSocketAt(ns, netns.None(), unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return nil, fmt.Errorf("opening sock_diag netlink socket in %v: %w", ns, err)
	}
	tv := unix.NsecToTimeval(handleTimeout.Nanoseconds())
	if err := s.SetReceiveTimeout(&tv); err != nil {
		s.Close()
		return nil, fmt.Errorf("setting sock_diag receive timeout: %w", err)
	}
	if err := s.SetSendTimeout(&tv); err != nil {
		s.Close()
		return nil, fmt.Errorf("setting sock_diag send timeout: %w", err)
	}
	return &Handle{sh: &nl.SocketHandle{Socket: s}}, nil
}

// NewHandleAtPath opens a Handle in the network namespace file at path
// (/proc/<pid>/ns/net, /var/run/netns/<name>).
func NewHandleAtPath(path string) (*Handle, error) {
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return nil, fmt.Errorf("opening network namespace %s: %w", path, err)
	}
	defer ns.Close()
	return NewHandleAt(ns)
}

// Close releases the netlink socket. A closed Handle must not be used again.
func (h *Handle) Close() {
	if h != nil && h.sh != nil {
		h.sh.Close()
		h.sh = nil
	}
}

// List dumps the TCP sockets of the calling thread's network namespace (see
// the package documentation) that match opts, on a netlink socket of its own.
func List(opts Options) ([]Socket, error) { return list(nil, opts) }

// List dumps the TCP sockets of h's network namespace that match opts.
func (h *Handle) List(opts Options) ([]Socket, error) { return list(h, opts) }

func list(h *Handle, opts Options) ([]Socket, error) {
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
	var socks []Socket
	for _, f := range families {
		req, err := h.request(unix.NLM_F_DUMP, &diagReq{family: f, states: states})
		if err != nil {
			return nil, err
		}
		var perr error
		err = req.ExecuteIter(unix.NETLINK_SOCK_DIAG, unix.SOCK_DIAG_BY_FAMILY, func(msg []byte) bool {
			s, err := parseMsg(msg)
			if err != nil {
				perr = err
				return false
			}
			socks = append(socks, s)
			return true
		})
		// A dump is never a snapshot (see the package documentation); an
		// interrupted one says so explicitly and is as good as any.
		if err != nil && !errors.Is(err, nl.ErrDumpInterrupted) {
			return nil, fmt.Errorf("dumping TCP sockets of family %d: %w", f, err)
		}
		if perr != nil {
			return nil, fmt.Errorf("dumping TCP sockets of family %d: %w", f, perr)
		}
	}
	return socks, nil
}

// request makes a netlink request on h's socket, or on a socket of its own
// in the calling thread's namespace when h is nil.
func (h *Handle) request(flags int, data *diagReq) (*nl.NetlinkRequest, error) {
	req := nl.NewNetlinkRequest(unix.SOCK_DIAG_BY_FAMILY, flags)
	if h != nil {
		if h.sh == nil {
			// A request without a socket would run in the caller's namespace.
			return nil, ErrClosed
		}
		req.Sockets = map[int]*nl.SocketHandle{unix.NETLINK_SOCK_DIAG: h.sh}
	}
	req.AddData(data)
	return req, nil
}

// diagReq is an inet_diag_req_v2 for TCP, as nl request data.
type diagReq struct {
	family   uint8
	states   uint32
	src, dst netip.AddrPort // exact lookups only; zero for dumps
}

func (r *diagReq) Len() int { return sizeofInetDiagReqV2 }

func (r *diagReq) Serialize() []byte {
	b := make([]byte, sizeofInetDiagReqV2)
	b[0] = r.family
	b[1] = unix.IPPROTO_TCP
	// b[2] idiag_ext: no extension is needed, the cgroup id comes unasked.
	binary.NativeEndian.PutUint32(b[4:], r.states)
	id := b[8:]
	binary.BigEndian.PutUint16(id[0:], r.src.Port())
	binary.BigEndian.PutUint16(id[2:], r.dst.Port())
	if r.src.IsValid() {
		if r.family == unix.AF_INET {
			a, d := r.src.Addr().As4(), r.dst.Addr().As4()
			copy(id[4:], a[:])
			copy(id[20:], d[:])
		} else {
			a, d := r.src.Addr().As16(), r.dst.Addr().As16()
			copy(id[4:], a[:])
			copy(id[20:], d[:])
		}
	}
	// The cookie is INET_DIAG_NOCOOKIE (all ones) so it never matches a
	// socket by accident.
	binary.NativeEndian.PutUint64(id[40:], ^uint64(0))
	return b
}

// parseMsg decodes one inet_diag_msg and its cgroup-id attribute.
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
	a := b[sizeofInetDiagMsg:]
	if pad := len(a) % unix.RTA_ALIGNTO; pad != 0 {
		// nl.ParseRouteAttr steps by the aligned length and would run off an
		// unpadded end.
		a = append(a[:len(a):len(a)], make([]byte, unix.RTA_ALIGNTO-pad)...)
	}
	attrs, err := nl.ParseRouteAttr(a)
	if err != nil {
		return Socket{}, fmt.Errorf("attributes: %v: %w", err, ErrMalformed)
	}
	for _, a := range attrs {
		if a.Attr.Type&^(unix.NLA_F_NESTED|unix.NLA_F_NET_BYTEORDER) == inetDiagCgroupID && len(a.Value) == 8 {
			s.CgroupID = ne.Uint64(a.Value)
		}
	}
	return s, nil
}
