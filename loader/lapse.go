// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/cilium/ebpf"

	"golang.org/x/sys/unix"
)

// The lapse (bpf/lib/events.h, fs_lapses): the daemon renews a heartbeat in
// the pins at the end of an Open that succeeded (a start that fails leaves
// it as it was: Open's is the last step that can fail, the daemon's
// settings that the programs read written before it, Options.Events) and
// at every Tick. Maps that never had one get one before the programs are
// attached (startLapse), and a migration carries the old pins' over.
// Once the heartbeat is older than Options.LapseAfter the programs stop
// refusing: every refusal is admitted as dry-run admits it (counted, its
// permit taken past the rule, its event flagged Lapsed), so a node whose
// daemon is gone for good (uninstalled, crash-looping, its membership frozen
// at its last word) is not refused by a limiter nobody runs. The counting
// goes on, so a daemon that comes back finds the counts true and refuses
// again from its first heartbeat.

// lapseSlot is the daemon's slot of fs_lapses, countSlot the programs'.
const (
	lapseSlot = uint32(0)
	countSlot = uint32(1)
)

// bootNow is CLOCK_BOOTTIME, the programs' bpf_ktime_get_boot_ns: unlike
// CLOCK_MONOTONIC it goes on while the node is suspended.
func bootNow() uint64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts)
	return uint64(ts.Nano())
}

// heartbeat renews the daemon's heartbeat, with the lapse in force.
func (l *Limiter) heartbeat() error {
	if l.objs.FsLapses == nil {
		return nil
	}
	v := limiterFsLapse{HeartbeatNs: bootNow(), AfterNs: uint64(l.lapse),
		FleetAfterMs: l.fleetAfterLocked(time.Now()), NodeSafe: l.nodeSafe}
	if err := l.objs.FsLapses.Put(lapseSlot, &v); err != nil {
		return fmt.Errorf("renewing the heartbeat: %w", err)
	}
	return nil
}

// startLapse starts the lapse's clock in maps that never had a heartbeat
// (0: the programs never lapse), before the programs are attached: a first
// start's, or a migration's whose old pins had none to carry over
// (carryOver). So programs a start leaves attached without getting through
// it (a daemon killed before its Open returned) lapse after LapseAfter like
// any others, not never. A heartbeat the maps hold (the last daemon's,
// or the one a migration carried over from the old pins) is left as it is:
// only a start that succeeds renews it.
func (l *Limiter) startLapse() error {
	if l.objs.FsLapses == nil {
		return nil
	}
	var v limiterFsLapse
	if err := l.objs.FsLapses.Lookup(lapseSlot, &v); err != nil {
		return fmt.Errorf("reading the heartbeat: %w", err)
	}
	if v.HeartbeatNs != 0 {
		return nil
	}
	v.HeartbeatNs, v.AfterNs = bootNow(), uint64(l.lapse)
	if err := l.objs.FsLapses.Put(lapseSlot, &v); err != nil {
		return fmt.Errorf("starting the heartbeat: %w", err)
	}
	return nil
}

// Heartbeat renews the heartbeat alone (Tick renews it too), for a
// goroutine of the daemon's own that beats every tick whatever its control
// loop is doing: a long reconcile pass or a slow source must not lapse
// enforcement while the daemon lives.
func (l *Limiter) Heartbeat() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return ErrClosed
	}
	return l.heartbeat()
}

// RenewHeartbeat renews the heartbeat of the limiter pinned in pinDir
// ("" for DefaultPinDir) with the lapse after, without loading anything (a
// last word before the limiter goes, or a tool's). Open renews it only once
// it succeeded, so a start that fails does not. Pins without the
// heartbeat's map (none yet, or an older version's) are nothing to renew:
// it returns nil.
func RenewHeartbeat(pinDir string, after time.Duration) error {
	if pinDir == "" {
		pinDir = DefaultPinDir
	}
	m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, "fs_lapses"), nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("opening the pinned heartbeat in %s: %w", pinDir, err)
	}
	defer m.Close()
	// The fleet's fields as the daemon last wrote them (fleetsafe.go),
	// the end of the leases kept where it was: fleet_after counts from
	// the heartbeat.
	var v limiterFsLapse
	if err := m.Lookup(lapseSlot, &v); err != nil {
		return fmt.Errorf("reading the pinned heartbeat in %s: %w", pinDir, err)
	}
	now := bootNow()
	if v.FleetAfterMs != 0 {
		end := v.HeartbeatNs + uint64(v.FleetAfterMs)*uint64(time.Millisecond)
		v.FleetAfterMs = 1 // ended already: at once
		if end > now {
			v.FleetAfterMs = uint32(max((end-now)/uint64(time.Millisecond), 1))
		}
	}
	v.HeartbeatNs, v.AfterNs = now, uint64(max(after, 0))
	if err := m.Put(lapseSlot, &v); err != nil {
		return fmt.Errorf("renewing the heartbeat in %s: %w", pinDir, err)
	}
	return nil
}

// Lapse is the state of the lapse as the pins hold it.
type Lapse struct {
	// After is connections.lapse_after as the last daemon wrote it; 0
	// never lapses.
	After time.Duration
	// Age is the time since the last heartbeat; 0 with Never.
	Age time.Duration
	// Never says no daemon has written a heartbeat (pins of an older
	// version): the programs enforce.
	Never bool
	// Lapsed says enforcement has lapsed now: the programs count and do
	// not refuse.
	Lapsed bool
	// Admitted counts the refusals admitted because enforcement had
	// lapsed, ever (on these pins).
	Admitted uint64
	// FleetAfter is the time from the last heartbeat to the end of the
	// fleet pools' leases as it wrote it (0: no fleet pool in the
	// kernel), and FleetSafe says the kernel's fleet pools are at their
	// safe slices now, that end being past (fleetsafe.go).
	FleetAfter time.Duration
	FleetSafe  bool
}

// Lapse reads the heartbeat and the lapse from the pins.
func (l *Limiter) Lapse() (Lapse, error) {
	if l.objs.FsLapses == nil {
		return Lapse{Never: true}, nil
	}
	var v, c limiterFsLapse
	if err := l.objs.FsLapses.Lookup(lapseSlot, &v); err != nil {
		return Lapse{}, fmt.Errorf("reading the heartbeat: %w", err)
	}
	if err := l.objs.FsLapses.Lookup(countSlot, &c); err != nil {
		return Lapse{}, fmt.Errorf("reading the lapse's count: %w", err)
	}
	out := Lapse{After: time.Duration(v.AfterNs), Admitted: c.Admitted, Never: v.HeartbeatNs == 0}
	if !out.Never {
		if now := bootNow(); now > v.HeartbeatNs {
			out.Age = time.Duration(now - v.HeartbeatNs)
		}
		// As the programs judge it (lapse_of, fleet_safe).
		out.Lapsed = v.AfterNs != 0 && out.Age > out.After
		out.FleetAfter = time.Duration(v.FleetAfterMs) * time.Millisecond
		out.FleetSafe = out.FleetAfter != 0 && out.Age > out.FleetAfter
	}
	return out, nil
}

// Lapse reads the heartbeat and the lapse from the pins.
func (r *ReadOnly) Lapse() (Lapse, error) { return r.l.Lapse() }
