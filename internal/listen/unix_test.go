// SPDX-License-Identifier: Apache-2.0

package listen

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// Only root (or the daemon's own user) may be able to change a directory on
// the way to a socket: anyone else could swap the socket for a link
// between the bind and what follows. Before, any directory was taken.
func TestUnixRefusesUnsafeDirectories(t *testing.T) {
	needRoot(t)
	base := publicDir(t)
	mk := func(name string, mode os.FileMode, uid int) string {
		d := filepath.Join(base, name)
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(d, mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(d, uid, uid); err != nil {
			t.Fatal(err)
		}
		return d
	}
	for _, tt := range []struct {
		dir  string
		safe bool
	}{
		{mk("nobodys", 0o755, 65534), false},
		{mk("open", 0o777, 0), false},
		{mk("group", 0o775, 0), false},
		{mk("sticky", os.ModeSticky|0o777, 0) + "/sub", true}, // like /tmp: a subdirectory of ours is fine
		{mk("roots", 0o755, 0), true},
		{filepath.Join(base, "nobodys", "below"), false}, // missing, below an unsafe one: not created
	} {
		ln, _, err := Unix(filepath.Join(tt.dir, "s.sock"), 0o600, -1)
		if ln != nil {
			ln.Close()
		}
		if tt.safe != (err == nil) || !tt.safe && (!errors.Is(err, ErrUnsafeDir) || !strings.Contains(err.Error(), filepath.Base(strings.TrimSuffix(tt.dir, "/below")))) {
			t.Errorf("%s: %v", tt.dir, err)
		}
	}
	if _, err := os.Stat(filepath.Join(base, "nobodys", "below")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a directory was made below an unsafe one: %v", err)
	}
	// A link owned by another user on the way is unsafe too, even to a
	// safe directory.
	link := filepath.Join(base, "link")
	if err := os.Symlink(filepath.Join(base, "roots"), link); err != nil {
		t.Fatal(err)
	}
	if err := os.Lchown(link, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	if _, _, err := Unix(filepath.Join(link, "s.sock"), 0o600, -1); !errors.Is(err, ErrUnsafeDir) {
		t.Errorf("through nobody's link: %v", err)
	}
}

// A socket swapped for a link to another file between the bind and the
// rest is refused, and the file keeps its mode and group. Before, Unix
// chmod-ed and chown-ed the path after the bind, following such a link.
func TestUnixSocketSwappedForLink(t *testing.T) {
	needRoot(t)
	dir := t.TempDir()
	target := filepath.Join(dir, "shadow")
	if err := os.WriteFile(target, []byte("secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	testHookAfterBind = func(path string) {
		os.Remove(path)
		os.Symlink(target, path)
	}
	defer func() { testHookAfterBind = nil }()
	ln, _, err := Unix(filepath.Join(dir, "s.sock"), 0o666, 12345)
	if ln != nil {
		ln.Close()
	}
	if err == nil {
		t.Error("a socket swapped for a link was taken")
	}
	var st unix.Stat_t
	if err := unix.Stat(target, &st); err != nil || st.Mode&0o777 != 0o600 || st.Gid != 0 {
		t.Errorf("the link's target is now mode %04o group %d (%v); want 0600 and 0", st.Mode&0o777, st.Gid, err)
	}
}

// The directories Unix makes get DirMode whatever the umask: under systemd's
// UMask=0077 MkdirAll made them 0700, which kept a socket's group out (the
// daemon only warned).
func TestUnixDirectoryModeUnderUmask(t *testing.T) {
	old := syscall.Umask(0o077)
	defer syscall.Umask(old)
	dir := filepath.Join(t.TempDir(), "a", "b")
	ln, _, err := Unix(filepath.Join(dir, "s.sock"), 0o660, os.Getgid())
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	for _, d := range []string{dir, filepath.Dir(dir)} {
		if fi, err := os.Stat(d); err != nil || fi.Mode().Perm() != DirMode {
			t.Errorf("%s: mode %v (%v), want %v", d, fi.Mode().Perm(), err, DirMode)
		}
	}
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(dir, "s.sock"), &st); err != nil || st.Mode&0o777 != 0o660 {
		t.Errorf("socket mode %04o (%v)", st.Mode&0o777, err)
	}
}

// A path too long for a unix socket is refused before anything is made.
func TestUnixPathTooLong(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "made")
	path := filepath.Join(dir, strings.Repeat("x", MaxPathLen))
	if _, _, err := Unix(path, 0o600, -1); err == nil || !strings.Contains(err.Error(), "longer than") {
		t.Fatalf("a %d-byte path: %v", len(path), err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the directory was made for a path that cannot be bound: %v", err)
	}
}
