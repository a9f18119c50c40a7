// SPDX-License-Identifier: Apache-2.0

package membership

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"sync"
)

// ErrRefused is wrapped by the error of a registration that would be
// refused: its cgroup is registered already, or nested in another
// project's.
var ErrRefused = errors.New("registration refused")

// Member is one registered cgroup: every process in it, or in a cgroup below
// it, belongs to Project.
type Member struct {
	// Project is the project's name (the rule of package internal/project).
	Project string `json:"project"`
	// Cgroup is the cgroup's directory: an absolute, clean path below the
	// cgroup2 mount (/sys/fs/cgroup/unified/kubepods/pod1 on a hybrid host).
	Cgroup string `json:"cgroup"`
}

// Source is one origin of members: the children of a directory, systemd
// slices, registrations stored by the operator, a container runtime's pods.
type Source interface {
	// Name names the source in status, logs and metrics ("directory").
	Name() string
	// Scan returns the members the source knows now. An error means the
	// source could not be read at all; the caller then keeps its last scan.
	Scan(ctx context.Context) (Found, error)
}

// Notifier is implemented by a source that can tell when its members may
// have changed, so the caller scans at once instead of at its next tick.
type Notifier interface {
	// Changed receives after a change; changes that arrive before the value
	// is taken are coalesced into one.
	Changed() <-chan struct{}
}

// Found is what one scan of a source found: its members, and the cgroups
// it saw but could not make members, with why (a slice that is not named
// as a project slice is).
type Found struct {
	Members []Member  `json:"members"`
	Skipped []Skipped `json:"skipped,omitempty"`
}

// Skipped is a cgroup a source saw and did not take.
type Skipped struct {
	Cgroup string `json:"cgroup"`
	Reason string `json:"reason"`
}

// Entry is a member with the source that claims it.
type Entry struct {
	Member
	Source string `json:"source"`
}

// Compare orders entries by cgroup, then project, then source: the order of
// every list this package returns.
func Compare(a, b Entry) int {
	if c := cmp.Compare(a.Cgroup, b.Cgroup); c != 0 {
		return c
	}
	if c := cmp.Compare(a.Project, b.Project); c != 0 {
		return c
	}
	return cmp.Compare(a.Source, b.Source)
}

// Members returns the members of es, in es's order.
func Members(es []Entry) []Member {
	out := make([]Member, len(es))
	for i, e := range es {
		out[i] = e.Member
	}
	return out
}

// Static is a source whose members its owner sets: the operator's stored
// registrations. It is safe for concurrent use.
type Static struct {
	name    string
	changed chan struct{}

	mu      sync.Mutex // guards the field below
	members []Member
}

// NewStatic returns an empty Static source named name.
func NewStatic(name string) *Static {
	return &Static{name: name, changed: make(chan struct{}, 1)}
}

// Name implements Source.
func (s *Static) Name() string { return s.name }

// Scan implements Source: the members last set.
func (s *Static) Scan(context.Context) (Found, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return Found{Members: slices.Clone(s.members)}, nil
}

// Set replaces the members and notifies.
func (s *Static) Set(ms []Member) {
	s.mu.Lock()
	s.members = slices.Clone(ms)
	s.mu.Unlock()
	select {
	case s.changed <- struct{}{}:
	default:
	}
}

// Changed implements Notifier.
func (s *Static) Changed() <-chan struct{} { return s.changed }
