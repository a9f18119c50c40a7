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
)

// DirMode is the mode of a socket directory Unix creates: anyone may reach
// a socket in it by name (the socket's own mode and the server's credential
// check decide who may connect), nobody but its owner may list it.
const DirMode os.FileMode = 0o711

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
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, DirMode); err != nil {
		return nil, "", fmt.Errorf("creating socket directory %s: %w", dir, err)
	}
	if err := clearPath(path); err != nil {
		return nil, "", err
	}
	umaskMu.Lock()
	old := syscall.Umask(int(0o777 &^ mode.Perm()))
	ln, err = net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	syscall.Umask(old)
	umaskMu.Unlock()
	if err != nil {
		return nil, "", fmt.Errorf("listening on %s: %w", path, err)
	}
	ln.SetUnlinkOnClose(true)
	// The umask can only take bits away; set the exact mode and group.
	if err := os.Chmod(path, mode.Perm()); err != nil {
		ln.Close()
		return nil, "", fmt.Errorf("setting the mode of %s: %w", path, err)
	}
	if gid >= 0 {
		if err := os.Chown(path, -1, gid); err != nil {
			ln.Close()
			return nil, "", fmt.Errorf("setting the group of %s to %d: %w", path, gid, err)
		}
	}
	return ln, reachable(path, mode, gid), nil
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
