// SPDX-License-Identifier: Apache-2.0

// Package sockdiag reads the kernel's TCP socket table through NETLINK_SOCK_DIAG
// (inet_diag) and reports, for every socket, the cgroup v2 id the kernel has
// attached to it. fairshare uses it as the ground truth against which the BPF
// permit counters are reconciled: after any churn the number of permits a
// project holds must equal the number of its live sockets that hold one.
//
// Contract:
//
//   - List and Lookup read the sockets of the network namespace of the calling
//     OS thread at the time of the call (a netlink socket belongs to the
//     namespace it was created in). A Handle (NewHandleAt, NewHandleAtPath)
//     is a netlink socket made once in another namespace, a pod's, whose List
//     and Lookup read that namespace from any thread.
//   - The netlink framing is github.com/vishvananda/netlink's nl package (the
//     request, multipart dumps, NLMSG_DONE and NLMSG_ERROR). netlink.Handle
//     itself cannot be used: its SocketDiagTCP drops the INET_DIAG_CGROUP_ID
//     attribute and it does not expose its sockets for a request of our own,
//     so Handle is built the way it builds one (nl.GetNetlinkSocketAt and an
//     nl.SocketHandle). This package encodes inet_diag_req_v2 and decodes
//     inet_diag_msg and the cgroup-id attribute, nothing else.
//   - Socket.CgroupID is the id of the cgroup the socket was created in (the
//     inode number of its cgroup2 directory), as the kernel reports it in the
//     INET_DIAG_CGROUP_ID attribute. Full sockets carry it; TIME_WAIT and
//     SYN_RECV (request) sockets are minisocks without that attribute and
//     report 0.
//   - Socket.Cookie is the kernel socket cookie: the value getsockopt(SO_COOKIE)
//     and bpf_get_socket_cookie() return for the same struct sock.
//   - The dump is not a snapshot: sockets opened or closed while it runs may or
//     may not appear. Reconciliation must compare at a quiet point or tolerate
//     drift of the sockets that changed during the call.
//
// MPTCP: since Go 1.24 net.Listen asks for IPPROTO_MPTCP by default. The
// process's listening fd is then an MPTCP socket, which is not in the TCP
// table; the kernel creates a TCP subflow listener for it, which is. That
// subflow is listed as an ordinary LISTEN socket with the same address and
// cgroup id, but with a cookie of its own: not the one SO_COOKIE or a cgroup
// BPF hook sees on the process's fd. What happens to an accepted connection
// depends on the peer. A plain TCP peer makes the connection fall back, and
// accept returns the TCP socket itself: it is listed with the cookie the
// process sees. An MPTCP peer gets an MPTCP socket on both ends; the table
// shows one ESTABLISHED TCP subflow per end with cookies the processes never
// see. (Seen on 6.18: the accepted MPTCP socket even shares its listener's
// cookie.) TestMPTCPListener pins these observations down. Dumping the MPTCP
// sockets themselves (IPPROTO_MPTCP, mptcp_diag) is not implemented.
//
// CountByCgroup and CountByProject turn a list into per-project counts, with
// the index of cgroup ids to projects that cgroup.ProjectIndex builds.
package sockdiag
