// SPDX-License-Identifier: Apache-2.0

package policy

import (
	"errors"
	"slices"
	"testing"

	"github.com/fairshare-dev/fairshare/internal/membership"
)

func mb(p, cg string) membership.Member { return membership.Member{Project: p, Cgroup: cg} }

// TestMembers: registrations are stored by cgroup, survive a reopen, are
// added all or nothing (a cgroup of another project, a bad path or a
// refusing check writes none), and are removed by cgroup or all at once.
func TestMembers(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if ms, err := s.Members(); err != nil || len(ms) != 0 {
		t.Fatalf("a new store has registrations: %v %v", ms, err)
	}
	v0, _ := s.Version()
	n, err := s.AddMembers([]membership.Member{mb("web", "/cg/b"), mb("web", "/cg/a"), mb("db", "/cg/c")}, nil)
	if err != nil || n != 3 {
		t.Fatalf("added %d: %v", n, err)
	}
	if v, _ := s.Version(); v == v0 {
		t.Error("a registration did not bump the version")
	}
	// Again: nothing new, nothing written.
	v1, _ := s.Version()
	if n, err := s.AddMembers([]membership.Member{mb("web", "/cg/a")}, nil); err != nil || n != 0 {
		t.Fatalf("re-adding: %d %v", n, err)
	}
	if v, _ := s.Version(); v != v1 {
		t.Error("re-adding wrote")
	}
	for _, bad := range [][]membership.Member{
		{mb("api", "/cg/d"), mb("api", "/cg/a")}, // /cg/a is web's
		{mb("api", "/cg/d"), mb("api", "cg/e")},
		{mb("api", "/cg/d"), mb("bad name", "/cg/e")},
	} {
		if _, err := s.AddMembers(bad, nil); err == nil {
			t.Fatalf("%v accepted", bad)
		}
	}
	if _, err := s.AddMembers([]membership.Member{mb("api", "/cg/d")}, func(stored []membership.Member) error {
		if len(stored) != 3 || stored[0].Cgroup != "/cg/a" {
			t.Errorf("check saw %v", stored)
		}
		return membership.ErrRefused
	}); !errors.Is(err, membership.ErrRefused) {
		t.Fatalf("a refusing check: %v", err)
	}
	want := []membership.Member{mb("web", "/cg/a"), mb("web", "/cg/b"), mb("db", "/cg/c")}
	if ms, _ := s.Members(); !slices.Equal(ms, want) {
		t.Fatalf("after refusals: %v, want %v", ms, want)
	}

	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if s, err = Open(dir, Options{}); err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if ms, _ := s.Members(); !slices.Equal(ms, want) {
		t.Fatalf("after a reopen: %v, want %v", ms, want)
	}

	if _, err := s.RemoveMembers("db", []string{"/cg/a"}); !errors.Is(err, ErrNotRegistered) {
		t.Fatalf("removing another project's cgroup: %v", err)
	}
	if rm, err := s.RemoveMembers("web", []string{"/cg/b"}); err != nil || !slices.Equal(rm, []membership.Member{mb("web", "/cg/b")}) {
		t.Fatalf("removed %v %v", rm, err)
	}
	if _, err := s.AddMembers([]membership.Member{mb("web", "/cg/x")}, nil); err != nil {
		t.Fatal(err)
	}
	if rm, err := s.RemoveMembers("web", nil); err != nil || len(rm) != 2 {
		t.Fatalf("removing all of web: %v %v", rm, err)
	}
	if ms, _ := s.Members(); !slices.Equal(ms, []membership.Member{mb("db", "/cg/c")}) {
		t.Fatalf("left %v", ms)
	}
	if rm, err := s.RemoveMembers("nobody", nil); err != nil || len(rm) != 0 {
		t.Fatalf("removing a project with no registrations: %v %v", rm, err)
	}
}
