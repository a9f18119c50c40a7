// SPDX-License-Identifier: Apache-2.0

package fairshare

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// docPages are README.md and every page in docs/.
func docPages(t *testing.T) map[string]string {
	t.Helper()
	pages := map[string]string{}
	files, err := filepath.Glob("docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range append(files, "README.md") {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		pages[f] = string(b)
	}
	return pages
}

// README stays a front door: short, no dated history, and the quick start
// that .ci/run relies on.
func TestReadmeIsAFrontDoor(t *testing.T) {
	b, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	if n := strings.Count(s, "\n"); n > 250 {
		t.Errorf("README.md has %d lines, more than 250: move the detail into docs/", n)
	}
	for _, want := range []string{"make demo", "make test", "docs/README.md"} {
		if !strings.Contains(s, want) {
			t.Errorf("README.md lacks %q", want)
		}
	}
	if m := regexp.MustCompile(`20\d\d-\d\d-\d\d`).FindString(s); m != "" {
		t.Errorf("README.md carries a date (%s): dated measurements go to docs/measurements-log.md", m)
	}
}

var mdLink = regexp.MustCompile(`\]\(([^)\s]+)\)`)

// Every relative link of the docs names a file that exists, and every
// anchor into a page names one of its headings.
func TestDocLinks(t *testing.T) {
	pages := docPages(t)
	for page, text := range pages {
		for _, m := range mdLink.FindAllStringSubmatch(text, -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			file, anchor, _ := strings.Cut(target, "#")
			path := page
			if file != "" {
				path = filepath.Clean(filepath.Join(filepath.Dir(page), file))
				if _, err := os.Stat(path); err != nil {
					t.Errorf("%s links to %s, which does not exist", page, target)
					continue
				}
			}
			if anchor == "" || !strings.HasSuffix(path, ".md") {
				continue
			}
			b, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if !hasAnchor(string(b), anchor) {
				t.Errorf("%s links to %s, but %s has no heading for #%s", page, target, path, anchor)
			}
		}
	}
}

// hasAnchor says whether a heading of page makes GitHub's anchor a.
func hasAnchor(page, a string) bool {
	for _, line := range strings.Split(page, "\n") {
		if !strings.HasPrefix(line, "#") {
			continue
		}
		h := strings.ToLower(strings.TrimSpace(strings.TrimLeft(line, "#")))
		var b strings.Builder
		for _, r := range h {
			switch {
			case r == ' ':
				b.WriteRune('-')
			case r == '-' || r == '_' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9':
				b.WriteRune(r)
			}
		}
		if b.String() == a {
			return true
		}
	}
	return false
}

// A test the docs name as evidence exists.
func TestDocTestNamesExist(t *testing.T) {
	funcs := map[string]bool{}
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != "." && strings.HasPrefix(d.Name(), ".") {
			return filepath.SkipDir
		}
		if strings.HasSuffix(path, "_test.go") {
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			for _, m := range regexp.MustCompile(`(?m)^func (Test\w+)\(`).FindAllStringSubmatch(string(b), -1) {
				funcs[m[1]] = true
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for page, text := range docPages(t) {
		for _, m := range regexp.MustCompile("`(Test[A-Z]\\w*)`").FindAllStringSubmatch(text, -1) {
			if !funcs[m[1]] {
				t.Errorf("%s names %s, which is no test", page, m[1])
			}
		}
	}
}

// stringConsts returns the values of the string constants in the files
// whose names start with prefix.
func stringConsts(t *testing.T, prefix string, files ...string) []string {
	t.Helper()
	var out []string
	for _, f := range files {
		af, err := parser.ParseFile(token.NewFileSet(), f, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(af, func(n ast.Node) bool {
			vs, ok := n.(*ast.ValueSpec)
			if !ok {
				return true
			}
			for i, name := range vs.Names {
				if !strings.HasPrefix(name.Name, prefix) || i >= len(vs.Values) {
					continue
				}
				if lit, ok := vs.Values[i].(*ast.BasicLit); ok && lit.Kind == token.STRING {
					v, err := strconv.Unquote(lit.Value)
					if err != nil {
						t.Fatal(err)
					}
					out = append(out, v)
				}
			}
			return true
		})
	}
	if len(out) == 0 {
		t.Fatalf("no %s* constants in %v: did they move?", prefix, files)
	}
	return out
}

// Every refusal reason, event kind, permit API code and listener refusal
// the code can emit has an entry in docs/troubleshooting.md, and every
// status warning the page explains is still printed by the CLI.
func TestTroubleshootingCoversTheCode(t *testing.T) {
	b, err := os.ReadFile("docs/troubleshooting.md")
	if err != nil {
		t.Fatal(err)
	}
	page := string(b)
	permitFiles, err := filepath.Glob("permitd/*.go")
	if err != nil {
		t.Fatal(err)
	}
	var nonTest []string
	for _, f := range permitFiles {
		if !strings.HasSuffix(f, "_test.go") {
			nonTest = append(nonTest, f)
		}
	}
	var want []string
	want = append(want, stringConsts(t, "Reason", "events/events.go")...)
	want = append(want, stringConsts(t, "Kind", "events/events.go")...)
	want = append(want, stringConsts(t, "Code", nonTest...)...)
	want = append(want, stringConsts(t, "Reason", "internal/listen/listen.go")...)
	for _, w := range want {
		if !strings.Contains(page, "### `"+w+"`\n") {
			t.Errorf("docs/troubleshooting.md has no entry \"### `%s`\"", w)
		}
	}
	var src strings.Builder
	for _, f := range []string{"cmd/fairshare/status.go", "cmd/fairshare/project.go"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		src.Write(b)
	}
	_, warnings, ok := strings.Cut(page, "## Status warnings")
	if !ok {
		t.Fatal("docs/troubleshooting.md has no Status warnings section")
	}
	warnings, _, _ = strings.Cut(warnings, "\n## ")
	n := 0
	for _, m := range regexp.MustCompile(`(?m)^### "(.+)"$`).FindAllStringSubmatch(warnings, -1) {
		n++
		w := m[1]
		if !strings.Contains(src.String(), w) && !strings.Contains(src.String(), strings.ReplaceAll(w, ": false", ": %v")) {
			t.Errorf("docs/troubleshooting.md explains the status line %q, which the CLI no longer prints", w)
		}
	}
	if n < 5 {
		t.Errorf("found only %d status warnings in docs/troubleshooting.md", n)
	}
}
