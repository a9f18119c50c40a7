// SPDX-License-Identifier: Apache-2.0

package membership

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// watcher tells when the children of one directory may have changed: an
// inotify watch for directories created, removed or renamed in it (mkdir
// and rmdir on cgroupfs go through the VFS, which reports them). It only
// wakes the caller, which rescans; a lost or coalesced event costs nothing
// but the wait for the next tick's rescan.
type watcher struct {
	dir     string
	changed chan struct{}

	mu   sync.Mutex // guards the fields below
	f    *os.File   // the inotify descriptor; nil when not watching
	live bool       // the watch on dir is in place (false after dir went)
}

func newWatcher(dir string) *watcher {
	return &watcher{dir: dir, changed: make(chan struct{}, 1)}
}

// ensure puts the watch in place if it is not (dir did not exist yet, or
// was removed and made again). Each time it does, the caller must rescan:
// what changed before the watch was in place was not reported.
func (w *watcher) ensure() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.live {
		return nil
	}
	if w.f == nil {
		fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
		if err != nil {
			return fmt.Errorf("inotify: %w", err)
		}
		// Non-blocking: the runtime's poller reads it, and Close wakes a
		// read in progress.
		w.f = os.NewFile(uintptr(fd), "inotify:"+w.dir)
		go w.read(w.f)
	}
	const mask = unix.IN_CREATE | unix.IN_DELETE | unix.IN_MOVED_FROM | unix.IN_MOVED_TO |
		unix.IN_DELETE_SELF | unix.IN_MOVE_SELF | unix.IN_ONLYDIR
	if _, err := unix.InotifyAddWatch(int(w.f.Fd()), w.dir, mask); err != nil {
		return fmt.Errorf("watching %s: %w", w.dir, err)
	}
	w.live = true
	return nil
}

// read wakes the caller at every batch of events, until f is closed.
func (w *watcher) read(f *os.File) {
	buf := make([]byte, 64*(unix.SizeofInotifyEvent+unix.NAME_MAX+1))
	for {
		n, err := f.Read(buf)
		if err != nil {
			if errors.Is(err, os.ErrClosed) {
				return
			}
			// Not expected from inotify; the rescan each tick still works.
			w.mu.Lock()
			w.live = false
			w.mu.Unlock()
			return
		}
		for off := 0; off+unix.SizeofInotifyEvent <= n; {
			ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
			if ev.Mask&(unix.IN_IGNORED|unix.IN_DELETE_SELF|unix.IN_MOVE_SELF) != 0 {
				// The directory went: the watch is gone with it.
				w.mu.Lock()
				w.live = false
				w.mu.Unlock()
			}
			off += unix.SizeofInotifyEvent + int(ev.Len)
		}
		select {
		case w.changed <- struct{}{}:
		default:
		}
	}
}

// close stops the watch.
func (w *watcher) close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.live = false
	if w.f == nil {
		return nil
	}
	err := w.f.Close()
	w.f = nil
	return err
}
