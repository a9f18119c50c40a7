// SPDX-License-Identifier: Apache-2.0

package netnsscan

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"golang.org/x/sys/unix"
)

// ErrNotThatProcess means a pid is no longer the process it was taken for:
// it exited (its number may be another process's now), or the process that
// has it is not in the cgroup it was found in.
var ErrNotThatProcess = errors.New("not the process it was found as")

// OpenPid opens the network namespace of process pid, only while pid is a
// process in the cgroup dir or below it (a directory below mount's point;
// the process's cgroup is placed by Mount.OfPID, so a daemon in a private
// cgroup namespace places it too). A pid found a while ago (in a cgroup's
// cgroup.procs, or in the runtime's account of a pod) may have exited and
// its number been given to another process, of another tenant, in another
// namespace; opening /proc/<pid>/ns/net would then give that namespace. So
// the process is held by a pidfd first: its cgroup is read
// (/proc/<pid>/cgroup), its namespace taken from the pidfd
// (PIDFD_GET_NET_NAMESPACE, Linux 6.11; /proc/<pid>/ns/net before), and the
// pidfd is asked last whether its process still lives: if it does, the pid
// was its all along, so what was read is its. The caller owns the file.
func OpenPid(pid int, mount cgroup.Mount, dir string) (*os.File, uint64, error) {
	pidfd, err := holdPid(pid, mount, dir)
	if err != nil {
		return nil, 0, err
	}
	defer unix.Close(pidfd)
	f, err := pidfdNetns(pidfd, pid)
	if err != nil {
		return nil, 0, err
	}
	// The last word: the pidfd's process has not exited, so neither read
	// above was of another process.
	if err := pidLives(pidfd, pid); err != nil {
		f.Close()
		return nil, 0, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return nil, 0, fmt.Errorf("reading the network namespace of pid %d: %w", pid, err)
	}
	return f, st.Ino, nil
}

// CheckPid returns nil when pid is a process in the cgroup dir or below it
// (a directory below mount's point), read as OpenPid reads it (through a
// pidfd, the process's liveness asked last), else ErrNotThatProcess: what
// a runtime's account of a pod (its cgroup, its sandbox's pid) is checked
// against.
func CheckPid(pid int, mount cgroup.Mount, dir string) error {
	pidfd, err := holdPid(pid, mount, dir)
	if err != nil {
		return err
	}
	defer unix.Close(pidfd)
	return pidLives(pidfd, pid)
}

// holdPid opens a pidfd of pid and checks that its process is in the
// cgroup dir or below; the caller closes the pidfd and asks pidLives last.
func holdPid(pid int, mount cgroup.Mount, dir string) (int, error) {
	if pid <= 0 {
		return -1, fmt.Errorf("pid %d: %w", pid, ErrNotThatProcess)
	}
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		if errors.Is(err, unix.ESRCH) {
			return -1, fmt.Errorf("pid %d has exited: %w", pid, ErrNotThatProcess)
		}
		return -1, fmt.Errorf("pidfd_open of pid %d: %w", pid, err)
	}
	cg, err := mount.OfPID(pid)
	switch {
	case errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ESRCH):
		err = fmt.Errorf("pid %d has exited: %w", pid, ErrNotThatProcess)
	case errors.Is(err, cgroup.ErrNotCgroup2):
		// In a cgroup the mount does not show: not below dir.
		err = fmt.Errorf("%w: %w", err, ErrNotThatProcess)
	case err != nil:
	case cg != dir && !strings.HasPrefix(cg, strings.TrimSuffix(dir, "/")+"/"):
		err = fmt.Errorf("pid %d is in %s, not in %s: %w", pid, cg, dir, ErrNotThatProcess)
	}
	if err != nil {
		unix.Close(pidfd)
		return -1, err
	}
	return pidfd, nil
}

// pidLives asks the pidfd whether its process still lives: if it does,
// pid was its all along.
func pidLives(pidfd, pid int) error {
	if err := unix.PidfdSendSignal(pidfd, 0, nil, 0); err != nil {
		if errors.Is(err, unix.ESRCH) {
			return fmt.Errorf("pid %d exited while it was read: %w", pid, ErrNotThatProcess)
		}
		return fmt.Errorf("pid %d: %w", pid, err)
	}
	return nil
}

// pidfdNetns opens the network namespace of the pidfd's process.
func pidfdNetns(pidfd, pid int) (*os.File, error) {
	path := "/proc/" + strconv.Itoa(pid) + "/ns/net"
	fd, err := unix.IoctlRetInt(pidfd, unix.PIDFD_GET_NET_NAMESPACE)
	switch {
	case err == nil:
		return os.NewFile(uintptr(fd), path), nil
	case errors.Is(err, unix.ESRCH):
		return nil, fmt.Errorf("pid %d has exited: %w", pid, ErrNotThatProcess)
	case !errors.Is(err, unix.ENOTTY) && !errors.Is(err, unix.EINVAL):
		return nil, fmt.Errorf("the network namespace of pid %d: %w", pid, err)
	}
	// A kernel before 6.11: by the pid, checked by the caller's liveness
	// test.
	f, err := os.Open(path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("pid %d has exited: %w", pid, ErrNotThatProcess)
		}
		return nil, err
	}
	return f, nil
}
