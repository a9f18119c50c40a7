/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Which project a task or a socket counts for: the one place that knows
 * what a project is. Today a project is a cgroup directly below the
 * projects root (a fixed ancestor level), its id the cgroup id, and a new
 * cgroup is a new project at its first connection, with no registration.
 * The programs ask task_project (process context: connect) and sock_project
 * (a socket: the tracepoints, the dump; a listener's project is recorded
 * from it in listen.h, where sk_lookup, which has no cgroup, finds it), and
 * create a project's counters with project_get.
 */
#pragma once

#include "maps.h"

/* Fixed when the programs are loaded: where projects live in the hierarchy. */
volatile const __u32 root_level;      /* level of the projects root cgroup */
volatile const __u64 root_cgroup_id;  /* its cgroup id */

/*
 * task_project finds the project of the calling task, its ancestor one level
 * below the root: its id in *id, and its entry if it has one yet. *id is 0
 * when the task is not below the root (a socket created in a project and
 * used by a task outside it is not counted). The keys of fs_projects are only
 * ever ids of projects (cgroup ids are not reused), so an entry found needs
 * no check that the root is the ancestor: a connect of a known project costs
 * one cgroup helper, not two.
 */
static __always_inline struct fs_project *task_project(__u64 *id)
{
	*id = bpf_get_current_ancestor_cgroup_id(root_level + 1);
	struct fs_project *p = bpf_map_lookup_elem(&fs_projects, id);
	if (!p && bpf_get_current_ancestor_cgroup_id(root_level) != root_cgroup_id)
		*id = 0;
	return p;
}

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
 * sock_project is the project of socket sk (the project of the cgroup it was
 * created in; an accepted child's is its listener's), 0 if it is not below
 * the root; for a project's socket *cg is the id of the socket's own cgroup
 * (the exempt set may name a cgroup nested in a project). The loads go
 * straight through the kernel's pointers (a tracing program's or one made by
 * CAST), no helper calls.
 */
static __always_inline __u64 sock_project(struct sock *sk, __u64 *cg)
{
	struct cgroup *c = sk->sk_cgrp_data.cgroup;
	if (!c)
		return 0;
	int level = c->level;
	if (level <= (int)root_level || level > 255)
		return 0;
	struct cgroup *anc = cgroup_ancestor(c, root_level);
	if (!anc || anc->kn->id != root_cgroup_id)
		return 0;
	anc = cgroup_ancestor(c, root_level + 1);
	if (!anc)
		return 0;
	*cg = c->kn->id;
	return anc->kn->id;
}

/* project_get is project id's entry, created if it has none (NULL: the map is full). */
static __always_inline struct fs_project *project_get(__u64 id)
{
	struct fs_project *p = bpf_map_lookup_elem(&fs_projects, &id);
	if (p)
		return p;
	struct fs_project zero = {};
	/* A new cgroup is a new project at once: no registration. */
	bpf_map_update_elem(&fs_projects, &id, &zero, BPF_NOEXIST);
	return bpf_map_lookup_elem(&fs_projects, &id);
}
