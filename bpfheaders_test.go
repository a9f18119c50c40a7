// SPDX-License-Identifier: Apache-2.0

package fairshare

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestBPFHeadersOneWay: the headers under bpf/lib form a one-way stack. A
// header uses only the functions, macros, maps and structs of the headers it
// includes (directly or through them), never a name of a header above it
// declared ahead, and bpf/limiter.c includes every header after the ones
// it builds on.
func TestBPFHeadersOneWay(t *testing.T) {
	files, err := filepath.Glob("bpf/lib/*.h")
	if err != nil || len(files) == 0 {
		t.Fatalf("no headers in bpf/lib: %v", err)
	}
	var (
		comment = regexp.MustCompile(`(?s)/\*.*?\*/`)
		include = regexp.MustCompile(`(?m)^#include "(\w+\.h)"`)
		defines = []*regexp.Regexp{
			regexp.MustCompile(`(?m)^static __always_inline[^;{]*?\b(\w+)\s*\([^;{]*\)\s*\{`),
			regexp.MustCompile(`(?m)^#define\s+(\w+)`),
			regexp.MustCompile(`(?m)^\}\s*(\w+)\s+SEC\(\.maps\)`),
			regexp.MustCompile(`(?m)^struct\s+(\w+)\s*\{`),
		}
	)
	body := map[string]string{}
	incs := map[string][]string{}
	owner := map[string]string{} // name -> the header defining it
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		h := filepath.Base(f)
		body[h] = comment.ReplaceAllString(string(b), "")
		for _, m := range include.FindAllStringSubmatch(body[h], -1) {
			incs[h] = append(incs[h], m[1])
		}
		for _, re := range defines {
			for _, m := range re.FindAllStringSubmatch(body[h], -1) {
				if _, ok := owner[m[1]]; !ok {
					owner[m[1]] = h
				}
			}
		}
	}
	var below func(h string, seen map[string]bool) map[string]bool
	below = func(h string, seen map[string]bool) map[string]bool {
		for _, i := range incs[h] {
			if !seen[i] {
				seen[i] = true
				below(i, seen)
			}
		}
		return seen
	}
	for h, b := range body {
		if below(h, map[string]bool{})[h] {
			t.Errorf("%s is included by a header it includes", h)
		}
		reach := below(h, map[string]bool{h: true})
		for name, o := range owner {
			if reach[o] {
				continue
			}
			if regexp.MustCompile(`\b` + name + `\b`).MatchString(b) {
				t.Errorf("%s uses %s, defined in %s, which it does not include", h, name, o)
			}
		}
	}

	// limiter.c includes each header after every header that one includes.
	c, err := os.ReadFile("bpf/limiter.c")
	if err != nil {
		t.Fatal(err)
	}
	pos := map[string]int{}
	for i, m := range regexp.MustCompile(`(?m)^#include "lib/(\w+\.h)"`).FindAllStringSubmatch(string(c), -1) {
		pos[m[1]] = i
	}
	for h := range body {
		p, ok := pos[h]
		if !ok {
			t.Errorf("bpf/limiter.c does not include lib/%s", h)
			continue
		}
		for _, i := range incs[h] {
			if q, ok := pos[i]; ok && q > p && !strings.HasPrefix(i, "vmlinux") {
				t.Errorf("bpf/limiter.c includes lib/%s before lib/%s, which it builds on", h, i)
			}
		}
	}
}
