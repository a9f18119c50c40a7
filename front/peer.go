// SPDX-License-Identifier: Apache-2.0

package front

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/clock"
	"github.com/fairshare-dev/fairshare/internal/peercred"
	"github.com/fairshare-dev/fairshare/sockdiag"
)

// ErrUntrusted means a request named its project in the header from a peer
// the operator did not mark trusted (Config.TrustedPeers), and the front had
// no identity of its own for it, or one that disagrees.
var ErrUntrusted = errors.New("project header not accepted from this peer")

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
	}
	// The daemon's listeners wrap their connections (internal/listen); the
	// socket the peer lookups need is behind NetConn.
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
			p.cgroup, p.err = f.id.unixPeerCgroup(c)
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

// identity holds the operator's trust and exempt sets and the cgroup indexes
// that turn a peer's cgroup id into a project, a trusted cgroup or an exempt
// one.
type identity struct {
	mount        cgroup.Mount // Point "" when none (no cgroup identity)
	projects     *cgroupIndex
	trustedNets  []netip.Prefix
	trustedCgs   *cgroupIndex
	exemptCgs    *cgroupIndex
	needsCgroups bool // some rule depends on a peer's cgroup
}

func newIdentity(cfg Config, clk clock.Clock) (*identity, error) {
	id := &identity{}
	var cgPaths []string
	for _, e := range cfg.TrustedPeers {
		if pfx, ok := parseNet(e); ok {
			id.trustedNets = append(id.trustedNets, pfx)
			continue
		}
		cgPaths = append(cgPaths, e)
	}
	needMount := cfg.ProjectsRoot != "" || len(cgPaths) > 0 || len(cfg.Exempt.Cgroups) > 0
	if !needMount {
		return id, nil
	}
	mount, err := cgroup.FindMount()
	if err != nil {
		return nil, err
	}
	id.mount = mount
	id.needsCgroups = true
	abs := func(key, p string) (string, error) {
		if !filepath.IsAbs(p) {
			if cfg.ProjectsRoot == "" {
				return "", fmt.Errorf("%s %q: a relative cgroup needs a projects root", key, p)
			}
			p = filepath.Join(cfg.ProjectsRoot, p)
		}
		p = filepath.Clean(p)
		if !mount.Contains(p) {
			return "", fmt.Errorf("%s %q: not below the cgroup2 mount %s", key, p, mount.Point)
		}
		return p, nil
	}
	if cfg.ProjectsRoot != "" {
		root, err := abs("projects root", cfg.ProjectsRoot)
		if err != nil {
			return nil, err
		}
		id.projects = newCgroupIndex([]string{root}, true, clk)
	}
	var dirs []string
	for _, p := range cgPaths {
		d, err := abs("trusted peer", p)
		if err != nil {
			return nil, err
		}
		dirs = append(dirs, d)
	}
	if len(dirs) > 0 {
		id.trustedCgs = newCgroupIndex(dirs, false, clk)
	}
	dirs = nil
	for _, p := range cfg.Exempt.Cgroups {
		d, err := abs("exempt cgroup", p)
		if err != nil {
			return nil, err
		}
		dirs = append(dirs, d)
	}
	if len(dirs) > 0 {
		id.exemptCgs = newCgroupIndex(dirs, false, clk)
	}
	return id, nil
}

// parseNet reads a trusted-peer entry as a CIDR or a single address.
func parseNet(s string) (netip.Prefix, bool) {
	if pfx, err := netip.ParsePrefix(s); err == nil {
		return pfx.Masked(), true
	}
	if a, err := netip.ParseAddr(s); err == nil {
		a = a.Unmap()
		return netip.PrefixFrom(a, a.BitLen()), true
	}
	return netip.Prefix{}, false
}

// unixPeerCgroup reads the cgroup of the process at the other end of a unix
// socket: SO_PEERCRED gives the pid the kernel recorded at connect time, and
// /proc/<pid>/cgroup its cgroup now.
func (id *identity) unixPeerCgroup(c net.Conn) (uint64, error) {
	if id.mount.Point == "" {
		return 0, nil
	}
	cr, err := peercred.Of(c)
	if err != nil {
		return 0, err
	}
	dir, err := id.mount.OfPID(int(cr.PID))
	if err != nil {
		return 0, err
	}
	cg, err := cgroup.ID(dir)
	if err != nil {
		return 0, fmt.Errorf("cgroup of pid %d: %w", cr.PID, err)
	}
	return cg, nil
}

// minIndexRefresh bounds how often a miss rebuilds a cgroup index: peers in
// cgroups outside every indexed tree miss every time, and must not turn
// every connection into a walk of the tree.
const minIndexRefresh = 100 * time.Millisecond

// cgroupIndex maps the ids of the cgroups in and below some directories to a
// name: with byProject, the project (cgroup.ProjectIndex); otherwise the
// directory itself. It is rebuilt on
// a miss, so a cgroup created after the last walk is found at its first
// connection.
type cgroupIndex struct {
	dirs      []string
	byProject bool
	clk       clock.Clock

	mu    sync.Mutex // guards the fields below
	ids   map[uint64]string
	built time.Time
	err   error
}

func newCgroupIndex(dirs []string, byProject bool, clk clock.Clock) *cgroupIndex {
	return &cgroupIndex{dirs: dirs, byProject: byProject, clk: clk}
}

// lookup returns the name of cgroup id, or "" when it is in none of the
// directories.
func (c *cgroupIndex) lookup(id uint64) string {
	if c == nil || id == 0 {
		return ""
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if name, ok := c.ids[id]; ok {
		return name
	}
	if now := c.clk.Now(); c.ids == nil || now.Sub(c.built) >= minIndexRefresh {
		c.buildLocked(now)
		return c.ids[id]
	}
	return ""
}

func (c *cgroupIndex) buildLocked(now time.Time) {
	ids := make(map[uint64]string)
	var firstErr error
	for _, d := range c.dirs {
		var err error
		if c.byProject {
			var m map[uint64]string
			m, err = cgroup.ProjectIndex(d)
			maps.Copy(ids, m)
		} else {
			err = cgroup.Walk(d, func(_ string, id uint64) { ids[id] = d })
		}
		if err != nil && firstErr == nil {
			firstErr = err
		}
	}
	c.ids, c.built, c.err = ids, now, firstErr
}

// clientListener hands out its connections as clientConns.
type clientListener struct{ net.Listener }

func (l clientListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &clientConn{Conn: c}, nil
}

// clientConn is a client connection of Front.Serve that tells the upstream
// exchange in flight when the client goes away. While an HTTP/1 handler
// runs, net/http reads the connection in the background, and a read that
// fails other than by a deadline is the client gone (or the connection
// closed): that is when net/http cancels the request's context. Hearing it
// here instead of through context.AfterFunc on that context spares each
// request an allocated context, map and channel and two locks on the
// request's context: five allocations and a fortieth of the front's CPU.
type clientConn struct {
	net.Conn

	mu   sync.Mutex // guards the fields below
	gone bool       // a read failed: the client will not read an answer
	up   net.Conn   // the upstream connection being watched for, or nil
	shot bool       // the watch fired: up was aborted
}

func (c *clientConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
		c.mu.Lock()
		c.gone = true
		up := c.up
		if up != nil {
			c.up, c.shot = nil, true
		}
		c.mu.Unlock()
		if up != nil {
			abortUpstream(up)
		}
	}
	return n, err
}

// CloseWrite half-closes a TCP connection, as net/http does before closing
// one (its type assertion would not see through the embedding).
func (c *clientConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// watch aborts up when the client goes away, at once if it already has.
func (c *clientConn) watch(up net.Conn) {
	c.mu.Lock()
	gone := c.gone
	if gone {
		c.shot = true
	} else {
		c.up, c.shot = up, false
	}
	c.mu.Unlock()
	if gone {
		abortUpstream(up)
	}
}

// isGone reports whether a read of the connection failed.
func (c *clientConn) isGone() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.gone
}

// unwatch ends the watch and reports whether it had not fired.
func (c *clientConn) unwatch() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.up = nil
	return !c.shot
}
