// SPDX-License-Identifier: Apache-2.0

package labels

import (
	"testing"

	"slices"
)

// A cap of three values: two projects are named, the rest share Other; a
// name sticks while its project is reported, frees when it is not, and goes
// to the busiest unnamed one; counts only grow, a restart from zero included.
func TestSetPolicy(t *testing.T) {
	s := NewSet(3)
	s.Assign([]string{"a", "b", "c"})
	for p, want := range map[string]string{"a": "a", "b": "b", "c": Other} {
		if got := s.Label(p); got != want {
			t.Errorf("label of %s = %s, want %s", p, got, want)
		}
	}
	s.Count("a", "ok", 5)
	s.Count("c", "ok", 2)
	s.Assign([]string{"c", "a", "b"}) // c busiest now: a and b keep their names
	if s.Label("c") != Other || s.Label("a") != "a" {
		t.Errorf("labels moved with load: a %s, c %s", s.Label("a"), s.Label("c"))
	}
	s.Count("a", "ok", 3) // a restarted from zero: all of it is new
	if got := s.Total("a", "ok"); got != 8 {
		t.Errorf("a's series %d, want 8", got)
	}
	s.Assign([]string{"c", "a"}) // b forgotten: its name goes to c
	if s.Label("c") != "c" || s.Label("b") != Other {
		t.Errorf("after b was forgotten: c %s, b %s", s.Label("c"), s.Label("b"))
	}
	if !s.OtherUsed() || s.Total(Other, "ok") != 2 {
		t.Errorf("Other used %v with %d, want c's 2 kept", s.OtherUsed(), s.Total(Other, "ok"))
	}
	one := NewSet(0)
	one.Assign([]string{"a"})
	if one.Label("a") != Other {
		t.Error("a cap below one names a project")
	}
}

func TestBusiest(t *testing.T) {
	type p struct {
		name string
		a, b uint64
	}
	got := Busiest([]p{{"d", 1, 9}, {"c", 2, 0}, {"b", 1, 9}, {"a", 1, 1}}, func(x p) string { return x.name },
		func(x p) [2]uint64 { return [2]uint64{x.a, x.b} })
	if want := []string{"c", "b", "d", "a"}; !slices.Equal(got, want) {
		t.Errorf("Busiest = %v, want %v", got, want)
	}
}
