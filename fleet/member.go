// SPDX-License-Identifier: Apache-2.0

package fleet

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/fairshare-dev/fairshare/internal/clock"
	"github.com/fairshare-dev/fairshare/pools"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Target is the local pool a fleet pool drives: the one call a node pool
// (a user-space pool, the kernel's connections pool, a destination pool)
// needs to follow its allotment.
type Target interface {
	// SetSize sets the pool's local POOL (0: admit nobody). Permits held
	// past it stay held; the pool refuses until under.
	SetSize(size int) error
}

// Capper is a Target that also takes per-project caps (see the package
// doc, Locally). A Target without it gets the allotment only.
type Capper interface {
	// SetCaps replaces the per-project caps; others is the cap of the
	// projects caps does not name (the newcomers: the node's spare).
	SetCaps(caps map[string]int, others int) error
}

// Safer is a Target that enforces on its own while the daemon is away (the
// kernel's pools, which stay pinned and enforcing): it takes the safe slice
// to fall to once this node's lease has ended with nobody to renew it
// (leaseEnd: when it ends as last renewed, zero before the first), since
// the others may stop counting the node from then on. The Member gives it
// each change of the safe slice and each renewal of the lease, and at a
// stop holds the pool to its safe slice, without caps, before it revokes
// the lease (see Run).
type Safer interface {
	SetSafe(safe int, leaseEnd time.Time) error
}

// Usage is one project's state in the local pool, as the Source reads it.
type Usage struct {
	Held int
	// Refused is the pool's running count of the project's refusals; the
	// Member publishes its growth since the previous publication.
	Refused uint64
	Active  bool
}

// Source reads the local pool's projects, once a publication period.
type Source interface {
	Usage() (map[string]Usage, error)
}

// Defaults of Config.
const (
	DefaultPeriod   = time.Second
	DefaultLeaseTTL = 5 * time.Second
	// DefaultDepartedTTL is Config.DepartedTTL for 0: how long a departed
	// node's holdings stay counted when its kernel enforces without a
	// daemon for ever (connections.lapse_after: 0).
	DefaultDepartedTTL = time.Hour
)

// Config configures a Member.
type Config struct {
	Client *clientv3.Client
	// Prefix is the fleet's key prefix ("/fairshare"); Pool the pool's
	// name; Node this node's name. The node publishes under
	// Prefix/Pool/nodes/Node.
	Prefix, Pool, Node string
	// Size and Floor are the fleet's S and F (Floor 0: the default).
	Size, Floor int
	// SafeFraction is the part of Size a node falls to by the end of a
	// lease it could not renew (and holds while cut off from etcd); 0
	// means one over the number of nodes it last saw.
	SafeFraction float64
	// Period is the publication period (DefaultPeriod): at most one write
	// per Period. A project's refusals count in its want for one Period
	// (Demand.Refused), so a Period shorter than a client's pause between
	// retries would keep a refused project from ever growing.
	Period time.Duration
	// LeaseTTL is the lease of the node's key (DefaultLeaseTTL): a node
	// silent that long drops out of the others' computation, and a node that
	// reached no etcd member that long counts itself cut off.
	LeaseTTL time.Duration
	Target   Target
	Source   Source
	Log      *slog.Logger
	Clock    clock.Clock
	// OnState, if set, is called on each change of State (connected, cut
	// off, back), outside the Member's lock.
	OnState func(Status)
	// LastSafe, when HasLastSafe, is the safe slice a previous run of this
	// node left where it outlives the daemon (a kernel pool's pins hold
	// the one the programs fall to). Before its first view of the fleet,
	// with no SafeFraction, the node's safe slice is at most it: the node
	// remembers nothing else of the number of nodes, and the floor alone
	// would raise a pool held to size/nodes (a rolling restart while etcd
	// is down would take a fleet of 200 nodes to 10 times its size).
	LastSafe    int
	HasLastSafe bool
	// DepartedTTL is how long a departed node's holdings stay counted
	// (DefaultDepartedTTL for 0): the time its pool goes on enforcing, and
	// its permits stay held, without a daemon (the kernel's
	// connections.lapse_after). Only a pool that does (a Safer: the
	// kernel's pools) writes and counts departure records of its own
	// accord; every Member counts the records it reads. See departed.go.
	DepartedTTL time.Duration
}

// States of a Member.
const (
	// StateWaiting: started, no answer from etcd yet; the pool has its
	// safe slice.
	StateWaiting = "waiting for etcd"
	// StateConnected: the allotment follows the fleet.
	StateConnected = "connected"
	// StateCutOff: no etcd member answered for a lease period; the
	// allotment is at most the safe slice (see Member.leaseBoundLocked).
	StateCutOff = "cut off from etcd: holding the safe slice"
	// StateStale: the view of the fleet does not show this node's own
	// publication of more than two periods ago (a watch that stalled or
	// ended while its read fails, an etcd restored from a snapshot that
	// stays silent), though etcd takes its puts and renewals: the others
	// divide the fleet by what it published since, so its plan may give it
	// a part they have shared out. It holds at most its safe slice, with
	// no caps, and reads the view again, until the view shows it.
	StateStale = "the view of the fleet lags this node's publications: holding the safe slice"
	// StateConflict: another daemon publishes under this node's name (its
	// key was written after this Member's last publication, under a lease
	// it was never granted); this one holds its safe slice, counting
	// itself apart, and publishes nothing until that key is gone.
	StateConflict = "another daemon publishes under this node's name: holding the safe slice (give each node its own fleet.node)"
)

// Status is a Member's view, for status and metrics.
type Status struct {
	Pool, Node, State string
	// Size, Floor, Active and Share are the fleet's (see Plan).
	Size, Floor, Active, Share int
	// Allotment is this node's POOL as applied (bounded by its lease);
	// Spare its part nobody was allocated; Safe the safe slice.
	Allotment, Spare, Safe int
	// Nodes is the number of live nodes in the last view; Departed what
	// the departed nodes are counted as holding (Plan.Departed).
	Nodes, Departed int
	// Since is when State last changed.
	Since time.Time
	// Writes counts this node's publications (etcd puts).
	Writes uint64
	// Projects is each project's fleet view, by name.
	Projects map[string]ProjectStatus
}

// ProjectStatus is one project's line in Status.
type ProjectStatus struct {
	// Alloc is its fleet allocation (a(p)); FleetHeld what it holds on the
	// fleet as published; Cap its cap on this node (-1: none); Held what
	// it holds here now.
	Alloc, FleetHeld, Cap, Held int
	Nodes                       int
}

// Member is one node's part in one fleet pool: it publishes the pool's
// demand, watches the others', and sets the local pool from the plan.
type Member struct {
	cfg Config
	key string
	dir string // Prefix/Pool/nodes/
	// base is Prefix/Pool/, which the Member reads and watches: the
	// nodes' keys (dir) and the departed nodes' records (ddir, dkey this
	// node's).
	base, ddir, dkey string

	mu sync.Mutex // guards the fields below
	// view is each live node's last publication, by node name.
	view map[string]Node
	// departed is each departed node's record in the view (what it is
	// counted as holding), by node name; gone the departures this Member
	// saw that have no record in the view yet (see departed.go); cleared
	// is the lease under whose publication this node deleted its own
	// record.
	departed  map[string]int
	gone      map[string]*goneNode
	cleared   clientv3.LeaseID
	pubAt     time.Time // when the last publication was put
	putErr    string    // the last publication's error, logged once; "" after a success
	plan      Plan
	applied   Allotment // what SetSize/SetCaps last got
	haveApply bool
	safeSent  int       // what Safer.SetSafe last took; -1: nothing yet, or a failed call
	endSent   time.Time // and the lease's end it took
	safeErr   string    // its last error, logged once; "" after a success
	state     string
	since     time.Time
	lastOK    time.Time // last answer from etcd
	lastRenew time.Time // last lease grant or renewal
	lastSeen  int       // nodes in the last view, for the default safe slice
	usage     map[string]Usage
	writes    uint64
	refused   map[string]uint64 // running refusal counts at the last publication
	// baselined: the Source was read once. A kernel pool's refusal
	// counts outlive the daemon (pinned): the first reading is the base
	// the next publications count from, not refusals of the last period.
	baselined bool
	published []byte
	// size and floor are the fleet's S and F as divided: the smallest size
	// any node of the view publishes (this node's own included) and the
	// largest floor among them, so that every node divides the same S in
	// a rolling resize; mismatch is the last such difference logged.
	size, floor int
	mismatch    string
	// ours are the leases this Member was granted lately (the current one
	// and the few before), to tell its own key, left by an expired lease
	// of its own, from another daemon's under the same name.
	ours     []clientv3.LeaseID
	getErr   string // the last read's error, logged once; "" after a success
	leaseErr string // the last lease call's error, logged once; "" after a success
	// computeTook is how long the last computation took (the watch's
	// coalescing gap follows it).
	computeTook time.Duration
	lease       clientv3.LeaseID
	pubLease    clientv3.LeaseID // the lease of the last publication
	pubRev      int64            // and the etcd revision it made
	// unseen are this node's puts the view does not show yet (their
	// revisions and when they were answered), oldest first; the view is
	// stale once the oldest is two periods old (see stepLocked).
	unseen []putMark
	// history counts the times etcd's revisions went back (a put answered
	// with a revision at most the previous put's: etcd restored from a
	// snapshot, another cluster): a view read before tells nothing of the
	// puts since. viewHistory is the history the view was read in.
	history, viewHistory int
	// reget asks watchLoop to drop its watch and read the view again: the
	// view is stale, and its watch may never bring what it lacks.
	reget chan struct{}

	// shared, when set before Run, replaces the node's own read and watch
	// of the fleet's keys and most of its computation: the views come
	// from a feed shared by the in-process nodes of TestFleetSimulation
	// (simFeed in sim_test.go), which watches etcd once for all of them
	// and computes each view's fleet-wide part once (the part every node
	// with that view computes alike); the node still splits its own
	// allotment, publishes under its own lease and applies. Only that
	// test sets it: a real node always watches and computes itself.
	shared <-chan *sharedView
}

// putMark is one put of this node's publication: the revision etcd
// answered and when.
type putMark struct {
	rev int64
	at  time.Time
}

// maxUnseen bounds Member.unseen: past it the oldest puts are forgotten
// (those left are as old, and keep the view stale as long).
const maxUnseen = 16

// staleAfter is how many periods a put may be missing from the view before
// the view counts as stale: a watch event comes in a moment, and the watch
// coalesces for at most a period.
const staleAfter = 2

// sharedView is one view of the fleet shared read-only among in-process
// Members (see Member.shared): the publications by node name, the
// fleet-wide part of the computation on them, and how long it took.
type sharedView struct {
	view  map[string]Node
	fleet *fleetAlloc
	took  time.Duration
}

// New validates cfg and returns a Member; Run starts it.
func New(cfg Config) (*Member, error) {
	if cfg.Client == nil || cfg.Target == nil || cfg.Source == nil {
		return nil, errors.New("fleet: client, target and source are required")
	}
	if cfg.Size <= 0 {
		return nil, fmt.Errorf("fleet pool %s: size %d must be > 0", cfg.Pool, cfg.Size)
	}
	if cfg.Node == "" || strings.Contains(cfg.Node, "/") || cfg.Pool == "" || strings.Contains(cfg.Pool, "/") {
		return nil, fmt.Errorf("fleet pool %q node %q: names must be non-empty and have no '/'", cfg.Pool, cfg.Node)
	}
	if cfg.SafeFraction < 0 || cfg.SafeFraction > 1 {
		return nil, fmt.Errorf("fleet pool %s: safe_fraction %v not in [0, 1]", cfg.Pool, cfg.SafeFraction)
	}
	if cfg.LeaseTTL <= 0 {
		cfg.LeaseTTL = DefaultLeaseTTL
	}
	if cfg.Period <= 0 {
		cfg.Period = DefaultPeriod
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	cfg.Clock = clock.Or(cfg.Clock)
	if cfg.DepartedTTL <= 0 {
		cfg.DepartedTTL = DefaultDepartedTTL
	}
	cfg.Floor = pools.EffectiveFloor(cfg.Size, cfg.Floor)
	base := strings.TrimSuffix(cfg.Prefix, "/") + "/" + cfg.Pool + "/"
	dir := base + "nodes/"
	m := &Member{cfg: cfg, dir: dir, key: dir + cfg.Node, base: base, ddir: base + "departed/",
		dkey: base + "departed/" + cfg.Node, view: map[string]Node{}, departed: map[string]int{},
		gone: map[string]*goneNode{}, refused: map[string]uint64{},
		state: StateWaiting, since: cfg.Clock.Now(), safeSent: -1, size: cfg.Size, floor: cfg.Floor,
		reget: make(chan struct{}, 1)}
	return m, nil
}

// safeWithSelfLocked is the safe slice counting this node among the nodes
// last seen when the view lacks it (its key gone for a moment): the view's
// count alone made it Size/(n-1), at two nodes the whole size.
func (m *Member) safeWithSelfLocked() int {
	n := m.lastSeen
	if _, mine := m.view[m.cfg.Node]; !mine && n > 0 {
		n++
	}
	return m.safeAmong(n)
}

// safeLocked is the safe slice: Size·SafeFraction, or Size over the nodes
// last seen; before any view, with no SafeFraction, the fleet's floor, or
// the last run's safe slice if lower (Config.LastSafe).
func (m *Member) safeLocked() int { return m.safeAmong(m.lastSeen) }

// safeAmong is the safe slice among n nodes (0: none seen yet), of the
// size the fleet divides.
func (m *Member) safeAmong(n int) int {
	switch {
	case m.cfg.SafeFraction > 0:
		return int(float64(m.size) * m.cfg.SafeFraction)
	case n > 0:
		return m.size / n
	case m.cfg.HasLastSafe:
		return max(min(m.floor, m.size, m.cfg.LastSafe), 0)
	default:
		return min(m.floor, m.size)
	}
}

// Run publishes, watches and applies until ctx ends; then it revokes the
// lease (best effort), so the others take this node's allotment back at
// once rather than after the lease. A pool that goes on enforcing without
// the daemon (Safer) is first held to its safe slice without caps, as if
// cut off: the others divide the whole fleet from the revocation on, and
// the margin is a partition's. If that fails the lease is left to expire,
// by which time the pool has fallen to the safe slice it was given.
func (m *Member) Run(ctx context.Context) error {
	m.mu.Lock()
	m.applyLocked(Allotment{Size: m.safeLocked()})
	m.sendSafeLocked()
	m.mu.Unlock()

	var wg sync.WaitGroup
	wg.Add(1)
	if m.shared != nil {
		go func() { defer wg.Done(); m.sharedLoop(ctx) }()
	} else {
		go func() { defer wg.Done(); m.watchLoop(ctx) }()
	}
	t := time.NewTicker(m.cfg.Period)
	defer t.Stop()
	for {
		m.tick(ctx)
		select {
		case <-ctx.Done():
			wg.Wait()
			m.mu.Lock()
			lease := m.lease
			held := m.stopLocked()
			m.mu.Unlock()
			if lease != 0 && m.departs() {
				// Before the revocation: the others count what this
				// node holds from the moment its key is gone.
				m.writeOwnRecord()
			}
			if lease != 0 && held {
				rctx, cancel := context.WithTimeout(context.Background(), time.Second)
				_, _ = m.cfg.Client.Revoke(rctx, lease)
				cancel()
			}
			return nil
		case <-t.C:
		}
	}
}

// stopLocked holds a Safer's pool to its safe slice, without caps, for
// the time the daemon is away, and reports whether it is held there (a
// Target without Safer stops with the daemon: true).
func (m *Member) stopLocked() bool {
	if _, ok := m.cfg.Target.(Safer); !ok {
		return true
	}
	safe := m.safeLocked()
	size := safe
	if m.haveApply {
		size = min(size, m.applied.Size)
	}
	// Written whatever was applied before: an empty caps map with no
	// spare (every project not named capped at 0) counts as equal to none.
	m.haveApply = false
	m.applyLocked(Allotment{Size: size})
	if !m.haveApply || m.applied.Size > safe || len(m.applied.Caps) != 0 {
		m.cfg.Log.Error("fleet: the pool could not be held to its safe slice at the stop; the lease is left to expire",
			"pool", m.cfg.Pool, "allotment", m.applied.Size, "safe", safe)
		return false
	}
	m.cfg.Log.Info("fleet: stopping; the pool is held to its safe slice until the daemon is back", "pool", m.cfg.Pool,
		"safe", safe)
	return true
}

// sendSafeLocked gives a Safer the safe slice when it changed (or the last
// call failed).
func (m *Member) sendSafeLocked() {
	s, ok := m.cfg.Target.(Safer)
	if !ok {
		return
	}
	safe := m.safeLocked()
	var end time.Time
	if !m.lastRenew.IsZero() {
		end = m.lastRenew.Add(m.cfg.LeaseTTL)
	}
	if safe == m.safeSent && end.Equal(m.endSent) {
		return
	}
	if err := s.SetSafe(safe, end); err != nil {
		// Once per cause, tried again every period.
		if e := err.Error(); e != m.safeErr {
			m.cfg.Log.Error("fleet: setting the safe slice the pool falls to without the daemon; trying again every period",
				"pool", m.cfg.Pool, "safe", safe, "err", err)
			m.safeErr = e
		}
		m.safeSent = -1
		return
	}
	m.safeSent, m.endSent, m.safeErr = safe, end, ""
}

// callTimeout bounds each etcd call: the period, but at least a second
// (a short period must still leave time to read a large fleet's keys) and
// at most a third of the lease (a failed renewal leaves time for another
// before it expires).
func (m *Member) callTimeout() time.Duration {
	return min(max(m.cfg.Period, time.Second), m.cfg.LeaseTTL/3)
}

// tick runs once a period: read the pool, keep the lease, publish what
// changed, and decay when cut off.
func (m *Member) tick(ctx context.Context) {
	usage, err := m.cfg.Source.Usage()
	if err != nil {
		m.cfg.Log.Warn("fleet: reading the local pool", "pool", m.cfg.Pool, "err", err)
	}
	m.mu.Lock()
	if err == nil {
		m.usage = usage
		if !m.baselined {
			for p, u := range usage {
				m.refused[p] = u.Refused
			}
			m.baselined = true
		}
	}
	node := Node{Name: m.cfg.Node, Size: m.cfg.Size, Floor: m.cfg.Floor, Projects: map[string]Demand{}}
	next := map[string]uint64{}
	for p, u := range m.usage {
		d := Demand{Held: u.Held, Active: u.Active}
		// Refusals since the last publication; all of them for a project
		// new since (or whose count restarted, forgotten and back).
		if last, ok := m.refused[p]; ok && u.Refused >= last {
			d.Refused = u.Refused - last
		} else {
			d.Refused = u.Refused
		}
		next[p] = u.Refused
		if d.Held > 0 || d.Active || d.Refused > 0 {
			node.Projects[p] = d
		}
	}
	body, _ := json.Marshal(node)
	lease := m.lease
	// Published again when the view lacks this node's key though it was
	// published (deleted by hand, or gone with a lease etcd dropped before
	// the renewal noticed): else nothing changed and it stayed away.
	// (A period after the put: the watch brings it back a moment after.)
	mine, seen := m.view[m.cfg.Node]
	lost := m.published != nil && !seen && m.cfg.Clock.Now().Sub(m.pubAt) >= m.cfg.Period
	changed := !bytes.Equal(body, m.published) || lost
	// Another daemon's key under this node's name: not written over
	// (each would take the key from the other at every change); once it
	// is gone (lost), this node publishes again. Its refusals meanwhile
	// are not kept for a burst of demand then. A key written by hand
	// (under no lease) is written over.
	foreign := m.foreignLocked(mine, seen)
	if foreign {
		m.refused = next
	}
	changed = changed || seen && mine.lease == 0 && mine.rev > m.pubRev
	m.mu.Unlock()

	ok := m.keepLease(ctx, &lease)
	m.mu.Lock()
	m.lease = lease
	changed = changed || lease != m.pubLease
	// The renewal's new end to the kernel now, not after the publication
	// (a slow put would leave the kernel's old end to pass meanwhile).
	m.sendSafeLocked()
	m.mu.Unlock()
	if ok && changed && !foreign {
		pctx, cancel := context.WithTimeout(ctx, m.callTimeout())
		resp, err := m.cfg.Client.Put(pctx, m.key, string(body), clientv3.WithLease(lease))
		cancel()
		if err == nil {
			m.mu.Lock()
			m.published, m.refused, m.writes = body, next, m.writes+1
			m.putDoneLocked(lease, resp.Header.Revision)
			if m.putErr != "" {
				m.cfg.Log.Info("fleet: publishing again", "pool", m.cfg.Pool)
				m.putErr = ""
			}
			m.mu.Unlock()
		} else {
			ok = false
			// A warning, once per cause: etcd that renews leases but
			// takes no write (its space quota full: etcd's NOSPACE alarm,
			// with no compaction) keeps every node connected to a view
			// that no longer moves.
			if e := err.Error(); e != m.putErr {
				if errors.Is(err, rpctypes.ErrLeaseNotFound) {
					m.cfg.Log.Warn("fleet: this node's lease ended before its publication; it is out of the fleet until it publishes under a new one",
						"pool", m.cfg.Pool)
				} else {
					m.cfg.Log.Warn("fleet: publishing this node's demand failed; the fleet divides by what it last published",
						"pool", m.cfg.Pool, "err", err)
				}
				m.putErr = e
			}
		}
	}
	if ok {
		m.tickDepartures(ctx)
	}
	m.mu.Lock()
	st := m.stepLocked()
	m.sendSafeLocked()
	m.mu.Unlock()
	if st != nil && m.cfg.OnState != nil {
		m.cfg.OnState(*st)
	}
}

// putDoneLocked records a put of this node's publication under lease,
// answered with etcd's revision rev: an answer of etcd, and a put the view
// must show within staleAfter periods. A revision at most the previous
// put's is another history of etcd's (restored from a snapshot without
// --bump-revision, say): the revisions of the view, read before, cannot
// tell whether it shows the puts since, so none counts as shown until
// the view is read again.
func (m *Member) putDoneLocked(lease clientv3.LeaseID, rev int64) {
	now := m.cfg.Clock.Now()
	if m.pubRev > 0 && rev <= m.pubRev {
		m.cfg.Log.Warn("fleet: etcd's revisions went back (restored from a snapshot?); this node holds at most its safe slice until it reads the fleet again",
			"pool", m.cfg.Pool, "revision", rev, "previous", m.pubRev)
		m.history++
		m.unseen = m.unseen[:0]
		m.pubRev = rev
	}
	m.pubLease, m.pubRev, m.lastOK, m.pubAt = lease, max(m.pubRev, rev), now, now
	if len(m.unseen) == maxUnseen {
		m.unseen = append(m.unseen[:0], m.unseen[1:]...)
	}
	m.unseen = append(m.unseen, putMark{rev: rev, at: now})
}

// staleLocked forgets the puts the view shows (mine, this node's key in
// it; seen: it holds one) and says whether one it does not show is more
// than staleAfter periods old.
func (m *Member) staleLocked(now time.Time, mine Node, seen bool) bool {
	if seen && m.viewHistory == m.history {
		n := 0
		for n < len(m.unseen) && m.unseen[n].rev <= mine.rev {
			n++
		}
		m.unseen = append(m.unseen[:0], m.unseen[n:]...)
	}
	return len(m.unseen) > 0 && now.Sub(m.unseen[0].at) > staleAfter*m.cfg.Period
}

// keepLease renews the node's lease (granting one when it has none or etcd
// forgot it), about three times a lease period. It reports whether etcd
// answered. *lease changes when a new lease was granted: the caller then
// publishes again under it.
func (m *Member) keepLease(ctx context.Context, lease *clientv3.LeaseID) bool {
	m.mu.Lock()
	due := *lease == 0 || m.cfg.Clock.Now().Sub(m.lastRenew) >= m.cfg.LeaseTTL/3
	m.mu.Unlock()
	if !due {
		return true
	}
	cctx, cancel := context.WithTimeout(ctx, m.callTimeout())
	defer cancel()
	// The lease runs from when etcd took the call, after it was sent.
	sent := m.cfg.Clock.Now()
	if *lease != 0 {
		_, err := m.cfg.Client.KeepAliveOnce(cctx, *lease)
		if err == nil {
			m.renewed(sent)
			return true
		}
		if !errors.Is(err, rpctypes.ErrLeaseNotFound) {
			m.leaseFailed("renewing this node's lease", err)
			return false
		}
		m.cfg.Log.Warn("fleet: the lease expired; this node dropped out of the fleet until it publishes again", "pool", m.cfg.Pool)
	}
	g, err := m.cfg.Client.Grant(cctx, int64((m.cfg.LeaseTTL+time.Second-1)/time.Second))
	if err != nil {
		m.leaseFailed("granting this node a lease", err)
		return false
	}
	*lease = g.ID
	m.mu.Lock()
	if !m.oursLocked(int64(g.ID)) {
		m.ours = append(m.ours, g.ID)
		if len(m.ours) > 4 {
			m.ours = m.ours[1:]
		}
	}
	m.mu.Unlock()
	m.renewed(sent)
	return true
}

// leaseFailed logs a failed lease call, once per cause: a wrong endpoint,
// CA or certificate fails every call the same way, and the node stays at
// its safe slice meanwhile.
func (m *Member) leaseFailed(what string, err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if e := err.Error(); e != m.leaseErr {
		m.cfg.Log.Warn("fleet: "+what+" failed; the pool holds at most its safe slice once the lease runs out; trying again every period",
			"pool", m.cfg.Pool, "err", err)
		m.leaseErr = e
	}
}

// oursLocked says whether lease is one this Member was granted lately.
func (m *Member) oursLocked(lease int64) bool {
	return slices.Contains(m.ours, clientv3.LeaseID(lease))
}

// foreignLocked says whether mine, this node's key as the view holds it
// (seen: it does), is another daemon's: written after this node's last
// publication (a view that lags behind it shows an older key of this
// node's, a previous run's too), under a lease this node was never
// granted (its own lease's put whose answer was lost is its own), and
// under a lease at all (a daemon always writes under one).
func (m *Member) foreignLocked(mine Node, seen bool) bool {
	return seen && m.published != nil && mine.rev > m.pubRev && mine.lease != 0 && !m.oursLocked(mine.lease)
}

// renewed records an answer of etcd to the lease sent at sent: the renewal
// clock (from sent: the lease ends no sooner than a lease_ttl after it) and
// the last answer (only answers count: a tick that had nothing to ask
// proves nothing about etcd).
func (m *Member) renewed(sent time.Time) {
	m.mu.Lock()
	m.lastRenew = sent
	m.lastOK = m.cfg.Clock.Now()
	if m.leaseErr != "" {
		m.cfg.Log.Info("fleet: the lease is kept again", "pool", m.cfg.Pool)
		m.leaseErr = ""
	}
	m.mu.Unlock()
}

// stepLocked moves the state on (connected, cut off, stale, in conflict)
// and applies the allotment: the plan's while connected and the view holds
// this node's key as last published, at most the safe slice otherwise,
// all within the lease's bound (leaseBoundLocked). It returns the status
// when the state changed.
func (m *Member) stepLocked() *Status {
	now := m.cfg.Clock.Now()
	old := m.state
	cut := m.lastOK.IsZero() || now.Sub(m.lastOK) > m.cfg.LeaseTTL
	mine, seen := m.view[m.cfg.Node]
	// stale: the view lacks a put of this node's that etcd answered more
	// than staleAfter periods ago. etcd answers (puts, renewals), so the
	// node is not cut off, but its view stopped following the fleet: the
	// others compute from its publications since, and the plan of this
	// view may give it what they gave away. Read again (the watch may
	// never bring it: stalled, or waiting for a revision a restored etcd
	// has not reached).
	stale := m.staleLocked(now, mine, seen)
	if stale {
		select {
		case m.reget <- struct{}{}:
		default:
		}
	}
	// own: the view holds a publication of this node under its current
	// lease. After a new lease the view may still hold the key of the old
	// one (or of a previous run), and its plan the node's part from
	// before, which the others may have shared out since: not applied
	// until the view holds a publication under the new lease (a put whose
	// answer was lost counts once the view shows it).
	own := seen && m.lease != 0 && mine.lease == int64(m.lease)
	foreign := m.foreignLocked(mine, seen)
	switch {
	case cut:
		if m.state != StateWaiting {
			m.state = StateCutOff
		}
	case foreign:
		m.state = StateConflict
	case stale:
		m.state = StateStale
	case own:
		m.state = StateConnected
	case m.state == StateConflict:
		// The other daemon's key is gone: this node publishes again.
		m.state = StateWaiting
	}
	var a Allotment
	switch m.state {
	case StateConnected:
		// A plan without this node's publication (its key gone from the
		// view for a moment, or still the old lease's): the others divide
		// the fleet without it, so it holds what it applied but no more
		// than its safe slice (counting itself among the nodes), the
		// margin a partition allows, with its caps, until its key is back.
		if pa, ok := m.plan.Nodes[m.cfg.Node]; ok && own {
			a = pa
		} else {
			a = m.applied
			if safe := m.safeWithSelfLocked(); !m.haveApply || a.Size > safe {
				a = Allotment{Size: safe, Caps: a.Caps, Spare: min(a.Spare, safe)}
			}
		}
	case StateCutOff, StateConflict, StateStale:
		// No caps: they came from a view going stale (or another
		// daemon's), and a project new here would never get one. The
		// node's rule divides what is left; never up.
		a = Allotment{Size: m.applied.Size}
		if m.state == StateStale {
			// Cut off as good as: the others may have shared out
			// the part its plan gives it.
			a.Size = min(a.Size, m.safeWithSelfLocked())
		}
		if m.state == StateConflict {
			// The other daemon is the node in the view: this one is a
			// node more.
			a.Size = min(a.Size, m.safeAmong(max(m.lastSeen, 1)+1))
		}
	default:
		a = m.applied
	}
	m.applyLocked(m.leaseBoundLocked(now, a))
	if m.state == old {
		return nil
	}
	m.since = now
	m.cfg.Log.Warn("fleet: "+m.state, "pool", m.cfg.Pool, "node", m.cfg.Node, "allotment", m.applied.Size,
		"safe", m.safeLocked(), "nodes_last_seen", m.lastSeen)
	st := m.statusLocked()
	return &st
}

// leaseBoundLocked bounds a by the lease: the others stop counting this
// node when its lease ends (no sooner than a lease_ttl after the last
// renewal was sent) and share its part out, so by then it must be at its
// safe slice. Over the lease's last quarter the bound falls linearly from
// a's size to the safe slice, and stays there until a renewal. A renewal
// is sent at the first tick past a third of the lease, a period at most
// after it (a period is at most a quarter of the lease): a healthy node
// renews with a sixth of the lease to spare, less the renewal's round
// trip. Before the first lease there is nothing to bound: the node is at
// its safe slice.
func (m *Member) leaseBoundLocked(now time.Time, a Allotment) Allotment {
	if m.lastRenew.IsZero() {
		return a
	}
	safe := m.safeWithSelfLocked()
	if a.Size <= safe {
		return a
	}
	end := m.lastRenew.Add(m.cfg.LeaseTTL)
	fall := m.cfg.LeaseTTL / 4
	left := end.Sub(now)
	if left >= fall {
		return a
	}
	bound := safe
	if left > 0 {
		bound = safe + int(float64(a.Size-safe)*float64(left)/float64(fall))
	}
	if a.Size <= bound {
		return a
	}
	return Allotment{Size: bound, Caps: a.Caps, Spare: min(a.Spare, bound)}
}

// applyLocked sets the local pool when the allotment changed.
func (m *Member) applyLocked(a Allotment) {
	if m.haveApply && a.Size == m.applied.Size && a.Spare == m.applied.Spare && maps.Equal(a.Caps, m.applied.Caps) {
		return
	}
	if err := m.cfg.Target.SetSize(a.Size); err != nil {
		m.cfg.Log.Error("fleet: setting the local pool", "pool", m.cfg.Pool, "size", a.Size, "err", err)
		return
	}
	m.applied, m.haveApply = a, true
	if c, ok := m.cfg.Target.(Capper); ok {
		if err := c.SetCaps(a.Caps, a.Spare); err != nil {
			// Applied again at the next computation, changed or not: a
			// cap left unwritten (or half written) holds the project to
			// the node's rule alone until then.
			m.cfg.Log.Error("fleet: setting the caps; trying again at the next computation", "pool", m.cfg.Pool, "err", err)
			m.haveApply = false
		}
	}
}

// watchLoop keeps the view: a read of the pool's nodes, then a watch from
// the revision after it; it starts again when the watch ends (compaction,
// a lost member) or the view is stale (stepLocked asks on reget).
func (m *Member) watchLoop(ctx context.Context) {
	for ctx.Err() == nil {
		// A read asked for before this one is this one.
		select {
		case <-m.reget:
		default:
		}
		m.mu.Lock()
		history := m.history
		m.mu.Unlock()
		gctx, cancel := context.WithTimeout(ctx, m.callTimeout())
		resp, err := m.cfg.Client.Get(gctx, m.base, clientv3.WithPrefix())
		cancel()
		m.readDone(err)
		if err != nil {
			select {
			case <-ctx.Done():
				return
			case <-time.After(m.cfg.Period / 2):
			}
			continue
		}
		view, departed := map[string]Node{}, map[string]int{}
		for _, kv := range resp.Kvs {
			m.take(view, departed, kv, false)
		}
		m.setViewOf(view, departed, history)
		wctx, wcancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		var lastCompute time.Time
		wch := m.cfg.Client.Watch(wctx, m.base, clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1))
		for {
			var wr clientv3.WatchResponse
			ok := false
			select {
			case wr, ok = <-wch:
			case <-m.reget:
			}
			if !ok || wr.Err() != nil {
				break
			}
			m.mu.Lock()
			next, dnext := maps.Clone(m.view), maps.Clone(m.departed)
			m.mu.Unlock()
			apply := func(wr clientv3.WatchResponse) {
				for _, ev := range wr.Events {
					m.take(next, dnext, ev.Kv, ev.Type == clientv3.EventTypeDelete)
				}
			}
			apply(wr)
			// One computation for what arrives within a fifth of a period
			// of the last one: with many nodes publications come in a
			// stream, and a computation per event would cost each node
			// O(nodes) computations a second. Where a computation takes
			// longer than a fiftieth of a period (it costs O(demands):
			// 10 to 25 ms at 1,000 nodes and 10,000 projects), the gap is
			// ten computations long, so computing takes at most a tenth
			// of the node's time, up to a period.
			failed := false
			m.mu.Lock()
			took := m.computeTook
			m.mu.Unlock()
			every := min(m.cfg.Period, max(m.cfg.Period/5, 10*took))
			gap := time.NewTimer(time.Until(lastCompute.Add(every)))
		drain:
			for {
				select {
				case more, ok := <-wch:
					if !ok || more.Err() != nil {
						failed = true
						break drain
					}
					apply(more)
				case <-gap.C:
					break drain
				}
			}
			gap.Stop()
			m.setViewOf(next, dnext, history)
			lastCompute = time.Now()
			if failed {
				break
			}
		}
		wcancel()
	}
}

// sharedLoop is watchLoop for a Member fed shared views (see
// Member.shared): each view as it comes, this node's allotment split from
// its fleet-wide part.
func (m *Member) sharedLoop(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case v := <-m.shared:
			plan := v.fleet.forNode(m.cfg.Node)
			if size, floor := m.divided(v.view); v.fleet.size != size || plan.Floor != floor {
				// Another pool's view: compute from scratch.
				m.setView(v.view)
				continue
			}
			m.applyView(v.view, plan, v.took)
		}
	}
}

// decode reads one node's key: its publication and the lease it is under.
func (m *Member) decode(kv *mvccpb.KeyValue) (Node, bool) {
	name := strings.TrimPrefix(string(kv.Key), m.dir)
	var n Node
	if name == "" || strings.Contains(name, "/") || json.Unmarshal(kv.Value, &n) != nil {
		m.cfg.Log.Warn("fleet: ignoring a malformed key", "key", string(kv.Key))
		return n, false
	}
	n.Name, n.lease, n.rev = name, kv.Lease, kv.ModRevision
	return n, true
}

// readDone logs a failed read of the fleet's keys once per cause (and
// the first success after): a node that cannot read them divides by
// what it read last, or holds its safe slice before its first view.
func (m *Member) readDone(err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	switch {
	case err != nil && err.Error() != m.getErr:
		m.cfg.Log.Warn("fleet: reading the fleet's publications failed; trying again every half period",
			"pool", m.cfg.Pool, "prefix", m.dir, "err", err)
		m.getErr = err.Error()
	case err == nil && m.getErr != "":
		m.cfg.Log.Info("fleet: reading the fleet's publications again", "pool", m.cfg.Pool)
		m.getErr = ""
	}
}

// setView recomputes the plan from a new view (no departed node's record)
// and applies it.
func (m *Member) setView(view map[string]Node) { m.setViewOf(view, map[string]int{}, -1) }

// setViewOf is setView for a view read in etcd's history number history
// (Member.history when the read began; -1: the current one), with the
// departed nodes' records departed.
func (m *Member) setViewOf(view map[string]Node, departed map[string]int, history int) {
	nodes := make([]Node, 0, len(view))
	for _, n := range view {
		nodes = append(nodes, n)
	}
	size, floor := m.divided(view)
	m.mu.Lock()
	out := m.departuresLocked(view, departed, size)
	m.mu.Unlock()
	t0 := time.Now()
	plan := ComputeDeparted(size, floor, out, nodes, m.cfg.Node, false)
	m.applyViewOf(view, plan, time.Since(t0), history)
}

// divided is the size and floor the fleet divides in view: the smallest
// size published (this node's own among them) and the largest floor, at
// most that size. Nodes configured alike divide their own; in a rolling
// resize (or with a node's size mistyped) every node divides the smallest
// until all agree, and a node whose own differs says so once.
func (m *Member) divided(view map[string]Node) (size, floor int) {
	size, floor = m.cfg.Size, m.cfg.Floor
	var other string
	for _, n := range view {
		if n.Size <= 0 {
			continue // not published (an older release)
		}
		if n.Size != m.cfg.Size || (n.Floor > 0 && n.Floor != m.cfg.Floor) {
			other = n.Name
		}
		size = min(size, n.Size)
		floor = max(floor, n.Floor)
	}
	floor = min(floor, size)
	m.mu.Lock()
	defer m.mu.Unlock()
	if other == "" {
		m.mismatch = ""
		return size, floor
	}
	if d := strconv.Itoa(size) + "/" + strconv.Itoa(floor); d != m.mismatch {
		o := view[other]
		m.cfg.Log.Warn("fleet: nodes publish different sizes or floors for this pool; the fleet divides the smallest size and the largest floor until they agree",
			"pool", m.cfg.Pool, "size", m.cfg.Size, "floor", m.cfg.Floor, "node", other, "their_size", o.Size,
			"their_floor", o.Floor, "divided_size", size, "divided_floor", floor)
		m.mismatch = d
	}
	return size, floor
}

// applyView installs a view and its plan, and applies the allotment.
func (m *Member) applyView(view map[string]Node, plan Plan, took time.Duration) {
	m.applyViewOf(view, plan, took, -1)
}

// applyViewOf is applyView for a view read in etcd's history number
// history (-1: the current one).
func (m *Member) applyViewOf(view map[string]Node, plan Plan, took time.Duration, history int) {
	m.mu.Lock()
	if history < 0 {
		history = m.history
	}
	m.view, m.plan, m.computeTook, m.viewHistory = view, plan, took, history
	m.size, m.floor = plan.Size, plan.Floor
	if len(view) > 0 {
		m.lastSeen = len(view)
	}
	m.lastOK = m.cfg.Clock.Now()
	st := m.stepLocked()
	m.mu.Unlock()
	if st != nil && m.cfg.OnState != nil {
		m.cfg.OnState(*st)
	}
}

// Status returns the Member's view.
func (m *Member) Status() Status {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.statusLocked()
}

func (m *Member) statusLocked() Status {
	st := Status{Pool: m.cfg.Pool, Node: m.cfg.Node, State: m.state, Size: m.size, Floor: m.floor,
		Active: m.plan.Active, Share: m.plan.Share, Allotment: m.applied.Size, Spare: m.applied.Spare,
		Safe: m.safeLocked(), Nodes: len(m.view), Departed: m.plan.Departed, Since: m.since, Writes: m.writes, Projects: map[string]ProjectStatus{}}
	if st.Share == 0 {
		st.Share = m.size
	}
	for p, pp := range m.plan.Projects {
		c, ok := m.applied.Caps[p]
		if !ok {
			c = -1
		}
		st.Projects[p] = ProjectStatus{Alloc: pp.Alloc, FleetHeld: pp.Held, Cap: c, Nodes: pp.Nodes, Held: m.usage[p].Held}
	}
	for p, u := range m.usage {
		if _, ok := st.Projects[p]; !ok && (u.Held > 0 || u.Active) {
			st.Projects[p] = ProjectStatus{Cap: -1, Held: u.Held}
		}
	}
	return st
}
