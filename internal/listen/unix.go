// SPDX-License-Identifier: Apache-2.0

package listen

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

var (
	// ErrInUse means a live server already answers on the socket path.
	ErrInUse = errors.New("socket is in use by a live server")
	// ErrNotSocket means the path holds something other than a socket,
	// which Unix does not remove.
	ErrNotSocket = errors.New("path exists and is not a socket")
	// ErrUnsafeDir means a directory on the way to the socket could be
	// changed by a user other than root (or the daemon's own), who could
	// then swap the socket, or a directory, for a link to another file.
	ErrUnsafeDir = errors.New("socket directory is writable by another user")
)

// DirMode is the mode of a socket directory Unix creates: anyone may reach
// a socket in it by name (the socket's own mode and the server's credential
// check decide who may connect), nobody but its owner may list it.
const DirMode os.FileMode = 0o711

// MaxPathLen is the longest unix socket path: sun_path holds 108 bytes with
// the terminating NUL.
const MaxPathLen = 107

// testHookAfterBind, if set, runs between the bind and the checks after
// it: tests swap the socket there.
var testHookAfterBind func(path string)

// umaskMu serialises the umask dance of Unix (the umask is per process).
var umaskMu sync.Mutex

// Unix listens on a unix stream socket at path with mode, and group gid
// when gid >= 0. See the package documentation for what it does with the
// path and its directory. warning, if not empty, says why some of the
// socket's intended users cannot reach it.
func Unix(path string, mode os.FileMode, gid int) (ln *net.UnixListener, warning string, err error) {
	if !filepath.IsAbs(path) {
		return nil, "", fmt.Errorf("socket path %q is not absolute", path)
	}
	if len(path) > MaxPathLen {
		return nil, "", fmt.Errorf("socket path %q is %d bytes, longer than a unix socket path may be (%d)", path, len(path), MaxPathLen)
	}
	dir := filepath.Dir(path)
	if err := makeDir(dir); err != nil {
		return nil, "", err
	}
	if err := clearPath(path); err != nil {
		return nil, "", err
	}
	// The umask gives the socket its exact mode from the first moment: no
	// chmod by path afterwards, which would follow a link put there.
	umaskMu.Lock()
	old := syscall.Umask(int(0o777 &^ mode.Perm()))
	ln, err = net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	syscall.Umask(old)
	umaskMu.Unlock()
	if err != nil {
		return nil, "", fmt.Errorf("listening on %s: %w", path, err)
	}
	ln.SetUnlinkOnClose(true)
	if testHookAfterBind != nil {
		testHookAfterBind(path)
	}
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		ln.Close()
		return nil, "", fmt.Errorf("%s changed under the listener (%v); refusing it", path, err)
	}
	if os.FileMode(st.Mode&0o777) != mode.Perm() {
		// A default ACL on the directory overrides the umask. The
		// directories up to here are root's alone (makeDir), so nobody
		// can have swapped the socket for a link meanwhile.
		if err := os.Chmod(path, mode.Perm()); err != nil {
			ln.Close()
			return nil, "", fmt.Errorf("setting the mode of %s: %w", path, err)
		}
	}
	if gid >= 0 {
		// Lchown: a link at the path is changed, never what it points to.
		if err := os.Lchown(path, -1, gid); err != nil {
			ln.Close()
			return nil, "", fmt.Errorf("setting the group of %s to %d: %w", path, gid, err)
		}
	}
	return ln, reachable(path, mode, gid), nil
}

// CheckUnix checks, without creating or removing anything, what Unix would
// refuse at path: a relative or too long path, a directory on the way that
// is not one or that another user could change (ErrUnsafeDir), a file at
// the path that is not a socket (ErrNotSocket), a live server on it
// (ErrInUse). A daemon calls it for every socket before it creates any, so
// a start it refuses leaves nothing behind. A stale socket passes: Unix
// removes it.
func CheckUnix(path string) error {
	if !filepath.IsAbs(path) {
		return fmt.Errorf("socket path %q is not absolute", path)
	}
	if len(path) > MaxPathLen {
		return fmt.Errorf("socket path %q is %d bytes, longer than a unix socket path may be (%d)", path, len(path), MaxPathLen)
	}
	existing := filepath.Dir(path)
	for {
		_, err := os.Lstat(existing)
		if err == nil {
			break
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("checking socket directory %s: %w", existing, err)
		}
		parent := filepath.Dir(existing)
		if parent == existing {
			break
		}
		existing = parent
	}
	if err := safeDirs(existing); err != nil {
		return err
	}
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("checking %s: %w", path, err)
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("%s is %s, not a socket; not removing it (remove it yourself or choose another path): %w",
			path, kind(fi.Mode()), ErrNotSocket)
	}
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		c.Close()
		return fmt.Errorf("%s: %w", path, ErrInUse)
	}
	return nil
}

// makeDir makes sure dir exists and that only root (or the process's own
// user) can change it or any directory above it: creating what is missing
// with exactly DirMode (whatever the umask), refusing a directory someone
// else could write (ErrUnsafeDir). A world-writable directory with the
// sticky bit (/tmp) is accepted: nobody can rename or remove what others
// made in it.
func makeDir(dir string) error {
	dir = filepath.Clean(dir)
	// The deepest directory that exists, and what is missing below it.
	existing, missing := dir, []string(nil)
	for {
		_, err := os.Lstat(existing)
		if err == nil {
			break
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("checking socket directory %s: %w", existing, err)
		}
		missing = append(missing, existing)
		parent := filepath.Dir(existing)
		if parent == existing {
			break
		}
		existing = parent
	}
	if err := safeDirs(existing); err != nil {
		return err
	}
	for i := len(missing) - 1; i >= 0; i-- {
		d := missing[i]
		if err := os.Mkdir(d, DirMode); err != nil && !errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("creating socket directory %s: %w", d, err)
		}
		// The umask may have taken bits away (UMask=0077 gives 0700,
		// which keeps a socket's group out).
		if err := os.Chmod(d, DirMode); err != nil {
			return fmt.Errorf("setting the mode of socket directory %s: %w", d, err)
		}
	}
	if len(missing) > 0 {
		// Made by someone else between the checks, perhaps: check again.
		return safeDirs(dir)
	}
	return nil
}

// safeDirs checks dir and every directory above it, both as written and
// with symbolic links resolved; a link on the way must be root's (or
// ours) too.
func safeDirs(dir string) error {
	real, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return fmt.Errorf("checking socket directory %s: %w", dir, err)
	}
	if err := safeChain(dir); err != nil {
		return err
	}
	if real != dir {
		return safeChain(real)
	}
	return nil
}

func safeChain(dir string) error {
	euid := uint32(os.Geteuid())
	for d := filepath.Clean(dir); ; d = filepath.Dir(d) {
		var st unix.Stat_t
		if err := unix.Lstat(d, &st); err != nil {
			return fmt.Errorf("checking socket directory %s: %w", d, err)
		}
		m := st.Mode & 0o7777
		link := st.Mode&unix.S_IFMT == unix.S_IFLNK
		switch {
		case st.Mode&unix.S_IFMT != unix.S_IFDIR && !link:
			return fmt.Errorf("%s is not a directory", d)
		case st.Uid != 0 && st.Uid != euid:
			return fmt.Errorf("%s (mode %04o) belongs to uid %d, who could swap the socket; use a directory of root's: %w",
				d, m, st.Uid, ErrUnsafeDir)
		case !link && m&0o022 != 0 && m&unix.S_ISVTX == 0:
			return fmt.Errorf("%s (mode %04o) is writable by its group or by others, who could swap the socket; "+
				"use a directory only root can write (0755 or 0711): %w", d, m, ErrUnsafeDir)
		}
		if d == "/" || d == "." {
			return nil
		}
	}
}

// clearPath makes room for the socket: nothing there, or a stale socket
// (removed). A live socket or any other file is an error naming the path.
func clearPath(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("checking %s: %w", path, err)
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("%s is %s, not a socket; not removing it (remove it yourself or choose another path): %w",
			path, kind(fi.Mode()), ErrNotSocket)
	}
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		c.Close()
		return fmt.Errorf("%s: %w", path, ErrInUse)
	}
	// A socket nobody answers on: left by a daemon that was killed.
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("removing the stale socket %s: %w", path, err)
	}
	return nil
}

func kind(m fs.FileMode) string {
	switch m.Type() {
	case 0:
		return "a regular file"
	case fs.ModeDir:
		return "a directory"
	case fs.ModeSymlink:
		return "a symbolic link"
	case fs.ModeNamedPipe:
		return "a named pipe"
	case fs.ModeDevice, fs.ModeDevice | fs.ModeCharDevice:
		return "a device"
	default:
		return "a " + m.Type().String() + " file"
	}
}

// reachable checks that every directory above path lets through the users
// the socket's mode is for: others when the mode grants others access,
// members of gid when it grants the group access. It returns what blocks
// them, or "".
func reachable(path string, mode os.FileMode, gid int) string {
	others := mode&0o006 != 0
	group := gid >= 0 && mode&0o060 != 0
	if !others && !group {
		return ""
	}
	for dir := filepath.Dir(path); ; dir = filepath.Dir(dir) {
		var st unix.Stat_t
		if err := unix.Stat(dir, &st); err != nil {
			return fmt.Sprintf("cannot check %s: %v", dir, err)
		}
		m := st.Mode & 0o777
		switch {
		case m&0o001 != 0:
		case others:
			return fmt.Sprintf("directory %s (mode %04o) does not let other users reach %s; give it o+x (0711)", dir, m, path)
		case m&0o010 != 0 && int(st.Gid) == gid:
		default:
			return fmt.Sprintf("directory %s (mode %04o, group %d) does not let group %d reach %s; give it o+x (0711)",
				dir, m, st.Gid, gid, path)
		}
		if dir == "/" || dir == "." {
			return ""
		}
	}
}

// RaiseFileLimit raises the soft RLIMIT_NOFILE to the hard limit and
// returns the limit in force. (The Go runtime does the same at start; doing
// it here makes the number the daemon budgets with the one it has.)
func RaiseFileLimit() (uint64, error) {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
		return 0, fmt.Errorf("reading RLIMIT_NOFILE: %w", err)
	}
	if rl.Cur < rl.Max {
		rl.Cur = rl.Max
		if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
			return 0, fmt.Errorf("raising RLIMIT_NOFILE to %d: %w", rl.Max, err)
		}
	}
	return rl.Cur, nil
}
