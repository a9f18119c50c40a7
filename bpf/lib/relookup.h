/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * A SYN looked up twice. The kernel runs sk_lookup wherever a listener is
 * looked up for a segment, and an nftables rule with a socket expression
 * at input (socket transparent, mark, cgroupv2, wildcard) looks the SYN's
 * socket up before TCP does: every SYN is looked up twice. A SYN must get
 * one answer, counted once and taking at most one rate token, so the first
 * lookup records its verdict and the second replays it: the last verdict
 * on this CPU, in this namespace, for the same tuple, at most RELOOK_NS ago
 * (coarse clock). Both lookups of a SYN run on one CPU in one softirq, one
 * after the other, and no sk_lookup runs nested in another on a CPU
 * (softirq context, or bottom halves off), so a plain per-CPU record is
 * enough. A project without a rate reads and writes it on the refusal path
 * only (its admitted SYN takes nothing at sk_lookup, so a second lookup
 * admitting it again costs nothing); a project with a rate reads it before
 * taking a token and writes it once per SYN.
 *
 * The price: a client that opens the same tuple again within RELOOK_NS of
 * its last SYN (the RST closed its socket; a new one gets another port
 * unless it binds one) gets that SYN's answer again, counted once for two,
 * and with a rate, without taking a token. The ACK of a SYN cookie comes
 * through sk_lookup with the SYN's tuple: within RELOOK_NS it is given the
 * SYN's answer, takes no second token and is not counted again.
 */
#pragma once

#include "events.h"

#define RELOOK_NS 10000000ULL /* 10 ms: a tick or two of the coarse clock */

/* The verdict recorded. */
enum relook_verdict {
	RELOOK_NONE = 0, /* no record of this SYN */
	RELOOK_DROP = 1, /* refused, counted and reported */
	RELOOK_PASS = 2, /* admitted (dry-run: counted and reported as would-be) */
};

struct fs_relook {
	__u64 netns;
	__u64 at_ns;
	struct fs_tuple tuple __attribute__((aligned(8)));
	__u32 verdict; /* enum relook_verdict */
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fs_relook);
} fs_relook SEC(".maps"); /* not pinned: a moment's memory */

/* same_tuple compares two tuples aligned to 8 bytes (36 bytes: 4 words and a half). */
static __always_inline bool same_tuple(const struct fs_tuple *a, const struct fs_tuple *b)
{
	const __u64 *x = (const __u64 *)a, *y = (const __u64 *)b;
	return x[0] == y[0] && x[1] == y[1] && x[2] == y[2] && x[3] == y[3] &&
	       *(const __u32 *)&x[4] == *(const __u32 *)&y[4];
}

/* relook_seen is the verdict given a moment ago on this CPU to tu (aligned to 8) in netns. */
static __always_inline int relook_seen(__u64 netns, const struct fs_tuple *tu)
{
	__u32 zero = 0;
	struct fs_relook *r = bpf_map_lookup_elem(&fs_relook, &zero);
	if (!r)
		return RELOOK_NONE;
	if (r->netns == netns && bpf_ktime_get_coarse_ns() - r->at_ns <= RELOOK_NS && same_tuple(&r->tuple, tu))
		return r->verdict;
	return RELOOK_NONE;
}

/* relook_note records verdict for tu (aligned to 8) in netns, now, on this CPU. */
static __always_inline void relook_note(__u64 netns, const struct fs_tuple *tu, int verdict)
{
	__u32 zero = 0;
	struct fs_relook *r = bpf_map_lookup_elem(&fs_relook, &zero);
	if (!r)
		return;
	r->netns = netns;
	r->at_ns = bpf_ktime_get_coarse_ns();
	__builtin_memcpy(&r->tuple, tu, sizeof(*tu));
	r->verdict = verdict;
}
