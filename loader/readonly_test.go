// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// With the daemon's limiter closed (as after a stop or a SIGKILL), the
// pinned maps still count; OpenReadOnly reads the same numbers and cannot
// write.
func TestReadOnlyWhileNoDaemon(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 8, 1)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	h := startHelper(t, mkProject(t, root, "alpha"))
	if r := h.dial("tcp4", ln.Addr().String(), 3); r.ok != 3 {
		t.Fatalf("dial: %+v", r)
	}
	want := snap(t, l)
	l.Close()

	if _, err := OpenReadOnly(t.TempDir()); !errors.Is(err, ErrNotPinned) {
		t.Fatalf("an empty directory: %v", err)
	}
	ro, err := OpenReadOnly(pin)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	got, err := ro.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	if got.InUse != 3 || got.Size != 8 || project(got, "alpha").InUse != 3 || got.Admitted != want.Admitted {
		t.Fatalf("read-only snapshot %+v, daemon's %+v", got, want)
	}
	if a, err := ro.KernelActive(); err != nil || a != 1 {
		t.Fatalf("kernel active %d %v", a, err)
	}
	if err := ro.l.objs.FsNode.Put(uint32(0), make([]byte, ro.l.objs.FsNode.ValueSize())); err == nil {
		t.Fatal("a write through the read-only maps succeeded")
	}
}

// Pins of another version's layout are refused, not misread: here a
// destination pool's project table as an earlier version pinned it (a plain
// array, its counts unpacked), which this version would read as packed.
func TestReadOnlyRefusesAnotherLayout(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	openLimiter(t, root, pin, 8, 1).Close()
	spec, err := loadLimiter()
	if err != nil {
		t.Fatal(err)
	}
	ms := spec.Maps["fs_dpool_proj"].Copy()
	ms.Flags &^= unix.BPF_F_MMAPABLE
	ms.Pinning = ebpf.PinNone
	old, err := ebpf.NewMap(ms)
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	path := filepath.Join(pin, "fs_dpool_proj")
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := old.Pin(path); err != nil {
		t.Fatal(err)
	}
	ro, err := OpenReadOnly(pin)
	if err == nil {
		ro.Close()
	}
	if !errors.Is(err, ErrPinnedMismatch) || !strings.Contains(err.Error(), "fs_dpool_proj") {
		t.Fatalf("pins of another layout opened read-only: %v", err)
	}
}

// Pins whose sizes and flags are this version's but whose bytes mean
// something else (fs_settings.layout, pinLayout) are refused read-only, and
// a start migrates them, writing this version's layout.
func TestPinnedLayoutWord(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	openLimiter(t, root, pin, 8, 1).Close()
	m, err := ebpf.LoadPinnedMap(filepath.Join(pin, "fs_config"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	var cfg limiterFsSettings
	if err := m.Lookup(uint32(0), &cfg); err != nil || cfg.Layout != pinLayout {
		t.Fatalf("layout after a start: %d (want %d): %v", cfg.Layout, pinLayout, err)
	}
	cfg.Layout = pinLayout - 1
	if err := m.Put(uint32(0), &cfg); err != nil {
		t.Fatal(err)
	}
	if ro, err := OpenReadOnly(pin); !errors.Is(err, ErrPinnedMismatch) || !strings.Contains(err.Error(), "layout") {
		if ro != nil {
			ro.Close()
		}
		t.Fatalf("pins of another layout word opened read-only: %v", err)
	}
	spec, err := loadLimiter()
	if err != nil {
		t.Fatal(err)
	}
	for name, ms := range spec.Maps { // sized as the start that pinned them sized them
		if pm, err := ebpf.LoadPinnedMap(filepath.Join(pin, name), nil); err == nil {
			ms.MaxEntries = pm.MaxEntries()
			pm.Close()
		}
	}
	if why, err := (&Limiter{pinDir: pin}).incompatible(spec); err != nil || why != fmt.Sprintf("pins of layout %d, this version's is %d", pinLayout-1, pinLayout) {
		t.Fatalf("a start would not migrate pins of another layout word: %q %v", why, err)
	}
	l := openLimiter(t, root, pin, 8, 1)
	l.Close()
	m2, err := ebpf.LoadPinnedMap(filepath.Join(pin, "fs_config"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m2.Close()
	if err := m2.Lookup(uint32(0), &cfg); err != nil || cfg.Layout != pinLayout {
		t.Fatalf("layout after the start that migrated: %d (want %d): %v", cfg.Layout, pinLayout, err)
	}
	ro, err := OpenReadOnly(pin)
	if err != nil {
		t.Fatalf("this version's pins after the migration: %v", err)
	}
	ro.Close()
}
