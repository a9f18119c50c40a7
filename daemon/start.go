// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/internal/listen"
	"github.com/fairshare-dev/fairshare/loader"
	"github.com/fairshare-dev/fairshare/policy"
	"golang.org/x/sys/unix"
)

// A start that is refused writes nothing. New checks first what it can
// check without creating anything (preflight), then builds the parts in an
// order that leaves the BPF programs last: the TCP listeners, the events
// log, the store, the pools, the scheduler, the front, the unix sockets, and
// only then the kernel side. (A first start on a node waits for another
// daemon's start on the same pins to end, lockForStart, so that none
// writes over or removes the other's.) Whatever it created before a failure is undone
// (rollback): sockets closed and removed, a store file or a state, socket or
// projects-root directory it made removed, pins it added to the pin
// directory removed. Pins a running configuration left (a daemon stopped
// or killed) are not touched by a start that fails before the kernel side,
// so they keep enforcing exactly as before; one refused inside it
// (loader.Open) puts back what it had written of the configuration in
// their maps (the pool's settings, the destination pools, the exempt set,
// the fleet caps, the events' settings), and renews no heartbeat; refused
// past its attach, it leaves its own programs running on those maps, with
// what they were loaded with (loader/prior.go).

// preflight checks, without creating anything, what would refuse the start
// later: the host's names (CheckHost), every unix socket path, the state
// directory, the events log's directory and the exempt cgroups. Errors that
// a restart cannot fix wrap config.ErrInvalid and name the key.
func preflight(cfg config.Config) error {
	if err := CheckHost(cfg); err != nil {
		return err
	}
	for _, s := range socketPaths(cfg) {
		if err := listen.CheckUnix(s.path); err != nil {
			if errors.Is(err, listen.ErrInUse) {
				return fmt.Errorf("%s: %w", s.key, err)
			}
			return fmt.Errorf("%w: %s: %w", config.ErrInvalid, s.key, err)
		}
	}
	if err := checkWritableDir("state_dir", cfg.StateDir); err != nil {
		return err
	}
	if fi, err := os.Lstat(filepath.Join(cfg.StateDir, policy.FileName)); err == nil && !fi.Mode().IsRegular() {
		return fmt.Errorf("%w: state_dir: %s is not a regular file", config.ErrInvalid, filepath.Join(cfg.StateDir, policy.FileName))
	}
	if cfg.Events.Log != "" {
		if fi, err := os.Stat(cfg.Events.Log); err == nil && fi.IsDir() {
			return fmt.Errorf("%w: events.log: %s is a directory", config.ErrInvalid, cfg.Events.Log)
		}
		if err := checkWritableDir("events.log", filepath.Dir(cfg.Events.Log)); err != nil {
			return err
		}
	}
	if cfg.BPF && len(cfg.Connections.Exempt) > 0 {
		root, err := ProjectsRoot(cfg)
		if err != nil {
			return err
		}
		if err := loader.CheckExempt(exemptPaths(cfg, root)); err != nil {
			return fmt.Errorf("%w: connections.exempt: %w", config.ErrInvalid, err)
		}
	}
	return nil
}

// socketPath is a unix socket the daemon listens on, with its key.
type socketPath struct{ key, path string }

// socketPaths are the unix sockets cfg has the daemon listen on.
func socketPaths(cfg config.Config) []socketPath {
	out := []socketPath{{"admin_socket", cfg.AdminSocket}}
	if cfg.Front.Enabled() && cfg.Front.Socket != "" {
		out = append(out, socketPath{"front.socket", cfg.Front.Socket})
	}
	if cfg.Permits.Socket != "" {
		out = append(out, socketPath{"permits.socket", cfg.Permits.Socket})
	}
	return out
}

// checkWritableDir checks that dir is a directory the daemon can write, or
// that the deepest of its parents that exists is (the daemon creates the
// rest).
func checkWritableDir(key, dir string) error {
	d := filepath.Clean(dir)
	for {
		fi, err := os.Stat(d)
		if err == nil {
			if !fi.IsDir() {
				return fmt.Errorf("%w: %s: %s is not a directory", config.ErrInvalid, key, d)
			}
			if err := unix.Access(d, unix.W_OK|unix.X_OK); err != nil {
				return fmt.Errorf("%w: %s: %s is not writable: %w", config.ErrInvalid, key, d, err)
			}
			return nil
		}
		if errors.Is(err, syscall.ENOTDIR) {
			return fmt.Errorf("%w: %s: %s: a parent is not a directory", config.ErrInvalid, key, dir)
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("%w: %s: %w", config.ErrInvalid, key, err)
		}
		parent := filepath.Dir(d)
		if parent == d {
			return fmt.Errorf("%w: %s: %s: no parent exists", config.ErrInvalid, key, dir)
		}
		d = parent
	}
}

// exemptPaths are the exempt cgroups of the config as the loader takes
// them: the config's are relative to the projects root, the loader's to
// the cgroup2 mount.
func exemptPaths(cfg config.Config, root string) []string {
	exempt := make([]string, len(cfg.Connections.Exempt))
	for i, p := range cfg.Connections.Exempt {
		if !filepath.IsAbs(p) {
			p = filepath.Join(root, p)
		}
		exempt[i] = p
	}
	return exempt
}

// rollback is what a start created so far, undone newest first when it
// fails.
type rollback []func()

func (r *rollback) add(f func()) { *r = append(*r, f) }

func (r rollback) run() {
	for i := len(r) - 1; i >= 0; i-- {
		r[i]()
	}
}

// missing returns path and those of its parents that do not exist now,
// deepest first: what creating path would make.
func missing(path string) []string {
	var out []string
	for p := filepath.Clean(path); ; p = filepath.Dir(p) {
		if _, err := os.Lstat(p); err == nil || !errors.Is(err, fs.ErrNotExist) {
			return out
		}
		out = append(out, p)
		if filepath.Dir(p) == p {
			return out
		}
	}
}

// removeMade removes what of made (missing's answer before a part was
// built) exists now, deepest first; a directory that is not empty stays.
func removeMade(made []string) {
	for _, p := range made {
		_ = os.Remove(p)
	}
}

// pinListing is what a pin directory held: whether it existed, and its
// entries by path relative to it (the netns subdirectory's included).
type pinListing struct {
	existed bool
	entries map[string]bool
}

// listPins reads the pin directory.
func listPins(dir string) pinListing {
	l := pinListing{entries: map[string]bool{}}
	if _, err := os.Stat(dir); err != nil {
		return l
	}
	l.existed = true
	_ = filepath.WalkDir(dir, func(p string, _ fs.DirEntry, err error) error {
		if err == nil && p != dir {
			rel, _ := filepath.Rel(dir, p)
			l.entries[rel] = true
		}
		return nil
	})
	return l
}

// restorePins removes from the pin directory what is not in before (the
// pins a failed start added; the limiter's descriptors are closed by now,
// so an unpinned link detaches), deepest first, and the directory itself if
// it did not exist. A committed migration's pins (loader.MigratedDir) are
// left for the next start to move in place. What was there before is left as it is.
func restorePins(dir string, before pinListing) error {
	now := listPins(dir)
	var added []string
	for p := range now.entries {
		// A committed migration's pins: the next start moves them in
		// place (removing them would leave the old and new pins mixed).
		if p == loader.MigratedDir || strings.HasPrefix(p, loader.MigratedDir+"/") {
			continue
		}
		if !before.entries[p] {
			added = append(added, p)
		}
	}
	// Deepest first: a directory after what is in it.
	sort.Slice(added, func(i, j int) bool {
		di, dj := strings.Count(added[i], "/"), strings.Count(added[j], "/")
		if di != dj {
			return di > dj
		}
		return added[i] > added[j]
	})
	var errs []error
	for _, p := range added {
		if err := os.Remove(filepath.Join(dir, p)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if !before.existed && now.existed {
		if err := os.Remove(dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// ErrPinsInUse means another daemon runs on the same pin directory: a second
// one would write its own pool, members and exempt set over the first's, and
// could unpin them as it exits.
var ErrPinsInUse = errors.New("another fairshare daemon runs on this pin directory")

// ErrPinsRemoved means the pin directory the daemon locked was removed, or
// replaced by another, while it ran (fairshare cleanup --force): its
// programs are pinned nowhere, so it stops, and they detach as it exits.
var ErrPinsRemoved = errors.New("the pin directory was removed or replaced while the daemon ran")

// lockPins takes an exclusive lock on the pin directory, held for the
// daemon's life (closing the file releases it). A directory that does not
// exist yet has nothing to protect: it returns nil, and New locks it once
// the kernel side made it.
func lockPins(dir string) (*os.File, error) {
	// A cleanup that removes the directory between the open and the lock
	// would leave the lock on a removed directory: the lock is taken on
	// what the path names after it, or the directory is gone (nil).
	for range 3 {
		f, err := lockPinsOnce(dir)
		if f == nil || err != nil {
			return f, err
		}
		gone, err := loader.PinDirReplaced(f, dir)
		if err == nil && !gone {
			return f, nil
		}
		f.Close()
		if err != nil {
			return nil, err
		}
	}
	return nil, fmt.Errorf("the pin directory %s kept changing while it was being locked (another process removing and making it)", dir)
}

func lockPinsOnce(dir string) (*os.File, error) {
	f, err := os.Open(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("opening the pin directory %s: %w", dir, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		defer f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			if pid := lockHolder(f); pid > 0 {
				return nil, fmt.Errorf("%s is locked by pid %d: %w", dir, pid, ErrPinsInUse)
			}
			return nil, fmt.Errorf("%s: %w", dir, ErrPinsInUse)
		}
		return nil, fmt.Errorf("locking the pin directory %s: %w", dir, err)
	}
	return f, nil
}

// lockForStart takes the pin directory's lock (lockPins) for a daemon that
// starts, under startLock, an exclusive lock on the directory's parent that
// every start takes first (waiting up to startLockWait for another start to
// finish) and holds until its kernel side has made and locked the
// directory, or its rollback has removed what it made. Without it two
// daemons starting at once on a node with no pins yet (or while the first
// has made the directory and not locked it yet) would both go on, the
// second to write over the first's pins and, refused at last, to remove
// them with its rollback. pinLock is nil while the directory does not
// exist; startLock is nil only when the parent does not exist (the loader
// refuses such a pin directory). The lock is on the parent as it is: on a
// node where bpffs is not mounted yet, a start mounts it over the parent,
// and a start after that locks the mount's root.
func lockForStart(dir string) (pinLock, startLock *os.File, err error) {
	parent := filepath.Dir(dir)
	f, err := os.Open(parent)
	if errors.Is(err, fs.ErrNotExist) {
		pinLock, err = lockPins(dir)
		return pinLock, nil, err
	}
	if err != nil {
		return nil, nil, fmt.Errorf("opening the pin directory's parent %s: %w", parent, err)
	}
	for deadline := time.Now().Add(startLockWait); ; {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			break
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, nil, fmt.Errorf("locking the pin directory's parent %s: %w", parent, err)
		}
		if time.Now().After(deadline) {
			pid := lockHolder(f)
			f.Close()
			return nil, nil, fmt.Errorf("another process (pid %d) has held %s's lock for %v: a fairshare daemon still starting on %s? %w",
				pid, parent, startLockWait, dir, ErrPinsInUse)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if pinLock, err = lockPins(dir); err != nil {
		f.Close()
		return nil, nil, err
	}
	return pinLock, f, nil
}

// startLockWait bounds lockForStart's wait for another daemon's start.
const startLockWait = 2 * time.Minute

// LockPins takes the pin directory's lock, as a daemon does for its life,
// for a command that changes the pins under it (cleanup): it fails with
// ErrPinsInUse, naming the daemon's pid when /proc/locks shows it, while a
// daemon runs on dir. Closing the file releases the lock; nil, nil when dir
// does not exist.
func LockPins(dir string) (*os.File, error) { return lockPins(dir) }

// lockHolder is the pid holding the flock on the open directory f, from
// /proc/locks (its pid namespace's view), or 0 if it cannot tell.
func lockHolder(f *os.File) int {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return 0
	}
	raw, err := os.ReadFile("/proc/locks")
	if err != nil {
		return 0
	}
	return parseLockHolder(string(raw), uint64(st.Dev), st.Ino)
}

// parseLockHolder finds, in /proc/locks, the pid of the granted FLOCK on
// the inode ino of device dev ("1: FLOCK ADVISORY WRITE 1234 00:1f:5678 0
// EOF"; waiters are marked "->" and skipped).
func parseLockHolder(locks string, dev, ino uint64) int {
	want := fmt.Sprintf("%02x:%02x:%d", unix.Major(dev), unix.Minor(dev), ino)
	for _, line := range strings.Split(locks, "\n") {
		fs := strings.Fields(line)
		if len(fs) < 6 || fs[1] != "FLOCK" || fs[5] != want {
			continue
		}
		if pid, err := strconv.Atoi(fs[4]); err == nil {
			return pid
		}
	}
	return 0
}
