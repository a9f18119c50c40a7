/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * A project's rates of new connections: two token buckets per project, one
 * taken at connect (outbound: its policy's connections_per_sec) and one at
 * the SYN (inbound: accepts_per_sec), before the rule, so that a project
 * over its rate is refused without touching the pool's counters. The two
 * are apart because the SYNs to a project's listener come from clients the
 * project does not control (a process in no project, a remote host): with
 * one bucket they spent its outbound budget and could starve every connect
 * of a project limited to a few a second.
 *
 * The bucket is one word, its theoretical arrival time (tat, the GCRA form
 * of a token bucket): the instant the bucket will be full again if nothing
 * more is taken. With interval = 1 s / rate (the time one token takes to
 * refill) and burst = the tokens a full bucket holds (one second's worth,
 * at least one), a bucket at now holds (burst x interval - (tat - now)) /
 * interval tokens; taking one moves tat to max(tat, now) + interval, which
 * is allowed while that stays within burst x interval of now. The refill is
 * computed from the clock at each take (nothing runs between connects), and
 * the take is one compare-and-swap on tat: no lock, and a refusal writes
 * nothing, so a project flooding past its rate keeps its own cache line
 * shared and stays off everyone else's. Losing the compare-and-swap
 * RATE_TRIES times in a row (two CPUs of one project connecting in lock
 * step, again and again) refuses: a spurious refusal, never a token taken
 * twice. A token taken for a connection the rule then refuses (or that has
 * its permit already) is given back: the rate counts connections admitted,
 * not attempts.
 *
 * The control loop (loader.SetRate, Tick) writes interval and burst with
 * fs_rate_set; interval 0 is unbounded. Only that program writes them and
 * creates or deletes entries; the hooks only take and give back tokens and
 * count refusals (limited_out, limited_in, and node-wide per CPU in
 * fs_rate_stats), so the loader never overwrites what they write.
 * fs_rate_node counts the entries with a rate, and while it is 0 (no
 * project has one, the common case) a connect costs one inlined array load
 * here and no lookup in fs_rates.
 *
 * The clock is the coarse one (tick resolution) the hooks already read: a
 * bucket refills in steps of a tick, which at any rate the kernel can serve
 * keeps the admitted count over a second within a token or two of rate x
 * time + burst.
 *
 * Exempt sockets (rule.h: the socket's cgroup or its project in the exempt
 * set) are never rate limited, even when the exempt budget is spent and
 * they go under the rule.
 *
 * A SYN the kernel answers with a SYN cookie leaves no request socket, and
 * the cookie's ACK comes through sk_lookup again (sk_lookup cannot tell the
 * two apart): each takes a token, unless the ACK comes within RELOOK_NS on
 * the SYN's CPU (relookup.h: it is given the SYN's answer, taking nothing),
 * so under SYN cookies a listener admits at least half its project's rate,
 * never more than the rate. A SYN looked up twice (an nftables socket
 * expression) takes one token and a refusal is counted once (relookup.h).
 */
#pragma once

#include "rule.h"

/*
 * One project's buckets. 64 bytes: a cache line of its own. The inbound
 * bucket sits where an older layout had padding (zero: unbounded), so pins
 * of that layout are reused as they are.
 */
struct fs_rate {
	__u64 tat;            /* outbound: CLOCK_MONOTONIC (coarse) ns when the bucket is full again */
	__u64 interval_ns;    /* outbound: 1 s / rate, the refill time of one token; 0 = unbounded */
	__u64 burst_ns;       /* outbound: burst x interval_ns, how far ahead of now tat may go */
	__u64 limited_out;    /* connects refused by the rate */
	__u64 limited_in;     /* SYNs refused by the rate */
	__u64 tat_in;         /* inbound: as tat */
	__u64 interval_in_ns; /* inbound: as interval_ns */
	__u64 burst_in_ns;    /* inbound: as burst_ns */
};

/* The node's view of the rates: how many projects have one. */
struct fs_rated {
	__s64 limited; /* entries of fs_rates with a rate (interval_ns or interval_in_ns > 0) */
	__u64 _pad;
};

/* Node-wide refusals by rate, per CPU (written on the refusal path only). */
struct fs_rate_counters {
	__u64 limited_out;
	__u64 limited_in;
};

/* Context of fs_rate_set, run by the loader with BPF_PROG_RUN. */
enum rate_op {
	RATE_SET = 1,    /* give project its intervals and bursts (interval 0: unbounded), creating its entry */
	RATE_DELETE = 2, /* delete project's entry (its cgroup is gone); result: 1 if there was one */
};

struct fs_rate_args {
	__u32 op;
	__u32 _pad;
	__u64 project;
	__u64 interval_ns; /* outbound */
	__u64 burst_ns;
	__s64 result;
	__u64 interval_in_ns; /* inbound */
	__u64 burst_in_ns;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384); /* set at load: as fs_projects (one bucket per project with a rate) */
	__type(key, __u64);
	__type(value, struct fs_rate);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_rates SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1); /* one node */
	__type(key, __u32);
	__type(value, struct fs_rated);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_rate_node SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1); /* one node */
	__type(key, __u32);
	__type(value, struct fs_rate_counters);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_rate_stats SEC(".maps");

#define RATE_TRIES 8 /* compare-and-swap attempts on a bucket */

/*
 * A token taken (or not): the bucket's tat and the interval it was taken
 * at, so that it can be given back at the same value although the control
 * loop may change the interval meanwhile. tat NULL: nothing was taken.
 */
struct rate_ticket {
	__u64 *tat;
	__u64 iv;
	bool would; /* over the rate, admitted in dry-run (events.h) */
};

/*
 * rate_of is project id's buckets if it has a rate at at (AT_CONNECT: the
 * outbound one, else the inbound one), else NULL.
 */
static __always_inline struct fs_rate *rate_of(int at, __u64 id)
{
	__u32 zero = 0;
	struct fs_rated *n = bpf_map_lookup_elem(&fs_rate_node, &zero);
	if (!n || *(volatile __s64 *)&n->limited <= 0)
		return NULL;
	struct fs_rate *r = bpf_map_lookup_elem(&fs_rates, &id);
	if (!r || !*(volatile __u64 *)(at == AT_CONNECT ? &r->interval_ns : &r->interval_in_ns))
		return NULL;
	return r;
}

/*
 * rate_take takes a token from r's bucket for at into t (t->tat, t->iv):
 * the interval it took, 0 if the bucket is empty.
 */
static __always_inline __u64 rate_take(struct fs_rate *r, int at, struct rate_ticket *t)
{
	__u64 *tatp = at == AT_CONNECT ? &r->tat : &r->tat_in;
	__u64 iv = *(volatile __u64 *)(at == AT_CONNECT ? &r->interval_ns : &r->interval_in_ns);
	__u64 burst = *(volatile __u64 *)(at == AT_CONNECT ? &r->burst_ns : &r->burst_in_ns);
	if (!iv)
		return 0;
	__u64 now = now_ns(CLK_COARSE);
#pragma unroll
	for (int i = 0; i < RATE_TRIES; i++) {
		__u64 seen = *(volatile __u64 *)tatp, tat = seen;
		/* Further ahead than a full burst can put it is no bucket's
		 * state (a refund that raced a rate change, a take lost to
		 * fs_rate_set's store): start from a full bucket rather than
		 * refuse the project for good. */
		if (tat > now && tat - now > burst + iv)
			tat = now;
		__u64 next = (tat > now ? tat : now) + iv;
		if (next - now > burst)
			return 0;
		if (__sync_val_compare_and_swap(tatp, seen, next) == seen) {
			t->tat = tatp;
			t->iv = iv;
			return iv;
		}
	}
	return 0;
}

/* rate_exempt says whether the socket is exempt (see exempt_take in rule.h). */
static __always_inline bool rate_exempt(int at, __u64 cg, __u64 id)
{
	struct fs_settings *cfg = settings();
	/* exempt_max is 0 while the set is empty: no lookup on the common path. */
	if (!cfg || !cfg->exempt_max)
		return false;
	if (at == AT_CONNECT)
		cg = bpf_get_current_cgroup_id();
	return exempt_listed(cg, id);
}

/*
 * rate_in_force is project id's bucket if its rate applies to a connection
 * at at (AT_CONNECT or AT_SYN) of cgroup cg (at AT_CONNECT the calling
 * task's, read only when the exempt set is not empty), else NULL.
 */
static __always_inline struct fs_rate *rate_in_force(int at, __u64 id, __u64 cg)
{
	struct fs_rate *r = rate_of(at, id);
	if (!r || rate_exempt(at, cg, id))
		return NULL;
	return r;
}

/*
 * rate_gate_of takes a token of r, project id's bucket in force
 * (rate_in_force; NULL: no rate, nothing to take), for a connection at at
 * (AT_CONNECT or AT_SYN), into t. false: the project is over its rate, and the refusal is counted; but a holder h (NULL: none to
 * look for) that has its permit already (a retransmitted SYN) passes,
 * taking nothing: its connection was counted when it was admitted. Not at
 * AT_CONNECT: a permit held there is a failed connect()'s leftover, which
 * take_permit ends (connect_stale), so the connect is a new one and pays
 * its token (it passed free, and sockets left so while tokens lasted went
 * past the rate together later).
 */
static __always_inline bool rate_gate_of(struct fs_rate *r, int at, struct holder *h, __u64 id, struct rate_ticket *t)
{
	t->tat = NULL;
	t->would = false;
	if (!r)
		return true;
	if (rate_take(r, at, t))
		return true;
	if (h && at != AT_CONNECT && recorded(at, h))
		return true;
	/* Dry-run (events.h): admitted; the caller counts and reports it as
	 * a would-be refusal unless the rule's own dry-run did (rate_would). */
	if (dry_run(id)) {
		t->would = true;
		return true;
	}
	__sync_fetch_and_add(at == AT_CONNECT ? &r->limited_out : &r->limited_in, 1);
	__u32 zero = 0;
	struct fs_rate_counters *st = bpf_map_lookup_elem(&fs_rate_stats, &zero);
	if (st) {
		if (at == AT_CONNECT)
			st->limited_out++;
		else
			st->limited_in++;
	}
	return false;
}

/* rate_gate is rate_gate_of for project id's bucket in force for cgroup cg at at. */
static __always_inline bool rate_gate(int at, struct holder *h, __u64 id, __u64 cg, struct rate_ticket *t)
{
	return rate_gate_of(rate_in_force(at, id, cg), at, h, id, t);
}

/*
 * rate_undo gives back the token of t, if one was taken: the caller's
 * connection was not admitted after all (refused by the rule, or it has
 * its permit already).
 */
static __always_inline void rate_undo(struct rate_ticket *t)
{
	if (!t->tat)
		return;
	/* Saturating: fs_rate_set may have set tat to 0 (a full bucket)
	 * since the token was taken, and tat - iv would wrap. */
#pragma unroll
	for (int i = 0; i < RATE_TRIES; i++) {
		__u64 tat = *(volatile __u64 *)t->tat;
		__u64 next = tat > t->iv ? tat - t->iv : 0;
		if (__sync_val_compare_and_swap(t->tat, tat, next) == tat)
			return;
	}
}

/*
 * rate_settle gives the token of t back when res, the outcome of the
 * take_permit it gated for holder h at at, admitted nothing new: REFUSED,
 * or NOT_TAKEN for a holder that has its permit already (a connect()
 * called again, a retransmitted SYN). NOT_TAKEN for a full table admits
 * the connection without a permit: its token stays taken, so the rate
 * holds when the tables are full. Returns res.
 */
static __always_inline int rate_settle(struct rate_ticket *t, int at, struct holder *h, int res)
{
	if (t->tat && (res == REFUSED || (res == NOT_TAKEN && recorded(at, h))))
		rate_undo(t);
	return res;
}

/*
 * rate_would counts a connection of project id admitted past its rate in
 * dry-run (t->would) as a would-be refusal at dir, unless res says the
 * rule's dry-run counted it already (WOULD): one connection, one count.
 * true: the caller reports the event.
 */
static __always_inline bool rate_would(struct rate_ticket *t, __u64 id, __u8 dir, int res)
{
	if (!t->would || res == WOULD)
		return false;
	count_would(id, dir);
	return true;
}

/*
 * rate_event_connect reports a connect() of project id refused by its rate
 * (would: admitted in dry-run) with reason rate_limited (events.h).
 */
static __always_inline void rate_event_connect(struct bpf_sock_addr *ctx, bool v6, __u64 id, bool would)
{
	struct fs_project *p = project_get(id);
	struct fs_tuple t __attribute__((aligned(8))) = {};
	tuple_connect(ctx, v6, &t);
	emit_refusal(id, p, FS_DIR_CONNECT, FS_REASON_RATE_LIMITED, &t, would ? FS_EV_WOULD : 0);
}

/* rate_event_syn is rate_event_connect for a SYN with tuple rk. */
static __always_inline void rate_event_syn(__u64 id, struct fs_tuple *rk, bool would)
{
	struct fs_project *p = project_get(id);
	emit_refusal(id, p, FS_DIR_SYN, FS_REASON_RATE_LIMITED, rk, would ? FS_EV_WOULD : 0);
}

/*
 * bucket_set gives one bucket (tat, interval, burst) a new interval iv and
 * burst. A changed rate keeps the bucket's tokens, at most the new burst
 * (as package pools' buckets do): lowering a rate hands out no new burst,
 * and raising one from a very low rate does not leave the project waiting
 * out the old interval.
 */
static __always_inline void bucket_set(__u64 *tatp, __u64 *ivp, __u64 *burstp, __u64 iv, __u64 burst)
{
	if (iv && burst < iv)
		burst = iv; /* a bucket holds at least one token */
	__u64 old_iv = *ivp, old_burst = *burstp;
	if (old_iv == iv && old_burst == burst)
		return;
	if (iv && old_iv) {
		/* Carry the tokens: those the bucket holds at the old rate
		 * (whole ones), at most the new burst. A syscall program may
		 * not read the coarse clock; the precise one is at most a tick
		 * ahead of it. */
		__u64 now = now_ns(CLK_FINE);
		__u64 tat = *tatp, tat2 = 0;
		if (tat > now) {
			__u64 debt = tat - now;
			__u64 tokens = debt < old_burst ? (old_burst - debt) / old_iv : 0;
			tat2 = tokens >= burst / iv ? 0 : now + (burst - tokens * iv);
		}
		/* A take racing this store is lost: one token at most. */
		*tatp = tat2;
	} else if (iv) {
		*tatp = 0; /* unbounded until now: a full bucket */
	}
	*burstp = burst;
	*(volatile __u64 *)ivp = iv;
}

/*
 * fs_rate_set writes a project's rates for the loader: the outbound bucket
 * and the inbound one (bucket_set). A new entry starts with full buckets.
 */
SEC("syscall")
int fs_rate_set(struct fs_rate_args *a)
{
	__u64 id = a->project;
	__u32 zero = 0;
	struct fs_rated *n = bpf_map_lookup_elem(&fs_rate_node, &zero);
	a->result = 0;
	if (!n)
		return 0;
	if (a->op == RATE_DELETE) {
		struct fs_rate *r = bpf_map_lookup_elem(&fs_rates, &id);
		if (!r)
			return 0;
		bool limited = r->interval_ns != 0 || r->interval_in_ns != 0;
		if (bpf_map_delete_elem(&fs_rates, &id) == 0) {
			if (limited)
				__sync_fetch_and_add(&n->limited, -1);
			a->result = 1;
		}
		return 0;
	}
	if (a->op != RATE_SET)
		return 0;
	__u64 iv = a->interval_ns, burst = a->burst_ns;
	__u64 iv_in = a->interval_in_ns, burst_in = a->burst_in_ns;
	struct fs_rate *r = bpf_map_lookup_elem(&fs_rates, &id);
	if (!r) {
		struct fs_rate nr = {
			.interval_ns = iv, .burst_ns = iv && burst < iv ? iv : burst,
			.interval_in_ns = iv_in, .burst_in_ns = iv_in && burst_in < iv_in ? iv_in : burst_in,
		};
		if (bpf_map_update_elem(&fs_rates, &id, &nr, BPF_NOEXIST))
			return 0; /* full; or another writer, which the loader's lock rules out */
		if (iv || iv_in)
			__sync_fetch_and_add(&n->limited, 1);
		a->result = 1;
		return 0;
	}
	bool was = r->interval_ns != 0 || r->interval_in_ns != 0;
	bucket_set(&r->tat, &r->interval_ns, &r->burst_ns, iv, burst);
	bucket_set(&r->tat_in, &r->interval_in_ns, &r->burst_in_ns, iv_in, burst_in);
	bool is = iv != 0 || iv_in != 0;
	if (!was && is)
		__sync_fetch_and_add(&n->limited, 1);
	else if (was && !is)
		__sync_fetch_and_add(&n->limited, -1);
	a->result = 1;
	return 0;
}
