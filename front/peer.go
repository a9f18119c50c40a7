// SPDX-License-Identifier: Apache-2.0

package front

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"sync"

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
}

type peerKey struct{}

// connContext records the connection for the peer lookups of its requests.
func (f *Front) connContext(ctx context.Context, c net.Conn) context.Context {
	p := &peer{conn: c}
	if cc, ok := c.(*clientConn); ok {
		p.conn, p.cc = cc.Conn, cc
		cc.writeFor = f.cfg.WriteTimeout
	}
	// The daemon's listeners wrap their connections (internal/listen) and
	// have looked a loopback client's socket up already: its cgroup is
	// taken from there rather than asked for again.
	if lc, ok := p.conn.(interface{ PeerCgroup() uint64 }); ok {
		if id := lc.PeerCgroup(); id != 0 {
			p.once.Do(func() { p.cgroup = id })
		}
	}
	// The socket the peer lookups need is behind NetConn.
	p.conn = peercred.Unwrap(p.conn)
	if ta, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		p.addr = ta.AddrPort().Addr().Unmap()
	}
	return context.WithValue(ctx, peerKey{}, p)
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
			p.cgroup, p.err = unixPeerCgroup(f.id.mount, c)
		case *net.TCPConn:
			if !p.addr.IsLoopback() {
				return
			}
			remote := c.RemoteAddr().(*net.TCPAddr).AddrPort()
			local := c.LocalAddr().(*net.TCPAddr).AddrPort()
			var s sockdiag.Socket
			s, p.err = sockdiag.Lookup(remote, local)
			p.cgroup = s.CgroupID
		}
		if p.err != nil {
			f.log.Debug("peer cgroup unknown", "peer", p.conn.RemoteAddr(), "err", p.err)
		}
	})
	return p.cgroup
}

// unixPeerCgroup reads the cgroup of the process at the other end of a unix
// socket: SO_PEERCRED gives the pid the kernel recorded at connect time, and
// /proc/<pid>/cgroup its cgroup now.
func unixPeerCgroup(mount cgroup.Mount, c net.Conn) (uint64, error) {
	if mount.Point == "" {
		return 0, nil
	}
	cr, err := peercred.Of(c)
	if err != nil {
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
	if cgroupID != 0 {
		p.once.Do(func() { p.cgroup = cgroupID })
	}
	if f.id.projects != nil {
		project = f.id.projects.lookup(f.cgroupOf(p))
	}
	return project, f.trusted(p)
}

// CheckIdentity checks cfg's projects root, trusted peers and exempt
// cgroups against the host's cgroup2 mount as New does, without building
// a front: 'run --print-config' refuses what the daemon would.
func CheckIdentity(cfg Config) error {
	if _, err := newIdentity(cfg, clock.System{}); err != nil {
		return fmt.Errorf("peer identity: %w", err)
	}
	return nil
}
