/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Addresses as the keys keep them: IPv6, or IPv4 v4-mapped, read from a
 * socket, from a packet, or written for a reservation's 4-tuple.
 */
#pragma once

#include "common.h"
#include "types.h"

static __always_inline void v4mapped(__u8 *dst, __be32 a)
{
	__u32 *d = (__u32 *)dst;
	d[0] = 0;
	d[1] = 0;
	d[2] = bpf_htonl(0xffff);
	d[3] = a;
}

static __always_inline bool is_v4mapped(const __u8 *addr)
{
	const __u32 *a = (const __u32 *)addr;
	return a[0] == 0 && a[1] == 0 && a[2] == bpf_htonl(0xffff);
}

static __always_inline bool wild_addr(const __u8 *addr)
{
	const __u64 *a = (const __u64 *)addr;
	return a[0] == 0 && a[1] == 0;
}

/* in6_load copies an IPv6 address from a kernel pointer, four loads. */
static __always_inline void in6_load(__u8 *dst, const struct in6_addr *a)
{
	__u32 *d = (__u32 *)dst;
	d[0] = a->in6_u.u6_addr32[0];
	d[1] = a->in6_u.u6_addr32[1];
	d[2] = a->in6_u.u6_addr32[2];
	d[3] = a->in6_u.u6_addr32[3];
}

static __always_inline __u64 sock_netns(struct sock *sk)
{
	return sk->__sk_common.skc_net.net->net_cookie;
}

/*
 * sock_tuple fills the 4-tuple of a connected socket as a reservation key
 * (local = the socket's own address and port).
 */
static __always_inline void sock_tuple(struct sock *sk, struct fs_resv_key *rk)
{
	if (sk->__sk_common.skc_family == AF_INET) {
		v4mapped(rk->laddr, sk->__sk_common.skc_rcv_saddr);
		v4mapped(rk->raddr, sk->__sk_common.skc_daddr);
	} else {
		in6_load(rk->laddr, &sk->__sk_common.skc_v6_rcv_saddr);
		in6_load(rk->raddr, &sk->__sk_common.skc_v6_daddr);
	}
	rk->lport = sk->__sk_common.skc_num;
	rk->rport = bpf_ntohs(sk->__sk_common.skc_dport);
}

#define TH_RST 0x04
#define TH_SYN 0x02

/*
 * skb_tuple reads the 4-tuple of an incoming TCP segment (local = its
 * destination) and its flags byte: 0, or -1 if it cannot be read.
 */
static __always_inline int skb_tuple(const struct sk_buff *skb, struct fs_resv_key *rk, __u8 *flags)
{
	unsigned char *head = skb->head;
	__u16 nh = skb->network_header;
	__u16 th_off = skb->transport_header;
	struct tcphdr th;
	if (bpf_probe_read_kernel(&th, sizeof(th), head + th_off))
		return -1;
	__u8 version = 0;
	bpf_probe_read_kernel(&version, 1, head + nh);
	if ((version >> 4) == 4) {
		struct iphdr ip;
		if (bpf_probe_read_kernel(&ip, sizeof(ip), head + nh))
			return -1;
		v4mapped(rk->laddr, ip.daddr);
		v4mapped(rk->raddr, ip.saddr);
	} else {
		struct ipv6hdr ip6;
		if (bpf_probe_read_kernel(&ip6, sizeof(ip6), head + nh))
			return -1;
		__builtin_memcpy(rk->laddr, &ip6.daddr, 16);
		__builtin_memcpy(rk->raddr, &ip6.saddr, 16);
	}
	rk->lport = bpf_ntohs(th.dest);
	rk->rport = bpf_ntohs(th.source);
	*flags = ((__u8 *)&th)[13];
	return 0;
}

/*
 * syn_tuple fills the 4-tuple of the SYN sk_lookup sees (local = its
 * destination, lport read by the caller).
 */
static __always_inline void syn_tuple(struct bpf_sk_lookup *ctx, __u16 fam, __u16 lport, struct fs_resv_key *rk)
{
	/* The verifier takes only loads at a constant offset from the
	 * context itself: keep the compiler from computing a field's address
	 * ahead (barrier_var), as it otherwise may. */
	barrier_var(ctx);
	rk->rport = bpf_ntohs(ctx->remote_port);
	if (fam == AF_INET) {
		barrier_var(ctx);
		v4mapped(rk->laddr, ctx->local_ip4);
		barrier_var(ctx);
		v4mapped(rk->raddr, ctx->remote_ip4);
	} else {
		/* The context allows only aligned 4-byte loads of these. */
		__u32 *la = (__u32 *)rk->laddr, *ra = (__u32 *)rk->raddr;
		barrier_var(ctx);
		la[0] = ctx->local_ip6[0];
		la[1] = ctx->local_ip6[1];
		la[2] = ctx->local_ip6[2];
		la[3] = ctx->local_ip6[3];
		barrier_var(ctx);
		ra[0] = ctx->remote_ip6[0];
		ra[1] = ctx->remote_ip6[1];
		ra[2] = ctx->remote_ip6[2];
		ra[3] = ctx->remote_ip6[3];
	}
	rk->lport = lport;
}
