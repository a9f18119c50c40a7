// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// A migration replaces pins of another layout (an older or newer version's
// maps: a value that grew, a map made mmapable) with this version's, with
// no moment where no program enforces (see Open and doc.go, "Upgrades").
// It works in two subdirectories of the pin directory, so that a crash at
// any point leaves a state the next Open finishes or undoes:
//
//   - stagingDir holds the new maps and links while they are made, counted
//     and attached beside the old ones. Found at Open, it is discarded (its
//     links unpinned, so its programs detach; the old ones never stopped)
//     and the migration starts again.
//   - readyDir is stagingDir renamed, in one rename, once its programs run
//     and its maps count the live sockets: the commit point. Found at Open,
//     its pins are moved up over the old ones (each move one rename, which
//     detaches the old link it replaces) before anything else.
//
// bpffs refuses dots in names, hence no ".tmp" suffix.
const (
	stagingDir = "migrating"
	readyDir   = MigratedDir
)

// MigratedDir is the subdirectory of the pin directory holding the pins of
// a committed migration until Open has moved them in place: whoever undoes
// a failed start's pins leaves it (and what is in it) for the next Open to
// finish, as after a crash.
const MigratedDir = "migrated"

// ErrPinsLocked means another process holds the pin directory's lock (a
// daemon running on it) while Open would have to migrate or finish
// migrating its pins: they are left alone. Options.PinLock passes the lock
// a caller holds itself.
var ErrPinsLocked = errors.New("the pin directory is locked by another process")

// migrateFault, replaced by tests only, fails a migration at a step ("counted":
// before the commit, "committed": after it, "installing": half of the new
// pins moved in place), as a crash there would leave the pin directory.
var migrateFault = func(step string) error { return nil }

// migration is what Open records of the pins of another layout it replaces.
type migration struct {
	reason  string // why the old pins cannot be reused
	staging string // <pin dir>/stagingDir
	// committed: the staging directory was renamed to the ready one; a
	// failure after it leaves the new pins for the next Open to install.
	committed bool
}

// lockPinDir makes sure no other process works on the pin directory
// while Open changes its layout: the caller's lock (Options.PinLock) if it
// holds one on this directory, else one taken here until Open returns.
func (l *Limiter) lockPinDir() error {
	if l.unlock != nil {
		return nil
	}
	if _, err := os.Stat(l.pinDir); err != nil {
		return fmt.Errorf("reading the pin directory %s: %w", l.pinDir, err)
	}
	if f := l.pinLock; f != nil {
		if replaced, err := PinDirReplaced(f, l.pinDir); err == nil && !replaced &&
			unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) == nil {
			l.unlock = func() {}
			return nil
		}
	}
	f, err := os.Open(l.pinDir)
	if err != nil {
		return fmt.Errorf("opening the pin directory %s: %w", l.pinDir, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return fmt.Errorf("%s: not migrating its pins under a daemon that runs on it: %w", l.pinDir, ErrPinsLocked)
		}
		return fmt.Errorf("locking the pin directory %s: %w", l.pinDir, err)
	}
	l.unlock = func() { f.Close() }
	return nil
}

// resumeMigration finishes or undoes a migration an earlier Open did not
// complete (it crashed or was killed): a ready directory is installed, a
// staging one discarded. Nothing to do is the common case.
func (l *Limiter) resumeMigration() error {
	ready := filepath.Join(l.pinDir, readyDir)
	staging := filepath.Join(l.pinDir, stagingDir)
	_, rerr := os.Stat(ready)
	_, serr := os.Stat(staging)
	if rerr != nil && serr != nil {
		return nil
	}
	if err := l.lockPinDir(); err != nil {
		return err
	}
	if rerr == nil {
		l.log.Warn("finishing an interrupted migration of the pins: moving the new ones in place", "pin_dir", l.pinDir)
		if err := l.install(); err != nil {
			return err
		}
	}
	if serr == nil {
		// Its programs ran beside the old ones, which still run: unpinned,
		// they detach (the process that made them is gone), and the
		// migration starts again from the old pins.
		l.log.Warn("discarding an interrupted migration of the pins: it starts again", "pin_dir", l.pinDir)
		if err := Cleanup(staging); err != nil {
			return fmt.Errorf("discarding the interrupted migration in %s: %w", staging, err)
		}
	}
	return nil
}

// incompatible says why the maps pinned in the pin directory cannot be
// reused by spec's programs ("" if they can): a map of another type, key,
// value, size or flags, one missing that the others must agree with, or
// permit tables too small for the pool's capacity.
func (l *Limiter) incompatible(spec *ebpf.CollectionSpec) (string, error) {
	if _, err := os.Stat(filepath.Join(l.pinDir, "fs_config")); err != nil {
		// Nothing pinned is a fresh start. Other pins without fs_config
		// are what an interrupted cleanup leaves (it unpins in the order
		// the directory lists, which puts fs_config anywhere): maps that may
		// no longer agree with one another (fs_held gone, the counts
		// kept) and the links still running the old programs. Not a
		// fresh start beside them: migrated, the counts rebuilt from
		// the live sockets and the leftovers replaced.
		left, err := leftoverPins(l.pinDir)
		if err != nil || len(left) == 0 {
			return "", err
		}
		return fmt.Sprintf("fs_config missing beside %d other pins (%s): an interrupted cleanup's leftovers",
			len(left), strings.Join(left[:min(len(left), 4)], ", ")), nil
	}
	names := make([]string, 0, len(spec.Maps))
	for name := range spec.Maps {
		names = append(names, name)
	}
	slices.Sort(names)
	var why []string
	if l.outgrown != 0 {
		why = append(why, fmt.Sprintf("permit tables of %d entries, for a pool of at most %d; this start's needs %d",
			l.outgrown, l.outgrown, l.capacity))
	}
	for _, name := range names {
		ms := spec.Maps[name]
		if ms.Pinning != ebpf.PinByName {
			continue
		}
		if l.outgrown != 0 && (name == "fs_slots" || name == "fs_held" || name == "fs_reservations") {
			continue // said above
		}
		m, err := ebpf.LoadPinnedMap(filepath.Join(l.pinDir, name), nil)
		if errors.Is(err, os.ErrNotExist) {
			// A map of a newer part that starts empty is made beside the
			// others (addedMaps); any other missing one would disagree
			// with them (a lost reservation table leaks its permits).
			if !addedMaps[name] {
				why = append(why, name+" missing")
			}
			continue
		}
		if err != nil {
			return "", fmt.Errorf("reading pinned map %s: %w", name, err)
		}
		err = ms.Compatible(m)
		m.Close()
		if err != nil {
			why = append(why, fmt.Sprintf("%s: %v", name, err))
		}
	}
	if len(why) == 0 {
		// Sizes and flags agree; what the bytes mean may not.
		if layout, err := pinnedLayout(l.pinDir); err != nil {
			return "", err
		} else if layout != pinLayout {
			why = append(why, fmt.Sprintf("pins of layout %d, this version's is %d", layout, pinLayout))
		}
	}
	return strings.Join(why, "; "), nil
}

// leftoverPins names the pins of fairshare's at the top of pinDir (maps
// and links: "fs_" and "link_" names), sorted.
func leftoverPins(pinDir string) ([]string, error) {
	ents, err := os.ReadDir(pinDir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading the pin directory %s: %w", pinDir, err)
	}
	var out []string
	for _, e := range ents {
		if n := e.Name(); !e.IsDir() && (strings.HasPrefix(n, "fs_") || strings.HasPrefix(n, "link_")) {
			out = append(out, n)
		}
	}
	return out, nil
}

// pinnedLayout is fs_settings.layout of the pins in pinDir, whose fs_config
// has this version's value size (0: pins of a version before the word).
func pinnedLayout(pinDir string) (uint32, error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, "fs_config"), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return 0, fmt.Errorf("reading pinned map fs_config: %w", err)
	}
	defer m.Close()
	var cfg limiterFsSettings
	if err := m.Lookup(uint32(0), &cfg); err != nil {
		return 0, fmt.Errorf("reading pinned map fs_config: %w", err)
	}
	return cfg.Layout, nil
}

// loadStaged loads spec with fresh maps pinned in the staging directory,
// for a migration from pins of another layout.
func (l *Limiter) loadStaged(spec *ebpf.CollectionSpec, reason string) error {
	if err := l.lockPinDir(); err != nil {
		return err
	}
	staging := filepath.Join(l.pinDir, stagingDir)
	if err := os.Mkdir(staging, 0o700); err != nil {
		return fmt.Errorf("creating the staging directory of the migration: %w", err)
	}
	l.mig = &migration{reason: reason, staging: staging}
	err := spec.LoadAndAssign(&l.objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: staging}})
	if err != nil {
		return l.loadError(err)
	}
	return l.carryOver()
}

// carriedMaps are the pinned maps whose contents a migration copies to the
// new ones before the new programs run beside the old (attachStaged):
//
//   - who is a member of which project, and the projects' names by id (the
//     ids the members name). They are definitions, not counts, and the new
//     programs must classify sockets from the moment they run (the daemon
//     sets the members again only after Open);
//   - what makes the old programs admit what the rule refuses, which the
//     daemon writes only after Open: the pool's dry-run and the events'
//     bound (fs_ev_config: the new programs report their refusals), the
//     projects in dry-run (fs_dryrun, by project id: carried with the
//     names only), and the lapse (fs_lapses: the last daemon's heartbeat
//     and lapse_after, so that the new programs lapse when the old ones do,
//     also after a crash that leaves them attached).
//
// Copied entry by entry, as bytes, only when the old and new entries have
// the same size (fs_lapses: the fields both have, which only ever grew at
// the end). A map that cannot be carried starts as at a first start, but
// the members never without the names (their ids would be given to other
// projects).
var carriedMaps = []string{"fs_names", "fs_members", "fs_dryrun", "fs_ev_config", "fs_lapses"}

// carryOver copies carriedMaps from the old pins to the new maps.
func (l *Limiter) carryOver() error {
	dsts := map[string]*ebpf.Map{"fs_names": l.objs.FsNames, "fs_members": l.objs.FsMembers,
		"fs_dryrun": l.objs.FsDryrun, "fs_ev_config": l.objs.FsEvConfig, "fs_lapses": l.objs.FsLapses}
	named := false // fs_names was carried: the ids mean what they meant
	for _, name := range carriedMaps {
		if (name == "fs_members" || name == "fs_dryrun") && !named {
			if _, err := os.Stat(filepath.Join(l.pinDir, name)); err == nil {
				l.log.Error("not carried over by the migration, the project names were not: projects are not recognised until the daemon sets the members",
					"map", name)
			}
			continue
		}
		src, err := ebpf.LoadPinnedMap(filepath.Join(l.pinDir, name), nil)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return fmt.Errorf("reading the old pinned map %s: %w", name, err)
		}
		var n int
		if name == "fs_lapses" {
			n, err = copyPrefix(src, dsts[name])
		} else {
			n, err = copyEntries(src, dsts[name])
		}
		src.Close()
		if err != nil {
			// Not a refusal: the daemon sets the members right after
			// Open; until then the new programs see no project (and
			// the old ones still run, and refuse or not, beside them).
			l.log.Error("a map could not be carried over by the migration: the new programs start without it until the daemon writes it",
				"map", name, "err", err)
			continue
		}
		named = named || name == "fs_names"
		l.log.Debug("carried over by the migration", "map", name, "entries", n)
	}
	return nil
}

// copyPrefix copies the entries of the array src into the array dst as
// copyEntries does, each value's bytes that both sizes have (the rest
// zero): for a value whose fields were only ever added at its end.
func copyPrefix(src, dst *ebpf.Map) (int, error) {
	if src.ValueSize() == dst.ValueSize() {
		return copyEntries(src, dst)
	}
	if src.KeySize() != 4 || dst.KeySize() != 4 || src.Type() != ebpf.Array {
		return 0, fmt.Errorf("entries of %d+%d bytes, this version's %d+%d",
			src.KeySize(), src.ValueSize(), dst.KeySize(), dst.ValueSize())
	}
	v := make([]byte, src.ValueSize())
	n := 0
	for k := uint32(0); k < min(src.MaxEntries(), dst.MaxEntries()); k++ {
		if err := src.Lookup(k, v); err != nil {
			return n, err
		}
		w := make([]byte, dst.ValueSize())
		copy(w, v)
		if err := dst.Put(k, w); err != nil {
			return n, err
		}
		n++
	}
	return n, nil
}

// copyEntries copies every non-zero entry of src into dst, as bytes.
func copyEntries(src, dst *ebpf.Map) (int, error) {
	if src.KeySize() != dst.KeySize() || src.ValueSize() != dst.ValueSize() {
		return 0, fmt.Errorf("entries of %d+%d bytes, this version's %d+%d",
			src.KeySize(), src.ValueSize(), dst.KeySize(), dst.ValueSize())
	}
	k, v := make([]byte, src.KeySize()), make([]byte, src.ValueSize())
	zero := make([]byte, src.ValueSize())
	n := 0
	it := src.Iterate()
	for it.Next(k, v) {
		if src.Type() == ebpf.Array && string(v) == string(zero) {
			continue
		}
		if err := dst.Put(k, v); err != nil {
			return n, err
		}
		n++
	}
	return n, it.Err()
}

// otherNetns finds the network namespaces the host's processes are in,
// other than the daemon's own, by their inode, each with a path to enter it
// by (/proc/<pid>/ns/net, checked again by inode when it is entered) and
// its cookie. One that cannot be entered is left out: its connections are
// counted at a later reconcile pass that can, as at a first start.
func (l *Limiter) otherNetns() map[uint64]dumpTarget {
	var self unix.Stat_t
	if err := unix.Stat("/proc/thread-self/ns/net", &self); err != nil {
		return nil
	}
	pids, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	out := map[uint64]dumpTarget{}
	seen := map[uint64]bool{self.Ino: true}
	for _, e := range pids {
		if e.Name()[0] < '0' || e.Name()[0] > '9' {
			continue
		}
		path := filepath.Join("/proc", e.Name(), "ns", "net")
		var st unix.Stat_t
		if unix.Stat(path, &st) != nil || seen[st.Ino] {
			continue
		}
		seen[st.Ino] = true
		ns, err := netns.GetFromPath(path)
		if err != nil {
			continue
		}
		var cookie uint64
		err = inNetns(ns, func() error {
			var err error
			cookie, err = netnsCookie()
			return err
		})
		ns.Close()
		if err != nil {
			l.log.Debug("a network namespace the migration cannot enter: its connections are counted later", "path", path, "err", err)
			continue
		}
		out[st.Ino] = dumpTarget{cookie: cookie, path: path, ino: st.Ino}
	}
	return out
}

// attachStaged attaches the new programs beside the old ones, their links
// pinned in the staging directory: from here both run, the release paths
// first, as attach does. Each hook's programs all run: a connect is
// refused if either refuses (cgroup hooks AND their verdicts), a SYN
// dropped if either drops (sk_lookup passes only if every program passes
// or one selects a socket, which these never do); each counts in its own
// maps and releases there.
func (l *Limiter) attachStaged() error {
	var tags []any
	for _, a := range l.attachments(l.root, &l.objs) {
		lk, err := a.attach()
		if err != nil {
			if errors.Is(err, ebpf.ErrNotSupported) {
				return fmt.Errorf("attaching %s: the kernel does not support this hook: %w", a.name, err)
			}
			return fmt.Errorf("attaching %s: %w", a.name, err)
		}
		l.links = append(l.links, lk)
		if err := lk.Pin(filepath.Join(l.mig.staging, a.name)); err != nil {
			return fmt.Errorf("pinning %s: %w", a.name, err)
		}
		if info, err := a.prog.Info(); err == nil {
			tags = append(tags, a.name, info.Tag)
		}
	}
	l.log.Info("bpf programs attached beside those of the old pins", tags...)
	return nil
}

// commit renames the staging directory to the ready one: from here a
// crash leaves pins the next Open installs rather than discards.
func (l *Limiter) commit() error {
	if err := os.Rename(l.mig.staging, filepath.Join(l.pinDir, readyDir)); err != nil {
		return fmt.Errorf("committing the migration: %w", err)
	}
	l.mig.committed = true
	return nil
}

// install moves the pins of the ready directory up over the old ones, then
// removes the old pins this version has no name for, and the directory.
// Replacing a link's pin detaches the old link (no process holds it: the
// old daemon is gone), whose new counterpart runs already. Each step is
// one rename or unlink, and every step is done again by a later Open if a
// crash interrupts this one.
func (l *Limiter) install() error {
	ready := filepath.Join(l.pinDir, readyDir)
	ents, err := os.ReadDir(ready)
	if err != nil {
		return fmt.Errorf("reading %s: %w", ready, err)
	}
	for i, e := range ents {
		if err := os.Rename(filepath.Join(ready, e.Name()), filepath.Join(l.pinDir, e.Name())); err != nil {
			return fmt.Errorf("moving the migrated pin %s in place: %w", e.Name(), err)
		}
		if i == len(ents)/2 {
			if err := migrateFault("installing"); err != nil {
				return err
			}
		}
	}
	known, err := currentPins()
	if err != nil {
		return err
	}
	top, err := os.ReadDir(l.pinDir)
	if err != nil {
		return fmt.Errorf("reading %s: %w", l.pinDir, err)
	}
	for _, e := range top {
		name := e.Name()
		if e.IsDir() || known[name] || !(strings.HasPrefix(name, "fs_") || strings.HasPrefix(name, "link_")) {
			continue
		}
		// A pin of the old layout this version does not have: a retired
		// link (unpinned, it detaches) or map.
		if err := os.Remove(filepath.Join(l.pinDir, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("removing the old pin %s: %w", name, err)
		}
		l.log.Info("removed a pin of the old layout this version does not use", "pin", name)
	}
	if err := os.Remove(ready); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("removing %s: %w", ready, err)
	}
	return nil
}

// currentPins names what this version pins at the top of the pin
// directory: its pinned maps and its links.
func currentPins() (map[string]bool, error) {
	spec, err := loadLimiter()
	if err != nil {
		return nil, fmt.Errorf("reading the embedded BPF object: %w", err)
	}
	out := map[string]bool{}
	for name, ms := range spec.Maps {
		if ms.Pinning == ebpf.PinByName {
			out[name] = true
		}
	}
	var l Limiter
	for _, a := range l.attachments("", &limiterObjects{}) {
		out[a.name] = true
	}
	return out, nil
}

// discardStaged undoes a migration that failed before its commit: the
// staging pins are removed (the new links detach once the limiter's
// descriptors are closed); the old pins were not touched and enforce.
func (l *Limiter) discardStaged() {
	if l.mig == nil {
		return
	}
	if _, err := os.Stat(l.mig.staging); err != nil {
		return
	}
	if err := Cleanup(l.mig.staging); err != nil {
		l.log.Error("removing the pins of the failed migration (the next start removes them)", "dir", l.mig.staging, "err", err)
	}
}
