// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sort"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/loader/limits"
	"github.com/fairshare-dev/fairshare/pools"
	"github.com/fairshare-dev/fairshare/sockdiag"
)

// Snapshot is what the maps say now. Counts include permits reserved for
// inbound handshakes in flight. Active is counted from the projects' entries;
// Share is the one the programs apply, from their own count of active
// projects, which takes in a newcomer at its first ask and lets go of a
// project that left the window only at the next Tick.
type Snapshot struct {
	Size, Floor, InUse, Active, Share int
	Admitted, Refused                 uint64
	Projects                          []ProjectCounters // sorted by project, then id
	// Reservations is the number of inbound handshakes holding a permit.
	Reservations int
	// Events are node-wide event counters (summed over CPUs).
	Events Events
	// Exempt is the exempt budget; its permits are in none of the counts
	// above.
	Exempt Exempt
	// Lapse is the daemon's heartbeat and whether enforcement has lapsed.
	Lapse Lapse
	// Dests are the destination pools (SetDestPools), by name; their
	// permits are in the counts above too (a connect takes both).
	Dests []DestSnapshot
}

// ProjectCounters are one project's counters.
type ProjectCounters struct {
	Project           string // its name ("" for counters of an id with no name, which only a bug leaves)
	ID                uint32 // its compact id in the maps
	InUse             int
	Admitted, Refused uint64
	LastSeen          time.Time // the last ask or release; now while it holds permits
	Active            bool
	// ConnectionsPerSec is the project's rate of outbound connections in
	// force in the kernel (SetRates; 0 unbounded), RateTokens its bucket's
	// tokens now; AcceptsPerSec and AcceptTokens the same of its inbound
	// bucket; RateLimitedOut and RateLimitedIn the connects and SYNs its
	// rates refused (not in Refused).
	ConnectionsPerSec             float64
	RateTokens                    float64
	AcceptsPerSec                 float64
	AcceptTokens                  float64
	RateLimitedOut, RateLimitedIn uint64
}

// Events are node-wide counters of what the programs did.
type Events struct {
	AdmittedOut, AdmittedIn uint64 // permits granted at connect / for a request socket or a late child
	RefusedOut, RefusedIn   uint64 // ECONNREFUSED at connect / RST at the SYN
	Released                uint64 // permits given back
	Adopted                 uint64 // existing sockets counted by reconcile
	Expired                 uint64 // reservations given back after the TTL: their request socket was gone
	Unaccounted             uint64 // late handshakes refused: connection up, no permit
	ExemptAdmitted          uint64 // exempt permits taken
	ExemptOver              uint64 // exempt sockets over the exempt budget, put under the rule
	ExemptReleased          uint64 // exempt permits given back
	// MapFull counts what a full kernel table left uncounted: a connection
	// that holds no permit (the project, held-permit or reservation
	// table), or a project's listener (fs_listen_socks, fs_listeners),
	// whose inbound connections the rule then neither counts nor refuses
	// until a reconcile pass adopts them. An uncounted listener is counted
	// at its listen and again at every reconcile pass that finds the table
	// still full.
	MapFull uint64
	// Late counts children established without a reservation, admitted
	// by the rule at ESTABLISHED: their handshake left no request socket
	// (a SYN cookie's), or began before the programs, or its reservation
	// was given back. One the rule refuses then is also Unaccounted.
	Late uint64
	// RateLimitedOut and RateLimitedIn count connects and SYNs refused by
	// their project's rate (SetRate), not in RefusedOut and RefusedIn.
	RateLimitedOut, RateLimitedIn uint64
	// AdoptedPast counts the adopted sockets the rule would have refused
	// (ReconcileReport.AdoptedPast), since this Limiter was opened (0 for
	// a ReadOnly).
	AdoptedPast uint64
	// LapsedAdmitted counts the refusals admitted because enforcement had
	// lapsed (Lapse.Admitted), ever on these pins.
	LapsedAdmitted uint64
}

// monoNow is CLOCK_MONOTONIC in ns, the clock of bpf_ktime_get_ns.
func monoNow() uint64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return uint64(ts.Nano())
}

func (l *Limiter) checkOpen() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return ErrClosed
	}
	return nil
}

type projectEntry struct {
	id  uint64
	val limiterFsProject
}

// readProjects reads the projects table, in batches: the entries of the ids
// named in names, and of any other id whose counters are not all zero. Only
// the ids up to projHigh are read (ids are given lowest first, so about as
// many as there are projects, not the table's 16,384: BenchmarkSnapshot);
// a ReadOnly, which gives none, reads them all.
func (l *Limiter) readProjects(names []string) ([]projectEntry, error) {
	var out []projectEntry
	id := uint64(0)
	n := l.projHigh + 1
	if l.readOnly {
		n = l.objs.FsProjects.MaxEntries()
	}
	err := readArrayN(l.objs.FsProjects, n, func(v limiterFsProject) {
		named := id < uint64(len(names)) && names[id] != ""
		if id != 0 && (named || v != (limiterFsProject{})) {
			out = append(out, projectEntry{id, v})
		}
		id++
	})
	if err != nil {
		return nil, fmt.Errorf("reading projects map: %w", err)
	}
	return out, nil
}

func (l *Limiter) activeLocked(p limiterFsProject, mono uint64) bool {
	return p.InUse > 0 || (p.LastSeenNs != 0 && mono-p.LastSeenNs < uint64(l.window))
}

// recountLocked brings the node's active count, which the programs only
// ever add to, to the projects active now (in_use or a stamp within the
// window), and returns the projects' entries it read and the time it
// judged them at. Tick runs it, and so does Open: the count in the pins is
// the last daemon's, with every project that left the window since (no
// Tick took it out) still in it, and such a project's next ask is counted
// again as a newcomer's; kept until the first Tick, it would halve a lone
// project's share after a restart.
func (l *Limiter) recountLocked() ([]projectEntry, uint64, error) {
	// The count is read before the projects: a newcomer the programs add
	// in between is then in both, counted twice until the next Tick (a
	// smaller share, the safe side), never missed.
	var node limiterFsPool
	if err := l.objs.FsNode.Lookup(uint32(0), &node); err != nil {
		return nil, 0, fmt.Errorf("reading node map: %w", err)
	}
	projs, err := l.readProjects(l.memb.names)
	if err != nil {
		return nil, 0, err
	}
	mono := l.mono()
	active := 0
	for _, p := range projs {
		if l.activeLocked(p.val, mono) {
			active++
		}
	}
	// An add, not a store: bumps made since the read above are kept.
	if d := int64(active) - node.Active; d != 0 {
		if _, err := l.adjust(limiterFsAdjustArgs{Op: opActive, Delta: d}); err != nil {
			return nil, 0, fmt.Errorf("recounting active projects: %w", err)
		}
	}
	return projs, mono, nil
}

// recountActiveLocked recounts the node's active projects and each
// destination pool's (Open).
func (l *Limiter) recountActiveLocked() error {
	_, mono, err := l.recountLocked()
	if err != nil {
		return err
	}
	return l.recountDestsLocked(mono)
}

// Tick is one step of the control loop, meant to run once a second: it
// recounts the active projects (the programs only ever add newcomers to the
// count; projects that left the window are taken out here), writes POOL and
// FLOOR into the config map, gives back reservations older than the TTL and
// forgets removed projects. now is unused by the kernel side, whose clock is
// CLOCK_MONOTONIC (Options.Monotonic); it is accepted so the loop's clock is
// the caller's. A bump of the members' generation still owed
// (membersChanged) is tried again first; its failure is returned with the
// rest's, which is done all the same.
func (l *Limiter) Tick(now time.Time) (err error) {
	_ = now
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return ErrClosed
	}
	if genErr := l.payGen(); genErr != nil {
		defer func() { err = errors.Join(err, genErr) }()
	}
	if err := l.heartbeat(); err != nil {
		return err
	}
	projs, mono, err := l.recountLocked()
	if err != nil {
		return err
	}
	var cfg limiterFsSettings
	if err := l.objs.FsConfig.Lookup(uint32(0), &cfg); err != nil {
		return fmt.Errorf("reading config map: %w", err)
	}
	if cfg.Pool != l.size || cfg.Floor != l.floor || cfg.WindowNs != uint64(l.window) {
		cfg.Pool, cfg.Floor, cfg.WindowNs = l.size, l.floor, uint64(l.window)
		if err := l.objs.FsConfig.Put(uint32(0), &cfg); err != nil {
			return fmt.Errorf("writing config map: %w", err)
		}
	}
	if err := l.expireLocked(mono); err != nil {
		return err
	}
	if err := l.forgetLocked(projs, mono); err != nil {
		return err
	}
	if err := l.tickDestsLocked(mono); err != nil {
		return err
	}
	return l.syncRatesLocked(projs)
}

// expireLocked gives back the reservations older than the TTL whose
// request socket is gone: the client reset the handshake, the kernel timed
// it out, or dropped it. A reservation of this network namespace whose
// request socket still exists (sock_diag lists its cookie in SYN_RECV) is
// kept: the handshake can still complete, and its permit is given back by
// the child's close, or here once the kernel lets go of the request socket
// (after its SYN-ACK retries, tcp_synack_retries). One of another namespace,
// which this process cannot list, is given back after the TTL as it is; if
// its handshake completes later the child is admitted again at ESTABLISHED.
// The BPF side ends the entry and releases; whoever ends a reservation
// (this or the ESTABLISHED conversion) owns its permit. It names the stamp
// it read, so a reservation made after the read is not ended for it.
func (l *Limiter) expireLocked(mono uint64) error {
	type candidate struct {
		a    limiterFsAdjustArgs
		mine bool // of this netns: checked against its socket table
	}
	var old []candidate
	mine := false
	err := l.readResv(func(k limiterFsResvKey, v limiterFsResv) {
		if mono > v.SinceNs && mono-v.SinceNs > uint64(l.ttl) {
			old = append(old, candidate{limiterFsAdjustArgs{Op: opExpire, Key: k, SinceNs: v.SinceNs}, v.Netns == l.netns})
			mine = mine || v.Netns == l.netns
		}
	})
	if err != nil {
		return err
	}
	var alive map[uint64]bool
	if mine {
		socks, err := sockdiag.List(sockdiag.Options{States: sockdiag.StateSynRecv.Mask()})
		if err != nil {
			return fmt.Errorf("listing request sockets for the reservation expiry: %w", err)
		}
		alive = make(map[uint64]bool, len(socks))
		for _, s := range socks {
			alive[s.Cookie] = true
		}
	}
	for _, c := range old {
		if c.mine && alive[c.a.Key.Cookie] {
			continue
		}
		if _, err := l.adjust(c.a); err != nil {
			return fmt.Errorf("expiring reservation: %w", err)
		}
	}
	return nil
}

// forgetLocked frees the ids of projects that have no member and hold
// nothing and asked for nothing for a while (forgetAfter): no new socket can
// count for them, and their counters have stopped moving. A project a
// listening socket still names (its registration went while it listened)
// keeps its id, so a connection it accepts later is not counted for a
// project the id is given to next. Holding nothing means in every pool: an
// exempt socket holds no permit of the node's pool but does hold one of the
// destination pool it connected to (dest.h), and its release gives it back
// to the id's entry there, which freeing the id would have zeroed (the
// pool's count then went below zero, the next project given the id
// inherited the debt).
func (l *Limiter) forgetLocked(projs []projectEntry, mono uint64) error {
	has := l.hasMember()
	var idle []uint32
	for _, p := range projs {
		id := uint32(p.id)
		if has[id] || p.val.InUse != 0 || mono-p.val.LastSeenNs < uint64(forgetAfter) {
			continue
		}
		idle = append(idle, id)
	}
	if len(idle) == 0 {
		return nil
	}
	listening := map[uint64]bool{}
	var k limiterFsListenKey
	var v limiterFsListener
	it := l.objs.FsListeners.Iterate()
	for it.Next(&k, &v) {
		listening[v.Project] = true
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("reading listeners: %w", err)
	}
	for _, id := range idle {
		if listening[uint64(id)] {
			continue
		}
		held, err := l.destHeldLocked(id)
		if err != nil {
			return err
		}
		if held {
			continue
		}
		if err := l.clearDestProjectLocked(id); err != nil {
			return err
		}
		if err := l.freeLocked(id); err != nil {
			return err
		}
		// Its bucket goes with it (its refusals stay in the node's).
		if _, err := l.rateSetLocked(limiterFsRateArgs{Op: rateOpDelete, Project: uint64(id)}); err != nil {
			return fmt.Errorf("forgetting the connection rate of project %d: %w", id, err)
		}
	}
	return nil
}

const (
	opExpire     = 1
	opAdd        = 2
	opDrop       = 3
	opActive     = 4
	opExempt     = 5
	opUnlisten   = 6
	opMemberGen  = 7
	opDestActive = 8
	opDestAdd    = 9
	opDestConf   = 10
)

// adjust runs fs_adjust, the syscall program that changes counters with the
// same atomics as the hooks (a map update from user space would race them).
func (l *Limiter) adjust(a limiterFsAdjustArgs) (int64, error) {
	l.adjustM.Lock()
	defer l.adjustM.Unlock()
	return runAdjust(l.objs.FsAdjust, a)
}

// runAdjust runs fs_adjust (prog) with context a and returns its result.
func runAdjust(prog *ebpf.Program, a limiterFsAdjustArgs) (int64, error) {
	buf, err := binary.Append(nil, binary.NativeEndian, &a)
	if err != nil {
		return 0, fmt.Errorf("encoding fs_adjust context: %w", err)
	}
	out := make([]byte, len(buf))
	if _, err := prog.Run(&ebpf.RunOptions{Context: buf, ContextOut: out}); err != nil {
		return 0, fmt.Errorf("running fs_adjust: %w", err)
	}
	var res limiterFsAdjustArgs
	if _, err := binary.Decode(out, binary.NativeEndian, &res); err != nil {
		return 0, fmt.Errorf("decoding fs_adjust context: %w", err)
	}
	return res.Result, nil
}

func (l *Limiter) readEvents() (Events, error) {
	var per []limiterFsCounters
	if err := l.objs.FsStats.Lookup(uint32(0), &per); err != nil {
		return Events{}, fmt.Errorf("reading counters: %w", err)
	}
	var e Events
	for _, c := range per {
		e.AdmittedOut += c.AdmittedOut
		e.AdmittedIn += c.AdmittedIn
		e.RefusedOut += c.RefusedOut
		e.RefusedIn += c.RefusedIn
		e.Released += c.Released
		e.Adopted += c.Adopted
		e.Expired += c.Expired
		e.Unaccounted += c.Unaccounted
		e.MapFull += c.MapFull
		e.ExemptAdmitted += c.ExemptAdmitted
		e.ExemptOver += c.ExemptOver
		e.ExemptReleased += c.ExemptReleased
		e.Late += c.Late
	}
	var err error
	if e.RateLimitedOut, e.RateLimitedIn, err = l.readRateStats(); err != nil {
		return Events{}, err
	}
	e.AdoptedPast = l.adoptedPast // l.mu is held (Snapshot)
	return e, nil
}

// Events reads the node-wide event counters alone, without the rest of
// Snapshot: cheap enough for every tick.
func (l *Limiter) Events() (Events, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return Events{}, ErrClosed
	}
	return l.readEvents()
}

// Snapshot reads the maps.
func (l *Limiter) Snapshot() (Snapshot, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return Snapshot{}, ErrClosed
	}
	var cfg limiterFsSettings
	if err := l.objs.FsConfig.Lookup(uint32(0), &cfg); err != nil {
		return Snapshot{}, fmt.Errorf("reading config map: %w", err)
	}
	var node limiterFsPool
	if err := l.objs.FsNode.Lookup(uint32(0), &node); err != nil {
		return Snapshot{}, fmt.Errorf("reading node map: %w", err)
	}
	ev, err := l.readEvents()
	if err != nil {
		return Snapshot{}, err
	}
	lapse, err := l.Lapse()
	if err != nil {
		return Snapshot{}, err
	}
	ev.LapsedAdmitted = lapse.Admitted
	names := l.memb.names
	if l.readOnly {
		// No SetMembers here: the names as the pins have them now.
		if names, err = readNames(l.objs.FsNames, l.objs.FsNames.MaxEntries()); err != nil {
			return Snapshot{}, err
		}
	}
	projs, err := l.readProjects(names)
	if err != nil {
		return Snapshot{}, err
	}
	resv, err := l.reservationsByProject()
	if err != nil {
		return Snapshot{}, err
	}
	rates, err := l.readRates()
	if err != nil {
		return Snapshot{}, err
	}
	now, mono := l.clock.Now(), l.mono()
	s := Snapshot{
		Size: int(cfg.Pool), Floor: int(cfg.Floor), InUse: int(node.InUse),
		// The share the programs apply now: from the kernel's active
		// count, which may be ahead of Active below until the next Tick.
		Share:    pools.Share(int(cfg.Pool), int(cfg.Floor), int(max(node.Active, 0))),
		Admitted: ev.AdmittedIn + ev.AdmittedOut, Refused: ev.RefusedIn + ev.RefusedOut,
		Events: ev, Lapse: lapse,
		Exempt: Exempt{
			Paths: slices.Clone(l.exempt), Missing: slices.Clone(l.exemptMissing), Max: int(l.exemptMax), InUse: int(node.ExemptInUse),
			Admitted: ev.ExemptAdmitted, OverBudget: ev.ExemptOver, Released: ev.ExemptReleased,
		},
	}
	for id, n := range resv {
		if id != 0 {
			s.Reservations += n
		}
	}
	for _, p := range projs {
		pc := ProjectCounters{
			Project: names[p.id], ID: uint32(p.id), InUse: int(p.val.InUse),
			Admitted: p.val.Admitted, Refused: p.val.Refused,
			Active: l.activeLocked(p.val, mono),
		}
		if r, ok := rates[p.id]; ok {
			pc.ConnectionsPerSec, pc.RateTokens = rateView(r, mono)
			pc.AcceptsPerSec, pc.AcceptTokens = rateViewIn(r, mono)
			pc.RateLimitedOut, pc.RateLimitedIn = r.LimitedOut, r.LimitedIn
		}
		switch {
		case p.val.InUse > 0:
			// Holding counts as asking; the programs stamp a project
			// only when it asks holding nothing and when it lets go.
			pc.LastSeen = now
		case p.val.LastSeenNs != 0 && p.val.LastSeenNs <= mono:
			pc.LastSeen = now.Add(-time.Duration(mono - p.val.LastSeenNs))
		}
		if pc.Active {
			s.Active++
		}
		s.Projects = append(s.Projects, pc)
	}
	sort.Slice(s.Projects, func(i, j int) bool {
		a, b := s.Projects[i], s.Projects[j]
		if a.Project != b.Project {
			return a.Project < b.Project
		}
		return a.ID < b.ID
	})
	if s.Dests, err = l.destSnapshotsLocked(names, mono); err != nil {
		return Snapshot{}, err
	}
	return s, nil
}

// reservationsByProject counts the reservations of each project; exempt
// ones (not in the project's in_use) are counted under id 0.
func (l *Limiter) reservationsByProject() (map[uint64]int, error) {
	out := map[uint64]int{}
	err := l.readResv(func(_ limiterFsResvKey, v limiterFsResv) {
		if isExemptKind(v.Kind) {
			out[0]++
			return
		}
		out[v.Project]++
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// kindExemptOut and kindExemptAdopted are the first and last of the exempt
// kinds of fs_sock and fs_resv (KIND_EXEMPT_OUT and KIND_EXEMPT_ADOPTED in
// bpf/lib/types.h; KIND_OUT_LAX and KIND_OUT_HOST, after them, are not).
const kindExemptOut, kindExemptAdopted = 4, 6

func isExemptKind(k uint32) bool { return k >= kindExemptOut && k <= kindExemptAdopted }

// SetPool changes POOL and FLOOR in force (floor 0: the default for size),
// as a fleet pool's allotment moves (package fleet). Size 0 admits nobody.
// Permits held stay held: past the new POOL, the programs refuse until
// releases bring in_use under. The size cannot pass the permit map's
// capacity, set for the size the limiter was opened with.
func (l *Limiter) SetPool(size, floor uint32) error {
	if size == 0 {
		floor = 0
	} else {
		floor = uint32(pools.EffectiveFloor(int(size), int(floor)))
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return ErrClosed
	}
	if size > l.held || size > limits.MaxPoolSize || floor > size {
		return fmt.Errorf("pool %d floor %d (permit map of %d entries): %w", size, floor, l.held, ErrInvalidOptions)
	}
	var cfg limiterFsSettings
	if err := l.objs.FsConfig.Lookup(uint32(0), &cfg); err != nil {
		return fmt.Errorf("reading config map: %w", err)
	}
	cfg.Pool, cfg.Floor = size, floor
	if err := l.objs.FsConfig.Put(uint32(0), &cfg); err != nil {
		return fmt.Errorf("writing config map: %w", err)
	}
	l.size, l.floor = size, floor
	return nil
}
