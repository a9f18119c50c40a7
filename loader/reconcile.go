// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/sockdiag"
)

// ReconcileReport says what a reconcile pass found and fixed. Maps are keyed
// by project name ("#<cgroup id>" for a project whose cgroup is gone).
type ReconcileReport struct {
	// Adopted is the number of project sockets that held no permit and now
	// do: connections older than the programs, or admitted late and refused.
	Adopted int
	// AdoptedPast counts, by project, the adopted sockets the rule would
	// have refused when they were adopted (in_use at or past the limit
	// for the project, or the project at its fleet cap, in the node's pool
	// or in the destination pool of the socket's peer, enforced or in
	// dry-run):
	// they exist, so they are counted where the rule
	// holds them (their project's and the pool's in_use, which may then
	// exceed the pool's size), and reported here, in a warning, in the
	// adopted_past_rule counter (Events.AdoptedPast) and by the daemon as
	// an event per pool and project (AdoptedPastIn).
	AdoptedPast map[string]int
	// Moved counts, by project, the permits taken as Unclassified (their
	// pod not classified yet) that the pass moved to the project their
	// cgroup is a member of now; MovedPast those of them the rule would
	// have refused the project now (the pool's in_use, the permit
	// included, at or past its limit, or the project at its fleet cap, in
	// the node's pool or the permit's destination pool, enforced or in
	// dry-run): counted all the same, that pool then refusing the project
	// (in dry-run, would) until it is back under its limit, and reported
	// as AdoptedPast is (a warning, the daemon's moved_past_rule event).
	// The pools' in_use does not change.
	Moved, MovedPast map[string]int
	// Aborted counts, by project, the sockets of MovedPast that the pass
	// aborted (Options.AbortMovedPast): their permits go back as they
	// close, and the project is held to its limit as if their connects had
	// been refused.
	Aborted map[string]int
	// AdoptedPastIn and MovedPastIn break AdoptedPast and MovedPast down
	// by the pool whose rule the socket was past, pool -> project ->
	// sockets: ConnectionsPool is the node's pool, any other a destination
	// pool's name. A socket past both is counted in each, so their sum may
	// exceed AdoptedPast's and MovedPast's; each (pool, project) is a
	// warning in the log.
	AdoptedPastIn, MovedPastIn map[string]map[string]int
	// Held counts the permits held by sockets (entries of the held map, all
	// network namespaces).
	Held map[string]int
	// Kernel counts, from sock_diag, the project sockets that should hold a
	// permit: SYN_SENT, ESTABLISHED and CLOSE_WAIT, and the closing states
	// while a process still has the socket open.
	Kernel map[string]int
	// Reservations counts inbound handshakes holding a permit.
	Reservations map[string]int
	// Drift is the map's in_use minus (Held + Reservations), as seen twice in
	// a row, before repair.
	Drift map[string]int
	// Repaired is the correction applied to in_use per project.
	Repaired map[string]int
	// Orphans is the number of permits released because their socket no
	// longer exists (checked in the caller's network namespace only).
	Orphans int
	// Exempt counts exempt permits held and reserved (in none of the maps
	// above: they come from the exempt budget, not the projects').
	Exempt int
	// ExemptDrift is the budget's exempt_in_use minus Exempt, as seen twice
	// in a row, before repair; ExemptRepaired the correction applied.
	ExemptDrift, ExemptRepaired int
	// StaleListeners is the number of listening sockets of the caller's
	// network namespace that were still counted for their port and project
	// although they no longer exist (their close came while the programs
	// were detached, as during an upgrade), and are now uncounted.
	StaleListeners int
	// Netns says, per network namespace the pass looked into (the
	// daemon's own and each attached one it could enter), how many project
	// sockets sock_diag found there that should hold a permit. Adoption,
	// orphans and stale listeners above are checked in each of them.
	Netns map[uint64]int
	// NetnsSkipped lists the attached namespaces the pass could not enter
	// (attached by a path that is gone or now names another namespace, or
	// found pinned at a restart and not attached again since), by cookie,
	// with why: their permits are counted but not checked.
	NetnsSkipped map[uint64]string
	// Dests counts, per destination pool, the permits of its held by
	// sockets (their entries in the held map), DestDrift its counts minus
	// those, per pool and project as seen twice in a row, before repair,
	// and DestRepaired the correction applied.
	Dests        map[string]int
	DestDrift    map[string]map[string]int
	DestRepaired map[string]map[string]int
	// Unadopted counts, by project, the sockets that hold no permit and
	// that the pass could not adopt: the held-permit table had no room for
	// them (each one's slot held another socket's permit and the spill
	// table was full), as only a flood of connections older than the
	// programs makes it. They count nowhere (their project's in_use, or
	// the exempt budget's, is short by them) until a pass finds room, and
	// each project is a warning in the log at every pass while they last.
	Unadopted map[string]int
	// Migrated: the pass counted the live connections into the maps a
	// migration made (Open's, StartReport). Adopted are then connections
	// the old maps held permits for, counted again, not drift.
	Migrated bool
}

// destPair is a project in a destination pool.
type destPair struct {
	pool uint32
	proj uint64
}

// dumpTarget is a network namespace a reconcile pass looks into.
type dumpTarget struct {
	cookie uint64
	host   bool   // the daemon's own: entered by staying
	path   string // an attached one's, "" if not known (found pinned at Open)
	ino    uint64
}

// targets lists the namespaces to look into: the daemon's own first, then
// the attached ones, and during a migration every other one a process of
// the host is in (migNetns).
func (l *Limiter) targets() []dumpTarget {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := []dumpTarget{{cookie: l.netns, host: true}}
	extra := maps.Clone(l.migNetns)
	for c, n := range l.nets {
		t := dumpTarget{cookie: c, path: n.info.Path, ino: n.info.Inode}
		if e, ok := extra[t.ino]; ok {
			if t.path == "" {
				t.path = e.path // found pinned: entered by a process in it
			}
			delete(extra, t.ino)
		}
		out = append(out, t)
	}
	for _, e := range extra {
		out = append(out, e)
	}
	return out
}

// enter runs f in t's namespace (on the calling thread for the daemon's
// own), after checking that t's path still names it.
func (t dumpTarget) enter(f func() error) error {
	if t.host {
		return f()
	}
	if t.path == "" {
		return errors.New("attached before a restart and not attached again since: no path to enter it by")
	}
	ns, err := netns.GetFromPath(t.path)
	if err != nil {
		return fmt.Errorf("opening %s: %w", t.path, err)
	}
	defer ns.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(ns), &st); err != nil {
		return fmt.Errorf("reading %s: %w", t.path, err)
	}
	if st.Ino != t.ino {
		return fmt.Errorf("%s is another network namespace now", t.path)
	}
	return inNetns(ns, f)
}

// slotBusy marks a slot of fs_slots or fs_resv_slots being filled (SLOT_BUSY
// in bpf/lib/types.h).
const slotBusy = 1 << 63

// sockRecordSize is sizeof(struct fs_sock_record), checked by a test.
const sockRecordSize = 40

// Values of fs_sock_record.adopted (bpf/lib/types.h) besides 0 and 1
// (adopted): adoptedPast, adopted while the rule would have refused it;
// moved, its permit moved from a weak member's project (unclassified) to its
// cgroup's project now; movedPast, moved while the rule would have refused
// that project a permit; notAdopted, holding none and not adopted, the
// held-permit tables having no room for it; movedAborted, movedPast and
// aborted for it (Options.AbortMovedPast).
const (
	adoptedPast  = 2
	moved        = 3
	movedPast    = 4
	notAdopted   = 5
	movedAborted = 6
)

// Values of fs_sock_record.past (bpf/lib/types.h): the pools whose rule a
// socket was adopted or moved past, the node's and the destination pool it
// holds.
const (
	pastNode = 1
	pastDest = 2
)

// ConnectionsPool names the node's connections pool where a report names
// pools (ReconcileReport.AdoptedPastIn): the configuration's name for it.
const ConnectionsPool = "connections"

// countPast counts record r, adopted or moved past the rule, in each pool
// it was past (pool 0: the node's). The programs fill r.Dest wherever they
// set pastDest; one that did not would be counted under
// unnamedDestPool(0), not dropped.
func countPast(in map[destPair]int, r limiterFsSockRecord) {
	if r.Past&pastNode != 0 {
		in[destPair{0, r.Project}]++
	}
	if r.Past&pastDest != 0 {
		d := r.Dest
		if d == 0 {
			d = unnamedDest
		}
		in[destPair{d, r.Project}]++
	}
}

// unnamedDest stands for the destination pool of a record past its rule
// that named none (countPast).
const unnamedDest = ^uint32(0)

// pastByPool is in (pass.pastIn, pass.movedPastIn) as ReconcileReport
// keys it, pool name -> project name -> sockets, nil if empty: pool 0 is
// ConnectionsPool, a destination pool's id its name in names, or
// unnamedDestPool's if it has none there.
func pastByPool(in map[destPair]int, names map[uint32]string, name func(uint64) string) map[string]map[string]int {
	var out map[string]map[string]int
	for k, n := range in {
		if out == nil {
			out = map[string]map[string]int{}
		}
		pool := ConnectionsPool
		if k.pool == unnamedDest {
			pool = unnamedDestPool(0)
		} else if k.pool != 0 {
			var ok bool
			if pool, ok = names[k.pool]; !ok {
				pool = unnamedDestPool(k.pool)
			}
		}
		if out[pool] == nil {
			out[pool] = map[string]int{}
		}
		out[pool][name(k.proj)] += n
	}
	return out
}

// EachPast calls f with each pool, project and count of in, a
// ReconcileReport's AdoptedPastIn or MovedPastIn, pools and then projects
// in order.
func EachPast(in map[string]map[string]int, f func(pool, project string, n int)) {
	for _, pool := range slices.Sorted(maps.Keys(in)) {
		for _, p := range slices.Sorted(maps.Keys(in[pool])) {
			f(pool, p, in[pool][p])
		}
	}
}

// warnPast logs each (pool, project) of in (EachPast) as a warning with msg.
func (l *Limiter) warnPast(msg string, in map[string]map[string]int) {
	EachPast(in, func(pool, project string, n int) {
		l.log.Warn(msg, "pool", pool, "project", project, "count", n)
	})
}

// StartReport is what the reconcile pass Open made found and repaired (two
// passes in a migration, their repairs added): a restart on pins whose
// members have connections the programs did not count (opened while none
// were attached) adopts them there, before the caller's first pass. Open
// logs it; a daemon publishes it as it does its own passes.
func (l *Limiter) StartReport() ReconcileReport {
	return l.started
}

// addRepairs adds to r, a later pass's report, what o, an earlier one's,
// found and repaired: sockets adopted (and past the rule), permits moved,
// orphans released, listeners uncounted, counts corrected. What r says of
// the maps and sockets (held, kernel, drift, unadopted) stays its own.
func (r *ReconcileReport) addRepairs(o ReconcileReport) {
	r.Adopted += o.Adopted
	r.Orphans += o.Orphans
	r.StaleListeners += o.StaleListeners
	r.ExemptRepaired += o.ExemptRepaired
	r.AdoptedPast = addNamed(r.AdoptedPast, o.AdoptedPast)
	r.Moved = addNamed(r.Moved, o.Moved)
	r.MovedPast = addNamed(r.MovedPast, o.MovedPast)
	r.Aborted = addNamed(r.Aborted, o.Aborted)
	r.Repaired = addNamed(r.Repaired, o.Repaired)
	r.AdoptedPastIn = addByPool(r.AdoptedPastIn, o.AdoptedPastIn)
	r.MovedPastIn = addByPool(r.MovedPastIn, o.MovedPastIn)
	r.DestRepaired = addByPool(r.DestRepaired, o.DestRepaired)
}

// addNamed adds from's counts to to's, making to if it is nil and from is
// not empty.
func addNamed(to, from map[string]int) map[string]int {
	if to == nil && len(from) > 0 {
		to = map[string]int{}
	}
	addCounts(to, from)
	return to
}

// addByPool is addNamed of pool -> project -> count maps.
func addByPool(to, from map[string]map[string]int) map[string]map[string]int {
	if to == nil && len(from) > 0 {
		to = map[string]map[string]int{}
	}
	for pool, in := range from {
		to[pool] = addNamed(to[pool], in)
	}
	return to
}

// Reconcile compares the maps with the kernel's own socket table and repairs
// drift, in four steps: it adopts project sockets of the caller's network
// namespace that hold no permit; it uncounts listeners of that namespace that
// no longer exist; it releases permits held for sockets of that namespace
// that no longer exist; and, for each project whose in_use differs
// from its held permits plus its reservations, it adds the difference back
// with the programs' own atomics; the exempt budget's use is compared with
// the exempt permits held and reserved and repaired the same way. Each
// repair needs the same finding in two
// consecutive reads, so that connections opening and closing meanwhile are
// not mistaken for drift. Permits of sockets in other namespaces are counted
// but cannot be checked against live sockets from here. Passes run one at a
// time: a call waits for another's to end.
func (l *Limiter) Reconcile(ctx context.Context) (ReconcileReport, error) {
	return l.onePass(ctx, l.reconcile)
}

// onePass runs f, a pass or a walk, once no other runs, if l is open and
// ctx not done.
func (l *Limiter) onePass(ctx context.Context, f func() (ReconcileReport, error)) (ReconcileReport, error) {
	l.passM.Lock()
	defer l.passM.Unlock()
	// Checked under passM, which Close takes: a pass never reads maps
	// closed under it.
	if err := l.checkOpen(); err != nil {
		return ReconcileReport{}, err
	}
	if err := ctx.Err(); err != nil {
		return ReconcileReport{}, err
	}
	return f()
}

// Settle counts at once what members and network namespaces new since the
// last pass have already: it walks the sockets of the namespaces given (the
// host's, the daemon's own, if host; the attached ones whose netns cookies
// are in netns) as a pass does (fs_dump), which counts each listener there
// under its cgroup's project now (a listener opened before its cgroup was a
// member is counted from here on, one whose cgroup is in no project now is
// uncounted), adopts the project sockets that hold no permit and moves the
// permits taken as unclassified whose pod is classified now. It does not
// compare the counts with the sockets: no repair, and no release of a gone
// socket's permit (Reconcile's, which needs two reads). A walk costs about
// a pass's dump of each namespace given: the iterator reads the whole TCP
// table of the host once per namespace, so a caller names only those a
// change concerns. Its report has what the walk adopted and moved, and
// the namespaces it could not enter. Cookies not attached are ignored. It
// runs between passes, never beside one.
func (l *Limiter) Settle(ctx context.Context, host bool, netns []uint64) (ReconcileReport, error) {
	return l.onePass(ctx, func() (ReconcileReport, error) { return l.settle(host, netns) })
}

func (l *Limiter) settle(host bool, netns []uint64) (ReconcileReport, error) {
	l.mu.Lock()
	names := slices.Clone(l.memb.names)
	destNames := map[uint32]string{}
	for n, dp := range l.dests {
		destNames[dp.id] = n
	}
	l.mu.Unlock()
	targets := slices.DeleteFunc(l.targets(), func(t dumpTarget) bool {
		if t.host {
			return !host
		}
		return !slices.Contains(netns, t.cookie)
	})
	p := newPass()
	if err := l.dump(targets, &p); err != nil {
		return ReconcileReport{}, err
	}
	var rep ReconcileReport
	if len(p.skipped) > 0 {
		rep.NetnsSkipped = p.skipped
	}
	l.reportFound(&rep, p, p.unadopted, -1, destNames, idName(names))
	return rep, nil
}

type pass struct {
	checked map[uint64]bool   // netns cookies dumped
	skipped map[uint64]string // netns cookies not dumped, and why
	held    map[uint64]int    // permits per project, from fs_held (exempt ones under 0)
	resv    map[uint64]int    // reservations per project (exempt ones under 0)
	inUse   map[uint64]int64  // in_use per project, if it did not move during the pass
	exempt  int64             // the node's exempt_in_use, if it did not move during the pass
	exOK    bool
	orphans map[uint64]uint64 // cookie -> project: held in our netns without a live socket
	adopted int
	past    map[uint64]int // adopted past the rule, by project id
	// moved counts the permits moved from (unclassified) to the project
	// of their cgroup now, by that project's id; movedPast those the rule
	// would have refused it.
	moved, movedPast, aborted map[uint64]int
	// pastIn and movedPastIn break past and movedPast down by the pool
	// whose rule it was (pool 0: the node's), a socket past both in each.
	pastIn, movedPastIn map[destPair]int
	live                map[uint64]bool // cookies of the sockets the dump wrote out
	// unadopted counts the sockets the dump found no room to adopt, by
	// project id.
	unadopted map[uint64]int
	// destHeld counts the destination pool permits of held entries, and
	// destInUse the pools' per-project counts that did not move during the
	// pass.
	destHeld  map[destPair]int
	destInUse map[destPair]int64
}

// addFound adds what pass q adopted and moved, a second read, to p's: the
// programs adopt and move a socket once, so each pass reports its own.
func (p *pass) addFound(q pass) {
	p.adopted += q.adopted
	addCounts(p.past, q.past)
	addCounts(p.moved, q.moved)
	addCounts(p.movedPast, q.movedPast)
	addCounts(p.aborted, q.aborted)
	addCounts(p.pastIn, q.pastIn)
	addCounts(p.movedPastIn, q.movedPastIn)
}

// addCounts adds the counts of from to to's.
func addCounts[K comparable](to, from map[K]int) {
	for k, n := range from {
		to[k] += n
	}
}

func newPass() pass {
	return pass{held: map[uint64]int{}, orphans: map[uint64]uint64{}, checked: map[uint64]bool{}, skipped: map[uint64]string{},
		past: map[uint64]int{}, moved: map[uint64]int{}, movedPast: map[uint64]int{}, aborted: map[uint64]int{}, destHeld: map[destPair]int{},
		pastIn: map[destPair]int{}, movedPastIn: map[destPair]int{}, unadopted: map[uint64]int{}}
}

func (l *Limiter) readPass(targets []dumpTarget, names []string, dests []uint32) (pass, error) {
	p := newPass()
	var n0, n1 limiterFsPool
	if err := l.objs.FsNode.Lookup(uint32(0), &n0); err != nil {
		return p, fmt.Errorf("reading node map: %w", err)
	}
	before, err := l.readProjects(names)
	if err != nil {
		return p, err
	}
	destBefore, err := l.readDestCounts(dests)
	if err != nil {
		return p, err
	}
	if err := l.dump(targets, &p); err != nil {
		return p, err
	}
	live := p.live
	count := func(cookie uint64, v limiterFsSock) {
		id := v.Project
		if isExemptKind(v.Kind) {
			id = 0
		}
		p.held[id]++
		if v.Dest != 0 {
			p.destHeld[destPair{v.Dest, v.Project}]++
		}
		if p.checked[v.Netns] && !live[cookie] {
			p.orphans[cookie] = id
		}
	}
	if err := l.readSlots(count); err != nil {
		return p, err
	}
	var cookie uint64
	var v limiterFsSock
	hit := l.objs.FsHeld.Iterate()
	for hit.Next(&cookie, &v) {
		count(cookie, v)
	}
	if err := hit.Err(); err != nil {
		return p, fmt.Errorf("reading held permits: %w", err)
	}
	if p.resv, err = l.reservationsByProject(); err != nil {
		return p, err
	}
	after, err := l.readProjects(names)
	if err != nil {
		return p, err
	}
	destAfter, err := l.readDestCounts(dests)
	if err != nil {
		return p, err
	}
	p.destInUse = map[destPair]int64{}
	for k, v := range destAfter {
		if destBefore[k] == v {
			p.destInUse[k] = v
		}
	}
	if err := l.objs.FsNode.Lookup(uint32(0), &n1); err != nil {
		return p, fmt.Errorf("reading node map: %w", err)
	}
	p.exempt, p.exOK = n1.ExemptInUse, n0.ExemptInUse == n1.ExemptInUse
	// A project whose count moved while we looked is not comparable.
	was := map[uint64]int64{}
	for _, e := range before {
		was[e.id] = e.val.InUse
	}
	p.inUse = map[uint64]int64{}
	for _, e := range after {
		if v, ok := was[e.id]; ok && v == e.val.InUse {
			p.inUse[e.id] = e.val.InUse
		}
	}
	return p, nil
}

// dump runs fs_dump over the sockets of each target's namespace: the
// programs count listeners under their cgroup's project now, adopt project
// sockets that hold no permit and move permits taken as unclassified
// (limiter.c). It fills p's checked, skipped and live and what it found.
func (l *Limiter) dump(targets []dumpTarget, p *pass) error {
	it, err := link.AttachIter(link.IterOptions{Program: l.objs.FsDump})
	if err != nil {
		return fmt.Errorf("attaching the tcp iterator: %w", err)
	}
	defer it.Close()
	p.live = map[uint64]bool{}
	for _, t := range targets {
		// The iterator walks the namespace of the thread that opens it.
		var buf []byte
		err := t.enter(func() error {
			rd, err := it.Open()
			if err != nil {
				return fmt.Errorf("opening the tcp iterator: %w", err)
			}
			defer rd.Close()
			if buf, err = io.ReadAll(rd); err != nil {
				return fmt.Errorf("reading the tcp iterator: %w", err)
			}
			return nil
		})
		if err != nil {
			if t.host {
				return err
			}
			p.skipped[t.cookie] = err.Error()
			continue
		}
		p.checked[t.cookie] = true
		for len(buf) >= sockRecordSize {
			var r limiterFsSockRecord
			if _, err := binary.Decode(buf[:sockRecordSize], binary.NativeEndian, &r); err != nil {
				return fmt.Errorf("decoding a socket record: %w", err)
			}
			buf = buf[sockRecordSize:]
			p.live[r.Cookie] = true
			switch r.Adopted {
			case 1:
				p.adopted++
			case adoptedPast:
				p.adopted++
				p.past[r.Project]++
				countPast(p.pastIn, r)
			case moved:
				p.moved[r.Project]++
			case movedPast, movedAborted:
				p.moved[r.Project]++
				p.movedPast[r.Project]++
				countPast(p.movedPastIn, r)
				if r.Adopted == movedAborted {
					p.aborted[r.Project]++
				}
			case notAdopted:
				p.unadopted[r.Project]++
			}
		}
	}
	return nil
}

// reportFound puts in rep, and logs, what the dumps of a pass found: the
// sockets adopted and the permits moved (found: every dump's of the pass),
// and the sockets the last dump found no room to adopt (unadopted: the
// last's, since a second dump adopts what the first found no room for if
// sockets ended meanwhile); held is the permits the pass saw held, for the
// log (-1: not read).
func (l *Limiter) reportFound(rep *ReconcileReport, found pass, unadopted map[uint64]int, held int,
	destNames map[uint32]string, name func(uint64) string) {
	rep.Adopted = found.adopted
	if rep.Adopted > 0 {
		l.log.Info("adopted connections that held no permit", "count", rep.Adopted)
	}
	rep.AdoptedPastIn = pastByPool(found.pastIn, destNames, name)
	rep.MovedPastIn = pastByPool(found.movedPastIn, destNames, name)
	past, movedTo, movedPastTo := found.past, found.moved, found.movedPast
	for id, n := range past {
		if rep.AdoptedPast == nil {
			rep.AdoptedPast = map[string]int{}
		}
		rep.AdoptedPast[name(id)] += n
	}
	l.warnPast("adopted connections past the rule: they exist, so they count, and in_use may exceed the pool until they end",
		rep.AdoptedPastIn)
	if len(past) > 0 {
		l.mu.Lock()
		for _, n := range past {
			l.adoptedPast += uint64(n)
		}
		l.mu.Unlock()
	}
	for id, n := range movedTo {
		if rep.Moved == nil {
			rep.Moved = map[string]int{}
		}
		rep.Moved[name(id)] += n
		l.log.Info("moved permits taken as unclassified to the project their pod is classified in", "project", name(id), "count", n)
	}
	for id, n := range movedPastTo {
		if rep.MovedPast == nil {
			rep.MovedPast = map[string]int{}
		}
		rep.MovedPast[name(id)] += n
	}
	l.warnPast("moved permits taken as unclassified to their project past the rule: they exist, so they count, "+
		"and the rule refuses the project in that pool until it is back under its limit", rep.MovedPastIn)
	for id, n := range found.aborted {
		if rep.Aborted == nil {
			rep.Aborted = map[string]int{}
		}
		rep.Aborted[name(id)] += n
		l.log.Warn("aborted connections made before their pod was classified, past its project's limit: as if their connects had been refused",
			"project", name(id), "count", n)
	}
	for id, n := range unadopted {
		if rep.Unadopted == nil {
			rep.Unadopted = map[string]int{}
		}
		rep.Unadopted[name(id)] += n
	}
	var heldAttr []any
	if held >= 0 {
		heldAttr = []any{"permits_held", held}
	}
	for _, p := range slices.Sorted(maps.Keys(rep.Unadopted)) {
		l.log.Warn("project sockets that hold no permit could not be adopted: the held-permit table has no room for them "+
			"(their slots hold other sockets' permits and the spill table is full); they count nowhere, "+
			"so the project may take its share again beside them, until a pass finds room",
			slices.Concat([]any{"project", p, "count", rep.Unadopted[p]}, heldAttr, []any{"slots", l.held, "spill_entries", l.held})...)
	}
}

// readDestCounts reads the per-project counts of destination pools ids.
func (l *Limiter) readDestCounts(ids []uint32) (map[destPair]int64, error) {
	out := map[destPair]int64{}
	for _, id := range ids {
		for pid := uint32(1); pid <= l.projHigh && pid < l.maxProj; pid++ {
			v, err := l.destProject(id, pid)
			if err != nil {
				return nil, err
			}
			out[destPair{id, uint64(pid)}] = v.InUse
		}
	}
	return out, nil
}

// destDrift is, per pool and project whose count did not move during the
// pass, the count minus the permits held for it.
func (p pass) destDrift() map[destPair]int64 {
	out := map[destPair]int64{}
	for k, v := range p.destInUse {
		if d := v - int64(p.destHeld[k]); d != 0 {
			out[k] = d
		}
	}
	return out
}

// countedListeners returns the cookies of the listening sockets counted in
// fs_listen_socks, by the cookie of their network namespace.
func (l *Limiter) countedListeners() (map[uint64][]uint64, error) {
	out := map[uint64][]uint64{}
	var cookie uint64
	var k limiterFsListenKey
	it := l.objs.FsListenSocks.Iterate()
	for it.Next(&cookie, &k) {
		out[k.Netns] = append(out[k.Netns], cookie)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("reading counted listeners: %w", err)
	}
	return out, nil
}

// slotBatch is how many slots one batch lookup reads.
const slotBatch = 4096

// readSlots calls fn for every held permit in fs_slots. The array is read in
// batches of slotBatch entries per system call: it has 2 x POOL entries, and
// an entry-by-entry walk costs two system calls for each.
func (l *Limiter) readSlots(fn func(cookie uint64, v limiterFsSock)) error {
	return readArray(l.objs.FsSlots, func(slot limiterFsSlot) {
		if slot.Cookie != 0 && slot.Cookie&slotBusy == 0 {
			fn(slot.Cookie, slot.Sock)
		}
	})
}

// readArray calls fn for every value of the array m, read in batches of
// slotBatch entries per system call.
func readArray[V any](m *ebpf.Map, fn func(V)) error {
	return readArrayN(m, m.MaxEntries(), fn)
}

// readArrayN calls fn for the first n entries of the array m (all of them
// if it has fewer), in batches.
func readArrayN[V any](m *ebpf.Map, n uint32, fn func(V)) error {
	n = min(n, m.MaxEntries())
	batch := int(min(n, slotBatch))
	if batch == 0 {
		return nil
	}
	keys := make([]uint32, batch)
	vals := make([]V, batch)
	var cursor ebpf.MapBatchCursor
	left := int(n)
	for left > 0 {
		want := min(left, batch)
		got, err := m.BatchLookup(&cursor, keys[:want], vals[:want], nil)
		for _, v := range vals[:got] {
			fn(v)
		}
		left -= got
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("reading %s: %w", m, err)
		}
	}
	return nil
}

// readResv calls fn for each reservation: those in their slot of
// fs_resv_slots (read in batches, as readSlots does) and those in the spill
// table fs_reservations. A slot being filled is skipped, as in readSlots.
func (l *Limiter) readResv(fn func(k limiterFsResvKey, v limiterFsResv)) error {
	err := readArray(l.objs.FsResvSlots, func(slot limiterFsResvSlot) {
		if slot.Tag != 0 && slot.Tag&slotBusy == 0 {
			fn(limiterFsResvKey{Cookie: slot.Tag}, slot.Resv)
		}
	})
	if err != nil {
		return err
	}
	var k limiterFsResvKey
	var v limiterFsResv
	it := l.objs.FsReservations.Iterate()
	for it.Next(&k, &v) {
		fn(k, v)
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("reading reservations: %w", err)
	}
	return nil
}

// exemptDrift is exempt_in_use minus the exempt permits held and reserved
// (both under id 0), and whether the pass could tell.
func (p pass) exemptDrift() (int64, bool) {
	return p.exempt - int64(p.held[0]+p.resv[0]), p.exOK
}

func (p pass) drift() map[uint64]int64 {
	d := map[uint64]int64{}
	for id, n := range p.inUse {
		if x := n - int64(p.held[id]+p.resv[id]); x != 0 {
			d[id] = x
		}
	}
	return d
}

// idName names project ids by names (an id's name, or #id).
func idName(names []string) func(uint64) string {
	return func(id uint64) string {
		if id < uint64(len(names)) && names[id] != "" {
			return names[id]
		}
		return "#" + strconv.FormatUint(id, 10)
	}
}

func (l *Limiter) reconcile() (ReconcileReport, error) {
	l.mu.Lock()
	names := slices.Clone(l.memb.names)
	destNames := map[uint32]string{}
	var destIDs []uint32
	for n, dp := range l.dests {
		destNames[dp.id] = n
		destIDs = append(destIDs, dp.id)
	}
	members := make(map[string]string, len(l.memb.members)) // path -> project
	for _, r := range l.memb.members {
		switch {
		case r.path == "":
		case r.project == 0:
			members[r.path] = NoProject
		default:
			members[r.path] = l.memb.names[r.project]
		}
	}
	l.mu.Unlock()
	targets := l.targets()
	name := idName(names)
	rep := ReconcileReport{Held: map[string]int{}, Kernel: map[string]int{}, Reservations: map[string]int{},
		Drift: map[string]int{}, Repaired: map[string]int{}, Netns: map[uint64]int{},
		Dests: map[string]int{}, DestDrift: map[string]map[string]int{}, DestRepaired: map[string]map[string]int{}}

	// Read before the dump: a listener counted now and not in the dump
	// closed before the dump reached it (cookies are never reused), while
	// one that starts listening after this read is not a candidate.
	listening, err := l.countedListeners()
	if err != nil {
		return rep, err
	}
	first, err := l.readPass(targets, names, destIDs)
	if err != nil {
		return rep, err
	}
	rep.Adopted = first.adopted
	if len(first.skipped) > 0 {
		rep.NetnsSkipped = first.skipped
	}
	for ns, cookies := range listening {
		if !first.checked[ns] {
			continue
		}
		for _, cookie := range cookies {
			if first.live[cookie] {
				continue
			}
			n, err := l.adjust(limiterFsAdjustArgs{Op: opUnlisten, Project: cookie})
			if err != nil {
				return rep, fmt.Errorf("uncounting gone listener %d: %w", cookie, err)
			}
			rep.StaleListeners += int(n)
		}
	}
	if rep.StaleListeners > 0 {
		l.log.Warn("uncounted listening sockets that no longer exist (their close was missed while the programs were detached)",
			"count", rep.StaleListeners)
	}
	d1 := first.drift()
	dd1 := first.destDrift()
	last := first
	e1, e1ok := first.exemptDrift()
	if len(d1) > 0 || len(dd1) > 0 || len(first.orphans) > 0 || (e1ok && e1 != 0) {
		second, err := l.readPass(targets, names, destIDs)
		if err != nil {
			return rep, err
		}
		first.addFound(second)
		rep.Adopted = first.adopted
		last = second
		for cookie, id := range second.orphans {
			if _, ok := first.orphans[cookie]; !ok {
				continue
			}
			n, err := l.adjust(limiterFsAdjustArgs{Op: opDrop, Project: cookie})
			if err != nil {
				return rep, fmt.Errorf("releasing the permit of gone socket %d: %w", cookie, err)
			}
			rep.Orphans += int(n)
			second.held[id] -= int(n)
		}
		if rep.Orphans > 0 {
			l.log.Warn("released permits of sockets that no longer exist", "count", rep.Orphans)
			// The releases changed in_use: compare again from scratch next time.
			second.inUse = nil
			second.exOK = false
			second.destInUse = nil
		}
		for k, x := range second.destDrift() {
			y, ok := dd1[k]
			if !ok || (x > 0) != (y > 0) {
				continue // churn, not drift
			}
			fix := min(abs(x), abs(y))
			if x > 0 {
				fix = -fix
			}
			pool := destNames[k.pool]
			if rep.DestDrift[pool] == nil {
				rep.DestDrift[pool], rep.DestRepaired[pool] = map[string]int{}, map[string]int{}
			}
			rep.DestDrift[pool][name(k.proj)] = int(x)
			if _, err := l.adjust(limiterFsAdjustArgs{Op: opDestAdd, SinceNs: uint64(k.pool), Project: k.proj, Delta: fix}); err != nil {
				return rep, fmt.Errorf("repairing project %s in destination pool %s: %w", name(k.proj), pool, err)
			}
			rep.DestRepaired[pool][name(k.proj)] = int(fix)
			l.log.Warn("repaired destination pool count drift", "pool", pool, "project", name(k.proj), "map_minus_sockets", x, "applied", fix)
		}
		// The exempt budget is repaired like a project's count: the same
		// finding twice, the smaller of the two corrections.
		if e2, ok := second.exemptDrift(); ok && e1ok && e2 != 0 && (e1 > 0) == (e2 > 0) {
			fix := min(abs(e1), abs(e2))
			if e2 > 0 {
				fix = -fix
			}
			if _, err := l.adjust(limiterFsAdjustArgs{Op: opExempt, Delta: fix}); err != nil {
				return rep, fmt.Errorf("repairing the exempt budget: %w", err)
			}
			rep.ExemptDrift, rep.ExemptRepaired = int(e2), int(fix)
			l.log.Warn("repaired exempt budget drift", "map_minus_sockets", e2, "applied", fix)
		}
		for id, x := range second.drift() {
			y, ok := d1[id]
			if !ok || (x > 0) != (y > 0) {
				continue // churn, not drift
			}
			fix := min(abs(x), abs(y))
			if x > 0 {
				fix = -fix
			}
			rep.Drift[name(id)] = int(x)
			if _, err := l.adjust(limiterFsAdjustArgs{Op: opAdd, Project: id, Delta: fix}); err != nil {
				return rep, fmt.Errorf("repairing project %s: %w", name(id), err)
			}
			rep.Repaired[name(id)] = int(fix)
			l.log.Warn("repaired connection count drift", "project", name(id), "cgroup_id", id, "map_minus_sockets", x, "applied", fix)
		}
	}
	for id, n := range last.held {
		if id == 0 {
			rep.Exempt += n
			continue
		}
		rep.Held[name(id)] += n
	}
	for k, n := range last.destHeld {
		if pool, ok := destNames[k.pool]; ok {
			rep.Dests[pool] += n
		}
	}
	for id, n := range last.resv {
		if id == 0 {
			rep.Exempt += n
			continue
		}
		rep.Reservations[name(id)] += n
	}
	held := 0
	for _, n := range last.held {
		held += n
	}
	l.reportFound(&rep, first, last.unadopted, held, destNames, name)

	// The kernel's own count: every cgroup below a member, by project.
	// The weak members first: a member below one wins (project.h), and a
	// cgroup below a NoProject member counts for none.
	index := map[uint64]string{}
	for _, weak := range []bool{true, false} {
		for path, proj := range members {
			if (proj == Unclassified) != weak {
				continue
			}
			_ = cgroup.Walk(path, func(_ string, id uint64) {
				if proj == NoProject {
					delete(index, id)
				} else {
					index[id] = proj
				}
			})
		}
	}
	for _, t := range targets {
		if !last.checked[t.cookie] {
			continue
		}
		var socks []sockdiag.Socket
		if t.host {
			socks, err = sockdiag.List(sockdiag.Options{})
		} else {
			var h *sockdiag.Handle
			if h, err = sockdiag.NewHandleAtPath(t.path); err == nil {
				socks, err = h.List(sockdiag.Options{})
				h.Close()
			}
		}
		if err != nil {
			if t.host {
				return rep, fmt.Errorf("listing kernel sockets: %w", err)
			}
			continue // gone since the dump
		}
		rep.Netns[t.cookie] = 0
		for _, s := range socks {
			proj, ok := index[s.CgroupID]
			if !ok || !ShouldHold(s) {
				continue
			}
			rep.Kernel[proj]++
			rep.Netns[t.cookie]++
		}
	}
	return rep, nil
}

// ShouldHold says whether a project socket in this state holds a permit:
// from connect (SYN_SENT) or the end of the handshake (ESTABLISHED) until the
// process closes it or the connection dies, whichever comes first. A socket
// the process has closed (no inode) while it finishes its FIN exchange holds
// none; a child still queued for accept() (no inode either) does.
func ShouldHold(s sockdiag.Socket) bool {
	switch s.State {
	case sockdiag.StateSynSent, sockdiag.StateEstablished, sockdiag.StateCloseWait:
		return true
	case sockdiag.StateFinWait1, sockdiag.StateFinWait2, sockdiag.StateLastAck, sockdiag.StateClosing:
		return s.Inode != 0
	}
	return false
}

func abs(x int64) int64 {
	if x < 0 {
		return -x
	}
	return x
}
