// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"fmt"
	"maps"
)

// priorConfig is what a start on reused pins overwrites of the
// configuration the running programs enforce (setUp: the destination
// pools, the pool's settings, the fleet caps Open clears, the events and
// the pool's dry-run, the exempt set), read before it writes. A start
// refused past that (an attach, a netns link, the first reconcile pass)
// puts it back (restorePrior): the programs, the old ones or this start's
// on the same maps, go on enforcing the last daemon's configuration in the
// maps, not half of the refused one's. Not put back: the counts (what the
// programs and the reconcile pass counted meanwhile is true), and, once
// the links were moved to this start's programs (attach), what those were
// loaded with (the cgroup walk's base level and depth from the project
// sources, limit_host_network_pods, abort_moved_past, the events'
// window): a start refused past its attach leaves its programs running
// with those, on the last daemon's maps.
type priorConfig struct {
	cfg    limiterFsSettings
	events limiterFsEvcfg
	exempt map[uint64]string // fs_exempt's ids
	// caps is fs_caps while some pool had caps (capsOn), nil otherwise
	// (then all zero, as clearCaps leaves it).
	caps []uint32
	// confs are the destination pools' settings by id (fs_dpool_conf),
	// dests the destinations in force (the trie's and the table's).
	confs []limiterFsDestConf
	dests map[limiterFsDestKey]uint32
}

// readPrior reads the configuration setUp is about to overwrite.
func (l *Limiter) readPrior() (*priorConfig, error) {
	p := &priorConfig{exempt: map[uint64]string{}}
	if err := l.objs.FsConfig.Lookup(uint32(0), &p.cfg); err != nil {
		return nil, fmt.Errorf("reading config map: %w", err)
	}
	if err := l.objs.FsEvConfig.Lookup(uint32(0), &p.events); err != nil {
		return nil, fmt.Errorf("reading fs_ev_config: %w", err)
	}
	var id uint64
	var v uint32
	it := l.objs.FsExempt.Iterate()
	for it.Next(&id, &v) {
		p.exempt[id] = ""
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("reading exempt map: %w", err)
	}
	if p.cfg.Caps&capsOn != 0 {
		p.caps = make([]uint32, 0, l.objs.FsCaps.MaxEntries())
		if err := readArray(l.objs.FsCaps, func(v uint32) { p.caps = append(p.caps, v) }); err != nil {
			return nil, err
		}
	}
	p.confs = make([]limiterFsDestConf, l.objs.FsDpoolConf.MaxEntries())
	for id := range p.confs {
		if err := l.objs.FsDpoolConf.Lookup(uint32(id), &p.confs[id]); err != nil {
			return nil, fmt.Errorf("reading destination pool %d: %w", id, err)
		}
	}
	trie, nets, err := l.destKeys()
	if err != nil {
		return nil, err
	}
	p.dests = trie
	maps.Copy(p.dests, nets)
	return p, nil
}

// restorePrior puts back what readPrior read, if setUp read it (reused
// pins; nothing otherwise), as well as it can: an error is logged, and the
// rest put back all the same.
func (l *Limiter) restorePrior() {
	p := l.prior
	if p == nil {
		return
	}
	l.prior = nil
	var errs []error
	// The destinations first: no connect finds a pool of the refused
	// configuration once its settings are gone. A pool it added keeps its
	// name and id, removed (its connections give its permits back as they
	// close, and a later start frees its id), as SetDestPools leaves one.
	errs = append(errs, l.rewriteDestsLocked(p.dests))
	for id := uint32(1); id < uint32(len(p.confs)); id++ {
		var c limiterFsDestConf
		if err := l.objs.FsDpoolConf.Lookup(id, &c); err != nil {
			errs = append(errs, fmt.Errorf("reading destination pool %d: %w", id, err))
			continue
		}
		was := p.confs[id]
		if confName(was) == "" {
			if confName(c) == "" || c.Flags&destLive == 0 {
				continue
			}
			was = c
			was.Flags &^= destLive
		}
		if was == c {
			continue
		}
		if err := l.putDestConf(id, &was); err != nil {
			errs = append(errs, fmt.Errorf("restoring destination pool %d: %w", id, err))
		}
	}
	l.mu.Lock()
	errs = append(errs, l.setExemptLocked(exemptSet{ids: p.exempt, max: p.cfg.ExemptMax}))
	l.mu.Unlock()
	// The caps' entries before their flag.
	if p.caps != nil {
		keys := make([]uint32, len(p.caps))
		for i := range keys {
			keys[i] = uint32(i)
		}
		if _, err := l.objs.FsCaps.BatchUpdate(keys, p.caps, nil); err != nil {
			errs = append(errs, fmt.Errorf("restoring the fleet caps: %w", err))
		}
	}
	var cfg limiterFsSettings
	if err := l.objs.FsConfig.Lookup(uint32(0), &cfg); err != nil {
		errs = append(errs, fmt.Errorf("reading config map: %w", err))
	} else {
		// The destination filter's fields are rewriteDestsLocked's.
		cfg.Pool, cfg.Floor, cfg.WindowNs = p.cfg.Pool, p.cfg.Floor, p.cfg.WindowNs
		cfg.Caps, cfg.ExemptMax, cfg.Layout = p.cfg.Caps, p.cfg.ExemptMax, p.cfg.Layout
		if err := l.objs.FsConfig.Put(uint32(0), &cfg); err != nil {
			errs = append(errs, fmt.Errorf("writing config map: %w", err))
		}
	}
	if err := l.objs.FsEvConfig.Put(uint32(0), &p.events); err != nil {
		errs = append(errs, fmt.Errorf("writing fs_ev_config: %w", err))
	}
	if err := errors.Join(errs...); err != nil {
		l.log.Error("the start failed, and the configuration the pinned programs enforced could not all be put back: "+
			"they may enforce part of this start's until the next start", "pin_dir", l.pinDir, "err", err)
	}
}
