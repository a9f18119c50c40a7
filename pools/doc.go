// SPDX-License-Identifier: Apache-2.0

// Package pools implements fair share: the rule that turns each node-wide
// bound (a pool of permits) into a per-project one, with no per-project
// configuration. It is pure Go with an injected clock; the daemon wires it to
// the HTTP front, the BPF maps and the metrics.
//
// # Definitions
//
// A pool has a size POOL (> 0) and a floor FLOOR (1 <= FLOOR <= POOL; by
// default DefaultFloor: POOL/20 rounded down, at least 1). A project is an
// opaque string; it exists from its first ask, with no registration. in_use
// is the number of permits held in the pool; held(p) the number held by p.
//
// active is the number of projects that held a permit or asked for one
// (admitted or refused, blocking or not) within the active window W (1s by
// default). share = max(FLOOR, POOL / active) with Go integer division
// (rounded down), and share = POOL while nobody is active. Every active
// project has the same share.
//
// # Admission
//
// A project holding fewer than share permits is admitted while
// in_use < POOL. A project holding share or more is admitted only while
// in_use < POOL - FLOOR. Admits states the rule as a pure function; Pool and
// Residents apply it under their lock, so the check and the increment are one
// step.
//
// # Invariants
//
//   - in_use <= POOL, except after Resize shrinks the pool below in_use:
//     then nobody is admitted until releases bring in_use back under.
//   - An admission of a project at or over its share never leaves
//     in_use > POOL - FLOOR.
//   - A permit is released at most once: the second release of a Permit
//     value (or one the pool did not issue) returns ErrDoubleRelease and
//     changes no count. Counts return to zero when every permit is released.
//
// # Consequences
//
//  1. While in_use < POOL - FLOOR nobody is refused: the share only orders
//     projects under pressure. A project alone has share = POOL and may take
//     the whole pool; a project past its share keeps taking permits until
//     in_use reaches POOL - FLOOR.
//  2. Projects past their share stop FLOOR permits short of the pool, so on a
//     node filled by such projects a newcomer (held 0 < share) gets FLOOR
//     permits at once. The guarantee is exact only for that case: projects
//     under their share may fill the pool completely (a lone project, or
//     several each below POOL/active). Then the newcomer waits for releases,
//     but from its arrival the share has shrunk, the others are at or over
//     it and cannot take back what is released while in_use >= POOL - FLOOR,
//     so the next releases go to the newcomer until it holds its floor.
//  3. On a full pool the project at or over its share is refused first; a
//     project under its share is admitted by the very next release. A
//     blocking Acquire is woken by that release, under the pool lock, before
//     any other caller can take the permit.
//
// # Caps
//
// SetCaps gives projects a cap each (package fleet sets them: a project's
// part of its fleet share on this node). A capped project is admitted while
// it holds fewer than its cap and in_use < POOL, in place of the share and
// the floor; projects without a cap keep the rule. The floor is not held
// back from a capped project because the fleet already kept it back when it
// computed the caps; holding it back again here would leave a project short
// of what the fleet granted it. A cap below what a project holds refuses it
// until releases bring it under; nothing held is taken back.
//
// # Dry-run
//
// SetDryRun puts a whole pool, or one project of it, in dry-run: every ask
// goes through the rule and is counted as usual, but an ask the rule refuses
// is admitted instead and counted in WouldRefuse (it counts as admitted too;
// Refused counts only real refusals). TryAcquireInto says so with the
// refusal it would have been (Refusal.WouldRefuse). In dry-run in_use may
// pass POOL: that is the point, an operator watches what enforcement would
// do before turning it on. A project's dry-run survives the pool forgetting
// its state. Residents have no dry-run: a full residents pool evicts rather
// than refuses.
//
// # Active window and recompute
//
// The hot path does not read the clock. An ask only marks the project as seen
// in the current epoch (the interval since the latest Recompute); the
// Recompute that closes the epoch stamps it with its own time, the earliest
// moment the pool can vouch that the ask had happened. A project joins the
// active set at its first ask, at once (the share shrinks immediately). It
// leaves at the first Recompute at time t where it holds nothing, has no
// blocked Acquire and its stamp is at least W old (stamp <= t - W). Because
// the stamp is an upper bound of the real time of the ask, a project never
// leaves early, even when recomputes come a little later than W apart (a
// ticker's jitter); with Recompute every period P, it leaves between W and
// W + 2P after its last ask or release. Recompute costs
// O(active projects) plus O(projects that expired): inactive projects are
// queued when they leave and their state (counters) is dropped after
// Config.Forget (1 minute by default) of idleness, so memory is bounded by the
// projects seen in the last Forget.
//
// # Retry estimate
//
// A refusal carries RetryAfter, an estimate for this project. Recompute
// measures the release rate of the pool and of each active project (releases
// per second, smoothed: half the last interval, half the previous estimate).
// The estimate is the time for the releases the project needs:
// (in_use - limit + 1) / pool rate, where limit is POOL under share and
// POOL - FLOOR at or over it. A project at or over its share also waits
// behind the (held - share) permits it holds past its share: the permits
// that come free go first to the refused projects nearest their share, so
// the room above the shares is not won by whichever project has the most
// clients retrying. For such a project the estimate is also the time for its
// own (held - share + 1) releases at its own rate, whichever is sooner.
// A project held to a cap (fleet pools) is admitted under its cap while the
// pool has room: at its cap it waits for its own (held - cap + 1) releases
// at its own rate, however much room the pool has; under it, for the
// pool's (in_use - POOL + 1).
// Before the pool has measured a rate (its first period) the pool rate is
// the releases since the last Recompute over the time since, the one case
// where a refusal reads the clock (after a release, and on one refusal in
// 16 otherwise); with nothing released yet the estimate is the time since the
// last Recompute, a back-off that grows while nothing comes free. When no
// release was seen lately the estimate is at most one window, when the next
// Recompute may grow the share. The result is clamped to [1ms,
// 1min] and not jittered: spreading many refused clients of one project is
// the caller's (the front and the permit API give each its own return slot
// at the release rate, package internal/pace). The refusal also carries the pool release rate
// the estimate used (ReleaseRate), so that a caller with a coarser unit (the
// HTTP front's whole seconds) can space many refused clients at that rate.
//
// # Blocking and concurrency
//
// All methods are safe for concurrent use; each pool has one mutex. Acquire
// waits in a FIFO per project; a release (or Recompute or Resize) grants
// permits to the heads of the waiting projects' queues, round-robin over
// projects, while the rule admits them. A waiting project counts as active.
// Admission decisions are linearizable (taken under the lock). Not
// guaranteed: ordering between different projects beyond round-robin,
// fairness between a blocked Acquire and a TryAcquire of another project
// arriving at the same moment, or exactness of the active window finer than
// the recompute period.
//
// # Residents and eviction
//
// Residents applies the same rule to resident objects: an awake object holds
// one permit, a sleeping one holds none but is remembered. When Spawn (a new
// object or a wake) cannot fit under the rule, it evicts instead of
// refusing, one object per spawn, so in_use does not change:
//
//   - a spawner at or over its share evicts its own idlest object (the least
//     recently spawned or touched: reason "own-idlest");
//   - a spawner under its share evicts the idlest object of the other project
//     holding the most, provided that project holds at least the share
//     (reason "furthest-over-share"). All active projects share one share, so
//     the largest holder is the one furthest over it; ties go to either.
//
// Eligible victims are therefore only the spawner itself (when at or over
// share) or projects at or over the share; a project under its share is
// never evicted for another. When nothing is eligible (everyone else is under
// the share, as happens when the floor dominates and POOL is full), Spawn
// waits up to Config.EvictWait (1s) for room or a victim (a Sleep, Remove or
// Recompute), honouring its context, then refuses with a *Refusal matching
// ErrTooManyResidents. Nothing is evicted while the rule admits. The victim is
// counted as asleep when Spawn returns; the caller must put it to sleep.
// A caller whose victim's owner did not confirm gives it back with
// Unconfirmed (resident again, as its project's most recently called, so
// the project's other objects are named first), or keeps it asleep without
// its owner with Dropped; Drop puts another resident object to sleep that
// way (reason "unconfirmed").
// Touch, Sleep and Remove keep held and sleeping counts exact; Touch does
// not read the clock. Victim choice is O(log projects) (a max-heap on held)
// and each project's objects form an LRU list.
//
// # Rates
//
// Rates keeps two token buckets per project with a policy: requests per
// second and work units per second, each with a burst of one second's worth
// (but at least one token); 0 means unbounded and keeps no state. A rate is
// otherwise between MinRate (one per 1000 s) and MaxRate (1e9 per second);
// SetLimits moves a rate outside into the bounds, and package policy refuses
// it. The time until a token (or until debt is paid) is exact up to
// MaxRateRetry (a day) and MaxRateRetry beyond: no debt is large enough to
// overflow it into an immediate retry. Buckets refill lazily on access.
// Allow takes one request token, or refuses with the time until a token is
// there. Charge takes work after the fact and may drive
// the work bucket below zero (debt); while in debt Allow refuses with the time
// until the balance is back at zero. A timestamp older than the bucket's last
// refill earns nothing and does not move the bucket back in time, so callers
// that read the clock before the lock cannot be paid twice for one interval
// (golang/go#71360).
package pools
