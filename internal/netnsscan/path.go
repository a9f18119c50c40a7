// SPDX-License-Identifier: Apache-2.0

package netnsscan

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"golang.org/x/sys/unix"
)

// ErrNotNetns means a path a container runtime gave as a pod's network
// namespace is not one: outside the runtimes' directories, a symbolic link,
// or a file other than a network namespace's.
var ErrNotNetns = errors.New("not a network namespace the runtime mounted")

// RuntimeNetnsDirs are where container runtimes bind-mount the network
// namespaces of pods (containerd's cni-<uuid>, CRI-O's, ip netns): the only
// directories OpenPath opens a namespace in. /var/run is /run on most
// systems; both are named, as runtimes write either.
var RuntimeNetnsDirs = []string{"/run/netns", "/var/run/netns"}

// OpenPath opens the network namespace a container runtime bind-mounted at
// path, for a pod whose sandbox's pid the runtime did not give (with a pid,
// OpenPid). The runtime's word is not trusted with more than a name in
// RuntimeNetnsDirs: the path must be one directly in them, is opened
// without following a last symbolic link and without blocking (a FIFO
// named there would otherwise hang the caller), and must be a network
// namespace (nsfs, NS_GET_NSTYPE); anything else is ErrNotNetns. It returns
// the namespace's inode; the caller owns the file.
func OpenPath(path string) (*os.File, uint64, error) {
	if !filepath.IsAbs(path) || filepath.Clean(path) != path || !slices.Contains(RuntimeNetnsDirs, filepath.Dir(path)) {
		return nil, 0, fmt.Errorf("%s is not a name in %v: %w", path, RuntimeNetnsDirs, ErrNotNetns)
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	if errors.Is(err, unix.ELOOP) {
		return nil, 0, fmt.Errorf("%s is a symbolic link: %w", path, ErrNotNetns)
	} else if err != nil {
		return nil, 0, &os.PathError{Op: "open", Path: path, Err: err}
	}
	f := os.NewFile(uintptr(fd), path)
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(fd, &sfs); err != nil {
		f.Close()
		return nil, 0, fmt.Errorf("statfs %s: %w", path, err)
	}
	if sfs.Type != unix.NSFS_MAGIC {
		f.Close()
		return nil, 0, fmt.Errorf("%s is not a namespace's file (file system magic %#x): %w", path, sfs.Type, ErrNotNetns)
	}
	if t, err := unix.IoctlRetInt(fd, unix.NS_GET_NSTYPE); err != nil || t != unix.CLONE_NEWNET {
		f.Close()
		return nil, 0, fmt.Errorf("%s is not a network namespace (type %#x, %v): %w", path, t, err, ErrNotNetns)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		f.Close()
		return nil, 0, fmt.Errorf("stat %s: %w", path, err)
	}
	return f, st.Ino, nil
}
