// SPDX-License-Identifier: Apache-2.0

package cgroup

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

var (
	// ErrNoCgroup2 means no cgroup2 file system is mounted.
	ErrNoCgroup2 = errors.New("cgroup2 is not mounted")
	// ErrNotCgroup2 means a directory is not on the cgroup2 hierarchy.
	ErrNotCgroup2 = errors.New("not a directory on cgroup2")
)

// Mount is where the cgroup2 hierarchy is mounted.
type Mount struct {
	// Point is the mount point: /sys/fs/cgroup (unified layout) or
	// /sys/fs/cgroup/unified (hybrid).
	Point string
	// Root is the hierarchy's path shown at Point: "/", except inside a
	// cgroup namespace, where it is the namespace's root.
	Root string
}

// FindMount reads the first cgroup2 mount of /proc/self/mountinfo.
func FindMount() (Mount, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return Mount{}, fmt.Errorf("reading mounts: %w", err)
	}
	defer f.Close()
	return ParseMountInfo(f)
}

// ParseMountInfo finds the first cgroup2 line of a mountinfo file.
func ParseMountInfo(r io.Reader) (Mount, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		if !ok {
			continue
		}
		fields, postFields := strings.Fields(pre), strings.Fields(post)
		if len(fields) < 5 || len(postFields) < 1 || postFields[0] != "cgroup2" {
			continue
		}
		return Mount{Root: unescape(fields[3]), Point: unescape(fields[4])}, nil
	}
	if err := sc.Err(); err != nil {
		return Mount{}, fmt.Errorf("reading mounts: %w", err)
	}
	return Mount{}, ErrNoCgroup2
}

// unescape undoes the octal escapes (\040 for a space) of mountinfo.
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// Contains reports whether dir (absolute, clean) is the mount point or below
// it.
func (m Mount) Contains(dir string) bool {
	return dir == m.Point || strings.HasPrefix(dir, strings.TrimSuffix(m.Point, "/")+"/")
}

// Path turns a cgroup as an operator writes it into its directory: a
// directory below the mount point as it is, anything else as a path below
// the mount (the form /proc/<pid>/cgroup shows: /system.slice/x.service,
// or kubepods/burstable/pod<uid>). The result is clean and below Point, the
// mount point itself included.
func (m Mount) Path(raw string) string {
	if filepath.IsAbs(raw) && m.Contains(filepath.Clean(raw)) {
		return filepath.Clean(raw)
	}
	return filepath.Join(m.Point, filepath.Clean("/"+raw))
}

// Level is the depth of dir in the cgroup2 hierarchy as the BPF cgroup
// helpers count it: the root of the initial namespace is level 0, so a
// namespaced mount adds the depth of its Root.
func (m Mount) Level(dir string) (uint32, error) {
	rel, err := filepath.Rel(m.Point, dir)
	if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
		return 0, fmt.Errorf("%s is not below the cgroup2 mount %s: %w", dir, m.Point, ErrNotCgroup2)
	}
	level := 0
	for _, p := range []string{m.Root, rel} {
		for _, e := range strings.Split(p, "/") {
			if e != "" && e != "." {
				level++
			}
		}
	}
	return uint32(level), nil
}

// OfPID returns the directory of the cgroup process pid is in now, below
// Point ("0::/path" in /proc/<pid>/cgroup).
//
// Both that path and the mount's Root are relative to the reader's cgroup
// namespace: in a private one (a container's, with the host's hierarchy
// bind-mounted) a cgroup outside the namespace's subtree reads
// "/../../kubepods/pod<uid>/<id>", and Root "/../../..". The directory is
// then the path's names below the ancestor of the namespace's root that its
// ".." reach, whose names neither string tells. They are found once, from
// the reader's own cgroup (the directory at the namespace root's depth below
// Point whose cgroup.procs lists the reader), and kept; failing that, the
// directory is looked for among those at the ancestor's depth as the one
// holding the path's names and listing pid in its cgroup.procs
// (ErrNotCgroup2 when none does). A cgroup
// the mount does not show (above or beside its Root) is ErrNotCgroup2 too,
// never a directory of another cgroup.
func (m Mount) OfPID(pid int) (string, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if err != nil {
		return "", fmt.Errorf("reading cgroup of pid %d: %w", pid, err)
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "0::"); ok {
			return m.dirOf(pid, rest)
		}
	}
	return "", fmt.Errorf("pid %d: no cgroup2 line in /proc/%d/cgroup", pid, pid)
}

// nsPath splits a path relative to a cgroup namespace's root, as the kernel
// writes it (its ".." first), into the count of its ".." and its names.
func nsPath(p string) (ups int, names []string, ok bool) {
	for _, e := range strings.Split(p, "/") {
		switch {
		case e == "" || e == ".":
		case e == "..":
			if len(names) > 0 {
				return 0, nil, false
			}
			ups++
		default:
			names = append(names, e)
		}
	}
	return ups, names, true
}

// dirOf is the directory below Point of pid's cgroup path p (relative to
// the reader's cgroup namespace, as Root is).
func (m Mount) dirOf(pid int, p string) (string, error) {
	root := m.Root
	if root == "" {
		root = "/"
	}
	uR, nR, okR := nsPath(root)
	uP, nP, okP := nsPath(p)
	notShown := fmt.Errorf("pid %d is in cgroup %s, which the cgroup2 mount %s (root %s) does not show: %w",
		pid, p, m.Point, root, ErrNotCgroup2)
	switch {
	case !okR || !okP:
		return "", notShown
	case uR == 0:
		// The mount's root is the namespace's root or below it.
		if uP > 0 || len(nP) < len(nR) || !slices.Equal(nP[:len(nR)], nR) {
			return "", notShown
		}
		return filepath.Join(append([]string{m.Point}, nP[len(nR):]...)...), nil
	case len(nR) > 0 || uP > uR:
		// The mount's root is beside the namespace's root, or the
		// cgroup above the mount's root.
		return "", notShown
	case uP == uR:
		return filepath.Join(append([]string{m.Point}, nP...)...), nil
	}
	// The mount's root is uR above the namespace's root and the cgroup
	// below the ancestor of the namespace's root uP up: that ancestor is
	// one of the directories uR-uP below Point. Where the namespace's root
	// is has been found once (nsRoot), or it is looked for each time.
	if ns, err := m.nsRoot(uR); err == nil {
		return filepath.Join(append([]string{m.Point}, append(ns[:uR-uP:uR-uP], nP...)...)...), nil
	}
	return m.findBelow(pid, uR-uP, nP, notShown)
}

// nsRoots caches, by mount, the names below its point of the reader's
// cgroup namespace's root (fixed for the life of the process).
var nsRoots sync.Map // Mount -> []string

// nsRoot returns the names of the reader's cgroup namespace's root below
// Point, uR of them: the directory holding the reader's own cgroup
// (/proc/self/cgroup, relative to that root) and listing its pid.
func (m Mount) nsRoot(uR int) ([]string, error) {
	if v, ok := nsRoots.Load(m); ok {
		return v.([]string), nil
	}
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil, err
	}
	var self string
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "0::"); ok {
			self = rest
		}
	}
	ups, names, ok := nsPath(self)
	if !ok || ups > 0 || self == "" {
		return nil, fmt.Errorf("the reader's own cgroup %q: %w", self, ErrNotCgroup2)
	}
	dir, err := m.findBelow(os.Getpid(), uR, names, ErrNotCgroup2)
	if err != nil {
		return nil, err
	}
	rel, err := filepath.Rel(m.Point, dir)
	if err != nil {
		return nil, err
	}
	ns := strings.Split(rel, "/")
	if len(ns) != uR+len(names) {
		return nil, fmt.Errorf("the reader's own cgroup %s: %w", dir, ErrNotCgroup2)
	}
	ns = ns[:uR]
	nsRoots.Store(m, ns)
	return ns, nil
}

// findBelow finds the directory of pid's cgroup among those depth below
// Point followed by names: the one whose cgroup.procs lists pid.
func (m Mount) findBelow(pid, depth int, names []string, notShown error) (string, error) {
	var found []string
	var walk func(dir string, depth int)
	walk = func(dir string, depth int) {
		if depth == 0 {
			cand := filepath.Join(append([]string{dir}, names...)...)
			if procsHas(cand, pid) {
				found = append(found, cand)
			}
			return
		}
		ents, err := os.ReadDir(dir)
		if err != nil {
			return
		}
		for _, e := range ents {
			if e.IsDir() {
				walk(filepath.Join(dir, e.Name()), depth-1)
			}
		}
	}
	walk(m.Point, depth)
	if len(found) != 1 {
		return "", notShown
	}
	return found[0], nil
}

// procsHas says whether the cgroup.procs of dir lists pid (pids as the
// reader's pid namespace numbers them, whatever its cgroup namespace).
func procsHas(dir string, pid int) bool {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return false
	}
	want := strconv.Itoa(pid)
	for line := range strings.Lines(string(b)) {
		if strings.TrimSpace(line) == want {
			return true
		}
	}
	return false
}

// ID returns the id of the cgroup at path: its directory's inode number.
func ID(path string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, fmt.Errorf("stat %s: %w", path, err)
	}
	return st.Ino, nil
}

// fileidKernfs is the file handle type of cgroupfs (kernfs): the handle is
// the cgroup's 64-bit id, little-endian.
const fileidKernfs = 0xfe

// PathOf returns the directory of the cgroup whose id is id (the way back
// from ID, bpf_get_current_cgroup_id or sock_diag's INET_DIAG_CGROUP_ID):
// the cgroup opened by its file handle, and the path the kernel reports for
// it. It needs CAP_DAC_READ_SEARCH; a cgroup removed since is an error.
func (m Mount) PathOf(id uint64) (string, error) {
	mfd, err := unix.Open(m.Point, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", fmt.Errorf("opening the cgroup2 mount: %w", err)
	}
	defer unix.Close(mfd)
	var h [8]byte
	binary.LittleEndian.PutUint64(h[:], id)
	fd, err := unix.OpenByHandleAt(mfd, unix.NewFileHandle(fileidKernfs, h[:]), unix.O_PATH|unix.O_CLOEXEC)
	if err != nil {
		return "", fmt.Errorf("opening cgroup %d: %w", id, err)
	}
	defer unix.Close(fd)
	path, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	if err != nil {
		return "", fmt.Errorf("reading the path of cgroup %d: %w", id, err)
	}
	if !m.Contains(path) {
		return "", fmt.Errorf("cgroup %d is at %s, not below the mount %s", id, path, m.Point)
	}
	return path, nil
}

// OnCgroup2 returns nil when dir is a directory on a cgroup2 file system:
// a cgroup. A file inside one (cgroup.procs, memory.max) is on the same
// file system and is not a cgroup: ErrNotCgroup2.
func OnCgroup2(dir string) error {
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err != nil {
		return fmt.Errorf("%s: %w", dir, err)
	}
	if sfs.Type != unix.CGROUP2_SUPER_MAGIC {
		return fmt.Errorf("%s: %w", dir, ErrNotCgroup2)
	}
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return fmt.Errorf("%s: %w", dir, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return fmt.Errorf("%s is a file in a cgroup, not a cgroup directory: %w", dir, ErrNotCgroup2)
	}
	return nil
}

// Walk calls fn with the path and id of dir and of every cgroup below it,
// parents before their children. Cgroups removed while the walk runs are
// skipped: what it sees is only as fresh as the walk. A dir that does not
// exist is an error.
func Walk(dir string, fn func(path string, id uint64)) error {
	dir = filepath.Clean(dir)
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) && path != dir {
				return fs.SkipDir // removed under our feet
			}
			return err
		}
		if !d.IsDir() {
			return nil
		}
		var st unix.Stat_t
		if err := unix.Lstat(path, &st); err != nil {
			if errors.Is(err, unix.ENOENT) && path != dir {
				return fs.SkipDir
			}
			return fmt.Errorf("stat %s: %w", path, err)
		}
		fn(path, st.Ino)
		return nil
	})
	if err != nil {
		return fmt.Errorf("indexing cgroups below %s: %w", dir, err)
	}
	return nil
}

// ProjectIndex maps the id of every cgroup below root to its project: the
// name of the first path element below root. A socket created in
// root/web/workers/1 thus belongs to "web". root itself is not a project and
// is left out.
func ProjectIndex(root string) (map[uint64]string, error) {
	root = filepath.Clean(root)
	index := make(map[uint64]string)
	err := Walk(root, func(path string, id uint64) {
		if path == root {
			return
		}
		rel := strings.TrimPrefix(path, root+string(filepath.Separator))
		project, _, _ := strings.Cut(rel, string(filepath.Separator))
		index[id] = project
	})
	if err != nil {
		return nil, err
	}
	return index, nil
}

// removeWait bounds how long RemoveTree waits for one cgroup to empty.
const removeWait = 5 * time.Second

// RemoveTree removes the cgroup dir and every cgroup below it, deepest
// first (a cgroup with children cannot be removed). A cgroup that still has
// processes cannot be removed either (rmdir says EBUSY), and a killed
// process takes a moment to be reaped, so it retries for a while, killing
// what is still inside (cgroup.kill): whoever removes a tree is done with
// everything in it. A dir that does not exist is not an error.
func RemoveTree(dir string) error {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("listing cgroup %s: %w", dir, err)
	}
	var errs []error
	for _, e := range ents {
		if e.IsDir() {
			errs = append(errs, RemoveTree(filepath.Join(dir, e.Name())))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	deadline := time.Now().Add(removeWait)
	for {
		err := unix.Rmdir(dir)
		if err == nil || errors.Is(err, unix.ENOENT) {
			return nil
		}
		if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
			return fmt.Errorf("removing cgroup %s: %w", dir, err)
		}
		_ = os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0)
		time.Sleep(20 * time.Millisecond)
	}
}
