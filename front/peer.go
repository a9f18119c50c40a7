// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/fairshare-dev/fairshare/internal/clock"
	"github.com/fairshare-dev/fairshare/internal/peercred"
	"github.com/fairshare-dev/fairshare/sockdiag"
	"golang.org/x/sys/unix"
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
	mount        string // cgroup2 mount point; "" when none (no cgroup identity)
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
	mount, err := cgroup2Mount()
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
		if p != mount && !strings.HasPrefix(p, mount+"/") {
			return "", fmt.Errorf("%s %q: not below the cgroup2 mount %s", key, p, mount)
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
// /proc/<pid>/cgroup its cgroup2 path now.
func (id *identity) unixPeerCgroup(c *net.UnixConn) (uint64, error) {
	if id.mount == "" {
		return 0, nil
	}
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, fmt.Errorf("raw conn: %w", err)
	}
	var uc *unix.Ucred
	var serr error
	if err := rc.Control(func(fd uintptr) {
		uc, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return 0, fmt.Errorf("raw conn control: %w", err)
	}
	if serr != nil {
		return 0, fmt.Errorf("reading SO_PEERCRED: %w", serr)
	}
	rel, err := procCgroup(int(uc.Pid))
	if err != nil {
		return 0, err
	}
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(id.mount, rel), &st); err != nil {
		return 0, fmt.Errorf("stat cgroup of pid %d: %w", uc.Pid, err)
	}
	return st.Ino, nil
}

// procCgroup returns the cgroup2 path of pid ("0::/path" in /proc/pid/cgroup).
func procCgroup(pid int) (string, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if err != nil {
		return "", fmt.Errorf("reading cgroup of pid %d: %w", pid, err)
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "0::"); ok {
			return rest, nil
		}
	}
	return "", fmt.Errorf("pid %d: no cgroup2 line in /proc/%d/cgroup", pid, pid)
}

// cgroup2Mount finds the cgroup2 mount point in /proc/self/mountinfo.
func cgroup2Mount() (string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", fmt.Errorf("reading mounts: %w", err)
	}
	defer f.Close()
	return parseCgroup2Mount(f)
}

func parseCgroup2Mount(r io.Reader) (string, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		if !ok {
			continue
		}
		if f := strings.Fields(post); len(f) > 0 && f[0] == "cgroup2" {
			if pf := strings.Fields(pre); len(pf) >= 5 {
				return pf[4], nil
			}
		}
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("reading mounts: %w", err)
	}
	return "", errors.New("no cgroup2 mount")
}

// minIndexRefresh bounds how often a miss rebuilds a cgroup index: peers in
// cgroups outside every indexed tree miss every time, and must not turn
// every connection into a walk of the tree.
const minIndexRefresh = 100 * time.Millisecond

// cgroupIndex maps the ids of the cgroups in and below some directories to a
// name: with byProject, the first path element below the (single) root, as
// sockdiag.CgroupIndex does; otherwise the directory itself. It is rebuilt on
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
		if c.byProject {
			m, err := sockdiag.CgroupIndex(d)
			if err != nil && firstErr == nil {
				firstErr = err
			}
			for k, v := range m {
				ids[k] = v
			}
			continue
		}
		err := filepath.WalkDir(d, func(path string, e fs.DirEntry, err error) error {
			if err != nil {
				if errors.Is(err, fs.ErrNotExist) {
					return fs.SkipDir
				}
				return err
			}
			if !e.IsDir() {
				return nil
			}
			var st unix.Stat_t
			if err := unix.Lstat(path, &st); err != nil {
				return fs.SkipDir
			}
			ids[st.Ino] = d
			return nil
		})
		if err != nil && firstErr == nil {
			firstErr = fmt.Errorf("indexing cgroups below %s: %w", d, err)
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
