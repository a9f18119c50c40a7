/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Fleet caps (package fleet, "Locally"): a bound per (pool, project) on what
 * a project may hold on this node, which the daemon sets from the fleet's
 * computation (the node's part of the project's fleet allocation) for a pool
 * marked fleet: true. A capped project is admitted while it holds fewer than
 * its cap and the pool's in_use is under its POOL: the cap takes the place
 * of the share and the floor, as in the user-space pools (pools.SetCaps),
 * since the fleet kept the floor back already and split the rest.
 *
 *   fs_caps   array of __u32, index pool * cap_stride + project, where pool
 *             0 is the node's connections pool and 1.. the destination
 *             pools (dest.h); value: the cap plus one, 0 for none. Entry
 *             pool * cap_stride (project 0, never a project) is the cap of
 *             the projects the row leaves at 0 (those the fleet has not
 *             seen: the node's spare); 0 there: the pool has no caps.
 *
 * fs_settings.caps is nonzero while some pool has caps: without a fleet pool
 * a connect reads nothing but that word, on the line it has loaded already.
 */
#pragma once

#include "maps.h"

volatile const __u32 cap_stride = 1; /* entries of fs_projects, set at load */

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 17); /* set at load: (Options.MaxDestPools + 1) x the entries of fs_projects */
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_caps SEC(".maps");

/*
 * fleet_cap is project id's cap in pool plus one, 0 when it has none: its
 * own entry, or the row's cap of the others.
 */
static __always_inline __u32 fleet_cap(struct fs_settings *cfg, __u32 pool, __u64 id)
{
	if (!cfg->caps || id >= cap_stride)
		return 0;
	__u32 row = pool * cap_stride;
	__u32 k = row + (__u32)id;
	__u32 *c = bpf_map_lookup_elem(&fs_caps, &k);
	if (c && *c)
		return *c;
	c = bpf_map_lookup_elem(&fs_caps, &row);
	return c ? *c : 0;
}

/*
 * cap_limit is the in_use project id (holding held permits of pool) may
 * take a permit of pool under: rule (the rule's limit, which the caller
 * computed) without a cap; with one, size (the pool's POOL) while it holds
 * less than its cap, else 0.
 */
static __always_inline __s64 cap_limit(struct fs_settings *cfg, __u32 pool, __u64 id, __s64 held, __s64 rule, __s64 size)
{
	__u32 c = fleet_cap(cfg, pool, id);
	if (!c)
		return rule;
	return held < (__s64)c - 1 ? size : 0;
}
