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
 * fs_settings.caps holds CAPS_ON while some pool has caps, and CAPS_FLEET
 * while the connections pool is a fleet pool: without a fleet pool a connect
 * reads nothing but that word, on the line it has loaded already.
 *
 * The safe slice without a daemon (fleet_safe_now): a fleet pool's allotment
 * holds only while the daemon lives. The other nodes stop counting this one
 * once its lease expires (or at once, when it stops and revokes it) and
 * share its part among themselves, while the programs, pinned, keep
 * enforcing. So once the daemon's heartbeat (fs_lapses) is older than
 * fleet_after_ms (written with it: the time to the end of the pools'
 * leases), a fleet pool's size is at most its safe slice (the size a node
 * cut off from etcd decays to, package fleet), its floor at most that, and
 * its caps are dropped: what a live node does when cut off, done by the
 * programs for a daemon killed or stopped. The safe
 * slice, plus one (0: not a fleet pool), is fs_lapses slot 0's node_safe
 * for the connections pool, fs_dest_state.fleet_safe for a destination pool.
 */
#define CAPS_ON 1    /* some pool has caps in fs_caps */
#define CAPS_FLEET 2 /* the connections pool is a fleet pool: node_safe holds */
#pragma once

#include "maps.h"

volatile const __u32 cap_stride = 1; /* entries of fs_projects, set at load */

/*
 * The daemon's heartbeat and the lapse (loader/lapse.go, events.h), and the
 * fleet's safe slices without a daemon (above). Slot 0 is the daemon's
 * (heartbeat_ns, after_ns, fleet_after_ms, node_safe: written whole from
 * user space), slot 1 the programs' (admitted, an atomic add): a daemon
 * renewing its heartbeat never writes over a count the programs are making.
 */
struct fs_lapse {
	__u64 heartbeat_ns;   /* CLOCK_BOOTTIME of the daemon's last tick; 0: never (enforce) */
	__u64 after_ns;       /* lapse_after; 0: never lapse */
	__u64 admitted;       /* slot 1: refusals admitted because enforcement had lapsed */
	__u32 fleet_after_ms; /* to the end of the fleet pools' leases: a heartbeat older puts them at their safe slices; 0: never */
	__u32 node_safe;      /* the connections pool's safe slice plus one, with CAPS_FLEET */
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2); /* the daemon's slot, the programs' slot */
	__type(key, __u32);
	__type(value, struct fs_lapse);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_lapses SEC(".maps");

/*
 * fleet_safe_now is the safe slice plus one of a fleet pool whose daemon's
 * heartbeat is older than fleet_after_ms, 0 otherwise (not a fleet pool, or
 * a heartbeat recent enough): dest_safe, the pool's fleet_safe for a
 * destination pool, or NULL for the connections pool (node_safe, read only
 * with CAPS_FLEET). The pool then has the lower of its size and that
 * slice, and no caps (rule_limit). A function of its own, verified once:
 * inlined in every judgment of a permit, it added a fifth to what the
 * verifier walks of connect4; rule_limit calls it for fleet pools only.
 */
__noinline __u32 fleet_safe_now(struct fs_settings *cfg, const __u32 *dest_safe)
{
	__u32 safe = 0;
	if (!cfg)
		return 0;
	if (dest_safe) {
		safe = *(volatile const __u32 *)dest_safe;
		if (!safe)
			return 0;
	} else if (!(cfg->caps & CAPS_FLEET)) {
		return 0;
	}
	__u32 zero = 0;
	struct fs_lapse *l = bpf_map_lookup_elem(&fs_lapses, &zero);
	if (!l)
		return 0;
	if (!dest_safe)
		safe = *(volatile __u32 *)&l->node_safe;
	__u64 hb = *(volatile __u64 *)&l->heartbeat_ns, after = *(volatile __u32 *)&l->fleet_after_ms;
	if (!safe || !after || !hb)
		return 0;
	__u64 now = bpf_ktime_get_boot_ns();
	return now > hb && now - hb > after * 1000000ULL ? safe : 0;
}

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
	if (!(cfg->caps & CAPS_ON) || id >= cap_stride)
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
