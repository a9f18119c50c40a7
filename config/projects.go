// SPDX-License-Identifier: Apache-2.0

package config

import (
	"fmt"
	"slices"
	"strings"

	"github.com/fairshare-dev/fairshare/internal/membership"
)

// Projects configures where the projects' members (the cgroups registered
// to each project) come from.
type Projects struct {
	// Sources lists the sources of membership, earlier first when two
	// newcomers conflict: directory (every child of projects_root is a
	// project), systemd (projects_root is a slice, its fairshare-<name>.slice
	// children the projects) and registered ('fairshare project add').
	Sources []string `yaml:"sources"`
}

// ProjectSources are the source names projects.sources accepts.
var ProjectSources = []string{membership.SourceDirectory, membership.SourceSystemd, membership.SourceRegistered, membership.SourceKubernetes}

// Has reports whether source is configured.
func (p *Projects) Has(source string) bool { return slices.Contains(p.Sources, source) }

func (p *Projects) validate() error {
	if len(p.Sources) == 0 {
		return fmt.Errorf("projects.sources must name at least one of %s", strings.Join(ProjectSources, ", "))
	}
	for i, s := range p.Sources {
		if !slices.Contains(ProjectSources, s) {
			return fmt.Errorf("projects.sources: %q is not a source; the sources are %s", s, strings.Join(ProjectSources, ", "))
		}
		if slices.Contains(p.Sources[:i], s) {
			return fmt.Errorf("projects.sources names %s twice", s)
		}
	}
	if p.Has(membership.SourceDirectory) && p.Has(membership.SourceSystemd) {
		return fmt.Errorf("projects.sources: directory and systemd both read projects_root, as plain directories or as slices; choose one")
	}
	return nil
}
