/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Addresses as the keys keep them: IPv6, or IPv4 v4-mapped, read from a
 * socket or from a program's context.
 */
#pragma once

#include "common.h"
#include "types.h"

/*
 * An address buffer on the stack: read as two 64-bit words (wild_addr,
 * port_owner), so it is 8-byte aligned by its type, not by an attribute each
 * declaration must repeat.
 */
typedef __u8 addr_buf[16] __attribute__((aligned(8)));

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
 * laddr_of fills a local address from a context's fields: the IPv4 one a4,
 * or the IPv6 one a0..a3, by family.
 */
static __always_inline void laddr_of(__u8 *laddr, __u16 fam, __u32 a4, __u32 a0, __u32 a1, __u32 a2, __u32 a3)
{
	__u32 *la = (__u32 *)laddr;
	if (fam == AF_INET) {
		v4mapped(laddr, a4);
		return;
	}
	la[0] = a0;
	la[1] = a1;
	la[2] = a2;
	la[3] = a3;
}

/*
 * The verifier takes only loads at a constant offset from the context
 * itself (the context allows only aligned 4-byte loads of the IPv6
 * addresses). Loads of one family's fields in a branch of their own may be
 * merged by clang into one load through a computed pointer, which it
 * refuses: so every address field is read, unconditionally, and each value
 * is made to exist before the next (barrier_var), whatever the family.
 * CTX_ADDR reads side's (local or remote) address of ctx into buf.
 */
#define CTX_ADDR(ctx, fam, side, buf)                                                   \
	do {                                                                            \
		__u32 a4__ = (ctx)->side##_ip4;                                         \
		barrier_var(a4__);                                                      \
		__u32 a0__ = (ctx)->side##_ip6[0];                                      \
		barrier_var(a0__);                                                      \
		__u32 a1__ = (ctx)->side##_ip6[1];                                      \
		barrier_var(a1__);                                                      \
		__u32 a2__ = (ctx)->side##_ip6[2];                                      \
		barrier_var(a2__);                                                      \
		__u32 a3__ = (ctx)->side##_ip6[3];                                      \
		barrier_var(a3__);                                                      \
		laddr_of(buf, fam, a4__, a0__, a1__, a2__, a3__);                       \
	} while (0)

/* CTX_LADDR reads the local address of ctx (sk_lookup, sockops) into laddr. */
#define CTX_LADDR(ctx, fam, laddr) CTX_ADDR(ctx, fam, local, laddr)
