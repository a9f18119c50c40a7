// SPDX-License-Identifier: Apache-2.0

package project

import (
	"errors"
	"strings"
	"testing"
)

func TestValidate(t *testing.T) {
	for _, name := range []string{"a", "alpha-1", "A_b.c", "9x", "x.cgroup", strings.Repeat("x", MaxLen)} {
		if err := Validate(name); err != nil {
			t.Errorf("%q: %v", name, err)
		}
	}
	for _, name := range []string{"", ".", "..", ".hidden", "-flag", "a/b", "a b", "é", "cgroup.procs",
		"x\n", "_x", "(other)", "(forgotten)", "#12", "a\x1b[2Jb", strings.Repeat("x", MaxLen+1), strings.Repeat("y", 60<<10)} {
		err := Validate(name)
		if !errors.Is(err, ErrInvalid) {
			t.Errorf("%q accepted", name)
			continue
		}
		// The message may be printed anywhere: it never carries the raw
		// name when the name has a control character, and never a huge one.
		if msg := err.Error(); strings.ContainsAny(msg, "\n\x1b") || len(msg) > 300 {
			t.Errorf("%q: unsafe message %q", name, msg)
		}
	}
}

func TestDisplay(t *testing.T) {
	for in, want := range map[string]string{
		"alpha":             "alpha",
		"(other)":           "(other)",
		"#42":               "#42",
		"":                  `""`,
		"a b":               `"a b"`,
		"evil\nconnections": `"evil\nconnections"`,
		"\x1b[2J":           `"\x1b[2J"`,
		"é":                 `"\u00e9"`,
		`a"b`:               `"a\"b"`,
	} {
		if got := Display(in); got != want {
			t.Errorf("Display(%q) = %s, want %s", in, got, want)
		}
	}
}
