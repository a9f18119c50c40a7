// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// What cleanup removes is what the loader makes in a pin directory, and
// nothing else (guardPinDir checks it all before anything goes):
//
//   - pinned maps, fs_* (the programs' maps pinned by name, those of an
//     earlier layout and a replaced map's temporary fs_*_old included);
//   - pinned links, link_* (the hooks' links, a retired version's and
//     pinOver's temporary link_*_new included);
//   - netnsDir/, the sk_lookup links of the attached network namespaces,
//     each named by the namespace's cookie (decimal);
//   - stagingDir/ and readyDir/, an interrupted migration's maps and links
//     (fs_*, link_*).
//
// A directory that is not on a bpf file system, or is the root of a bpf
// file system mount, is never a pin directory; neither is one holding
// anything else, which is somebody else's and is left alone, with the
// directory and every pin in it: a cleanup pointed at the wrong directory
// (the state directory, /sys/fs/bpf, another tool's) removes nothing.

// ErrNotPinDir means the directory given to Cleanup or CleanupPinDir is
// not one the loader pins in: not on a bpf file system, the root of one,
// not a directory, or holding entries the loader never makes. Nothing was
// removed. The error wrapping it says which, and lists the entries.
var ErrNotPinDir = errors.New("not a fairshare pin directory")

// errNoPinDir is guardPinDir's answer for a directory that does not exist.
var errNoPinDir = errors.New("the pin directory does not exist")

// CleanupReport says what CleanupPinDir found.
type CleanupReport struct {
	// Missing: the pin directory does not exist, so nothing is pinned
	// there and nothing was done.
	Missing bool
	// Pins counts the pins it held (maps and links, those of the
	// network namespaces and of an interrupted migration included); 0
	// with Missing false is an empty directory, removed.
	Pins int
}

// CleanupPinDir is Cleanup for a caller that must tell what it found: a
// missing directory is reported (Missing), not an error. A directory that
// is not a pin directory of the loader's is refused with an error wrapping
// ErrNotPinDir, and nothing is removed.
func CleanupPinDir(pinDir string) (CleanupReport, error) {
	if pinDir == "" {
		pinDir = DefaultPinDir
	}
	scan, err := scanPinDir(pinDir, false)
	if errors.Is(err, errNoPinDir) {
		return CleanupReport{Missing: true}, nil
	}
	if err != nil {
		return CleanupReport{}, err
	}
	return CleanupReport{Pins: scan.pins}, cleanup(pinDir, true)
}

// PinDirsIn lists the directories directly in dir that hold the loader's
// pins (a pinned fs_config), sorted: where the pins are when a pin
// directory named is not. Nothing if dir is not on a bpf file system or
// cannot be read.
func PinDirsIn(dir string) []string {
	var sfs unix.Statfs_t
	if unix.Statfs(dir, &sfs) != nil || sfs.Type != unix.BPF_FS_MAGIC {
		return nil
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range ents {
		if !e.IsDir() {
			continue
		}
		p := filepath.Join(dir, e.Name())
		if _, err := os.Lstat(filepath.Join(p, "fs_config")); err == nil {
			out = append(out, p)
		}
	}
	return out
}

// pinScan is what guardPinDir found in a pin directory.
type pinScan struct {
	ents []os.DirEntry // its top level
	pins int           // pins in it and its subdirectories
}

// guardPinDir checks that pinDir is a pin directory of the loader's (see
// above) and returns its top-level entries; errNoPinDir if it does not
// exist, an error wrapping ErrNotPinDir if it is not one. opened: pinDir
// is /proc/self/fd/N of a directory the caller holds open (CleanupOpened),
// which is followed, and may have been removed (then it is empty); any
// other pinDir that is a symbolic link is refused.
func guardPinDir(pinDir string, opened bool) ([]os.DirEntry, error) {
	scan, err := scanPinDir(pinDir, opened)
	if err != nil {
		return nil, err
	}
	return scan.ents, nil
}

func scanPinDir(pinDir string, opened bool) (*pinScan, error) {
	flags := unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC
	if !opened {
		flags |= unix.O_NOFOLLOW
	}
	fd, err := unix.Open(pinDir, flags, 0)
	switch {
	case errors.Is(err, unix.ENOENT):
		return nil, errNoPinDir
	case (errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR)) && !opened && isSymlink(pinDir):
		return nil, fmt.Errorf("%s is a symbolic link, not a pin directory: give the directory itself: %w", pinDir, ErrNotPinDir)
	case errors.Is(err, unix.ENOTDIR):
		return nil, fmt.Errorf("%s is not a directory: %w", pinDir, ErrNotPinDir)
	case err != nil:
		return nil, fmt.Errorf("opening the pin directory %s: %w", pinDir, err)
	}
	dir := os.NewFile(uintptr(fd), pinDir)
	defer dir.Close()

	var sfs unix.Statfs_t
	if err := unix.Fstatfs(fd, &sfs); err != nil {
		return nil, fmt.Errorf("reading the file system of %s: %w", pinDir, err)
	}
	if sfs.Type != unix.BPF_FS_MAGIC {
		return nil, fmt.Errorf("%s is not on a bpf file system (it is on %s): fairshare pins only on bpffs, "+
			"in pin_dir (/sys/fs/bpf/fairshare by default), not in the state directory or elsewhere: %w",
			pinDir, fsTypeName(sfs.Type), ErrNotPinDir)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("reading %s: %w", pinDir, err)
	}
	// A directory removed while open (CleanupOpened) is empty, and has
	// no parent.
	if st.Nlink == 0 {
		return &pinScan{}, nil
	}
	var parent unix.Stat_t
	if err := unix.Fstatat(fd, "..", &parent, 0); err != nil {
		return nil, fmt.Errorf("reading the parent of %s: %w", pinDir, err)
	}
	if parent.Dev != st.Dev || parent.Ino == st.Ino {
		return nil, fmt.Errorf("%s is the root of a bpf file system mount, not a pin directory: fairshare pins in a "+
			"directory of its own below it (pin_dir, /sys/fs/bpf/fairshare by default), and what else is there is "+
			"other programs' pins: %w", pinDir, ErrNotPinDir)
	}

	ents, err := dir.ReadDir(-1)
	if err != nil {
		return nil, fmt.Errorf("reading pin directory %s: %w", pinDir, err)
	}
	scan := &pinScan{ents: ents}
	var strangers []string
	for _, e := range ents {
		name := e.Name()
		switch {
		case e.IsDir() && name == netnsDir:
			n, s, err := scanPinSubdir(pinDir, name, isNetnsPin)
			if err != nil {
				return nil, err
			}
			scan.pins += n
			strangers = append(strangers, s...)
		case e.IsDir() && (name == stagingDir || name == readyDir):
			n, s, err := scanPinSubdir(pinDir, name, isTopPin)
			if err != nil {
				return nil, err
			}
			scan.pins += n
			strangers = append(strangers, s...)
		case isPinEntry(e) && isTopPin(name):
			scan.pins++
		default:
			strangers = append(strangers, entryName(e, ""))
		}
	}
	if len(strangers) == 0 {
		return scan, nil
	}
	slices.Sort(strangers)
	if scan.pins == 0 {
		return nil, fmt.Errorf("%s holds no fairshare pins but %s: it is not a fairshare pin directory "+
			"(fairshare pins fs_*, link_*, %s/, %s/ and %s/); nothing was removed: %w",
			pinDir, listNames(strangers), netnsDir, stagingDir, readyDir, ErrNotPinDir)
	}
	return nil, fmt.Errorf("%s holds fairshare's pins and entries fairshare never makes: %s; "+
		"refusing to remove anything there (move those away, or remove them if they are no one's, and run cleanup again): %w",
		pinDir, listNames(strangers), ErrNotPinDir)
}

// scanPinSubdir counts the pins in the subdirectory sub of pinDir that
// ours accepts by name, and lists the other entries (as sub/name).
func scanPinSubdir(pinDir, sub string, ours func(string) bool) (int, []string, error) {
	ents, err := os.ReadDir(filepath.Join(pinDir, sub))
	if err != nil {
		return 0, nil, fmt.Errorf("reading %s: %w", filepath.Join(pinDir, sub), err)
	}
	n := 0
	var strangers []string
	for _, e := range ents {
		if isPinEntry(e) && ours(e.Name()) {
			n++
			continue
		}
		strangers = append(strangers, entryName(e, sub))
	}
	return n, strangers, nil
}

// isSymlink says whether path is a symbolic link.
func isSymlink(path string) bool {
	fi, err := os.Lstat(path)
	return err == nil && fi.Mode()&fs.ModeSymlink != 0
}

// isTopPin says whether name is one the loader gives a pinned map or link.
func isTopPin(name string) bool {
	return strings.HasPrefix(name, "fs_") || strings.HasPrefix(name, "link_")
}

// isNetnsPin says whether name is a network namespace's link's (its
// cookie, AttachNetns).
func isNetnsPin(name string) bool {
	_, err := strconv.ParseUint(name, 10, 64)
	return err == nil
}

// isPinEntry says whether e can be a pin: a bpffs object, not a directory
// or a symbolic link (the loader makes neither under those names).
func isPinEntry(e fs.DirEntry) bool {
	return e.Type()&(fs.ModeDir|fs.ModeSymlink) == 0
}

func entryName(e fs.DirEntry, sub string) string {
	name := e.Name()
	if sub != "" {
		name = sub + "/" + name
	}
	if e.IsDir() {
		name += "/"
	}
	return name
}

// listNames lists names for a message, at most ten of them.
func listNames(names []string) string {
	const most = 10
	if len(names) <= most {
		return strings.Join(names, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(names[:most], ", "), len(names)-most)
}

// fsTypeName names a file system by its statfs magic, for a message.
func fsTypeName(magic int64) string {
	switch magic {
	case unix.EXT4_SUPER_MAGIC:
		return "ext2/3/4"
	case unix.XFS_SUPER_MAGIC:
		return "xfs"
	case unix.BTRFS_SUPER_MAGIC:
		return "btrfs"
	case unix.TMPFS_MAGIC:
		return "tmpfs"
	case unix.OVERLAYFS_SUPER_MAGIC:
		return "overlayfs"
	case unix.SYSFS_MAGIC:
		return "sysfs"
	case unix.PROC_SUPER_MAGIC:
		return "procfs"
	case unix.CGROUP2_SUPER_MAGIC:
		return "cgroup2"
	}
	return fmt.Sprintf("a file system of type %#x", uint64(magic))
}
