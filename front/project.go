// SPDX-License-Identifier: Apache-2.0

package front

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"sort"
	"strings"
)

// MaxProjectLen bounds a project name; cgroup directory names are far longer
// in principle, but a name that appears in headers and metric labels must stay
// short.
const MaxProjectLen = 64

var (
	// ErrNoProject means the request named no project: no route matched its
	// host and it carried no project header.
	ErrNoProject = errors.New("no project")
	// ErrBadProject means the name given is not a valid project name.
	ErrBadProject = errors.New("invalid project name")
)

// ValidateProject reports whether name can be a project: 1 to MaxProjectLen
// characters from [A-Za-z0-9._-], starting with a letter or digit. The set is
// what a cgroup directory, a header value and a metric label all accept
// without escaping.
func ValidateProject(name string) error {
	if name == "" || len(name) > MaxProjectLen {
		return fmt.Errorf("%w: length %d not in 1..%d", ErrBadProject, len(name), MaxProjectLen)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		alnum := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
		if !alnum && (i == 0 || c != '.' && c != '_' && c != '-') {
			return fmt.Errorf("%w: character %q at %d", ErrBadProject, c, i)
		}
	}
	return nil
}

// route maps one path prefix on a host to a project; prefix "" is the bare
// host.
type route struct {
	prefix  string
	project string
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
		t[host] = append(t[host], route{prefix: prefix, project: project})
	}
	for _, rs := range t {
		sort.Slice(rs, func(i, j int) bool { return len(rs[i].prefix) > len(rs[j].prefix) })
	}
	return t, nil
}

// lookup returns the project routed for host and path, or "".
func (t routeTable) lookup(host, path string) string {
	if len(t) == 0 {
		return ""
	}
	host = strings.ToLower(host)
	if p := t.match(host, path); p != "" {
		return p
	}
	if h, _, err := net.SplitHostPort(host); err == nil {
		return t.match(h, path)
	}
	return ""
}

func (t routeTable) match(host, path string) string {
	for _, r := range t[host] {
		if r.prefix == "" || path == r.prefix || strings.HasPrefix(path, r.prefix+"/") {
			return r.project
		}
	}
	return ""
}

// resolve names the project of r (see the package documentation for the
// order).
func (f *Front) resolve(r *http.Request) (string, error) {
	if p := f.routes.lookup(r.Host, r.URL.Path); p != "" {
		return p, nil
	}
	name := r.Header.Get(f.cfg.ProjectHeader)
	if name == "" {
		return "", fmt.Errorf("%w: set the %s header or use a routed host", ErrNoProject, f.cfg.ProjectHeader)
	}
	if err := ValidateProject(name); err != nil {
		return "", err
	}
	return name, nil
}
