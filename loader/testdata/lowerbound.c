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
	__u32 pad;
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

/* take: 1 taken, 0 refused, -1 no project or no slot */
static __always_inline int take(__u64 cg, __u64 cookie)
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
	return 1;
}

static __always_inline void give(__u64 cookie)
{
	__u32 k = cookie & (SLOTS - 1);
	struct slot *s = bpf_map_lookup_elem(&lb_slots, &k);
	if (!s || s->cookie != cookie)
		return;
	__u32 i = s->project;
	if (__sync_val_compare_and_swap(&s->cookie, cookie, 0) != cookie)
		return;
	struct project *p = bpf_map_lookup_elem(&lb_projects, &i);
	if (p)
		__sync_fetch_and_add(&p->in_use, -1);
}

SEC("cgroup/connect4")
int lb_connect4(struct bpf_sock_addr *ctx)
{
	if (ctx->type != SOCK_STREAM)
		return 1;
	int r = take(bpf_get_current_cgroup_id(), bpf_get_socket_cookie(ctx));
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
		if (pi && *pi)
			take(sk->sk_cgrp_data.cgroup->kn->id, bpf_get_socket_cookie(sk));
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
