/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The rule (pools/doc.go) and the permits it hands out: admission under
 * POOL and FLOOR with share = max(FLOOR, POOL / active), the exempt budget,
 * and take_permit, the one sequence every admission path runs (take a
 * permit, record it, undo it if it cannot be recorded). The end of a
 * permit's life is here too: give_back, and end_held and end_resv, which end
 * a table entry and give its permit back to the budget it came from.
 */
#pragma once

#include "project.h"
#include "addr.h"
#include "share.h"
#include "cap.h"
#include "held.h"
#include "resv.h"
#include "events.h"
#include "dest.h"

/*
 * seen is pool_seen (share.h) of the node's pool: the project's ask
 * stamped, a newcomer counted into the node's active count.
 */
static __always_inline void seen(struct fs_settings *cfg, struct fs_pool *n, struct fs_project *p, bool fine)
{
	struct rule_pool r = node_pool(cfg, n);
	__u64 clk = 0;
	pool_seen(&r, p, fine, &clk);
}

/*
 * admit applies the rule to project id's entry p (NULL: the project map is
 * full) in the node's pool (pool_admit, share.h), or its fleet cap when it
 * has one (cap.h), and, if it admits, takes the permit on the node's and the
 * project's in_use and counts it in the project's admitted. Returns 1
 * admitted, 0 refused, -1 not counted (no config, or no entry: counted as
 * map_full). in: the permit is inbound (limit_for). clk: the run's clock
 * reading (clock_ns).
 */
static __always_inline int admit(struct fs_project *p, __u64 id, bool fine, bool in, __u64 *clk)
{
	struct fs_settings *cfg = settings();
	struct fs_pool *n = node();
	if (!cfg || !n)
		return -1;
	if (!p) {
		COUNT(map_full);
		return -1;
	}
	struct rule_pool r = node_pool(cfg, n);
	return pool_admit(cfg, &r, id, p, fine, in, clk);
}

/*
 * would_admit applies the rule without taking a permit: sk_lookup's answer
 * to every segment for a project's listener (it cannot tell a SYN from
 * another segment); the permit is taken when the kernel makes the request
 * socket (fs_sockops), or when the child of a SYN cookie is established.
 */
static __always_inline int would_admit(struct fs_project *p, __u64 id, bool fine)
{
	struct fs_settings *cfg = settings();
	struct fs_pool *n = node();
	if (!cfg || !n || !p)
		return -1;
	seen(cfg, n, p, fine);
	if (*(volatile __s64 *)&n->in_use < node_limit(cfg, n, id, p, true))
		return 1;
	return 0; /* the caller counts the refusal, or dry-run's admission */
}

/*
 * unadmit gives a pool permit back to the node's in_use and to project
 * entry p's (NULL: gone). Holding counts as asking: the project stays
 * active a window after it lets go of its last permit. clk: the run's
 * clock reading (clock_ns).
 */
static __always_inline void unadmit(struct fs_project *p, bool fine, __u64 *clk)
{
	struct fs_pool *n = node();
	pool_give(n ? &n->in_use : NULL, p, false, fine, clk);
}

/* release gives back a pool permit of project id that was held. */
static __always_inline void release(__u64 id, bool fine, __u64 *clk)
{
	unadmit(project_get(id), fine, clk);
	COUNT(released);
}

/* force takes a permit without the rule: the connection already exists. */
static __always_inline void force(__u64 id, bool fine)
{
	struct fs_settings *cfg = settings();
	struct fs_pool *n = node();
	struct fs_project *p = project_get(id);
	if (!n)
		return;
	if (p && cfg)
		seen(cfg, n, p, fine);
	__sync_fetch_and_add(&n->in_use, 1);
	if (p)
		__sync_fetch_and_add(&p->in_use, 1);
}

/*
 * exempt_take takes an exempt permit for a socket of cgroup cg (with task:
 * the calling task's cgroup, asked for only once the set is known to be
 * non-empty) in project id if either is in the exempt set and the budget has
 * room. Over the budget it returns false and the socket is treated like any
 * other of its project: the exempt set can add at most exempt_max
 * connections to the POOL the rule bounds. The budget is taken with a
 * fetch-add, rolled back when it went over: the exempt permits held never
 * exceed exempt_max, though the counter may for the instant between a
 * losing add and its roll-back (the pool's in_use, which readers compare
 * with POOL, is taken with a compare-and-swap so that it never does).
 */
static __always_inline bool exempt_take(bool task, __u64 cg, __u64 id)
{
	struct fs_settings *cfg = settings();
	struct fs_pool *n = node();
	/* exempt_max is 0 while the set is empty: no lookup on the common path. */
	if (!cfg || !n || !cfg->exempt_max)
		return false;
	if (task && !cg)
		cg = bpf_get_current_cgroup_id();
	if (!exempt_listed(cg, id))
		return false;
	__s64 used = __sync_fetch_and_add(&n->exempt_in_use, 1);
	if (used >= cfg->exempt_max) {
		__sync_fetch_and_add(&n->exempt_in_use, -1);
		COUNT(exempt_over);
		return false;
	}
	return true;
}

/*
 * exempt_room says whether cgroup cg or project id is exempt and the exempt
 * budget has room now (what exempt_take would say, taking nothing).
 */
static __always_inline bool exempt_room(struct fs_settings *cfg, __u64 cg, __u64 id)
{
	struct fs_pool *n = node();
	if (!cfg->exempt_max || !n || !exempt_listed(cg, id))
		return false;
	return *(volatile __s64 *)&n->exempt_in_use < cfg->exempt_max;
}

/* exempt_undo gives an exempt permit back without counting a release. */
static __always_inline void exempt_undo(void)
{
	struct fs_pool *n = node();
	if (n)
		__sync_fetch_and_add(&n->exempt_in_use, -1);
}

/* give_back releases a held permit or a reservation of either budget (clk: clock_ns). */
static __always_inline void give_back(__u64 id, __u32 kind, bool fine, __u64 *clk)
{
	if (KIND_IS_EXEMPT(kind)) {
		exempt_undo();
		COUNT(exempt_released);
		return;
	}
	release(id, fine, clk);
}

/* Where take_permit takes a permit: where it is recorded, what is counted. */
#define AT_CONNECT 1 /* connect(): held by the socket; admitted_out, refused_out */
#define AT_SYN 2     /* an inbound handshake's request socket: reserved for its cookie; admitted_in
		      * (a refusal refuses nothing here: sk_lookup refuses at the SYN) */
#define AT_CHILD 3   /* a child at ESTABLISHED without a reservation: held by it;
		      * admitted_in, and unaccounted when refused (it exists already) */

/* Who a permit is for: a socket or a handshake (its request socket). */
struct holder {
	__u64 cookie;    /* the socket's cookie (AT_SYN: the request socket's) */
	struct sock *sk; /* AT_CONNECT, AT_CHILD: the socket (its netns is
			  * read only once the permit is taken), or NULL */
	__u64 netns;     /* AT_SYN: the request socket's netns cookie */
	__u32 dest;      /* AT_CONNECT: the destination pool whose permit the
			  * caller took (dest.h), kept with the permit */
	__u64 clk;       /* the run's clock reading, 0 until read (clock_ns):
			  * the destination pool's and the node's stamps share it */
	__u32 kind_out;  /* AT_CONNECT: the kind its permit takes, KIND_OUT, or
			  * for an unclassified pod's (project.h) KIND_OUT_LAX
			  * (in a lapse) or KIND_OUT_HOST (never refused):
			  * connect_kind's */
};

/* Outcomes of take_permit. */
#define REFUSED 0   /* the rule refused: nothing is held */
#define TAKEN 1     /* a permit is taken and recorded */
#define NOT_TAKEN 2 /* nothing taken and no refusal: the holder has its permit
		     * already, or a table is full (uncounted; map_full) */
#define WOULD 3     /* dry-run (events.h): the rule refused, the permit was
		     * taken and recorded past it; the caller emits and admits */

/*
 * record keeps a permit of project id and kind for h, as a reservation at
 * AT_SYN (stamped with now_ns(fine)), else in the held-permit table: 0,
 * -EEXIST if h has one already, another error if the table is full (counted
 * as map_full).
 */
static __always_inline long record(int at, bool fine, struct holder *h, __u64 id, __u32 kind)
{
	long err;
	if (at == AT_SYN) {
		struct fs_resv r = {.project = id, .since_ns = now_ns(fine), .netns = h->netns, .kind = kind};
		err = resv_put(h->cookie, &r);
	} else {
		struct fs_sock v = {.project = id, .netns = h->sk ? sock_netns(h->sk) : 0, .kind = kind, .dest = h->dest};
		err = hold(h->cookie, &v);
	}
	if (err && err != -EEXIST)
		COUNT(map_full);
	return err;
}

/* recorded says whether h has a permit recorded already. */
static __always_inline bool recorded(int at, struct holder *h)
{
	return at == AT_SYN ? resv_find(h->cookie) : held_find(h->cookie, false) != NULL;
}

__noinline int connect_stale(__u64 cookie);

/*
 * take_permit is every admission: a permit for h, of project id (its entry
 * p, or NULL to look it up and create it) and of cgroup cg (at AT_CONNECT
 * the calling task's, read only when the exempt set is not empty), taken at
 * at, with the clock now_ns(fine) (both constants at every call: the code
 * of the other places and clock is compiled out).
 *
 *   take    from the exempt budget if cg or id is exempt and the budget has
 *           room, else under the rule (admit);
 *   record  it for h (record);
 *   undo    it if it cannot be recorded: h has a permit already (a
 *           retransmitted SYN, a child adopted by the reconcile dump), or
 *           the table is full.
 *
 * At AT_CONNECT a permit the socket holds already is a leftover
 * (connect_stale): it is ended, with its destination pool's, and the
 * connect asks again as a socket that holds none, once.
 *
 * TAKEN counts admitted_out (AT_CONNECT) or admitted_in, or exempt_admitted
 * for an exempt permit. REFUSED counts refused_out, refused_in or
 * unaccounted (AT_CHILD), and the project's refused; a holder that has its
 * permit already is NOT_TAKEN, not refused. An undone permit goes back
 * without a release counted: the node never counted it admitted (the
 * project's admitted did, see admit).
 *
 * moved, nonzero, is the kind of a reservation's permit moving to its child
 * (AT_CHILD; a reservation's kind is never 0): nothing is taken, the permit
 * is recorded for h, counted nowhere (its SYN counted it), and given back as
 * an ended permit (give_back, counted released) if it cannot be recorded.
 * Taking it here rather than recording it in on_established keeps one
 * record, so one inlined hold, in fs_set_state (818 -> 750 instructions).
 */
static __always_inline int take_permit(int at, bool fine, struct holder *h, __u64 id, struct fs_project *p, __u64 cg, __u32 moved)
{
	bool ex = false, would = false, stale = false, lax = false;
	/* The clock reading is shared with the destination pool's (h->clk)
	 * at a connect only: elsewhere each use reads its own, as before
	 * (at is a constant, so the code there is what it was). */
	__u64 c0 = 0, c1 = 0;
	__u64 *clk_admit = at == AT_CONNECT ? &h->clk : &c0;
	__u64 *clk_undo = at == AT_CONNECT ? &h->clk : &c1;
	if (moved)
		goto keep;
again:
	ex = exempt_take(at == AT_CONNECT, cg, id);
	if (!ex) {
		if (!p)
			p = project_get(id);
		int a = admit(p, id, fine, at != AT_CONNECT, clk_admit);
		if (a < 0)
			return NOT_TAKEN;
		if (a == 0) {
			/* Looked up only here, on the refusal path: on the
			 * common path record finds it (EEXIST). */
			if (recorded(at, h)) {
				if (at == AT_CONNECT && !stale) {
					stale = true;
					connect_stale(h->cookie);
					goto again;
				}
				return NOT_TAKEN;
			}
			/* In dry-run a request socket takes its permit past
			 * the rule: sk_lookup counted and reported its SYN's
			 * would-be refusal already. */
			if (dry_run(id)) {
				take_past_rule(p);
				would = at != AT_SYN;
				lax = true;
				goto kind;
			}
			/* An unclassified pod of the host's network namespace
			 * is never refused (project.h): past the rule, no
			 * would-be refusal reported. Nor is one whose connect
			 * began in a lapse (KIND_OUT_LAX) that ended since: a
			 * host pod's among them. */
			if (at == AT_CONNECT && (h->kind_out == KIND_OUT_HOST || h->kind_out == KIND_OUT_LAX)) {
				take_past_rule(p);
				goto kind;
			}
			/* A request socket exists already, whatever the rule
			 * says now (sk_lookup admitted its SYN a moment ago):
			 * nothing is refused, its child is judged when it is
			 * established. */
			if (at == AT_SYN)
				return REFUSED;
			__sync_fetch_and_add(&p->refused, 1);
			if (at == AT_CONNECT)
				COUNT(refused_out);
			else
				COUNT(unaccounted);
			return REFUSED;
		}
	}
	__u32 kind;
kind:
	kind = at == AT_CONNECT ? (ex ? KIND_EXEMPT_OUT : lax ? KIND_OUT_LAX : h->kind_out) : (ex ? KIND_EXEMPT_IN : KIND_IN);
keep:
	if (moved)
		kind = moved;
	long err;
record:
	err = record(at, fine, h, id, kind);
	if (err) {
		if (at == AT_CONNECT && err == -EEXIST && !stale) {
			stale = true;
			connect_stale(h->cookie);
			goto record;
		}
		if (moved) {
			give_back(id, kind, fine, clk_undo);
			return NOT_TAKEN;
		}
		if (ex)
			exempt_undo();
		else
			unadmit(p, fine, clk_undo);
		return NOT_TAKEN;
	}
	if (moved)
		return TAKEN;
	if (ex) {
		COUNT(exempt_admitted);
		return TAKEN;
	}
	if (at == AT_CONNECT)
		COUNT(admitted_out);
	else
		COUNT(admitted_in);
	if (would) {
		count_would(id, at == AT_CONNECT ? FS_DIR_CONNECT : FS_DIR_SYN);
		return WOULD;
	}
	return TAKEN;
}

/*
 * end_held ends the permit held for cookie and gives it back, with the
 * destination pool's permit taken with it: true if this call ended it
 * (unhold). The spill table is looked at only while it has entries, unless
 * always (user-space paths).
 */
static __always_inline bool end_held(__u64 cookie, bool fine, bool always)
{
	__u64 id = 0;
	__u32 kind = 0, dest = 0;
	if (!unhold(cookie, &id, &kind, &dest, always))
		return false;
	__u64 clk = 0;
	give_back(id, kind, fine, &clk);
	if (dest)
		dest_release(dest, id, fine, &clk);
	return true;
}

/*
 * connect_stale ends the permit a socket about to connect holds from an
 * earlier connect() of its own, and gives it back with its destination
 * pool's: 1 if it ended one. The hook runs only on a socket that is
 * unconnected and closed, under its lock, so a permit it holds was taken by
 * a connect() that failed past this hook and before the socket left
 * TCP_CLOSE (no route, a multicast or broadcast address, another cgroup's
 * program refusing it), which no state change released. Kept as it was,
 * that permit would stand for the new connect, in the destination pool of
 * the old one: a connect() to an unroutable address, then to the database,
 * reached it past its pool every time, and the first pool stayed charged.
 * A function of its own: the path is rare, and the release inlined in
 * connect4 would be verified again in every path that reaches it.
 */
__noinline int connect_stale(__u64 cookie)
{
	return end_held(cookie, CLK_COARSE, true);
}

/*
 * end_resv ends the reservation of cookie and gives its permit back: true if
 * this call ended it (resv_take, with its always and since).
 */
static __always_inline bool end_resv(__u64 cookie, bool fine, bool always, __u64 since)
{
	__u64 id = 0;
	__u32 kind = 0;
	if (!resv_take(cookie, &id, &kind, always, since))
		return false;
	__u64 clk = 0;
	give_back(id, kind, fine, &clk);
	return true;
}
