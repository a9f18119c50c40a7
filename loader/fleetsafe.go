// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"fmt"
	"math"
	"time"

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
// pool for "", else a destination pool): the size the programs hold it to,
// without caps, once the daemon's heartbeat is older than after (the
// fleet's lease_ttl, the same for every fleet pool: the last call's). The
// daemon calls it with each change of the safe slice; it renews the
// heartbeat.
func (l *Limiter) SetFleetSafe(pool string, safe uint32, after time.Duration) error {
	if after <= 0 || after/time.Millisecond > math.MaxUint32 {
		return fmt.Errorf("fleet safe slice after %v: %w", after, ErrInvalidOptions)
	}
	if safe > limits.MaxPoolSize {
		return fmt.Errorf("fleet safe slice %d, at most %d: %w", safe, limits.MaxPoolSize, ErrInvalidOptions)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return ErrClosed
	}
	if pool == "" {
		l.fleetAfter, l.nodeSafe = after, safe+1
		// The slice first, then the flag the programs read it by.
		if err := l.heartbeat(); err != nil {
			return err
		}
		return l.setConfigFlag(capsFleet, true)
	}
	dp, ok := l.dests[pool]
	if !ok || !dp.live {
		return fmt.Errorf("%q: %w", pool, ErrNoDestPool)
	}
	var c limiterFsDestConf
	if err := l.objs.FsDpoolConf.Lookup(dp.id, &c); err != nil {
		return fmt.Errorf("reading destination pool %s: %w", pool, err)
	}
	l.fleetAfter = after
	if err := l.heartbeat(); err != nil {
		return err
	}
	c.FleetSafe = safe + 1
	if err := l.putDestConf(dp.id, &c); err != nil {
		return fmt.Errorf("setting the safe slice of destination pool %s: %w", pool, err)
	}
	dp.fleetSafe = c.FleetSafe
	return nil
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
