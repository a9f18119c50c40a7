// SPDX-License-Identifier: Apache-2.0

package front

import (
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/clock"
	"github.com/fairshare-dev/fairshare/internal/proxyclaim"
)

// ErrUntrusted means a request named its project in the header from a peer
// the operator did not mark trusted (Config.TrustedPeers), and the front had
// no identity of its own for it, or one that disagrees.
var ErrUntrusted = errors.New("project header not accepted from this peer")

// ErrUnknownPeer means the client is a process of this node whose cgroup
// the front could not learn; it is refused (403) rather than served as a
// peer outside every project.
var ErrUnknownPeer = errors.New("the front cannot tell which cgroup this local client is in")

// who is the front's decision about a request: its project and whether it
// belongs to the exempt class.
type who struct {
	project string
	exempt  bool
}

// resolve names the project of r and decides whether it is exempt. The
// order (see "Naming the project" in the package documentation) puts what
// the kernel knows about the peer above anything the request says:
//
//  1. A trusted peer: a route matching the request's host (and path), then
//     the project header, then its own cgroup's project as below.
//  2. A peer the kernel places in a project (its cgroup is below the
//     projects root): that project. Routes do not apply, and a header
//     naming another project is refused (403).
//  3. Any other peer (remote, or local outside every project): a route,
//     else nothing (400); a project header from it is refused (403).
//
// Exempt by route follows the route: only where the route decided.
//
// An error is answered with status.
func (f *Front) resolve(r *http.Request) (_ who, status int, _ error) {
	return f.resolvePeer(r, peerOf(r))
}

// resolvePeer is resolve for a request from peer p.
func (f *Front) resolvePeer(r *http.Request, p *peer) (_ who, status int, _ error) {
	name := r.Header.Get(f.cfg.ProjectHeader)
	var pl placement
	trusted := f.trusted(p, &pl)
	if trusted {
		rt, err := f.routes.lookup(r.Host, r.URL.Path)
		if err != nil {
			return who{}, http.StatusBadRequest, err
		}
		if rt != nil {
			return who{rt.project, f.exemptRoutes[rt.key] || f.isExempt(rt.project, p)}, 0, nil
		}
		if name != "" {
			if err := ValidateProject(name); err != nil {
				return who{}, http.StatusBadRequest, err
			}
			return who{name, f.isExempt(name, p)}, 0, nil
		}
	}
	cg := f.cgroupOf(p)
	if p.local && p.err != nil {
		// A client of this node whose cgroup the kernel could not give
		// (it closed or reset its connection, or the process that
		// connected is gone and another holds its socket): not a peer
		// outside every project, whom routes would serve.
		return who{}, http.StatusForbidden, fmt.Errorf("%w: %w", ErrUnknownPeer, p.err)
	}
	own, err := pl.of(f, cg)
	if err != nil && p.local {
		return who{}, http.StatusForbidden, fmt.Errorf("%w: %w", ErrUnknownPeer, err)
	}
	if own != "" {
		if name != "" && name != own {
			return who{}, http.StatusForbidden, fmt.Errorf("%w: the peer's cgroup belongs to project %s", ErrUntrusted, own)
		}
		if err := ValidateProject(own); err != nil {
			return who{}, http.StatusForbidden, fmt.Errorf("cgroup project: %w", err)
		}
		return who{own, f.isExempt(own, p)}, 0, nil
	}
	if !trusted {
		rt, err := f.routes.lookup(r.Host, r.URL.Path)
		if err != nil {
			return who{}, http.StatusBadRequest, err
		}
		if rt != nil {
			return who{rt.project, f.exemptRoutes[rt.key] || f.isExempt(rt.project, p)}, 0, nil
		}
		if name != "" {
			return who{}, http.StatusForbidden, fmt.Errorf("%w: only trusted peers may set %s", ErrUntrusted, f.cfg.ProjectHeader)
		}
	}
	return who{}, http.StatusBadRequest, fmt.Errorf("%w: use a routed host, connect from a project's cgroup, or send %s through a trusted peer",
		ErrNoProject, f.cfg.ProjectHeader)
}

// projectOf is the project of cgroup id cg: the daemon's membership when
// it gave one (Deps.ProjectOf), else the index of the projects root's
// children.
func (f *Front) projectOf(cg uint64) (string, error) {
	if f.deps.ProjectOf != nil {
		if cg == 0 {
			return "", nil
		}
		return f.deps.ProjectOf(cg)
	}
	if f.id.projects != nil {
		return f.id.projects.lookup(cg), nil
	}
	return "", nil
}

// placement is a peer's project as one request (or one accepted
// connection's class) found it: trusted and resolvePeer ask once between
// them.
type placement struct {
	looked bool
	own    string
	err    error
}

// of is the project of cgroup cg (projectOf), asked at the first call.
func (pl *placement) of(f *Front, cg uint64) (string, error) {
	if !pl.looked {
		pl.own, pl.err = f.projectOf(cg)
		pl.looked = true
	}
	return pl.own, pl.err
}

// trusted reports whether p may name the project in the header or by a
// route over its own cgroup: by its cgroup (a trusted cgroup), or by its
// address, unless the kernel places it in a project. A process in a
// project's cgroup that connects from a trusted address (loopback, for a
// local edge proxy's sake) is its project's like any other: trusting the
// address would let every process of the node behind it name any project,
// which a trusted cgroup holding a project's is refused for. A local
// client whose cgroup cannot be learned is not trusted by address either.
// (A pod of this node in a network namespace of its own connects from its
// own address, which the front's tables do not hold: it counts as another
// host's peer, trusted or not by its address.)
func (f *Front) trusted(p *peer, pl *placement) bool {
	if f.id.trustedCgs != nil && f.id.trustedCgs.lookup(f.cgroupOf(p)) != "" {
		return true
	}
	if !p.addr.IsValid() || !slices.ContainsFunc(f.id.trustedNets, func(n netip.Prefix) bool { return n.Contains(p.addr) }) {
		return false
	}
	// A peer at an address of another host is trusted without a look at
	// the kernel's tables (an edge proxy's connections cost no lookup, and
	// do not depend on one).
	var reached netip.Addr
	if p.conn != nil {
		if ta, ok := p.conn.LocalAddr().(*net.TCPAddr); ok {
			reached = ta.AddrPort().Addr().Unmap()
		}
	}
	if !isLocalAddr(p.addr, reached) {
		return true
	}
	cg := f.cgroupOf(p)
	if !p.local {
		return true
	}
	own, err := pl.of(f, cg)
	return p.err == nil && err == nil && own == ""
}

// isExempt reports whether a request of project from p is in the exempt
// class (before the exempt budget is checked).
func (f *Front) isExempt(project string, p *peer) bool {
	return f.exemptProjects[project] || (f.id.exemptCgs != nil && f.id.exemptCgs.lookup(f.cgroupOf(p)) != "")
}

// isClaim reports whether request header k is one the front decides and
// the client may not pass upstream under any spelling (case, and '-'
// versus '_', do not count): the project header, and the proxy claims
// (package proxyclaim). The front sets X-Forwarded-For itself, and
// X-Forwarded-Proto for a request over TLS (directUpstream.writeHead,
// Front.rewrite); it sends no X-Forwarded-Host, which would repeat the
// Host line (passed on unchanged), and no X-Forwarded-Proto: http, which
// its own listener would always say: each line the front adds is parsed
// by the upstream on every request, and the two cost a Go upstream 0.6-0.9
// us a request on 2 cores. A framing field spelt with '_' for '-'
// (Transfer_Encoding) is dropped too (proxyclaim.FramingAlias): the front
// frames what it sends, and an upstream that read the alias would frame the
// request by the client's word.
func (f *Front) isClaim(k string) bool {
	return proxyclaim.Is(k) || proxyclaim.FoldEq(k, f.claimProject) || proxyclaim.FramingAlias(k)
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

// membership says that the daemon's membership names projects
// (Deps.ProjectOf), so peers' cgroups are needed without a projects root.
func newIdentity(cfg Config, clk clock.Clock, membership bool) (*identity, error) {
	id := &identity{}
	var cgPaths []string
	for _, e := range cfg.TrustedPeers {
		if pfx, ok := parseNet(e); ok {
			id.trustedNets = append(id.trustedNets, pfx)
			continue
		}
		cgPaths = append(cgPaths, e)
	}
	needMount := membership || cfg.ProjectsRoot != "" || len(cgPaths) > 0 || len(cfg.Exempt.Cgroups) > 0
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
	// outside: ids that missed after a walk that began after they were
	// first asked about: cgroups outside every indexed tree, which need
	// no walk again (a cgroup's id is not reused while the index lives:
	// cgroup2 ids are 64-bit and only grow). At most maxOutside.
	outside map[uint64]struct{}
}

// maxOutside bounds cgroupIndex.outside; past it the set starts again.
const maxOutside = 4096

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
	if _, ok := c.outside[id]; ok {
		return ""
	}
	// A cgroup not seen before: created since the last walk (a new
	// sub-cgroup of a project), or outside every tree. Walk now rather
	// than answer "outside" from a stale index; each cgroup outside costs
	// one walk, not one per connection.
	c.buildLocked(c.clk.Now())
	if name, ok := c.ids[id]; ok {
		return name
	}
	if len(c.outside) >= maxOutside || c.outside == nil {
		c.outside = make(map[uint64]struct{})
	}
	c.outside[id] = struct{}{}
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
