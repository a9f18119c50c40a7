// SPDX-License-Identifier: Apache-2.0

package front

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"sort"
	"strings"

	"github.com/fairshare-dev/fairshare/internal/project"
)

// MaxProjectLen bounds a project name (project.MaxLen): the name appears in
// headers and metric labels too.
const MaxProjectLen = project.MaxLen

var (
	// ErrNoProject means the request named no project: no route matched its
	// host and it carried no project header.
	ErrNoProject = errors.New("no project")
	// ErrBadProject means the name given is not a valid project name.
	ErrBadProject = project.ErrInvalid
)

// ValidateProject reports whether name can be a project, by the one rule of
// package internal/project that the policy store, the permit API and the
// configuration apply too.
func ValidateProject(name string) error { return project.Validate(name) }

// route maps one path prefix on a host to a project; prefix "" is the bare
// host.
type route struct {
	prefix  string
	project string
	key     string // as the operator wrote it, for Config.Exempt.Routes
}

// routeTable holds the operator's Host (or host/path-prefix) -> project map,
// indexed by lower-case host with each host's routes longest prefix first.
type routeTable map[string][]route

func newRouteTable(m map[string]string) (routeTable, error) {
	t := routeTable{}
	for key, project := range m {
		if err := ValidateProject(project); err != nil {
			return nil, fmt.Errorf("route %q: %w", key, err)
		}
		host, prefix, _ := strings.Cut(key, "/")
		host = strings.ToLower(host)
		if host == "" {
			return nil, fmt.Errorf("route %q: empty host", key)
		}
		if prefix != "" || strings.HasSuffix(key, "/") {
			prefix = "/" + strings.TrimSuffix(prefix, "/")
			if prefix == "/" {
				prefix = ""
			}
		}
		t[host] = append(t[host], route{prefix: prefix, project: project, key: key})
	}
	for _, rs := range t {
		sort.Slice(rs, func(i, j int) bool { return len(rs[i].prefix) > len(rs[j].prefix) })
	}
	return t, nil
}

// lookup returns the route for host and path, or nil.
func (t routeTable) lookup(host, path string) *route {
	if len(t) == 0 {
		return nil
	}
	host = strings.ToLower(host)
	if r := t.match(host, path); r != nil {
		return r
	}
	if h, _, err := net.SplitHostPort(host); err == nil {
		return t.match(h, path)
	}
	return nil
}

func (t routeTable) match(host, path string) *route {
	rs := t[host]
	for i := range rs {
		r := &rs[i]
		if r.prefix == "" || path == r.prefix || strings.HasPrefix(path, r.prefix+"/") {
			return r
		}
	}
	return nil
}

// who is the front's decision about a request: its project and whether it
// belongs to the exempt class.
type who struct {
	project string
	exempt  bool
}

// resolve names the project of r and decides whether it is exempt (see the
// package documentation for the order). An error is answered with status.
func (f *Front) resolve(r *http.Request) (_ who, status int, _ error) {
	p := peerOf(r)
	if rt := f.routes.lookup(r.Host, r.URL.Path); rt != nil {
		return who{rt.project, f.exemptRoutes[rt.key] || f.isExempt(rt.project, p)}, 0, nil
	}
	name := r.Header.Get(f.cfg.ProjectHeader)
	if name != "" && f.trusted(p) {
		if err := ValidateProject(name); err != nil {
			return who{}, http.StatusBadRequest, err
		}
		return who{name, f.isExempt(name, p)}, 0, nil
	}
	var own string
	if f.id.projects != nil {
		own = f.id.projects.lookup(f.cgroupOf(p))
	}
	switch {
	case own != "" && (name == "" || name == own):
		if err := ValidateProject(own); err != nil {
			return who{}, http.StatusForbidden, fmt.Errorf("cgroup project: %w", err)
		}
		return who{own, f.isExempt(own, p)}, 0, nil
	case own != "":
		return who{}, http.StatusForbidden, fmt.Errorf("%w: the peer's cgroup belongs to project %s", ErrUntrusted, own)
	case name != "":
		return who{}, http.StatusForbidden, fmt.Errorf("%w: only trusted peers may set %s", ErrUntrusted, f.cfg.ProjectHeader)
	}
	return who{}, http.StatusBadRequest, fmt.Errorf("%w: use a routed host, connect from a project's cgroup, or send %s through a trusted peer",
		ErrNoProject, f.cfg.ProjectHeader)
}

// trusted reports whether p may name the project in the header.
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
