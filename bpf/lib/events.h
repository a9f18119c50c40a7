/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Refusal events and dry-run. A refused connect() looks like a closed port,
 * so every refusal (and, in dry-run, every refusal turned into an admission)
 * is written to the fs_events ring buffer with what an operator needs: the
 * project, the direction, the 4-tuple, the rule's inputs (the project's and
 * the node's in_use, share, POOL) and the reason. Only the refusal path
 * writes: the admitted path does not reach this file.
 *
 * A flood of refusals costs bounded CPU: each project may write per_sec
 * events a second (fs_ev_config, from the daemon's events.per_sec); the rest
 * are counted (fs_ev_projects, fs_ev_stats) and the daemon reports them as one
 * "dropped" event per project and tick. The window is a whole second of
 * CLOCK_MONOTONIC (ev_window_ns); the window and its count are one 64-bit
 * word of the project's entry, moved on by one compare-and-swap, so CPUs
 * racing at a second's start cannot pass the bound (a reset of the count
 * apart from the second's change let each racing CPU write one more).
 *
 * Dry-run (enforce: false, the pool's in fs_ev_config, written by
 * loader.Open before the programs are attached, a project's in fs_dryrun,
 * written by the control loop; both carried over by a migration):
 * take_permit (rule.h) asks
 * dry_run on its refusal branch only, and takes the permit past the rule
 * instead, counting it as would_refuse; the caller then emits the event
 * with FS_EV_WOULD and admits.
 *
 * Lapse (fs_lapses): the daemon renews a heartbeat (CLOCK_BOOTTIME) every
 * tick; once it is older than after_ns (connections.lapse_after; 0 never),
 * dry_run says yes to every refusal, so the programs go on counting and stop
 * refusing, and each refusal admitted so is counted (admitted) and its event
 * flagged FS_EV_LAPSED. A daemon that comes back renews the heartbeat once
 * its start can no longer fail (the last step of loader.Open: a start that
 * fails renews nothing), and the next refusal is one again. Maps that never
 * had a heartbeat (0: never lapse) get one before the programs are attached,
 * and a migration's new maps the old pins' (loader/migrate.go, carryOver),
 * so programs a killed start leaves attached lapse too. The clock is read
 * on the refusal path only: the admitted path never reaches dry_run.
 *
 * The API other refusals use (issue #20's rate limit): emit_refusal with a
 * reason of enum fs_reason; see /work/coord/events-api.md.
 */
#pragma once

#include "maps.h"
#include "project.h"
#include "addr.h"
#include "share.h"
#include "cap.h"

/* Why a connection was refused. Add new reasons at the end (and their name
 * in loader/events.go, reasonNames); 0 is never sent. */
enum fs_reason {
	FS_REASON_OVER_SHARE = 1,    /* holds >= share, in_use >= POOL - FLOOR */
	FS_REASON_POOL_FULL = 2,     /* holds < share, in_use >= POOL */
	FS_REASON_EXEMPT_BUDGET = 3, /* exempt, exempt_max spent, then refused under the rule */
	FS_REASON_RATE_LIMITED = 4,  /* the project's connections per second (#20) */
	FS_REASON_FLOOR = 5,         /* inbound, under its share but not under the one it would have beside
				      * a newcomer, in_use >= POOL - FLOOR (rule.h, limit_for) */
	FS_REASON_FLEET_CAP = 6,     /* holds >= its fleet cap on this node (cap.h) */
	FS_REASON_FLEET_SAFE = 7,    /* a fleet pool held to its safe slice, its lease ended unrenewed (cap.h) */
};

#define FS_DIR_CONNECT 1 /* outbound connect() */
#define FS_DIR_SYN 2     /* inbound SYN */

#define FS_EV_WOULD 1 /* dry-run: refused by the rule, admitted */
#define FS_EV_TAKEN 2 /* the ask's permit is counted already: report the counts before it */
#define FS_EV_LAPSED 4 /* admitted because enforcement lapsed (no daemon seen for lapse_after) */

/*
 * Both ends of a refused connection, addresses as the keys keep them (IPv6,
 * or IPv4 v4-mapped), ports in host order: 36 bytes.
 */
struct fs_tuple {
	__u8 laddr[16];
	__u8 raddr[16];
	__u16 lport;
	__u16 rport;
};

/* One event in fs_events. */
struct fs_event {
	__u64 project;         /* cgroup id */
	__u64 time_ns;         /* CLOCK_MONOTONIC */
	struct fs_tuple tuple; /* local and remote (at connect the local side may be unset) */
	__u32 _pad0;
	__s64 held;   /* the project's in_use at the decision */
	__s64 in_use; /* the node's */
	__u32 share;  /* a floor refusal's: beside one more project */
	__u32 pool;
	__u8 dir;
	__u8 reason;
	__u8 flags;
	__u8 _pad[1];
	__u32 dest; /* the destination pool that refused (dest.h); 0: the node's pool */
};

/* Keeps struct fs_event in the BTF for bpf2go: the ring buffer has no
 * value type to name it. */
const struct fs_event *unused_fs_event __attribute__((unused));

/* Written by the loader (SetEvents). */
struct fs_evcfg {
	__u32 per_sec; /* events per project and second; 0 writes none */
	__u32 dry_run; /* 1: the pool is in dry-run */
};

/* Per project, on the refusal path only. */
struct fs_evproj {
	__u64 window;  /* (the window's number << 32) | events written in it (EV_COUNT) */
	__u64 _unused; /* was a separate count */
	__u64 dropped; /* events over the bound, ever */
	__u64 would;   /* refusals dry-run admitted, ever */
};

/* Node-wide, per CPU. */
struct fs_evstats {
	__u64 emitted;   /* events written */
	__u64 dropped;   /* over a project's bound (or its entry could not be made) */
	__u64 lost;      /* the ring buffer was full */
	__u64 would_out; /* connects dry-run admitted */
	__u64 would_in;  /* SYNs dry-run admitted */
};

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024); /* 2900 events: a second of a busy node's refusals at 100 per project */
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1); /* one node */
	__type(key, __u32);
	__type(value, struct fs_evcfg);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_ev_config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384); /* set at load: as fs_projects */
	__type(key, __u64);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_dryrun SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384); /* set at load: as fs_projects (the projects refused lately) */
	__type(key, __u64);
	__type(value, struct fs_evproj);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_ev_projects SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1); /* one node */
	__type(key, __u32);
	__type(value, struct fs_evstats);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_ev_stats SEC(".maps");

/* The events window: a second, set at load (a test makes it shorter to see
 * many windows' starts). */
volatile const __u64 ev_window_ns = 1000000000ULL;

#define EV_COUNT 0xffffffffULL /* the count's bits of fs_evproj.window */
#define EV_TRIES 8             /* CAS attempts; a CPU that loses them all drops its event */

#define EVCOUNT(field)                                        \
	do {                                                  \
		__u32 zero__ = 0;                             \
		struct fs_evstats *s__ = bpf_map_lookup_elem(&fs_ev_stats, &zero__); \
		if (s__)                                      \
			s__->field++;                         \
	} while (0)

static __always_inline struct fs_evcfg *evcfg(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&fs_ev_config, &zero);
}

/* evproj returns project id's entry, made on its first refusal. */
static __always_inline struct fs_evproj *evproj(__u64 id)
{
	struct fs_evproj *e = bpf_map_lookup_elem(&fs_ev_projects, &id);
	if (e)
		return e;
	struct fs_evproj zero = {};
	bpf_map_update_elem(&fs_ev_projects, &id, &zero, BPF_NOEXIST);
	return bpf_map_lookup_elem(&fs_ev_projects, &id);
}

/*
 * lapse_of is the lapse's slot if enforcement has lapsed now (a heartbeat
 * older than after_ns), else NULL. Boot time: a node suspended meanwhile
 * counts the time it slept.
 */
static __always_inline struct fs_lapse *lapse_of(void)
{
	__u32 zero = 0;
	struct fs_lapse *l = bpf_map_lookup_elem(&fs_lapses, &zero);
	if (!l)
		return NULL;
	__u64 hb = *(volatile __u64 *)&l->heartbeat_ns, after = l->after_ns;
	if (!after || !hb)
		return NULL;
	__u64 now = bpf_ktime_get_boot_ns();
	return now > hb && now - hb > after ? l : NULL;
}

/*
 * dry_run says whether a refusal of project id is to be admitted instead:
 * the pool or the project is in dry-run, or enforcement has lapsed (counted
 * in fs_lapses.admitted).
 */
static __always_inline bool dry_run(__u64 id)
{
	struct fs_evcfg *c = evcfg();
	if (c && c->dry_run)
		return true;
	if (bpf_map_lookup_elem(&fs_dryrun, &id) != NULL)
		return true;
	if (!lapse_of())
		return false;
	__u32 one = 1;
	struct fs_lapse *l = bpf_map_lookup_elem(&fs_lapses, &one);
	if (l)
		__sync_fetch_and_add(&l->admitted, 1);
	return true;
}

/* count_would counts a refusal dry-run admitted at dir. */
static __always_inline void count_would(__u64 id, __u8 dir)
{
	struct fs_evproj *e = evproj(id);
	if (e)
		__sync_fetch_and_add(&e->would, 1);
	if (dir == FS_DIR_CONNECT)
		EVCOUNT(would_out);
	else
		EVCOUNT(would_in);
}

/* take_past_rule takes a permit for project entry p (not NULL) without the
 * rule: dry-run admits what the rule refused. */
static __always_inline void take_past_rule(struct fs_project *p)
{
	struct fs_pool *n = node();
	if (n)
		__sync_fetch_and_add(&n->in_use, 1);
	__sync_fetch_and_add(&p->in_use, 1);
	__sync_fetch_and_add(&p->admitted, 1);
}

/*
 * refusal_reason is why the rule refused project id (entry p) of cgroup cg
 * now: exempt over its budget, at its fleet cap (cap.h), over its share, the
 * floor kept from an inbound ask (in), or the pool full. taken: the ask's permit is counted already
 * (dry-run), and does not count here.
 */
static __always_inline __u8 refusal_reason(__u64 cg, __u64 id, struct fs_project *p, bool taken, bool in)
{
	struct fs_settings *cfg = settings();
	struct fs_pool *n = node();
	if (!cfg || !n)
		return FS_REASON_POOL_FULL;
	if (cfg->exempt_max && exempt_listed(cg, id))
		return FS_REASON_EXEMPT_BUDGET;
	/* At the safe slice: that, where it binds; no caps in any case. */
	__u32 safe = fleet_safe_now(cfg, NULL);
	if (safe && safe - 1 < cfg->pool)
		return FS_REASON_FLEET_SAFE;
	__s64 held = p ? *(volatile __s64 *)&p->in_use - (taken ? 1 : 0) : 0;
	__u32 cap = safe ? 0 : fleet_cap(cfg, 0, id);
	if (cap)
		return held >= (__s64)cap - 1 ? FS_REASON_FLEET_CAP : FS_REASON_POOL_FULL;
	if (!under_share(cfg, n, held, false))
		return FS_REASON_OVER_SHARE;
	return in && !under_share(cfg, n, held, true) ? FS_REASON_FLOOR : FS_REASON_POOL_FULL;
}

/* tuple_connect fills t for a connect() of connect4 (v6 false) or connect6
 * (remote: the address connected to; local: the socket's, unset unless it
 * was bound, as the kernel picks it after this hook). */
static __always_inline void tuple_connect(struct bpf_sock_addr *ctx, bool v6, struct fs_tuple *t)
{
	/* The local side through the kernel's socket (a read-only cast, as
	 * connect_common's holder): bpf_sock's fields would need arithmetic
	 * on its pointer that the verifier refuses. */
	struct bpf_sock *bs = ctx->sk;
	struct sock *sk = bs ? CAST(struct sock, bs) : NULL;
	/* v6 is a constant (connect4 or connect6): connect4 may not even
	 * read user_ip6. */
	if (!v6) {
		v4mapped(t->raddr, ctx->user_ip4);
		if (sk)
			v4mapped(t->laddr, sk->__sk_common.skc_rcv_saddr);
	} else {
		__u32 *r = (__u32 *)t->raddr;
		r[0] = ctx->user_ip6[0];
		r[1] = ctx->user_ip6[1];
		r[2] = ctx->user_ip6[2];
		r[3] = ctx->user_ip6[3];
		if (sk)
			in6_load(t->laddr, &sk->__sk_common.skc_v6_rcv_saddr);
	}
	t->rport = bpf_ntohs(ctx->user_port);
	if (sk)
		t->lport = sk->__sk_common.skc_num;
}

/*
 * ev_reserve reserves an event of project id in fs_events within the
 * project's bound per second (the window's word below), or counts it
 * dropped (or lost) and returns NULL. *now is the clock it read.
 */
static __always_inline struct fs_event *ev_reserve(__u64 id, __u64 *now_out)
{
	struct fs_evcfg *c = evcfg();
	if (!c || !c->per_sec)
		return NULL;
	__u64 now = bpf_ktime_get_ns();
	__u64 win = ev_window_ns ? (now / ev_window_ns) << 32 : 0;
	struct fs_evproj *e = evproj(id);
	if (!e) {
		EVCOUNT(dropped);
		return NULL;
	}
	/* One word, one CAS: a count of this window below per_sec becomes one
	 * more, any other window's starts this one at 1. A CPU whose clock
	 * reading is older than the window another CPU began (it was slow
	 * between the two: the word is one window ahead) drops its event
	 * rather than take the word back to a window whose events were
	 * counted, and so does one that loses every try: the bound is never
	 * passed. A word further ahead is no late CPU's (a corrupt word, or
	 * one written under another ev_window_ns on the same pins): this
	 * window starts, or the project would be muted until the clock
	 * caught up with it, up to 2^31 windows. */
	bool written = false;
	for (int i = 0; i < EV_TRIES; i++) {
		__u64 old = *(volatile __u64 *)&e->window;
		__s32 ahead = (__s32)((__u32)(old >> 32) - (__u32)(win >> 32));
		if (ahead == 1)
			break;
		__u64 cur = ahead == 0 ? old : win;
		if ((cur & EV_COUNT) >= c->per_sec)
			break;
		if (__sync_val_compare_and_swap(&e->window, old, cur + 1) == old) {
			written = true;
			break;
		}
	}
	if (!written) {
		__sync_fetch_and_add(&e->dropped, 1);
		EVCOUNT(dropped);
		return NULL;
	}
	struct fs_event *ev = bpf_ringbuf_reserve(&fs_events, sizeof(*ev), 0);
	if (!ev) {
		EVCOUNT(lost);
		return NULL;
	}
	*now_out = now;
	return ev;
}

/*
 * emit_refusal writes the event of a refusal (flags 0) or of a refusal
 * dry-run admitted (FS_EV_WOULD, its permit already taken) of project id
 * (entry p, or NULL) at dir, for the 4-tuple t, within the project's bound
 * per second. It never fails the caller.
 */
static __always_inline void emit_refusal(__u64 id, struct fs_project *p, __u8 dir, __u8 reason,
					 const struct fs_tuple *t, __u8 flags)
{
	__u64 now = 0;
	struct fs_event *ev = ev_reserve(id, &now);
	if (!ev)
		return;
	if ((flags & FS_EV_WOULD) && lapse_of())
		flags |= FS_EV_LAPSED;
	struct fs_settings *cfg = settings();
	struct fs_pool *n = node();
	__s64 taken = (flags & FS_EV_TAKEN) ? 1 : 0;
	ev->project = id;
	ev->time_ns = now;
	__builtin_memcpy(&ev->tuple, t, sizeof(ev->tuple));
	ev->_pad0 = 0;
	ev->held = p ? *(volatile __s64 *)&p->in_use - taken : 0;
	ev->in_use = n ? *(volatile __s64 *)&n->in_use - taken : 0;
	ev->share = 0;
	ev->pool = 0;
	if (cfg && n) {
		/* A floor refusal's share is the one the SYN was judged by. */
		__s64 active = rule_active(n, reason == FS_REASON_FLOOR);
		__u32 share = cfg->pool;
		if (active > 1)
			share = cfg->pool / (__u32)active;
		if (share < cfg->floor)
			share = cfg->floor;
		/* A cap refusal's share is the cap. */
		__u32 cap = reason == FS_REASON_FLEET_CAP ? fleet_cap(cfg, 0, id) : 0;
		if (cap)
			share = cap - 1;
		__u32 size = cfg->pool;
		/* At the safe slice: the pool that was divided, and its share. */
		__u32 safe = reason == FS_REASON_FLEET_SAFE ? fleet_safe_now(cfg, NULL) : 0;
		if (safe && safe - 1 < size) {
			size = safe - 1;
			share = active > 1 ? size / (__u32)active : size;
			__u32 floor = cfg->floor < size ? cfg->floor : size;
			if (share < floor)
				share = floor;
		}
		ev->share = share;
		ev->pool = size;
	}
	ev->dir = dir;
	ev->reason = reason;
	ev->flags = flags;
	__builtin_memset(ev->_pad, 0, sizeof(ev->_pad));
	ev->dest = 0;
	bpf_ringbuf_submit(ev, 0);
	EVCOUNT(emitted);
}

/*
 * refused_connect reports a connect() of project id (entry p, or NULL)
 * that take_permit refused (would false) or admitted in dry-run (would).
 */
static __always_inline void refused_connect(struct bpf_sock_addr *ctx, bool v6, __u64 id, struct fs_project *p, bool would)
{
	if (!p)
		p = project_get(id);
	struct fs_tuple t __attribute__((aligned(8))) = {};
	tuple_connect(ctx, v6, &t);
	__u8 flags = would ? FS_EV_WOULD | FS_EV_TAKEN : 0;
	emit_refusal(id, p, FS_DIR_CONNECT, refusal_reason(bpf_get_current_cgroup_id(), id, p, would, false), &t, flags);
}

/*
 * syn_tuple fills t for the segment sk_lookup's ctx looks a listener up for:
 * local laddr (family fam) and lport as the caller read them, the remote end
 * from ctx (CTX_ADDR). Only on a refusal's path: a SYN admitted reads none.
 */
static __always_inline void syn_tuple(struct bpf_sk_lookup *ctx, __u16 fam, __u16 lport, const __u8 *laddr, struct fs_tuple *t)
{
	__builtin_memcpy(t->laddr, laddr, 16);
	CTX_ADDR(ctx, fam, remote, t->raddr);
	t->lport = lport;
	t->rport = bpf_ntohs(ctx->remote_port);
}

/*
 * refused_syn reports a SYN for project id (listener cgroup cg) with tuple
 * rk that the rule refused (would false) or dry-run admitted (would; taken:
 * its permit is counted already; sk_lookup takes none, fs_sockops does).
 */
static __always_inline void refused_syn(__u64 id, __u64 cg, struct fs_tuple *rk, bool would, bool taken)
{
	struct fs_project *p = project_get(id);
	__u8 flags = (would ? FS_EV_WOULD : 0) | (taken ? FS_EV_TAKEN : 0);
	emit_refusal(id, p, FS_DIR_SYN, refusal_reason(cg, id, p, taken, true), rk, flags);
}
