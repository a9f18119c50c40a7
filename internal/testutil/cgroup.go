// SPDX-License-Identifier: Apache-2.0

package testutil

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"golang.org/x/sys/unix"
)

// RequireRoot skips tests that create cgroups, move processes into them or
// load BPF programs: all of these need root (CAP_SYS_ADMIN, CAP_BPF).
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN) to load BPF and create cgroups")
	}
}

// Cgroup2Mount returns the mount point of the cgroup v2 hierarchy
// (cgroup.FindMount); it skips the test when there is none.
func Cgroup2Mount(t testing.TB) string {
	t.Helper()
	m, err := cgroup.FindMount()
	if errors.Is(err, cgroup.ErrNoCgroup2) {
		t.Skip("no cgroup2 mount in /proc/self/mountinfo")
	}
	if err != nil {
		t.Fatal(err)
	}
	return m.Point
}

// TempCgroup creates a cgroup directory below parent (os.MkdirTemp pattern)
// and removes it with everything below it when the test ends, failed or not.
func TempCgroup(t testing.TB, parent, pattern string) string {
	t.Helper()
	dir, err := os.MkdirTemp(parent, pattern)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { RemoveCgroup(t, dir) })
	return dir
}

// MkCgroup creates the cgroup parent/name and removes it with everything
// below it when the test ends, failed or not.
func MkCgroup(t testing.TB, parent, name string) string {
	t.Helper()
	dir := filepath.Join(parent, name)
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { RemoveCgroup(t, dir) })
	return dir
}

// RemoveCgroup removes the cgroup dir with everything below it, killing
// what still runs inside (cgroup.RemoveTree), and fails the test if it
// cannot.
func RemoveCgroup(t testing.TB, dir string) {
	t.Helper()
	if err := cgroup.RemoveTree(dir); err != nil {
		t.Error(err)
	}
}

// InCgroup makes cmd start inside the cgroup dir: clone3 places the child
// there, so it never runs outside it. Other SysProcAttr fields are kept.
// The directory descriptor is closed when the test ends, so cmd must be
// started within the test.
func InCgroup(t testing.TB, cmd *exec.Cmd, dir string) {
	t.Helper()
	fd, err := unix.Open(dir, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.UseCgroupFD = true
	cmd.SysProcAttr.CgroupFD = fd
}

// StartInCgroup starts cmd inside the cgroup dir (see InCgroup) and kills
// and reaps it when the test ends, unless it has been waited for already.
// Pipes the caller needs must be set up before.
func StartInCgroup(t testing.TB, cmd *exec.Cmd, dir string) {
	t.Helper()
	InCgroup(t, cmd, dir)
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting %s in cgroup %s: %v", cmd.Path, dir, err)
	}
	t.Cleanup(func() { Stop(cmd) })
}

// MoveToCgroup moves the running process pid into the cgroup dir, as a
// runtime does (a write of its pid to cgroup.procs).
func MoveToCgroup(t testing.TB, pid int, dir string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
		t.Fatalf("moving pid %d to %s: %v", pid, dir, err)
	}
}

// Stop kills a started cmd and waits for it, unless it has been waited for
// already.
func Stop(cmd *exec.Cmd) {
	if cmd.ProcessState == nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}
}
