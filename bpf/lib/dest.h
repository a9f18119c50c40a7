/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Destination pools: a named connections pool selected by where a connect()
 * goes (docs/destination-pools.md). A connect to a destination of such a
 * pool takes a permit in it as well as the node's, under the same rule
 * (pools/doc.go) with the pool's own SIZE, FLOOR and window, and is refused
 * if either refuses.
 *
 *   fs_dnets          the destinations: an open-addressing table keyed
 *                     (prefix, port), probed once per prefix length in use,
 *                     longest first (fs_settings.dest_lens, on the line
 *                     dest_kinds is read from: at most DEST_LENS per kind
 *                     and address family), with a few inlined loads each
 *                     where the trie is a helper call and a walk
 *   fs_dests          LPM trie (port, prefix) -> pool id 1..: the
 *                     destinations the table does not hold (lengths past
 *                     DEST_LENS, shorter than those it holds; a key the
 *                     loader cannot place within DEST_NET_PROBES slots, and
 *                     every shorter length of its kind), looked up after the
 *                     table; and, while the loader rewrites the table,
 *                     every destination
 *
 * A pool of every port is kept under port 0 and looked up second, so a pool
 * that names the port wins over one that does not, and among those the
 * longest prefix: the table's lengths come longest first, and are all
 * longer than (or as long as) the trie's of the kind.
 *   fs_dpool_conf     per pool: size, floor, window, flags, name (the loader's;
 *                     read back at a restart)
 *   fs_dpool_state    per pool: in_use, active, counters (atomics), and a copy
 *                     of its settings: one cache line, all of the pool a
 *                     connect reads
 *   fs_dpool_proj     per (pool, project): held and admitted in one word
 *                     (in_use: share.h, PACKED_HELD_BITS), last ask, refused; an
 *                     array indexed (pool - 1) * dest_stride + project, so a
 *                     lookup is inlined (no hashing)
 *
 * The tables a matching connect reads are mmapable arrays: their values are
 * page-aligned (a plain array's start some bytes into a line), so a host
 * slot, a pool's state and a (pool, project) entry are one line each.
 *
 * The rule is share.h's (pool_admit, pool_give), the node's own code over
 * the pool's fields (dest_pool).
 *
 * The socket's held-permit entry (held.h) keeps the pool id with the node's
 * permit: every release path ends that entry exactly once (end_held), and
 * the one that does gives back both. A pool removed while connections hold
 * its permits leaves the trie at once and keeps its id and counts until they
 * are given back (the loader reuses the id only once its in_use is 0).
 *
 * Cost: nothing while no pool is configured (the kinds' bits of
 * fs_settings.dest_kinds are 0 and nothing is looked at); otherwise a filter
 * (fs_settings.dest_quick: of the pools naming a port, the fingerprint of
 * each host and the port of each prefix, up to four,
 * and the IPv4 /16s and IPv6 first bytes of the others, up to three and
 * two, on the line already read; the exact fs_dfilter past that) and, where it
 * lets a connect through, a probe of the table per prefix length it holds
 * of the kind, and the trie only if it holds destinations of the kind
 * (DEST_NET_PORTS, DEST_PORTS, DEST_NET_ANY, DEST_ANY); for a match the
 * rule's few atomics. What lies past the filter (the lookup, the rule, a
 * refusal's report) is a function of its own, dest_take4 or dest_take6,
 * called for a connect the filter lets through (or, in a race with the
 * loader's writes, for a second try): verified once, not in every path of
 * the node's admission that follows (see dest_take4).
 * Outbound only: an accepted connection takes no destination permit. A
 * socket the reconcile dump adopts (one no program counted: open before a
 * first start or a migration, or before its cgroup was registered) takes
 * one in its peer's pool, past the rule (dest_adopt, limiter.c
 * dest_adoptable).
 */
#pragma once

#include "maps.h"
#include "project.h"
#include "addr.h"
#include "share.h"
#include "events.h"
#include "cap.h"

/* fs_settings.dest_kinds: what the trie and the table hold */
#define DEST_PORTS 1     /* the trie: prefixes naming a port */
#define DEST_ANY 2       /* the trie: prefixes of every port */
#define DEST_NET_PORTS 4 /* the table: prefixes naming a port */
#define DEST_NET_ANY 8   /* the table: prefixes of every port */
#define DEST_KINDS 15    /* the kinds' bits of dest_kinds; the generation above them */

/* fs_dest_conf.flags (fs_dpool_conf) */
#define DEST_LIVE 1   /* configured (its destinations are in fs_dests) */
#define DEST_DRYRUN 2 /* enforce: false */

#define DEST_KEY_BITS (16 + 128) /* a full key: port and IPv6 address */

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 2048); /* set at load: 2 x limits.MaxDestinations (SetDestPools holds the old and the new at once) */
	__type(key, struct fs_dest_key);
	__type(value, __u32);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_dests SEC(".maps");

#define DEST_NET_BITS 11
#define DEST_NETS (1 << DEST_NET_BITS) /* loader.destNets: 2 x limits.MaxDestinations */
#define DEST_NET_PROBES 4              /* loader.destNetProbes */

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, DEST_NETS);
	__type(key, __u32);
	__type(value, struct fs_dest_net);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_dnets SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 17); /* set at load: Options.MaxDestPools + 1 (id 0 is none) */
	__type(key, __u32);
	__type(value, struct fs_dest_conf);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_dpool_conf SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 17); /* set at load: as fs_dpool_conf */
	__type(key, __u32);
	__type(value, struct fs_dest_state);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_dpool_state SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 16); /* set at load: Options.MaxDestPools x the entries of fs_projects */
	__type(key, __u32);
	__type(value, struct fs_project);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_dpool_proj SEC(".maps");

/* One filter (types.h, fs_dest_filter), written by the loader. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fs_dest_filter);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_dfilter SEC(".maps");

volatile const __u32 dest_stride = 1; /* entries of fs_projects, set at load */

/* A destination pool and a project's entry in it, as dest_get finds them. */
struct dest_view {
	__u32 id;
	struct fs_dest_state *s;
	struct fs_project *p;
};

static __always_inline bool dest_get(__u32 pool, __u64 project, struct dest_view *v)
{
	__u32 k = pool;
	v->id = pool;
	v->s = bpf_map_lookup_elem(&fs_dpool_state, &k);
	/* project < dest_stride (the loader's ids are), so the index names
	 * one (pool, project) and cannot wrap into the next pool's. */
	if (pool == 0 || project >= dest_stride)
		return false;
	__u32 i = (pool - 1) * dest_stride + (__u32)project;
	v->p = bpf_map_lookup_elem(&fs_dpool_proj, &i);
	return v->s && v->p;
}

/*
 * dest_mask is the mask of a prefix of plen bits (0..128) over the two
 * 64-bit words of an address as loaded (little-endian words of network-order
 * bytes: the first byte is the low one). Computed here from the length
 * alone, one word the loader writes, so that a connect reading the lengths
 * while they change never pairs one length with another's mask.
 */
static __always_inline void dest_mask(__u32 plen, __u64 *m0, __u64 *m1)
{
	__u32 n0 = plen < 64 ? plen : 64, n1 = plen > 64 ? plen - 64 : 0;
	*m0 = n0 == 0 ? 0 : n0 == 64 ? ~0ULL : __builtin_bswap64(~0ULL << (64 - n0));
	*m1 = n1 == 0 ? 0 : n1 >= 64 ? ~0ULL : __builtin_bswap64(~0ULL << (64 - n1));
}

/*
 * dest_net is the pool of the destination of prefix length plen at port
 * holding address q (its two 64-bit words) in fs_dnets, 0 if none: the slot
 * the hash of the masked address, port and length names and the next ones,
 * up to DEST_NET_PROBES, until a free slot (loader.destNetSlot computes the
 * same hash). A slot the loader is rewriting may read torn: it then matches
 * nothing (the connect finds its pool in the trie, which holds every
 * destination while the table is rewritten), or, for an address equal to
 * the half-written one, is counted in the pool of the slot's new entry and
 * gives its permit back there: a miscount of a connect racing a
 * reconfiguration, never a leak. The probes are a loop, not unrolled:
 * unrolled, a match cost 3-10 ns more and a miss past the filter 2-8
 * (BenchmarkConnectAcceptClose, 22 alternating rounds:
 * docs/measurements-log.md), though the loop runs more instructions.
 */
static __always_inline __u32 dest_net(__u32 plen, const __u64 *q, __u16 port)
{
	__u64 m0, m1;
	dest_mask(plen, &m0, &m1);
	__u64 a0 = q[0] & m0, a1 = q[1] & m1;
	/* port and length as the slot keeps them, bytes 16..19 */
	__u32 pl = (__u32)port | (plen & 0xff) << 16;
	__u32 h = ((__u32)a0 ^ (__u32)(a0 >> 32) ^ ((__u32)a1 * 31) ^ (__u32)(a1 >> 32) ^ (pl * 0x10001)) * 0x9E3779B1u;
	__u32 i = h >> (32 - DEST_NET_BITS);
#pragma clang loop unroll(disable)
	for (int j = 0; j < DEST_NET_PROBES; j++) {
		__u32 k = (i + j) & (DEST_NETS - 1);
		struct fs_dest_net *e = bpf_map_lookup_elem(&fs_dnets, &k);
		if (!e)
			return 0;
		__u32 pool = *(volatile __u32 *)&e->pool;
		if (!pool)
			return 0;
		const __u64 *ea = (const __u64 *)e->addr;
		if (ea[0] == a0 && ea[1] == a1 && *(const __u32 *)e->port == pl)
			return pool;
	}
	return 0;
}

/*
 * dest_tab is the pool of the table's longest prefix of kind (0: naming
 * the port, 1: every port) at port holding addr, 0 if none; v6: addr is
 * not v4-mapped (only the lengths of prefixes that can hold it are probed).
 */
static __always_inline __u32 dest_tab(const struct fs_settings *cfg, int kind, bool v6, const __u8 *addr, __u16 port)
{
	const __u64 *q = (const __u64 *)addr;
	for (int i = 0; i < DEST_LENS; i++) {
		__u32 len = *(volatile __u8 *)&cfg->dest_lens[kind][v6][i];
		if (!len)
			return 0;
		__u32 v = dest_net(len - 1, q, port);
		if (v)
			return v;
	}
	return 0;
}

/* dest_trie is the pool of the trie's longest prefix at port holding addr, 0 if none. */
static __always_inline __u32 dest_trie(const __u8 *addr, __u16 port)
{
	struct fs_dest_key k __attribute__((aligned(8))) = {.prefixlen = DEST_KEY_BITS};
	__builtin_memcpy(k.port, &port, 2);
	__builtin_memcpy(k.addr, addr, 16);
	__u32 *v = bpf_map_lookup_elem(&fs_dests, &k);
	return v ? *v : 0;
}

/*
 * The quick filter (fs_settings.dest_quick, loader.quickOf): for the pools
 * naming a port, in four 16-bit lanes, the fingerprint of each host (a
 * whole address and its port, dest_fp) and the port of each prefix; the
 * /16s of the IPv4
 * addresses of the others in three 16-bit lanes (the low six bytes of the
 * second word), the first bytes of their IPv6 addresses in two 8-bit lanes
 * (its high two); each value in a lane of its own (the lanes left over
 * repeat one). A part all ones holds more values than lanes. Where any byte
 * of the part is 0xff (all ones, a lane read torn between a value and all
 * ones while the loader writes it, or a value with such a byte)
 * fs_dfilter's exact bits decide: the loader writes them before the quick
 * word, widening or narrowing. dest_lane16 says whether a lane of q holds
 * v: a lane of q ^ v is zero (dest_zero16, the classic test for a zero
 * lane, exact as to whether one is); dest_ff64 whether a byte of q is 0xff
 * (a zero byte of ~q). For the IPv4 part the IPv6 lanes are taken out of
 * both tests (DEST_V4_PAD).
 */
static __always_inline bool dest_zero16(__u64 x)
{
	return ((x - 0x0001000100010001ULL) & ~x & 0x8000800080008000ULL) != 0;
}

static __always_inline bool dest_lane16(__u64 q, __u16 v)
{
	return dest_zero16(q ^ (0x0001000100010001ULL * v));
}

static __always_inline bool dest_ff64(__u64 q)
{
	__u64 x = ~q;
	return ((x - 0x0101010101010101ULL) & ~x & 0x8080808080808080ULL) != 0;
}

/*
 * dest_fp is the 16-bit fingerprint of address q (its two words) and port
 * hport (host order) that the quick word holds for a host of a pool naming
 * a port (loader.destFP computes the same): a connect to another host at
 * the port, another database on 5432, is stopped by the filter rather
 * than by a probe of the table, but for one in some 16k that shares a
 * host's fingerprint.
 */
static __always_inline __u16 dest_fp(const __u64 *q, __u16 hport)
{
	__u64 x = q[0] ^ q[1];
	return ((__u32)x ^ (__u32)(x >> 32) ^ (__u32)hport * 0x10001u) * 0x9E3779B1u >> 16;
}

/*
 * dest_port_may: a pool naming port hport (host order) may match address
 * q: a lane holds the port (a prefix's) or the fingerprint (a host's).
 */
static __always_inline bool dest_port_may(const struct fs_settings *cfg, __u16 hport, const __u64 *q)
{
	__u64 w = *(volatile __u64 *)&cfg->dest_quick[0];
	if (!dest_ff64(w)) {
		/* Both tests in one branch: one more would double the paths
		 * the verifier walks past it. */
		__u64 m = 0x0001000100010001ULL, x = w ^ m * hport, y = w ^ m * dest_fp(q, hport);
		return (((x - m) & ~x) | ((y - m) & ~y)) & 0x8000800080008000ULL;
	}
	__u32 zero = 0;
	struct fs_dest_filter *f = bpf_map_lookup_elem(&fs_dfilter, &zero);
	return f && (f->ports[(hport >> 6) & 1023] & (1ULL << (hport & 63)));
}

#define DEST_V4_PAD 0xffff000000000000ULL /* the IPv6 lanes of dest_quick[1] */

/*
 * dest_net_may: a pool of every port may match addr (IPv6, or v4-mapped if
 * v4): its /16 (IPv4) or first byte (IPv6) is in the filter.
 */
static __always_inline bool dest_net_may(const struct fs_settings *cfg, bool v4, const __u8 *addr)
{
	__u64 w = *(volatile __u64 *)&cfg->dest_quick[1];
	__u32 zero = 0;
	struct fs_dest_filter *f;
	if (v4) {
		__u16 v = (__u16)addr[12] << 8 | addr[13];
		/* The IPv6 lanes' bytes are not this part's: a zero byte of
		 * ~w there would read as a 0xff here. */
		if (!dest_ff64(w & ~DEST_V4_PAD))
			return dest_zero16((w ^ (0x0001000100010001ULL * v)) | DEST_V4_PAD);
		f = bpf_map_lookup_elem(&fs_dfilter, &zero);
		return f && (f->v4[(v >> 6) & 1023] & (1ULL << (v & 63)));
	}
	__u8 b = addr[0], l0 = w >> 48, l1 = w >> 56;
	if (l0 != 0xff && l1 != 0xff)
		return l0 == b || l1 == b;
	f = bpf_map_lookup_elem(&fs_dfilter, &zero);
	return f && (f->v6[(b >> 6) & 3] & (1ULL << (b & 63)));
}

/* What the filter lets through (dest_may), and the second try (dest_try). */
#define DEST_MAY_PORTS 1 /* a pool naming the port may match */
#define DEST_MAY_NET 2   /* a pool of every port may match */
#define DEST_RETRY 4     /* the second try, the last: filtered in dest_try, its answer kept */
#define DEST_AGAIN (1U << 30) /* dest_try: the word changed meanwhile (not a pool id) */

/*
 * dest_may is what the filter says of a connect to port (network order) at
 * addr (IPv6 or v4-mapped) for the kinds configured: DEST_MAY_PORTS,
 * DEST_MAY_NET, both, or 0, and then no pool matches. A bit test on the
 * line dest_kinds came from, where a probe is a hash and a load of
 * another, and the trie a helper call and a walk.
 */
static __always_inline __u32 dest_may(const struct fs_settings *cfg, __u32 kinds, __u16 port, const __u8 *addr)
{
	__u32 may = 0;
	if ((kinds & (DEST_NET_PORTS | DEST_PORTS)) && dest_port_may(cfg, bpf_ntohs(port), (const __u64 *)addr))
		may |= DEST_MAY_PORTS;
	if ((kinds & (DEST_NET_ANY | DEST_ANY)) && dest_net_may(cfg, is_v4mapped(addr), addr))
		may |= DEST_MAY_NET;
	return may;
}

/*
 * dest_past is the destination pool of a connect to port (network order)
 * at addr (IPv6 or v4-mapped), 0 if none, among the kinds configured that
 * the filter let through (may): the pools that name the port first, then
 * those of every port; at each, the table before the trie (its prefixes
 * are the longer).
 */
static __always_inline __u32 dest_past(const struct fs_settings *cfg, __u32 kinds, __u32 may, __u16 port, const __u8 *addr)
{
	__u32 v;
	bool v4 = is_v4mapped(addr);
	if (may & DEST_MAY_PORTS) {
		if ((kinds & DEST_NET_PORTS) && (v = dest_tab(cfg, 0, !v4, addr, port)))
			return v;
		if ((kinds & DEST_PORTS) && (v = dest_trie(addr, port)))
			return v;
	}
	if (may & DEST_MAY_NET) {
		if ((kinds & DEST_NET_ANY) && (v = dest_tab(cfg, 1, !v4, addr, 0)))
			return v;
		if (kinds & DEST_ANY)
			return dest_trie(addr, 0);
	}
	return 0;
}

/*
 * A connect's lookup (dest_connect; dest_find, the same for the tests)
 * reads dest_kinds (a word of the config line, cfg) as kinds, and is made
 * again if that word has changed by the end of it. The loader bumps the
 * generation in the word's high bits after each of its writes to what a
 * lookup reads (loader.destWrote; the table's slots, written while it is
 * switched off, as one), so a lookup that read some of them before a write
 * and some after, a program preempted in its middle, is made again on what
 * is there now: the lookup rewriteDestsLocked's order answers for takes
 * place between two writes. (A write whose bump comes after the lookup's
 * second read changes one thing, which that order makes safe.) Once only:
 * a second such race in one connect (another change begun meanwhile) keeps
 * the second lookup's answer.
 *
 * dest_first is the first try's filter: what it lets through for dest_try
 * (dest_may), 0 if no pool can match and the word is still kinds, or
 * DEST_RETRY if it has changed: the second try, on the word as it is now.
 */
static __always_inline __u32 dest_first(const struct fs_settings *cfg, __u32 kinds, __u16 port, const __u8 *addr)
{
	__u32 may = dest_may(cfg, kinds & DEST_KINDS, port, addr);
	if (may || *(volatile __u32 *)&cfg->dest_kinds == kinds)
		return may;
	return DEST_RETRY;
}

/*
 * dest_try is the pool past the filter (how: what it let through, or
 * DEST_RETRY for the second try, filtered here) of a lookup that read
 * dest_kinds as kinds, 0 if none; DEST_AGAIN if the word has changed by
 * its end and this is not the second try.
 */
static __always_inline __u32 dest_try(const struct fs_settings *cfg, __u32 kinds, __u32 how, __u16 port, const __u8 *addr)
{
	if (how == DEST_RETRY)
		how |= dest_may(cfg, kinds & DEST_KINDS, port, addr);
	__u32 pool = kinds & DEST_KINDS ? dest_past(cfg, kinds & DEST_KINDS, how, port, addr) : 0;
	return (how & DEST_RETRY) || *(volatile __u32 *)&cfg->dest_kinds == kinds ? pool : DEST_AGAIN;
}

/*
 * dest_lookup_again is the last try of a lookup, on the word kinds as it
 * is now: a function of its own, verified once, where an inlined second
 * lookup would double what the verifier walks in the programs that call
 * it, fs_selftest_dest (dest_find) and fs_dump, whose adoption
 * (dest_adoptable) looks up with it alone. A connect's second try is
 * dest_take's, in its own function already.
 */
__noinline __u32 dest_lookup_again(__u32 kinds, __u32 port, __u64 a0, __u64 a1)
{
	struct fs_settings *cfg = settings();
	if (!cfg)
		return 0;
	addr_buf a;
	__u64 *w = (__u64 *)a;
	w[0] = a0;
	w[1] = a1;
	return dest_try(cfg, kinds, DEST_RETRY, (__u16)port, a);
}

/*
 * dest_find is the pool of a connect to port (network order) at addr that
 * read dest_kinds as kinds, looked up as dest_connect does, inline: what
 * the tests check (fs_selftest_dest).
 */
static __always_inline __u32 dest_find(const struct fs_settings *cfg, __u32 kinds, __u16 port, const __u8 *addr)
{
	const __u64 *q = (const __u64 *)addr;
	__u32 how = dest_first(cfg, kinds, port, addr);
	if (how == DEST_RETRY)
		return dest_lookup_again(*(volatile __u32 *)&cfg->dest_kinds, port, q[0], q[1]);
	__u32 pool = how ? dest_try(cfg, kinds, how, port, addr) : 0;
	if (pool != DEST_AGAIN)
		return pool;
	return dest_lookup_again(*(volatile __u32 *)&cfg->dest_kinds, port, q[0], q[1]);
}

/* dest_pool is destination pool v as the rule (share.h) takes it. */
static __always_inline struct rule_pool dest_pool(struct dest_view *v)
{
	struct rule_pool r = {.size = &v->s->size, .floor = &v->s->floor, .window_ns = &v->s->window_ns,
			      .active = &v->s->active, .in_use = &v->s->in_use, .cap_pool = v->id, .packed = true,
			      .fleet_safe = &v->s->fleet_safe};
	return r;
}

/*
 * dest_admit applies the rule in the pool (pool_admit), or project id's fleet
 * cap in it (cap.h): 1 and the permit taken, or 0. clk: the run's clock
 * reading (clock_ns), which the node's admission then takes.
 */
static __always_inline int dest_admit(struct fs_settings *cfg, struct dest_view *v, __u64 id, __u64 *clk)
{
	struct rule_pool r = dest_pool(v);
	return pool_admit(cfg, &r, id, v->p, CLK_COARSE, false, clk);
}

/*
 * dest_adopt counts a permit of project id in pool for a socket the reconcile
 * dump adopts (fs_dump) or moves to id (move_held): held, not admitted,
 * past the rule. True if the pool's rule (or the project's fleet cap in it)
 * would refuse a connect of the project now, checked before the ask is
 * stamped as the node's adoption checks: the pool's in_use (for a move,
 * the permit moved included) at or past the project's limit, or the
 * project at its cap. Reported as the node's
 * adoption is, enforced or in dry-run (where a refusal is a would_refuse);
 * never for a removed pool, which has no rule.
 */
static __always_inline bool dest_adopt(__u32 pool, __u64 id)
{
	struct dest_view v;
	if (!dest_get(pool, id, &v))
		return false;
	struct fs_settings *cfg = settings();
	struct rule_pool r = dest_pool(&v);
	bool past = cfg && (v.s->flags & DEST_LIVE) &&
		    *(volatile __s64 *)&v.s->in_use >= rule_limit(cfg, &r, id, v.p, false);
	/* Stamped as an ask, as the node's adoption (force): a newcomer
	 * counts in the pool's active set now, not at the next Tick. */
	__u64 clk = 0;
	pool_seen(&r, v.p, true, &clk);
	__sync_fetch_and_add(&v.s->in_use, 1);
	__sync_fetch_and_add(&v.p->in_use, 1); /* packed: held only */
	return past;
}

/* dest_take_past takes a permit in the pool without the rule (dry-run). */
static __always_inline void dest_take_past(struct dest_view *v)
{
	__sync_fetch_and_add(&v->s->in_use, 1);
	__sync_fetch_and_add(&v->p->in_use, PACKED_ADMIT);
}

/*
 * dest_give gives a permit of project id back to pool (a release, or the
 * undo of one the node's pool then refused): pool_give, as the node's
 * unadmit, with the run's clock reading clk (clock_ns). The pool's settings
 * are not needed: only its counters are looked up.
 */
static __always_inline void dest_give(__u32 pool, __u64 id, bool fine, __u64 *clk)
{
	__u32 k = pool;
	struct fs_dest_state *s = bpf_map_lookup_elem(&fs_dpool_state, &k);
	if (pool == 0 || id >= dest_stride || !s)
		return;
	__u32 i = (pool - 1) * dest_stride + (__u32)id;
	struct fs_project *p = bpf_map_lookup_elem(&fs_dpool_proj, &i);
	if (!p)
		return;
	pool_give(&s->in_use, p, true, fine, clk);
}

/* dest_release gives back the destination permit a socket's entry kept. */
static __always_inline void dest_release(__u32 pool, __u64 id, bool fine, __u64 *clk)
{
	dest_give(pool, id, fine, clk);
}

/* dest_event reports a connect refused (or, would, admitted in dry-run) by pool v. */
static __always_inline void dest_event(struct bpf_sock_addr *ctx, bool v6, __u64 id, struct dest_view *v, bool would)
{
	__u64 now = 0;
	struct fs_event *ev = ev_reserve(id, &now);
	if (!ev)
		return;
	__s64 taken = would ? 1 : 0;
	__s64 held = packed_held(*(volatile __s64 *)&v->p->in_use) - taken;
	__u32 size = v->s->size;
	struct fs_settings *cfg = settings();
	/* At the safe slice (cap.h): the pool that was divided. */
	__u32 safe = cfg ? fleet_safe_now(cfg, &v->s->fleet_safe) : 0;
	bool binds = safe && safe - 1 < size;
	if (binds)
		size = safe - 1;
	__s64 active = *(volatile __s64 *)&v->s->active;
	__u32 share = active > 1 ? size / (__u32)active : size;
	__u32 floor = v->s->floor < size ? v->s->floor : size;
	if (share < floor)
		share = floor;
	__u32 cap = cfg && !safe ? fleet_cap(cfg, v->id, id) : 0;
	if (cap)
		share = cap - 1; /* a capped project's bound is its cap */
	struct fs_tuple t __attribute__((aligned(8))) = {};
	tuple_connect(ctx, v6, &t);
	ev->project = id;
	ev->time_ns = now;
	__builtin_memcpy(&ev->tuple, &t, sizeof(ev->tuple));
	ev->_pad0 = 0;
	ev->held = held;
	ev->in_use = *(volatile __s64 *)&v->s->in_use - taken;
	ev->share = share;
	ev->pool = size;
	ev->dir = FS_DIR_CONNECT;
	struct rule_pool r = dest_pool(v);
	ev->reason = binds ? FS_REASON_FLEET_SAFE
		     : cap ? (held >= (__s64)cap - 1 ? FS_REASON_FLEET_CAP : FS_REASON_POOL_FULL)
			   : pool_under(&r, held, false) ? FS_REASON_POOL_FULL : FS_REASON_OVER_SHARE;
	ev->flags = would ? FS_EV_WOULD | FS_EV_TAKEN : 0;
	if (would && lapse_of())
		ev->flags |= FS_EV_LAPSED;
	__builtin_memset(ev->_pad, 0, sizeof(ev->_pad));
	ev->dest = v->id;
	bpf_ringbuf_submit(ev, 0);
	EVCOUNT(emitted);
}

/* dest_addr is the address connect() was called with, v4-mapped if IPv4. */
static __always_inline void dest_addr(struct bpf_sock_addr *ctx, bool v6, __u8 *a)
{
	if (v6) {
		__u32 *r = (__u32 *)a;
		r[0] = ctx->user_ip6[0];
		r[1] = ctx->user_ip6[1];
		r[2] = ctx->user_ip6[2];
		r[3] = ctx->user_ip6[3];
	} else {
		v4mapped(a, ctx->user_ip4);
	}
}

/*
 * connect_host says whether the connecting socket is an unclassified pod's
 * of the host's network namespace (project.h, WEAK_HOST), which no pool
 * refuses. Asked on the refusal path only: the member walk's memo answers.
 */
static __always_inline bool connect_host(struct bpf_sock_addr *ctx)
{
	struct bpf_sock *bs = ctx->sk;
	if (!bs)
		return false;
	__u64 cg = 0, weak = 0;
	sock_project_of(CAST(struct sock, bs), &cg, &weak);
	return weak == WEAK_HOST;
}

/*
 * dest_take is dest_connect past the filter (how, as for dest_try): the
 * pool looked up, the rule applied, a refusal counted and reported. The
 * pool's id if a permit was taken in it, minus it if the pool refused, 0
 * if none matches, DEST_AGAIN (nothing taken) for a try made again.
 */
static __always_inline int dest_take(struct bpf_sock_addr *ctx, bool v6, __u64 id, __u32 kinds, __u64 *clk, __u32 how)
{
	struct fs_settings *cfg = settings();
	if (!cfg || !clk)
		return 0;
	addr_buf a;
	dest_addr(ctx, v6, a);
	__u32 pool = dest_try(cfg, kinds, how, (__u16)ctx->user_port, a);
	if (!pool || pool == DEST_AGAIN)
		return pool;
	struct dest_view v;
	if (!dest_get(pool, id, &v))
		return 0;
	if (dest_admit(cfg, &v, id, clk))
		return pool;
	/* Dry-run: the pool's, the project's, or the node's enforcement
	 * lapsed (no daemon's heartbeat, events.h): a destination pool stops
	 * refusing with the node's pool. */
	if ((v.s->flags & DEST_DRYRUN) || bpf_map_lookup_elem(&fs_dryrun, &id) || lapse_of()) {
		dest_take_past(&v);
		__sync_fetch_and_add(&v.s->would, 1);
		dest_event(ctx, v6, id, &v, true);
		return pool;
	}
	/* An unclassified pod of the host's network namespace: past the rule,
	 * as the node's pool takes it (KIND_OUT_HOST), nothing reported. */
	if (connect_host(ctx)) {
		dest_take_past(&v);
		return pool;
	}
	__sync_fetch_and_add(&v.p->refused, 1);
	__sync_fetch_and_add(&v.s->refused, 1);
	dest_event(ctx, v6, id, &v, false);
	return -(int)pool;
}

/*
 * dest_take4 and dest_take6 are dest_take for connect4 and connect6: global
 * functions, each verified once on its own (the verifier knows nothing of
 * what it returns or writes to *clk). Inlined, the lookup's and the rule's
 * paths multiplied those of the node's admission after them: the verifier
 * walked 370k instructions of connect4 and 839k of connect6 (the deepest
 * cgroup walk), near its limit of 1M, and loading the programs took
 * 2.7-3.0 s of CPU (at the default depth); it walks 142k and 153k now
 * (TestVerifierHeadroom), and a load takes 1.0-1.3 s.
 * A match costs some 45 ns more than inlined on the AMD EPYC VMs of
 * 2026-12-07, not for the call (a call alone costs some 5 ns there) but
 * for the code and data lines a match is the first to touch, this
 * function's first among them; a connect the filter stops is the cheaper
 * for it: docs/measurements-log.md.
 */
__noinline int dest_take4(struct bpf_sock_addr *ctx, __u64 id, __u32 kinds, __u64 *clk, __u32 how)
{
	return dest_take(ctx, false, id, kinds, clk, how);
}

__noinline int dest_take6(struct bpf_sock_addr *ctx, __u64 id, __u32 kinds, __u64 *clk, __u32 how)
{
	return dest_take(ctx, true, id, kinds, clk, how);
}

/* Outcomes of dest_connect. */
#define DEST_NONE 0    /* no destination pool: nothing taken */
#define DEST_TAKEN 1   /* a permit taken in pool *dest */
#define DEST_REFUSED 2 /* the pool refused: refuse the connect */

/*
 * dest_connect takes the permit of a connect() of project id in the
 * destination pool its address matches, if any (pool id in *dest). A
 * refusal is counted and reported; in dry-run (the pool's, or the
 * project's) it is taken past the rule and counted as would_refuse. clk:
 * the run's clock reading (clock_ns), shared with the node's admission.
 * The filter runs here, inline: a connect it stops makes no call, unless
 * dest_kinds changed meanwhile (a second try, dest_first).
 */
static __always_inline int dest_connect(struct bpf_sock_addr *ctx, bool v6, __u64 id, __u32 *dest, __u64 *clk)
{
	struct fs_settings *cfg = settings();
	if (!cfg)
		return DEST_NONE;
	__u32 kinds = *(volatile __u32 *)&cfg->dest_kinds;
	if (!(kinds & DEST_KINDS))
		return DEST_NONE;
	addr_buf a;
	dest_addr(ctx, v6, a);
	__u32 how = dest_first(cfg, kinds, (__u16)ctx->user_port, a);
	if (!how)
		return DEST_NONE;
	if (how == DEST_RETRY)
		kinds = *(volatile __u32 *)&cfg->dest_kinds;
	int r = v6 ? dest_take6(ctx, id, kinds, clk, how) : dest_take4(ctx, id, kinds, clk, how);
	if (r == DEST_AGAIN) {
		kinds = *(volatile __u32 *)&cfg->dest_kinds;
		r = v6 ? dest_take6(ctx, id, kinds, clk, DEST_RETRY) : dest_take4(ctx, id, kinds, clk, DEST_RETRY);
	}
	if (!r)
		return DEST_NONE;
	*dest = r < 0 ? -r : r;
	return r < 0 ? DEST_REFUSED : DEST_TAKEN;
}
