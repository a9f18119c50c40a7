// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/loader"
)

// cleanupPinDir is a fresh name for a pin directory under /sys/fs/bpf (not
// made), cleaned at the end of the test whatever it holds then.
func cleanupPinDir(t *testing.T, tag string) string {
	t.Helper()
	dir := filepath.Join("/sys/fs/bpf", fmt.Sprintf("fairshare-cleanup-%s-%d", tag, os.Getpid()))
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// The reported cases, by the command an uninstall runs: 'cleanup
// --pin-dir' of a plain directory (the state directory by mistake), of
// bpffs's root (a bpffs of the test's own stands for /sys/fs/bpf) and of a
// pin directory where another tool pinned too exits 1 saying why, and
// removes nothing.
func TestCleanupCommandRefuses(t *testing.T) {
	needRoot(t)
	plain := t.TempDir()
	if err := os.WriteFile(filepath.Join(plain, "policies.db"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(plain, "fs_config"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	if err := unix.Mount("bpf", root, "bpf", 0, "mode=0700"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(root, unix.MNT_DETACH) })
	testutil.PinMap(t, filepath.Join(root, "tool_map"))
	testutil.PinMap(t, filepath.Join(root, "fs_config"))
	shared := cleanupPinDir(t, "shared")
	if err := os.Mkdir(shared, 0o700); err != nil {
		t.Fatal(err)
	}
	testutil.PinMap(t, filepath.Join(shared, "fs_config"))
	testutil.PinMap(t, filepath.Join(shared, "link_connect4"))
	testutil.PinMap(t, filepath.Join(shared, "tool_map"))

	for _, tc := range []struct{ dir, says string }{
		{plain, "is not on a bpf file system"},
		{root, "is the root of a bpf file system mount"},
		{shared, "entries fairshare never makes: tool_map"},
	} {
		before := testutil.Tree(t, tc.dir)
		out, errOut, code := runCLI(t, "cleanup", "--pin-dir", tc.dir)
		if code != 1 || !strings.Contains(errOut, "cleanup refused: "+tc.dir) || !strings.Contains(errOut, tc.says) {
			t.Errorf("cleanup --pin-dir %s: exit %d, stdout %q, stderr %q; want 1 and %q", tc.dir, code, out, errOut, tc.says)
		}
		if after := testutil.Tree(t, tc.dir); !slices.Equal(before, after) {
			t.Errorf("the refused cleanup of %s changed it:\nbefore %v\nafter  %v", tc.dir, before, after)
		}
	}
	if b, err := os.ReadFile(filepath.Join(plain, "policies.db")); err != nil || string(b) != "x" {
		t.Errorf("policies.db after the refused cleanup: %q, %v", b, err)
	}
}

// A pin directory Open made is cleaned (exit 0, every pin and the
// directory gone, and the count said); the same command again finds
// nothing pinned there and exits 0, as an uninstall run twice needs.
func TestCleanupCommandCleansPins(t *testing.T) {
	needRoot(t)
	pin := cleanupPinDir(t, "real")
	t.Cleanup(func() { loader.Cleanup(pin) })
	lim, err := loader.Open(loader.Options{PinDir: pin, PoolSize: 1000})
	if err != nil {
		t.Fatal(err)
	}
	lim.Close()
	if _, err := os.Stat(filepath.Join(pin, "link_connect4")); err != nil {
		t.Fatalf("Open pinned no link: %v", err)
	}
	out, errOut, code := runCLI(t, "cleanup", "--pin-dir", pin)
	if code != 0 || !strings.Contains(out, "detached and unpinned everything under "+pin+" (") {
		t.Errorf("cleanup: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	if _, err := os.Stat(pin); !os.IsNotExist(err) {
		t.Errorf("the pin directory is still there: %v", err)
	}
	out, errOut, code = runCLI(t, "cleanup", "--pin-dir", pin)
	if code != 0 || out != "nothing is pinned in "+pin+": it does not exist\n" {
		t.Errorf("cleanup again: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
}

// The reported case: 'cleanup --pin-dir' with a mistyped directory said
// it had detached everything. It says nothing is pinned there, exits 0
// (an idempotent uninstall), and names on stderr the pin directory beside
// it that holds fairshare's pins; off bpffs, it says that instead.
func TestCleanupCommandMissingPinDir(t *testing.T) {
	needRoot(t)
	pin := cleanupPinDir(t, "meant")
	if err := os.Mkdir(pin, 0o700); err != nil {
		t.Fatal(err)
	}
	testutil.PinMap(t, filepath.Join(pin, "fs_config"))
	typo := pin + "-typo"
	out, errOut, code := runCLI(t, "cleanup", "--pin-dir", typo)
	if code != 0 || out != "nothing is pinned in "+typo+": it does not exist\n" ||
		!strings.Contains(errOut, "note: fairshare's pins are in "+pin+": fairshare cleanup --pin-dir "+pin) {
		t.Errorf("cleanup of a missing directory: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	if _, err := os.Stat(filepath.Join(pin, "fs_config")); err != nil {
		t.Errorf("the pin directory beside it was touched: %v", err)
	}
	off := filepath.Join(t.TempDir(), "fairshare")
	out, errOut, code = runCLI(t, "cleanup", "--pin-dir", off)
	if code != 0 || out != "nothing is pinned in "+off+": it does not exist\n" || !strings.Contains(errOut, "is not a bpf file system") {
		t.Errorf("cleanup of a missing directory off bpffs: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
}
