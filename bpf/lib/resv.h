/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The reservation table: a permit taken for an inbound handshake when the
 * kernel makes its request socket (fs_sockops at BPF_SOCK_OPS_TIMEOUT_INIT),
 * until the child socket exists. It is keyed by the request socket's cookie,
 * which the kernel copies to the child (inet_csk_clone_lock), so the child
 * at ESTABLISHED finds its handshake's reservation by its own cookie.
 *
 * A cookie is unique on the host and never reused: the key names one
 * handshake of one network namespace, and a slot's tag (the cookie itself)
 * can never come back for another handshake, so a compare-and-swap on it
 * ends exactly the reservation it read (no ABA, as a tag made from a hash of
 * the 4-tuple had: a client could choose a colliding source port).
 *
 * Two tables, as held permits have (held.h): fs_resv_slots, a small array
 * indexed by the cookie's low bits (the kernel hands cookies out in per-CPU
 * runs, so handshakes in flight spread over neighbouring slots), claimed and
 * freed with a compare-and-swap of the tag (SLOT_BUSY while it is filled);
 * and fs_reservations, the spill table for a cookie whose slot another
 * handshake holds, looked at only while node spilled says it has entries.
 * Handshakes in flight are few (a reservation lives one round trip), so
 * RESV_SLOTS slots stay in the cache. A request socket is made once, so two
 * CPUs never record the same cookie: the slot and the spill table cannot
 * both take it.
 *
 * This header only keeps the table: resv_put records, resv_take ends, and
 * only the caller whose resv_take succeeds owns the permit; the counters are
 * rule.h's.
 */
#pragma once

#include "held.h"

static __always_inline struct fs_resv_slot *resv_slot(__u64 cookie)
{
	__u32 i = cookie & (RESV_SLOTS - 1);
	return bpf_map_lookup_elem(&fs_resv_slots, &i);
}

/* resv_find returns whether cookie holds a reservation. */
static __always_inline bool resv_find(__u64 cookie)
{
	struct fs_resv_slot *s = resv_slot(cookie);
	if (s && s->tag == cookie)
		return true;
	if (spill_empty())
		return false;
	struct fs_resv_key k = {.cookie = cookie};
	return bpf_map_lookup_elem(&fs_reservations, &k) != NULL;
}

/*
 * resv_put records reservation r for cookie: 0, -EEXIST if it has one
 * already, another error if both tables are full.
 */
static __always_inline long resv_put(__u64 cookie, struct fs_resv *r)
{
	struct fs_resv_slot *s = resv_slot(cookie);
	if (!s)
		return -1;
	struct fs_resv_key k = {.cookie = cookie};
	if (__sync_val_compare_and_swap(&s->tag, 0, cookie | SLOT_BUSY) == 0) {
		if (!spill_empty() && bpf_map_lookup_elem(&fs_reservations, &k)) {
			__sync_lock_test_and_set(&s->tag, 0);
			return -EEXIST;
		}
		s->resv = *r;
		publish(&s->tag, cookie);
		return 0;
	}
	if ((s->tag & ~SLOT_BUSY) == cookie)
		return -EEXIST;
	struct fs_pool *n = node();
	if (!n)
		return -1;
	/* Counted before the insert, so that a reader who finds the count at
	 * zero cannot miss an entry already in. */
	__sync_fetch_and_add(&n->spilled, 1);
	long err = bpf_map_update_elem(&fs_reservations, &k, r, BPF_NOEXIST);
	if (err)
		__sync_fetch_and_add(&n->spilled, -1);
	return err;
}

/*
 * resv_take ends the reservation of cookie. Only the caller whose
 * compare-and-swap (or delete) succeeds gets true and the reservation's
 * project and kind: its permit goes to exactly one of the conversion at
 * ESTABLISHED and the expiry. The spill table is looked at only while it has
 * entries, unless always (user-space paths). A non-zero since ends only a
 * reservation stamped since (the expiry's, which read it earlier).
 */
static __always_inline bool resv_take(__u64 cookie, __u64 *id, __u32 *kind, bool always, __u64 since)
{
	struct fs_resv_slot *s = resv_slot(cookie);
	if (s && s->tag == cookie) {
		if (since && s->resv.since_ns != since)
			return false;
		*id = s->resv.project;
		*kind = s->resv.kind;
		return __sync_val_compare_and_swap(&s->tag, cookie, 0) == cookie;
	}
	if (!always && spill_empty())
		return false;
	struct fs_resv_key k = {.cookie = cookie};
	struct fs_resv *r = bpf_map_lookup_elem(&fs_reservations, &k);
	if (!r || (since && r->since_ns != since))
		return false;
	*id = r->project;
	*kind = r->kind;
	if (bpf_map_delete_elem(&fs_reservations, &k))
		return false;
	struct fs_pool *n = node();
	if (n)
		__sync_fetch_and_add(&n->spilled, -1);
	return true;
}
