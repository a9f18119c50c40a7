// SPDX-License-Identifier: Apache-2.0

package netnsscan_test

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/netnsscan"
	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// reusePid starts cmd in the cgroup dir with the pid want, which must be
// free: the kernel's next pid is set to it (ns_last_pid), so the test can
// make a pid reuse happen instead of waiting for one. Other processes of
// the machine may take the pid first: it tries a few times, and skips if
// it never gets it.
func reusePid(t *testing.T, want int, dir string, mk func() *exec.Cmd) *exec.Cmd {
	t.Helper()
	for range 20 {
		if err := os.WriteFile("/proc/sys/kernel/ns_last_pid", []byte(strconv.Itoa(want-1)), 0); err != nil {
			t.Skipf("cannot choose the next pid: %v", err)
		}
		cmd := mk()
		testutil.StartInCgroup(t, cmd, dir)
		if cmd.Process.Pid == want {
			return cmd
		}
		testutil.Stop(cmd)
	}
	t.Skipf("pid %d was taken by another process 20 times", want)
	return nil
}

// TestOpenPid: a process's network namespace is opened through its pid
// only while the pid is a process of the cgroup it was found in (or
// below): a process of another cgroup, one that exited (reaped or not),
// and a pid reused by another process in another cgroup and namespace
// after the first exited are each refused, never opened as that
// process's.
func TestOpenPid(t *testing.T) {
	testutil.RequireRoot(t)
	mnt, err := cgroup.FindMount()
	if err != nil {
		t.Fatal(err)
	}
	top := testutil.TempCgroup(t, mnt.Point, "fairshare-pidfd-")
	pod := testutil.MkCgroup(t, top, "pod")
	ctr := testutil.MkCgroup(t, pod, "sandbox")
	other := testutil.MkCgroup(t, top, "other")

	sandbox := inNewNetns(t, ctr)
	pid := sandbox.Process.Pid
	f, ino, err := netnsscan.OpenPid(pid, mnt, pod)
	if err != nil {
		t.Fatalf("the sandbox below the pod's cgroup: %v", err)
	}
	f.Close()
	if want := inode(t, pid); ino != want {
		t.Errorf("opened namespace %d, the sandbox's is %d", ino, want)
	}
	if _, _, err := netnsscan.OpenPid(pid, mnt, other); !errors.Is(err, netnsscan.ErrNotThatProcess) {
		t.Errorf("checked against another cgroup: %v", err)
	}
	// A sibling whose name begins with the cgroup's is not below it.
	if _, _, err := netnsscan.OpenPid(pid, mnt, filepath.Join(top, "po")); !errors.Is(err, netnsscan.ErrNotThatProcess) {
		t.Errorf("checked against a prefix of its cgroup's name: %v", err)
	}

	// Exited, not reaped yet (a zombie keeps its pid).
	zombie := inNewNetns(t, ctr)
	zombie.Process.Signal(syscall.SIGKILL)
	for {
		b, _ := os.ReadFile("/proc/" + strconv.Itoa(zombie.Process.Pid) + "/stat")
		if len(b) == 0 || containsState(b, 'Z') {
			break
		}
	}
	if f, _, err := netnsscan.OpenPid(zombie.Process.Pid, mnt, pod); !errors.Is(err, netnsscan.ErrNotThatProcess) {
		if f != nil {
			f.Close()
		}
		t.Errorf("a process that exited, not reaped: %v", err)
	}
	testutil.Stop(zombie)
	if _, _, err := netnsscan.OpenPid(zombie.Process.Pid, mnt, pod); !errors.Is(err, netnsscan.ErrNotThatProcess) {
		t.Errorf("a process that exited and was reaped: %v", err)
	}

	// The sandbox exits; its pid goes to a process of another cgroup in a
	// namespace of its own (another tenant's).
	testutil.Stop(sandbox)
	reused := reusePid(t, pid, other, func() *exec.Cmd {
		cmd := exec.Command("sleep", "60")
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
		return cmd
	})
	if f, ino, err := netnsscan.OpenPid(pid, mnt, pod); !errors.Is(err, netnsscan.ErrNotThatProcess) {
		if f != nil {
			f.Close()
		}
		t.Errorf("pid %d reused by a process of %s (namespace %d): opened %d, %v", pid, other, inode(t, reused.Process.Pid), ino, err)
	}
}

// containsState says whether a /proc/<pid>/stat line shows state s.
func containsState(stat []byte, s byte) bool {
	for i := len(stat) - 1; i > 0; i-- {
		if stat[i] == ')' {
			return i+2 < len(stat) && stat[i+2] == s
		}
	}
	return false
}
