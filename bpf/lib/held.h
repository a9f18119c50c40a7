/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The held-permit table: a permit held by a socket is an entry keyed by the
 * socket cookie, in fs_slots or, when its slot is taken, in fs_held. Neither
 * is sk_storage: creating socket storage costs a kmalloc with memory-cgroup
 * accounting on every connect (~0.8 us measured here).
 *
 * fs_slots is an array indexed by the low bits of the cookie. The kernel
 * hands cookies out in per-CPU runs of consecutive numbers, so the sockets
 * of a connection loop fill neighbouring slots, whose cache lines are still
 * warm; a slot is claimed and freed with one compare-and-swap, and an array
 * lookup is inlined by the verifier (no helper call, no hashing, no bucket
 * lock). Measured here: the hash insert this replaced cost ~360 ns of the
 * connect program, its lookup ~175 ns of sock_release.
 *
 * fs_held is the spill table for a cookie whose slot a long-lived socket
 * still holds. Node spilled counts its entries, so that while it is empty
 * (nearly always) the release paths do not look into it.
 *
 * Both are sized from POOL by the loader: 2 x POOL rounded up to a power of
 * two, so slots collide rarely and the spill table cannot fill first.
 *
 * This header only keeps the table: hold records, unhold ends, and only the
 * caller whose unhold succeeds owns the permit (and the destination pool's
 * permit taken with it, dest.h); the counters are rule.h's and dest.h's.
 */
#pragma once

#include "maps.h"

volatile const __u64 slot_mask; /* entries of fs_slots - 1 (a power of two), set at load */

static __always_inline struct fs_slot *slot_of(__u64 cookie)
{
	__u32 i = cookie & slot_mask;
	return bpf_map_lookup_elem(&fs_slots, &i);
}

/* spill_empty says whether both spill tables (fs_held, fs_reservations) are empty. */
static __always_inline bool spill_empty(void)
{
	struct fs_pool *n = node();
	return !n || n->spilled <= 0;
}

/*
 * held_find returns the permit held for cookie, or NULL. The spill table
 * is looked at only while it has entries, unless always (user-space paths).
 */
static __always_inline struct fs_sock *held_find(__u64 cookie, bool always)
{
	struct fs_slot *s = slot_of(cookie);
	if (s && s->cookie == cookie)
		return &s->sock;
	if (!always && spill_empty())
		return NULL;
	return bpf_map_lookup_elem(&fs_held, &cookie);
}

/*
 * hold records the permit v for cookie: 0, -EEXIST if the socket holds one
 * already, another error if both tables are full.
 */
static __always_inline long hold(__u64 cookie, struct fs_sock *v)
{
	struct fs_slot *s = slot_of(cookie);
	if (!s)
		return -1;
	if (__sync_val_compare_and_swap(&s->cookie, 0, cookie | SLOT_BUSY) == 0) {
		/* The socket may hold a permit in the spill table from before
		 * its slot was freed (connect() called again). */
		if (!spill_empty() && bpf_map_lookup_elem(&fs_held, &cookie)) {
			__sync_lock_test_and_set(&s->cookie, 0);
			return -EEXIST;
		}
		s->sock = *v;
		publish(&s->cookie, cookie);
		return 0;
	}
	if ((s->cookie & ~SLOT_BUSY) == cookie)
		return -EEXIST;
	struct fs_pool *n = node();
	if (!n)
		return -1;
	/* Counted before the insert, so that a reader who finds the count at
	 * zero cannot miss an entry already in. Two holds of one cookie never
	 * race (the socket's lock serialises connect(), the child is
	 * established once), so the slot and the spill table cannot both take
	 * it as fs_resv_slots could (see resv_put). */
	__sync_fetch_and_add(&n->spilled, 1);
	long err = bpf_map_update_elem(&fs_held, &cookie, v, BPF_NOEXIST);
	if (err)
		__sync_fetch_and_add(&n->spilled, -1);
	return err;
}

/*
 * unhold ends the permit held for cookie. Only the caller whose
 * compare-and-swap (or delete) succeeds gets true and the permit's project,
 * kind and destination pool, so a permit is given back exactly once however many release
 * paths race. The fields are read while the slot still names the cookie:
 * nobody writes a slot's fields but the one who claimed it empty.
 */
static __always_inline bool unhold(__u64 cookie, __u64 *id, __u32 *kind, __u32 *dest, bool always)
{
	struct fs_slot *s = slot_of(cookie);
	if (s && s->cookie == cookie) {
		*id = s->sock.project;
		*kind = s->sock.kind;
		*dest = s->sock.dest;
		return __sync_val_compare_and_swap(&s->cookie, cookie, 0) == cookie;
	}
	if (!always && spill_empty())
		return false;
	struct fs_sock *h = bpf_map_lookup_elem(&fs_held, &cookie);
	if (!h)
		return false;
	*id = h->project;
	*kind = h->kind;
	*dest = h->dest;
	if (bpf_map_delete_elem(&fs_held, &cookie))
		return false;
	struct fs_pool *n = node();
	if (n)
		__sync_fetch_and_add(&n->spilled, -1);
	return true;
}
