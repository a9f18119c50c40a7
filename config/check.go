// SPDX-License-Identifier: Apache-2.0

package config

import (
	"fmt"
	"net/netip"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/fairshare-dev/fairshare/internal/project"
)

// Listeners bounds the connections the daemon's listeners hold (package
// internal/listen): each of the front's TCP listener, the front's unix
// socket and the permit socket holds at most MaxConns, and one peer (a
// local user, a project on the front, a remote address) at most
// MaxConnsPerPeer of each. 0 derives the numbers from the open-files limit
// and a memory budget (see the daemon package). SubUID is the file of
// subordinate uid ranges folded onto their owners when counting peers;
// "" is /etc/subuid.
type Listeners struct {
	MaxConns        int    `yaml:"max_conns"`
	MaxConnsPerPeer int    `yaml:"max_conns_per_peer"`
	SubUID          string `yaml:"subuid"`
}

// checkValues checks what Validate's older checks let through: names,
// addresses and paths in lists, and signs, each error naming its key.
func (c *Config) checkValues() error {
	if c.Listeners.MaxConns < 0 {
		return fmt.Errorf("listeners.max_conns must be 0 (derived from the open-files limit) or more, got %d", c.Listeners.MaxConns)
	}
	if c.Listeners.MaxConnsPerPeer < 0 {
		return fmt.Errorf("listeners.max_conns_per_peer must be 0 (a 64th of max_conns, at least 4) or more, got %d", c.Listeners.MaxConnsPerPeer)
	}
	if f := c.Listeners.SubUID; f != "" && !filepath.IsAbs(f) {
		return fmt.Errorf("listeners.subuid must be an absolute path or empty (/etc/subuid), got %q", f)
	}
	for _, v := range []struct {
		key string
		n   int
	}{{"max_waiting", c.Permits.MaxWaiting}, {"max_waiting_per_uid", c.Permits.MaxWaitingPerUID},
		{"max_waiting_per_session", c.Permits.MaxWaitingPerSession}} {
		if v.n < 0 {
			return fmt.Errorf("permits.%s must be 0 (the default) or more, got %d", v.key, v.n)
		}
	}
	if g := c.Permits.Group; g != "" {
		if strings.ContainsFunc(g, func(r rune) bool { return r <= ' ' || r == ':' || r == 0x7f }) {
			return fmt.Errorf("permits.group must be a group name or a numeric gid, got %q", g)
		}
		if n, err := strconv.Atoi(g); err == nil && n < 0 {
			return fmt.Errorf("permits.group: a gid is not negative, got %d", n)
		}
	}
	for i, e := range c.Connections.Exempt {
		if err := checkCgroup(e, true); err != nil {
			return fmt.Errorf("connections.exempt[%d]: %v", i, err)
		}
	}
	return c.Front.checkValues()
}

func (f *Front) checkValues() error {
	// Checked with the front off too (see validate). Signs first, so that
	// a negative max_in_flight is reported as itself and not through the
	// exempt_max bound that depends on it.
	if f.MaxInFlight < 1 {
		return fmt.Errorf("front.max_in_flight must be >= 1, got %d", f.MaxInFlight)
	}
	if f.ExemptMax < 0 {
		return fmt.Errorf("front.exempt_max must be 0 (the front's default, 4) or more, got %d", f.ExemptMax)
	}
	for key, p := range f.Routes {
		host, _, _ := strings.Cut(key, "/")
		if strings.TrimSpace(host) == "" || strings.ContainsAny(key, " \t\r\n") {
			return fmt.Errorf("front.routes: key %q must be a host or host/path-prefix", key)
		}
		if err := project.Validate(p); err != nil {
			return fmt.Errorf("front.routes[%q]: %v", key, err)
		}
	}
	for i, p := range f.Exempt.Projects {
		if err := project.Validate(p); err != nil {
			return fmt.Errorf("front.exempt.projects[%d]: %v", i, err)
		}
	}
	for i, e := range f.Exempt.Cgroups {
		if err := checkCgroup(e, true); err != nil {
			return fmt.Errorf("front.exempt.cgroups[%d]: %v", i, err)
		}
	}
	for i, e := range f.TrustedPeers {
		if err := checkPeer(e); err != nil {
			return fmt.Errorf("front.trusted_peers[%d]: %v", i, err)
		}
	}
	return nil
}

// checkPeer accepts a CIDR, an address, an absolute cgroup path, or a
// cgroup nested in a project ("<project>/<cgroup>", relative to
// projects_root). Anything that looks like an address must parse as one: a
// mistyped CIDR was taken as a cgroup path before. A bare word is refused:
// it could mean a host (names are not resolved) or a whole project (whose
// every process could then name any project), and neither is what a trusted
// edge is.
func checkPeer(e string) error {
	if strings.TrimSpace(e) == "" {
		return fmt.Errorf("empty entry")
	}
	if looksLikeAddress(e) {
		if strings.Contains(e, "/") {
			if _, err := netip.ParsePrefix(e); err != nil {
				return fmt.Errorf("%q is not a valid CIDR: %v", e, err)
			}
			return nil
		}
		if _, err := netip.ParseAddr(e); err != nil {
			return fmt.Errorf("%q is not a valid address: %v", e, err)
		}
		return nil
	}
	if !filepath.IsAbs(e) && !strings.Contains(e, "/") {
		return fmt.Errorf("%q is neither a CIDR, an address nor a cgroup path; a bare name could mean a host "+
			"(names are not resolved) or a whole project (every process of which could then name any project): "+
			"write a cgroup as an absolute path, or as <project>/<cgroup> below projects_root", e)
	}
	return checkCgroup(e, false)
}

// looksLikeAddress reports whether e is made of what IP addresses and CIDRs
// are made of, with at least one '.' or ':'.
func looksLikeAddress(e string) bool {
	sep := false
	for _, r := range e {
		switch {
		case r == '.' || r == ':':
			sep = true
		case r >= '0' && r <= '9', r >= 'a' && r <= 'f', r >= 'A' && r <= 'F', r == '/', r == '%':
		default:
			return false
		}
	}
	return sep && (e[0] == ':' || e[0] >= '0' && e[0] <= '9' || strings.Contains(e, ":"))
}

// checkCgroup accepts an absolute clean path, or a clean path relative to
// projects_root whose first element is a project name (a bare project when
// bare is true).
func checkCgroup(e string, bare bool) error {
	if strings.TrimSpace(e) == "" {
		return fmt.Errorf("empty entry")
	}
	if strings.ContainsAny(e, "\x00\n") || filepath.Clean(e) != strings.TrimSuffix(e, "/") && e != "/" {
		return fmt.Errorf("%q is not a clean cgroup path (no '.', '..', '//' or control characters)", e)
	}
	if filepath.IsAbs(e) {
		return nil
	}
	first, _, nested := strings.Cut(e, "/")
	if first == ".." || strings.HasPrefix(e, "../") {
		return fmt.Errorf("%q leaves projects_root", e)
	}
	if err := project.Validate(first); err != nil {
		return fmt.Errorf("%q: a relative cgroup starts with its project: %v", e, err)
	}
	if !nested && !bare {
		return fmt.Errorf("%q names a whole project", e)
	}
	return nil
}
