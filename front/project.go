// SPDX-License-Identifier: Apache-2.0

package front

import (
	"errors"
	"fmt"
	"net"
	"slices"
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

// ErrDotSegments refuses a request that a route would place by a path with
// a "." or ".." segment (decoded: %2e counts; a segment's ";" parameters
// and a backslash as a separator count too, as some servers read them): an
// upstream that resolves them (nginx does) would serve another route's
// path than the one that placed the request, charged to the wrong project
// or exempt.
var ErrDotSegments = errors.New(`a path with "." or ".." segments cannot be placed by a route`)

// lookup returns the route for host and path (decoded), or nil. Runs of
// slashes count as one, as an upstream that merges them (nginx does) reads
// the path. A path with a dot segment is refused (ErrDotSegments) where the
// host has routes by path, whose choice it could lead astray; a host routed
// whole (or not at all) is placed as the path does not matter.
func (t routeTable) lookup(host, path string) (*route, error) {
	if len(t) == 0 {
		return nil, nil
	}
	host = strings.ToLower(host)
	var buf [2]string
	keys := append(buf[:0], host)
	if h, _, err := net.SplitHostPort(host); err == nil {
		keys = append(keys, h)
	}
	path, ok := routePath(path)
	if !ok {
		for _, k := range keys {
			if slices.ContainsFunc(t[k], func(r route) bool { return r.prefix != "" }) {
				return nil, ErrDotSegments
			}
		}
	}
	for _, k := range keys {
		if r := t.match(k, path); r != nil {
			return r, nil
		}
	}
	return nil, nil
}

// routePath is path with runs of slashes merged, and false if a segment
// is "." or ".." (after a ";" cut off, and with a backslash as a separator
// too).
func routePath(path string) (string, bool) {
	merged := path
	if strings.Contains(path, "//") {
		var b strings.Builder
		b.Grow(len(path))
		for i := 0; i < len(path); i++ {
			if path[i] == '/' && i > 0 && path[i-1] == '/' {
				continue
			}
			b.WriteByte(path[i])
		}
		merged = b.String()
	}
	if !strings.Contains(merged, ".") {
		return merged, true
	}
	for seg := range strings.FieldsFuncSeq(merged, func(r rune) bool { return r == '/' || r == '\\' }) {
		seg, _, _ = strings.Cut(seg, ";")
		if seg == "." || seg == ".." {
			return merged, false
		}
	}
	return merged, true
}

func (t routeTable) match(host, path string) *route {
	rs := t[host]
	for i := range rs {
		r := &rs[i]
		if r.prefix == "" || strings.HasPrefix(path, r.prefix) && (len(path) == len(r.prefix) || path[len(r.prefix)] == '/') {
			return r
		}
	}
	return nil
}
