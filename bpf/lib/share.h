/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The rule (pools/doc.go), once, over a pool given as an argument: the
 * node's connections pool (fs_config, fs_node) and a destination pool
 * (dest.h: fs_dpool_conf, fs_dpool_state) are divided by the same code.
 *
 *   pool_seen    a project's ask stamped, a newcomer counted into active
 *   pool_under   whether a project holds less than its share
 *   pool_limit   the in_use a project may take a permit under
 *   rule_limit   that, or the project's fleet cap, or the rule at the fleet's
 *                safe slice while the daemon is away (cap.h): what every
 *                judgment of a permit takes
 *   pool_admit   the permit taken under that limit, or refused
 *   pool_give    a permit given back
 *
 * A pool is a struct rule_pool of pointers to its fields, so that each is
 * read where the rule needs it, as if the code named it: the wrappers for
 * the node below and dest.h's compile to what they did with a copy each.
 * rule.h takes permits by these, and events.h says why a refusal was one;
 * both include this header, which includes neither. The exempt set is here
 * too (the node's pool only).
 */
#pragma once

#include "maps.h"
#include "cap.h"

/*
 * clock_ns is now_ns(fine), read once per program run: *now is 0 until the
 * first call reads it, and later calls of the same run take that reading.
 * A connect that takes a permit in a destination pool and in the node's
 * pool stamps both with one helper call (each stamp is compared with a
 * window of a second: a few ns apart is the same time). A caller that
 * passes a fresh 0 gets the code of a plain now_ns (the compiler drops the
 * test).
 */
static __always_inline __u64 clock_ns(__u64 *now, bool fine)
{
	if (!*now)
		*now = now_ns(fine);
	return *now;
}

/* A pool the rule divides: where its parameters and counters are. */
struct rule_pool {
	const __u32 *size;      /* POOL */
	const __u32 *floor;     /* FLOOR */
	const __u64 *window_ns; /* the active window; 0 leaves active to the control loop */
	__s64 *active;          /* projects in its active window (bumped here, lowered by Tick) */
	__s64 *in_use;          /* permits held (atomics only) */
	__u32 cap_pool;         /* its row in fs_caps (cap.h): 0 the node's, a destination pool's id */
	bool packed;            /* its project entries count in one word (PACKED_HELD_BITS) */
	const __u32 *fleet_safe; /* a destination pool's safe slice plus one (cap.h, fleet_safe_now); NULL the node's */
};

/*
 * A destination pool's project entry (dest.h) keeps what it holds and what
 * it was admitted in one word, in_use: held in the low PACKED_HELD_BITS
 * bits, signed, admitted in the others, so that an admission is one atomic
 * add (PACKED_ADMIT) where the node's entries take two (a locked add costs
 * a matching connect some 5-10 ns: BenchmarkConnectAcceptClose). The word
 * is admitted * 2^24 + held, held as a signed number: a release or a drift
 * repair adds to held alone, even past 0, and both read back exactly
 * (packed_held, and loader's unpackDest) while held stays within +-2^23:
 * one project's connections to one pool, 8.4 million sockets, which a node
 * does not hold (the pool's size is at most limits.MaxPoolSize, 2^18; held
 * goes past it only by connections admitted past the rule: dry-run, a
 * lapse, adopted or moved ones). Admitted wraps after 2^40 admissions of
 * one project in one pool. The entry's own admitted field stays 0.
 */
#define PACKED_HELD_BITS 24
#define PACKED_ADMIT (1 + (1LL << PACKED_HELD_BITS))

/* packed_held is the held count of packed word w. */
static __always_inline __s64 packed_held(__s64 w)
{
	return (__s64)((__u64)w << (64 - PACKED_HELD_BITS)) >> (64 - PACKED_HELD_BITS);
}

/* proj_held is what project entry p holds of pool r. */
static __always_inline __s64 proj_held(struct rule_pool *r, struct fs_project *p)
{
	__s64 w = *(volatile __s64 *)&p->in_use;
	return r->packed ? packed_held(w) : w;
}

/*
 * pool_seen stamps project entry p's ask in pool r and, when this ask brings
 * it into the active window (never seen, or last seen a window ago while
 * holding nothing), adds it to the pool's active count. It stamps only asks
 * made while holding nothing. The stamp is swapped in with a
 * compare-and-swap, so of several CPUs asking for the same newcomer at once
 * only one counts it. A project Tick already counted and that ages out
 * before the next Tick is counted twice until then: the error only shrinks
 * the share, the safe direction. A stamp ahead of now (the coarse clock lags
 * the precise one by up to a tick) is recent, not a window old.
 */
static __always_inline void pool_seen(struct rule_pool *r, struct fs_project *p, bool fine, __u64 *clk)
{
	/* A project that holds permits is active whatever its stamp, and the
	 * release of its last one stamps it (pool_give): no clock read, no
	 * store, on the common path. */
	if (proj_held(r, p) > 0)
		return;
	__u64 now = clock_ns(clk, fine);
	__u64 last = p->last_seen_ns;
	__u64 window = *r->window_ns;
	if (window && proj_held(r, p) <= 0 && (last == 0 || (now > last && now - last >= window))) {
		if (__sync_val_compare_and_swap(&p->last_seen_ns, last, now) == last)
			__sync_fetch_and_add(r->active, 1);
		return;
	}
	p->last_seen_ns = now;
}

/*
 * pool_active is the number of active projects the rule divides pool r by:
 * one more for an inbound permit (in), beside the project a newcomer would
 * make (see limit_for).
 */
static __always_inline __s64 pool_active(struct rule_pool *r, bool in)
{
	__s64 active = *r->active;
	return in ? (active > 1 ? active : 1) + 1 : active;
}

/*
 * pool_under says whether a project holding held permits of pool r holds
 * less than its share, max(FLOOR, POOL / active) (POOL while at most one
 * project is active). held < POOL / active (integer division) is (held + 1)
 * * active <= POOL: a multiplication where the division took some 40
 * cycles. in: the share an inbound permit is judged by, with one more
 * project active (see limit_for).
 */
static __always_inline bool pool_under(struct rule_pool *r, __s64 held, bool in)
{
	__s64 pool = *r->size;
	if (held < (__s64)*r->floor)
		return true;
	__s64 active = pool_active(r, in);
	if (active <= 1)
		return held < pool;
	return (held + 1) * active <= pool;
}

/*
 * pool_limit is the in_use of pool r the rule lets project entry p take a
 * permit under: POOL under its share, POOL - FLOOR at or past it (in: see
 * limit_for).
 */
static __always_inline __s64 pool_limit(struct rule_pool *r, struct fs_project *p, bool in)
{
	__u32 size = *r->size, floor = *r->floor;
	if (pool_under(r, proj_held(r, p), in))
		return size;
	return floor < size ? size - floor : 0;
}

/*
 * rule_limit is the in_use of pool r that project id (entry p) may take a
 * permit under: the rule's limit (pool_limit), or the project's fleet cap
 * in the pool (cap_limit); for a fleet pool whose daemon's heartbeat is
 * older than its lease (cap.h, fleet_safe_now), the rule's limit in the
 * pool at the lower of its size and its safe slice, its floor at most
 * that, and no cap. Every judgment of a
 * permit (admission, sk_lookup's answer, adoption, a move) takes this one.
 */
static __always_inline __s64 rule_limit(struct fs_settings *cfg, struct rule_pool *r, __u64 id, struct fs_project *p, bool in)
{
	/* A pool that is not a fleet pool makes no call: a word of a line
	 * loaded already says so. */
	bool fleet = r->fleet_safe ? *(volatile const __u32 *)r->fleet_safe != 0 : (cfg->caps & CAPS_FLEET) != 0;
	__u32 safe = fleet ? fleet_safe_now(cfg, r->fleet_safe) : 0;
	if (!safe)
		return cap_limit(cfg, r->cap_pool, id, proj_held(r, p), pool_limit(r, p, in), *r->size);
	/* One way through for any slice (a branch for the clamp multiplied
	 * the states the verifier walks through the admission after it). */
	__u32 size = *r->size, floor = *r->floor;
	safe--;
	size = size < safe ? size : safe;
	floor = floor < size ? floor : size;
	struct rule_pool c = *r;
	c.size = &size;
	c.floor = &floor;
	return pool_limit(&c, p, in);
}

#define ADMIT_TRIES 8 /* compare-and-swap attempts on a pool's counter */

/*
 * pool_admit applies the rule to project id's entry p in pool r, or the
 * project's fleet cap in the pool when it has one (cap.h), and, if it
 * admits, takes the permit on the pool's and the project's in_use and counts
 * it in the project's admitted: 1 admitted, 0 refused. in: the permit is
 * inbound (limit_for). clk: the run's clock reading (clock_ns).
 *
 * Compare-and-swap, not fetch-add and roll back: the pool's in_use only
 * ever moves to a value the rule allows, so a reader (Snapshot, metrics)
 * never sees it above POOL, not even for an instant. Losing the race
 * ADMIT_TRIES times in a row (only under heavy contention on the one
 * counter) refuses: a spurious refusal, never an overshoot. The project's
 * admitted is bumped here, on the line the admission holds already, even
 * for a permit the caller then undoes (a race only): bumped after the
 * record instead, its locked add waited for the record's stores to the
 * slot and cost connect4 ~25 ns (loopback benchmark, medians of 6).
 */
static __always_inline int pool_admit(struct fs_settings *cfg, struct rule_pool *r, __u64 id, struct fs_project *p,
					bool fine, bool in, __u64 *clk)
{
	pool_seen(r, p, fine, clk);
	__s64 lim = rule_limit(cfg, r, id, p, in);
	bool ok = false;
#pragma unroll
	for (int i = 0; i < ADMIT_TRIES; i++) {
		__s64 used = *(volatile __s64 *)r->in_use;
		if (used >= lim)
			break;
		if (__sync_val_compare_and_swap(r->in_use, used, used + 1) == used) {
			ok = true;
			break;
		}
	}
	if (!ok)
		return 0;
	if (r->packed) {
		__sync_fetch_and_add(&p->in_use, PACKED_ADMIT);
		return 1;
	}
	__sync_fetch_and_add(&p->in_use, 1);
	__sync_fetch_and_add(&p->admitted, 1);
	return 1;
}

/*
 * pool_give gives a permit back to the pool's in_use (NULL: none) and to
 * project entry p's (NULL: gone; packed: a destination pool's,
 * PACKED_HELD_BITS). Holding counts as asking: the project stays active a
 * window after it lets go of its last permit. clk: the run's clock reading
 * (clock_ns).
 */
static __always_inline void pool_give(__s64 *in_use, struct fs_project *p, bool packed, bool fine, __u64 *clk)
{
	if (in_use)
		__sync_fetch_and_add(in_use, -1);
	if (!p)
		return;
	__s64 was = __sync_fetch_and_add(&p->in_use, -1);
	if ((packed ? packed_held(was) : was) <= 1)
		p->last_seen_ns = clock_ns(clk, fine);
}

/* node_pool is the node's connections pool as the rule takes it. */
static __always_inline struct rule_pool node_pool(struct fs_settings *cfg, struct fs_pool *n)
{
	struct rule_pool r = {.size = &cfg->pool, .floor = &cfg->floor, .window_ns = &cfg->window_ns,
			      .active = &n->active, .in_use = &n->in_use};
	return r;
}

/* rule_active is pool_active of the node's pool. */
static __always_inline __s64 rule_active(struct fs_pool *n, bool in)
{
	struct rule_pool r = {.active = &n->active};
	return pool_active(&r, in);
}

/* node_limit is rule_limit of the node's pool. */
static __always_inline __s64 node_limit(struct fs_settings *cfg, struct fs_pool *n, __u64 id, struct fs_project *p, bool in)
{
	struct rule_pool r = node_pool(cfg, n);
	return rule_limit(cfg, &r, id, p, in);
}

/* under_share is pool_under of the node's pool. */
static __always_inline bool under_share(struct fs_settings *cfg, struct fs_pool *n, __s64 held, bool in)
{
	struct rule_pool r = node_pool(cfg, n);
	return pool_under(&r, held, in);
}

/*
 * limit_for is pool_limit of the node's pool: the in_use the rule lets
 * project p take a permit under, POOL under its share, POOL - FLOOR at or
 * past it. An inbound permit (in: a
 * handshake's reservation, a child judged at ESTABLISHED, sk_lookup's
 * answer) is judged as if one more project were active: a newcomer's
 * arrival, which shrinks every share, is taken as given. How long a
 * handshake holds its permit is the client's choice: a SYN flood from
 * sources that never answer keeps its request sockets through the kernel's
 * SYN-ACK retries, a minute. Under the plain rule, one that reached a lone
 * project's share (the whole pool), or several projects' shares at once,
 * would fill the pool and shut out every project that arrives meanwhile.
 * Judged so, a flooded project past the share it would have beside a
 * newcomer stops at POOL - FLOOR: a flood pushes a project no further than a
 * newcomer's arrival would leave it, and beside a lone flooded project a
 * newcomer finds its floor at once. The SYNs past the bound are refused at
 * sk_lookup as past a share (reason FS_REASON_FLOOR), so a request socket
 * goes without its permit only in the race between sk_lookup and the
 * reservation, as before. Destination pools are outbound only: in is false
 * for them.
 */
static __always_inline __s64 limit_for(struct fs_settings *cfg, struct fs_pool *n, struct fs_project *p, bool in)
{
	struct rule_pool r = node_pool(cfg, n);
	return pool_limit(&r, p, in);
}

/*
 * exempt_listed says whether cgroup cg is in the exempt set. cg is what
 * sock_project gave: the socket's own cgroup, or the registered cgroup it is
 * in when that one is exempt (MEMBER_EXEMPT), so a registered cgroup in the
 * set exempts everything below it. id is unused.
 */
static __always_inline bool exempt_listed(__u64 cg, __u64 id)
{
	return bpf_map_lookup_elem(&fs_exempt, &cg);
}
