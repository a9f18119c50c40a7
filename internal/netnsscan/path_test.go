// SPDX-License-Identifier: Apache-2.0

package netnsscan_test

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/netnsscan"
	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// TestOpenPath: a runtime's path to a pod's namespace is opened only when
// it is a network namespace mounted directly in /run/netns (ip netns add,
// as runtimes do); a FIFO there is refused at once (not waited on), and so
// are a symbolic link there to a network namespace, a regular file, a
// namespace of another type, and any path outside the runtimes' directories.
func TestOpenPath(t *testing.T) {
	testutil.RequireRoot(t)
	name := fmt.Sprintf("fairshare-openpath-%d-%d", os.Getpid(), time.Now().UnixNano())
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v\n%s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
	good := filepath.Join("/run/netns", name)
	bad := func(suffix string, mk func(path string) error) string {
		p := good + "-" + suffix
		if err := mk(p); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = os.Remove(p) })
		return p
	}
	fifo := bad("fifo", func(p string) error { return syscall.Mkfifo(p, 0o600) })
	link := bad("link", func(p string) error { return os.Symlink("/proc/self/ns/net", p) })
	file := bad("file", func(p string) error { return os.WriteFile(p, nil, 0o600) })
	utsns := bad("uts", func(p string) error {
		if err := os.WriteFile(p, nil, 0o600); err != nil {
			return err
		}
		return syscall.Mount("/proc/self/ns/uts", p, "", syscall.MS_BIND, "")
	})
	t.Cleanup(func() { _ = syscall.Unmount(utsns, syscall.MNT_DETACH) })

	f, ino, err := netnsscan.OpenPath(good)
	if err != nil {
		t.Fatalf("OpenPath(%s): %v", good, err)
	}
	f.Close()
	if want, _ := netnsscan.Inode(good); ino != want || ino == 0 {
		t.Errorf("OpenPath(%s) gave inode %d, want %d", good, ino, want)
	}
	for _, p := range []string{fifo, link, file, utsns, "/proc/self/ns/net", t.TempDir(), "/run/netns/../netns/" + name, "run/netns/" + name} {
		done := make(chan error, 1)
		go func() {
			f, _, err := netnsscan.OpenPath(p)
			if f != nil {
				f.Close()
			}
			done <- err
		}()
		select {
		case err := <-done:
			if !errors.Is(err, netnsscan.ErrNotNetns) {
				t.Errorf("OpenPath(%s): %v, want ErrNotNetns", p, err)
			} else {
				t.Logf("OpenPath(%s): %v", p, err)
			}
		case <-time.After(3 * time.Second):
			t.Fatalf("OpenPath(%s) still blocked after 3 s", p)
		}
	}
}
