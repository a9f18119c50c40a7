// SPDX-License-Identifier: Apache-2.0

package netnsscan

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"time"
	"unsafe"

	"github.com/fairshare-dev/fairshare/internal/membership"
	"golang.org/x/sys/unix"
)

// Defaults of Options.
const (
	// DefaultBudget is how many cgroup directories a Step reads beyond
	// those of fresh members: about 60 ms of work on the development
	// machines (BenchmarkStep), so a sweep of 50,000 registered pods of
	// two containers each (150,000 directories) takes 37 steps.
	DefaultBudget = 4096
	// DefaultFresh is how many steps a new member is read at every step:
	// a pod's containers start after its cgroup is registered.
	DefaultFresh = 10
)

// Options configure New.
type Options struct {
	// Budget bounds the cgroup directories a Step reads for fresh members,
	// and again for the sweep; 0 means DefaultBudget. A member's tree is
	// read whole, so each reads at least one member.
	Budget int
	// Fresh is how many steps in a row a new member is read; 0 means
	// DefaultFresh.
	Fresh int
	// Proc is where procfs is mounted; "" means /proc.
	Proc string
}

// Namespace is a network namespace that a registered cgroup's process is
// in (other than the daemon's own).
type Namespace struct {
	// Inode is the namespace's inode number on nsfs: its identity while
	// it lives. The kernel gives a dead namespace's number to the next
	// one made.
	Inode uint64 `json:"inode"`
	// ID is the kernel's id of the namespace (NS_GET_ID, Linux 6.18):
	// never given to another. 0 where the kernel has none.
	ID uint64 `json:"id,omitempty"`
	// Path opens it while the process PID lives: <proc>/<pid>/ns/net.
	Path string `json:"path"`
	PID  int    `json:"pid"`
	// Cgroup is the directory PID was found in (OpenPid checks it is still
	// there, or below).
	Cgroup string `json:"cgroup"`
	// Projects whose processes were seen in it in the last sweep (or the
	// current one, for a namespace first seen there), sorted.
	Projects []string `json:"projects"`
	// Members are the member cgroups (as registered: a pod's, not its
	// containers') whose processes were seen in it in the last sweep or
	// the current one, sorted.
	Members []string `json:"members,omitempty"`
	// Since is when it was first seen.
	Since time.Time `json:"since"`
}

// Changes is what one Step found.
type Changes struct {
	// New are the namespaces seen for the first time.
	New []Namespace
	// Joined are namespaces seen before, in which a process of a member
	// cgroup not seen in them since the last sweep began was seen: a
	// namespace shared with another member's processes (a tenant's
	// process that entered another's namespace, say) that a new member's
	// first read finds.
	Joined []Namespace
	// Gone are the namespaces a whole sweep did not see (no process of a
	// registered cgroup is in them any more), and those whose inode number
	// a read found to be another namespace's now (its ID changed: the one
	// known died, and the one found is New). A caller handles Gone first.
	Gone []Namespace
	// Swept says a sweep over every member ended at this step.
	Swept bool
	// Dirs is how many cgroup directories the step read, Procs how many
	// processes' namespaces.
	Dirs, Procs int
}

// Stats describe the scanner's work.
type Stats struct {
	Members    int           `json:"members"`
	Namespaces int           `json:"namespaces"`
	Sweeps     uint64        `json:"sweeps"`      // sweeps completed
	SweepSteps int           `json:"sweep_steps"` // steps the last sweep took
	SweepTime  time.Duration `json:"sweep_time"`  // CPU-ish: the sum of its steps' durations
	StepDirs   int           `json:"step_dirs"`   // directories the last step read
	StepTime   time.Duration `json:"step_time"`   // how long the last step took
	Budget     int           `json:"budget"`
	Errors     uint64        `json:"errors"` // cgroups or processes that could not be read, other than gone
	LastError  string        `json:"last_error,omitempty"`
	// Truncated counts the members whose tree was bigger than the budget
	// and was read in part.
	Truncated     uint64 `json:"truncated"`
	LastTruncated string `json:"last_truncated,omitempty"`
	// NamespaceIDs says the kernel gives namespaces ids (NS_GET_ID, Linux
	// 6.18), which tell apart two namespaces of one inode number.
	NamespaceIDs bool `json:"namespace_ids"`
}

// Scanner finds the network namespaces of the registered cgroups'
// processes. It is not safe for concurrent use: one loop owns it.
type Scanner struct {
	opts Options
	host uint64 // the daemon's own namespace: never reported
	now  func() time.Time
	buf  []byte

	members map[string]*member // by cgroup
	order   []string           // the members' cgroups, sorted
	fresh   []string           // members read at every step for now, oldest first
	started bool               // SetMembers was called
	cursor  string             // the sweep's next member: the first >= cursor
	sweep   uint64             // the sweep in progress (from 1)

	ns      map[uint64]*nsState
	missing map[string]bool // members whose cgroup did not exist when last read
	noIDs   bool            // the kernel gives namespaces no ids (NS_GET_ID): known by inode alone

	stats      Stats
	sweepSteps int
	sweepTime  time.Duration
}

type member struct {
	project string
	fresh   int  // reads left at every step
	readNew bool // read by ReadNew
}

type nsState struct {
	Namespace
	seen     uint64            // the last sweep it was seen in
	projects map[string]uint64 // project -> the last sweep it was seen in
	members  map[string]uint64 // member cgroup -> the last sweep it was seen in
}

// New returns a scanner; the namespace it runs in is the host's, which it
// never reports.
func New(o Options) (*Scanner, error) {
	if o.Budget <= 0 {
		o.Budget = DefaultBudget
	}
	if o.Fresh <= 0 {
		o.Fresh = DefaultFresh
	}
	if o.Proc == "" {
		o.Proc = "/proc"
	}
	self := filepath.Join(o.Proc, "self/ns/net")
	host, err := nsInode(self)
	if err != nil {
		return nil, fmt.Errorf("reading the daemon's own network namespace: %w", err)
	}
	// Whether the kernel gives namespaces ids: asked once, of the host's.
	var hostID uint64
	if f, err := os.Open(self); err == nil {
		hostID, _ = ID(f)
		f.Close()
	}
	return &Scanner{opts: o, host: host, now: time.Now, buf: make([]byte, 64<<10),
		members: map[string]*member{}, ns: map[uint64]*nsState{}, missing: map[string]bool{}, sweep: 1,
		noIDs: hostID == 0, stats: Stats{Budget: o.Budget, NamespaceIDs: hostID != 0}}, nil
}

// Inode is the identity of the namespace a path opens (/proc/<pid>/ns/net,
// or a bind mount of it): its inode on nsfs, as Namespace.Inode.
func Inode(path string) (uint64, error) { return nsInode(path) }

// nsGetID is NS_GET_ID, _IOR(NSIO, 13, __u64): the namespace's 64-bit id
// (Linux 6.18).
const nsGetID = 0x8008b70d

// ID is the kernel's id of the namespace f opens (Namespace.ID), 0 if the
// kernel has none (before Linux 6.18: ENOTTY).
func ID(f *os.File) (uint64, error) {
	id, err := nsID(int(f.Fd()))
	runtime.KeepAlive(f)
	return id, err
}

func nsID(fd int) (uint64, error) {
	var id uint64
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), nsGetID, uintptr(unsafe.Pointer(&id)))
	switch errno {
	case 0:
		return id, nil
	case unix.ENOTTY, unix.EINVAL:
		return 0, nil
	default:
		return 0, errno
	}
}

// identity reads the inode of a namespace file and, if the kernel gives
// namespaces ids (asked once, in New), its id: an open, an fstat, an ioctl
// and a close, where the inode alone is one stat (BenchmarkIdentity).
func (s *Scanner) identity(path string) (ino, id uint64, err error) {
	if s.noIDs {
		ino, err = nsInode(path)
		return ino, 0, err
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, 0, fmt.Errorf("open %s: %w", path, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return 0, 0, fmt.Errorf("fstat %s: %w", path, err)
	}
	if id, err = nsID(fd); err != nil {
		return st.Ino, 0, fmt.Errorf("NS_GET_ID %s: %w", path, err)
	}
	return st.Ino, id, nil
}

// nsInode reads the inode of a namespace file (readlink: "net:[4026531833]").
func nsInode(path string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, fmt.Errorf("stat %s: %w", path, err)
	}
	return st.Ino, nil
}

// SetMembers replaces the members (an accepted set, sorted by cgroup, as
// membership.Resolve returns it). Members new since the last call are read
// at each of the next Options.Fresh steps (oldest first, within the
// budget), so a pod's namespace is found in the step after its cgroup is
// registered, or its containers start. The first call's members are not
// new: the first sweep reads them.
func (s *Scanner) SetMembers(es []membership.Entry) {
	next := make(map[string]*member, len(es))
	order := make([]string, 0, len(es))
	for _, e := range es {
		if m, ok := s.members[e.Cgroup]; ok {
			m.project = e.Project
			next[e.Cgroup] = m
		} else if s.started {
			next[e.Cgroup] = &member{project: e.Project, fresh: s.opts.Fresh}
			s.fresh = append(s.fresh, e.Cgroup)
		} else {
			// The first members are no news: the first sweep reads them.
			next[e.Cgroup] = &member{project: e.Project}
		}
		order = append(order, e.Cgroup)
	}
	if !slices.IsSorted(order) {
		slices.Sort(order)
	}
	s.members, s.order, s.started = next, order, true
	for cg := range s.missing {
		if next[cg] == nil {
			delete(s.missing, cg)
		}
	}
	s.stats.Members = len(order)
}

// ReadNew reads the members new since SetMembers that no read has read
// yet, oldest first, within Options.Budget directories: a change of the
// members has the namespaces of its new members found at once (those whose
// processes run already) rather than at the next Step. It does not sweep,
// and reports gone only a namespace whose inode number it found to be
// another's now (Changes.Gone); it leaves the members' Options.Fresh reads at
// the steps that follow as they were: a burst of changes does not spend
// them before a new pod's containers start.
func (s *Scanner) ReadNew() Changes {
	start := s.now()
	var c Changes
	for _, cg := range s.fresh {
		m := s.members[cg]
		if m == nil || m.readNew {
			continue
		}
		if c.Dirs >= s.opts.Budget {
			break // read at the next step, as fresh
		}
		s.visitMember(cg, m.project, start, &c)
		m.readNew = true
	}
	s.stats.Namespaces = len(s.ns)
	return c
}

// Step reads the fresh members, then sweeps on from where the last step
// stopped until it has read Options.Budget directories. When the sweep
// passes the last member, namespaces no step of the sweep saw are gone.
func (s *Scanner) Step() Changes {
	start := s.now()
	var c Changes
	// visited: the fresh members read in this step, by the sweep they
	// were read in (one that ends in this step does not count for the next).
	var visited map[string]uint64
	keep := s.fresh[:0]
	for i, cg := range s.fresh {
		m := s.members[cg]
		if m == nil || m.fresh == 0 || visited[cg] != 0 {
			continue // gone, done, or listed twice
		}
		if c.Dirs >= s.opts.Budget {
			keep = append(keep, s.fresh[i:]...) // their turn comes next step
			break
		}
		if visited == nil {
			visited = map[string]uint64{}
		}
		s.visitMember(cg, m.project, start, &c)
		m.readNew = true // read once: ReadNew has no news of it
		visited[cg] = s.sweep
		if m.fresh--; m.fresh > 0 {
			keep = append(keep, cg)
		}
	}
	s.fresh = keep
	spent, wrapped := 0, false
	for spent < s.opts.Budget {
		i := sort.SearchStrings(s.order, s.cursor)
		if i == len(s.order) {
			if wrapped {
				break // one sweep ends per step at most
			}
			s.endSweep(&c)
			s.cursor, wrapped = "", true
			continue
		}
		cg := s.order[i]
		s.cursor = cg + "\x00" // the next member after cg
		if visited[cg] == s.sweep {
			continue // read as fresh in this step and this sweep
		}
		before := c.Dirs
		s.visitMember(cg, s.members[cg].project, start, &c)
		spent += c.Dirs - before
	}
	took := s.now().Sub(start)
	s.sweepSteps++
	s.sweepTime += took
	s.stats.StepDirs, s.stats.StepTime, s.stats.Namespaces = c.Dirs, took, len(s.ns)
	return c
}

// endSweep closes the sweep in progress: what it did not see is gone.
func (s *Scanner) endSweep(c *Changes) {
	for ino, n := range s.ns {
		if n.seen < s.sweep {
			c.Gone = append(c.Gone, n.Namespace)
			delete(s.ns, ino)
			continue
		}
		for p, seen := range n.projects {
			if seen < s.sweep {
				delete(n.projects, p)
			}
		}
		for m, seen := range n.members {
			if seen < s.sweep {
				delete(n.members, m)
			}
		}
		n.Projects, n.Members = sortedKeys(n.projects), sortedKeys(n.members)
	}
	slices.SortFunc(c.Gone, func(a, b Namespace) int { return cmp.Compare(a.Inode, b.Inode) })
	s.sweep++
	c.Swept = true
	s.stats.Sweeps++
	s.stats.SweepSteps, s.stats.SweepTime = s.sweepSteps, s.sweepTime
	s.sweepSteps, s.sweepTime = 0, 0
}

// visitMember reads the processes of a member's cgroup and of the cgroups
// below it, at most Options.Budget directories: a member whose tree is
// bigger (someone with a delegated subtree made thousands of cgroups) is
// read in part, and counted in Stats.Truncated, rather than let it stall
// the step.
func (s *Scanner) visitMember(dir, project string, now time.Time, c *Changes) {
	left := s.opts.Budget
	if err := s.visit(dir, dir, project, now, c, &left); errors.Is(err, unix.ENOENT) {
		s.missing[dir] = true
	} else {
		delete(s.missing, dir)
	}
	if left < 0 {
		s.stats.Truncated++
		s.stats.LastTruncated = dir
	}
}

// visit reads the processes of the cgroup dir (of member cgroup mem) and of
// every cgroup below it while *left, the directories it may still read, is
// positive. It returns the error of dir's own stat (ENOENT: it does not
// exist).
func (s *Scanner) visit(dir, mem, project string, now time.Time, c *Changes, left *int) error {
	if *left <= 0 {
		*left = -1
		return nil
	}
	*left--
	c.Dirs++
	s.procs(dir, mem, project, now, c)
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		s.fail(dir, err)
		return err
	}
	// On cgroupfs (kernfs) a directory's link count is 2 + its
	// subdirectories: a leaf needs no listing.
	if st.Nlink <= 2 {
		return nil
	}
	names, err := subdirs(dir)
	if err != nil {
		s.fail(dir, err)
		return nil
	}
	for _, n := range names {
		s.visit(dir+"/"+n, mem, project, now, c, left)
	}
	return nil
}

// procs reads dir's cgroup.procs (below member cgroup mem) and the
// namespace of each process.
func (s *Scanner) procs(dir, mem, project string, now time.Time, c *Changes) {
	data, err := readFile(dir+"/cgroup.procs", &s.buf)
	if err != nil {
		s.fail(dir, err)
		return
	}
	for len(data) > 0 {
		var line []byte
		if i := bytes.IndexByte(data, '\n'); i >= 0 {
			line, data = data[:i], data[i+1:]
		} else {
			line, data = data, nil
		}
		pid, err := strconv.Atoi(string(line))
		if err != nil || pid <= 0 {
			continue
		}
		c.Procs++
		path := s.opts.Proc + "/" + strconv.Itoa(pid) + "/ns/net"
		ino, id, err := s.identity(path)
		if err != nil {
			s.fail(path, err)
			continue
		}
		if ino == s.host {
			continue
		}
		n, ok := s.ns[ino]
		if ok && id != 0 && n.ID != 0 && id != n.ID {
			// The namespace known by this number died, and another has
			// it now (a pod's sandbox made again, a process that
			// unshared again): that one is gone, this one new.
			c.Gone = append(c.Gone, n.clone())
			delete(s.ns, ino)
			ok = false
		}
		if !ok {
			n = &nsState{Namespace: Namespace{Inode: ino, ID: id, Since: now}, projects: map[string]uint64{}, members: map[string]uint64{}}
			s.ns[ino] = n
		}
		n.Path, n.PID, n.Cgroup, n.seen = path, pid, dir, s.sweep
		if _, had := n.projects[project]; !had {
			n.projects[project] = s.sweep
			n.Projects = sortedKeys(n.projects)
		}
		n.projects[project] = s.sweep
		_, had := n.members[mem]
		n.members[mem] = s.sweep
		if !had {
			n.Members = sortedKeys(n.members)
		}
		switch {
		case !ok:
			c.New = append(c.New, n.clone())
		case !had:
			c.Joined = append(c.Joined, n.clone())
		}
	}
}

// clone is n's Namespace, its slices its own.
func (n *nsState) clone() Namespace {
	ns := n.Namespace
	ns.Projects, ns.Members = slices.Clone(ns.Projects), slices.Clone(ns.Members)
	return ns
}

// fail counts an error other than the cgroup or process having gone, which
// is the normal race with the node's churn.
func (s *Scanner) fail(what string, err error) {
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ESRCH) || errors.Is(err, unix.ENODEV) {
		return
	}
	s.stats.Errors++
	s.stats.LastError = fmt.Sprintf("%s: %v", what, err)
}

// Namespaces lists the namespaces found and not gone, by inode.
func (s *Scanner) Namespaces() []Namespace {
	out := make([]Namespace, 0, len(s.ns))
	for _, n := range s.ns {
		out = append(out, n.clone())
	}
	slices.SortFunc(out, func(a, b Namespace) int { return cmp.Compare(a.Inode, b.Inode) })
	return out
}

// MembersOf is Namespace.Members of the namespace of inode ino, as the
// scanner knows it now (nil if it knows none); the slice is not to be
// changed.
func (s *Scanner) MembersOf(ino uint64) []string {
	if n := s.ns[ino]; n != nil {
		return n.Members
	}
	return nil
}

// Forget drops what the scanner knows of the namespace of inode ino (its
// owner saw it die): a namespace that has its inode now (the kernel reuses
// the number) is reported New when a read next finds it.
func (s *Scanner) Forget(ino uint64) {
	delete(s.ns, ino)
	s.stats.Namespaces = len(s.ns)
}

// Missing lists the members whose cgroup did not exist when last read (a
// registration that outlived its pod, say), sorted.
func (s *Scanner) Missing() []string {
	out := make([]string, 0, len(s.missing))
	for cg := range s.missing {
		out = append(out, cg)
	}
	slices.Sort(out)
	return out
}

// Stats returns the scanner's counters.
func (s *Scanner) Stats() Stats { return s.stats }

// Host is the inode of the daemon's own network namespace.
func (s *Scanner) Host() uint64 { return s.host }

func sortedKeys(m map[string]uint64) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// readFile reads a small file into *buf, growing it if needed; what it
// returns is valid until the next read into *buf.
func readFile(path string, buf *[]byte) ([]byte, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	n := 0
	for {
		if n == len(*buf) {
			*buf = append(*buf, make([]byte, len(*buf))...)
		}
		m, err := unix.Read(fd, (*buf)[n:])
		if err != nil {
			return nil, err
		}
		if m == 0 {
			return (*buf)[:n], nil
		}
		n += m
	}
}

// subdirs lists the directories in dir.
func subdirs(dir string) ([]string, error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	var names []string
	buf := make([]byte, 8192)
	for {
		n, err := unix.Getdents(fd, buf)
		if err != nil {
			return nil, err
		}
		if n <= 0 {
			return names, nil
		}
		for b := buf[:n]; len(b) > 0; {
			// struct linux_dirent64: ino u64, off s64, reclen u16, type u8, name.
			reclen := int(b[16]) | int(b[17])<<8
			if reclen == 0 || reclen > len(b) {
				return names, nil
			}
			if b[18] == unix.DT_DIR {
				name := b[19:reclen]
				if i := bytes.IndexByte(name, 0); i >= 0 {
					name = name[:i]
				}
				if s := string(name); s != "." && s != ".." {
					names = append(names, s)
				}
			}
			b = b[reclen:]
		}
	}
}
