// SPDX-License-Identifier: Apache-2.0

package fairshare

import (
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
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

// make demo runs the kernel's drills too when it can (as root: to the node's
// pool, then to a destination pool), and says
// plainly that it skipped it otherwise. As root the drills are the real
// ones, run by a binary built here with 3.5 s phases (the least the drill takes) (make's own build is
// taken as done, so nothing is written to the tree), and the connections
// drill must report connections the kernel refused. (Before, the drills
// were replaced by echo in both cases: the kernel path never ran.) The
// requests drill's latency verdicts are the drill package's to check, with
// its phases: here, with 3.5 s phases on a loaded host, they may fail, and
// make demo still runs the kernel's drills before it fails.
func TestMakeDemo(t *testing.T) {
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("no make")
	}
	bin := filepath.Join(t.TempDir(), "fairshare")
	if out, err := exec.Command("go", "build", "-o", bin, "./cmd/fairshare").CombinedOutput(); err != nil {
		t.Fatalf("building: %v\n%s", err, out)
	}
	demo := func(run, uid string) string {
		t.Helper()
		out, err := exec.Command("make", "--no-print-directory", "-o", "build", "demo", "DEMO_RUN="+run,
			"DEMO_FLAGS=--phase 3.5s --slices 2", "DEMO_UID="+uid).CombinedOutput()
		if err != nil {
			t.Logf("make demo (uid %s): %v", uid, err)
		}
		return string(out)
	}
	if os.Geteuid() == 0 {
		out := demo(bin, "0")
		_, conns, ok := strings.Cut(out, "fair-share drill (connections)")
		refused := regexp.MustCompile(`(?m)^\s+both\s+big\s+16\s+\d+\s+\d+\s+([1-9]\d*)\s`)
		if !strings.HasPrefix(out, bin+" drill") || !ok || !refused.MatchString(conns) {
			t.Errorf("as root, make demo does not run both drills, the kernel refusing the big project:\n%s", out)
		}
		_, dest, ok := strings.Cut(conns, "fair-share drill (connections to the destination pool drill 127.0.0.1:")
		if !ok || !refused.MatchString(dest) {
			t.Errorf("as root, make demo does not run the drill to a destination pool, the kernel refusing the big project:\n%s", out)
		}
	}
	// Not root: what make runs is all this case is about, so echo stands in
	// for the drills the root case ran for real.
	out := demo("echo fairshare", "1000")
	if !strings.Contains(out, "fairshare drill --phase") || strings.Contains(out, "fairshare drill connections --phase") ||
		!strings.Contains(out, "SKIPPED: the connections drill") || !strings.Contains(out, "needs root") {
		t.Errorf("as another user, make demo does not say what it skipped:\n%s", out)
	}
}
