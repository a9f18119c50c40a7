// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fairshare-dev/fairshare/loader/limits"
)

// The safe slice without a daemon (bpf/lib/cap.h, fleet_safe_now). A fleet
// pool's allotment holds only while the daemon lives: once its lease has
// expired (or been revoked at a stop) the other nodes share its part among
// themselves, while the programs, pinned, go on enforcing. So the
// heartbeat (lapse.go) also carries the fleet's lease_ttl, and once the
// heartbeat is older than that the programs hold each fleet pool in the
// kernel to its safe slice, without caps: what a live node cut off from
// etcd decays to (package fleet). The connections pool's safe slice rides
// with the heartbeat (fs_lapses slot 0, with the flag capsFleet in
// fs_settings.caps so that a node without a fleet pool reads nothing
// more); a destination pool's is in its settings (fs_dpool_conf, copied to
// the line of its counts).

// fs_settings.caps (bpf/lib/cap.h).
const (
	capsOn    = 1 // some pool has fleet caps
	capsFleet = 2 // the connections pool is a fleet pool
)

// SetFleetSafe sets the safe slice of fleet pool pool (the connections
// pool for "", else a destination pool marked Fleet): the size the
// programs hold it to, without caps, once its lease has ended unrenewed.
// leaseEnd is when the pool's lease ends as this node last renewed it (the
// others may stop counting the node then), zero before the first; ttl the
// fleet's lease_ttl, for a pool without a lease yet (a ttl after the last
// heartbeat). The daemon calls it at each change of the safe slice and
// each renewal of the lease; it renews the heartbeat, which carries the
// earliest of the pools' ends (fleetAfterLocked).
func (l *Limiter) SetFleetSafe(pool string, safe uint32, leaseEnd time.Time, ttl time.Duration) error {
	if ttl <= 0 || ttl/time.Millisecond > math.MaxUint32 {
		return fmt.Errorf("fleet safe slice with a lease of %v: %w", ttl, ErrInvalidOptions)
	}
	if safe > limits.MaxPoolSize {
		return fmt.Errorf("fleet safe slice %d, at most %d: %w", safe, limits.MaxPoolSize, ErrInvalidOptions)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return ErrClosed
	}
	var dp *destPool
	if pool != "" {
		var ok bool
		if dp, ok = l.dests[pool]; !ok || !dp.live || !dp.cfg.Fleet {
			return fmt.Errorf("%q (a destination pool marked fleet): %w", pool, ErrNoDestPool)
		}
	}
	if l.fleetEnd == nil {
		l.fleetEnd = map[string]time.Time{}
	}
	l.fleetTTL, l.fleetEnd[pool] = ttl, leaseEnd
	if pool == "" {
		// The flag once per Open (not at every renewal): Open clears it
		// (clearCaps), though it keeps the pinned slice (nodeSafe).
		first := !l.fleetFlag
		l.nodeSafe = safe + 1
		// The slice first, then the flag the programs read it by, once
		// (not at every renewal).
		if err := l.heartbeat(); err != nil || !first {
			return err
		}
		if err := l.setConfigFlag(capsFleet, true); err != nil {
			return err
		}
		l.fleetFlag = true
		return nil
	}
	if err := l.heartbeat(); err != nil {
		return err
	}
	if dp.fleetSafe == safe+1 {
		return nil
	}
	var c limiterFsDestConf
	if err := l.objs.FsDpoolConf.Lookup(dp.id, &c); err != nil {
		return fmt.Errorf("reading destination pool %s: %w", pool, err)
	}
	c.FleetSafe = safe + 1
	if err := l.putDestConf(dp.id, &c); err != nil {
		return fmt.Errorf("setting the safe slice of destination pool %s: %w", pool, err)
	}
	dp.fleetSafe = c.FleetSafe
	return nil
}

// PinnedFleetSafes reads, from the pins in pinDir ("" for DefaultPinDir),
// the safe slices the last daemon gave the kernel's fleet pools
// (SetFleetSafe): the connections pool's under "", a destination pool's
// under its name. A daemon reads them before it opens the limiter, to
// start no higher (package fleet, Config.LastSafe). Pins that are not
// there, or of another layout, hold none: an empty map and no error.
func PinnedFleetSafes(pinDir string) (map[string]int, error) {
	if pinDir == "" {
		pinDir = DefaultPinDir
	}
	out := map[string]int{}
	open := func(name string, size int) (*ebpf.Map, error) {
		m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, name), &ebpf.LoadPinOptions{ReadOnly: true})
		if errors.Is(err, os.ErrNotExist) {
			return nil, nil
		}
		if err != nil {
			return nil, fmt.Errorf("opening the pinned %s in %s: %w", name, pinDir, err)
		}
		if m.ValueSize() != uint32(size) {
			m.Close()
			return nil, nil
		}
		return m, nil
	}
	m, err := open("fs_lapses", binary.Size(limiterFsLapse{}))
	if err != nil {
		return out, err
	}
	if m != nil {
		var v limiterFsLapse
		if err := m.Lookup(lapseSlot, &v); err == nil && v.NodeSafe > 0 {
			out[""] = int(v.NodeSafe - 1)
		}
		m.Close()
	}
	if m, err = open("fs_dpool_conf", binary.Size(limiterFsDestConf{})); err != nil || m == nil {
		return out, err
	}
	defer m.Close()
	for id := uint32(1); id < m.MaxEntries(); id++ {
		var c limiterFsDestConf
		if err := m.Lookup(id, &c); err != nil || c.FleetSafe == 0 {
			continue
		}
		if name := confName(c); name != "" {
			out[name] = int(c.FleetSafe - 1)
		}
	}
	return out, nil
}

// fleetAfterLocked is the heartbeat's fleet_after at now: the time to the
// earliest end of the fleet pools' leases, so that the programs hold the
// pools to their safe slices from when the other nodes may stop counting
// this one, whether the daemon is gone or its leases ended under it (cut
// off from etcd: the others count it out all the same); a pool without a
// lease yet counts as fleetTTL from the heartbeat. 0 without a fleet pool
// in the kernel.
func (l *Limiter) fleetAfterLocked(now time.Time) uint32 {
	if l.fleetTTL <= 0 {
		return 0
	}
	after := l.fleetTTL
	for _, end := range l.fleetEnd {
		if !end.IsZero() {
			after = min(after, max(end.Sub(now), time.Millisecond))
		}
	}
	return uint32(max(after/time.Millisecond, 1))
}

// setConfigFlag sets or clears flag in fs_settings.caps.
func (l *Limiter) setConfigFlag(flag uint32, on bool) error {
	var cfg limiterFsSettings
	if err := l.objs.FsConfig.Lookup(uint32(0), &cfg); err != nil {
		return fmt.Errorf("reading config map: %w", err)
	}
	cfg.Caps &^= flag
	if on {
		cfg.Caps |= flag
	}
	if err := l.objs.FsConfig.Put(uint32(0), &cfg); err != nil {
		return fmt.Errorf("writing config map: %w", err)
	}
	return nil
}
