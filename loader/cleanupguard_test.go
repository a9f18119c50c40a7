// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// newPinDirSure is newPinDir whose directory goes at the end even if
// Cleanup refuses it (os.RemoveAll unpins all the same).
func newPinDirSure(t *testing.T) string {
	t.Helper()
	var dir string
	t.Cleanup(func() {
		if dir != "" {
			os.RemoveAll(dir)
		}
	})
	dir = newPinDir(t)
	return dir
}

// privateBPFFS mounts a bpf file system of the test's own (an instance
// apart from /sys/fs/bpf's: what is pinned in one is not in the other),
// unmounted at the end.
func privateBPFFS(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := unix.Mount("bpf", dir, "bpf", 0, "mode=0700"); err != nil {
		t.Fatalf("mounting a bpf file system: %v", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmounting %s: %v", dir, err)
		}
	})
	return dir
}

// wantRefused checks that both cleanups refuse dir with ErrNotPinDir, the
// message containing each of says, and that nothing under it changed.
func wantRefused(t *testing.T, dir string, says ...string) {
	t.Helper()
	before := testutil.Tree(t, dir)
	err := Cleanup(dir)
	_, err2 := CleanupPinDir(dir)
	for _, err := range []error{err, err2} {
		if !errors.Is(err, ErrNotPinDir) {
			t.Errorf("cleanup of %s: %v; want ErrNotPinDir", dir, err)
			continue
		}
		for _, s := range says {
			if !strings.Contains(err.Error(), s) {
				t.Errorf("cleanup of %s: %q does not say %q", dir, err, s)
			}
		}
	}
	if after := testutil.Tree(t, dir); !slices.Equal(before, after) {
		t.Errorf("the refused cleanup of %s changed it:\nbefore %v\nafter  %v", dir, before, after)
	}
}

// The reported case: a plain directory (the state directory, by mistake)
// is not on bpffs, and cleanup removed its files and itself. Refused now,
// as are a file and a symbolic link to a pin directory.
func TestCleanupRefusesPlainDirectory(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "policies.db"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(dir, "netns", "sub"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "fs_config"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	wantRefused(t, dir, "not on a bpf file system")
	wantRefused(t, filepath.Join(dir, "policies.db"), "not a directory")
	if got, _ := os.ReadFile(filepath.Join(dir, "policies.db")); string(got) != "x" {
		t.Errorf("policies.db now holds %q", got)
	}

	testutil.RequireRoot(t)
	pin := newPinDirSure(t)
	testutil.PinMap(t, filepath.Join(pin, "fs_config"))
	ln := filepath.Join(t.TempDir(), "pins")
	if err := os.Symlink(pin, ln); err != nil {
		t.Fatal(err)
	}
	wantRefused(t, ln, "symbolic link")
	if _, err := os.Stat(filepath.Join(pin, "fs_config")); err != nil {
		t.Errorf("the pin behind the refused symbolic link: %v", err)
	}
}

// The reported case: the root of a bpf file system (/sys/fs/bpf given as
// the pin directory) holds other programs' pins, which cleanup unpinned.
// A bpffs of the test's own stands for it, with another tool's pins and
// directory, and pins named as fairshare's: all refused, empty or not.
func TestCleanupRefusesBPFFSRoot(t *testing.T) {
	testutil.RequireRoot(t)
	root := privateBPFFS(t)
	wantRefused(t, root, "root of a bpf file system")
	testutil.PinMap(t, filepath.Join(root, "tool_map"))
	testutil.PinMap(t, filepath.Join(root, "fs_config"))
	if err := os.Mkdir(filepath.Join(root, "tc"), 0o700); err != nil {
		t.Fatal(err)
	}
	testutil.PinMap(t, filepath.Join(root, "tc", "globals_map"))
	wantRefused(t, root, "root of a bpf file system")
	// And by a path with a trailing slash or "." in it.
	wantRefused(t, root+"/", "root of a bpf file system")
	wantRefused(t, filepath.Join(root, "tc")+"/..", "root of a bpf file system")
}

// A pin directory Open made, with a network namespace's link and an
// interrupted migration's pins, is cleaned: every pin and the directory go,
// and the report counts them.
func TestCleanupRealPinDir(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDirSure(t)
	l := openLimiter(t, root, pin, 8, 1)
	ns := exec.Command("unshare", "-n", "sleep", "60")
	if err := ns.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ns.Process.Kill(); ns.Wait() })
	nsPath := fmt.Sprintf("/proc/%d/ns/net", ns.Process.Pid)
	var self, other unix.Stat_t
	if err := unix.Stat("/proc/self/ns/net", &self); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if unix.Stat(nsPath, &other) == nil && other.Ino != self.Ino {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("unshare -n made no network namespace")
		}
	}
	if _, err := l.AttachNetns(nsPath); err != nil {
		t.Fatal(err)
	}
	l.Close()
	if err := os.Mkdir(filepath.Join(pin, stagingDir), 0o700); err != nil {
		t.Fatal(err)
	}
	testutil.PinMap(t, filepath.Join(pin, stagingDir, "fs_config"))
	tree := testutil.Tree(t, pin)
	pins := 0
	for _, p := range tree {
		if !strings.HasSuffix(p, "/") {
			pins++
		}
	}
	if !slices.Contains(tree, "link_connect4") || !slices.ContainsFunc(tree, func(p string) bool { return strings.HasPrefix(p, netnsDir+"/") && p != netnsDir+"/" }) {
		t.Fatalf("the pin directory lacks what the test cleans: %v", tree)
	}
	rep, err := CleanupPinDir(pin)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Missing || rep.Pins != pins {
		t.Errorf("report %+v; want %d pins (%v)", rep, pins, tree)
	}
	if _, err := os.Stat(pin); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the pin directory is still there: %v", err)
	}
}

// A pin directory that does not exist has nothing pinned: Cleanup is
// quiet about it (its callers' contract), CleanupPinDir says so, and
// PinDirsIn finds the pin directories beside it (the one a mistyped name
// meant).
func TestCleanupMissingPinDir(t *testing.T) {
	testutil.RequireRoot(t)
	pin := newPinDirSure(t)
	testutil.PinMap(t, filepath.Join(pin, "fs_config"))
	typo := pin + "-typo"
	if err := Cleanup(typo); err != nil {
		t.Errorf("Cleanup of a missing directory: %v", err)
	}
	rep, err := CleanupPinDir(typo)
	if err != nil || !rep.Missing || rep.Pins != 0 {
		t.Errorf("CleanupPinDir of a missing directory: %+v, %v; want Missing", rep, err)
	}
	if _, err := os.Stat(typo); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the missing directory was made: %v", err)
	}
	if got := PinDirsIn(filepath.Dir(pin)); !slices.Contains(got, pin) || slices.Contains(got, typo) {
		t.Errorf("PinDirsIn(%s) = %v; want %s in it", filepath.Dir(pin), got, pin)
	}
	if got := PinDirsIn(t.TempDir()); got != nil {
		t.Errorf("PinDirsIn off bpffs = %v", got)
	}
}

// A real pin directory where another tool pinned too (a map, a directory,
// an entry in netns/): nothing is removed, fairshare's pins included, and
// the error names the strangers; once they are gone, cleanup cleans.
func TestCleanupRefusesStrangers(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDirSure(t)
	openLimiter(t, root, pin, 8, 1).Close()
	strangers := []string{"tool_map", "tc/", filepath.Join(netnsDir, "tool_link")}
	t.Cleanup(func() {
		for _, s := range strangers {
			os.RemoveAll(filepath.Join(pin, s))
		}
	})
	testutil.PinMap(t, filepath.Join(pin, "tool_map"))
	wantRefused(t, pin, "tool_map", "fairshare never makes")
	if err := os.Mkdir(filepath.Join(pin, "tc"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(pin, netnsDir), 0o700); err != nil {
		t.Fatal(err)
	}
	testutil.PinMap(t, filepath.Join(pin, netnsDir, "tool_link"))
	wantRefused(t, pin, "tool_map", "tc/", "netns/tool_link")
	if _, err := ebpf.LoadPinnedMap(filepath.Join(pin, "fs_config"), nil); err != nil {
		t.Errorf("fairshare's own pin went with the refusal: %v", err)
	}

	// A directory of another tool's alone is no pin directory at all.
	other := filepath.Join(filepath.Dir(pin), filepath.Base(pin)+"-other")
	if err := os.Mkdir(other, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(other) })
	testutil.PinMap(t, filepath.Join(other, "tool_map"))
	wantRefused(t, other, "holds no fairshare pins but tool_map")

	for _, s := range strangers {
		if err := os.Remove(filepath.Join(pin, s)); err != nil {
			t.Fatal(err)
		}
	}
	if err := Cleanup(pin); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(pin); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the pin directory is still there once the strangers went: %v", err)
	}
}

// CleanupOpened (a daemon's pins whose directory was renamed, or removed)
// goes through the same checks by /proc/self/fd: the renamed directory is
// emptied and left; a removed one is nothing to do.
func TestCleanupOpenedRenamed(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDirSure(t)
	openLimiter(t, root, pin, 8, 1).Close()
	f, err := os.Open(pin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	moved := pin + "-moved"
	if err := os.Rename(pin, moved); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(moved) })
	if err := CleanupOpened(f); err != nil {
		t.Fatal(err)
	}
	if ents, err := os.ReadDir(moved); err != nil || len(ents) != 0 {
		t.Errorf("left in the renamed directory: %v %v", ents, err)
	}
	if err := os.Remove(moved); err != nil {
		t.Fatal(err)
	}
	if err := CleanupOpened(f); err != nil {
		t.Errorf("CleanupOpened of a removed directory: %v", err)
	}
}
