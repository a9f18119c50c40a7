/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The reservation table: a permit taken at an inbound SYN, keyed by the
 * handshake's 4-tuple, until the child socket exists. Two tables, as held
 * permits have (held.h). fs_resv_slots is a small array indexed by a hash of
 * the tuple; a slot is claimed and freed with a compare-and-swap of its tag
 * (the hash, never 0; SLOT_BUSY while it is being filled). fs_reservations is
 * the spill table for a tuple whose slot another handshake holds, looked at
 * only while node spilled says it has entries. Handshakes in flight are few
 * (a reservation lives one round trip), so RESV_SLOTS slots of 64 bytes,
 * 16 KiB in all, stay in the cache and in a page the TLB keeps: measured
 * here (bpf_stats, loopback connect loop), a slot in a table sized from
 * POOL, a cold line per SYN, cost sk_lookup ~190 of its ~260 ns above the
 * empty program's. A SYN flood spills into the hash table and pays a cold
 * line there.
 *
 * This header only keeps the table: resv_put records, resv_take ends, and
 * only the caller whose resv_take succeeds owns the permit; the counters are
 * rule.h's.
 */
#pragma once

#include "held.h"

/*
 * resv_hash places a tuple: its words folded with exclusive-or, the ports
 * shifted where they do not meet the addresses' v4-mapped prefix, times an
 * odd constant; the slot is taken from the top bits, which every bit of the
 * fold reaches. The table is small and every slot of it warm, so spreading
 * matters more than mixing: one multiplication, where a chain of five took
 * ~15 ns of sk_lookup and as much of the conversion at ESTABLISHED. Tuples
 * that fold alike share a slot and the later ones spill; the full key is
 * compared either way.
 */
static __always_inline __u64 resv_hash(const struct fs_resv_key *k)
{
	const __u64 *w = (const __u64 *)k;
	__u64 f = w[0] ^ w[1] ^ w[2] ^ w[3] ^ ((__u64)k->lport << 16 | (__u64)k->rport << 40);
	return f * 0x9e3779b97f4a7c15ULL;
}

/* resv_tagof is a slot's tag for hash h: nonzero, without SLOT_BUSY. */
static __always_inline __u64 resv_tagof(__u64 h)
{
	return (h | 1) & ~SLOT_BUSY;
}

static __always_inline struct fs_resv_slot *resv_slot(__u64 h)
{
	__u32 i = h >> 56; /* the top 8 bits: RESV_SLOTS */
	return bpf_map_lookup_elem(&fs_resv_slots, &i);
}

static __always_inline bool resv_key_eq(const struct fs_resv_key *a, const struct fs_resv_key *b)
{
	const __u64 *x = (const __u64 *)a, *y = (const __u64 *)b;
	const __u32 *xp = (const __u32 *)&a->lport, *yp = (const __u32 *)&b->lport;
	return x[0] == y[0] && x[1] == y[1] && x[2] == y[2] && x[3] == y[3] && *xp == *yp;
}

static __always_inline void resv_key_copy(struct fs_resv_key *dst, const struct fs_resv_key *src)
{
	__u64 *d = (__u64 *)dst;
	const __u64 *s = (const __u64 *)src;
	d[0] = s[0];
	d[1] = s[1];
	d[2] = s[2];
	d[3] = s[3];
	*(__u32 *)&dst->lport = *(const __u32 *)&src->lport;
}

/* resv_find returns whether k holds a reservation. */
static __always_inline bool resv_find(struct fs_resv_key *k)
{
	__u64 h = resv_hash(k);
	struct fs_resv_slot *s = resv_slot(h);
	if (s && s->tag == resv_tagof(h) && resv_key_eq(&s->key, k))
		return true;
	if (spill_empty())
		return false;
	return bpf_map_lookup_elem(&fs_reservations, k) != NULL;
}

/*
 * resv_slot_put is the first half of resv_put: claim k's slot if it is free.
 * 0 done, -EEXIST k has a reservation (in the slot, or in the spill table
 * from before the slot was freed), 1 the slot holds another tuple: spill.
 */
static __always_inline long resv_slot_put(struct fs_resv_slot *s, __u64 tag, struct fs_resv_key *k, struct fs_resv *r)
{
	if (__sync_val_compare_and_swap(&s->tag, 0, tag | SLOT_BUSY) == 0) {
		/* After the claim (a full barrier): a spill insert of k that
		 * this lookup misses sees the claim in resv_spill_put and backs
		 * off. */
		if (!spill_empty() && bpf_map_lookup_elem(&fs_reservations, k)) {
			__sync_lock_test_and_set(&s->tag, 0);
			return -EEXIST;
		}
		resv_key_copy(&s->key, k);
		s->kind = r->kind;
		s->project = r->project;
		s->since_ns = r->since_ns;
		publish(&s->tag, tag);
		return 0;
	}
	__u64 cur = s->tag;
	if (cur == (tag | SLOT_BUSY) || (cur == tag && resv_key_eq(&s->key, k)))
		return -EEXIST;
	return 1;
}

/*
 * resv_spill_put is the second half of resv_put: k's slot held another tuple
 * when resv_slot_put looked, so k goes to the spill table. The slot may have
 * been freed since and claimed for k by another CPU (a retransmitted or
 * duplicated SYN) whose look into the spill table came before this insert:
 * k would then be reserved twice, two permits for one handshake. So the slot
 * is read again after the insert, with a compare-and-swap that changes
 * nothing but orders the read after it, and if it is being filled with k's
 * tag or holds k, this insert backs off. (Both may back off; k then goes
 * unreserved and its child is admitted when it is established.)
 */
static __always_inline long resv_spill_put(struct fs_resv_slot *s, __u64 tag, struct fs_resv_key *k, struct fs_resv *r)
{
	struct fs_pool *n = node();
	if (!n)
		return -1;
	/* Counted before the insert, so that a reader who finds the count at
	 * zero cannot miss an entry already in. */
	__sync_fetch_and_add(&n->spilled, 1);
	long err = bpf_map_update_elem(&fs_reservations, k, r, BPF_NOEXIST);
	if (err) {
		__sync_fetch_and_add(&n->spilled, -1);
		return err;
	}
	__u64 cur = __sync_val_compare_and_swap(&s->tag, 0, 0);
	if (cur != (tag | SLOT_BUSY) && !(cur == tag && resv_key_eq(&s->key, k)))
		return 0;
	if (bpf_map_delete_elem(&fs_reservations, k))
		return 0; /* already ended (converted, undone or expired): it was used */
	__sync_fetch_and_add(&n->spilled, -1);
	return -EEXIST;
}

/*
 * resv_put records reservation r for k: 0, -EEXIST if k has one already (a
 * retransmitted SYN, or a SYN of the same tuple on another CPU), another
 * error if both tables are full.
 */
static __always_inline long resv_put(struct fs_resv_key *k, struct fs_resv *r)
{
	__u64 h = resv_hash(k), tag = resv_tagof(h);
	struct fs_resv_slot *s = resv_slot(h);
	if (!s)
		return -1;
	long err = resv_slot_put(s, tag, k, r);
	if (err <= 0)
		return err;
	return resv_spill_put(s, tag, k, r);
}

/*
 * resv_take ends the reservation of k. Only the caller whose
 * compare-and-swap (or delete) succeeds gets true and the reservation's
 * project and kind: its permit goes to exactly one of the conversion at
 * ESTABLISHED, the undo at an RST and the expiry. The spill table is looked
 * at only while it has entries, unless always (user-space paths). A
 * non-zero since ends only a reservation stamped since (the expiry's).
 */
static __always_inline bool resv_take(struct fs_resv_key *k, __u64 *id, __u32 *kind, bool always, __u64 since)
{
	__u64 h = resv_hash(k), tag = resv_tagof(h);
	struct fs_resv_slot *s = resv_slot(h);
	if (s && s->tag == tag && resv_key_eq(&s->key, k)) {
		if (since && s->since_ns != since)
			return false;
		*id = s->project;
		*kind = s->kind;
		return __sync_val_compare_and_swap(&s->tag, tag, 0) == tag;
	}
	if (!always && spill_empty())
		return false;
	struct fs_resv *r = bpf_map_lookup_elem(&fs_reservations, k);
	if (!r || (since && r->since_ns != since))
		return false;
	*id = r->project;
	*kind = r->kind;
	if (bpf_map_delete_elem(&fs_reservations, k))
		return false;
	struct fs_pool *n = node();
	if (n)
		__sync_fetch_and_add(&n->spilled, -1);
	return true;
}
