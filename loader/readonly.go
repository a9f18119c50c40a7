// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/cilium/ebpf"
	"github.com/fairshare-dev/fairshare/internal/clock"
	"golang.org/x/sys/unix"
)

// ErrNotPinned means the pin directory holds no limiter.
var ErrNotPinned = errors.New("no limiter is pinned there")

// ReadOnly is the counting side of a pinned limiter opened read-only: the
// maps a daemon left pinned keep counting and refusing in the kernel while
// no daemon runs, and `fairshare status` reads them from here. Every map is
// opened with BPF_F_RDONLY, so nothing written through a ReadOnly can change
// what the programs do; no program is loaded and no link is touched.
type ReadOnly struct{ l *Limiter }

// OpenReadOnly opens the maps pinned in pinDir. The projects are named from
// the pinned names map, as the daemon named them.
func OpenReadOnly(pinDir string) (*ReadOnly, error) {
	if pinDir == "" {
		pinDir = DefaultPinDir
	}
	if _, err := os.Stat(filepath.Join(pinDir, "fs_config")); errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%s: %w", pinDir, ErrNotPinned)
	} else if err != nil {
		return nil, fmt.Errorf("reading %s: %w", pinDir, err)
	}
	spec, err := loadLimiter()
	if err != nil {
		return nil, fmt.Errorf("reading the embedded BPF object: %w", err)
	}
	l := &Limiter{readOnly: true, pinDir: pinDir, clock: clock.System{}, mono: monoNow,
		log: slog.New(slog.DiscardHandler)}
	ok := false
	defer func() {
		if !ok {
			l.objs.Close()
		}
	}()
	for _, m := range []struct {
		name string
		dst  **ebpf.Map
	}{
		{"fs_config", &l.objs.FsConfig}, {"fs_node", &l.objs.FsNode}, {"fs_projects", &l.objs.FsProjects}, {"fs_names", &l.objs.FsNames},
		{"fs_stats", &l.objs.FsStats}, {"fs_resv_slots", &l.objs.FsResvSlots}, {"fs_reservations", &l.objs.FsReservations},
	} {
		mp, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, m.name), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			if errors.Is(err, os.ErrPermission) {
				return nil, fmt.Errorf("opening the pinned map %s needs root (CAP_BPF): %w", m.name, err)
			}
			return nil, fmt.Errorf("opening the pinned map %s in %s: %w", m.name, pinDir, err)
		}
		*m.dst = mp
		if err := sameLayout(spec, m.name, mp, pinDir); err != nil {
			return nil, err
		}
	}
	// The rate maps are missing from the pins of a version without rates,
	// fs_lapses from those of a version without the lapse, and the
	// destination pool maps from those of a version without them.
	for _, m := range []struct {
		name string
		dst  **ebpf.Map
	}{{"fs_rates", &l.objs.FsRates}, {"fs_rate_stats", &l.objs.FsRateStats}, {"fs_lapses", &l.objs.FsLapses},
		{"fs_dpool_conf", &l.objs.FsDpoolConf}, {"fs_dpool_state", &l.objs.FsDpoolState}, {"fs_dpool_proj", &l.objs.FsDpoolProj}} {
		mp, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, m.name), &ebpf.LoadPinOptions{ReadOnly: true})
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("opening the pinned map %s in %s: %w", m.name, pinDir, err)
		}
		*m.dst = mp
		if err := sameLayout(spec, m.name, mp, pinDir); err != nil {
			return nil, err
		}
	}
	var cfg limiterFsSettings
	if err := l.objs.FsConfig.Lookup(uint32(0), &cfg); err != nil {
		return nil, fmt.Errorf("reading the pinned config: %w", err)
	}
	if cfg.Layout != pinLayout {
		return nil, fmt.Errorf("the pins in %s are of layout %d, this version's is %d: read them with the fairshare "+
			"binary that pinned them, or start this version's daemon, which migrates them: %w", pinDir, cfg.Layout, pinLayout, ErrPinnedMismatch)
	}
	l.size, l.floor, l.exemptMax = cfg.Pool, cfg.Floor, cfg.ExemptMax
	l.window = time.Duration(cfg.WindowNs)
	if l.window <= 0 {
		l.window = time.Second
	}
	l.maxProj = l.objs.FsProjects.MaxEntries()
	if l.objs.FsDpoolConf != nil && l.objs.FsDpoolState != nil && l.objs.FsDpoolProj != nil {
		if err := l.loadDestsLocked(); err != nil {
			return nil, err
		}
	}
	ok = true
	return &ReadOnly{l: l}, nil
}

// sameLayout refuses pinned map m (name) when its layout is not this
// version's: read with this version's structs, another version's counts
// would be misread (a destination pool's packed counts as plain ones, a
// field at another offset), not refused. A daemon's start migrates such
// pins; reading them needs the binary that wrote them.
func sameLayout(spec *ebpf.CollectionSpec, name string, m *ebpf.Map, pinDir string) error {
	ms, ok := spec.Maps[name]
	if !ok {
		return nil
	}
	const layout = unix.BPF_F_MMAPABLE | unix.BPF_F_NO_PREALLOC
	if m.Type() != ms.Type || m.KeySize() != ms.KeySize || m.ValueSize() != ms.ValueSize || m.Flags()&layout != ms.Flags&layout {
		return fmt.Errorf("the pinned map %s in %s has another version's layout (%v, key %d, value %d bytes, flags %#x; this version's: %v, %d, %d, %#x): "+
			"read it with the fairshare binary that pinned it, or start this version's daemon, which migrates the pins: %w",
			name, pinDir, m.Type(), m.KeySize(), m.ValueSize(), m.Flags()&layout, ms.Type, ms.KeySize, ms.ValueSize, ms.Flags&layout, ErrPinnedMismatch)
	}
	return nil
}

// Snapshot reads the pinned maps, as Limiter.Snapshot does.
func (r *ReadOnly) Snapshot() (Snapshot, error) { return r.l.Snapshot() }

// KernelActive is the active count the programs compute the share from.
func (r *ReadOnly) KernelActive() (int, error) { return r.l.KernelActive() }

// Close closes the maps; the pins stay.
func (r *ReadOnly) Close() error {
	r.l.mu.Lock()
	r.l.closed = true
	r.l.mu.Unlock()
	return r.l.objs.Close()
}

// KernelActive reads the active count the programs keep and apply the share
// from (Snapshot.Share is computed from it). The programs add a newcomer at
// its first ask and only Tick takes out a project that left the window, so
// it can be ahead of the projects Snapshot marks active, for up to a tick
// while a daemon runs and indefinitely while none does. Reported with the
// share, it is the pair the kernel enforces.
func (l *Limiter) KernelActive() (int, error) {
	// Under mu: Close closes the maps' descriptors under it, and a status
	// call may still run as the daemon stops.
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return 0, ErrClosed
	}
	var node limiterFsPool
	if err := l.objs.FsNode.Lookup(uint32(0), &node); err != nil {
		return 0, fmt.Errorf("reading node map: %w", err)
	}
	return int(max(node.Active, 0)), nil
}
