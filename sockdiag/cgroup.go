// SPDX-License-Identifier: Apache-2.0

package sockdiag

import (
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// CgroupIndex walks the cgroup2 directory tree below root and maps the id of
// every cgroup in it to its project: the name of the first path element below
// root. A socket created in root/web/workers/1 thus belongs to "web". root
// itself is not a project and is left out of the map.
//
// A cgroup's id is the inode number of its directory on cgroup2, which is
// what INET_DIAG_CGROUP_ID and the BPF cgroup helpers report. Cgroups removed
// while the walk runs are skipped: the index is only as fresh as the walk.
func CgroupIndex(root string) (map[uint64]string, error) {
	root = filepath.Clean(root)
	var st unix.Stat_t
	if err := unix.Stat(root, &st); err != nil {
		return nil, fmt.Errorf("indexing cgroups below %s: %w", root, err)
	}
	index := make(map[uint64]string)
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) && path != root {
				return fs.SkipDir // removed under our feet
			}
			return err
		}
		if !d.IsDir() || path == root {
			return nil
		}
		var st unix.Stat_t
		if err := unix.Lstat(path, &st); err != nil {
			if errors.Is(err, unix.ENOENT) {
				return fs.SkipDir
			}
			return fmt.Errorf("stat %s: %w", path, err)
		}
		rel := strings.TrimPrefix(path, root+string(filepath.Separator))
		project, _, _ := strings.Cut(rel, string(filepath.Separator))
		index[st.Ino] = project
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("indexing cgroups below %s: %w", root, err)
	}
	return index, nil
}

// CountByCgroup counts the sockets for which include returns true (all of
// them when include is nil) by cgroup id. Sockets without a cgroup id
// (TIME_WAIT, SYN_RECV) are counted under 0.
func CountByCgroup(socks []Socket, include func(Socket) bool) map[uint64]int {
	counts := make(map[uint64]int)
	for _, s := range socks {
		if include == nil || include(s) {
			counts[s.CgroupID]++
		}
	}
	return counts
}

// CountByProject folds per-cgroup counts into per-project counts with an
// index from CgroupIndex. Counts of cgroups outside the index (other
// hierarchies, cgroups created after the walk, the 0 of TIME_WAIT) are
// returned under "" so that nothing disappears silently.
func CountByProject(counts map[uint64]int, index map[uint64]string) map[string]int {
	out := make(map[string]int)
	for id, n := range counts {
		out[index[id]] += n
	}
	return out
}
