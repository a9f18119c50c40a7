// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * The least a connection limiter can do at fairshare's hooks and still count
 * a project's connections correctly: the lower-bound side of
 * BenchmarkConnectAcceptClose (loader/bench_test.go), never shipped. Built
 * by the benchmark with clang (-O2 -mcpu=v3, the flags of gen.go).
 *
 *   connect4      the caller's cgroup (one helper), its project (one hash
 *                 lookup), one fetch-add on the project's count against a
 *                 limit (rolled back past it), and the permit recorded for
 *                 the socket's cookie in a slot (one compare-and-swap)
 *   sock_release  the slot of the socket's cookie, read from the socket:
 *   set_state     one compare-and-swap frees it, one fetch-add gives the
 *                 permit back (CLOSE); a child (SYN_RECV -> ESTABLISHED) of
 *                 a project's listener takes its permit as connect4 does
 *   sk_lookup     the rule alone for a project's port: one array lookup
 *   sockops       nothing (an empty program: the floor's)
 *
 * With lb_dest_on set, connect4 also takes a destination pool's permit (the
 * lower-bound side of BenchmarkConnectAcceptClose/outbound-dests): the
 * pool of the connect's exact address and port (one array load indexed by
 * the port and a compare of the address: no prefixes, no second host at a
 * port, no helper call), one fetch-add on the pool's count against its
 * size (rolled back past it), one on the project's count in the pool, and
 * the pool kept in the socket's slot, which the release gives back with
 * two fetch-adds.
 *
 * No rate, no exempt budget, no events, no node pool, no activity window, no
 * spill table (a taken slot is not counted: the benchmark's cookies are
 * consecutive and the slots many), no reservation of the request socket.
 * Whatever fairshare does above this is the price of its features.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_tracing.h>

#define SOCK_STREAM 1
#define TCP_ESTABLISHED 1
#define TCP_SYN_RECV 3
#define TCP_CLOSE 7
#define IPPROTO_TCP 6

extern void *bpf_rdonly_cast(const void *obj, __u32 btf_id) __ksym;
#define CAST(type, p) ((type *)bpf_rdonly_cast((const void *)(p), bpf_core_type_id_kernel(type)))

char LICENSE[] SEC("license") = "Dual BSD/GPL";

struct project {
	__s64 in_use;
	__s64 limit;
};

struct slot {
	__u64 cookie;
	__u32 project;
	__u32 pool; /* the destination pool's index, 0: none */
};

/* registered cgroup id -> project index */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u64);
	__type(value, __u32);
} lb_members SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 64);
	__type(key, __u32);
	__type(value, struct project);
} lb_projects SEC(".maps");

#define SLOTS 32768

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, SLOTS);
	__type(key, __u32);
	__type(value, struct slot);
} lb_slots SEC(".maps");

/* local port -> project index (0: none) */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, __u32);
} lb_ports SEC(".maps");

/* port (network order, as connect4 reads it) -> the one host (IPv4, network order) of pool index 1.. there */
struct dest {
	__u32 addr;
	__u32 pool;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct dest);
} lb_dests SEC(".maps");

#define DEST_POOLS 8

/* per pool: its count and size */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, DEST_POOLS);
	__type(key, __u32);
	__type(value, struct project);
} lb_dpools SEC(".maps");

/* per (pool, project): index pool * 64 + project, the project's count in the pool */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, DEST_POOLS * 64);
	__type(key, __u32);
	__type(value, __s64);
} lb_dpool_proj SEC(".maps");

/* [0]: nonzero if destination pools are in force */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} lb_dest_on SEC(".maps");

/* dest_take: the pool index of a permit taken, 0 for none, -1 refused */
static __always_inline int dest_take(struct bpf_sock_addr *ctx, __u32 i)
{
	__u32 zero = 0;
	__u32 *on = bpf_map_lookup_elem(&lb_dest_on, &zero);
	if (!on || !*on)
		return 0;
	__u32 port = ctx->user_port & 0xffff;
	struct dest *t = bpf_map_lookup_elem(&lb_dests, &port);
	if (!t || t->addr != ctx->user_ip4)
		return 0;
	__u32 pool = t->pool;
	struct project *d = bpf_map_lookup_elem(&lb_dpools, &pool);
	__u32 pp = pool * 64 + (i & 63);
	__s64 *held = bpf_map_lookup_elem(&lb_dpool_proj, &pp);
	if (!d || !held || pool == 0)
		return 0;
	if (__sync_fetch_and_add(&d->in_use, 1) >= d->limit) {
		__sync_fetch_and_add(&d->in_use, -1);
		return -1;
	}
	__sync_fetch_and_add(held, 1);
	return pool;
}

static __always_inline void dest_give(__u32 pool, __u32 i)
{
	struct project *d = bpf_map_lookup_elem(&lb_dpools, &pool);
	__u32 pp = pool * 64 + (i & 63);
	__s64 *held = bpf_map_lookup_elem(&lb_dpool_proj, &pp);
	if (!d || !held)
		return;
	__sync_fetch_and_add(&d->in_use, -1);
	__sync_fetch_and_add(held, -1);
}

/* take: 1 taken, 0 refused, -1 no project or no slot */
static __always_inline int take(__u64 cg, __u64 cookie, struct slot **out)
{
	__u32 *idx = bpf_map_lookup_elem(&lb_members, &cg);
	if (!idx)
		return -1;
	__u32 i = *idx;
	struct project *p = bpf_map_lookup_elem(&lb_projects, &i);
	if (!p)
		return -1;
	if (__sync_fetch_and_add(&p->in_use, 1) >= p->limit) {
		__sync_fetch_and_add(&p->in_use, -1);
		return 0;
	}
	__u32 k = cookie & (SLOTS - 1);
	struct slot *s = bpf_map_lookup_elem(&lb_slots, &k);
	if (!s || __sync_val_compare_and_swap(&s->cookie, 0, cookie) != 0) {
		__sync_fetch_and_add(&p->in_use, -1);
		return -1;
	}
	s->project = i;
	s->pool = 0;
	*out = s;
	return 1;
}

static __always_inline void give(__u64 cookie)
{
	__u32 k = cookie & (SLOTS - 1);
	struct slot *s = bpf_map_lookup_elem(&lb_slots, &k);
	if (!s || s->cookie != cookie)
		return;
	__u32 i = s->project;
	__u32 pool = s->pool;
	if (__sync_val_compare_and_swap(&s->cookie, cookie, 0) != cookie)
		return;
	struct project *p = bpf_map_lookup_elem(&lb_projects, &i);
	if (p)
		__sync_fetch_and_add(&p->in_use, -1);
	if (pool)
		dest_give(pool, i);
}

SEC("cgroup/connect4")
int lb_connect4(struct bpf_sock_addr *ctx)
{
	if (ctx->type != SOCK_STREAM)
		return 1;
	__u64 cookie = bpf_get_socket_cookie(ctx);
	struct slot *s = NULL;
	int r = take(bpf_get_current_cgroup_id(), cookie, &s);
	if (r == 1 && s) {
		int d = dest_take(ctx, s->project);
		if (d < 0) {
			give(cookie);
			r = 0;
		} else {
			s->pool = d;
		}
	}
	barrier_var(r);
	return r == 0 ? 0 : 1;
}

SEC("cgroup/sock_release")
int lb_sock_release(struct bpf_sock *ctx)
{
	if (ctx->type != SOCK_STREAM)
		return 1;
	__u64 cookie = CAST(struct sock, ctx)->__sk_common.skc_cookie.counter;
	if (cookie)
		give(cookie);
	return 1;
}

SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(lb_set_state, struct sock *sk, int oldstate, int newstate)
{
	if (newstate == TCP_CLOSE) {
		__u64 cookie = sk->__sk_common.skc_cookie.counter;
		if (cookie)
			give(cookie);
	} else if (newstate == TCP_ESTABLISHED && oldstate == TCP_SYN_RECV) {
		__u32 port = sk->__sk_common.skc_num;
		__u32 *pi = bpf_map_lookup_elem(&lb_ports, &port);
		struct slot *s = NULL;
		if (pi && *pi)
			take(sk->sk_cgrp_data.cgroup->kn->id, bpf_get_socket_cookie(sk), &s);
	}
	return 0;
}

SEC("sk_lookup")
int lb_sk_lookup(struct bpf_sk_lookup *ctx)
{
	if (ctx->protocol != IPPROTO_TCP)
		return SK_PASS;
	__u32 port = ctx->local_port;
	__u32 *pi = bpf_map_lookup_elem(&lb_ports, &port);
	if (!pi || !*pi)
		return SK_PASS;
	__u32 i = *pi;
	struct project *p = bpf_map_lookup_elem(&lb_projects, &i);
	if (p && *(volatile __s64 *)&p->in_use >= p->limit)
		return SK_DROP;
	return SK_PASS;
}

SEC("sockops")
int lb_sockops(struct bpf_sock_ops *ctx)
{
	return 1;
}
