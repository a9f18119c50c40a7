// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"math"
	"time"

	"github.com/fairshare-dev/fairshare/internal/clock"
)

// ledger is the state the rule needs, shared by Pool and Residents: the
// projects, the active set, the share and the release-rate estimates. It is
// not safe for concurrent use; its owner holds a mutex around every call, so
// every method here is "Locked" in spirit.
type ledger struct {
	name   string
	size   int
	floor  int
	window int64 // ns
	forget int64 // ns

	inUse int
	share int

	// clock reads the owner's clock as ledger time. Only the refusal of a
	// pool that has measured no release rate yet reads it (see
	// coldRate): the hot path never does.
	clock func() int64
	// coldSeq counts the refusals that asked coldRate; coldReleased is
	// released when coldRate last read the clock.
	coldSeq      uint32
	coldReleased uint64

	// now is the coarse clock: the latest time read by the owner (at
	// Recompute, at a blocking wait, at Snapshot). The hot path stamps
	// projects with it instead of reading the clock.
	now           int64
	lastRecompute int64
	// epoch counts recomputes. A project stamped in the current epoch asked
	// after the last recompute, so the recompute that closes the epoch knows
	// only an upper bound of when: its own time. Stamps are raised to that
	// bound, which makes "left the active set" never early (a stamp taken
	// from the coarse clock alone is a lower bound and would be).
	epoch uint32

	index    map[string]int32
	projects []project
	free     []int32 // recycled project slots
	active   []int32 // the active set, unordered
	idle     []idleEntry
	idleHead int

	released uint64  // releases since the last recompute
	relRate  float64 // pool releases per second, smoothed
	// measured: a recompute has measured relRate over a period with
	// permits held or released (0 included): the cold back-off is only
	// for a pool's first period, before it knows anything.
	measured bool

	// admitted and refused count every ask since the pool was built. They
	// are kept here, not summed over projects, because forgetting an idle
	// project drops its counts and the pool's totals must never go down.
	// wouldRefuse counts the asks admitted in dry-run that the rule refused
	// (they are in admitted too).
	admitted, refused, wouldRefuse uint64
	// dryRun admits every ask of the pool, counting what the rule refused;
	// dryProjects does so for the projects it names (see doc.go, Dry-run).
	dryRun      bool
	dryProjects map[string]bool
	// caps bounds what the projects it names may hold, in place of the
	// share (see doc.go, Caps); package fleet sets them.
	caps map[string]int
	// capOthers is the cap of the projects caps does not name, while caps
	// is set; -1: they keep the rule.
	capOthers int
	// forgotten sums the counts of the projects forgotten so far, so that
	// at every instant admitted (refused) is the sum over the projects
	// known plus forgotten's.
	forgotten ForgottenStat
}

// project is one project's bookkeeping. Slots are recycled when a project is
// forgotten; gen tells a stale idle entry from the current occupant.
type project struct {
	name      string
	gen       uint32
	held      int
	lastSeen  int64
	seenEpoch uint32 // ledger.epoch when lastSeen was stamped
	idleSince int64
	activePos int32 // position in ledger.active, -1 when inactive
	admitted  uint64
	refused   uint64
	would     uint64  // asks admitted in dry-run that the rule refused
	dryRun    bool    // the project is in dry-run (ledger.dryProjects)
	cap       int     // its permit cap (ledger.caps), -1 for none
	released  uint64  // own releases since the last recompute
	relRate   float64 // own releases per second, smoothed
}

type idleEntry struct {
	idx   int32
	gen   uint32
	since int64
}

func newLedger(cfg Config, ns clock.Nanos) ledger {
	n := ns.Now()
	l := ledger{
		clock:         ns.Now,
		name:          cfg.Name,
		size:          cfg.Size,
		floor:         cfg.Floor,
		window:        int64(cfg.Window),
		forget:        int64(cfg.Forget),
		now:           n,
		lastRecompute: n,
		index:         map[string]int32{},
	}
	l.share = Share(l.size, l.floor, 0)
	return l
}

// advance moves the coarse clock forward; it never moves back, which keeps
// out-of-order readings from concurrent callers harmless.
func (l *ledger) advance(now int64) {
	if now > l.now {
		l.now = now
	}
}

// lookup returns the slot of name, creating the project on first sight.
func (l *ledger) lookup(name string) int32 {
	if idx, ok := l.index[name]; ok {
		return idx
	}
	var idx int32
	if n := len(l.free); n > 0 {
		idx = l.free[n-1]
		l.free = l.free[:n-1]
		gen := l.projects[idx].gen
		l.projects[idx] = project{name: name, gen: gen, activePos: -1, dryRun: l.dryProjects[name], cap: l.capOf(name)}
	} else {
		idx = int32(len(l.projects))
		l.projects = append(l.projects, project{name: name, activePos: -1, dryRun: l.dryProjects[name], cap: l.capOf(name)})
	}
	l.index[name] = idx
	return idx
}

// seen records that the project held or asked now, entering the active set
// at once: a newcomer shrinks the others' share without waiting for the next
// recompute (leaving the set, in contrast, waits for Recompute).
func (l *ledger) seen(idx int32) {
	pr := &l.projects[idx]
	pr.lastSeen, pr.seenEpoch = l.now, l.epoch
	if pr.activePos < 0 {
		pr.activePos = int32(len(l.active))
		l.active = append(l.active, idx)
		l.share = Share(l.size, l.floor, len(l.active))
	}
}

// admits applies the rule to project idx.
func (l *ledger) admits(idx int32) bool {
	pr := &l.projects[idx]
	if pr.cap >= 0 {
		return pr.held < pr.cap && l.inUse < l.size
	}
	return Admits(l.inUse, pr.held, l.size, l.floor, l.share)
}

// capOf is project name's cap, -1 when it has none.
func (l *ledger) capOf(name string) int {
	if c, ok := l.caps[name]; ok {
		return c
	}
	if l.caps != nil {
		return l.capOthers
	}
	return -1
}

// setCaps replaces every cap (nil: none); the caps outlive a project's
// state, as dry-run does.
func (l *ledger) setCaps(caps map[string]int, others int) {
	l.caps, l.capOthers = caps, others
	for name, idx := range l.index {
		l.projects[idx].cap = l.capOf(name)
	}
}

// dry reports whether a refusal of project idx is to be admitted instead
// (the pool or the project in dry-run).
func (l *ledger) dry(idx int32) bool {
	return l.dryRun || l.projects[idx].dryRun
}

// setDryRun puts the pool (project "") or one project in dry-run, or back.
func (l *ledger) setDryRun(project string, on bool) {
	if project == "" {
		l.dryRun = on
		return
	}
	if on {
		if l.dryProjects == nil {
			l.dryProjects = map[string]bool{}
		}
		l.dryProjects[project] = true
	} else {
		delete(l.dryProjects, project)
	}
	if idx, ok := l.index[project]; ok {
		l.projects[idx].dryRun = on
	}
}

func (l *ledger) take(idx int32) {
	l.projects[idx].held++
	l.projects[idx].admitted++
	l.admitted++
	l.inUse++
}

// hold counts a permit held again by project idx without counting an ask:
// one given back to the object it was taken from (Residents.Unevict), whose
// holding was counted admitted when it began.
func (l *ledger) hold(idx int32) {
	l.projects[idx].held++
	l.inUse++
}

func (l *ledger) give(idx int32) {
	pr := &l.projects[idx]
	pr.held--
	pr.released++
	pr.lastSeen, pr.seenEpoch = l.now, l.epoch
	l.inUse--
	l.released++
}

// refusal builds the refusal for project idx with its retry estimate.
func (l *ledger) refusal(idx int32) *Refusal {
	rf := new(Refusal)
	l.fillRefusal(idx, rf)
	return rf
}

// fillRefusal counts a refusal of project idx and writes it into rf, which
// the caller owns (so the refused path need not allocate).
func (l *ledger) fillRefusal(idx int32, rf *Refusal) {
	pr := &l.projects[idx]
	pr.refused++
	l.refused++
	l.describe(idx, rf)
}

// fillWould counts an ask of project idx that the rule refused and dry-run
// admits, and writes the refusal it would have been into rf. The caller
// then grants the permit.
func (l *ledger) fillWould(idx int32, rf *Refusal) {
	l.projects[idx].would++
	l.wouldRefuse++
	l.describe(idx, rf)
	rf.WouldRefuse = true
}

// describe writes the refusal of project idx, as the rule stands, into rf.
func (l *ledger) describe(idx int32, rf *Refusal) {
	pr := &l.projects[idx]
	reason, share := ReasonFull, l.share
	switch {
	case pr.cap >= 0:
		share = pr.cap
		if pr.held >= pr.cap {
			reason = ReasonOverCap
		}
	case pr.held >= l.share:
		reason = ReasonOverShare
	}
	rate := l.relRate
	if rate <= 0 {
		rate = l.coldRate()
	}
	*rf = Refusal{
		Pool:        l.name,
		Project:     pr.name,
		Reason:      reason,
		Held:        pr.held,
		Share:       share,
		InUse:       l.inUse,
		Size:        l.size,
		RetryAfter:  l.retryAfter(idx, rate),
		ReleaseRate: rate,
	}
}

// coldReads is how many refusals of a pool with no rate share one clock
// read (coldRate).
const coldReads = 16

// coldRate is the pool's release rate while it has no smoothed one (its
// first period, or one with nothing held before): the releases since the
// last recompute over the time since, read from the clock. It is 0 when
// nothing was released yet. The clock is read here only, on a refusal of a
// pool with no rate, which a running pool leaves after its first
// recompute: an idle pool keeps the rate it measured last.
func (l *ledger) coldRate() float64 {
	if l.clock == nil {
		return 0
	}
	// The clock is read after a release and by one refusal in coldReads
	// otherwise, so that a pool refusing fast with nothing released
	// (BenchmarkPoolRefuseInto) pays a share of a clock read, not one
	// each; the others use the time last read.
	if l.coldSeq%coldReads == 0 || l.released != l.coldReleased {
		l.advance(l.clock())
		l.coldReleased = l.released
	}
	l.coldSeq++
	if l.released == 0 || l.now <= l.lastRecompute {
		return 0
	}
	return float64(l.released) / (float64(l.now-l.lastRecompute) / float64(time.Second))
}

// Bounds of a retry estimate.
const (
	minRetry = time.Millisecond
	maxRetry = time.Minute
)

// shareRetry is retryAfter's estimate, in seconds, for project pr under the
// rule (no cap); +Inf when no release is expected.
func (l *ledger) shareRetry(pr *project, rate float64) float64 {
	est := math.Inf(1)
	// Path 1: enough releases from anyone bring in_use under the limit that
	// applies to the project as it stands. A project past its share waits
	// for as many releases more as it is past it: the permits that come
	// free go first to the refused projects nearest their share, so the
	// room above the share is not won by whichever project has the most
	// clients retrying (see "Retry estimate" in doc.go).
	limit, behind := l.size, 0
	if pr.held >= l.share {
		limit, behind = l.size-l.floor, pr.held-l.share
	}
	if rate > 0 {
		est = float64(l.inUse-limit+1+behind) / rate
	}
	// Path 2 (over share): the project's own releases bring it under its
	// share; then it needs in_use < size, which those releases help reach.
	if pr.held >= l.share && pr.relRate > 0 {
		est = math.Min(est, l.ownRetry(pr, pr.held-l.share+1, rate))
	}
	return est
}

// capRetry is retryAfter's estimate, in seconds, for project pr held to its
// cap (admitted while held < cap and in_use < size); +Inf when no release
// is expected. At its cap only its own releases let it in, whatever the
// pool's rate: answered from the pool's, a capped project whose pool had
// room was told 1 ms, and clients that obeyed spun (each refusal counting
// as demand for the fleet's allotment besides).
func (l *ledger) capRetry(pr *project, rate float64) float64 {
	if pr.held >= pr.cap {
		if pr.relRate <= 0 {
			return math.Inf(1)
		}
		return l.ownRetry(pr, pr.held-pr.cap+1, rate)
	}
	if rate <= 0 {
		return math.Inf(1)
	}
	return float64(l.inUse-l.size+1) / rate
}

// ownRetry is the time, in seconds, for project pr to release own permits,
// and for in_use then to be under the size, which those releases help
// reach.
func (l *ledger) ownRetry(pr *project, own int, rate float64) float64 {
	t := float64(own) / pr.relRate
	if rest := l.inUse - own - l.size + 1; rest > 0 {
		if rate <= 0 {
			return math.Inf(1)
		}
		t = math.Max(t, float64(rest)/rate)
	}
	return t
}

// retryAfter estimates how long until project idx would be admitted; see
// "Retry estimate" in doc.go.
func (l *ledger) retryAfter(idx int32, rate float64) time.Duration {
	pr := &l.projects[idx]
	var est float64
	if pr.cap >= 0 {
		est = l.capRetry(pr, rate)
	} else {
		est = l.shareRetry(pr, rate)
	}
	// No release seen lately: nothing we know of frees a permit before the
	// next recompute, where the share may grow.
	if math.IsInf(est, 1) {
		est = float64(l.window) / float64(time.Second)
		// A pool that has never measured a rate (its first period) and
		// has released nothing yet: what it knows is that nothing was
		// released in the e since its last recompute. It answers e, a
		// back-off that doubles while nothing comes free, up to the window:
		// a crowd told the whole window at a pool's start stayed away a
		// second while the first releases came 20ms later (docs/compare.md).
		if !l.measured && l.relRate <= 0 && l.clock != nil {
			est = math.Min(est, float64(l.now-l.lastRecompute)/float64(time.Second))
		}
	}
	// No jitter here: spreading the refused clients of a project is the
	// caller's (package internal/pace gives each its own slot). Stretching
	// the estimate by up to half, as this did, made a hint up to 2.5 times
	// the wait of the first client in line once the slot's own jitter was
	// added.
	// Clamped as a float: a rate that has halved at every recompute while
	// nothing was released (ewma with 0) makes est past what a Duration
	// holds, and the conversion wrapped to a negative, answered as 1ms.
	if est >= maxRetry.Seconds() {
		return maxRetry
	}
	d := time.Duration(est * float64(time.Second))
	return min(max(d, minRetry), maxRetry)
}

// ewma blends the rate of the last interval into the smoothed rate.
func ewma(old, inst float64) float64 {
	if old == 0 {
		return inst
	}
	return 0.5*old + 0.5*inst
}

// recompute settles the active set at now, updates the release rates and
// the share, and forgets long-idle projects. pinned(idx) keeps a project
// active (waiters) and keep(idx) keeps an inactive project from being
// forgotten (sleeping objects); either may be nil. forgotten(idx) is called
// before a slot is recycled. Cost: O(active) plus O(expired idle entries).
func (l *ledger) recompute(now int64, pinned, keep func(int32) bool, forgotten func(int32)) {
	l.advance(now)
	now = l.now
	dt := float64(now-l.lastRecompute) / float64(time.Second)
	l.lastRecompute = now
	// An interval with nothing held and nothing released says nothing about
	// how fast permits free: an idle pool keeps the rate it last measured.
	// Decaying it (halving each idle second) made the first crowd after a
	// quiet spell be told to come back 1/rate apart at a rate near zero.
	if dt > 0 && (l.released > 0 || l.inUse > 0) {
		l.relRate = ewma(l.relRate, float64(l.released)/dt)
		l.measured = true
	}
	l.released = 0
	cutoff := now - l.window
	for i := 0; i < len(l.active); {
		idx := l.active[i]
		pr := &l.projects[idx]
		if (pinned != nil && pinned(idx)) || pr.seenEpoch == l.epoch {
			pr.lastSeen = now // an upper bound of its last ask (see epoch)
		}
		if dt > 0 && (pr.released > 0 || pr.held > 0) {
			pr.relRate = ewma(pr.relRate, float64(pr.released)/dt)
		}
		pr.released = 0
		if pr.held > 0 || pr.lastSeen > cutoff {
			i++
			continue
		}
		// Leave the active set: swap-remove.
		last := len(l.active) - 1
		moved := l.active[last]
		l.active[i] = moved
		l.projects[moved].activePos = int32(i)
		l.active = l.active[:last]
		pr.activePos = -1
		pr.relRate = 0
		pr.idleSince = now
		l.idle = append(l.idle, idleEntry{idx: idx, gen: pr.gen, since: now})
	}
	l.epoch++
	l.forgetIdle(now, keep, forgotten)
	l.share = Share(l.size, l.floor, len(l.active))
}

func (l *ledger) forgetIdle(now int64, keep func(int32) bool, forgotten func(int32)) {
	cutoff := now - l.forget
	for l.idleHead < len(l.idle) && l.idle[l.idleHead].since <= cutoff {
		e := l.idle[l.idleHead]
		l.idleHead++
		pr := &l.projects[e.idx]
		if pr.gen != e.gen || pr.activePos >= 0 || pr.idleSince != e.since || pr.held > 0 {
			continue // reused, reactivated since, or busy: a later entry decides
		}
		if keep != nil && keep(e.idx) {
			// Still referenced (sleeping objects): look again one period later.
			pr.idleSince = now
			l.idle = append(l.idle, idleEntry{idx: e.idx, gen: e.gen, since: now})
			continue
		}
		if forgotten != nil {
			forgotten(e.idx)
		}
		l.forgotten.Projects++
		l.forgotten.Admitted += pr.admitted
		l.forgotten.Refused += pr.refused
		l.forgotten.WouldRefuse += pr.would
		delete(l.index, pr.name)
		gen := pr.gen + 1
		*pr = project{gen: gen, activePos: -1}
		l.free = append(l.free, e.idx)
	}
	// Compact the queue when its consumed head dominates.
	if l.idleHead > 1024 && l.idleHead*2 > len(l.idle) {
		n := copy(l.idle, l.idle[l.idleHead:])
		l.idle = l.idle[:n]
		l.idleHead = 0
	}
}

// resize changes size and floor (already validated) and the share.
func (l *ledger) resize(size, floor int) {
	l.size, l.floor = size, floor
	l.share = Share(l.size, l.floor, len(l.active))
}

// snapshot fills the pool-wide fields and the per-project stats (sorted by
// the caller). now is the clock's reading and nowNs the same reading as the
// ledger's time: a last-seen time shows as long before now as it was,
// whatever step the wall clock made since (see clock.Nanos).
func (l *ledger) snapshot(now time.Time, nowNs int64) Snapshot {
	s := Snapshot{
		Name:   l.name,
		Size:   l.size,
		Floor:  l.floor,
		InUse:  l.inUse,
		Active: len(l.active),
		Share:  l.share,

		Admitted:    l.admitted,
		Refused:     l.refused,
		WouldRefuse: l.wouldRefuse,
		DryRun:      l.dryRun,
		Forgotten:   l.forgotten,
	}
	s.Projects = make([]ProjectStat, 0, len(l.index))
	for _, idx := range l.index {
		pr := &l.projects[idx]
		s.Projects = append(s.Projects, ProjectStat{
			Project:     pr.name,
			Held:        pr.held,
			Admitted:    pr.admitted,
			Refused:     pr.refused,
			WouldRefuse: pr.would,
			DryRun:      pr.dryRun,
			LastSeen:    now.Add(-time.Duration(nowNs - pr.lastSeen)).Round(0),
			Active:      pr.activePos >= 0,
		})
	}
	sortStats(s.Projects)
	return s
}
