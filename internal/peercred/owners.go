// SPDX-License-Identifier: Apache-2.0

package peercred

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/user"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// DefaultSubUIDFile is where shadow's newuidmap finds the subordinate uid
// ranges it lets each user map into a user namespace.
const DefaultSubUIDFile = "/etc/subuid"

// ownersCheckEvery bounds how often Owner looks at the file for a change.
const ownersCheckEvery = time.Second

// Owners folds subordinate uids onto the user they were given to. A user
// with a range in /etc/subuid (65,536 uids by default) can run processes as
// any uid of it (newuidmap, a rootless container), and SO_PEERCRED and
// sock_diag report those host uids as they are: without folding, one user is
// as many peers as its range has uids. The file is read when first needed
// and again when it changes (its inode, size or modification time); a
// missing or unreadable file folds nothing.
//
// A range owned by root folds onto uid 0 as well: for counting, every
// container of that range is one peer with root. Folding never makes a peer
// privileged; callers decide privilege on the uid the kernel reported.
type Owners struct {
	path  string
	every time.Duration

	mu      sync.Mutex // guards the fields below
	checked time.Time
	stamp   fileStamp
	ranges  []subRange // sorted by start
	err     error      // why the last read folded nothing, for Err
}

type subRange struct{ start, end, owner uint32 } // [start, end)

type fileStamp struct {
	ino, size int64
	mtime     time.Time
	exists    bool
}

// NewOwners folds the ranges of the subuid file at path
// (DefaultSubUIDFile when empty).
func NewOwners(path string) *Owners {
	if path == "" {
		path = DefaultSubUIDFile
	}
	return &Owners{path: path, every: ownersCheckEvery}
}

// Path returns the file the ranges are read from.
func (o *Owners) Path() string {
	if o == nil {
		return ""
	}
	return o.path
}

// Owner returns the uid that owns uid: the owner of the subordinate range
// holding it, or uid itself. A nil Owners folds nothing.
func (o *Owners) Owner(uid uint32) uint32 {
	if o == nil {
		return uid
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	o.refreshLocked(time.Now())
	i := sort.Search(len(o.ranges), func(i int) bool { return o.ranges[i].end > uid })
	if i < len(o.ranges) && o.ranges[i].start <= uid {
		return o.ranges[i].owner
	}
	return uid
}

// Ranges returns how many ranges are folded, and why none are when the file
// could not be used.
func (o *Owners) Ranges() (int, error) {
	if o == nil {
		return 0, nil
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	o.refreshLocked(time.Now())
	return len(o.ranges), o.err
}

// refreshLocked rereads the file when it changed, looking at most once per
// o.every.
func (o *Owners) refreshLocked(now time.Time) {
	read := o.ranges != nil
	if read && now.Sub(o.checked) < o.every {
		return
	}
	o.checked = now
	st := stampOf(o.path)
	if read && st == o.stamp {
		return
	}
	o.stamp = st
	if !st.exists {
		o.ranges, o.err = []subRange{}, nil
		return
	}
	b, err := os.ReadFile(o.path)
	if err != nil {
		o.ranges, o.err = []subRange{}, fmt.Errorf("reading %s: %w", o.path, err)
		return
	}
	o.ranges, o.err = parseSubUID(b)
	if o.err != nil {
		o.err = fmt.Errorf("%s: %w", o.path, o.err)
	}
}

func stampOf(path string) fileStamp {
	fi, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) || err != nil {
		return fileStamp{}
	}
	st := fileStamp{size: fi.Size(), mtime: fi.ModTime(), exists: true}
	if sys, ok := fi.Sys().(*syscall.Stat_t); ok {
		st.ino = int64(sys.Ino)
	}
	return st
}

// parseSubUID reads "owner:start:count" lines, owner a login name or a uid.
// A line it cannot use (a name that is not a user, a bad number) is skipped
// and the first such line is reported; the others still fold.
func parseSubUID(b []byte) ([]subRange, error) {
	rs := []subRange{}
	var firstErr error
	sc := bufio.NewScanner(bytes.NewReader(b))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		r, err := parseSubLine(line)
		if err != nil {
			if firstErr == nil {
				firstErr = fmt.Errorf("line %d: %w", n, err)
			}
			continue
		}
		rs = append(rs, r)
	}
	sort.Slice(rs, func(i, j int) bool { return rs[i].start < rs[j].start })
	// Overlapping ranges: the earlier start keeps the overlap.
	out := rs[:0]
	for _, r := range rs {
		if len(out) > 0 && r.start < out[len(out)-1].end {
			r.start = out[len(out)-1].end
			if r.start >= r.end {
				continue
			}
		}
		out = append(out, r)
	}
	return out, firstErr
}

func parseSubLine(line string) (subRange, error) {
	f := strings.Split(line, ":")
	if len(f) != 3 {
		return subRange{}, fmt.Errorf("%q is not owner:start:count", line)
	}
	start, err1 := strconv.ParseUint(f[1], 10, 32)
	count, err2 := strconv.ParseUint(f[2], 10, 32)
	if err1 != nil || err2 != nil || count == 0 || start+count > 1<<32 {
		return subRange{}, fmt.Errorf("%q: start and count must be whole numbers within the uid space", line)
	}
	owner, err := strconv.ParseUint(f[0], 10, 32)
	if err != nil {
		u, lerr := user.Lookup(f[0])
		if lerr != nil {
			return subRange{}, fmt.Errorf("owner %q: %w", f[0], lerr)
		}
		if owner, err = strconv.ParseUint(u.Uid, 10, 32); err != nil {
			return subRange{}, fmt.Errorf("owner %q has uid %q", f[0], u.Uid)
		}
	}
	end := start + count
	if end > 1<<32-1 {
		end = 1<<32 - 1 // (uid_t)-1 is no uid
	}
	return subRange{start: uint32(start), end: uint32(end), owner: uint32(owner)}, nil
}
