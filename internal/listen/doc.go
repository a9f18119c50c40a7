// SPDX-License-Identifier: Apache-2.0

// Package listen is how every listener of the daemon (the HTTP front on TCP
// and on its unix socket, the permit API, the admin API and /metrics)
// accepts connections when the peers may be hostile. A local user must not
// be able to stop the daemon, or lock the operator out, by opening
// connections.
//
// # Accept errors
//
// Listener.Accept never hands a transient error to the server behind it:
// running out of file descriptors (EMFILE, ENFILE), of memory, or a
// connection aborted before it was accepted are waited out with a backoff
// (5ms doubling to 1s) while the connection stays in the kernel's backlog,
// and the server keeps serving. The first error of a run is logged, the
// rest of the run is counted, and the recovery is logged with the count and
// how long it lasted (a run longer than a minute is logged again each
// minute). Only a closed listener ends Accept.
//
// # Caps
//
// Options.MaxConns bounds the connections open through a listener at once,
// and Options.MaxPerPeer the connections of one peer. A connection past a
// cap is accepted, told why when the listener says how (Options.Refuse: a
// 503 for HTTP, an error line for the permit protocol) and closed at once,
// so the daemon never holds more descriptors for a listener than its cap.
// The caps of all listeners together stay below the process's open-files
// limit (RaiseFileLimit raises it to the hard limit first), which is what
// keeps a flood from starving anything else: the control loop, the BPF
// maps, the upstream connections, and above all the admin socket.
//
// # Peers
//
// A peer is what the kernel says about the other end, never what it says
// about itself (Peer):
//
//   - on a unix socket, the uid from SO_PEERCRED;
//   - on TCP from loopback, or from the address the connection reached
//     (a process of this host connecting to the host's own address, as
//     kubelet probes a host-network pod), the owner of the client's
//     socket, looked up in the kernel's socket table (sock_diag) when the
//     connection is accepted;
//   - on TCP from elsewhere, the address (an IPv6 address's /64).
//
// A uid is folded onto its owner when it lies in a subordinate range of
// /etc/subuid (Options.Owners): a user who can map 65,536 uids into a user
// namespace is still one peer. Options.Classify may name the peer
// otherwise: the daemon keys a client in a project's cgroup by its project,
// so that tenants running as one uid do not share one share.
//
// Options.Reserve keeps the last connections of a listener's cap for
// privileged peers (Options.Privileged, asked about the uid the kernel
// reported, never a folded one; on the admin socket and /metrics, root):
// however many connections other users hold, the operator's CLI gets in.
// Privileged peers are not subject to MaxPerPeer.
//
// Idle timeouts belong to the protocols (the HTTP servers set theirs; the
// permit protocol's sessions carry leases and have none), so Listener does
// not set deadlines.
//
// # Serving
//
// ServeHTTP is the one serve-then-shut-down loop of the daemon's HTTP
// servers (admin API, /metrics, the front): serve until the context ends,
// then stop accepting and give the requests in flight a grace period.
//
// # Unix socket paths
//
// Unix creates a unix socket: it never removes anything at the path but a
// socket nobody answers on (a live one is ErrInUse; any other kind of file
// is ErrNotSocket, named in the error), creates missing directories with
// mode 0711 whatever the umask (anyone may reach a socket whose name they
// know, nobody but the owner may list it), and gives the socket its mode
// from the first moment (through the umask) and its group with lchown, so
// nothing done by path can follow a link someone put there. Every directory
// on the way must be root's (or the process's user's) and writable by
// nobody else unless sticky, like /tmp (ErrUnsafeDir): another user could
// otherwise swap the socket. If a directory does not let the socket's
// intended users through, the returned warning says which and why.
package listen
