// SPDX-License-Identifier: Apache-2.0

package front

import (
	"fmt"
	"net/http"
	"strings"
)

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
	p := peerOf(r)
	name := r.Header.Get(f.cfg.ProjectHeader)
	trusted := f.trusted(p)
	if trusted {
		if rt := f.routes.lookup(r.Host, r.URL.Path); rt != nil {
			return who{rt.project, f.exemptRoutes[rt.key] || f.isExempt(rt.project, p)}, 0, nil
		}
		if name != "" {
			if err := ValidateProject(name); err != nil {
				return who{}, http.StatusBadRequest, err
			}
			return who{name, f.isExempt(name, p)}, 0, nil
		}
	}
	var own string
	if f.id.projects != nil {
		own = f.id.projects.lookup(f.cgroupOf(p))
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
		if rt := f.routes.lookup(r.Host, r.URL.Path); rt != nil {
			return who{rt.project, f.exemptRoutes[rt.key] || f.isExempt(rt.project, p)}, 0, nil
		}
		if name != "" {
			return who{}, http.StatusForbidden, fmt.Errorf("%w: only trusted peers may set %s", ErrUntrusted, f.cfg.ProjectHeader)
		}
	}
	return who{}, http.StatusBadRequest, fmt.Errorf("%w: use a routed host, connect from a project's cgroup, or send %s through a trusted peer",
		ErrNoProject, f.cfg.ProjectHeader)
}

// trusted reports whether p may name the project in the header or by a
// route over its own cgroup.
func (f *Front) trusted(p *peer) bool {
	if p.addr.IsValid() {
		for _, n := range f.id.trustedNets {
			if n.Contains(p.addr) {
				return true
			}
		}
	}
	return f.id.trustedCgs != nil && f.id.trustedCgs.lookup(f.cgroupOf(p)) != ""
}

// isExempt reports whether a request of project from p is in the exempt
// class (before the exempt budget is checked).
func (f *Front) isExempt(project string, p *peer) bool {
	return f.exemptProjects[project] || (f.id.exemptCgs != nil && f.id.exemptCgs.lookup(f.cgroupOf(p)) != "")
}

// claimKey folds a request header name the way the many upstreams that read
// headers through CGI-style variables do (case and '-' versus '_' do not
// count), so that "fairshare_project" is recognised as a claim to the
// project header.
func claimKey(k string) string {
	return strings.ReplaceAll(strings.ToLower(k), "_", "-")
}

// isClaim reports whether request header k is one the front decides and
// the client may not pass upstream under any spelling: the project header,
// Forwarded and X-Forwarded-{For,Host,Proto}.
func (f *Front) isClaim(k string) bool {
	if !strings.Contains(k, "_") {
		return false // canonical spellings are handled by name
	}
	c := claimKey(k)
	if c == f.claimProject {
		return true
	}
	for _, fw := range forwarded {
		if c == claimKey(fw) {
			return true
		}
	}
	return false
}
