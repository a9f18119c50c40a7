// SPDX-License-Identifier: Apache-2.0

// Package scheduler decides the order in which requests from many
// participants (projects) reach one server, and the priority class each one
// runs under. It decides order only: it never refuses, drops or interrupts a
// request, and what a participant pays is not its concern.
//
// # Queues
//
// Submit appends a request to its participant's own FIFO queue. Arrival
// decides nothing else: a queued request has no class until the moment it
// is dispatched.
//
// # Buckets and tiers
//
// A participant's Policy names a Tier and a number of Shares. The tier
// decides which credit buckets it holds:
//
//	TierPro   P1 and P2
//	TierLite  P2
//	TierNone  neither (its requests always go out as P3)
//
// Each bucket refills continuously at Rate*Shares credits per second up to
// Burst*Shares (Config, with defaults DefaultP1Rate etc.). Refill depends on
// the clock alone: not on the server, not on what anyone else spends. A new
// participant starts with full buckets. Shares scale credits, never turns.
//
// # The decision
//
// Each step asks, in order: does any queue with work hold at least one P1
// credit? Then this is a P1 pass over exactly those queues. Otherwise the
// same question for P2. Otherwise a P3 pass, where every queue with work
// qualifies whatever it holds: P3 is the credit test switched off, not a
// separate queue. Because a queue is only eligible for a pass if it holds a
// credit of that class, the request taken from it goes out under the
// highest class its balances support at that moment.
//
// Within the chosen class a cursor takes one request from the queue it
// points at and moves to the next eligible queue. Each class keeps its own
// cursor, so the next pass of that class resumes where the last one stopped
// and a long queue cannot hold the class because it arrived first. Turns
// are per participant: ten shares get the same turns as one, with more
// credit to spend on them.
//
// # Charging
//
// A P1 or P2 dispatch takes one credit, flat, from that class's bucket. On
// Done(cost) the bucket that admitted the request is charged cost-1 (a
// request lighter than average gets part of its credit back, a heavy one
// drives the balance negative), even if the participant's class has changed
// in between. Debt only delays the participant's own return to a higher
// class; nothing dispatched is ever taken back and a heavy request is never
// held back in advance. Debt stops at what a day of the bucket's refill
// repays: a larger cost (an upstream's cost header of 1e12, +Inf passed to
// Done) charges only that much, so that no cost, and no rate however low,
// makes a wake-up time overflow.
//
// A P3 dispatch is charged to no bucket, neither the flat credit nor the
// cost on completion. A P3 pass happens only when no queue on the server
// holds a credit of any class, so it spends capacity nobody with priority
// could use; charging it would delay a participant's return to priority for
// work that displaced no one, and TierNone has no bucket to charge anyway.
//
// # Dropping and climbing
//
// Spending moves a queue down (P1 to P2 to P3) and refill moves it back up:
// the same per-queue balance test seen at two moments. A queue still holding
// work when its bucket reaches a credit is eligible at the higher class from
// that instant. So a Pro participant's wait for P1 is bounded by its own P1
// refill, whatever others do. A Lite participant additionally waits until no
// queue on the server is eligible for P1. The longer the gaps between a
// participant's turns (a busier server), the more its buckets refill in
// between.
//
// # Room
//
// Run dispatches only while the server has room: fewer than MaxInFlight
// tickets dispatched and not Done, and HasRoom (if set) agreeing. Without
// room it waits Poll and asks again; it never waits for a particular
// request to finish. A ticket whose Wait context ends before dispatch is
// withdrawn without moving anyone else.
//
// The last places, the fair-share rule's floor of MaxInFlight (5%, at least
// one), go first to participants holding fewer places than their share:
// MaxInFlight over the participants with work queued or in flight or whose
// last request ended within Window (at least the floor). There a queue whose
// participant holds its share is passed over, behind everyone in its ring
// and without a turn, for the first queue under its share of the best class
// that has one; with none waiting, the best class's head is served as usual.
// And a place a participant under its share gives back while none of its
// requests waits is kept for its next request for Keep, after its first
// request and while its requests come one after another (each within Keep of
// the end of the one before, or while another is under way): until then,
// participants at their share do not take it (one under its share may). At
// most the floor's worth of places are kept at once. So a participant whose
// requests are long (streams, long polls), having taken every place while
// alone, does not take back each place a client sending one short request
// after another frees: the client keeps it, and every place the long
// requests give back goes to those under their share while they wait. Places
// are never taken back from a running request, and one place is not divided
// (with MaxInFlight 1 the participants take turns).
//
// While Run is active, a request submitted when no other request waits and
// the server has room is dispatched inside Submit (unless the places left
// are not for it: see above; the loop then decides): the loop's next
// decision would pick it anyway, and making it there saves two goroutine
// wake-ups (Submit to Run, Run to the waiter), so Wait returns at once. It
// is accounted exactly like a loop dispatch (a wait of zero). A request that
// finds another one waiting always queues, room or not, so none overtakes.
// Done wakes the loop only when a request is waiting for the freed slot.
//
// # Capacity: when every request runs
//
// Every queued request runs only under a condition the scheduler cannot
// make true by itself: credits must be issued more slowly than the server
// completes work. Measure both in credits (a cost of 1 is an average
// request). Let I1 be the P1 refill of the participants with work queued
// (P1Rate times the shares of every Pro participant among them) and I2 their
// P2 refill (P2Rate times the shares of every Pro or Lite one), and C the
// credits the server completes per second. Then:
//
//   - If I1 < C, P1 work runs out again and again, so P2 passes happen and
//     Lite work runs, after at most the time it takes to drain the P1
//     buckets (their bursts) at a net C-I1.
//   - If I1+I2 < C, P2 work runs out too, P3 passes happen and every
//     request runs, TierNone included, after at most the time it takes to
//     drain the bursts at a net C-I1-I2.
//   - Otherwise the lower classes wait for as long as the overload lasts.
//     TierNone work (and with I1 >= C, Lite work) may then never run.
//
// Pro participants are never starved: each one's wait for P1 is bounded by
// its own refill, whatever the load, but for the last places: there one at
// or over its share of places may wait for a participant under it, or for a
// place kept for one (Keep), whatever its credit. Nothing inside the
// scheduler can restore the guarantee without breaking another rule it
// implements: serving P3 while some queue holds a P1 credit breaks "P1
// whenever any queue qualifies", and slowing refill when the server is busy
// breaks "refill follows the clock and nobody else's spending". The
// safeguard belongs where shares are sold: the shares placed on one server
// must keep I1+I2 below its capacity (with the defaults, 50 credits/s per
// Pro share and 40 per Lite share). A Snapshot lists every participant's
// policy and queue, which is enough to compute I1 and I2 and alert on them.
// The test TestEveryRequestRunsOnlyWhileIssuanceIsBelowCapacity shows all
// three cases.
//
// # Cost
//
// Each class keeps a ring of exactly the non-empty queues eligible for it,
// with counters, so choosing the class and the queue is O(1). A ring is a
// FIFO array of participant handles: a turn pops the head, and a queue that
// stays in the class is pushed back at the tail. A queue that leaves a ring
// from the middle leaves a tombstone that the head skips when it gets
// there; a full array at least half tombstones is squeezed rather than
// grown. A queue that drops below a credit is moved to a lower ring and
// parked on a timer for the instant refill lifts it again; balances are
// refilled lazily when touched. Timers set in due order, the usual case,
// go to a FIFO (O(1)); the others to a 4-ary heap (O(log n)). A queue
// that enters a ring having had no turn for a full round is served next,
// after any that entered the same way before it (a sparse participant is
// not stuck behind a whole round); one that just had a turn enters behind
// everyone. The sparse ones go first only while the head of the others has
// not itself waited a round, so a stream of sparse queues (many light
// participants, or a new name per request) cannot keep a backlogged queue
// from its turn: it waits a round of the ring's members at most.
//
// At 100k participants the cost of a decision is cache misses, not
// instructions, so the layout counts them. What a decision reads and
// writes (balances, ring position, timer, queue head) sits in one 64-byte
// record per participant in a dense array; names, queue tails and
// statistics sit in a second array that only Submit, completion and status
// output touch. The four children of a timer heap node share a cache line.
// Tickets are 64 bytes and allocated 64 at a time, and a ticket gets a
// channel only when Wait has to block, so a dispatch touches the
// participant's two records and one ticket line, and a channel only if
// someone waits. Because a ring's array and the timer FIFO say who comes
// next, the records of the queues up to eight turns ahead and of the next
// timers due, and the head tickets of the likeliest next dispatches, are
// prefetched after each decision, so their misses overlap; below 4096
// participants every record stays in cache and nothing is prefetched. A
// dispatch allocates nothing.
//
// Participants that are idle, with nothing queued or in flight and full
// buckets, are forgotten once a second to bound memory; their Policy is
// kept.
package scheduler
