// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"slices"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/events"
	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/membership"
	"github.com/fairshare-dev/fairshare/loader"
	"github.com/fairshare-dev/fairshare/pools"
)

// kernelReadEvery is how often the control loop reads the kernel's project
// entries for kernelBook: well under the minute after which the loader
// forgets an idle entry of a removed cgroup.
const kernelReadEvery = 15 * time.Second

// ErrStalePins means the pinned maps changed layout under the loader while
// it loaded (loader.ErrPinnedMismatch: another process at work on the pin
// directory). Pins of another layout found at the start, a larger pool's
// included, are migrated by the loader, not refused.
var ErrStalePins = errors.New("the pinned maps changed layout while the programs loaded")

// stalePinsError names the pin directory and the remedy in one sentence and
// keeps the loader's error for errors.Is. The remedy is a start once the
// other process is done, not cleanup: cleanup would drop enforcement and
// the counts that the next start migrates.
type stalePinsError struct {
	dir string
	err error
}

func (e *stalePinsError) Error() string {
	return fmt.Sprintf("the maps pinned in %s changed layout while the daemon loaded the programs against them "+
		"(another process at work on the pin directory); start it again once that is done: "+
		"the start then reuses or migrates what is pinned (%v)", e.dir, e.err)
}

func (e *stalePinsError) Unwrap() []error { return []error{ErrStalePins, e.err} }

// verbose adds the verifier's log to an error's message: cilium/ebpf's
// VerifierError prints the log only with %+v, which does not reach through
// the wrapping around it, and an operator needs that log to see why a
// program was refused. Callers still reach the error with errors.Is/As.
type verbose struct{ err error }

func (v verbose) Error() string {
	var ve *ebpf.VerifierError
	if errors.As(v.err, &ve) {
		return fmt.Sprintf("%v\n%+v", v.err, ve)
	}
	return v.err.Error()
}

func (v verbose) Unwrap() error { return v.err }

// loadError turns loader.Open's error into the daemon's.
func loadError(pinDir string, err error) error {
	if errors.Is(err, loader.ErrPinnedMismatch) {
		return &stalePinsError{dir: pinDir, err: err}
	}
	if errors.Is(err, loader.ErrBadExempt) {
		return fmt.Errorf("%w: connections.exempt: %w", config.ErrInvalid, err)
	}
	return fmt.Errorf("loading the bpf programs: %w", verbose{err})
}

// kernelSide is the connections pool enforced in the kernel: the limiter,
// the counts of the entries it forgot (kernelBook) and the reconcile
// passes' record. It is the daemon's pool view of the kernel (see pool), and
// the one place the daemon talks to the loader.
type kernelSide struct {
	lim       *loader.Limiter
	root      string // the projects root
	pinDir    string
	reconcile time.Duration // config.Reconcile: between passes; 0 only at start
	log       *slog.Logger
	events    *eventSink
	dryPool   bool // the pool is in dry-run (pools.connections.enforce: false)
	exempt    bool // connections.exempt names cgroups: followed every tick (refreshExempt)

	// syncMu serialises syncDryRun's copy and write: a write of an older
	// copy after a newer one put the set back as it was (a project just
	// put in dry-run refused, one just put back admitted past the rule,
	// until the next tick).
	syncMu sync.Mutex
	mu     sync.Mutex // guards the fields below
	book   kernelBook
	rec    admin.Reconcile
	// settleErr is the last settle's error, logged once ("": it worked).
	settleErr string
	// When the loop last reconciled and read the entries; zero: never.
	lastReconcile, lastRead time.Time
	// started is what Open's own pass found, ended at startedAt,
	// recorded at the loop's first tick (maintain); nil since.
	started   *loader.ReconcileReport
	startedAt time.Time
	// dry are the projects in dry-run by their policy, written into the
	// maps (SetDryRunProjects) when they change and at each tick.
	dry map[string]bool
	// dropped and lost are the programs' event counters last read (per
	// project id, and the ring buffer's), for the sink's dropped notices.
	dropped map[uint64]uint64
	lost    uint64

	// full is what warnFull keeps of the kernel's map_full counter (the
	// control loop's, not guarded by mu).
	full fullWatch
}

// openKernel loads and attaches the BPF programs for the connections pool
// of cfg (Open reconciles once) and reads the entries they keep. The pools
// named in sizes (the fleet ones, at their safe slice) open at that size
// with the default floor rather than at the configured (fleet) size: the
// destination pools, and the connections pool when it is a fleet pool,
// whose permit maps are still sized for the configured size, the most its
// allotment can reach.
//
// pinLock is the daemon's lock on the pin directory (nil if it did not
// exist yet): the loader migrates pins of another layout under it.
func openKernel(cfg config.Config, log *slog.Logger, sink *eventSink, sizes map[string]int, pinLock *os.File) (*kernelSide, error) {
	root, err := ProjectsRoot(cfg)
	if err != nil {
		return nil, err
	}
	conn := cfg.Pools[config.PoolConnections]
	mnt, err := cgroup.FindMount()
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(root, 0o755); err != nil {
		return nil, fmt.Errorf("creating projects root: %w", err)
	}
	level, err := mnt.Level(root)
	if err != nil {
		return nil, fmt.Errorf("projects root %s: %w", root, err)
	}
	exempt := exemptPaths(cfg, root)
	// The programs look for a socket's member from the level of the
	// projects root's children down (a registration above it is refused
	// by SetMembers), or from the top without a root. Beside Kubernetes
	// from the top too: the pod roots (/kubepods, level 1) are the
	// (unclassified) project's members, and a Guaranteed pod sits right
	// below one, so a walk from the level below would miss them and leave
	// such a pod unlimited until it is classified.
	base := uint32(1)
	if (cfg.Projects.Has(membership.SourceDirectory) || cfg.Projects.Has(membership.SourceSystemd)) &&
		!cfg.Projects.Has(membership.SourceKubernetes) {
		base = level + 1
	}
	dests, err := destPoolsOf(cfg, sizes)
	if err != nil {
		return nil, err
	}
	// A fleet connections pool opens at its safe slice (in sizes), its
	// permit tables sized for the fleet's size, the most its allotment
	// can reach.
	size, capacity, cfloor := uint32(conn.Size), uint32(0), uint32(conn.Floor)
	if n, ok := sizes[config.PoolConnections]; ok {
		size, capacity, cfloor = uint32(n), uint32(conn.Size), 0
	}
	lim, err := loader.Open(loader.Options{
		PinDir: cfg.PinDir, PinLock: pinLock, BaseLevel: base,
		PoolSize: size, PoolCapacity: capacity, Floor: cfloor, Window: conn.Window,
		Logger: log,
		Exempt: exempt, ExemptMax: uint32(cfg.Connections.ExemptMax),
		ReservationTTL: cfg.Connections.ReservationTTL, MaxNetns: cfg.Connections.MaxNetns,
		LapseAfter: cfg.Connections.LapseAfter, AbortMovedPast: cfg.Connections.AbortMovedPast,
		LimitHostNetwork: cfg.Connections.LimitHostNetworkPods,
		MaxDestPools:     uint32(cfg.Connections.MaxDestinationPools), DestPools: dests,
		// No destination pool and no room asked for: the tables are made
		// for none (8 MiB less); a pool added by SIGHUP then needs a
		// restart, which grows them (docs/destination-pools.md).
		NoDestPools: len(dests) == 0 && cfg.Connections.MaxDestinationPools == 0,
		// The events' bound and the pool's dry-run, written by Open
		// before its programs run (a pool in dry-run is never refused
		// by them) and before its heartbeat, its last step: nothing
		// after Open fails a start on pins a daemon left (New's
		// lockPins after it runs only on a pin directory this start
		// made), so a start that fails renews no heartbeat and a crash
		// loop lets enforcement lapse.
		Events: &loader.EventSettings{PerSec: uint32(cfg.Events.PerSec), DryRun: !conn.Enforced()},
	})
	if err != nil {
		return nil, loadError(cfg.PinDir, err)
	}
	k := &kernelSide{lim: lim, root: root, pinDir: cfg.PinDir, reconcile: cfg.Reconcile, log: log, events: sink,
		book: kernelBook{last: map[uint32]kernelCounts{}}, dry: map[string]bool{}, dropped: map[uint64]uint64{},
		dryPool: !conn.Enforced()}
	// Open's own pass: at a restart on pins with members, or a
	// migration, it is the one that adopts (and repairs), so its
	// findings become events and a pass of the record as the daemon's
	// do, at the first tick: once the start can no longer be undone.
	started := lim.StartReport()
	k.started, k.startedAt = &started, time.Now()
	// The floor in force, as the maps say.
	floor := pools.EffectiveFloor(int(size), int(cfloor))
	if s, err := lim.Snapshot(); err == nil {
		floor = s.Floor
		// Before the first Tick may forget an entry, so its counts are
		// kept (see kernelBook).
		k.note(s)
		// What the pins counted before this start is not warned of.
		k.warnFull(s.Events.MapFull, time.Now())
	}
	log.Info("connections enforced in the kernel", "projects_root", root, "pin_dir", cfg.PinDir,
		"size", size, "floor", floor)
	if k.exempt = len(exempt) > 0; k.exempt {
		if s, err := lim.Snapshot(); err == nil && len(s.Exempt.Missing) > 0 {
			log.Warn("exempt cgroups that do not exist yet: their sockets are exempt once they do (checked every tick)",
				"missing", s.Exempt.Missing, "in_force", s.Exempt.Paths)
		}
	}
	return k, nil
}

// refreshExempt puts in force the exempt cgroups made since the last tick,
// and follows one removed or made again (connections.exempt; after a boot
// a project's cgroups come after the daemon).
func (k *kernelSide) refreshExempt() {
	appeared, gone, err := k.lim.RefreshExempt()
	if err != nil {
		k.log.Warn("applying the exempt cgroups again", "err", err)
		return
	}
	if len(appeared) > 0 {
		k.log.Info("exempt cgroups now in force", "cgroups", appeared)
	}
	if len(gone) > 0 {
		k.log.Warn("exempt cgroups gone: out of force until they exist again", "cgroups", gone)
	}
}

func (k *kernelSide) name() string { return config.PoolConnections }

// recompute writes the active set and the share into the maps.
func (k *kernelSide) recompute(now time.Time) error {
	if err := k.lim.Tick(now); err != nil {
		return fmt.Errorf("bpf tick (pin dir %s): %w", k.pinDir, err)
	}
	return nil
}

// beat renews the kernel's heartbeat every tick until ctx ends, apart from
// the control loop (which renews it too, in Tick): enforcement lapses when
// the daemon is gone or the whole process stalls past
// connections.lapse_after, never because one tick's work (a reconcile pass
// over a busy node's sockets, a slow source) ran long. A failure is logged
// once until a renewal succeeds again.
func (k *kernelSide) beat(ctx context.Context, every time.Duration) error {
	failing := false
	return eachTick(ctx, every, func() (bool, error) {
		err := k.lim.Heartbeat()
		switch {
		case errors.Is(err, loader.ErrClosed):
			return true, nil
		case err != nil && !failing:
			k.log.Error("renewing the heartbeat failed: enforcement lapses after connections.lapse_after unless a renewal succeeds",
				"pin_dir", k.pinDir, "err", err)
			failing = true
		case err == nil && failing:
			k.log.Info("the heartbeat is renewed again", "pin_dir", k.pinDir)
			failing = false
		}
		return false, nil
	})
}

// eachTick calls f every period until ctx ends, f says it is done, or f
// fails; it returns f's error.
func eachTick(ctx context.Context, period time.Duration, f func() (done bool, err error)) error {
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if done, err := f(); done || err != nil {
			return err
		}
	}
}

// status reads the kernel's pool from one pass over its entries.
func (k *kernelSide) status() (admin.Pool, error) {
	s, err := k.lim.Snapshot()
	if err != nil {
		return admin.Pool{}, fmt.Errorf("reading the bpf maps: %w", err)
	}
	active, err := k.lim.KernelActive()
	if err != nil {
		return admin.Pool{}, fmt.Errorf("reading the bpf maps: %w", err)
	}
	k.mu.Lock()
	k.book.note(s)
	forgotten := k.book.forgotten
	k.mu.Unlock()
	would, err := k.refusalStats()
	if err != nil {
		return admin.Pool{}, fmt.Errorf("reading the bpf maps: %w", err)
	}
	k.mu.Lock()
	dry := maps.Clone(k.dry)
	k.mu.Unlock()
	return withWould(KernelPool(s, active, forgotten), would, k.dryPool, dry), nil
}

// maintain runs what is due at the control loop's tick: a reconcile pass
// (the first at the loop's first tick, after Open's own is recorded), and a
// read of the entries for kernelBook.
func (k *kernelSide) maintain(ctx context.Context, now time.Time) {
	k.mu.Lock()
	started := k.started
	k.started = nil
	k.mu.Unlock()
	if started != nil {
		k.recordPass(*started, k.startedAt)
	}
	k.mu.Lock()
	reconcile := k.lastReconcile.IsZero() || k.reconcile > 0 && now.Sub(k.lastReconcile) >= k.reconcile
	if reconcile {
		k.lastReconcile = now
	}
	read := now.Sub(k.lastRead) >= kernelReadEvery
	if read {
		k.lastRead = now
	}
	k.mu.Unlock()
	if reconcile {
		k.reconcilePass(ctx)
	}
	if k.exempt {
		k.refreshExempt()
	}
	// A project's dry-run reaches a cgroup made since; the events the
	// programs dropped become the sink's notices.
	k.syncDryRun()
	if _, err := k.refusalStats(); err != nil {
		k.log.Warn("reading the kernel's event counters", "err", err)
	}
	if e, err := k.lim.Events(); err != nil {
		k.log.Warn("reading the kernel's node-wide counters", "err", err)
	} else {
		k.warnFull(e.MapFull, now)
	}
	// The loader forgets a removed project's entry after a minute idle;
	// reading them more often than that keeps their final counts.
	if read {
		if s, err := k.lim.Snapshot(); err == nil {
			k.mu.Lock()
			k.book.note(s)
			k.mu.Unlock()
		}
	}
}

// fullWarnEvery is the least time between two warnings of warnFull.
const fullWarnEvery = time.Minute

// fullWatch is what warnFull keeps of the kernel's map_full counter.
type fullWatch struct {
	known  bool      // last was read
	last   uint64    // map_full at the last warning, or at the first read
	warned time.Time // the last warning; zero: none yet
}

// warnFull warns when the kernel's map_full counter (loader.Events.MapFull)
// has grown, at most once per fullWarnEvery, with the growth since the last
// warning: a kernel table had no room, so a connection holds no permit or a
// project's listener is not counted (its inbound connections are neither
// counted nor refused). The first reading (at openKernel) is only noted.
// Called by openKernel, then by the control loop only.
func (k *kernelSide) warnFull(mapFull uint64, now time.Time) {
	w := &k.full
	switch {
	case !w.known || mapFull < w.last: // the first reading, or new maps
		w.known, w.last = true, mapFull
	case mapFull > w.last && (w.warned.IsZero() || now.Sub(w.warned) >= fullWarnEvery):
		k.log.Warn("a kernel table is full: connections or project listeners went uncounted (map_full): such a connection holds "+
			"no permit; such a listener's inbound connections are neither counted nor refused until a reconcile pass adopts them. "+
			"pools.connections.size sizes the held-permit and reservation tables (twice it rounded up to a power of two, at least 1024; "+
			"a larger size takes effect at the next start); the listener tables hold "+strconv.Itoa(loader.MaxListeners)+
			" project listening sockets, set by no option: find the project with the most listeners and have it close some "+
			"(docs/troubleshooting.md, map_full)",
			"grew", mapFull-w.last, "map_full_total", mapFull, "pin_dir", k.pinDir)
		w.last, w.warned = mapFull, now
	}
}

// reconcilePass compares the maps with the kernel's socket table and
// repairs drift. The loader logs each repair; the pass is a debug line and
// the record Status shows.
func (k *kernelSide) reconcilePass(ctx context.Context) {
	start := time.Now()
	rep, err := k.lim.Reconcile(ctx)
	if err != nil && ctx.Err() != nil {
		return // shutting down: the next start's pass checks the counts
	}
	if err != nil {
		k.mu.Lock()
		k.rec.Time = time.Now()
		k.rec.Failures++
		k.rec.Error = err.Error()
		k.mu.Unlock()
		k.log.Error("reconcile failed: the connection counts were not checked against the kernel's socket table", "err", err)
		return
	}
	repairs := k.recordPass(rep, time.Now())
	k.log.Debug("reconcile pass", "sockets", sum(rep.Kernel), "held", sum(rep.Held), "reservations", sum(rep.Reservations),
		"repairs", repairs, "took", time.Since(start).Round(time.Microsecond))
}

// sum is the sum of m's counts.
func sum(m map[string]int) (n int) {
	for _, v := range m {
		n += v
	}
	return n
}

// recordPass keeps what a reconcile pass that ended at end found, for
// Status and the metrics, and publishes its repairs as events: the daemon's
// passes and the one loader.Open made (StartReport). It returns the pass's
// repairs. A migration's count of the live connections into the new maps is
// no repair: its adoptions are the old maps' permits (rep.Migrated).
func (k *kernelSide) recordPass(rep loader.ReconcileReport, end time.Time) int {
	k.mu.Lock()
	k.rec.Time = end
	repairs := rep.Orphans + rep.StaleListeners + abs(rep.ExemptRepaired)
	if !rep.Migrated {
		repairs += rep.Adopted
	}
	for _, v := range rep.Repaired {
		repairs += abs(v)
	}
	k.rec.Passes++
	k.rec.RepairsTotal += uint64(repairs)
	k.rec.Error = ""
	k.rec.Sockets, k.rec.Held, k.rec.Repairs = sum(rep.Kernel), sum(rep.Held), repairs
	k.rec.Adopted, k.rec.Orphans, k.rec.StaleListeners = rep.Adopted, rep.Orphans, rep.StaleListeners
	k.rec.Unadopted = sum(rep.Unadopted)
	k.addFound(rep)
	k.mu.Unlock()
	k.publishRepairs(rep)
	return repairs
}

// publishRepairs makes an event of each repair of a pass: sockets adopted
// (and those past the rule, per pool and project, the pool named), permits
// moved from (unclassified) past the rule (per pool and project), permits
// of gone sockets released, stale listeners uncounted, in_use corrected
// (per project), the exempt count corrected; and of the sockets it could
// not adopt (per project).
func (k *kernelSide) publishRepairs(rep loader.ReconcileReport) {
	pubIn := func(kind, pool, project string, n int, detail string) {
		if n != 0 {
			k.events.publish(events.Event{Source: events.SourceReconcile, Kind: kind, Pool: pool,
				Project: project, Count: uint64(abs(n)), Detail: detail})
		}
	}
	pub := func(kind, project string, n int, detail string) {
		pubIn(kind, config.PoolConnections, project, n, detail)
	}
	// Past the rule: an event per pool and project (a socket past the
	// node's pool and its destination pool's is in both).
	pubPast := func(kind string, in map[string]map[string]int, detail string) {
		loader.EachPast(in, func(pool, project string, n int) { pubIn(kind, pool, project, n, detail) })
	}
	if rep.Migrated {
		pub(events.KindAdopted, "", rep.Adopted, "live connections counted into the maps of a migration (the old maps held their permits)")
	} else {
		pub(events.KindAdopted, "", rep.Adopted, "project sockets that held no permit now do")
	}
	pubPast(events.KindAdoptedPast, rep.AdoptedPastIn,
		"adopted past the rule: the sockets exist, so they count, and in_use may exceed the pool until they end")
	pubPast(events.KindMovedPast, rep.MovedPastIn,
		"permits taken while its pod was unclassified moved to it past the rule: they count, and the project is refused until back under its limit")
	for _, p := range slices.Sorted(maps.Keys(rep.Aborted)) {
		pub(events.KindAbortedPast, p, rep.Aborted[p],
			"connections its pod opened before it was classified, moved to it past the rule, aborted (connections.abort_moved_past): as if refused then")
	}
	for _, p := range slices.Sorted(maps.Keys(rep.Unadopted)) {
		pub(events.KindUnadopted, p, rep.Unadopted[p],
			"sockets that hold no permit not adopted: the held-permit table has no room; they count nowhere until a pass finds room (repeated at every pass while they last)")
	}
	pub(events.KindRepaired, "", rep.Orphans, "permits of sockets that no longer exist released")
	pub(events.KindRepaired, "", rep.StaleListeners, "listeners that no longer exist uncounted")
	pub(events.KindRepaired, "", rep.ExemptRepaired, fmt.Sprintf("exempt in_use corrected by %+d", rep.ExemptRepaired))
	projects := make([]string, 0, len(rep.Repaired))
	for p := range rep.Repaired {
		projects = append(projects, p)
	}
	sort.Strings(projects)
	for _, p := range projects {
		v := rep.Repaired[p]
		pub(events.KindRepaired, p, v, fmt.Sprintf("in_use corrected by %+d", v))
	}
}

// addFound adds what rep's walk adopted past the rule and moved to the
// passes' totals. k.mu is held.
func (k *kernelSide) addFound(rep loader.ReconcileReport) {
	for _, n := range rep.AdoptedPast {
		k.rec.AdoptedPastTotal += uint64(n)
	}
	for _, n := range rep.Moved {
		k.rec.MovedTotal += uint64(n)
	}
	for _, n := range rep.MovedPast {
		k.rec.MovedPastTotal += uint64(n)
	}
	for _, n := range rep.Aborted {
		k.rec.AbortedTotal += uint64(n)
	}
}

// record is the reconcile passes' record, nil before the first pass.
func (k *kernelSide) record() *admin.Reconcile {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.rec.Passes == 0 && k.rec.Failures == 0 {
		return nil
	}
	rec := k.rec
	return &rec
}

// setRates puts project's rates of new connections, outbound and inbound
// (0: unbounded), in force in the kernel: at once if its cgroup exists,
// else from the tick after it appears (the loader keeps the rates and
// writes them every tick).
func (k *kernelSide) setRates(project string, r loader.Rates) {
	if err := k.lim.SetRates(project, r); err != nil {
		k.log.Error("connection rates not set in the kernel; the control loop tries again every tick",
			"project", project, "connections_per_sec", r.Out, "accepts_per_sec", r.In, "err", err)
	}
}

// close closes the limiter's descriptors; with detach it also unpins and
// detaches the programs, which otherwise keep enforcing. gone, if set, is
// the daemon's pin directory, open, whose path now leads elsewhere or
// nowhere (watchPins): what is left in it is unpinned through it (the
// directory renamed, or a file system mounted over it) and the programs
// detach, and the path, if something is there, is not theirs to clean.
func (k *kernelSide) close(detach bool, gone *os.File) error {
	if gone != nil {
		if err := loader.CleanupOpened(gone); err != nil {
			k.log.Error("unpinning what was left of the daemon's pins through its removed or replaced pin directory failed: "+
				"those left keep enforcing after it exits; 'fairshare cleanup' cannot reach them by the path", "pin_dir", k.pinDir, "err", err)
			return errors.Join(err, k.lim.Close())
		}
		err := k.lim.Close()
		k.log.Info("bpf programs detached: their pin directory was removed or replaced while the daemon ran", "pin_dir", k.pinDir)
		return err
	}
	err := k.lim.Close()
	if !detach {
		k.log.Info("bpf programs left pinned and enforcing", "pin_dir", k.pinDir)
		return err
	}
	err = errors.Join(err, loader.Cleanup(k.pinDir))
	k.log.Info("bpf programs detached and unpinned", "pin_dir", k.pinDir)
	return err
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}

type kernelCounts struct{ admitted, refused, rateLimited uint64 }

// kernelBook keeps the connections pool's totals equal to the sums over its
// projects after the loader forgets an entry. An entry is deleted only after
// a minute without an ask, so its counts have stopped moving well before:
// the last counts seen of an entry that disappears are its final ones, and
// they go into forgotten. The book lives in the daemon; a restarted daemon
// starts it again from the entries it finds (the kernel keeps those).
type kernelBook struct {
	last      map[uint32]kernelCounts // project id -> counts last seen
	forgotten admin.Forgotten
}

// note records a snapshot's entries and moves those gone to forgotten.
func (k *kernelSide) note(s loader.Snapshot) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.book.note(s)
}

func (b *kernelBook) note(s loader.Snapshot) {
	now := make(map[uint32]bool, len(s.Projects))
	for _, p := range s.Projects {
		now[p.ID] = true
		b.last[p.ID] = kernelCounts{p.Admitted, p.Refused, p.RateLimitedOut + p.RateLimitedIn}
	}
	for id, c := range b.last {
		if !now[id] {
			b.forgotten.Projects++
			b.forgotten.Admitted += c.admitted
			b.forgotten.Refused += c.refused
			b.forgotten.RateLimited += c.rateLimited
			delete(b.last, id)
		}
	}
}

// KernelPool is the connections pool as status shows it, from one read of
// the maps: InUse is the sum of what the projects hold in that read, and the
// totals the sums of their counts plus forgotten's, so the rows add up;
// Active is the programs' own count (kernelActive) and Share the share it
// gives, the pair the kernel enforces.
//
// forgotten is what the daemon saw of the entries the loader forgot. A
// daemon that started after some were forgotten (or status reading the
// pins with no daemon) never saw them; the node-wide counters, which the
// programs keep pinned and which count every admission and refusal, say
// how much the entries in the read leave unexplained, and forgotten is
// raised to that. So the pool's totals are never below the kernel's own
// counters, and never go down across a daemon restart. (Under churn the
// node counters are read just before the entries and may be a connection
// behind them, which the raise ignores; they are never used to lower.)
func KernelPool(s loader.Snapshot, kernelActive int, forgotten admin.Forgotten) admin.Pool {
	var adm, ref, lim uint64
	for _, pc := range s.Projects {
		adm += pc.Admitted
		ref += pc.Refused
		lim += pc.RateLimitedOut + pc.RateLimitedIn
	}
	if s.Admitted > adm {
		forgotten.Admitted = max(forgotten.Admitted, s.Admitted-adm)
	}
	if s.Refused > ref {
		forgotten.Refused = max(forgotten.Refused, s.Refused-ref)
	}
	// Refusals by rate of a bucket without a project entry (none while
	// the project held nothing yet) are in the node's count only.
	if n := s.Events.RateLimitedOut + s.Events.RateLimitedIn; n > lim {
		forgotten.RateLimited = max(forgotten.RateLimited, n-lim)
	}
	p := admin.Pool{Name: config.PoolConnections, Enforcer: "kernel", Size: s.Size, Floor: s.Floor,
		Active: kernelActive, Share: pools.Share(s.Size, s.Floor, kernelActive),
		Projects: []admin.Project{}, Forgotten: forgotten}
	if len(s.Exempt.Paths) > 0 || len(s.Exempt.Missing) > 0 || s.Exempt.InUse > 0 || s.Exempt.Admitted > 0 {
		p.Exempt = &admin.Exempt{Members: s.Exempt.Paths, Missing: s.Exempt.Missing, Max: s.Exempt.Max, InUse: s.Exempt.InUse,
			Admitted: s.Exempt.Admitted, OverBudget: s.Exempt.OverBudget}
	}
	e := s.Events
	p.KernelEvents = &admin.KernelEvents{Adopted: e.Adopted, Late: e.Late, Unaccounted: e.Unaccounted,
		Expired: e.Expired, MapFull: e.MapFull}
	if lp := s.Lapse; !lp.Never {
		p.Lapse = &admin.Lapse{After: lp.After.Seconds(), HeartbeatAge: lp.Age.Seconds(), Lapsed: lp.Lapsed, Admitted: lp.Admitted,
			FleetAfter: lp.FleetAfter.Seconds(), FleetSafe: lp.FleetSafe}
	}
	p.Admitted, p.Refused, p.RateLimited = forgotten.Admitted, forgotten.Refused, forgotten.RateLimited
	for _, pc := range s.Projects {
		name := pc.Project
		if name == "" {
			name = fmt.Sprintf("#%d", pc.ID) // no name: a bug of the kernel side
		}
		lim := pc.RateLimitedOut + pc.RateLimitedIn
		p.Projects = append(p.Projects, admin.Project{Project: name, Held: pc.InUse,
			Admitted: pc.Admitted, Refused: pc.Refused, Active: pc.Active, LastSeen: pc.LastSeen,
			RateLimited: lim, ConnectionsPerSec: pc.ConnectionsPerSec, RateTokens: pc.RateTokens,
			AcceptsPerSec: pc.AcceptsPerSec, AcceptTokens: pc.AcceptTokens})
		p.InUse += pc.InUse
		p.Admitted += pc.Admitted
		p.Refused += pc.Refused
		p.RateLimited += lim
	}
	return p
}

// memberKernel is what the membership (projects) needs of the kernel side:
// the loader's SetMembers, AttachNetns and DetachGone (design17).
type memberKernel interface {
	// Members are the kernel's members now: after a restart, the members
	// in force, which win conflicts over newcomers.
	Members() ([]membership.Member, error)
	SetMembers(ms []membership.Member) (membersReport, error)
	// AttachNetns attaches in the namespace ns, which nsPath opened, or
	// opens while its process lives (how reconcile enters it later).
	AttachNetns(ns *os.File, nsPath string) (netnsInfo, error)
	DetachGone() ([]netnsInfo, error)
	// Settle counts at once what members and namespaces new to the kernel
	// have already: their listeners, which the programs count only from
	// the TCP_LISTEN they see (one listening before its cgroup was a
	// member, or in a namespace not attached yet, admits every SYN until
	// counted), and their connections: the walk of a reconcile pass, made
	// now rather than at the next period and only over the namespaces
	// given (the host's if host, the attached ones of cookies netns),
	// without its comparison.
	Settle(ctx context.Context, host bool, netns []uint64) error
}

// errNetnsFull is AttachNetns's error at the attach cap
// (connections.max_netns).
var errNetnsFull = loader.ErrNetnsFull

// membersReport is the loader's MembersReport.
type membersReport struct {
	Added, Removed, Kept int
	Changed              []string             // the cgroups written or removed (loader's)
	Refused              []membership.Refusal // Source empty: the kernel side's
}

// netnsInfo is the loader's NetnsInfo.
type netnsInfo struct {
	Cookie, Inode uint64
	Path          string
}

// members is the kernel side as the membership's memberKernel.
func (k *kernelSide) members() memberKernel { return kernelMembers{k.lim, k} }

// kernelMembers is the loader's membership API as memberKernel.
type kernelMembers struct {
	lim *loader.Limiter
	k   *kernelSide
}

func (m kernelMembers) Settle(ctx context.Context, host bool, netns []uint64) error {
	return m.k.settle(ctx, host, netns)
}

// settle has the loader count at once what new members and namespaces have
// already (loader.Settle): their listeners, their open connections. What
// it adopted and moved is published as a pass's is and added to the
// passes' totals; the record of the last pass (its time, its counts of
// sockets and permits) stays the pass's.
func (k *kernelSide) settle(ctx context.Context, host bool, netns []uint64) error {
	rep, err := k.lim.Settle(ctx, host, netns)
	if err != nil && ctx.Err() != nil {
		return err // shutting down: the walk is left to the next start's pass
	}
	k.mu.Lock()
	if err != nil {
		if k.settleErr != err.Error() {
			k.log.Error("the listeners and connections of new members or namespaces were not counted at once; "+
				"tried again at every apply until it works, and the next reconcile pass counts them", "err", err)
		}
		k.settleErr = err.Error()
		k.mu.Unlock()
		return err
	}
	if k.settleErr != "" {
		k.log.Info("the listeners and connections of new members or namespaces are counted at once again")
		k.settleErr = ""
	}
	for cookie, why := range rep.NetnsSkipped {
		// Most often its last process has just ended.
		k.log.Info("a network namespace was not walked for the members' change: its listeners are counted at the next reconcile pass",
			"netns_cookie", cookie, "reason", why)
	}
	k.rec.RepairsTotal += uint64(rep.Adopted)
	k.addFound(rep)
	k.mu.Unlock()
	k.publishRepairs(rep)
	return nil
}

func (m kernelMembers) Members() ([]membership.Member, error) { return m.lim.Members() }

func (m kernelMembers) SetMembers(ms []membership.Member) (membersReport, error) {
	rep, err := m.lim.SetMembers(ms)
	out := membersReport{Added: rep.Added, Removed: rep.Removed, Kept: rep.Kept, Changed: rep.Changed}
	for _, r := range rep.Refused {
		out.Refused = append(out.Refused, membership.Refusal{Entry: membership.Entry{Member: r.Member}, Reason: r.Reason})
	}
	return out, err
}

func (m kernelMembers) AttachNetns(ns *os.File, nsPath string) (netnsInfo, error) {
	i, err := m.lim.AttachNetnsFile(ns, nsPath)
	return netnsInfo(i), err
}

func (m kernelMembers) DetachGone() ([]netnsInfo, error) {
	gone, err := m.lim.DetachGone()
	out := make([]netnsInfo, len(gone))
	for i, g := range gone {
		out[i] = netnsInfo(g)
	}
	return out, err
}
