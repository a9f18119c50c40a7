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
 * refuses it), so the first hit is the only one, with two exceptions:
 *
 *   - a weak registration (MEMBER_WEAK: the pod roots, members of the
 *     reserved project "(unclassified)") is a fallback: the walk goes on
 *     below it, and the first other registration found wins; the weak one
 *     counts only for a socket with none below it. So a pod the daemon has
 *     not classified yet is under the rule from its first connect, and a
 *     classified pod's own cgroup, deeper, wins.
 *   - a registration of project 0 (no project: the pods of system
 *     namespaces, the daemon's own cgroup) ends the walk with no project:
 *     it may sit below a weak one and makes its sockets uncounted.
 *
 * A weak registration counts a socket of the host's network namespace
 * (host_netns) but never refuses it: a pod there (hostNetwork: kube-proxy,
 * a CNI agent, the control plane's static pods) is far likelier a system
 * pod, which must never be refused, than a tenant's (Pod Security's
 * baseline keeps hostNetwork from tenants). Its connects take their permits
 * past the rule (KIND_OUT_HOST), which its classification then releases (a
 * system pod's) or moves to its project, where a move past the rule aborts
 * them as any unclassified connect's (limiter.c fs_dump); its listeners are
 * counted only once it is classified.
 *
 * The walk's answer is remembered per CPU (fs_member_memo, guarded by
 * fs_member_gen, which the loader bumps at every change of fs_members): the
 * sockets of one cgroup come in runs, and a hit costs no hash lookup.
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
/* The host's network namespace cookie (the daemon's own, which runs there),
 * 0 unknown: a weak registration does not hold for its sockets (above). */
volatile const __u64 host_netns;

#define MAX_DEPTH 16 /* loader.MaxDepth */

/* fs_member.flags: the registered cgroup is in the exempt set (rule.h). */
#define MEMBER_EXEMPT 1
/* fs_member.flags: a fallback, found only when nothing below it is (above). */
#define MEMBER_WEAK 2

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
 * cgroup_walk is the project of cgroup c (not NULL), 0 if none: one hash
 * lookup per level walked, the loads straight through the kernel's
 * pointers (no helper calls). For a project's socket *cg is the id of c
 * itself, own (the exempt set may name a cgroup nested in a project), or of
 * the registered cgroup when that one is exempt: the exempt check (rule.h)
 * is then one lookup.
 */
static __always_inline __u64 cgroup_walk(struct cgroup *c, __u64 own, __u64 *cg, __u64 *weakp)
{
	int level = c->level;
	if (level < (int)base_level || level > 255)
		return 0;
	__u32 last = level - base_level;
	/* A weak hit (MEMBER_WEAK) is kept while the walk goes on: the
	 * levels below it are walked as they would be without it (a cgroup
	 * below no member walks them all anyway), so it costs nothing more. */
	__u64 weak = 0, wcg = 0;
	for (__u32 i = 0; i < MAX_DEPTH; i++) {
		if (i > last || i >= max_depth)
			break;
		struct cgroup *anc = cgroup_ancestor(c, base_level + i);
		if (!anc)
			break;
		__u64 aid = anc->kn->id;
		struct fs_member *m = bpf_map_lookup_elem(&fs_members, &aid);
		if (m) {
			__u64 mcg = (m->flags & MEMBER_EXEMPT) ? aid : own;
			if (m->flags & MEMBER_WEAK) {
				if (!weak) {
					weak = m->project;
					wcg = mcg;
				}
				continue;
			}
			*cg = mcg;
			return m->project;
		}
	}
	if (weak)
		*cg = wcg;
	*weakp = weak != 0;
	return weak;
}

/*
 * The walk's last answer on each CPU (fs_member_memo), so that the sockets
 * of one cgroup, which come in runs, find their project without a hash
 * lookup: the lookup was most of connect4's cost (43 of its 81 ns above an
 * empty program, loopback benchmark), and a cgroup of no project paid it at
 * every level it walked. The answer is a function of the cgroup and of
 * fs_members; the loader bumps fs_member_gen after every change of
 * fs_members (loader.membersChanged, with fs_adjust's atomic add), and an answer is used only while the
 * generation it was found under is current. The generation is read before
 * the walk, so an answer found under it predates any change bumped after.
 *
 * The memo is per CPU but not per program run: a run can be preempted, or
 * interrupted by a softirq's (the tracepoints walk too), and another run on
 * the same CPU reads or writes it meanwhile. So it is a seqcount: a writer
 * claims it with a compare-and-swap from the even count it read before its
 * walk to the odd one after (a nested writer that came first changed the
 * count, and the claim fails: the answer is not kept), writes, and
 * publishes the next even count; a reader uses the fields only if the count
 * was even and the same before and after it read them. The count only
 * grows, so a reader cannot take a torn entry for a whole one. Only a miss
 * pays the compare-and-swap.
 */
struct fs_member_memo {
	__u64 seq;     /* even: stable; odd: being written */
	__u64 cgroup;  /* the cgroup asked about (its own id) */
	__u64 gen;     /* fs_member_gen when the answer was found */
	__u64 project; /* the answer: its project, 0 none */
	__u64 cg;      /* and *cg */
	__u64 weak;    /* and whether it is a weak registration's */
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME); /* shared by every program set of the pins */
} fs_member_gen SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fs_member_memo);
} fs_member_memo SEC(".maps"); /* not pinned: a cache of the programs loaded with it */

/*
 * cgroup_project is the project of cgroup c, 0 if none, and *cg and *weak
 * as cgroup_walk's: the memo's answer while it is current, else the walk's.
 */
static __always_inline __u64 cgroup_project(struct cgroup *c, __u64 *cg, __u64 *weak)
{
	*weak = 0;
	if (!c)
		return 0;
	/* Read before the walk: a select between it and aid in the walk
	 * would otherwise load through a pointer to either, which the
	 * verifier refuses (stack vs kernel). */
	__u64 own = c->kn->id;
	__u32 zero = 0;
	__u64 *genp = bpf_map_lookup_elem(&fs_member_gen, &zero);
	struct fs_member_memo *m = bpf_map_lookup_elem(&fs_member_memo, &zero);
	if (!genp || !m)
		return cgroup_walk(c, own, cg, weak);
	__u64 gen = *(volatile __u64 *)genp;
	__u64 s = *(volatile __u64 *)&m->seq;
	/* The fields are plain loads: nothing else keeps the compiler from
	 * reading them before the count. */
	asm volatile("" ::: "memory");
	if (!(s & 1) && m->cgroup == own && m->gen == gen) {
		__u64 id = m->project, mcg = m->cg, mweak = m->weak;
		asm volatile("" ::: "memory");
		if (*(volatile __u64 *)&m->seq == s) {
			if (id)
				*cg = mcg;
			*weak = mweak;
			return id;
		}
	}
	asm volatile("" ::: "memory");
	__u64 id = cgroup_walk(c, own, cg, weak);
	if (!(s & 1) && __sync_val_compare_and_swap(&m->seq, s, s + 1) == s) {
		m->cgroup = own;
		m->gen = gen;
		m->project = id;
		m->cg = id ? *cg : 0;
		m->weak = *weak;
		publish(&m->seq, s + 2);
	}
	return id;
}

/*
 * sock_project_of is the project of socket sk (the project of the cgroup it
 * was created in; an accepted child's is its listener's), 0 if none, and in
 * *weak whether it is a weak registration's: 1, or 2 for a socket of the
 * host's network namespace (WEAK_HOST: counted, never refused; above).
 */
#define WEAK_HOST 2
static __always_inline __u64 sock_project_of(struct sock *sk, __u64 *cg, __u64 *weak)
{
	__u64 id = cgroup_project(sk->sk_cgrp_data.cgroup, cg, weak);
	if (*weak && host_netns && sk->__sk_common.skc_net.net->net_cookie == host_netns)
		*weak = WEAK_HOST;
	return id;
}

/*
 * sock_project is sock_project_of for the paths that do not take a
 * connect's permit (listeners, accepted children): a socket of the host's
 * network namespace under a weak registration is in no project there.
 */
static __always_inline __u64 sock_project(struct sock *sk, __u64 *cg)
{
	__u64 weak;
	__u64 id = sock_project_of(sk, cg, &weak);
	return weak == WEAK_HOST ? 0 : id;
}

/* project_get is project id's entry (NULL for an id out of range). */
static __always_inline struct fs_project *project_get(__u64 id)
{
	__u32 k = id;
	return bpf_map_lookup_elem(&fs_projects, &k);
}

/*
 * task_project finds the project of a connecting socket bs (its cgroup is
 * that of the task that made it): its id in *id (0: none), *cg and *weak as
 * sock_project_of's, and its entry.
 */
static __always_inline struct fs_project *task_project(struct bpf_sock *bs, __u64 *id, __u64 *cg, __u64 *weak)
{
	*id = 0;
	*weak = 0;
	if (!bs)
		return NULL;
	*id = sock_project_of(CAST(struct sock, bs), cg, weak);
	if (!*id)
		return NULL;
	return project_get(*id);
}
