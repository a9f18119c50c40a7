// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"fmt"
	"maps"
)

// capRow is what SetCaps wrote for one pool (bpf/lib/cap.h): the caps by
// project name, kept for the projects that get an id later, and the ids
// whose entry is not 0.
type capRow struct {
	byName  map[string]uint32 // cap + 1
	written map[uint32]bool
}

// capPool is the index of pool's row in fs_caps: 0 for the connections
// pool (""), a destination pool's id for it.
func (l *Limiter) capPool(pool string) (uint32, error) {
	if pool == "" {
		return 0, nil
	}
	dp, ok := l.dests[pool]
	if !ok || !dp.live {
		return 0, fmt.Errorf("%q: %w", pool, ErrNoDestPool)
	}
	return dp.id, nil
}

// SetCaps sets the per-project fleet caps of the connections pool (pool
// "") or of destination pool pool (package fleet sets them from the
// fleet's computation): a project named in caps is admitted while it holds
// fewer than its cap and the pool's in_use is under its size, in place of
// the share and the floor; the projects caps does not name have the cap
// others, or the rule when others < 0. caps nil removes the pool's caps.
// A cap below what a project holds refuses it until releases bring it
// under; nothing is closed. A project with no id yet gets its cap when it
// gets one. The programs look at the caps only while some pool has them.
func (l *Limiter) SetCaps(pool string, caps map[string]int, others int) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return ErrClosed
	}
	idx, err := l.capPool(pool)
	if err != nil {
		return err
	}
	if l.caps == nil {
		l.caps = map[uint32]*capRow{}
	}
	row := l.caps[idx]
	if caps == nil {
		return l.dropCapsLocked(idx)
	}
	if row == nil {
		row = &capRow{written: map[uint32]bool{}}
		l.caps[idx] = row
		// On before the first entry: entries written while the flag is
		// off would be stale ones Open does not clear (see clearCaps).
		if err := l.setCapsOn(true); err != nil {
			return err
		}
	}
	row.byName = make(map[string]uint32, len(caps))
	for name, c := range caps {
		row.byName[name] = uint32(max(c, 0)) + 1
	}
	was := maps.Clone(row.written)
	for name, v := range row.byName {
		id := l.memb.ids[name]
		if id == 0 || id >= l.maxProj {
			continue
		}
		if err := l.putCap(idx, id, v); err != nil {
			return err
		}
		row.written[id] = true
		delete(was, id)
	}
	for id := range was {
		if err := l.putCap(idx, id, 0); err != nil {
			return err
		}
		delete(row.written, id)
	}
	v := uint32(0)
	if others >= 0 {
		v = uint32(others) + 1
	}
	return l.putCap(idx, 0, v)
}

// dropCapsLocked removes the caps of pool row idx, if any.
func (l *Limiter) dropCapsLocked(idx uint32) error {
	row := l.caps[idx]
	if row == nil {
		return nil
	}
	for id := range row.written {
		if err := l.putCap(idx, id, 0); err != nil {
			return err
		}
	}
	if err := l.putCap(idx, 0, 0); err != nil {
		return err
	}
	delete(l.caps, idx)
	if len(l.caps) == 0 {
		return l.setCapsOn(false)
	}
	return nil
}

func (l *Limiter) putCap(pool, id, v uint32) error {
	if err := l.objs.FsCaps.Put(pool*l.maxProj+id, v); err != nil {
		return fmt.Errorf("writing the fleet cap of project %d in pool %d: %w", id, pool, err)
	}
	return nil
}

// setCapsOn writes fs_settings.caps's capsOn.
func (l *Limiter) setCapsOn(on bool) error { return l.setConfigFlag(capsOn, on) }

// clearCaps zeroes fs_caps when the flag says a daemon before this one
// may have left caps there (it is set before the first entry is written
// and cleared after the last is zeroed): a node starts with no caps, as
// it has no view of the fleet yet. cfg is the config being written.
func (l *Limiter) clearCaps(cfg *limiterFsSettings) error {
	if cfg.Caps&capsOn == 0 {
		cfg.Caps = 0 // and the fleet's flag: SetFleetSafe sets it again
		return nil
	}
	n := l.objs.FsCaps.MaxEntries()
	keys, zeros := make([]uint32, n), make([]uint32, n)
	for i := range keys {
		keys[i] = uint32(i)
	}
	if _, err := l.objs.FsCaps.BatchUpdate(keys, zeros, nil); err != nil {
		for _, k := range keys {
			if err := l.objs.FsCaps.Put(k, uint32(0)); err != nil {
				return fmt.Errorf("clearing the fleet caps: %w", err)
			}
		}
	}
	cfg.Caps = 0
	return nil
}

// capsOfNewLocked writes the caps of project name, just given id.
func (l *Limiter) capsOfNewLocked(name string, id uint32) error {
	for idx, row := range l.caps {
		if v, ok := row.byName[name]; ok {
			if err := l.putCap(idx, id, v); err != nil {
				return err
			}
			row.written[id] = true
		}
	}
	return nil
}

// clearCapsOfLocked zeroes the caps of project id, being freed.
func (l *Limiter) clearCapsOfLocked(id uint32) error {
	for idx, row := range l.caps {
		if row.written[id] {
			if err := l.putCap(idx, id, 0); err != nil {
				return err
			}
			delete(row.written, id)
		}
	}
	return nil
}
