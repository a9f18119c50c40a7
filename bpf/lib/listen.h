/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Listener bookkeeping: which project listens on which address, for
 * sk_lookup, which has no cgroup to ask. A project's listening socket is
 * counted under its address (fs_listeners, keyed by fs_listen_key, which
 * only this header fills) when it starts listening or the reconcile dump
 * sees it, and uncounted once when it closes (fs_listen_socks).
 *
 * fs_ports holds the project listening addresses per local port (all
 * namespaces), split by kind: the cheap first filter of the inbound paths,
 * which run for every SYN and every accepted child of the host, and a hint
 * that spares the listener lookup that would miss (a wildcard listener, the
 * usual server, is found with one lookup instead of two). An array lookup is
 * inlined by the verifier; the hash lookups behind it are not.
 *
 * A port with one listening address (the usual case) also names its
 * listening socket, the owner, so that sk_lookup and fs_sockops find it
 * without the fs_listeners lookup and read the listener's address and
 * namespace from the socket itself. The owner is the socket's address, its
 * cookie, its project and cgroup (from the listener entry) and a check word
 * mixed from the four, written last. A reader recomputes the check from the
 * words it read: words of two different writes do not match it, so the
 * reader falls back to the hash, and it then checks the socket itself,
 * which no longer listens or has another cookie if it closed (or its memory
 * was reused). No sequence lock, no reliance on the order in which the CPU
 * makes stores or loads visible. The socket is freed an RCU grace period
 * after it stopped listening, and sk_lookup runs under RCU, so a socket named
 * by an owner it read stays readable while it looks. (The project is kept
 * here because finding it from the socket's cgroup is a chain of six
 * dependent loads, ~25 ns of sk_lookup.)
 */
#pragma once

#include "project.h"
#include "addr.h"

/*
 * listen_addr fills the listening address of sk as fs_listen_key keeps it
 * (all zero for a wildcard) and returns its scope: the families of the SYNs
 * it takes.
 */
static __always_inline __u32 listen_addr(struct sock *sk, __u8 *addr)
{
	if (sk->__sk_common.skc_family == AF_INET) {
		__be32 a = sk->__sk_common.skc_rcv_saddr;
		if (a == 0)
			__builtin_memset(addr, 0, 16);
		else
			v4mapped(addr, a);
		return SCOPE_V4;
	}
	in6_load(addr, &sk->__sk_common.skc_v6_rcv_saddr);
	if (!wild_addr(addr))
		return is_v4mapped(addr) ? SCOPE_V4 : SCOPE_V6;
	return BPF_CORE_READ_BITFIELD(sk, __sk_common.skc_ipv6only) ? SCOPE_V6 : SCOPE_V4 | SCOPE_V6;
}

/* listen_key_of fills the key of listening socket sk's address. */
static __always_inline void listen_key_of(struct sock *sk, struct fs_listen_key *k)
{
	k->netns = sock_netns(sk);
	k->port = sk->__sk_common.skc_num;
	k->scope = listen_addr(sk, k->addr);
}

/*
 * syn_key fills the key of the specific address a SYN of family fam to
 * laddr:port in netns is for; find_listener then tries the wildcards.
 */
static __always_inline void syn_key(struct fs_listen_key *k, __u64 netns, __u32 port, __u16 fam, const __u8 *laddr)
{
	k->netns = netns;
	k->port = port;
	k->scope = fam == AF_INET ? SCOPE_V4 : SCOPE_V6;
	__builtin_memcpy(k->addr, laddr, 16);
}

#define PORT_SPECIFIC 1ULL
#define PORT_WILDCARD (1ULL << 16)
#define PORT_VERSION (1ULL << 32)

static __always_inline __u64 *port_state(struct fs_port *n)
{
	return (__u64 *)n;
}

/* port_addrs is the number of listening addresses a port state word counts. */
static __always_inline __u32 port_addrs(__u64 w)
{
	return (w & 0xffff) + ((w >> 16) & 0xffff);
}

/*
 * owner_check mixes the words of a port's owner: a reader that got them from
 * different writes recomputes another value (but for a chance of 2^-64).
 */
static __always_inline __u64 owner_check(__u64 sk, __u64 cookie, __u64 id, __u64 cg)
{
	__u64 h = (sk ^ 0x5bd1e9955bd1e995ULL) * 0x9e3779b97f4a7c15ULL;
	h = (h ^ (h >> 29) ^ cookie) * 0xbf58476d1ce4e5b9ULL;
	h = (h ^ (h >> 31) ^ id) * 0x94d049bb133111ebULL;
	h = (h ^ (h >> 29) ^ cg) * 0x9e3779b97f4a7c15ULL;
	return h ^ (h >> 32);
}

/*
 * port_change records a change of k's port: d = 1 address k added, -1
 * removed, 0 its listener (the owner) replaced. The counts are changed
 * whatever they are (see fs_port): a removal that comes before its addition
 * (an on_listen and a close racing) leaves them right once both are done.
 * A change that leaves k the port's only address names k's listener, as the
 * hash holds it after the change, as the owner, unless the port changed
 * again meanwhile (the later change names its own). Readers check the owner
 * against the socket, so a stale or half-written one costs them a hash
 * lookup, never a wrong answer.
 */
static __always_inline void port_change(struct fs_listen_key *k, int d)
{
	__u32 port = k->port;
	struct fs_port *n = bpf_map_lookup_elem(&fs_ports, &port);
	if (!n)
		return;
	__u64 one = wild_addr(k->addr) ? PORT_WILDCARD : PORT_SPECIFIC;
	__u64 delta = PORT_VERSION + (d > 0 ? one : d < 0 ? -one : 0);
	__u64 w = __sync_fetch_and_add(port_state(n), delta) + delta;
	if (d < 0 || port_addrs(w) != 1)
		return;
	/* Looked up after the change: a delete of k that this change did not
	 * see has already taken k out of the hash. */
	struct fs_listener *l = bpf_map_lookup_elem(&fs_listeners, k);
	if (!l || *(volatile __u64 *)port_state(n) != w)
		return;
	__u64 sk = l->sk, cookie = l->cookie, id = l->project, cg = l->cgroup;
	n->sk = sk;
	n->cookie = cookie;
	n->project = id;
	n->cgroup = cg;
	*(volatile __u64 *)&n->check = owner_check(sk, cookie, id, cg);
}

/*
 * on_listen counts a project's listening socket under its address for
 * sk_lookup. A socket already counted (the reconcile dump sees every
 * listener again) is not counted twice; if its address entry is missing
 * (see unlisten), it is put back. A socket is counted once however often it
 * is seen, and uncounted once: only the close whose delete from
 * fs_listen_socks succeeds drops a ref.
 *
 * A listener that finds fs_listen_socks or fs_listeners full goes
 * uncounted: the rule neither counts nor refuses its inbound connections.
 * That is counted as map_full, at its listen and again at every reconcile
 * pass that sees it while the table has no room (the pass tries again).
 */
static __noinline void on_listen(struct sock *sk)
{
	__u64 cg = 0;
	__u64 id = sock_project(sk, &cg);
	if (!id)
		return;
	struct fs_listen_key k = {};
	listen_key_of(sk, &k);
	__u64 cookie = bpf_get_socket_cookie(sk);
	struct fs_listener nl = {.project = id, .cgroup = cg, .sk = (__u64)sk, .cookie = cookie, .refs = 1};
	long err;
	if (bpf_map_update_elem(&fs_listen_socks, &cookie, &k, BPF_NOEXIST)) {
		if (!bpf_map_lookup_elem(&fs_listen_socks, &cookie)) {
			COUNT(map_full); /* the listener goes uncounted */
			return;
		}
		if (!bpf_map_lookup_elem(&fs_listeners, &k)) {
			err = bpf_map_update_elem(&fs_listeners, &k, &nl, BPF_NOEXIST);
			if (err == 0)
				port_change(&k, 1);
			else if (err != -EEXIST)
				COUNT(map_full);
		}
		return;
	}
	struct fs_listener *l = bpf_map_lookup_elem(&fs_listeners, &k);
	if (!l) {
		err = bpf_map_update_elem(&fs_listeners, &k, &nl, BPF_NOEXIST);
		if (err == 0) {
			port_change(&k, 1);
			return;
		}
		if (err != -EEXIST) {
			/* Counted in fs_listen_socks only: the next reconcile
			 * pass puts the address in if there is room then. */
			COUNT(map_full);
			return;
		}
		/* Another socket of the address won the insert. */
		l = bpf_map_lookup_elem(&fs_listeners, &k);
		if (!l)
			return;
	}
	/* Another SO_REUSEPORT listener: the latest names the project. */
	l->project = nl.project;
	l->cgroup = nl.cgroup;
	l->sk = nl.sk;
	l->cookie = nl.cookie;
	__sync_fetch_and_add(&l->refs, 1);
	port_change(&k, 0);
}

/* listened returns the port's entry if a project listens on it, else NULL. */
static __always_inline struct fs_port *listened(__u32 port)
{
	struct fs_port *n = bpf_map_lookup_elem(&fs_ports, &port);
	return n && (n->specific || n->wildcard) ? n : NULL;
}

/*
 * unlisten uncounts the listening socket counted under cookie: it drops the
 * socket's ref; the last one deletes the address. A listener opened on the
 * address in the instant between the last ref's drop and the delete loses
 * its entry with it; the next reconcile dump puts it back (on_listen). It
 * returns whether this call uncounted it: the close of the listener, or
 * reconcile (OP_UNLISTEN) for a socket whose close the programs missed.
 */
static __always_inline bool unlisten(__u64 cookie)
{
	struct fs_listen_key *ck = bpf_map_lookup_elem(&fs_listen_socks, &cookie);
	if (!ck)
		return false;
	struct fs_listen_key k = {};
	__builtin_memcpy(&k, ck, sizeof(k));
	if (bpf_map_delete_elem(&fs_listen_socks, &cookie))
		return false; /* someone else uncounted it */
	struct fs_listener *l = bpf_map_lookup_elem(&fs_listeners, &k);
	if (!l)
		return true;
	if (__sync_fetch_and_add(&l->refs, -1) <= 1 && bpf_map_delete_elem(&fs_listeners, &k) == 0)
		port_change(&k, -1);
	return true;
}

/*
 * A listener as sk_lookup sees it: its project and cgroup id, and the
 * socket (NULL when it cannot be checked).
 */
struct lview {
	__u64 project;
	__u64 cgroup;
	struct sock *sk;
};

/*
 * listening_sock makes the socket address p, named by an owner or a
 * listener entry with the given cookie, into a socket pointer if it is that
 * socket and it still listens; else NULL.
 */
static __always_inline struct sock *listening_sock(__u64 p, __u64 cookie)
{
	if (!p)
		return NULL;
	struct sock *sk = CAST(struct sock, p);
	if (sk->__sk_common.skc_cookie.counter != cookie || sk->__sk_common.skc_state != TCP_LISTEN)
		return NULL;
	return sk;
}

/* Outcomes of port_owner. */
#define OWNER_UNKNOWN -1 /* no valid owner: look in the hash */
#define OWNER_OTHER 0    /* the port's only listener does not take this SYN */
#define OWNER_TAKES 1    /* it does: *v */

/*
 * port_owner checks whether the port's only listening socket takes a SYN of
 * family fam to laddr (v4-mapped for IPv4) in netns, reading the socket's
 * own address, scope and namespace.
 */
static __always_inline int port_owner(struct fs_port *n, __u64 w, __u64 netns, __u16 fam, const __u8 *laddr, struct lview *v)
{
	if (port_addrs(w) != 1)
		return OWNER_UNKNOWN;
	__u64 p = n->sk, cookie = n->cookie, id = n->project, cg = n->cgroup;
	if (owner_check(p, cookie, id, cg) != *(volatile __u64 *)&n->check)
		return OWNER_UNKNOWN;
	struct sock *sk = listening_sock(p, cookie);
	if (!sk)
		return OWNER_UNKNOWN;
	if (sock_netns(sk) != netns)
		return OWNER_OTHER;
	addr_buf addr;
	__u32 scope = listen_addr(sk, addr);
	if (!(scope & (fam == AF_INET ? SCOPE_V4 : SCOPE_V6)))
		return OWNER_OTHER;
	const __u64 *a = (const __u64 *)addr, *b = (const __u64 *)laddr;
	if ((a[0] || a[1]) && (a[0] != b[0] || a[1] != b[1]))
		return OWNER_OTHER;
	v->sk = sk;
	v->project = id;
	v->cgroup = cg;
	return OWNER_TAKES;
}

/*
 * find_listener looks k (the SYN's address, scope of its family) up, then
 * the wildcards that take its family, skipping a kind the port (its entry n)
 * lacks.
 */
static __always_inline struct fs_listener *find_listener(struct fs_port *n, struct fs_listen_key *k)
{
	if (n->specific) {
		struct fs_listener *l = bpf_map_lookup_elem(&fs_listeners, k);
		if (l)
			return l;
	}
	if (!n->wildcard)
		return NULL;
	__builtin_memset(k->addr, 0, 16);
	struct fs_listener *l = bpf_map_lookup_elem(&fs_listeners, k);
	if (l)
		return l;
	k->scope = SCOPE_V4 | SCOPE_V6;
	return bpf_map_lookup_elem(&fs_listeners, k);
}

/*
 * syn_listener finds the project listener that takes a segment of family fam
 * to laddr:lport in netns (port: the port's entry, w its state word): the
 * port's owner if it has a valid one, else the listener entries. false: no
 * project listener takes it (the address's only listener no longer listens:
 * its close is on its way, or was missed). With SO_REUSEPORT an entry names
 * the latest listener, whose project is the group's (the kernel lets only
 * sockets of one user share a port).
 */
static __always_inline bool syn_listener(struct fs_port *port, __u64 w, __u64 netns, __u32 lport, __u16 fam,
					 const __u8 *laddr, struct lview *v)
{
	int own = port_owner(port, w, netns, fam, laddr, v);
	if (own == OWNER_OTHER)
		return false;
	if (own == OWNER_TAKES)
		return true;
	struct fs_listen_key lk = {};
	syn_key(&lk, netns, lport, fam, laddr);
	struct fs_listener *l = find_listener(port, &lk);
	if (!l)
		return false;
	v->project = l->project;
	v->cgroup = l->cgroup;
	v->sk = listening_sock(l->sk, l->cookie);
	return v->sk || l->refs > 1;
}
