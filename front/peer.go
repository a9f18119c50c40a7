// SPDX-License-Identifier: Apache-2.0

package front

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/clock"
	"github.com/fairshare-dev/fairshare/internal/peercred"
	"github.com/fairshare-dev/fairshare/sockdiag"
)

// peer is the client end of one connection. The kernel's facts about it
// (address, cgroup) are found once per connection, at its first request that
// needs them, and shared by every request on it (HTTP/2 multiplexes many).
type peer struct {
	conn net.Conn
	cc   *clientConn // the connection as Front.Serve accepted it; nil under another server
	addr netip.Addr  // TCP peer; invalid for a unix socket peer

	once   sync.Once
	cgroup uint64 // cgroup id of the client: 0 when unknown
	err    error  // why cgroup is unknown, for the log
	// local: the client is a process of this node (a unix socket peer, or
	// a TCP peer at one of the node's own addresses), so it has a cgroup
	// the front must know: when the lookup fails it is refused rather
	// than taken for a peer outside every project.
	local bool
}

type peerKey struct{}

// connContext records the connection for the peer lookups of its requests.
func (f *Front) connContext(ctx context.Context, c net.Conn) context.Context {
	var p *peer
	if cc, ok := c.(*clientConn); ok {
		cc.writeFor = f.cfg.WriteTimeout
		if hc, ok := cc.Conn.(*handedConn); ok && hc.peer != nil {
			// From the fast path: the facts it found already.
			p = hc.peer
		} else {
			p = f.newPeer(cc.Conn)
		}
		p.cc = cc
	} else {
		p = f.newPeer(c)
	}
	return context.WithValue(ctx, peerKey{}, p)
}

// newPeer records the client of c, as accepted, for the peer lookups of
// its requests.
func (f *Front) newPeer(c net.Conn) *peer {
	p := &peer{conn: c}
	// The daemon's listeners wrap their connections (internal/listen) and
	// have looked a loopback client's socket up already: its cgroup is
	// taken from there rather than asked for again.
	if lc, ok := c.(interface{ PeerCgroup() uint64 }); ok {
		p.found(lc.PeerCgroup())
	}
	// The socket the peer lookups need is behind NetConn.
	p.conn = peercred.Unwrap(c)
	if ta, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		p.addr = ta.AddrPort().Addr().Unmap()
	}
	return p
}

// found records the cgroup id a listener found for the client's socket in
// this kernel's tables (0: it found none, and cgroupOf looks itself): the
// client is a process of this node, whatever its address, and is placed
// as one (trusted.local, resolvePeer's unknown local peer).
func (p *peer) found(id uint64) {
	if id != 0 {
		p.once.Do(func() { p.cgroup, p.local = id, true })
	}
}

// peerOf returns the request's peer. A request served without the front's own
// server (a handler mounted elsewhere) gets a peer from r.RemoteAddr, which
// net/http fills from the connection, not from anything the client sends; it
// has no cgroup.
func peerOf(r *http.Request) *peer {
	if p, ok := r.Context().Value(peerKey{}).(*peer); ok {
		return p
	}
	p := &peer{}
	if ap, err := netip.ParseAddrPort(r.RemoteAddr); err == nil {
		p.addr = ap.Addr().Unmap()
	}
	return p
}

// cgroupOf returns the cgroup id of the peer's client, looking it up on first
// use: the cgroup of the process (SO_PEERCRED) for a unix socket, the cgroup
// of the client's socket (sock_diag) for a TCP loopback peer. Remote TCP peers
// have no cgroup on this node.
func (f *Front) cgroupOf(p *peer) uint64 {
	p.once.Do(func() {
		switch c := p.conn.(type) {
		case *net.UnixConn:
			p.local = true
			p.cgroup, p.err = unixPeerCgroup(f.id.mount, c)
		case *net.TCPConn:
			if f.id.mount.Point == "" {
				return // no rule looks at cgroups
			}
			remote := c.RemoteAddr().(*net.TCPAddr).AddrPort()
			local := c.LocalAddr().(*net.TCPAddr).AddrPort()
			var s sockdiag.Socket
			// Every TCP peer is looked up, not only loopback ones: a
			// local client may reach the front at any of the node's
			// addresses. A remote peer's socket is not in this kernel.
			s, p.err = sockdiag.Lookup(remote, local)
			p.cgroup = s.CgroupID
			switch {
			case p.err == nil:
				p.local = true
				if p.cgroup == 0 {
					p.err = errors.New("the client's socket has no cgroup (closed)")
				}
			case errors.Is(p.err, sockdiag.ErrNotFound) && !isLocalAddr(remote.Addr().Unmap(), local.Addr().Unmap()):
				p.err = nil // remote: no cgroup on this node
			default:
				// Gone already (closed, reset) or the lookup failed:
				// still a local client, of a cgroup nobody knows.
				p.local = true
			}
		}
		if p.err != nil {
			f.log.Debug("peer cgroup unknown", "peer", p.conn.RemoteAddr(), "err", p.err)
		}
	})
	return p.cgroup
}

// isLocalAddr reports whether a is an address of this node: loopback, the
// address the connection reached (a client of the node that connects to its
// own address gets it as its source too), or one of its interfaces' (as
// read at most a second ago: see nodeAddrs).
func isLocalAddr(a, reached netip.Addr) bool {
	if a.IsLoopback() || a == reached {
		return true
	}
	local, ok := nodeAddrs.has(a)
	return local || !ok // cannot tell: not taken for remote
}

// nodeAddrs are the node's interface addresses, read again when a second
// old (a failed read is not kept). Each remote client's first request
// asks, and a read is a netlink dump of every address, which a flood of
// new connections would otherwise make at each.
var nodeAddrs addrCache

type addrCache struct {
	mu  sync.Mutex // guards the fields below
	at  time.Time  // when set was read; zero: never
	set map[netip.Addr]bool
	ok  bool // the last read succeeded
}

// has reports whether a is one of the node's addresses; ok is false when
// they could not be read.
func (c *addrCache) has(a netip.Addr) (local, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if now := time.Now(); c.at.IsZero() || now.Sub(c.at) >= time.Second || now.Before(c.at) {
		c.at = now
		addrs, err := net.InterfaceAddrs()
		c.ok = err == nil
		if err != nil {
			c.at = time.Time{} // a failure is not kept: the next asks again
		}
		clear(c.set)
		if c.set == nil {
			c.set = map[netip.Addr]bool{}
		}
		for _, ia := range addrs {
			if n, isNet := ia.(*net.IPNet); isNet {
				if b, isAddr := netip.AddrFromSlice(n.IP); isAddr {
					c.set[b.Unmap()] = true
				}
			}
		}
	}
	return c.set[a], c.ok
}

// unixPeerCgroup reads the cgroup of the process at the other end of a unix
// socket: SO_PEERCRED gives the pid the kernel recorded at connect time, and
// /proc/<pid>/cgroup its cgroup now. The pid is held through a pidfd
// (SO_PEERPIDFD) while it is read: a connecting process that exited (its
// socket passed on to another), or whose pid was reused, is an error, not
// whatever process has that pid now.
func unixPeerCgroup(mount cgroup.Mount, c net.Conn) (uint64, error) {
	if mount.Point == "" {
		return 0, nil
	}
	cr, err := peercred.Of(c)
	if err != nil {
		return 0, err
	}
	pidfd, err := peerPidfd(c)
	if err != nil {
		return 0, err
	}
	defer unix.Close(pidfd)
	if err := pidAlive(pidfd, cr.PID); err != nil {
		return 0, err
	}
	dir, err := mount.OfPID(int(cr.PID))
	if err != nil {
		return 0, err
	}
	cg, err := cgroup.ID(dir)
	if err != nil {
		return 0, fmt.Errorf("cgroup of pid %d: %w", cr.PID, err)
	}
	// Still the same process (alive, so its pid was not reused) after
	// its cgroup was read.
	if err := pidAlive(pidfd, cr.PID); err != nil {
		return 0, err
	}
	return cg, nil
}

// PeerClass says who a newly accepted connection's client is, as the front
// will see it, for the daemon's per-peer connection caps: the project of its
// cgroup (the process's cgroup for a unix socket peer; cgroupID, found by
// the listener's own socket lookup, for a loopback TCP peer, looked up here
// when 0), and whether it is a trusted peer (by address or cgroup). Only the
// kernel's facts are read, nothing the client sends.
func (f *Front) PeerClass(c net.Conn, cgroupID uint64) (project string, trusted bool) {
	p := &peer{conn: peercred.Unwrap(c)}
	if ta, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		p.addr = ta.AddrPort().Addr().Unmap()
	}
	p.found(cgroupID)
	var pl placement
	project, _ = pl.of(f, f.cgroupOf(p))
	return project, f.trusted(p, &pl)
}

// CheckIdentity checks cfg's projects root, trusted peers and exempt
// cgroups against the host's cgroup2 mount as New does, without building
// a front: 'run --print-config' refuses what the daemon would.
func CheckIdentity(cfg Config) error {
	if _, err := newIdentity(cfg, clock.System{}, false); err != nil {
		return fmt.Errorf("peer identity: %w", err)
	}
	return nil
}

// peerPidfd returns a pidfd of the process that connected c (SO_PEERPIDFD).
func peerPidfd(c net.Conn) (int, error) {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return -1, fmt.Errorf("pidfd of peer: %T has no file descriptor", c)
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return -1, err
	}
	pidfd, serr := -1, error(nil)
	if err := rc.Control(func(fd uintptr) {
		pidfd, serr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PEERPIDFD)
	}); err != nil {
		return -1, err
	}
	if serr != nil {
		return -1, fmt.Errorf("SO_PEERPIDFD: %w", serr)
	}
	return pidfd, nil
}

// pidAlive returns an error when the process of pidfd has exited.
func pidAlive(pidfd int, pid int32) error {
	if err := unix.PidfdSendSignal(pidfd, 0, nil, 0); err != nil {
		return fmt.Errorf("the process that connected (pid %d) is gone: %w", pid, err)
	}
	return nil
}
