// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * fairshare connection limiter: TCP connection permits per project, taken at
 * connect (outbound) and when the kernel makes an inbound handshake's request
 * socket, released when the socket dies.
 *
 * A project is a compact id whose members are registered cgroups at any
 * depth (lib/project.h). The rule (see pools/doc.go) is applied here
 * with POOL and FLOOR from the config map and share = max(FLOOR, POOL /
 * active):
 *
 *   admit = in_use < POOL          when the project holds < share
 *         = in_use < POOL - FLOOR  when the project holds >= share
 *
 * active (fs_node) is the number of projects in the active window. A project
 * asking for the first time in the window (a new entry, or its last ask older
 * than the window while it holds nothing) bumps it here, so a newcomer
 * shrinks everyone's share at its first ask, as in package pools, and not a
 * tick later. Only the control loop (loader.Tick) lowers it, when projects
 * leave the window. Without the control loop active can only grow, so the
 * share can only shrink: a full node still keeps the floor free and a node
 * with room refuses nothing.
 *
 * Node-wide in_use never exceeds POOL, not even transiently: it is taken with
 * a bounded compare-and-swap loop that only moves it to a value the rule
 * allows. A project's own count is read before and added after, so
 * concurrent connects of one project (at most one per CPU) can all see it
 * below its share and all use the POOL limit: the project can pass its share
 * by at most (CPUs - 1) while the pool has room, never the pool itself.
 *
 * Exempt sockets (their cgroup, or the registered cgroup they are in, is in fs_exempt) take a
 * permit from a separate budget (exempt_max, taken with a fetch-add rolled
 * back when it went over) and are neither refused by the rule nor counted in
 * in_use; over the budget they go under the rule like any socket of their
 * project. So the exempt set adds at most exempt_max connections to POOL.
 * Every admission (connect, request socket, a child admitted late) runs
 * take_permit (lib/rule.h): take, record, undo if it cannot be recorded.
 *
 * Programs (kept few: each one runs on a hot path):
 *   cgroup/connect4, cgroup/connect6  outbound admission, process context;
 *                                      a refusal makes connect() fail at
 *                                      once with ECONNREFUSED
 *   sk_lookup                          inbound admission: the rule alone, for
 *                                      every segment no socket of the host
 *                                      took yet (a SYN, a stray segment, a
 *                                      SYN cookie's ACK); a refusal is
 *                                      SK_DROP, the kernel answers with an
 *                                      RST, the client sees ECONNREFUSED (a
 *                                      refused cookie ACK resets a
 *                                      connection the client already has)
 *                                      and accept() never sees it
 *   sockops (TIMEOUT_INIT)             the inbound permit, taken when the
 *                                      kernel makes a request socket
 *   tp_btf/inet_sock_set_state         listener bookkeeping, inbound permit
 *                                      conversion at ESTABLISHED, release at
 *                                      TCP_CLOSE
 *   cgroup/sock_release                release when the fd is closed before
 *                                      the socket reaches TCP_CLOSE
 *   iter/tcp                           adoption of sockets that predate the
 *                                      programs, and the reconcile dump
 *   syscall                            atomic adjustments from user space
 *                                      (expired reservations, drift repair),
 *                                      and single steps of the slot and port
 *                                      protocols for the tests (fs_selftest)
 *
 * A held permit is an entry keyed by the socket cookie (lib/held.h: a slot
 * of fs_slots, or fs_held when the slot is taken). Every release path clears the entry
 * and only the caller whose compare-and-swap or delete succeeded gives the
 * permit back, so a socket releases exactly once however many of
 * the paths fire (an orderly close runs sock_release and then TCP_CLOSE).
 *
 * An inbound permit is taken as a reservation when the kernel makes the
 * handshake's request socket, and exists while that socket or its child
 * does: while the handshake can still become an accepted connection. Only
 * the kernel decides that, so no packet is trusted: sk_lookup, which cannot
 * see TCP flags, applies the rule and takes nothing; fs_sockops runs at
 * BPF_SOCK_OPS_TIMEOUT_INIT, which tcp_conn_request runs only for a request
 * socket it is about to queue: never for a segment that is not a SYN, a SYN
 * the kernel drops (a full accept queue, whichever SO_REUSEPORT member it
 * was steered to) or answers with a SYN cookie (no request socket: the
 * child takes its permit when it is established). The reservation is keyed
 * by the request socket's cookie (lib/resv.h: a slot of fs_resv_slots, or
 * fs_reservations), which the kernel copies to the child, and is ended
 * exactly once: by the conversion at ESTABLISHED (the child's cookie), or
 * by the expiry from user space (loader.Tick) past the reservation TTL once
 * sock_diag no longer lists the request socket (the client reset it, the
 * kernel timed it out); a reservation of another network namespace, which
 * the daemon cannot list, expires after the TTL as it is.
 *
 * Memory order: a port's owner needs none: its words carry a check word
 * and name a socket that is checked in turn (see lib/listen.h), so it is read
 * right on any architecture. The slot protocols (fs_slots, fs_resv_slots)
 * do rely on x86: a slot's fields are published by a plain store of its tag
 * after them and read with plain loads after it, which x86 keeps in order
 * (stores after stores, loads after loads). The object is built for x86
 * alone (gen.go), which loader.TestObjectIsX86Only checks: another target
 * needs release stores and acquire loads there first.
 *
 * Layout: one object, its parts in lib/ by data structure, each header
 * including what it builds on:
 *   lib/common.h   kernel types, helpers, constants, the clock, publish
 *   lib/types.h    the types the loader shares (the pinned format)
 *   lib/maps.h     every map, and the node's config, counts and counters
 *   lib/project.h  which project a task or a socket counts for
 *   lib/addr.h     addresses as the keys keep them
 *   lib/held.h     the held-permit table (by socket cookie)
 *   lib/resv.h     the reservation table (by request socket cookie)
 *   lib/cap.h      the fleet caps: a project's bound in a fleet pool on this node
 *   lib/share.h    the rule over a pool given as an argument (the node's, a
 *                  destination pool's): stamp, share, limit, admit, give
 *                  back; the exempt set
 *   lib/events.h   refusal events (a ring buffer, bounded per project), dry-run
 *                  and the lapse
 *   lib/dest.h     destination pools: a pool chosen by where a connect goes
 *                  (a table probed per prefix length, then an LPM trie),
 *                  under share.h's rule
 *   lib/rule.h     the rule, the exempt budget, take_permit, give_back
 *   lib/listen.h   listener bookkeeping: addresses, ports, owners
 *   lib/rate.h     a project's rate of new connections (token buckets)
 *   lib/relookup.h a SYN looked up twice (an nftables socket expression):
 *                  its refusal counted once
 * The programs follow here in the order of the table above.
 */
#include "lib/common.h"
#include "lib/types.h"
#include "lib/maps.h"
#include "lib/project.h"
#include "lib/addr.h"
#include "lib/held.h"
#include "lib/resv.h"
#include "lib/cap.h"
#include "lib/share.h"
#include "lib/events.h"
#include "lib/dest.h"
#include "lib/rule.h"
#include "lib/listen.h"
#include "lib/rate.h"
#include "lib/relookup.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/*
 * connect_kind is the kind a connect's permit takes (holder.kind_out), by
 * its project's registration (weak: sock_project_of's). An unclassified
 * pod's connect (a weak registration's, project.h) made in a lapse is never
 * aborted when the pod is classified (nothing would have refused it), and
 * one of the host's network namespace is never refused. Only these pay the
 * lapse's clock. A global function, verified once: its answer is any
 * scalar to the verifier, so the connect's paths are not walked again for
 * each kind. A classified project's connect (weak 0) does not call it: the
 * constant path is pruned against the call's (fs_connect4 verified in
 * 166k instructions either way).
 */
__noinline __u32 connect_kind(__u64 weak)
{
	if (!weak)
		return KIND_OUT;
	if (lapse_of())
		return KIND_OUT_LAX;
	return weak == WEAK_HOST ? KIND_OUT_HOST : KIND_OUT;
}

static __always_inline int connect_common(struct bpf_sock_addr *ctx, bool v6)
{
	/* Cheapest filter first: UDP connect runs this hook too. */
	if (ctx->type != SOCK_STREAM)
		return 1;
	struct bpf_sock *bs = ctx->sk;
	__u64 id = 0, cg = 0, weak = 0;
	struct fs_project *p = task_project(bs, &id, &cg, &weak);
	if (!id)
		return 1;
	/* The socket's netns is read from the socket itself (record): two
	 * loads where the helper is a call. */
	struct holder h = {.cookie = bpf_get_socket_cookie(ctx), .sk = bs ? CAST(struct sock, bs) : NULL};
	h.kind_out = weak ? connect_kind(weak) : KIND_OUT;
	/* The project's rate first (rate.h): a refusal by it never touches
	 * the pool's counters, and its token goes back unless a permit is
	 * taken. */
	struct rate_ticket t;
	if (!rate_gate(AT_CONNECT, &h, id, 0, &t)) {
		rate_event_connect(ctx, v6, id, false);
		goto refuse;
	}
	/* The destination pool's permit (dest.h) before the node's, kept with
	 * it in the socket's entry (h.dest) and given back if the node's
	 * pool takes none. */
	if (dest_connect(ctx, v6, id, &h.dest, &h.clk) == DEST_REFUSED) {
		rate_settle(&t, AT_CONNECT, &h, REFUSED);
		goto refuse;
	}
	int r = rate_settle(&t, AT_CONNECT, &h, take_permit(AT_CONNECT, CLK_COARSE, &h, id, p, cg, 0));
	if (h.dest && r != TAKEN && r != WOULD)
		dest_give(h.dest, id, false, &h.clk);
	if (rate_would(&t, id, FS_DIR_CONNECT, r))
		rate_event_connect(ctx, v6, id, true);
	if (r == TAKEN || r == NOT_TAKEN)
		return 1;
	refused_connect(ctx, v6, id, p, r == WOULD);
	if (r == WOULD)
		return 1;
refuse:
	/* A refused connect holds nothing: a leftover of an earlier failed
	 * connect() of the socket (connect_stale) is ended here too when the
	 * rate or a destination pool refused before take_permit ran, rather
	 * than kept, in the pool of that earlier connect, until the close. */
	if (recorded(AT_CONNECT, &h))
		connect_stale(h.cookie);
	bpf_set_retval(-ECONNREFUSED);
	return 0;
}

SEC("cgroup/connect4")
int fs_connect4(struct bpf_sock_addr *ctx)
{
	/* 0 or 1 as the verifier sees it: clang may return a spilled copy
	 * of what it knows is 0 or 1, which the verifier cannot bound. */
	int ret = connect_common(ctx, false);
	barrier_var(ret);
	return ret & 1;
}

SEC("cgroup/connect6")
int fs_connect6(struct bpf_sock_addr *ctx)
{
	/* 0 or 1 as the verifier sees it: clang may return a spilled copy
	 * of what it knows is 0 or 1, which the verifier cannot bound. */
	int ret = connect_common(ctx, true);
	barrier_var(ret);
	return ret & 1;
}

/*
 * The network namespace this instance of fs_sk_lookup is attached to: an
 * sk_lookup program cannot ask (bpf_get_netns_cookie is refused to it), so
 * the loader loads one instance per namespace with its cookie here, all
 * sharing the pinned maps (loader/netns.go).
 */
volatile const __u64 lookup_netns;

SEC("sk_lookup")
int fs_sk_lookup(struct bpf_sk_lookup *ctx)
{
	if (ctx->protocol != IPPROTO_TCP)
		return SK_PASS;
	__u32 lport = ctx->local_port;
	struct fs_port *port = bpf_map_lookup_elem(&fs_ports, &lport);
	if (!port)
		return SK_PASS;
	__u64 w = *(volatile __u64 *)port_state(port);
	if (!(w & 0xffffffff))
		return SK_PASS;
	struct fs_settings *cfg = settings();
	if (!cfg)
		return SK_PASS;

	addr_buf laddr;
	__u16 fam = ctx->family;
	CTX_LADDR(ctx, fam, laddr);
	struct lview v = {};
	if (!syn_listener(port, w, lookup_netns, lport, fam, laddr, &v))
		return SK_PASS;
	/*
	 * Only the rule, no permit: this program cannot see TCP flags, and a
	 * segment is not a handshake. The permit is taken when the kernel makes
	 * a request socket for a SYN (fs_sockops), or when the child of a SYN
	 * cookie is established (on_established); a segment the kernel drops
	 * takes nothing. A refusal is SK_DROP: the kernel answers with an RST.
	 * The project's rate (rate.h) takes a token first, for whatever segment
	 * gets here (a SYN, a cookie's ACK; a retransmitted SYN finds its
	 * request socket before any lookup of a listener), given back when the
	 * rule refuses. A SYN looked up twice (relookup.h) gets the first
	 * lookup's verdict again, taking and counting nothing: with a rate,
	 * the record is read before the token is taken and written once.
	 */
	struct fs_rate *r = rate_in_force(AT_SYN, v.project, v.cgroup);
	struct fs_tuple tu __attribute__((aligned(8))); /* filled with a rate, or on a refusal */
	if (r) {
		__builtin_memset(&tu, 0, sizeof(tu));
		syn_tuple(ctx, fam, lport, laddr, &tu);
		int seen = relook_seen(lookup_netns, &tu);
		if (seen)
			return seen == RELOOK_DROP ? SK_DROP : SK_PASS;
	}
	struct rate_ticket t;
	if (!rate_gate_of(r, AT_SYN, NULL, v.project, &t)) {
		/* The rate's counters took this one (rate_gate_of). */
		relook_note(lookup_netns, &tu, RELOOK_DROP);
		rate_event_syn(v.project, &tu, false);
		return SK_DROP;
	}
	int a = 1;
	struct fs_project *cp = NULL;
	if (!exempt_room(cfg, v.cgroup, v.project)) {
		cp = project_get(v.project);
		a = would_admit(cp, v.project, CLK_COARSE);
	}
	if (a < 0)
		goto pass;
	bool would = false;
	if (a == 0 && cp) {
		would = dry_run(v.project);
		if (!r) {
			__builtin_memset(&tu, 0, sizeof(tu));
			syn_tuple(ctx, fam, lport, laddr, &tu);
			/* The same SYN refused a moment ago at another
			 * lookup: the same answer, counted and reported once
			 * (with a rate, it was replayed above). */
			int seen = relook_seen(lookup_netns, &tu);
			if (seen)
				return seen == RELOOK_DROP ? SK_DROP : SK_PASS;
		}
		if (would) {
			count_would(v.project, FS_DIR_SYN);
		} else {
			__sync_fetch_and_add(&cp->refused, 1);
			COUNT(refused_in);
		}
		refused_syn(v.project, v.cgroup, &tu, would, false);
		if (!would) {
			/* The rule refused: the SYN's rate token goes back. */
			rate_undo(&t);
			relook_note(lookup_netns, &tu, RELOOK_DROP);
			return SK_DROP;
		}
		if (!r)
			relook_note(lookup_netns, &tu, RELOOK_PASS);
	}
	/* Past the rate in dry-run: counted once, here unless the rule's
	 * dry-run counted it above. */
	if (rate_would(&t, v.project, FS_DIR_SYN, would ? WOULD : TAKEN))
		rate_event_syn(v.project, &tu, true);
pass:
	if (r)
		relook_note(lookup_netns, &tu, RELOOK_PASS);
	return SK_PASS;
}

/*
 * fs_sockops takes the permit of an inbound handshake when the kernel makes
 * its request socket: BPF_SOCK_OPS_TIMEOUT_INIT for a socket that is not a
 * full socket runs from tcp_conn_request only for a request socket it is
 * about to queue (not for a SYN it drops, nor for one it answers with a SYN
 * cookie), in the listener's cgroup (the program is attached with the other
 * cgroup programs, at the cgroup2 root: a listener that is no project's
 * member finds its port unlisted and takes nothing). The permit is a reservation
 * keyed by the request socket's cookie, which the child inherits. reply is
 * left 0: the kernel's own timeout.
 */
SEC("sockops")
int fs_sockops(struct bpf_sock_ops *ctx)
{
	if (ctx->op != BPF_SOCK_OPS_TIMEOUT_INIT || ctx->is_fullsock)
		return 1;
	__u32 lport = ctx->local_port;
	struct fs_port *port = listened(lport);
	if (!port)
		return 1;
	__u64 w = *(volatile __u64 *)port_state(port);
	addr_buf laddr;
	__u16 fam = ctx->family;
	CTX_LADDR(ctx, fam, laddr);
	__u64 netns = bpf_get_netns_cookie(ctx);
	struct lview v = {};
	if (!syn_listener(port, w, netns, lport, fam, laddr, &v))
		return 1;
	struct holder h = {.cookie = bpf_get_socket_cookie(ctx), .netns = netns};
	take_permit(AT_SYN, CLK_COARSE, &h, v.project, NULL, v.cgroup, 0);
	return 1;
}

/*
 * on_established converts the reservation made for the request socket into
 * the child's permit: the child has the request socket's cookie. Without a
 * reservation (a SYN cookie's child, one whose reservation was given back, a
 * handshake begun before the programs) the rule is applied now to the
 * project of the child's cgroup (the listener's); a refusal here cannot
 * stop the connection, so it is left unheld and counted as unaccounted.
 */
static __noinline void on_established(struct sock *sk)
{
	if (!listened(sk->__sk_common.skc_num))
		return;
	struct holder h = {.cookie = bpf_get_socket_cookie(sk), .sk = sk};
	__u64 id = 0, cg = 0;
	__u32 moved = 0;
	/* The reservation's permit moves to the child, or the child takes one
	 * now: one call either way, so that the child's permit is recorded
	 * (a hold, inlined) in one place. */
	if (!resv_take(h.cookie, &id, &moved, false, 0)) {
		moved = 0;
		id = sock_project(sk, &cg);
		if (!id)
			return;
		COUNT(late);
	}
	take_permit(AT_CHILD, CLK_FINE, &h, id, NULL, cg, moved);
}

/*
 * on_close releases the permit a closing socket holds, if any, and uncounts
 * it if it was a listener. Not filtered by port: by now a listener bound to
 * port 0 has given its port back (skc_num is 0). Listeners close rarely;
 * unlisten finds the address by the socket's cookie.
 */
static __noinline void on_close(__u64 cookie, bool listener)
{
	end_held(cookie, CLK_FINE, false);
	if (listener)
		unlisten(cookie);
}

SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(fs_set_state, struct sock *sk, int oldstate, int newstate)
{
	/* Most transitions (SYN_SENT, the FIN states, TIME_WAIT) concern us
	 * not at all, and this program runs for every TCP socket of the host
	 * about ten times per connection: look at the arguments before
	 * touching the socket. Of the transitions to ESTABLISHED only a
	 * child's (from SYN_RECV) matters. The work is in functions that are
	 * called, not inlined, so that this one needs no stack and saves no
	 * registers: the transitions that concern us not cost ~2 ns less. */
	switch (newstate) {
	case TCP_CLOSE: {
		if (sk->sk_protocol != IPPROTO_TCP)
			return 0;
		/* Every end of a connection passes here, including RST, failed
		 * connects, timeouts and children dropped with their listener.
		 * A socket that holds a permit has a cookie already; reading it
		 * rather than calling the helper spares every other socket of
		 * the host the generation of one. */
		__u64 cookie = sk->__sk_common.skc_cookie.counter;
		if (cookie)
			on_close(cookie, oldstate == TCP_LISTEN);
		return 0;
	}
	case TCP_ESTABLISHED:
		if (oldstate == TCP_SYN_RECV && sk->sk_protocol == IPPROTO_TCP)
			on_established(sk);
		return 0;
	case TCP_LISTEN:
		if (sk->sk_protocol == IPPROTO_TCP)
			on_listen(sk);
		return 0;
	}
	return 0;
}

SEC("cgroup/sock_release")
int fs_sock_release(struct bpf_sock *ctx)
{
	if (ctx->type != SOCK_STREAM)
		return 1;
	/* A socket that holds a permit has a cookie already: read it rather
	 * than have the helper generate one for every other socket. */
	__u64 cookie = CAST(struct sock, ctx)->__sk_common.skc_cookie.counter;
	if (cookie)
		end_held(cookie, CLK_COARSE, false);
	return 1;
}

/*
 * weak_above says whether a weak member (MEMBER_WEAK: a pod root) of
 * project id is an ancestor of cgroup c: a permit c's socket holds under
 * id was taken while nothing deeper claimed it.
 */
static __always_inline bool weak_above(struct cgroup *c, __u64 id)
{
	if (!c)
		return false;
	int level = c->level;
	if (level < (int)base_level || level > 255)
		return false;
	__u32 last = level - base_level;
	for (__u32 i = 0; i < MAX_DEPTH; i++) {
		if (i > last || i >= max_depth)
			break;
		struct cgroup *anc = cgroup_ancestor(c, base_level + i);
		if (!anc)
			break;
		__u64 aid = anc->kn->id;
		struct fs_member *m = bpf_map_lookup_elem(&fs_members, &aid);
		if (m && (m->flags & MEMBER_WEAK) && m->project == id)
			return true;
	}
	return false;
}

/*
 * move_held moves the permit socket cookie holds (v, as read) to project
 * to, with its destination pool's if it took one: MOVED, MOVED_PAST if the
 * rule (or a fleet cap) of either pool would refuse to a connect now
 * (counted all the same: the connection exists; *past says which pools,
 * PAST_NODE and PAST_DEST), 0 if it did not move. It
 * ends the entry as a release does (unhold: only one caller wins it), moves
 * the counts between the projects (the pools' in_use do not change), and
 * holds it again under to. fs_dump runs with the socket locked, so its
 * TCP_CLOSE cannot come meanwhile; a sock_release racing in between finds
 * no entry and gives nothing back, and the permit held again is given back
 * at TCP_CLOSE, which every socket reaches after its close: counted
 * exactly, at worst until the FIN exchange ends.
 */
static __always_inline __u32 move_held(__u64 cookie, struct fs_sock v, __u64 to, __u32 *past, bool *over)
{
	__u64 from = 0;
	__u32 kind = 0, dest = 0, p = 0;
	if (!unhold(cookie, &from, &kind, &dest, true))
		return 0; /* released meanwhile */
	v.project = to;
	struct fs_settings *cfg = settings();
	struct fs_pool *n = node();
	struct fs_project *pt = project_get(to);
	struct fs_project *pf = project_get(from);
	if (cfg && n && pt) {
		__s64 used = *(volatile __s64 *)&n->in_use, lim = node_limit(cfg, n, to, pt, false);
		if (used >= lim)
			p |= PAST_NODE;
		/* in_use counts this permit: a connect of the project now,
		 * itself not counted, would be refused. */
		*over = used > lim;
		seen(cfg, n, pt, CLK_FINE);
	}
	if (pt)
		__sync_fetch_and_add(&pt->in_use, 1);
	if (pf && __sync_fetch_and_add(&pf->in_use, -1) <= 1)
		pf->last_seen_ns = now_ns(CLK_FINE);
	/* Its destination pool's permit moves with it. */
	__u64 clk = 0;
	if (dest) {
		if (dest_adopt(dest, to))
			p |= PAST_DEST;
		dest_give(dest, from, true, &clk);
	}
	if (hold(cookie, &v) != 0) {
		/* Both tables full: given back; the next pass adopts it. */
		release(to, CLK_FINE, &clk);
		if (dest)
			dest_give(dest, to, true, &clk);
		return 0;
	}
	*past = p;
	return p ? MOVED_PAST : MOVED;
}

/*
 * dest_adoptable is the destination pool an adopted socket sk of project id
 * takes a permit in (dest_adopt), 0 none: the pool of its peer's address
 * and port, as connect() found it unless another program rewrote the
 * address there, for a socket the dump adopts (one that predates the
 * programs, as at a first start or a migration, or that no program
 * counted). An accepted socket takes none: one whose local address a
 * project listener in its netns takes (find_listener, the key a SYN to it
 * would look up) is taken for one; so is, wrongly, an outbound socket
 * bound to such an address, and an accepted socket whose listener has
 * closed is taken for an outbound one. A removed pool (not DEST_LIVE)
 * takes none.
 */
static __always_inline __u32 dest_adoptable(struct sock *sk, __u64 id)
{
	struct fs_settings *cfg = settings();
	if (!cfg)
		return 0;
	__u32 kinds = *(volatile __u32 *)&cfg->dest_kinds;
	if (!(kinds & DEST_KINDS))
		return 0;
	__u32 lport = sk->__sk_common.skc_num;
	addr_buf a;
	struct fs_port *n = listened(lport);
	if (n) {
		if (sk->__sk_common.skc_family == AF_INET)
			v4mapped(a, sk->__sk_common.skc_rcv_saddr);
		else
			in6_load(a, &sk->__sk_common.skc_v6_rcv_saddr);
		struct fs_listen_key k = {};
		syn_key(&k, sock_netns(sk), lport, is_v4mapped(a) ? AF_INET : AF_INET6, a);
		if (find_listener(n, &k))
			return 0;
	}
	if (sk->__sk_common.skc_family == AF_INET)
		v4mapped(a, sk->__sk_common.skc_daddr);
	else
		in6_load(a, &sk->__sk_common.skc_v6_daddr);
	const __u64 *q = (const __u64 *)a;
	__u32 pool = dest_lookup_again(kinds, sk->__sk_common.skc_dport, q[0], q[1]);
	struct dest_view v;
	return pool && dest_get(pool, id, &v) && (v.s->flags & DEST_LIVE) ? pool : 0;
}

/*
 * abort_moved_past, set at load (loader.Options.AbortMovedPast): a
 * connection a pod opened (KIND_OUT) before it was classified, whose permit
 * a pass moves from (unclassified) to the pod's project where the node's
 * rule would refuse a connect of the project now (itself not counted), is
 * aborted as if that connect had been refused (its peer gets a reset, its
 * process ECONNABORTED), and its permit goes back at its TCP_CLOSE. Without
 * it a tenant at its limit could start pod after pod whose first connects,
 * made before each was classified, took the (unclassified) project's share
 * and were then moved to it, without bound. Not aborted: a socket adopted
 * by a dump (older than the programs, KIND_ADOPTED), an accepted one, one
 * past a destination pool's rule only, any while the project is not
 * enforced (dry-run, its own or the pool's, or a lapse), and one taken past
 * the rule while it was not enforced (KIND_OUT_LAX: a connection a lapse
 * admitted is not reset when the daemon comes back). bpf_sock_destroy
 * came with Linux 6.5: weak, and looked for, so that the programs load on
 * an older kernel, where nothing is aborted.
 */
volatile const __u32 abort_moved_past;

extern int bpf_sock_destroy(struct sock_common *sk) __weak __ksym;

/* enforced says whether a refusal of project id would be one: no dry-run
 * (the pool's or the project's) and no lapse. dry_run's test, without its
 * count of a lapse's admissions. */
static __always_inline bool enforced(__u64 id)
{
	struct fs_evcfg *c = evcfg();
	return !(c && c->dry_run) && !bpf_map_lookup_elem(&fs_dryrun, &id) && !lapse_of();
}

/*
 * fs_dump walks the TCP sockets of the caller's netns. A socket of a project
 * that holds no permit and is past its handshake is adopted (it predates the
 * programs, or was left unaccounted); a permit held under a weak member's
 * project (unclassified) moves to its cgroup's project now (move_held);
 * every project socket is written out for
 * the reconcile report, and so is every socket that holds a permit (its
 * member removed since) and every listening socket, project or not: a
 * counted listener missing from the dump is gone (OP_UNLISTEN), and so is
 * the socket of a held permit.
 */
SEC("iter/tcp")
int fs_dump(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;
	if (!skc)
		return 0;
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(skc);
	if (!tp)
		return 0; /* TIME_WAIT and request socks: hold nothing */
	struct sock *sk = (struct sock *)tp;
	__u32 state = sk->__sk_common.skc_state;
	__u64 cg = 0, weak = 0;
	__u64 id = sock_project_of(sk, &cg, &weak);
	/* An unclassified pod of the host's network namespace (project.h,
	 * WEAK_HOST) is in no project here: its listeners are not counted, its
	 * sockets not adopted; its connects' permits (KIND_OUT_HOST) are kept
	 * below, live, until it is classified. */
	if (weak == WEAK_HOST)
		id = 0;
	if (!id && state != TCP_LISTEN) {
		/* A socket of no project may still hold the permit it took
		 * while its cgroup was a member (removed since, or moved to
		 * no project: the permit ends with the socket). Written out,
		 * it is live: the pass does not release its permit as a gone
		 * socket's. Not so a permit taken as unclassified (a weak
		 * member's project above it) by a pod classified as no
		 * project's since (a system namespace's): that one was never
		 * a tenant's, and is released as a gone socket's. A socket
		 * that never had a cookie holds nothing, and reading the
		 * field spares the others the generation of one. */
		__u64 c = sk->__sk_common.skc_cookie.counter;
		struct fs_sock *s = c ? held_find(c, true) : NULL;
		if (!s || (weak != WEAK_HOST && weak_above(sk->sk_cgrp_data.cgroup, s->project)))
			return 0;
		struct fs_sock_record rec = {.cookie = c, .project = s->project, .state = state,
					     .held = 1, .kind = s->kind, .dest = s->dest};
		bpf_seq_write(ctx->meta->seq, &rec, sizeof(rec));
		return 0;
	}
	struct fs_sock_record rec = {
		.cookie = bpf_get_socket_cookie(sk),
		.project = id,
		.state = state,
	};
	if (state == TCP_LISTEN) {
		/* A listener counted under another project than its cgroup's
		 * now (opened while its pod was unclassified, and classified
		 * since; or its cgroup is in no project now) is counted again
		 * under its own, or uncounted. */
		struct fs_listen_key *ck = bpf_map_lookup_elem(&fs_listen_socks, &rec.cookie);
		if (ck) {
			struct fs_listen_key k = {};
			__builtin_memcpy(&k, ck, sizeof(k));
			struct fs_listener *l = bpf_map_lookup_elem(&fs_listeners, &k);
			if (l && l->project != id)
				unlisten(rec.cookie);
		}
		if (id)
			on_listen(sk);
	} else if (state == TCP_ESTABLISHED || state == TCP_SYN_SENT || state == TCP_CLOSE_WAIT ||
		   ((state == TCP_FIN_WAIT1 || state == TCP_FIN_WAIT2 || state == TCP_LAST_ACK ||
		     state == TCP_CLOSING) && sk->sk_socket)) {
		/* SYN_RECV children are converted from their reservation; a socket
		 * the process closed (no struct socket) finishing its FIN exchange
		 * released its permit at close. Keep in step with loader.ShouldHold. */
		/* An exempt socket is adopted into the exempt budget while it
		 * has room, like a new one; the rest are adopted under the rule. */
		bool held = held_find(rec.cookie, true);
		bool ex = !held && exempt_take(false, cg, id);
		struct fs_sock v = {.project = id, .netns = sock_netns(sk),
				    .kind = ex ? KIND_EXEMPT_ADOPTED : KIND_ADOPTED,
				    .dest = held ? 0 : dest_adoptable(sk, id)};
		long err = held ? -EEXIST : hold(rec.cookie, &v);
		if (err == 0) {
			rec.adopted = 1;
			rec.dest = v.dest;
			/* Its destination pool's permit, past the rule as the
			 * node's: the entry names the pool, so the release
			 * gives it back there. Past that pool's rule, it is
			 * reported as past the node's is, naming the pool
			 * (PAST_DEST). */
			if (v.dest && dest_adopt(v.dest, id))
				rec.past |= PAST_DEST;
			if (ex) {
				COUNT(exempt_admitted);
			} else {
				/* Past the rule (it would refuse a connect of the
				 * project now): counted all the same, the socket
				 * exists, and reported (ADOPTED_PAST, PAST_NODE). */
				struct fs_settings *cfg = settings();
				struct fs_pool *n = node();
				struct fs_project *p = project_get(id);
				if (cfg && n && p &&
				    *(volatile __s64 *)&n->in_use >= node_limit(cfg, n, id, p, false))
					rec.past |= PAST_NODE;
				force(id, CLK_FINE);
			}
			if (rec.past)
				rec.adopted = ADOPTED_PAST;
			COUNT(adopted);
		} else if (ex) {
			exempt_undo();
		}
		struct fs_sock *s = held_find(rec.cookie, true);
		/* A permit taken as unclassified (a weak member's project)
		 * whose cgroup is a project's member now (its pod classified
		 * since) moves to that project, as a listener's count does
		 * above, and its destination pool's permit with it. An exempt
		 * permit is no project's. */
		if (s && id && s->project != id && !KIND_IS_EXEMPT(s->kind) &&
		    weak_above(sk->sk_cgrp_data.cgroup, s->project)) {
			struct fs_sock v = *s;
			bool over = false;
			__u32 moved = move_held(rec.cookie, v, id, &rec.past, &over);
			if (moved) {
				rec.adopted = moved;
				rec.dest = v.dest;
			}
			if (moved == MOVED_PAST && over && (v.kind == KIND_OUT || v.kind == KIND_OUT_HOST) && abort_moved_past && enforced(id) &&
			    bpf_sock_destroy && bpf_sock_destroy(skc) == 0)
				rec.adopted = MOVED_ABORTED;
			s = held_find(rec.cookie, true);
		}
		if (s) {
			rec.held = 1;
			rec.kind = s->kind;
			rec.project = s->project;
			rec.dest = s->dest;
		} else if (err && err != -EEXIST) {
			/* No room (its slot holds another socket's permit and
			 * the spill table is full; -EEXIST: it held one, given
			 * back since): uncounted, and reported (NOT_ADOPTED)
			 * at every pass until one finds room. */
			rec.adopted = NOT_ADOPTED;
		}
	}
	bpf_seq_write(ctx->meta->seq, &rec, sizeof(rec));
	return 0;
}

SEC("syscall")
int fs_adjust(struct fs_adjust_args *a)
{
	a->result = 0;
	if (a->op == OP_EXPIRE) {
		if (end_resv(a->key.cookie, CLK_FINE, true, a->since_ns)) {
			COUNT(expired);
			a->result = 1;
		}
		return 0;
	}
	if (a->op == OP_UNLISTEN) {
		a->result = unlisten(a->project);
		return 0;
	}
	if (a->op == OP_DROP) {
		a->result = end_held(a->project, CLK_FINE, true);
		return 0;
	}
	if (a->op == OP_MEMBER_GEN) {
		/* An add, not a store from user space: two writers on the
		 * same pins never move the generation back, which would make
		 * memo answers found before a change current again. */
		__u32 zero = 0;
		__u64 *g = bpf_map_lookup_elem(&fs_member_gen, &zero);
		if (g)
			a->result = __sync_fetch_and_add(g, 1) + 1;
		return 0;
	}
	if (a->op == OP_ACTIVE || a->op == OP_EXEMPT) {
		struct fs_pool *n = node();
		if (n) {
			__sync_fetch_and_add(a->op == OP_ACTIVE ? &n->active : &n->exempt_in_use, a->delta);
			a->result = 1;
		}
		return 0;
	}
	if (a->op == OP_DEST_CONF) {
		__u32 k = a->since_ns;
		struct fs_dest_conf *c = bpf_map_lookup_elem(&fs_dpool_conf, &k);
		struct fs_dest_state *s = bpf_map_lookup_elem(&fs_dpool_state, &k);
		if (c && s) {
			/* Each a single store: a connect may read the old size
			 * beside the new floor for an instant, as it could
			 * when the loader wrote fs_dpool_conf in place. */
			*(volatile __typeof__(s->size) *)&s->size = c->size;
			*(volatile __typeof__(s->floor) *)&s->floor = c->floor;
			*(volatile __typeof__(s->window_ns) *)&s->window_ns = c->window_ns;
			*(volatile __typeof__(s->flags) *)&s->flags = c->flags;
			*(volatile __typeof__(s->fleet_safe) *)&s->fleet_safe = c->fleet_safe;
			a->result = 1;
		}
		return 0;
	}
	if (a->op == OP_DEST_ACTIVE || a->op == OP_DEST_ADD) {
		struct dest_view v;
		if (!dest_get(a->since_ns, a->project, &v))
			return 0;
		if (a->op == OP_DEST_ACTIVE) {
			__sync_fetch_and_add(&v.s->active, a->delta);
		} else {
			__sync_fetch_and_add(&v.s->in_use, a->delta);
			__sync_fetch_and_add(&v.p->in_use, a->delta);
		}
		a->result = 1;
		return 0;
	}
	if (a->op == OP_ADD) {
		/* project 0 adjusts the node only (permits of vanished projects). */
		__u64 id = a->project;
		__s64 delta = a->delta;
		struct fs_pool *n = node();
		if (id) {
			struct fs_project *p = project_get(id);
			if (!p)
				return 0;
			__sync_fetch_and_add(&p->in_use, delta);
		}
		if (n)
			__sync_fetch_and_add(&n->in_use, delta);
		a->result = 1;
	}
	return 0;
}

/*
 * fs_selftest runs one step of a protocol on its own, so that a test can
 * interleave steps as two CPUs could and check the outcome. Never attached;
 * only the loader's tests run it.
 */
SEC("syscall")
int fs_selftest(struct fs_selftest_args *a)
{
	a->result = 0;
	if (a->op == ST_PORT_CHANGE) {
		struct fs_listen_key k = {};
		__builtin_memcpy(&k, &a->lkey, sizeof(k));
		port_change(&k, a->delta);
		return 0;
	}
	if (a->op == ST_TAKE) {
		struct holder h = {.cookie = a->cookie};
		if (a->delta == AT_SYN)
			a->result = take_permit(AT_SYN, CLK_FINE, &h, a->resv.project, NULL, a->cg, 0);
		else if (a->delta == AT_CHILD)
			a->result = take_permit(AT_CHILD, CLK_FINE, &h, a->resv.project, NULL, a->cg, 0);
	}
	return 0;
}

/*
 * fs_selftest_dest runs dest_find for the tests, as a connect that read
 * fs_settings.dest_kinds as args[0] before the loader's later writes: port
 * args[1] (host order) at the address of 64-bit words args[2], args[3] (as
 * loaded: network order). It returns the pool, 0 none. Not fs_selftest's
 * op: a sleepable program cannot read the trie. Never attached.
 */
SEC("raw_tp")
int fs_selftest_dest(struct bpf_raw_tracepoint_args *ctx)
{
	struct fs_settings *cfg = settings();
	if (!cfg)
		return 0;
	addr_buf a;
	__u64 *w = (__u64 *)a;
	w[0] = ctx->args[2];
	w[1] = ctx->args[3];
	return dest_find(cfg, (__u32)ctx->args[0], bpf_htons((__u16)ctx->args[1]), a);
}
