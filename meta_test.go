// SPDX-License-Identifier: Apache-2.0

package fairshare

import (
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestPackageDocs fails when a package lacks its package comment in doc.go, or
// carries a package comment in any other file: one place states the contract.
func TestPackageDocs(t *testing.T) {
	dirs := map[string][]string{}
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != "." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || d.Name() == "headers") {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(path, ".go") && !strings.HasSuffix(path, "_test.go") {
			dirs[filepath.Dir(path)] = append(dirs[filepath.Dir(path)], path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(dirs) < 5 {
		t.Fatalf("found only %d packages; is the walk broken?", len(dirs))
	}
	for dir, files := range dirs {
		var withDoc []string
		for _, f := range files {
			src, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			af, err := parser.ParseFile(token.NewFileSet(), f, src, parser.ParseComments|parser.PackageClauseOnly)
			if err != nil {
				t.Fatalf("%s: %v", f, err)
			}
			if af.Doc != nil && strings.TrimSpace(af.Doc.Text()) != "" {
				withDoc = append(withDoc, filepath.Base(f))
			}
		}
		switch {
		case len(withDoc) == 0:
			t.Errorf("package %s has no package comment (put it in doc.go)", dir)
		case len(withDoc) > 1 || withDoc[0] != "doc.go":
			t.Errorf("package %s: package comment must be in doc.go only, found in %v", dir, withDoc)
		}
	}
}

// TestSPDXHeaders fails when a Go or C source file does not open with an
// SPDX licence line. Generated files and vendored headers are exempt.
func TestSPDXHeaders(t *testing.T) {
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != "." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "headers") {
			return filepath.SkipDir
		}
		if d.IsDir() || !(strings.HasSuffix(path, ".go") || strings.HasSuffix(path, ".c") || strings.HasSuffix(path, ".h")) {
			return nil
		}
		if strings.Contains(path, "_bpfel") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		first, _, _ := strings.Cut(string(src), "\n")
		if !strings.Contains(first, "SPDX-License-Identifier:") {
			t.Errorf("%s: first line must be an SPDX-License-Identifier comment", path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
