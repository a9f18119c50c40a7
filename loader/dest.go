// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"math/bits"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fairshare-dev/fairshare/internal/destination"
	"github.com/fairshare-dev/fairshare/loader/limits"
	"github.com/fairshare-dev/fairshare/pools"
)

// Destination pools (bpf/lib/dest.h, docs/destination-pools.md): named
// connection pools selected by where a connect() goes. A connect that
// matches one takes a permit in it as well as in the node's pool, under the
// same rule with the pool's own size, floor and window; the socket's
// held-permit entry keeps the pool's id, so whichever release path ends the
// entry gives both back.

// DefaultMaxDestPools is Options.MaxDestPools when it is 0.
const DefaultMaxDestPools = limits.DefaultMaxDestPools

// MaxDestPools bounds Options.MaxDestPools.
const MaxDestPools = limits.MaxDestPools

// MaxDestinations bounds the destinations of all pools together (the
// entries of fs_dests).
const MaxDestinations = limits.MaxDestinations

// Flags of fs_dest_conf (DEST_LIVE, DEST_DRYRUN in bpf/lib/dest.h) and the
// kinds of fs_settings.dest_kinds (DEST_PORTS, DEST_ANY).
const (
	destLive     = 1
	destDryRun   = 2
	destPorts    = 1
	destAny      = 2
	destNetPorts = 4
	destNetAny   = 8
	destKeyBit   = 16 + 128
	// packedHeldBits is PACKED_HELD_BITS (bpf/lib/share.h): the low bits
	// of a destination pool's project entry that hold its permits, above
	// them its admissions.
	packedHeldBits = 24
)

// The table fs_dnets (DEST_NETS, DEST_NET_BITS, DEST_NET_PROBES, DEST_LENS
// in bpf/lib/dest.h): twice as many slots as destinations may be
// configured, so that a destination nearly always finds a slot within the
// probes; at most destLens prefix lengths of each kind (naming a port, of
// every port), each a probe of a connect that finds nothing longer.
const (
	destNetBits   = 11
	destNets      = 1 << destNetBits
	destNetProbes = 4
	destLens      = 4
)

// ErrDestPoolsFull means every destination pool id of the pinned maps is
// configured, or held by a removed pool (or one the change removes) whose
// connections still hold its permits.
var ErrDestPoolsFull = errors.New("no free destination pool id")

// ErrBadDestPool reports a destination pool SetDestPools cannot use.
var ErrBadDestPool = errors.New("invalid destination pool")

// ErrNoDestPool is returned by SetDestPoolSize for a name not configured.
var ErrNoDestPool = errors.New("no such destination pool")

// DestPool is a destination pool's configuration.
type DestPool struct {
	Name string // pools.<name>: lowercase letters, digits and _, at most 32 bytes
	// Size is the pool's POOL (0..limits.MaxPoolSize; 0 admits nobody, a
	// fleet pool's allotment may be 0) and Floor its FLOOR (0:
	// pools.DefaultFloor(Size), 0 when Size is).
	Size, Floor uint32
	// Window is its active window; 0 means the node pool's.
	Window time.Duration
	// DryRun admits what the rule would refuse and counts it (enforce: false).
	DryRun bool
	// Fleet marks a fleet pool (fleet: true): its safe slice
	// (SetFleetSafe) is kept across SetDestPools; another pool has none.
	Fleet        bool
	Destinations []destination.Destination
}

// destPool is a destination pool id's state on the Go side.
type destPool struct {
	id      uint32
	cfg     DestPool
	live    bool // configured; false: removed, its id kept until its in_use is 0
	floorOf uint32
	// fleetSafe is its safe slice plus one (SetFleetSafe), 0 for a pool
	// that is not a fleet pool: kept across SetDestPools.
	fleetSafe uint32
	// removed is when it left the tables (zero for a pool found removed
	// at Open): its id is freed no sooner than destForgetGrace after.
	removed time.Time
}

// destForgetGrace is how long a removed pool's id stays its own after its
// destinations left the tables, however empty it is: a connect that found
// the pool just before (a program run preempted between its lookup and
// its admission) takes its permit within that time, and a pool that was
// forgotten meanwhile would have its count wiped and then given back to
// the next pool given the id.
const destForgetGrace = 100 * time.Millisecond

// graceSleep waits out the rest of a removed pool's destForgetGrace (a
// test's hook).
var graceSleep = time.Sleep

// DestSnapshot is what the maps say of one destination pool.
type DestSnapshot struct {
	Name                     string
	ID                       uint32
	Destinations             []string
	Size, Floor, InUse       int
	Active, Share            int
	KernelActive             int
	Admitted, Refused, Would uint64
	DryRun                   bool
	// Removed: no longer configured; its connections still hold InUse.
	Removed  bool
	Projects []ProjectCounters // projects with counts in the pool, by name
}

func (p DestPool) validate() error {
	if p.Name == "" || len(p.Name) > 32 {
		return fmt.Errorf("destination pool name %q (1..32 bytes): %w", p.Name, ErrBadDestPool)
	}
	if p.Size > limits.MaxPoolSize {
		return fmt.Errorf("pools.%s: size %d, at most %d: %w", p.Name, p.Size, limits.MaxPoolSize, ErrBadDestPool)
	}
	if p.Floor > p.Size {
		return fmt.Errorf("pools.%s: floor %d above size %d: %w", p.Name, p.Floor, p.Size, ErrBadDestPool)
	}
	if len(p.Destinations) == 0 {
		return fmt.Errorf("pools.%s: no destinations: %w", p.Name, ErrBadDestPool)
	}
	return nil
}

// loadDestsLocked reads the pools the pins hold (a restart keeps their ids
// and counts).
func (l *Limiter) loadDestsLocked() error {
	l.dests = map[string]*destPool{}
	n := l.objs.FsDpoolConf.MaxEntries()
	for id := uint32(1); id < n; id++ {
		var c limiterFsDestConf
		if err := l.objs.FsDpoolConf.Lookup(id, &c); err != nil {
			return fmt.Errorf("reading destination pool %d: %w", id, err)
		}
		name := confName(c)
		if name == "" {
			continue
		}
		l.dests[name] = &destPool{id: id, live: c.Flags&destLive != 0, fleetSafe: c.FleetSafe,
			cfg: DestPool{Name: name, Size: c.Size, Floor: c.Floor, Window: time.Duration(c.WindowNs), DryRun: c.Flags&destDryRun != 0}}
	}
	return nil
}

// putDestConf writes pool id's settings c, and copies them to the line of
// its counts, where the programs read them (fs_dest_state, OP_DEST_CONF).
func (l *Limiter) putDestConf(id uint32, c *limiterFsDestConf) error {
	if err := l.objs.FsDpoolConf.Put(id, c); err != nil {
		return err
	}
	if _, err := l.adjust(limiterFsAdjustArgs{Op: opDestConf, SinceNs: uint64(id)}); err != nil {
		return err
	}
	return nil
}

// syncDestConfsLocked copies each pool's settings read back to the line of
// its counts (OP_DEST_CONF): pins of a daemon killed between the two writes
// of putDestConf get the settings it wrote.
func (l *Limiter) syncDestConfsLocked() error {
	for name, dp := range l.dests {
		if _, err := l.adjust(limiterFsAdjustArgs{Op: opDestConf, SinceNs: uint64(dp.id)}); err != nil {
			return fmt.Errorf("restoring destination pool %s: %w", name, err)
		}
	}
	return nil
}

func confName(c limiterFsDestConf) string {
	b := make([]byte, 0, len(c.Name))
	for _, ch := range c.Name {
		if ch == 0 {
			break
		}
		b = append(b, byte(ch))
	}
	return string(b)
}

// SetDestPools makes pools the destination pools, applied at once with the
// programs running: a new pool starts empty, a resized one keeps its
// counts, and a removed one stops matching new connects while those that
// hold its permits give them back as they close (its id is reused only
// once they have). A pool keeps its id and counts across calls and
// restarts by name.
//
// A new pool that finds no free id takes that of a pool this call removes
// and no connection holds a permit of (a pool renamed with every id of
// Options.MaxDestPools in use): that pool's destinations leave the tables
// first, and the call waits destForgetGrace (under the lock) before the
// id is given, so connects to them meanwhile are counted in no destination
// pool. Nothing is changed if pools do not validate, overlap
// (destination.Check) or need more ids than are free, counting those of
// removed pools and pools being removed that hold no permit
// (ErrDestPoolsFull, naming those that do); a pool being removed that
// takes a permit during the wait (a connect that found it just before) is
// put back as it was, and the call refused so.
func (l *Limiter) SetDestPools(dps []DestPool) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return ErrClosed
	}
	return l.setDestPoolsLocked(dps)
}

func (l *Limiter) setDestPoolsLocked(dps []DestPool) error {
	byName := map[string][]destination.Destination{}
	total := 0
	for _, p := range dps {
		if err := p.validate(); err != nil {
			return err
		}
		if _, dup := byName[p.Name]; dup {
			return fmt.Errorf("destination pool %s given twice: %w", p.Name, ErrBadDestPool)
		}
		byName[p.Name] = p.Destinations
		total += len(p.Destinations)
	}
	if err := destination.Check(byName); err != nil {
		return fmt.Errorf("%w: %w", ErrBadDestPool, err)
	}
	if total > MaxDestinations {
		return fmt.Errorf("%d destinations, at most %d: %w", total, MaxDestinations, ErrBadDestPool)
	}
	// Ids: a pool keeps its own; a new one takes a free id, else one of a
	// removed pool whose permits all came back, else one of a pool this
	// call removes that holds none.
	ids := map[string]uint32{}
	var newOnes []string
	for _, p := range dps {
		if dp, ok := l.dests[p.Name]; ok {
			ids[p.Name] = dp.id
		} else {
			newOnes = append(newOnes, p.Name)
		}
	}
	if len(newOnes) > 0 && l.objs.FsDpoolConf.MaxEntries() <= 1 {
		return fmt.Errorf("no destination pool was configured when the kernel's destination pool tables were made, "+
			"so they have no room for one (their size is fixed then, see connections.max_destination_pools); restart "+
			"with the pool in the configuration (the connection counts are kept): %w", ErrDestPoolsFull)
	}
	free, err := l.freeDestIDsLocked(byName, len(newOnes))
	if err != nil {
		return err
	}
	var busy []string
	if len(newOnes) > len(free) {
		// Then the ids of pools this call removes that hold nothing,
		// retired here, before anything below is written.
		more, held, err := l.retireForIDsLocked(byName, len(newOnes)-len(free))
		if err != nil {
			return err
		}
		free, busy = append(free, more...), held
	}
	if len(newOnes) > len(free) {
		why := "removed pools keep theirs while their connections last"
		if len(busy) > 0 {
			why += "; pools this change removes hold permits: " + strings.Join(busy, ", ")
		}
		return fmt.Errorf("%d new destination pools, %d ids free of %d (%s): %w",
			len(newOnes), len(free), l.objs.FsDpoolConf.MaxEntries()-1, why, ErrDestPoolsFull)
	}
	for i, n := range newOnes {
		ids[n] = free[i]
		// A removed pool's id, free since its permits came back:
		// forgotten here, not at the next Tick, which would forget
		// the new pool's settings and counts with the old name.
		for name, dp := range l.dests {
			if dp.id == free[i] && !dp.live {
				if err := l.forgetDestLocked(name, dp); err != nil {
					return err
				}
			}
		}
	}
	// The settings first, and the pools known before the kernel's tables
	// name them (an error past here leaves no pool counted in that
	// l.dests does not know; the next call or a restart finishes the
	// change from what the tables hold).
	want := map[limiterFsDestKey]uint32{}
	for _, p := range dps {
		c := limiterFsDestConf{Size: p.Size, Floor: destFloor(p.Size, p.Floor),
			WindowNs: uint64(l.window), Flags: destLive}
		if p.Window > 0 {
			c.WindowNs = uint64(p.Window)
		}
		if p.DryRun {
			c.Flags |= destDryRun
		}
		if dp, ok := l.dests[p.Name]; ok && p.Fleet {
			c.FleetSafe = dp.fleetSafe
		}
		for i := range min(len(p.Name), len(c.Name)) {
			c.Name[i] = int8(p.Name[i])
		}
		if err := l.putDestConf(ids[p.Name], &c); err != nil {
			return fmt.Errorf("writing destination pool %s: %w", p.Name, err)
		}
		for _, d := range p.Destinations {
			want[destKey(d)] = ids[p.Name]
		}
	}
	for _, p := range dps {
		dp, ok := l.dests[p.Name]
		if !ok {
			dp = &destPool{id: ids[p.Name]}
			l.dests[p.Name] = dp
			l.log.Info("destination pool added", "pool", p.Name, "id", dp.id, "size", p.Size, "destinations", len(p.Destinations))
		}
		dp.cfg, dp.live = p, true
		dp.cfg.Destinations = slices.Clone(p.Destinations)
		if !p.Fleet {
			dp.fleetSafe = 0
			delete(l.fleetEnd, p.Name)
		}
	}
	if err := l.rewriteDestsLocked(want); err != nil {
		return err
	}
	// Removed pools: no longer live; their ids stay named until their
	// permits are back (Tick).
	for name, dp := range l.dests {
		if _, ok := byName[name]; ok || !dp.live {
			continue
		}
		if err := l.markDestLive(name, dp, false); err != nil {
			return err
		}
		dp.live, dp.removed = false, time.Now()
		delete(l.fleetEnd, name)
		l.log.Info("destination pool removed; its connections give its permits back as they close", "pool", name, "id", dp.id)
	}
	return nil
}

// rewriteDestsLocked makes the trie, the table (fs_dnets), the lengths it
// is probed at, the filter and dest_kinds those of the destinations want,
// with the programs running. A connect meanwhile finds the pool the old
// destinations give it or the new ones do, never a third, never none when
// both give one (TestDestRewriteNeverMisses and the Race tests; the order
// was checked in a model of the programs' lookup against
// destination.Match at every step of 12,000 random changes):
//
//  1. the filter lets through what the old or the new can match, and the
//     kinds name the trie for all of them, the table still for the old;
//  2. the trie takes the old table's destinations the new drop, then the
//     new ones, port-named first and longest first within a kind (a
//     shorter new prefix never answers before a longer one is in);
//  3. the table is switched off (the trie alone answers: it holds every
//     old and new destination), and the trie lets go of the old ones the
//     new drop, of every port first and shortest first within a kind (a
//     longer old prefix never leaves while a shorter one could answer);
//  4. the table and its lengths are rewritten, then switched on;
//  5. the trie lets go of what the table holds, and the kinds and the
//     filter narrow to the new alone.
//
// The trie holds up to the old and the new destinations at once (its size
// is twice MaxDestinations). The guarantee takes a connect's lookup as
// happening between two of these writes: each write bumps the generation
// in dest_kinds (destWrote, setDestKinds), and a lookup that saw it move
// (preempted in its middle, or racing a write) is made again, once
// (dest_connect; dest_find, the same for TestDestFindAcrossWrites). A
// connect whose second lookup is cut by a write too may be counted in a
// third pool or none: a miscount of a connect racing a change, never a
// leak (its socket gives back what it took, where it took it).
func (l *Limiter) rewriteDestsLocked(want map[limiterFsDestKey]uint32) error {
	oldTrie, oldNets, err := l.destKeys()
	if err != nil {
		return err
	}
	// A change interrupted past step 2 (a daemon killed) leaves the trie
	// holding its old and new destinations: with this change's beside
	// them, they may not fit. Then the trie lets go of what this change
	// drops first, and the old table's are not put in: connects racing
	// this one change may miss their pool; the next is in order again.
	need := maps.Clone(oldTrie)
	maps.Copy(need, oldNets)
	maps.Copy(need, want)
	if len(need) > int(l.objs.FsDests.MaxEntries()) {
		l.log.Warn("the destination trie is too full to hold the destinations in force beside the new ones "+
			"(a change of destination pools was interrupted); the old ones leave it first, so connects racing "+
			"this change may miss their pool", "trie", len(oldTrie), "table", len(oldNets), "new", len(want))
		dropped, err := l.trieDropAbsent(oldTrie, want)
		if err != nil {
			return err
		}
		for _, k := range dropped {
			delete(oldTrie, k)
		}
		oldNets = map[limiterFsDestKey]uint32{}
	}
	tab, placed, lens := netTable(want)
	all := maps.Clone(oldTrie)
	maps.Copy(all, oldNets)
	maps.Copy(all, want)
	filter, lanes := filterOf(want), quickPortsOf(want)
	union := unionFilter(filterOf(all), filter)
	if err := l.setDestFilter(union, unionValues(quickPortsOf(all), lanes), true); err != nil {
		return err
	}
	if err := l.setDestKinds(kindsOf(all, nil) | kindsOf(oldNets, everyKey(oldNets))); err != nil {
		return err
	}
	var puts []limiterFsDestKey
	for k := range oldNets {
		if _, ok := want[k]; !ok {
			puts = append(puts, k)
		}
	}
	for _, k := range append(puts, sortDestKeys(want, false)...) {
		if err := l.triePut(k, all[k]); err != nil {
			return err
		}
	}
	if err := l.setDestKinds(kindsOf(all, nil)); err != nil {
		return err
	}
	if _, err := l.trieDropAbsent(all, want); err != nil {
		return err
	}
	if err := l.writeNetTable(tab); err != nil {
		return err
	}
	if err := l.destWrote(); err != nil {
		return err
	}
	if err := l.setDestLens(lens); err != nil {
		return err
	}
	if err := l.setDestKinds(kindsOf(want, nil) | kindsOf(want, placed)); err != nil {
		return err
	}
	for k := range placed {
		if err := l.trieDelete(k); err != nil {
			return err
		}
	}
	if err := l.setDestKinds(kindsOf(want, placed)); err != nil {
		return err
	}
	return l.setDestFilter(filter, lanes, false)
}

// trieDropAbsent lets go of the keys of have that want lacks, in the order
// sortDestKeys gives a drop (every port first, shortest first), and returns
// them.
func (l *Limiter) trieDropAbsent(have, want map[limiterFsDestKey]uint32) ([]limiterFsDestKey, error) {
	drop := map[limiterFsDestKey]uint32{}
	for k, id := range have {
		if _, ok := want[k]; !ok {
			drop[k] = id
		}
	}
	keys := sortDestKeys(drop, true)
	for _, k := range keys {
		if err := l.trieDelete(k); err != nil {
			return nil, err
		}
	}
	return keys, nil
}

// sortDestKeys lists keys in the order the trie takes them (put: naming a
// port first, then every port; longest prefix first within each) or, drop,
// lets go of them (every port first; shortest first within each); ties in
// a fixed order.
func sortDestKeys(keys map[limiterFsDestKey]uint32, drop bool) []limiterFsDestKey {
	out := slices.Collect(maps.Keys(keys))
	kind := func(k limiterFsDestKey) int {
		if k.Port != [2]byte{} {
			return 0
		}
		return 1
	}
	slices.SortFunc(out, func(a, b limiterFsDestKey) int {
		c := cmp.Compare(kind(a), kind(b))
		if c == 0 {
			c = cmp.Compare(b.Prefixlen, a.Prefixlen)
		}
		if drop {
			c = -c
		}
		if c != 0 {
			return c
		}
		if c := bytes.Compare(a.Port[:], b.Port[:]); c != 0 {
			return c
		}
		return bytes.Compare(a.Addr[:], b.Addr[:])
	})
	return out
}

// freeDestIDsLocked lists the ids a new pool may take, lowest first: those
// no pool names, then those of removed pools (not in keep) holding nothing.
// A pool removed less than destForgetGrace ago is waited for (under the
// lock, so at most that long) only when need, the number of new pools,
// is more than the ids free without it.
func (l *Limiter) freeDestIDsLocked(keep map[string][]destination.Destination, need int) ([]uint32, error) {
	used := map[uint32]bool{}
	for _, dp := range l.dests {
		used[dp.id] = true
	}
	var free []uint32
	for id := uint32(1); id < l.objs.FsDpoolConf.MaxEntries(); id++ {
		if !used[id] {
			free = append(free, id)
		}
	}
	var removed []*destPool
	for n, dp := range l.dests {
		if _, ok := keep[n]; !ok && !dp.live {
			removed = append(removed, dp)
		}
	}
	slices.SortFunc(removed, func(a, b *destPool) int { return a.removed.Compare(b.removed) })
	for _, dp := range removed {
		if len(free) >= need {
			break
		}
		if wait := destForgetGrace - time.Since(dp.removed); wait > 0 {
			graceSleep(wait)
		}
		held, err := l.destInUseLocked(dp.id)
		if err != nil {
			return nil, err
		}
		if held <= 0 {
			free = append(free, dp.id)
		}
	}
	return free, nil
}

// retireForIDsLocked frees the ids of need pools this change removes (live,
// not in keep) that no connection holds a permit of, for new pools no other
// id is left for: their destinations leave the tables, they are marked
// removed, and once destForgetGrace is out (a connect that found one just
// before takes its permit within it) their ids are returned, still named
// (setDestPoolsLocked forgets them). If fewer than need hold nothing, it
// returns no id and busy, the pools being removed that hold permits, with
// everything as it was: before any write when they are too few to begin
// with, else (one took a permit during the grace) with the tables and the
// flags written back. An error from a write leaves the change half-made,
// the pools still named: the next call makes the tables what it wants from
// what they hold.
func (l *Limiter) retireForIDsLocked(keep map[string][]destination.Destination, need int) (ids []uint32, busy []string, err error) {
	var empty []string
	for name, dp := range l.dests {
		if _, ok := keep[name]; ok || !dp.live {
			continue
		}
		held, err := l.destInUseLocked(dp.id)
		if err != nil {
			return nil, nil, err
		}
		if held > 0 {
			busy = append(busy, fmt.Sprintf("%s (%d held)", name, held))
		} else {
			empty = append(empty, name)
		}
	}
	slices.Sort(busy)
	if len(empty) < need {
		return nil, busy, nil
	}
	slices.SortFunc(empty, func(a, b string) int { return cmp.Compare(l.dests[a].id, l.dests[b].id) })
	empty = empty[:need]
	retiring := map[uint32]bool{}
	for _, name := range empty {
		retiring[l.dests[name].id] = true
	}
	// The destinations in force but the retiring pools'.
	trie, nets, err := l.destKeys()
	if err != nil {
		return nil, nil, err
	}
	inForce := maps.Clone(trie)
	maps.Copy(inForce, nets)
	rest := maps.Clone(inForce)
	maps.DeleteFunc(rest, func(_ limiterFsDestKey, id uint32) bool { return retiring[id] })
	if err := l.rewriteDestsLocked(rest); err != nil {
		return nil, nil, err
	}
	removed := time.Now()
	for _, name := range empty {
		dp := l.dests[name]
		if err := l.markDestLive(name, dp, false); err != nil {
			return nil, nil, err
		}
		dp.live, dp.removed = false, removed
	}
	if wait := destForgetGrace - time.Since(removed); wait > 0 {
		graceSleep(wait)
	}
	var late []string
	for _, name := range empty {
		held, err := l.destInUseLocked(l.dests[name].id)
		if err != nil {
			return nil, nil, err
		}
		if held > 0 {
			late = append(late, fmt.Sprintf("%s (%d held, taken as it was being removed)", name, held))
		}
	}
	if len(late) == 0 {
		for _, name := range empty {
			dp := l.dests[name]
			ids = append(ids, dp.id)
			delete(l.fleetEnd, name)
			l.log.Info("destination pool removed; its id, free, goes to a new pool", "pool", name, "id", dp.id)
		}
		return ids, nil, nil
	}
	for _, name := range empty {
		dp := l.dests[name]
		if err := l.markDestLive(name, dp, true); err != nil {
			return nil, nil, err
		}
		dp.live, dp.removed = true, time.Time{}
	}
	if err := l.rewriteDestsLocked(inForce); err != nil {
		return nil, nil, err
	}
	busy = append(busy, late...)
	slices.Sort(busy)
	return nil, busy, nil
}

// markDestLive sets or clears pool dp's DEST_LIVE flag in the maps.
func (l *Limiter) markDestLive(name string, dp *destPool, live bool) error {
	var c limiterFsDestConf
	if err := l.objs.FsDpoolConf.Lookup(dp.id, &c); err != nil {
		return fmt.Errorf("reading destination pool %s: %w", name, err)
	}
	what := "retiring"
	c.Flags &^= destLive
	if live {
		what = "restoring"
		c.Flags |= destLive
	}
	if err := l.putDestConf(dp.id, &c); err != nil {
		return fmt.Errorf("%s destination pool %s: %w", what, name, err)
	}
	return nil
}

// destInUseLocked is the permits of pool id held.
func (l *Limiter) destInUseLocked(id uint32) (int64, error) {
	var s limiterFsDestState
	if err := l.objs.FsDpoolState.Lookup(id, &s); err != nil {
		return 0, fmt.Errorf("reading destination pool %d: %w", id, err)
	}
	return s.InUse, nil
}

// forgetDestLocked frees pool dp's id: its name and per-project entries
// are cleared, so that the next pool given the id starts from zero.
func (l *Limiter) forgetDestLocked(name string, dp *destPool) error {
	for pid := uint32(1); pid <= l.projHigh && pid < l.maxProj; pid++ {
		k := (dp.id-1)*l.maxProj + pid
		if err := l.objs.FsDpoolProj.Put(k, &limiterFsProject{}); err != nil {
			return fmt.Errorf("clearing destination pool %s: %w", name, err)
		}
	}
	if err := l.objs.FsDpoolState.Put(dp.id, &limiterFsDestState{}); err != nil {
		return fmt.Errorf("clearing destination pool %s: %w", name, err)
	}
	if err := l.dropCapsLocked(dp.id); err != nil {
		return err
	}
	if err := l.putDestConf(dp.id, &limiterFsDestConf{}); err != nil {
		return fmt.Errorf("clearing destination pool %s: %w", name, err)
	}
	delete(l.dests, name)
	l.log.Info("destination pool's last connection closed; id freed", "pool", name, "id", dp.id)
	return nil
}

func destKey(d destination.Destination) limiterFsDestKey {
	a, bits := d.Mapped()
	k := limiterFsDestKey{Prefixlen: uint32(16 + bits), Addr: a}
	// Network order; every port (0) is kept under port 0, whose 16 bits
	// are matched like any port's.
	k.Port[0], k.Port[1] = byte(d.Port>>8), byte(d.Port)
	return k
}

// destKeys reads the destinations in force: the trie's, and the table's
// (as the trie's keys).
func (l *Limiter) destKeys() (trie, nets map[limiterFsDestKey]uint32, err error) {
	trie = map[limiterFsDestKey]uint32{}
	var k limiterFsDestKey
	var v uint32
	it := l.objs.FsDests.Iterate()
	for it.Next(&k, &v) {
		trie[k] = v
	}
	if err := it.Err(); err != nil {
		return nil, nil, fmt.Errorf("reading destinations: %w", err)
	}
	tab, err := l.readNetTable()
	if err != nil {
		return nil, nil, err
	}
	nets = map[limiterFsDestKey]uint32{}
	for _, n := range tab {
		if n.Pool != 0 {
			nets[limiterFsDestKey{Prefixlen: 16 + uint32(n.Plen), Port: n.Port, Addr: n.Addr}] = n.Pool
		}
	}
	return trie, nets, nil
}

// kindsOf is fs_settings.dest_kinds for keys, those in inTable kept in the
// table and the others in the trie.
func kindsOf(keys map[limiterFsDestKey]uint32, inTable map[limiterFsDestKey]bool) uint32 {
	k := uint32(0)
	for key := range keys {
		port := key.Port != [2]uint8{}
		switch {
		case inTable[key] && port:
			k |= destNetPorts
		case inTable[key]:
			k |= destNetAny
		case port:
			k |= destPorts
		default:
			k |= destAny
		}
	}
	return k
}

// everyKey is the set of keys' keys.
func everyKey(keys map[limiterFsDestKey]uint32) map[limiterFsDestKey]bool {
	out := make(map[limiterFsDestKey]bool, len(keys))
	for k := range keys {
		out[k] = true
	}
	return out
}

// destMask is the mask of a prefix of bits of the 128-bit address (the
// programs' dest_mask): its two 64-bit words as the programs load them
// (little-endian: the object is x86's alone).
func destMask(bits int) [2]uint64 {
	var m [16]byte
	for i := range bits {
		m[i/8] |= 0x80 >> (i % 8)
	}
	return [2]uint64{binary.LittleEndian.Uint64(m[:8]), binary.LittleEndian.Uint64(m[8:])}
}

// destNetSlot is the first slot of fs_dnets a destination (address masked
// to bits, port in network order) is looked for at: dest_net's hash, on the
// words as the programs load them.
func destNetSlot(addr [16]byte, port [2]byte, bits int) uint32 {
	a0, a1 := binary.LittleEndian.Uint64(addr[:8]), binary.LittleEndian.Uint64(addr[8:])
	pl := uint32(binary.LittleEndian.Uint16(port[:])) | uint32(bits&0xff)<<16
	h := (uint32(a0) ^ uint32(a0>>32) ^ uint32(a1)*31 ^ uint32(a1>>32) ^ pl*0x10001) * 0x9E3779B1
	return h >> (32 - destNetBits)
}

// netTable places the destinations of keys in a table laid out as
// fs_dnets, each in the first free slot from its own (destNetSlot) within
// destNetProbes; placed says which, and lens the lengths the programs
// probe, plus one, longest first (0 past the last), for each kind and for an IPv4
// (v4-mapped) address and another (the lengths of the prefixes that can
// hold such an address: a v4-mapped connect skips IPv6-only lengths, and
// the other way round). Of each kind (naming a port, of every port) the
// longest destLens lengths are placed, longest first;
// a length of which a destination finds no slot is the kind's last, so
// that every length the trie holds (the others) is shorter than the
// table's, or as long: two destinations of one kind and length that both
// hold an address are one. Keys are placed in a fixed order, so the same
// set gives the same table.
func netTable(keys map[limiterFsDestKey]uint32) (tab []limiterFsDestNet, placed map[limiterFsDestKey]bool, lens [2][2][destLens]uint8) {
	var nlens [2][2]int
	mapped := netip.MustParsePrefix("::ffff:0.0.0.0/96")
	tab = make([]limiterFsDestNet, destNets)
	placed = map[limiterFsDestKey]bool{}
	for kind := range 2 {
		byLen := map[int][]limiterFsDestKey{}
		for k := range keys {
			if (k.Port != [2]byte{}) == (kind == 0) {
				bits := int(k.Prefixlen) - 16
				byLen[bits] = append(byLen[bits], k)
			}
		}
		order := make([]int, 0, len(byLen))
		for b := range byLen {
			order = append(order, b)
		}
		slices.SortFunc(order, func(a, b int) int { return b - a })
		for _, bits := range order[:min(len(order), destLens)] {
			ks := byLen[bits]
			slices.SortFunc(ks, func(a, b limiterFsDestKey) int {
				if c := bytes.Compare(a.Port[:], b.Port[:]); c != 0 {
					return c
				}
				return bytes.Compare(a.Addr[:], b.Addr[:])
			})
			m := destMask(bits)
			var fams [2]bool // holds some v4-mapped address, some other
			for _, k := range ks {
				p := netip.PrefixFrom(netip.AddrFrom16(k.Addr), bits)
				fams[0] = fams[0] || p.Overlaps(mapped)
				fams[1] = fams[1] || !(bits >= 96 && mapped.Contains(p.Addr()))
			}
			for fam, has := range fams {
				if has {
					lens[kind][fam][nlens[kind][fam]] = uint8(bits + 1)
					nlens[kind][fam]++
				}
			}
			full := true
			for _, k := range ks {
				var a [16]byte
				binary.LittleEndian.PutUint64(a[:8], binary.LittleEndian.Uint64(k.Addr[:8])&m[0])
				binary.LittleEndian.PutUint64(a[8:], binary.LittleEndian.Uint64(k.Addr[8:])&m[1])
				i := destNetSlot(a, k.Port, bits)
				ok := false
				for j := uint32(0); j < destNetProbes && !ok; j++ {
					s := &tab[(i+j)&(destNets-1)]
					if s.Pool == 0 {
						*s = limiterFsDestNet{Addr: a, Port: k.Port, Plen: uint8(bits), Pool: keys[k]}
						placed[k], ok = true, true
					}
				}
				full = full && ok
			}
			if !full {
				break
			}
		}
	}
	return tab, placed, lens
}

// readNetTable reads fs_dnets.
func (l *Limiter) readNetTable() ([]limiterFsDestNet, error) {
	tab := make([]limiterFsDestNet, 0, l.objs.FsDnets.MaxEntries())
	err := readArrayN(l.objs.FsDnets, l.objs.FsDnets.MaxEntries(), func(v limiterFsDestNet) { tab = append(tab, v) })
	if err == nil && len(tab) != int(l.objs.FsDnets.MaxEntries()) {
		err = fmt.Errorf("%d slots of %d", len(tab), l.objs.FsDnets.MaxEntries())
	}
	if err != nil {
		return nil, fmt.Errorf("reading the destination table: %w", err)
	}
	return tab, nil
}

// writeNetTable makes fs_dnets tab, writing only the slots that change:
// first those that empty or change hands are emptied, shortest prefix
// first, then the new entries are written, longest first. So a connect
// that probes the table meanwhile never finds a shorter prefix of the table
// where a longer one matching it left for the trie (the loader moves a
// kind's lengths to the trie from the shortest up), nor a shorter new one
// before a longer one. A slot is written whole but not atomically: the
// programs may read one half-written, which matches nothing (the trie holds
// every destination meanwhile, SetDestPools), or at worst counts a connect
// racing the change in the slot's new pool, where its release gives the
// permit back (bpf/lib/dest.h, dest_net).
func (l *Limiter) writeNetTable(tab []limiterFsDestNet) error {
	l.destWriting("table")
	cur, err := l.readNetTable()
	if err != nil {
		return err
	}
	var gone, come []int
	for i := range cur {
		if cur[i] == tab[i] {
			continue
		}
		if cur[i].Pool != 0 {
			gone = append(gone, i)
		}
		if tab[i].Pool != 0 {
			come = append(come, i)
		}
	}
	slices.SortStableFunc(gone, func(a, b int) int { return int(cur[a].Plen) - int(cur[b].Plen) })
	slices.SortStableFunc(come, func(a, b int) int { return int(tab[b].Plen) - int(tab[a].Plen) })
	for _, i := range gone {
		if err := l.objs.FsDnets.Put(uint32(i), &limiterFsDestNet{}); err != nil {
			return fmt.Errorf("writing the destination table: %w", err)
		}
	}
	for _, i := range come {
		if err := l.objs.FsDnets.Put(uint32(i), &tab[i]); err != nil {
			return fmt.Errorf("writing the destination table: %w", err)
		}
	}
	return nil
}

// filterOf is the filter (fs_dest_filter in bpf/lib/types.h) of the trie's
// keys: a bit per port of the keys naming one; for the keys of every port, a
// bit per /16 of IPv4 addresses (the first two octets, the first high) and
// per first byte of other IPv6 addresses. A prefix shorter than that sets
// every bit it covers; an IPv6 prefix that covers the v4-mapped range sets
// the IPv4 bits too, as the trie would match an IPv4 address there.
func filterOf(keys map[limiterFsDestKey]uint32) limiterFsDestFilter {
	var f limiterFsDestFilter
	mapped := netip.MustParsePrefix("::ffff:0.0.0.0/96")
	// set sets the bits of words that a prefix fixing the n leading bits
	// of the width-bit value v covers: 2^(width-n) values.
	set := func(words []uint64, width int, v uint32, n int) {
		span := uint32(1) << (width - min(n, width))
		base := v &^ (span - 1)
		for b := base; b < base+span; b++ {
			words[b>>6] |= 1 << (b & 63)
		}
	}
	for k := range keys {
		port := uint16(k.Port[0])<<8 | uint16(k.Port[1])
		if port != 0 {
			f.Ports[port>>6] |= 1 << (port & 63)
			continue
		}
		bits := int(k.Prefixlen) - 16
		pfx := netip.PrefixFrom(netip.AddrFrom16(k.Addr), bits)
		if bits >= 96 && mapped.Contains(pfx.Addr()) {
			set(f.V4[:], 16, uint32(k.Addr[12])<<8|uint32(k.Addr[13]), bits-96)
			continue
		}
		set(f.V6[:], 8, uint32(k.Addr[0]), bits)
		if pfx.Contains(mapped.Addr()) {
			set(f.V4[:], 16, 0, 0)
		}
	}
	return f
}

func unionFilter(a, b limiterFsDestFilter) limiterFsDestFilter {
	for i := range a.Ports {
		a.Ports[i] |= b.Ports[i]
	}
	for i := range a.V4 {
		a.V4[i] |= b.V4[i]
	}
	for i := range a.V6 {
		a.V6[i] |= b.V6[i]
	}
	return a
}

// destFP is the programs' dest_fp (bpf/lib/dest.h): the fingerprint of a
// host (addr, its 16 bytes as the trie keeps them) at port (host order),
// over the address's two words as the programs load them.
func destFP(addr [16]byte, port uint16) uint16 {
	x := binary.LittleEndian.Uint64(addr[:8]) ^ binary.LittleEndian.Uint64(addr[8:])
	return uint16((uint32(x) ^ uint32(x>>32) ^ uint32(port)*0x10001) * 0x9E3779B1 >> 16)
}

// quickPortsOf is what the quick word's port lanes hold for the keys that
// name a port (dest_port_may), distinct, in order: a prefix's port, and a
// host's fingerprint (destFP), but for a host at a port a prefix names
// already, or whose fingerprint has a byte of 0xff (which would send every
// connect to the exact bits): its port. Where that makes more values than
// the lanes, the hosts' ports instead: five databases on 5432 take one
// lane, not five, and the word still stops a connect to another port.
func quickPortsOf(keys map[limiterFsDestKey]uint32) []uint64 {
	ports, prefixPorts := map[uint64]bool{}, map[uint64]bool{}
	for k := range keys {
		if port := uint64(binary.BigEndian.Uint16(k.Port[:])); port != 0 {
			ports[port] = true
			if k.Prefixlen != 16+128 {
				prefixPorts[port] = true
			}
		}
	}
	vals := slices.Collect(maps.Keys(prefixPorts))
	for k := range keys {
		port := binary.BigEndian.Uint16(k.Port[:])
		if port == 0 || k.Prefixlen != 16+128 || prefixPorts[uint64(port)] {
			continue
		}
		v := uint64(port)
		if fp := destFP(k.Addr, port); fp&0xff != 0xff && fp>>8 != 0xff {
			v = uint64(fp)
		}
		vals = append(vals, v)
	}
	slices.Sort(vals)
	if vals = slices.Compact(vals); len(vals) > int(quickPorts.n) {
		vals = slices.Sorted(maps.Keys(ports))
	}
	return vals
}

// heldLanes is the values the port lanes of quick word w hold (none for a
// word of no value, 0, or all ones), distinct, in order.
func heldLanes(w uint64) []uint64 {
	if w == 0 || w == ^uint64(0) {
		return nil
	}
	var vals []uint64
	for i := range quickPorts.n {
		vals = append(vals, w>>(i*quickPorts.width)&(1<<quickPorts.width-1))
	}
	slices.Sort(vals)
	return slices.Compact(vals)
}

// unionValues is the values of the lists given (each in order), distinct,
// in order.
func unionValues(lists ...[]uint64) []uint64 {
	u := slices.Concat(lists...)
	slices.Sort(u)
	return slices.Compact(u)
}

// setDestFilter writes the filter, the exact bits then their quick form
// (quickOf, its port lanes holding the values ports gives: quickPortsOf)
// in fs_settings. A reader may see a word of the old value beside one of
// the new: callers write a union of both first, widening, where the lanes
// also keep every value the word holds now (heldLanes): quickPortsOf of a
// larger set may hold a host's port where a smaller one held its
// fingerprint, so the values of the keys alone may miss the old word's.
func (l *Limiter) setDestFilter(f limiterFsDestFilter, ports []uint64, widen bool) error {
	l.destWriting("filter")
	if err := l.objs.FsDfilter.Put(uint32(0), &f); err != nil {
		return fmt.Errorf("writing the destination filter: %w", err)
	}
	if err := l.destWrote(); err != nil {
		return err
	}
	return l.editDestSettings("filter", func(cfg *limiterFsSettings) bool {
		vals := ports
		if widen {
			vals = unionValues(ports, heldLanes(cfg.DestQuick[0]))
		}
		cfg.DestQuick = quickOf(f, vals, cfg.DestQuick)
		return true
	})
}

// quickOf is fs_settings.dest_quick for filter f, written over prev (see
// dest_port_may and dest_net_may in bpf/lib/dest.h): the values of ports
// (quickPortsOf: for each pool naming a port, a host's fingerprint or a
// prefix's port; f's port bits hold the port of each) in four 16-bit lanes
// of the first word; in the second, the IPv4 /16s in three
// 16-bit lanes (its low six bytes) and the IPv6 first bytes in two 8-bit
// lanes (its high two); a part all ones where it has more values than
// lanes. The programs go to f's exact bits (written before this word) where
// a byte of a part is 0xff: all ones, a lane torn between a value and all
// ones, or a value with such a byte. A value prev holds keeps its lane, so
// that a reader who sees some bytes of the old word and some of the new
// still finds every value both hold (and, for the union rewriteDestsLocked
// writes first, every value of the old, whose port lanes setDestFilter
// adds; TestQuickOf tries every such mixture of ports, and
// TestQuickPortsAcrossChanges of hosts' fingerprints).
func quickOf(f limiterFsDestFilter, ports []uint64, prev [2]uint64) [2]uint64 {
	// A part with no value repeats one few connects go to: not 0, which
	// would let 0.0.0.0 (the local host to Linux), ::1 and 64:ff9b::
	// through to a probe, but 240.0/16 and 0100::/8, reserved (a connect
	// there costs a probe that finds nothing, no more).
	sixteens, first6 := setBits(f.V4[:]), setBits(f.V6[:])
	v4 := lanesOf(sixteens, quickV4, prev[1]&(1<<48-1))
	if len(sixteens) == 0 {
		v4 = quickNoV4
	}
	v6 := lanesOf(first6, quickV6, prev[1]>>48)
	if len(first6) == 0 {
		v6 = quickNoV6
	}
	return [2]uint64{lanesOf(ports, quickPorts, prev[0]), v4 | v6<<48}
}

// The parts of dest_quick: lanes of width bits each.
var (
	quickPorts = laneSet{n: 4, width: 16}
	quickV4    = laneSet{n: 3, width: 16}
	quickV6    = laneSet{n: 2, width: 8}
)

// The IPv4 and IPv6 parts of dest_quick[1] with no value (quickOf).
const (
	quickNoV4 = 0xf000_f000_f000
	quickNoV6 = 0x0101
)

type laneSet struct{ n, width uint }

// setBits is the values whose bits are set in words, in order.
func setBits(words []uint64) []uint64 {
	var vals []uint64
	for w, word := range words {
		for word != 0 {
			vals = append(vals, uint64(w<<6+bits.TrailingZeros64(word)))
			word &= word - 1
		}
	}
	return vals
}

// lanesOf places vals (distinct, each of ln.width bits) in the ln.n lanes
// of a part: each where prev has it, the others in the lanes prev holds no
// value of vals in, the lanes left over repeating the first value; all ones
// (of n x width bits) for more than n values, 0 for none.
func lanesOf(vals []uint64, ln laneSet, prev uint64) uint64 {
	n, width := ln.n, ln.width
	ones := uint64(1)<<(n*width) - 1
	if len(vals) > int(n) {
		return ones
	}
	if len(vals) == 0 {
		return 0
	}
	mask := uint64(1)<<width - 1
	lanes := make([]uint64, n)
	set := make([]bool, n)
	placed := map[uint64]bool{}
	want := map[uint64]bool{}
	for _, v := range vals {
		want[v] = true
	}
	if prev != ones {
		for i := range n {
			if v := prev >> (i * width) & mask; want[v] && !placed[v] {
				lanes[i], set[i], placed[v] = v, true, true
			}
		}
	}
	for _, v := range vals {
		if placed[v] {
			continue
		}
		for i := range n {
			if !set[i] {
				lanes[i], set[i], placed[v] = v, true, true
				break
			}
		}
	}
	var out uint64
	for i := range n {
		if !set[i] {
			lanes[i] = vals[0]
		}
		out |= lanes[i] << (i * width)
	}
	return out
}

// triePut and trieDelete write one destination of the trie, then bump the
// lookup's generation (destWrote).
func (l *Limiter) triePut(k limiterFsDestKey, id uint32) error {
	l.destWriting("trie")
	if err := l.objs.FsDests.Put(&k, id); err != nil {
		return fmt.Errorf("writing destination: %w", err)
	}
	return l.destWrote()
}

func (l *Limiter) trieDelete(k limiterFsDestKey) error {
	l.destWriting("trie")
	if err := l.objs.FsDests.Delete(&k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("removing destination: %w", err)
	}
	return l.destWrote()
}

// destWriteHook, when set (tests only), is called before each write to what
// a destination lookup reads (destWriting), with what it writes.
var destWriteHook func(l *Limiter, what string)

// destWriting is called before each write to what a destination lookup
// reads ("filter", "trie", "lens", "kinds"), or before the batch of writes
// to the table ("table"), which is switched off meanwhile; each is followed
// by a step of the generation (destWrote, or the kinds' own).
func (l *Limiter) destWriting(what string) {
	if destWriteHook != nil {
		destWriteHook(l, what)
	}
}

// destKindsMask is the kinds' bits of fs_settings.dest_kinds (DEST_KINDS in
// bpf/lib/dest.h); destGenOne is one step of the generation above them.
const (
	destKindsMask = 15
	destGenOne    = 16
)

// destWrote bumps the generation in fs_settings.dest_kinds after a write to
// what a destination lookup reads (the filter, the lengths, the table, the
// trie): a connect whose lookup read the word before the write makes it
// again (dest_connect's second try), so that every lookup
// rewriteDestsLocked's order answers for sees the destinations as they
// were between two writes, even one preempted in its middle.
func (l *Limiter) destWrote() error {
	return l.editDestSettings("", func(*limiterFsSettings) bool { return true })
}

// editDestSettings rewrites fs_settings as edit changes it (nothing if it
// says no change), with a step of the generation in dest_kinds in the same
// write; what names the write for destWriting ("": a step alone).
func (l *Limiter) editDestSettings(what string, edit func(*limiterFsSettings) bool) error {
	var cfg limiterFsSettings
	if err := l.objs.FsConfig.Lookup(uint32(0), &cfg); err != nil {
		return fmt.Errorf("reading config map: %w", err)
	}
	if !edit(&cfg) {
		return nil
	}
	if what != "" {
		l.destWriting(what)
	}
	cfg.DestKinds += destGenOne
	if err := l.objs.FsConfig.Put(uint32(0), &cfg); err != nil {
		return fmt.Errorf("writing config map: %w", err)
	}
	return nil
}

// setDestLens writes fs_settings.dest_lens, the table's prefix lengths plus one
// (netTable).
func (l *Limiter) setDestLens(lens [2][2][destLens]uint8) error {
	return l.editDestSettings("lens", func(cfg *limiterFsSettings) bool {
		cfg.DestLens = lens
		return true
	})
}

// setDestKinds writes the kinds of fs_settings.dest_kinds, and a step of its
// generation (destWrote) if they change; 0 keeps the programs from looking
// at the trie or the table at all.
func (l *Limiter) setDestKinds(kinds uint32) error {
	return l.editDestSettings("kinds", func(cfg *limiterFsSettings) bool {
		if cfg.DestKinds&destKindsMask == kinds {
			return false
		}
		cfg.DestKinds = cfg.DestKinds&^destKindsMask | kinds&destKindsMask
		return true
	})
}

// destFloor is the FLOOR written for a pool of size and configured floor:
// the default's at least one permit would sit above a size of 0.
func destFloor(size, floor uint32) uint32 {
	if size == 0 {
		return 0
	}
	return uint32(pools.EffectiveFloor(int(size), int(floor)))
}

// SetDestPoolSize sets the size of destination pool name at run time (a
// fleet-wide pool's local share, say), keeping its counts; its floor is
// recomputed if the configuration left it to the default. Connections held
// past a smaller size are not closed: the pool refuses until it is below.
// A size of 0 admits nobody.
func (l *Limiter) SetDestPoolSize(name string, size uint32) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return ErrClosed
	}
	dp, ok := l.dests[name]
	if !ok || !dp.live {
		return fmt.Errorf("%q: %w", name, ErrNoDestPool)
	}
	p := dp.cfg
	p.Size = size
	if p.Floor > size {
		p.Floor = size
	}
	if err := p.validate(); err != nil {
		return err
	}
	var c limiterFsDestConf
	if err := l.objs.FsDpoolConf.Lookup(dp.id, &c); err != nil {
		return fmt.Errorf("reading destination pool %s: %w", name, err)
	}
	c.Size, c.Floor = size, destFloor(size, p.Floor)
	if err := l.putDestConf(dp.id, &c); err != nil {
		return fmt.Errorf("resizing destination pool %s: %w", name, err)
	}
	dp.cfg = p
	return nil
}

// unpackDest is a destination pool's project entry v as the node's entries
// read: its in_use word unpacked into held and admitted (bpf/lib/share.h,
// PACKED_HELD_BITS).
func unpackDest(v limiterFsProject) limiterFsProject {
	held := v.InUse << (64 - packedHeldBits) >> (64 - packedHeldBits)
	v.Admitted = uint64(v.InUse-held) >> packedHeldBits
	v.InUse = held
	return v
}

// destProject reads project pid's entry in pool id.
func (l *Limiter) destProject(id, pid uint32) (limiterFsProject, error) {
	var v limiterFsProject
	if pid == 0 || pid >= l.maxProj {
		return v, nil
	}
	if err := l.objs.FsDpoolProj.Lookup((id-1)*l.maxProj+pid, &v); err != nil {
		return v, fmt.Errorf("reading destination pool %d: %w", id, err)
	}
	return unpackDest(v), nil
}

// tickDestsLocked recounts each pool's active projects (the programs only
// add newcomers) and frees the ids of removed pools whose permits are back.
func (l *Limiter) tickDestsLocked(mono uint64) error {
	for name, dp := range l.dests {
		var s limiterFsDestState
		if err := l.objs.FsDpoolState.Lookup(dp.id, &s); err != nil {
			return fmt.Errorf("reading destination pool %s: %w", name, err)
		}
		if !dp.live && s.InUse <= 0 && time.Since(dp.removed) >= destForgetGrace {
			if err := l.forgetDestLocked(name, dp); err != nil {
				return err
			}
			continue
		}
		if err := l.recountDestLocked(name, dp, s.Active, mono); err != nil {
			return err
		}
	}
	return nil
}

// recountDestsLocked recounts each destination pool's active projects, as
// recountLocked does the node's (Open: the pinned counts are the last
// daemon's).
func (l *Limiter) recountDestsLocked(mono uint64) error {
	for name, dp := range l.dests {
		var s limiterFsDestState
		if err := l.objs.FsDpoolState.Lookup(dp.id, &s); err != nil {
			return fmt.Errorf("reading destination pool %s: %w", name, err)
		}
		if err := l.recountDestLocked(name, dp, s.Active, mono); err != nil {
			return err
		}
	}
	return nil
}

// recountDestLocked brings pool dp's active count, read as was (before its
// projects: a newcomer added in between is counted twice until the next
// Tick, never missed), to its projects active at mono.
func (l *Limiter) recountDestLocked(name string, dp *destPool, was int64, mono uint64) error {
	window := uint64(l.window)
	if dp.cfg.Window > 0 {
		window = uint64(dp.cfg.Window)
	}
	active := int64(0)
	for pid := uint32(1); pid <= l.projHigh && pid < l.maxProj; pid++ {
		v, err := l.destProject(dp.id, pid)
		if err != nil {
			return err
		}
		if v.InUse > 0 || (v.LastSeenNs != 0 && mono-v.LastSeenNs < window) {
			active++
		}
	}
	if d := active - was; d != 0 {
		if _, err := l.adjust(limiterFsAdjustArgs{Op: opDestActive, SinceNs: uint64(dp.id), Delta: d}); err != nil {
			return fmt.Errorf("recounting active projects of destination pool %s: %w", name, err)
		}
	}
	return nil
}

// destHeldLocked says whether project pid holds a permit of any
// destination pool, a removed one still counting its connections included.
func (l *Limiter) destHeldLocked(pid uint32) (bool, error) {
	for _, dp := range l.dests {
		v, err := l.destProject(dp.id, pid)
		if err != nil {
			return false, err
		}
		if v.InUse != 0 {
			return true, nil
		}
	}
	return false, nil
}

// clearDestProjectLocked zeroes project pid's entries in every pool: its id
// is being freed (forgetLocked), and the next project given it starts empty.
func (l *Limiter) clearDestProjectLocked(pid uint32) error {
	if pid == 0 || pid >= l.maxProj {
		return nil
	}
	for id := uint32(1); id < l.objs.FsDpoolConf.MaxEntries(); id++ {
		if err := l.objs.FsDpoolProj.Put((id-1)*l.maxProj+pid, &limiterFsProject{}); err != nil {
			return fmt.Errorf("clearing project %d in destination pool %d: %w", pid, id, err)
		}
	}
	return nil
}

// destSnapshotsLocked reads every destination pool, sorted by name.
func (l *Limiter) destSnapshotsLocked(names []string, mono uint64) ([]DestSnapshot, error) {
	out := make([]DestSnapshot, 0, len(l.dests))
	for name, dp := range l.dests {
		var c limiterFsDestConf
		var s limiterFsDestState
		if err := l.objs.FsDpoolConf.Lookup(dp.id, &c); err != nil {
			return nil, fmt.Errorf("reading destination pool %s: %w", name, err)
		}
		if err := l.objs.FsDpoolState.Lookup(dp.id, &s); err != nil {
			return nil, fmt.Errorf("reading destination pool %s: %w", name, err)
		}
		ds := DestSnapshot{Name: name, ID: dp.id, Size: int(c.Size), Floor: int(c.Floor), InUse: int(s.InUse),
			KernelActive: int(max(s.Active, 0)), Refused: s.Refused, Would: s.Would,
			DryRun: c.Flags&destDryRun != 0, Removed: c.Flags&destLive == 0}
		for _, d := range dp.cfg.Destinations {
			ds.Destinations = append(ds.Destinations, d.String())
		}
		ds.Share = pools.Share(ds.Size, ds.Floor, ds.KernelActive)
		n := l.projHigh
		if l.readOnly {
			n = l.maxProj - 1
		}
		for pid := uint32(1); pid <= n && pid < l.maxProj; pid++ {
			v, err := l.destProject(dp.id, pid)
			if err != nil {
				return nil, err
			}
			if v == (limiterFsProject{}) {
				continue
			}
			ds.Admitted += v.Admitted
			pc := ProjectCounters{ID: pid, InUse: int(v.InUse), Admitted: v.Admitted, Refused: v.Refused,
				Active: v.InUse > 0 || (v.LastSeenNs != 0 && mono-v.LastSeenNs < c.WindowNs)}
			if int(pid) < len(names) {
				pc.Project = names[pid]
			}
			if pc.Active {
				ds.Active++
			}
			ds.Projects = append(ds.Projects, pc)
		}
		sort.Slice(ds.Projects, func(i, j int) bool { return ds.Projects[i].Project < ds.Projects[j].Project })
		out = append(out, ds)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// unnamedDestPool names destination pool id where the limiter has no name
// for it: removed since the kernel reported it, or added after the names
// were read (0: a record that named no pool).
func unnamedDestPool(id uint32) string {
	return fmt.Sprintf("destination_pool_%d", id)
}

// DestPoolName is the name of destination pool id (an event's), "" if
// none.
func (l *Limiter) DestPoolName(id uint32) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	for n, dp := range l.dests {
		if dp.id == id {
			return n
		}
	}
	return ""
}
