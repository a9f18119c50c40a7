// SPDX-License-Identifier: Apache-2.0

package policy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/fairshare-dev/fairshare/internal/membership"
	bolt "go.etcd.io/bbolt"
)

// bucketMembers holds the operator's registrations (the "registered" source
// of membership): cgroup path -> storedMember. The key is the cgroup, so a
// cgroup is registered once.
var bucketMembers = []byte("members")

type storedMember struct {
	Project string `json:"project"`
}

// ErrNotRegistered means a removal named a cgroup that is not registered
// for the project.
var ErrNotRegistered = errors.New("no such registration")

// Members returns the stored registrations, sorted by cgroup.
func (s *Store) Members() ([]membership.Member, error) {
	var out []membership.Member
	err := s.db.View(func(tx *bolt.Tx) error {
		var err error
		out, err = members(tx)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("listing registrations: %w", err)
	}
	return out, nil
}

func members(tx *bolt.Tx) ([]membership.Member, error) {
	b := tx.Bucket(bucketMembers)
	if b == nil {
		return nil, nil
	}
	out := make([]membership.Member, 0, b.Stats().KeyN)
	err := b.ForEach(func(k, v []byte) error {
		var sm storedMember
		if err := json.Unmarshal(v, &sm); err != nil {
			return fmt.Errorf("decoding the registration of %s: %w", k, err)
		}
		out = append(out, membership.Member{Project: sm.Project, Cgroup: string(k)})
		return nil
	})
	return out, err
}

// AddMembers stores ms in one transaction. check sees the registrations
// stored before (sorted by cgroup) and may refuse the whole change; so does
// a member whose name or path is invalid, or whose cgroup is registered for
// another project (membership.ErrRefused). Nothing is written when
// anything is refused. A member stored already is kept as it is. It
// returns how many registrations are new.
func (s *Store) AddMembers(ms []membership.Member, check func(stored []membership.Member) error) (int, error) {
	for _, m := range ms {
		if err := ValidateProject(m.Project); err != nil {
			return 0, err
		}
		if err := membership.ValidCgroup(m.Cgroup); err != nil {
			return 0, fmt.Errorf("%w: %w", membership.ErrRefused, err)
		}
	}
	added := 0
	err := s.db.Update(func(tx *bolt.Tx) error {
		if check != nil {
			stored, err := members(tx)
			if err != nil {
				return err
			}
			if err := check(stored); err != nil {
				return err
			}
		}
		b, err := tx.CreateBucketIfNotExists(bucketMembers)
		if err != nil {
			return err
		}
		for _, m := range ms {
			if v := b.Get([]byte(m.Cgroup)); v != nil {
				var sm storedMember
				if err := json.Unmarshal(v, &sm); err != nil {
					return fmt.Errorf("decoding the registration of %s: %w", m.Cgroup, err)
				}
				if sm.Project != m.Project {
					return fmt.Errorf("%w: %s is registered to project %s already", membership.ErrRefused, m.Cgroup, sm.Project)
				}
				continue
			}
			buf, err := json.Marshal(storedMember{Project: m.Project})
			if err != nil {
				return err
			}
			if err := b.Put([]byte(m.Cgroup), buf); err != nil {
				return err
			}
			added++
		}
		if added == 0 {
			return nil
		}
		return bumpVersion(tx)
	})
	if err != nil {
		return 0, fmt.Errorf("saving registrations: %w", err)
	}
	return added, nil
}

// RemoveMembers removes registrations of project: those of cgroups, or
// every one when cgroups is empty. A cgroup not registered for project is
// ErrNotRegistered, and then nothing is removed. It returns what it
// removed, sorted by cgroup.
func (s *Store) RemoveMembers(project string, cgroups []string) ([]membership.Member, error) {
	if err := ValidateProject(project); err != nil {
		return nil, err
	}
	var removed []membership.Member
	err := s.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketMembers)
		if b == nil {
			if len(cgroups) > 0 {
				return fmt.Errorf("%w: %s is not registered for project %s", ErrNotRegistered, cgroups[0], project)
			}
			return nil
		}
		projectOf := func(v []byte) (string, error) {
			var sm storedMember
			err := json.Unmarshal(v, &sm)
			return sm.Project, err
		}
		if len(cgroups) > 0 {
			for _, cg := range cgroups {
				v := b.Get([]byte(cg))
				p, err := projectOf(v)
				if v == nil || err != nil || p != project {
					return fmt.Errorf("%w: %s is not registered for project %s", ErrNotRegistered, cg, project)
				}
				if !slices.ContainsFunc(removed, func(m membership.Member) bool { return m.Cgroup == cg }) {
					removed = append(removed, membership.Member{Project: project, Cgroup: cg})
				}
			}
			slices.SortFunc(removed, func(a, b membership.Member) int { return strings.Compare(a.Cgroup, b.Cgroup) })
		} else {
			// Every registration of the project: decode only the values
			// that can be its.
			quoted, _ := json.Marshal(project)
			err := b.ForEach(func(k, v []byte) error {
				if !bytes.Contains(v, quoted) {
					return nil
				}
				p, err := projectOf(v)
				if err != nil {
					return fmt.Errorf("decoding the registration of %s: %w", k, err)
				}
				if p == project {
					removed = append(removed, membership.Member{Project: project, Cgroup: string(k)})
				}
				return nil
			})
			if err != nil {
				return err
			}
		}
		if len(removed) == 0 {
			return nil
		}
		for _, m := range removed {
			if err := b.Delete([]byte(m.Cgroup)); err != nil {
				return err
			}
		}
		return bumpVersion(tx)
	})
	if err != nil {
		removed = nil
		return nil, fmt.Errorf("removing registrations of %s: %w", project, err)
	}
	return removed, nil
}
