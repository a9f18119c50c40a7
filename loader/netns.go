// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strconv"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// NetnsInfo is a network namespace where inbound admission (sk_lookup)
// runs.
type NetnsInfo struct {
	Cookie uint64 // the kernel's netns cookie (SO_NETNS_COOKIE)
	Inode  uint64 // the inode of its namespace file (/proc/<pid>/ns/net)
	Path   string // the path it was attached by ("" for one found pinned at Open)
}

// netnsDir is the subdirectory of the pin directory holding one link per
// attached namespace, named by its cookie.
const netnsDir = "netns"

// netnsLink is one namespace's sk_lookup instance and its link.
type netnsLink struct {
	info NetnsInfo
	prog *ebpf.Program
	lk   link.Link
}

// inNetns runs f on a thread that has entered the network namespace open at
// ns, and comes back. If it cannot come back the thread is not given back
// to the scheduler (it ends with the goroutine).
func inNetns(ns netns.NsHandle, f func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- fmt.Errorf("reading the thread's network namespace: %w", err)
			return
		}
		defer orig.Close()
		if err := netns.Set(ns); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("entering the network namespace: %w", err)
			return
		}
		ferr := f()
		if err := netns.Set(orig); err != nil {
			errc <- errors.Join(ferr, fmt.Errorf("leaving the network namespace: %w", err))
			return // locked: the thread dies with this goroutine
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// lookupSpec is the collection of the sk_lookup program alone, its maps
// replaced by the limiter's pinned ones, for the per-namespace instances.
func (l *Limiter) lookupSpec() (*ebpf.CollectionSpec, map[string]*ebpf.Map, error) {
	spec, err := l.spec()
	if err != nil {
		return nil, nil, err
	}
	for name := range spec.Programs {
		if name != "fs_sk_lookup" {
			delete(spec.Programs, name)
		}
	}
	// Every map of the limiter, by its name (the bpf2go struct's tags).
	reps := map[string]*ebpf.Map{}
	mv := reflect.ValueOf(&l.objs.limiterMaps).Elem()
	for i := range mv.NumField() {
		name := mv.Type().Field(i).Tag.Get("ebpf")
		if m, ok := mv.Field(i).Interface().(*ebpf.Map); ok && m != nil {
			if _, used := spec.Maps[name]; used {
				reps[name] = m
			}
		}
	}
	for name := range spec.Maps {
		if _, ok := reps[name]; !ok && name[0] != '.' {
			return nil, nil, fmt.Errorf("map %s of the sk_lookup program has no shared instance", name)
		}
	}
	return spec, reps, nil
}

// loadLookup loads an instance of the sk_lookup program for the namespace
// with the given cookie.
func (l *Limiter) loadLookup(cookie uint64) (*ebpf.Program, error) {
	if l.lookupCache == nil {
		spec, reps, err := l.lookupSpec()
		if err != nil {
			return nil, err
		}
		l.lookupCache, l.lookupReps = spec, reps
	}
	spec, reps := l.lookupCache.Copy(), l.lookupReps
	if err := spec.Variables["lookup_netns"].Set(cookie); err != nil {
		return nil, fmt.Errorf("setting lookup_netns: %w", err)
	}
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{MapReplacements: reps})
	if err != nil {
		return nil, l.loadError(err)
	}
	defer coll.Close()
	prog := coll.Programs["fs_sk_lookup"]
	// Keep the program past the collection's Close.
	return prog.Clone()
}

// AttachNetns attaches inbound admission in the network namespace whose
// file is nsPath (/proc/<pid>/ns/net, /var/run/netns/<name>): an instance of
// the sk_lookup program with that namespace's cookie, sharing the maps,
// its link pinned under <pin dir>/netns/<cookie>. It is idempotent by
// namespace (another path to an attached one returns its info), and the
// daemon's own namespace is attached by Open.
func (l *Limiter) AttachNetns(nsPath string) (NetnsInfo, error) {
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		return NetnsInfo{}, fmt.Errorf("opening network namespace %s: %w", nsPath, err)
	}
	defer ns.Close()
	return l.attachNetns(ns, nsPath)
}

// AttachNetnsFile is AttachNetns of a namespace the caller opened (through
// a pidfd, so that a reused pid cannot name another namespace); nsPath is
// how reconcile enters it later, checked against its inode then.
func (l *Limiter) AttachNetnsFile(ns *os.File, nsPath string) (NetnsInfo, error) {
	return l.attachNetns(netns.NsHandle(ns.Fd()), nsPath)
}

func (l *Limiter) attachNetns(ns netns.NsHandle, nsPath string) (NetnsInfo, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(ns), &st); err != nil {
		return NetnsInfo{}, fmt.Errorf("reading network namespace %s: %w", nsPath, err)
	}
	var cookie uint64
	if err := inNetns(ns, func() (err error) { cookie, err = netnsCookie(); return err }); err != nil {
		return NetnsInfo{}, fmt.Errorf("network namespace %s: %w", nsPath, err)
	}
	info := NetnsInfo{Cookie: cookie, Inode: st.Ino, Path: nsPath}

	// One attach at a time; the load (the verifier: tens of ms) runs
	// outside l.mu, so status and Tick do not wait for it.
	l.attachM.Lock()
	defer l.attachM.Unlock()
	l.mu.Lock()
	switch n, ok := l.nets[cookie]; {
	case l.closed:
		l.mu.Unlock()
		return NetnsInfo{}, ErrClosed
	case cookie == l.netns:
		l.mu.Unlock()
		return NetnsInfo{Cookie: cookie, Inode: l.netnsIno, Path: "/proc/self/ns/net"}, nil
	case ok:
		// The latest path is the one reconcile enters by.
		n.info.Path, n.info.Inode = nsPath, st.Ino
		info := n.info
		l.mu.Unlock()
		return info, nil
	case len(l.nets) >= l.maxNetns:
		n := len(l.nets)
		l.mu.Unlock()
		return NetnsInfo{}, fmt.Errorf("network namespace %s: %d attached (Options.MaxNetns): %w", nsPath, n, ErrNetnsFull)
	}
	l.mu.Unlock()

	prog, err := l.loadLookup(cookie)
	if err != nil {
		return NetnsInfo{}, err
	}
	lk, err := link.AttachNetNs(int(ns), prog)
	if err != nil {
		prog.Close()
		return NetnsInfo{}, fmt.Errorf("attaching sk_lookup in network namespace %s: %w", nsPath, err)
	}
	// The pin directory itself is not made again: one removed under the
	// daemon (cleanup --force) is not its to fill, nor one made in its
	// place (the caller's lock says which is its own).
	if l.pinLock != nil {
		if replaced, err := PinDirReplaced(l.pinLock, l.pinDir); err != nil || replaced {
			lk.Close()
			prog.Close()
			return NetnsInfo{}, fmt.Errorf("attaching network namespace %s: the pin directory %s was removed or replaced", nsPath, l.pinDir)
		}
	}
	dir := filepath.Join(l.pinDir, netnsDir)
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		lk.Close()
		prog.Close()
		return NetnsInfo{}, fmt.Errorf("creating %s: %w", dir, err)
	}
	if err := lk.Pin(filepath.Join(dir, strconv.FormatUint(cookie, 10))); err != nil {
		lk.Close()
		prog.Close()
		return NetnsInfo{}, fmt.Errorf("pinning the sk_lookup link of network namespace %s: %w", nsPath, err)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		// Closed meanwhile: the link stays pinned, as all do at Close,
		// and the next Open takes it up.
		lk.Close()
		prog.Close()
		return info, nil
	}
	l.nets[cookie] = &netnsLink{info: info, prog: prog, lk: lk}
	l.log.Info("inbound admission attached in a network namespace", "netns", nsPath, "cookie", cookie, "inode", st.Ino)
	return info, nil
}

// Netns lists the namespaces where inbound admission runs: the daemon's own
// first, then the attached ones by cookie.
func (l *Limiter) Netns() ([]NetnsInfo, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil, ErrClosed
	}
	out := []NetnsInfo{{Cookie: l.netns, Inode: l.netnsIno, Path: "/proc/self/ns/net"}}
	for _, n := range l.nets {
		out = append(out, n.info)
	}
	slices.SortFunc(out[1:], func(a, b NetnsInfo) int { return cmp.Compare(a.Cookie, b.Cookie) })
	return out, nil
}

// DetachGone detaches and unpins the links of attached namespaces that no
// longer exist (the kernel reports a link whose namespace died with inode
// 0) and returns them.
func (l *Limiter) DetachGone() ([]NetnsInfo, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil, ErrClosed
	}
	var gone []NetnsInfo
	var errs []error
	for cookie, n := range l.nets {
		if alive, err := linkAlive(n.lk); err != nil {
			errs = append(errs, fmt.Errorf("reading the link of network namespace %d: %w", cookie, err))
			continue
		} else if alive {
			continue
		}
		// Gone whether or not its pin goes: the namespace is dead, and
		// its number may be a new namespace's already (the caller's
		// record of it must go). A pin left is unpinned at the next
		// start (reattachNetns).
		if err := n.lk.Unpin(); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("unpinning the link of network namespace %d: %w", cookie, err))
		}
		n.lk.Close()
		n.prog.Close()
		delete(l.nets, cookie)
		gone = append(gone, n.info)
		l.log.Info("network namespace gone: its inbound admission detached", "netns", n.info.Path, "cookie", cookie)
	}
	slices.SortFunc(gone, func(a, b NetnsInfo) int { return cmp.Compare(a.Cookie, b.Cookie) })
	return gone, errors.Join(errs...)
}

// linkAlive says whether a netns link's namespace still exists.
func linkAlive(lk link.Link) (bool, error) {
	info, err := lk.Info()
	if err != nil {
		return false, err
	}
	ni := info.NetNs()
	return ni != nil && ni.NetnsInode != 0, nil
}

// reattachNetns takes up the namespace links an earlier run pinned: those
// whose namespace is gone are unpinned, the others moved to a program
// instance of this binary (so a restart runs new code everywhere).
func (l *Limiter) reattachNetns() error {
	l.nets = map[uint64]*netnsLink{}
	var st unix.Stat_t
	if err := unix.Stat("/proc/thread-self/ns/net", &st); err == nil {
		l.netnsIno = st.Ino
	}
	dir := filepath.Join(l.pinDir, netnsDir)
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("reading %s: %w", dir, err)
	}
	for _, e := range ents {
		path := filepath.Join(dir, e.Name())
		cookie, err := strconv.ParseUint(e.Name(), 10, 64)
		if err != nil {
			continue // not ours
		}
		lk, err := link.LoadPinnedLink(path, nil)
		if err != nil {
			return fmt.Errorf("loading pinned link %s: %w", path, err)
		}
		info, err := lk.Info()
		if err != nil {
			lk.Close()
			return fmt.Errorf("reading pinned link %s: %w", path, err)
		}
		ni := info.NetNs()
		if ni == nil || ni.NetnsInode == 0 {
			_ = lk.Unpin()
			lk.Close()
			l.log.Info("network namespace gone while the daemon was down: its inbound admission detached", "cookie", cookie)
			continue
		}
		prog, err := l.loadLookup(cookie)
		if err != nil {
			lk.Close()
			return err
		}
		if err := lk.Update(prog); err != nil {
			prog.Close()
			lk.Close()
			return fmt.Errorf("moving pinned link %s to the new program: %w", path, err)
		}
		l.nets[cookie] = &netnsLink{info: NetnsInfo{Cookie: cookie, Inode: uint64(ni.NetnsInode)}, prog: prog, lk: lk}
	}
	return nil
}

// closeNetns closes the descriptors of the namespace links (they stay pinned).
func (l *Limiter) closeNetns() {
	for _, n := range l.nets {
		n.lk.Close()
		n.prog.Close()
	}
	l.nets = nil
}

// cleanupNetns unpins the namespace links under pinDir and removes their
// directory.
func cleanupNetns(pinDir string) error {
	dir := filepath.Join(pinDir, netnsDir)
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("reading %s: %w", dir, err)
	}
	var errs []error
	for _, e := range ents {
		path := filepath.Join(dir, e.Name())
		if lk, err := link.LoadPinnedLink(path, nil); err == nil {
			err = lk.Unpin()
			lk.Close()
			if err != nil {
				errs = append(errs, fmt.Errorf("unpinning %s: %w", path, err))
			}
			continue
		}
		if err := os.Remove(path); err != nil {
			errs = append(errs, fmt.Errorf("unpinning %s: %w", path, err))
		}
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("removing %s: %w", dir, err))
	}
	return errors.Join(errs...)
}
