/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Which project a socket counts for: the one place that knows what a
 * project is. A project is a compact id (1.., an index of fs_projects) with
 * a name (fs_names); its members are registered cgroups at any depth
 * (fs_members: cgroup id -> project id), kept by the loader (SetMembers). A
 * socket belongs to the project of the first registered cgroup found
 * walking its cgroup's ancestors from base_level down, at most max_depth
 * levels: a registration may sit anywhere from base_level to
 * base_level + max_depth - 1 (the loader refuses the others), and
 * everything below it counts for it. A socket of no registered cgroup is not
 * counted. Registrations of different projects never nest (the loader
 * refuses it), so the first hit is the only one.
 *
 * The programs ask task_project (connect: the connecting socket, whose
 * cgroup is the task's that made it) and sock_project (a socket: the
 * tracepoints, the dump; a listener's project is recorded from it in
 * listen.h, where sk_lookup, which has no cgroup, finds it), and reach a
 * project's counters with project_get.
 */
#pragma once

#include "maps.h"

/* Fixed when the programs are loaded (loader.Options): where the walk runs. */
volatile const __u32 base_level = 1; /* cgroup level of the walk's first step */
volatile const __u32 max_depth = 8;  /* levels walked, 1..MAX_DEPTH */

#define MAX_DEPTH 16 /* loader.MaxDepth */

/* fs_member.flags: the registered cgroup is in the exempt set (rule.h). */
#define MEMBER_EXEMPT 1

/*
 * cgroup_ancestor is cg->ancestors[level] (level <= cg's own). The verifier
 * does not walk a flexible array of pointers, so the entry is read as the
 * first member (->cgroup) of a struct cgroup_subsys_state placed at its
 * address: a plain load the kernel checks, where bpf_probe_read_kernel
 * would be a helper call.
 */
static __always_inline struct cgroup *cgroup_ancestor(struct cgroup *cg, __u32 level)
{
	__u64 at = (__u64)cg + bpf_core_field_offset(struct cgroup, ancestors) + 8 * (level & 0xff);
	return CAST(struct cgroup_subsys_state, at)->cgroup;
}

/*
 * cgroup_project is the project of cgroup c, 0 if none: one hash lookup per
 * level walked, the loads straight through the kernel's pointers (no helper
 * calls). For a project's socket *cg is the id of c itself (the exempt set
 * may name a cgroup nested in a project), or of the registered cgroup when
 * that one is exempt: the exempt check (rule.h) is then one lookup.
 */
static __always_inline __u64 cgroup_project(struct cgroup *c, __u64 *cg)
{
	if (!c)
		return 0;
	int level = c->level;
	if (level < (int)base_level || level > 255)
		return 0;
	__u32 last = level - base_level;
	/* Read before the walk: a select between it and aid below would
	 * otherwise load through a pointer to either, which the verifier
	 * refuses (stack vs kernel). */
	__u64 own = c->kn->id;
	for (__u32 i = 0; i < MAX_DEPTH; i++) {
		if (i > last || i >= max_depth)
			break;
		struct cgroup *anc = cgroup_ancestor(c, base_level + i);
		if (!anc)
			break;
		__u64 aid = anc->kn->id;
		struct fs_member *m = bpf_map_lookup_elem(&fs_members, &aid);
		if (m) {
			*cg = (m->flags & MEMBER_EXEMPT) ? aid : own;
			return m->project;
		}
	}
	return 0;
}

/*
 * sock_project is the project of socket sk (the project of the cgroup it was
 * created in; an accepted child's is its listener's), 0 if none.
 */
static __always_inline __u64 sock_project(struct sock *sk, __u64 *cg)
{
	return cgroup_project(sk->sk_cgrp_data.cgroup, cg);
}

/* project_get is project id's entry (NULL for an id out of range). */
static __always_inline struct fs_project *project_get(__u64 id)
{
	__u32 k = id;
	return bpf_map_lookup_elem(&fs_projects, &k);
}

/*
 * task_project finds the project of a connecting socket bs (its cgroup is
 * that of the task that made it): its id in *id (0: none), *cg as
 * sock_project's, and its entry.
 */
static __always_inline struct fs_project *task_project(struct bpf_sock *bs, __u64 *id, __u64 *cg)
{
	*id = 0;
	if (!bs)
		return NULL;
	*id = sock_project(CAST(struct sock, bs), cg);
	if (!*id)
		return NULL;
	return project_get(*id);
}
