// SPDX-License-Identifier: Apache-2.0

package netnsscan_test

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
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

// TestOpenPidCgroupns: a daemon in a private cgroup namespace (a
// container's, the host's hierarchy mounted) opens the namespace of a pod's
// process by the pod's cgroup, and still refuses it by another's. Its
// /proc/<pid>/cgroup reads "0::/../pods/pod/sandbox"; taken as a path below
// the mount, that was no cgroup, and every pod's process was refused.
func TestOpenPidCgroupns(t *testing.T) {
	if env := os.Getenv("FS_TEST_CGNS_OPEN"); env != "" {
		openInNamespace(t, env) // the daemon's stand-in, run by the test below
		return
	}
	testutil.RequireRoot(t)
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-pidfd-cgns-")
	nsRoot := testutil.MkCgroup(t, testutil.MkCgroup(t, top, "daemon"), "ctr")
	pod := testutil.MkCgroup(t, testutil.MkCgroup(t, top, "pods"), "pod")
	other := testutil.MkCgroup(t, filepath.Dir(pod), "other")
	sandbox := inNewNetns(t, testutil.MkCgroup(t, pod, "sandbox"))
	reader := exec.Command("unshare", "-C", os.Args[0], "-test.run=^TestOpenPidCgroupns$", "-test.v")
	reader.Env = append(os.Environ(), "FS_TEST_CGNS_OPEN="+strconv.Itoa(sandbox.Process.Pid)+";"+pod+";"+other)
	testutil.InCgroup(t, reader, nsRoot)
	out, err := reader.CombinedOutput()
	if err != nil {
		t.Fatalf("OpenPid in a cgroup namespace rooted at %s: %v\n%s", nsRoot, err, out)
	}
	t.Logf("OpenPid in a cgroup namespace rooted at %s:\n%s", nsRoot, out)
}

// openInNamespace runs OpenPid of "pid;pod;other" in a private cgroup
// namespace: opened by pod, refused by other.
func openInNamespace(t *testing.T, env string) {
	args := strings.Split(env, ";")
	pid, _ := strconv.Atoi(args[0])
	mnt, err := cgroup.FindMount()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(mnt.Root, "/..") {
		t.Fatalf("not in a private cgroup namespace: mount %+v", mnt)
	}
	f, ino, err := netnsscan.OpenPid(pid, mnt, args[1])
	if err != nil {
		t.Fatalf("OpenPid(%d) by its pod's cgroup %s (mount %+v): %v", pid, args[1], mnt, err)
	}
	f.Close()
	t.Logf("pid %d opened by %s: namespace %d", pid, args[1], ino)
	if f, _, err := netnsscan.OpenPid(pid, mnt, args[2]); !errors.Is(err, netnsscan.ErrNotThatProcess) {
		if f != nil {
			f.Close()
		}
		t.Errorf("OpenPid(%d) by another cgroup %s: %v; want ErrNotThatProcess", pid, args[2], err)
	}
}
