// SPDX-License-Identifier: Apache-2.0

package membership

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/project"
)

// Names of the sources, as configuration and status spell them
// (registered is the daemon's Static source of stored registrations).
const (
	SourceDirectory  = "directory"
	SourceSystemd    = "systemd"
	SourceRegistered = "registered"
	// SourceKubernetes is the pods of a node's container runtime (package
	// kube): each pod's cgroup in the project of its namespace or label.
	SourceKubernetes = "kubernetes"
)

// Children is a source whose members are the child cgroups of one root,
// each named by a rule: the directory source (every child is the project
// of its name) and the systemd source (every fairshare-<name>.slice). It
// watches the root with inotify, so a child made or removed is reported at
// once (Changed), and each Scan reads the root again, so nothing a lost
// event missed stays missed past one tick.
type Children struct {
	name string
	root string
	rule func(child string) (project, skip string)
	w    *watcher
}

// NewDirectory returns the directory source: every child directory of root
// is a project of its own name, and everything below it is in it. With
// create, a missing root is made (the daemon's own root,
// <cgroup2>/fairshare). root must be on cgroup2.
func NewDirectory(root string, create bool) (*Children, error) {
	if create {
		if err := os.MkdirAll(root, 0o755); err != nil {
			return nil, fmt.Errorf("creating the projects root: %w", err)
		}
	}
	return newChildren(SourceDirectory, root, func(child string) (string, string) { return child, "" })
}

// NewSystemd returns the systemd source for root, a slice's cgroup
// (<cgroup2>/fairshare.slice): its children named fairshare-<name>.slice
// are the projects, <name> unescaped (\x2d is a dash, see SliceName).
// Anything else directly in the slice (a service or scope whose unit says
// Slice=fairshare.slice) belongs to no project, and Scan says so in
// Found.Skipped. systemd creates the slice when a unit first uses it, so a
// missing root is not an error: it has no members yet.
func NewSystemd(root string) (*Children, error) {
	unit, err := SliceRoot(root)
	if err != nil {
		return nil, err
	}
	prefix := strings.TrimSuffix(unit, ".slice") + "-"
	return newChildren(SourceSystemd, root, func(child string) (string, string) {
		return sliceProject(unit, prefix, child)
	})
}

// SliceRoot checks that root can be the systemd source's root, a slice's
// cgroup, and returns the slice's unit name (fairshare.slice).
func SliceRoot(root string) (string, error) {
	unit := filepath.Base(root)
	base, ok := strings.CutSuffix(unit, ".slice")
	if !ok || base == "" || base == "-" {
		return "", fmt.Errorf("the systemd source needs projects_root at a slice's cgroup such as <cgroup2>/fairshare.slice, got %s", root)
	}
	return unit, nil
}

func newChildren(name, root string, rule func(string) (string, string)) (*Children, error) {
	if err := ValidCgroup(root); err != nil {
		return nil, fmt.Errorf("projects root: %w", err)
	}
	if err := cgroup.OnCgroup2(root); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("projects root: %w", err)
	}
	c := &Children{name: name, root: root, rule: rule, w: newWatcher(root)}
	_ = c.w.ensure() // a missing root is watched once it exists (Scan)
	return c, nil
}

// Name implements Source.
func (c *Children) Name() string { return c.name }

// Root is the directory whose children are the projects.
func (c *Children) Root() string { return c.root }

// Changed implements Notifier.
func (c *Children) Changed() <-chan struct{} { return c.w.changed }

// Close stops the inotify watch.
func (c *Children) Close() error { return c.w.close() }

// Scan implements Source: one read of the root.
func (c *Children) Scan(context.Context) (Found, error) {
	// Watch first, then read: a child made in between is in the read or
	// reported by the watch.
	werr := c.w.ensure()
	ents, err := os.ReadDir(c.root)
	if errors.Is(err, fs.ErrNotExist) {
		return Found{Skipped: []Skipped{{Cgroup: c.root, Reason: "the projects root does not exist (yet)"}}}, nil
	}
	if err != nil {
		return Found{}, fmt.Errorf("reading the projects root: %w", err)
	}
	if werr != nil {
		return Found{}, werr
	}
	var f Found
	for _, e := range ents {
		if !e.IsDir() {
			continue
		}
		path := filepath.Join(c.root, e.Name())
		p, skip := c.rule(e.Name())
		if skip != "" {
			f.Skipped = append(f.Skipped, Skipped{Cgroup: path, Reason: skip})
			continue
		}
		f.Members = append(f.Members, Member{Project: p, Cgroup: path})
	}
	return f, nil
}

// sliceProject names the project of child, a cgroup directly in the slice
// unit whose children are named prefix<name>.slice, or says why it has none.
func sliceProject(unit, prefix, child string) (name, skip string) {
	mid, ok := strings.CutSuffix(child, ".slice")
	if !ok {
		return "", fmt.Sprintf("a unit directly in %s is in no project: give it Slice=%s<name>.slice", unit, prefix)
	}
	mid, ok = strings.CutPrefix(mid, prefix)
	if !ok || mid == "" {
		return "", fmt.Sprintf("a slice in %s is a project only when named %s<name>.slice", unit, prefix)
	}
	if strings.Contains(mid, "-") {
		// systemd itself puts a-b.slice inside a.slice; this one was made
		// by hand.
		return "", fmt.Sprintf("a dash nests in systemd, so this slice belongs inside %s%s.slice; "+
			"a project name with a dash is written \\x2d (systemd-escape)", prefix, project.Display(mid[:strings.IndexByte(mid, '-')]))
	}
	name, err := Unescape(mid)
	if err != nil {
		return "", err.Error()
	}
	return name, ""
}

// Unescape undoes systemd's unit-name escapes: \xHH is the byte HH (\x2d a
// literal dash, which unescaped would nest the slice).
func Unescape(s string) (string, error) {
	if !strings.Contains(s, `\`) {
		return s, nil
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '\\' {
			b.WriteByte(s[i])
			continue
		}
		if i+4 > len(s) || s[i+1] != 'x' {
			return "", fmt.Errorf("%q: a backslash in a unit name starts an escape \\xHH", s)
		}
		n, err := strconv.ParseUint(s[i+2:i+4], 16, 8)
		if err != nil {
			return "", fmt.Errorf("%q: %q is not an escape \\xHH", s, s[i:i+4])
		}
		b.WriteByte(byte(n))
		i += 3
	}
	return b.String(), nil
}

// SliceName is the slice unit of project under the slice unit parent
// ("fairshare.slice"): fairshare-<name>.slice, a dash in the name written
// \x2d as systemd-escape writes it (unescaped it would nest the slice).
// Valid project names need no other escape.
func SliceName(parent, project string) string {
	base := strings.TrimSuffix(parent, ".slice")
	return base + "-" + strings.ReplaceAll(project, "-", `\x2d`) + ".slice"
}
