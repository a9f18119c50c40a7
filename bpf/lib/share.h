/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The rule's judgement, apart from taking anything: the active count a pool
 * is divided by, whether a project holds less than its share, the in_use a
 * project may take a permit under, and the exempt set. rule.h takes permits
 * by it and events.h says why a refusal was one; both include this header,
 * which includes neither.
 */
#pragma once

#include "maps.h"

/*
 * rule_active is the number of active projects the rule divides the pool
 * by: one more for an inbound permit (in), beside the project a newcomer
 * would make (see limit_for).
 */
static __always_inline __s64 rule_active(struct fs_pool *n, bool in)
{
	__s64 active = n->active;
	return in ? (active > 1 ? active : 1) + 1 : active;
}

/*
 * under_share says whether a project holding held permits holds less than
 * its share, max(FLOOR, POOL / active) (POOL while at most one project is
 * active). held < POOL / active (integer division) is (held + 1) * active <=
 * POOL: a multiplication where the division took some 40 cycles. in: the
 * share an inbound permit is judged by, with one more project active (see
 * limit_for).
 */
static __always_inline bool under_share(struct fs_settings *cfg, struct fs_pool *n, __s64 held, bool in)
{
	__s64 pool = cfg->pool;
	if (held < (__s64)cfg->floor)
		return true;
	__s64 active = rule_active(n, in);
	if (active <= 1)
		return held < pool;
	return (held + 1) * active <= pool;
}

/*
 * limit_for is the in_use the rule lets project p take a permit under: POOL
 * under its share, POOL - FLOOR at or past it. An inbound permit (in: a
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
 * reservation, as before.
 */
static __always_inline __s64 limit_for(struct fs_settings *cfg, struct fs_pool *n, struct fs_project *p, bool in)
{
	if (under_share(cfg, n, *(volatile __s64 *)&p->in_use, in))
		return cfg->pool;
	return cfg->floor < cfg->pool ? cfg->pool - cfg->floor : 0;
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
