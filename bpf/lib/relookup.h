/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * A SYN looked up twice. The kernel runs sk_lookup wherever a listener is
 * looked up for a segment, and an nftables rule with a socket expression
 * at input (socket transparent, mark, cgroupv2, wildcard) looks the SYN's
 * socket up before TCP does: a SYN the rule refuses is refused at both
 * lookups. relooked says whether the refusal about to be counted is the
 * second of one SYN: the last refusal on this CPU, in this namespace, of
 * the same tuple, at most RELOOK_NS ago (coarse clock). Both lookups of a
 * SYN run on one CPU in one softirq, one after the other, and no sk_lookup
 * runs nested in another on a CPU (softirq context, or bottom halves off),
 * so a plain per-CPU record is enough. Only the refusal path reads or
 * writes it: an admitted SYN pays nothing.
 *
 * The price: a client that opens the same tuple again within RELOOK_NS of
 * its refusal (the RST closed its socket; a new one gets another port
 * unless it binds one) has that refusal counted and reported once for two.
 */
#pragma once

#include "events.h"

#define RELOOK_NS 10000000ULL /* 10 ms: a tick or two of the coarse clock */

struct fs_relook {
	__u64 netns;
	__u64 at_ns;
	struct fs_tuple tuple __attribute__((aligned(8)));
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

/* relooked: tu (aligned to 8) was refused in netns a moment ago on this CPU; else it is recorded. */
static __always_inline bool relooked(__u64 netns, const struct fs_tuple *tu)
{
	__u32 zero = 0;
	struct fs_relook *r = bpf_map_lookup_elem(&fs_relook, &zero);
	if (!r)
		return false;
	__u64 now = bpf_ktime_get_coarse_ns();
	if (r->netns == netns && now - r->at_ns <= RELOOK_NS && same_tuple(&r->tuple, tu))
		return true;
	r->netns = netns;
	r->at_ns = now;
	__builtin_memcpy(&r->tuple, tu, sizeof(*tu));
	return false;
}
