// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * fairshare connection limiter: TCP connection permits per project, taken at
 * connect (outbound) and at the inbound SYN, released when the socket dies.
 *
 * A project is a cgroup directly below the projects root; its id is the
 * cgroup id. The rule (see pools/doc.go) is applied here with POOL and FLOOR
 * from the config map and share = max(FLOOR, POOL / active):
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
 * Exempt sockets (their cgroup or their project is in fs_exempt) take a
 * permit from a separate budget (exempt_max, fetch-add and roll-back like the
 * pool) and are neither refused by the rule nor counted in in_use; over the
 * budget they go under the rule like any socket of their project. So the
 * exempt set adds at most exempt_max connections to POOL.
 *
 * Programs (kept few: each one runs on a hot path):
 *   cgroup/connect4, cgroup/connect6  outbound admission, process context;
 *                                      a refusal makes connect() fail at
 *                                      once with ECONNREFUSED
 *   sk_lookup                          inbound admission at the SYN; a refusal
 *                                      is SK_DROP, the kernel answers the SYN
 *                                      with an RST, the client sees
 *                                      ECONNREFUSED and accept() never sees it
 *   tp_btf/inet_sock_set_state         listener bookkeeping, inbound permit
 *                                      conversion at ESTABLISHED, release at
 *                                      TCP_CLOSE
 *   tp_btf/tcp_send_reset              undoes reservations made for non-SYN
 *                                      packets (sk_lookup cannot see flags)
 *   cgroup/sock_release                release when the fd is closed before
 *                                      the socket reaches TCP_CLOSE
 *   iter/tcp                           adoption of sockets that predate the
 *                                      programs, and the reconcile dump
 *   syscall                            atomic adjustments from user space
 *                                      (expired reservations, drift repair)
 *
 * A held permit is an entry keyed by the socket cookie (a slot of fs_slots,
 * or fs_held when the slot is taken). Every release path clears the entry
 * and only the caller whose compare-and-swap or delete succeeded gives the
 * permit back, so a socket releases exactly once however many of
 * the paths fire (an orderly close runs sock_release and then TCP_CLOSE).
 * A reservation is kept the same way, keyed by its 4-tuple (a slot of
 * fs_resv_slots, or fs_reservations), and ended exactly once by the
 * conversion at ESTABLISHED, the undo at an RST or the expiry.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_tracing.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define ECONNREFUSED 111
#define EEXIST 17
#define AF_INET 2
#define AF_INET6 10
#define SOCK_STREAM 1

/* Fixed when the programs are loaded: where projects live in the hierarchy. */
volatile const __u32 root_level;      /* level of the projects root cgroup */
volatile const __u64 root_cgroup_id;  /* its cgroup id */
volatile const __u64 slot_mask;       /* entries of fs_slots - 1 (a power of two) */

/* Run-time values, written by the control loop (loader.Tick, SetPool). */
struct fs_settings {
	__u32 pool;          /* POOL */
	__u32 floor;         /* FLOOR */
	__u32 exempt_max;    /* exempt budget; 0 while the exempt set is empty */
	__u32 _pad;
	__u64 window_ns;     /* the active window; 0 leaves active to the control loop */
	__u64 netns_cookie;  /* the netns whose sk_lookup we own */
	__u64 root_cgroup_id; /* copy of the constant, to check pins on reuse */
};

/* Node-wide permits held. One slot; atomics only. */
struct fs_pool {
	__s64 in_use;
	__s64 exempt_in_use; /* exempt permits, never above exempt_max */
	__s64 spilled;       /* entries of the spill tables fs_held and fs_reservations */
	__s64 active;        /* projects in the active window (bumped here, lowered by Tick) */
};

/*
 * Per project. The event counters are atomics here rather than per-CPU
 * values: the admission already owns this cache line for the in_use
 * fetch-add, so a second atomic on it is nearly free, while a per-CPU hash
 * would cost another lookup on every connect.
 */
struct fs_project {
	__s64 in_use;        /* permits held, reservations included */
	__u64 last_seen_ns;  /* CLOCK_MONOTONIC of the last ask */
	__u64 admitted;
	__u64 refused;
};

/* Node-wide event counters, per CPU; summed at read time. */
struct fs_counters {
	__u64 admitted_out;
	__u64 admitted_in;
	__u64 refused_out;
	__u64 refused_in;
	__u64 released;
	__u64 adopted;        /* pre-existing sockets counted by iter/tcp */
	__u64 expired;        /* reservations whose handshake never finished */
	__u64 unaccounted;    /* children admitted late and refused: not held */
	__u64 map_full;       /* project or reservation map full: not held */
	__u64 stray;          /* reservations of non-SYN packets, undone at the RST */
	__u64 exempt_admitted; /* exempt permits taken (either direction) */
	__u64 exempt_over;     /* exempt sockets over the budget: put under the rule */
	__u64 exempt_released;
};

enum sock_kind {
	KIND_OUT = 1,
	KIND_IN = 2,
	KIND_ADOPTED = 3,
	/* Exempt permits come from the exempt budget, not from the pool or
	 * the project: releasing one gives it back there. */
	KIND_EXEMPT_OUT = 4,
	KIND_EXEMPT_IN = 5,
	KIND_EXEMPT_ADOPTED = 6,
};

#define KIND_IS_EXEMPT(k) ((k) >= KIND_EXEMPT_OUT)

/*
 * A permit held by a socket, keyed by its cookie. The entry exists exactly
 * while the permit is held: whoever deletes it (the first of the release
 * paths) gives the permit back, so it is released exactly once.
 */
struct fs_sock {
	__u64 project;
	__u64 netns;  /* netns cookie: reconcile can only verify its own netns */
	__u32 kind;
	__u32 _pad;
};

/*
 * A held permit in its slot of fs_slots (index: cookie & slot_mask). cookie
 * 0 is a free slot; SLOT_BUSY | cookie is a slot being filled.
 */
struct fs_slot {
	__u64 cookie;
	struct fs_sock sock;
};

#define SLOT_BUSY (1ULL << 63)

/* A listening address. addr is IPv6 or v4-mapped; all zero = wildcard. */
struct fs_listen_key {
	__u64 netns;
	__u32 port;  /* host order */
	__u32 _pad;
	__u8 addr[16];
};

/*
 * Several sockets may listen on one address (SO_REUSEPORT): refs counts them,
 * and the entry goes when the last one closes. project and cgroup are the
 * latest listener's.
 */
struct fs_listener {
	__u64 project;
	__u64 cgroup; /* the listener's own cgroup (exemption of nested cgroups) */
	__u32 refs;   /* listening sockets on this address counted here */
	__u32 _pad;
};

/*
 * A handshake in flight, admitted at the SYN, keyed by its 4-tuple. Aligned
 * so that it is hashed and compared as five 64-bit words (the verifier
 * refuses misaligned stack access).
 */
struct fs_resv_key {
	__u8 laddr[16];
	__u8 raddr[16];
	__u32 lport; /* host order */
	__u32 rport; /* host order */
} __attribute__((aligned(8)));

struct fs_resv {
	__u64 project;
	__u64 since_ns;
	__u32 kind; /* KIND_IN or KIND_EXEMPT_IN: which budget the permit came from */
	__u32 _pad;
};

/* Context of fs_adjust, run from user space with BPF_PROG_RUN. */
enum adjust_op {
	OP_EXPIRE = 1, /* end reservation key if it still has since_ns; if we ended it, release */
	OP_ADD = 2,    /* add delta to project and node in_use (drift repair) */
	OP_DROP = 3,   /* release the permit held for socket cookie `project`: the socket is gone */
	OP_ACTIVE = 4, /* add delta to the node's active count (Tick's recount) */
	OP_EXEMPT = 5, /* add delta to the node's exempt_in_use (drift repair) */
	OP_UNLISTEN = 6, /* uncount the listener counted under socket cookie `project`: it is gone */
};

struct fs_adjust_args {
	__u32 op;
	__u32 _pad;
	__u64 project;
	__s64 delta;
	__s64 result;
	/*
	 * OP_EXPIRE: the reservation's since_ns as the caller read it. A
	 * reservation of the same tuple made after that read (the handshake
	 * completed, the connection closed and a new SYN came) has another
	 * stamp and is left alone.
	 */
	__u64 since_ns;
	struct fs_resv_key key;
};

/* One record per project-owned TCP socket, written by fs_dump. */
struct fs_sock_record {
	__u64 cookie;
	__u64 project;
	__u32 state;
	__u32 held;
	__u32 kind;
	__u32 adopted; /* 1 if this dump adopted it */
};

/* Emits the record's BTF for bpf2go -type; lives in .rodata with the tunables. */
volatile const struct fs_sock_record fs_record_layout;

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1); /* one node */
	__type(key, __u32);
	__type(value, struct fs_settings);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1); /* one node */
	__type(key, __u32);
	__type(value, struct fs_pool);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_node SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1); /* one node */
	__type(key, __u32);
	__type(value, struct fs_counters);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096); /* projects on one node; beyond it, connects are not counted */
	__type(key, __u64);
	__type(value, struct fs_project);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_projects SEC(".maps");

/*
 * Held permits, by socket cookie, in two tables. Neither is sk_storage:
 * creating socket storage costs a kmalloc with memory-cgroup accounting on
 * every connect (~0.8 us measured here).
 *
 * fs_slots is an array indexed by the low bits of the cookie. The kernel
 * hands cookies out in per-CPU runs of consecutive numbers, so the sockets
 * of a connection loop fill neighbouring slots, whose cache lines are still
 * warm; a slot is claimed and freed with one compare-and-swap, and an array
 * lookup is inlined by the verifier (no helper call, no hashing, no bucket
 * lock). Measured here: the hash insert this replaced cost ~360 ns of the
 * connect program, its lookup ~175 ns of sock_release.
 *
 * fs_held is the spill table for a cookie whose slot a long-lived socket
 * still holds. Node spilled counts its entries, so that while it is empty
 * (nearly always) the release paths do not look into it.
 *
 * Both are sized from POOL by the loader: 2 x POOL rounded up to a power of
 * two, so slots collide rarely and the spill table cannot fill first.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1024); /* replaced at load: 2 x POOL rounded up to a power of two */
	__type(key, __u32);
	__type(value, struct fs_slot);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_slots SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024); /* replaced at load: as fs_slots */
	__type(key, __u64);
	__type(value, struct fs_sock);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_held SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384); /* listening addresses of all projects */
	__type(key, struct fs_listen_key);
	__type(value, struct fs_listener);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_listeners SEC(".maps");

/*
 * Listening sockets counted in the refs of fs_listeners, by cookie (the value
 * is the address they are counted under). A socket is counted once however
 * often it is seen (the TCP_LISTEN transition, then every reconcile dump),
 * and uncounted once: only the close whose delete succeeds drops a ref.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384); /* as fs_listeners */
	__type(key, __u64);
	__type(value, struct fs_listen_key);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_listen_socks SEC(".maps");

/*
 * Project listening addresses per local port (all namespaces), split by
 * kind: the cheap first filter of the inbound paths, which run for every SYN
 * and every accepted child of the host, and a hint that spares the listener
 * lookup that would miss (a wildcard listener, the usual server, is found
 * with one lookup instead of two). An array lookup is inlined by the
 * verifier; the hash lookups behind it are not. A port with one listening
 * address (the usual case) also names its listener here, so sk_lookup does
 * not look in fs_listeners at all: measured here (bpf_stats, loopback
 * connect loop) that takes sk_lookup from ~450-570 to ~360-380 ns/run.
 */
struct fs_port {
	/* specific, wildcard and version are one 64-bit word (port_state),
	 * changed with one fetch-add: whoever changes the port's addresses
	 * learns their counts and the version the change made, atomically. */
	__u16 specific; /* addresses of the port's listeners that are one address */
	__u16 wildcard; /* addresses that are 0.0.0.0 or :: */
	__u32 version;  /* bumped by every change of the addresses or of their owner */
	/*
	 * The owner: the port's only listening address and its listener,
	 * valid while tag equals the port's state word (one address, the
	 * version it was written at). sk_lookup then admits without the
	 * fs_listeners lookup, whose 32-byte key costs a jhash and two more
	 * cache lines (and pages) per SYN. tag is 0 while the owner is being
	 * written; lock admits one writer at a time.
	 */
	__u64 tag;
	__u32 lock;
	__u32 _pad;
	__u64 netns;
	__u64 project;
	__u64 cgroup;
	__u8 addr[16];
} __attribute__((aligned(8)));

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536); /* one slot per TCP port */
	__type(key, __u32);
	__type(value, struct fs_port);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_ports SEC(".maps");

/*
 * Reservations, by 4-tuple, in two tables as held permits are. fs_resv_slots
 * is an array indexed by a hash of the tuple; a slot is claimed and freed
 * with a compare-and-swap of its tag (the hash, never 0; SLOT_BUSY while it
 * is being filled). fs_reservations is the spill table for a tuple whose
 * slot another handshake holds, looked at only while node spilled says it
 * has entries. Measured here (bpf_stats, loopback connect loop): the hash
 * insert at the SYN was ~220 ns of sk_lookup's ~500 and the delete at
 * ESTABLISHED ~8 ns per run of the state program (~80 per connection); the
 * slots take ~70 ns off sk_lookup and all of the delete (see resv_hash for
 * why the slots are placed as they are).
 */
struct fs_resv_slot {
	__u64 tag;
	struct fs_resv_key key;
	struct fs_resv resv;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1024); /* replaced at load with the size of fs_slots (slot_mask) */
	__type(key, __u32);
	__type(value, struct fs_resv_slot);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_resv_slots SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024); /* replaced at load like fs_held: reservations hold permits, so at most POOL plus races */
	__type(key, struct fs_resv_key);
	__type(value, struct fs_resv);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_reservations SEC(".maps");

/*
 * The exempt set: cgroup ids (a project, or a cgroup nested in one) whose
 * sockets take exempt permits instead of pool permits. An operator's short
 * list, not a tenant mechanism: 64 entries, checked by the loader too.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 64); /* loader.ExemptCap */
	__type(key, __u64);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_exempt SEC(".maps");

static __always_inline struct fs_counters *counters(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&fs_stats, &zero);
}

#define COUNT(field)                                  \
	do {                                          \
		struct fs_counters *c__ = counters();    \
		if (c__)                              \
			c__->field++;                 \
	} while (0)

static __always_inline struct fs_pool *node(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&fs_node, &zero);
}

static __always_inline struct fs_slot *slot_of(__u64 cookie)
{
	__u32 i = cookie & slot_mask;
	return bpf_map_lookup_elem(&fs_slots, &i);
}

static __always_inline bool spill_empty(void)
{
	struct fs_pool *n = node();
	return !n || n->spilled <= 0;
}

/*
 * held_find returns the permit held for cookie, or NULL. The spill table
 * is looked at only while it has entries, unless always (user-space paths).
 */
static __always_inline struct fs_sock *held_find(__u64 cookie, bool always)
{
	struct fs_slot *s = slot_of(cookie);
	if (s && s->cookie == cookie)
		return &s->sock;
	if (!always && spill_empty())
		return NULL;
	return bpf_map_lookup_elem(&fs_held, &cookie);
}

/*
 * hold records the permit v for cookie: 0, -EEXIST if the socket holds one
 * already, another error if both tables are full.
 */
static __always_inline long hold(__u64 cookie, struct fs_sock *v)
{
	struct fs_slot *s = slot_of(cookie);
	if (!s)
		return -1;
	if (__sync_val_compare_and_swap(&s->cookie, 0, cookie | SLOT_BUSY) == 0) {
		/* The socket may hold a permit in the spill table from before
		 * its slot was freed (connect() called again). */
		if (!spill_empty() && bpf_map_lookup_elem(&fs_held, &cookie)) {
			__sync_lock_test_and_set(&s->cookie, 0);
			return -EEXIST;
		}
		s->sock = *v;
		/* Publish: the exchange orders the stores above before it. */
		__sync_lock_test_and_set(&s->cookie, cookie);
		return 0;
	}
	if ((s->cookie & ~SLOT_BUSY) == cookie)
		return -EEXIST;
	struct fs_pool *n = node();
	if (!n)
		return -1;
	/* Counted before the insert, so that a reader who finds the count at
	 * zero cannot miss an entry already in. */
	__sync_fetch_and_add(&n->spilled, 1);
	long err = bpf_map_update_elem(&fs_held, &cookie, v, BPF_NOEXIST);
	if (err)
		__sync_fetch_and_add(&n->spilled, -1);
	return err;
}

/*
 * unhold ends the permit held for cookie. Only the caller whose
 * compare-and-swap (or delete) succeeds gets true and the permit's project
 * and kind, so a permit is given back exactly once however many release
 * paths race. The fields are read while the slot still names the cookie:
 * nobody writes a slot's fields but the one who claimed it empty.
 */
static __always_inline bool unhold(__u64 cookie, __u64 *id, __u32 *kind, bool always)
{
	struct fs_slot *s = slot_of(cookie);
	if (s && s->cookie == cookie) {
		*id = s->sock.project;
		*kind = s->sock.kind;
		return __sync_val_compare_and_swap(&s->cookie, cookie, 0) == cookie;
	}
	if (!always && spill_empty())
		return false;
	struct fs_sock *h = bpf_map_lookup_elem(&fs_held, &cookie);
	if (!h)
		return false;
	*id = h->project;
	*kind = h->kind;
	if (bpf_map_delete_elem(&fs_held, &cookie))
		return false;
	struct fs_pool *n = node();
	if (n)
		__sync_fetch_and_add(&n->spilled, -1);
	return true;
}

/*
 * resv_hash places a tuple: a hash of everything but the remote port, plus
 * the remote port. A client's connections to one address take ports close
 * together (the kernel's ephemeral ports advance by two), so their
 * reservations fill neighbouring slots, whose lines and pages are still warm,
 * where a hash of the whole tuple sends each to a cold line of its own: a
 * cache and TLB miss (the kernel's page tables are switched at every system
 * call here), measured to cost sk_lookup as much as the hash-map insert did.
 */
static __always_inline __u64 resv_hash(const struct fs_resv_key *k)
{
	const __u64 *w = (const __u64 *)k;
	__u64 h = 0;
#pragma unroll
	for (int i = 0; i < 4; i++)
		h = (h ^ w[i]) * 0x9e3779b97f4a7c15ULL;
	h = (h ^ k->lport) * 0x9e3779b97f4a7c15ULL;
	/* A multiplication moves bits only upwards, and the index takes the
	 * low ones: mix the high bits down (murmur3's finaliser). */
	h ^= h >> 33;
	h *= 0xff51afd7ed558ccdULL;
	h ^= h >> 33;
	h *= 0xc4ceb9fe1a85ec53ULL;
	return (h ^ (h >> 33)) + k->rport;
}

/* resv_tagof is a slot's tag for hash h: nonzero, without SLOT_BUSY. */
static __always_inline __u64 resv_tagof(__u64 h)
{
	return (h | 1) & ~SLOT_BUSY;
}

static __always_inline struct fs_resv_slot *resv_slot(__u64 h)
{
	__u32 i = h & slot_mask;
	return bpf_map_lookup_elem(&fs_resv_slots, &i);
}

static __always_inline bool resv_key_eq(const struct fs_resv_key *a, const struct fs_resv_key *b)
{
	const __u64 *x = (const __u64 *)a, *y = (const __u64 *)b;
	return x[0] == y[0] && x[1] == y[1] && x[2] == y[2] && x[3] == y[3] && x[4] == y[4];
}

/* resv_find returns the reservation of k, or NULL. */
static __always_inline struct fs_resv *resv_find(struct fs_resv_key *k)
{
	__u64 h = resv_hash(k);
	struct fs_resv_slot *s = resv_slot(h);
	if (s && s->tag == resv_tagof(h) && resv_key_eq(&s->key, k))
		return &s->resv;
	if (spill_empty())
		return NULL;
	return bpf_map_lookup_elem(&fs_reservations, k);
}

/*
 * resv_put records reservation r for k: 0, -EEXIST if k has one already (a
 * retransmitted SYN, or a SYN of the same tuple on another CPU), another
 * error if both tables are full.
 */
static __always_inline long resv_put(struct fs_resv_key *k, struct fs_resv *r)
{
	__u64 h = resv_hash(k), tag = resv_tagof(h);
	struct fs_resv_slot *s = resv_slot(h);
	if (!s)
		return -1;
	if (__sync_val_compare_and_swap(&s->tag, 0, tag | SLOT_BUSY) == 0) {
		/* k may be in the spill table from before its slot was freed. */
		if (!spill_empty() && bpf_map_lookup_elem(&fs_reservations, k)) {
			__sync_lock_test_and_set(&s->tag, 0);
			return -EEXIST;
		}
		s->key = *k;
		s->resv = *r;
		/* Publish: the exchange orders the stores above before it. */
		__sync_lock_test_and_set(&s->tag, tag);
		return 0;
	}
	__u64 cur = s->tag;
	if (cur == (tag | SLOT_BUSY) || (cur == tag && resv_key_eq(&s->key, k)))
		return -EEXIST;
	struct fs_pool *n = node();
	if (!n)
		return -1;
	/* Counted before the insert, as in hold. */
	__sync_fetch_and_add(&n->spilled, 1);
	long err = bpf_map_update_elem(&fs_reservations, k, r, BPF_NOEXIST);
	if (err)
		__sync_fetch_and_add(&n->spilled, -1);
	return err;
}

/*
 * resv_take ends the reservation of k. Only the caller whose
 * compare-and-swap (or delete) succeeds gets true and the reservation's
 * project and kind: its permit goes to exactly one of the conversion at
 * ESTABLISHED, the undo at an RST and the expiry. The spill table is looked
 * at only while it has entries, unless always (user-space paths). A
 * non-zero since ends only a reservation stamped since (the expiry's).
 */
static __always_inline bool resv_take(struct fs_resv_key *k, __u64 *id, __u32 *kind, bool always, __u64 since)
{
	__u64 h = resv_hash(k), tag = resv_tagof(h);
	struct fs_resv_slot *s = resv_slot(h);
	if (s && s->tag == tag && resv_key_eq(&s->key, k)) {
		if (since && s->resv.since_ns != since)
			return false;
		*id = s->resv.project;
		*kind = s->resv.kind;
		return __sync_val_compare_and_swap(&s->tag, tag, 0) == tag;
	}
	if (!always && spill_empty())
		return false;
	struct fs_resv *r = bpf_map_lookup_elem(&fs_reservations, k);
	if (!r || (since && r->since_ns != since))
		return false;
	*id = r->project;
	*kind = r->kind;
	if (bpf_map_delete_elem(&fs_reservations, k))
		return false;
	struct fs_pool *n = node();
	if (n)
		__sync_fetch_and_add(&n->spilled, -1);
	return true;
}

/*
 * now_ns is CLOCK_MONOTONIC, at tick resolution where it is allowed. The
 * stamps are compared with windows of a second (activity) and seconds
 * (reservation TTL), so a tick is precise enough, and the coarse clock reads
 * a variable where the precise one reads the clock source (kvm-clock here).
 * Tracing programs (tp_btf, iter) may not call the coarse helper (it takes a
 * seqcount that could deadlock from NMI), so they pass fine = true; the
 * argument is a constant at every call site and the other call is compiled
 * out. The coarse clock never runs ahead of the precise one, so user space
 * subtracting a stamp from its own CLOCK_MONOTONIC never goes negative.
 */
#define CLK_COARSE false
#define CLK_FINE true

static __always_inline __u64 now_ns(bool fine)
{
	return fine ? bpf_ktime_get_ns() : bpf_ktime_get_coarse_ns();
}

static __always_inline struct fs_project *project_get(__u64 id)
{
	struct fs_project *p = bpf_map_lookup_elem(&fs_projects, &id);
	if (p)
		return p;
	struct fs_project zero = {};
	/* A new cgroup is a new project at once: no registration. */
	bpf_map_update_elem(&fs_projects, &id, &zero, BPF_NOEXIST);
	return bpf_map_lookup_elem(&fs_projects, &id);
}

/*
 * seen stamps the project's ask and, when this ask brings it into the active
 * window (never seen, or last seen a window ago while holding nothing), adds
 * it to the node's active count. The stamp is swapped in with a
 * compare-and-swap, so of several CPUs asking for the same newcomer at once
 * only one counts it. A project Tick already counted and that ages out
 * before the next Tick is counted twice until then: the error only shrinks
 * the share, the safe direction. A stamp ahead of now (the coarse clock lags
 * the precise one by up to a tick) is recent, not a window old.
 */
static __always_inline void seen(struct fs_settings *cfg, struct fs_pool *n, struct fs_project *p, bool fine)
{
	__u64 now = now_ns(fine);
	__u64 last = p->last_seen_ns;
	__u64 window = cfg->window_ns;
	if (window && p->in_use <= 0 && (last == 0 || (now > last && now - last >= window))) {
		if (__sync_val_compare_and_swap(&p->last_seen_ns, last, now) == last)
			__sync_fetch_and_add(&n->active, 1);
		return;
	}
	p->last_seen_ns = now;
}

/* share is max(FLOOR, POOL / active), POOL while nobody is active. */
static __always_inline __s64 share_of(struct fs_settings *cfg, struct fs_pool *n)
{
	__s64 active = n->active;
	__s64 pool = cfg->pool;
	if (active <= 1)
		return pool;
	__s64 s = pool / active;
	return s < cfg->floor ? cfg->floor : s;
}

#define ADMIT_HELD 2 /* refused, but the socket already holds a permit */
#define ADMIT_TRIES 8 /* compare-and-swap attempts on the node counter */

/*
 * admit applies the rule to project entry p (NULL: the project map is full)
 * and, if it admits, takes the permit on both counters. Returns 1 admitted,
 * 0 refused, -1 not counted (map full), or ADMIT_HELD when it would refuse a
 * socket (cookie, nonzero) that already holds a permit: connect() called
 * again while connecting must not fail.
 * Looking that up only on the refusal path keeps the common path to one
 * operation on the held tables (the insert).
 */
static __always_inline int admit(struct fs_project *p, __u64 cookie, bool fine)
{
	__u32 zero = 0;
	struct fs_settings *cfg = bpf_map_lookup_elem(&fs_config, &zero);
	struct fs_pool *n = bpf_map_lookup_elem(&fs_node, &zero);
	if (!cfg || !n)
		return -1;
	if (!p) {
		COUNT(map_full);
		return -1;
	}
	seen(cfg, n, p, fine);

	__s64 lim = cfg->pool;
	if (*(volatile __s64 *)&p->in_use >= share_of(cfg, n))
		lim = cfg->floor < cfg->pool ? cfg->pool - cfg->floor : 0;
	/*
	 * Compare-and-swap, not fetch-add and roll back: in_use only ever
	 * moves to a value the rule allows, so a reader (Snapshot, metrics)
	 * never sees it above POOL, not even for an instant. Losing the race
	 * ADMIT_TRIES times in a row (only under heavy contention on the one
	 * counter) refuses: a spurious refusal, never an overshoot.
	 */
	bool ok = false;
#pragma unroll
	for (int i = 0; i < ADMIT_TRIES; i++) {
		__s64 used = *(volatile __s64 *)&n->in_use;
		if (used >= lim)
			break;
		if (__sync_val_compare_and_swap(&n->in_use, used, used + 1) == used) {
			ok = true;
			break;
		}
	}
	if (!ok) {
		if (cookie && held_find(cookie, false))
			return ADMIT_HELD;
		__sync_fetch_and_add(&p->refused, 1);
		return 0;
	}
	__sync_fetch_and_add(&p->in_use, 1);
	__sync_fetch_and_add(&p->admitted, 1);
	return 1;
}

static __always_inline void release(__u64 id, bool fine)
{
	__u32 zero = 0;
	struct fs_pool *n = bpf_map_lookup_elem(&fs_node, &zero);
	struct fs_project *p = bpf_map_lookup_elem(&fs_projects, &id);
	if (n)
		__sync_fetch_and_add(&n->in_use, -1);
	if (p) {
		__sync_fetch_and_add(&p->in_use, -1);
		/* Holding counts as asking: the project stays active until it lets go. */
		p->last_seen_ns = now_ns(fine);
	}
	COUNT(released);
}

/* force takes a permit without the rule: the connection already exists. */
static __always_inline void force(__u64 id, bool fine)
{
	__u32 zero = 0;
	struct fs_settings *cfg = bpf_map_lookup_elem(&fs_config, &zero);
	struct fs_pool *n = bpf_map_lookup_elem(&fs_node, &zero);
	struct fs_project *p = project_get(id);
	if (!n)
		return;
	if (p && cfg)
		seen(cfg, n, p, fine);
	__sync_fetch_and_add(&n->in_use, 1);
	if (p)
		__sync_fetch_and_add(&p->in_use, 1);
}

/*
 * exempt_take takes an exempt permit for a socket of cgroup cg (with task:
 * the calling task's cgroup, asked for only once the set is known to be
 * non-empty) in project id if either is in the exempt set and the budget has
 * room. Over the budget it returns false and the socket is treated like any
 * other of its project: the exempt set can add at most exempt_max
 * connections to the POOL the rule bounds. The budget is taken like the pool (fetch-add, roll back), so
 * exempt_in_use never exceeds exempt_max either.
 */
static __always_inline bool exempt_take(bool task, __u64 cg, __u64 id)
{
	__u32 zero = 0;
	struct fs_settings *cfg = bpf_map_lookup_elem(&fs_config, &zero);
	struct fs_pool *n = bpf_map_lookup_elem(&fs_node, &zero);
	/* exempt_max is 0 while the set is empty: no lookup on the common path. */
	if (!cfg || !n || !cfg->exempt_max)
		return false;
	if (task)
		cg = bpf_get_current_cgroup_id();
	if (!bpf_map_lookup_elem(&fs_exempt, &id) && (cg == id || !bpf_map_lookup_elem(&fs_exempt, &cg)))
		return false;
	__s64 used = __sync_fetch_and_add(&n->exempt_in_use, 1);
	if (used >= cfg->exempt_max) {
		__sync_fetch_and_add(&n->exempt_in_use, -1);
		COUNT(exempt_over);
		return false;
	}
	return true;
}

/* exempt_undo gives an exempt permit back without counting a release. */
static __always_inline void exempt_undo(void)
{
	__u32 zero = 0;
	struct fs_pool *n = bpf_map_lookup_elem(&fs_node, &zero);
	if (n)
		__sync_fetch_and_add(&n->exempt_in_use, -1);
}

/* give_back releases a permit of either budget. */
static __always_inline void give_back(__u64 id, __u32 kind, bool fine)
{
	if (KIND_IS_EXEMPT(kind)) {
		exempt_undo();
		COUNT(exempt_released);
		return;
	}
	release(id, fine);
}

/*
 * task_project finds the project of the calling task, its ancestor one level
 * below the root: its id in *id, and its entry if it has one yet. *id is 0
 * when the task is not below the root (a socket created in a project and
 * used by a task outside it is not counted). The keys of fs_projects are only
 * ever ids of projects (cgroup ids are not reused), so an entry found needs
 * no check that the root is the ancestor: a connect of a known project costs
 * one cgroup helper, not two.
 */
static __always_inline struct fs_project *task_project(__u64 *id)
{
	*id = bpf_get_current_ancestor_cgroup_id(root_level + 1);
	struct fs_project *p = bpf_map_lookup_elem(&fs_projects, id);
	if (!p && bpf_get_current_ancestor_cgroup_id(root_level) != root_cgroup_id)
		*id = 0;
	return p;
}

/* cgroup_project is the project of a socket's cgroup, 0 if outside the root. */
static __always_inline __u64 cgroup_project(struct cgroup *cg)
{
	if (!cg)
		return 0;
	int level = BPF_CORE_READ(cg, level);
	if (level <= (int)root_level || level > 255)
		return 0;
	struct cgroup *anc = NULL;
	bpf_probe_read_kernel(&anc, sizeof(anc), &cg->ancestors[root_level & 0xff]);
	if (!anc || BPF_CORE_READ(anc, kn, id) != root_cgroup_id)
		return 0;
	anc = NULL;
	bpf_probe_read_kernel(&anc, sizeof(anc), &cg->ancestors[(root_level + 1) & 0xff]);
	if (!anc)
		return 0;
	return BPF_CORE_READ(anc, kn, id);
}

static __always_inline int connect_common(struct bpf_sock_addr *ctx)
{
	/* Cheapest filter first: UDP connect runs this hook too. */
	if (ctx->type != SOCK_STREAM)
		return 1;
	__u64 id = 0;
	struct fs_project *p = task_project(&id);
	if (!id)
		return 1;
	__u64 cookie = bpf_get_socket_cookie(ctx);
	__u32 kind = KIND_OUT;
	if (exempt_take(true, 0, id)) {
		kind = KIND_EXEMPT_OUT;
	} else {
		int r = admit(p ? p : project_get(id), cookie, CLK_COARSE);
		if (r < 0 || r == ADMIT_HELD)
			return 1;
		if (r == 0) {
			COUNT(refused_out);
			bpf_set_retval(-ECONNREFUSED);
			return 0;
		}
	}
	struct fs_sock v = {.project = id, .netns = bpf_get_netns_cookie(ctx), .kind = kind};
	long err = hold(cookie, &v);
	if (err) {
		/* The socket already holds a permit (connect() again after
		 * EINPROGRESS, or a concurrent connect won), or the map is full
		 * (the connection goes uncounted). */
		if (err != -EEXIST)
			COUNT(map_full);
		if (kind == KIND_EXEMPT_OUT)
			exempt_undo();
		else
			release(id, CLK_COARSE);
		return 1;
	}
	if (kind == KIND_EXEMPT_OUT)
		COUNT(exempt_admitted);
	else
		COUNT(admitted_out);
	return 1;
}

SEC("cgroup/connect4")
int fs_connect4(struct bpf_sock_addr *ctx)
{
	return connect_common(ctx);
}

SEC("cgroup/connect6")
int fs_connect6(struct bpf_sock_addr *ctx)
{
	return connect_common(ctx);
}

static __always_inline void release_cookie(__u64 cookie, bool fine)
{
	__u64 id = 0;
	__u32 kind = 0;
	if (unhold(cookie, &id, &kind, false))
		give_back(id, kind, fine);
}

SEC("cgroup/sock_release")
int fs_sock_release(struct bpf_sock *ctx)
{
	if (ctx->type != SOCK_STREAM)
		return 1;
	release_cookie(bpf_get_socket_cookie(ctx), CLK_COARSE);
	return 1;
}

static __always_inline void v4mapped(__u8 *dst, __be32 a)
{
	__builtin_memset(dst, 0, 10);
	dst[10] = 0xff;
	dst[11] = 0xff;
	__builtin_memcpy(dst + 12, &a, 4);
}

/* local_addr fills the listening/local address in normalised form. */
static __always_inline void sock_local(struct sock *sk, __u8 *addr, bool wildcard_zero)
{
	if (sk->__sk_common.skc_family == AF_INET) {
		__be32 a = sk->__sk_common.skc_rcv_saddr;
		if (a == 0 && wildcard_zero)
			__builtin_memset(addr, 0, 16);
		else
			v4mapped(addr, a);
	} else {
		bpf_core_read(addr, 16, &sk->__sk_common.skc_v6_rcv_saddr);
	}
}

static __always_inline void sock_remote(struct sock *sk, __u8 *addr)
{
	if (sk->__sk_common.skc_family == AF_INET)
		v4mapped(addr, sk->__sk_common.skc_daddr);
	else
		bpf_core_read(addr, 16, &sk->__sk_common.skc_v6_daddr);
}

static __always_inline __u64 sock_netns(struct sock *sk)
{
	return BPF_CORE_READ(sk, __sk_common.skc_net.net, net_cookie);
}

static __always_inline bool wild_addr(const __u8 *addr)
{
	const __u64 *a = (const __u64 *)addr;
	return a[0] == 0 && a[1] == 0;
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
 * port_change records a change of k's port: d = 1 address k added, -1
 * removed, 0 its listener (the owner) replaced. A change that leaves k the
 * port's only address writes k's listener, as the hash holds it after the
 * change, as the owner tagged with the new state. Every change bumps the
 * version, so an owner written for an earlier state is never taken for the
 * current one; a writer that finds the state moved on or the lock held
 * writes nothing, and sk_lookup falls back to the hash until the port's next
 * first address.
 */
static __always_inline void port_change(struct fs_listen_key *k, int d)
{
	__u32 port = k->port;
	struct fs_port *n = bpf_map_lookup_elem(&fs_ports, &port);
	if (!n)
		return;
	bool wild = wild_addr(k->addr);
	__u64 one = wild ? PORT_WILDCARD : PORT_SPECIFIC;
	if (d < 0 && !(wild ? n->wildcard : n->specific))
		return;
	__u64 delta = PORT_VERSION + (d > 0 ? one : d < 0 ? -one : 0);
	__u64 w = __sync_fetch_and_add(port_state(n), delta) + delta;
	if (d < 0 || port_addrs(w) != 1)
		return;
	/* Looked up after the change: a delete of k that this change did not
	 * see has already taken k out of the hash. */
	struct fs_listener *l = bpf_map_lookup_elem(&fs_listeners, k);
	if (!l || __sync_val_compare_and_swap(&n->lock, 0, 1) != 0)
		return;
	if (*(volatile __u64 *)port_state(n) == w) {
		__sync_lock_test_and_set(&n->tag, 0);
		n->netns = k->netns;
		__builtin_memcpy(n->addr, k->addr, 16);
		n->project = l->project;
		n->cgroup = l->cgroup;
		/* Publish: the exchange orders the stores above before it. */
		__sync_lock_test_and_set(&n->tag, w);
	}
	__sync_lock_test_and_set(&n->lock, 0);
}

/*
 * port_owner finds the listener of the SYN's address (netns, addr) from the
 * port's owner: 1 found (*id, *cg), 0 no listener there, -1 the owner is not
 * valid (look in the hash). The tag is read before and after the owner, as
 * a seqlock's sequence: port_change zeroes it before writing.
 */
static __always_inline int port_owner(struct fs_port *n, __u64 netns, const __u8 *addr, __u64 *id, __u64 *cg)
{
	__u64 w = *(volatile __u64 *)port_state(n);
	if (port_addrs(w) != 1 || *(volatile __u64 *)&n->tag != w)
		return -1;
	const __u64 *oa = (const __u64 *)n->addr, *a = (const __u64 *)addr;
	__u64 on = n->netns, o0 = oa[0], o1 = oa[1];
	*id = n->project;
	*cg = n->cgroup;
	asm volatile("" ::: "memory");
	if (*(volatile __u64 *)&n->tag != w)
		return -1;
	if (on != netns || ((o0 || o1) && (o0 != a[0] || o1 != a[1])))
		return 0;
	return 1;
}

/*
 * on_listen counts a project's listening socket under its address for
 * sk_lookup. A socket already counted (the reconcile dump sees every
 * listener again) is not counted twice; if its address entry is missing
 * (see on_unlisten), it is put back.
 */
static __always_inline void on_listen(struct sock *sk)
{
	struct cgroup *cg = sk->sk_cgrp_data.cgroup;
	__u64 id = cgroup_project(cg);
	if (!id)
		return;
	struct fs_listen_key k = {};
	k.netns = sock_netns(sk);
	k.port = sk->__sk_common.skc_num;
	sock_local(sk, k.addr, true);
	__u64 cookie = bpf_get_socket_cookie(sk);
	struct fs_listener nl = {.project = id, .cgroup = BPF_CORE_READ(cg, kn, id), .refs = 1};
	if (bpf_map_update_elem(&fs_listen_socks, &cookie, &k, BPF_NOEXIST)) {
		if (!bpf_map_lookup_elem(&fs_listen_socks, &cookie))
			return; /* map full: the listener goes uncounted */
		if (!bpf_map_lookup_elem(&fs_listeners, &k) &&
		    bpf_map_update_elem(&fs_listeners, &k, &nl, BPF_NOEXIST) == 0)
			port_change(&k, 1);
		return;
	}
	struct fs_listener *l = bpf_map_lookup_elem(&fs_listeners, &k);
	if (!l) {
		if (bpf_map_update_elem(&fs_listeners, &k, &nl, BPF_NOEXIST) == 0) {
			port_change(&k, 1);
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

static __always_inline void on_unlisten(struct sock *sk)
{
	unlisten(bpf_get_socket_cookie(sk));
}

/*
 * find_listener looks k up, then its wildcard, skipping a kind the port (its
 * entry n) lacks.
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
	return bpf_map_lookup_elem(&fs_listeners, k);
}

/*
 * on_established converts the reservation made at the SYN into the child's
 * permit. Without a reservation (it expired, the SYN came before the programs,
 * or another netns) the rule is applied now; a refusal here cannot stop the
 * connection, so it is left unheld and counted as unaccounted.
 */
static __always_inline void on_established(struct sock *sk)
{
	struct fs_port *port = listened(sk->__sk_common.skc_num);
	if (!port)
		return;
	struct fs_resv_key rk = {};
	sock_local(sk, rk.laddr, false);
	sock_remote(sk, rk.raddr);
	rk.lport = sk->__sk_common.skc_num;
	rk.rport = bpf_ntohs(sk->__sk_common.skc_dport);

	__u64 id = 0;
	__u32 kind = KIND_IN;
	if (!resv_take(&rk, &id, &kind, false, 0)) {
		struct fs_listen_key lk = {};
		lk.netns = sock_netns(sk);
		lk.port = rk.lport;
		__builtin_memcpy(lk.addr, rk.laddr, 16);
		struct fs_listener *l = find_listener(port, &lk);
		if (!l)
			return;
		id = l->project;
		if (exempt_take(false, l->cgroup, id)) {
			kind = KIND_EXEMPT_IN;
			COUNT(exempt_admitted);
		} else {
			kind = KIND_IN;
			int a = admit(project_get(id), 0, CLK_FINE);
			if (a < 0)
				return;
			if (a == 0) {
				COUNT(unaccounted);
				return;
			}
			COUNT(admitted_in);
		}
	}
	__u64 cookie = bpf_get_socket_cookie(sk);
	struct fs_sock v = {.project = id, .netns = sock_netns(sk), .kind = kind};
	long err = hold(cookie, &v);
	if (err) {
		/* Adopted meanwhile by the reconcile dump, or the map is full. */
		if (err != -EEXIST)
			COUNT(map_full);
		give_back(id, kind, CLK_FINE);
	}
}

SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(fs_set_state, struct sock *sk, int oldstate, int newstate)
{
	/* Most transitions (SYN_SENT, the FIN states, TIME_WAIT) concern us
	 * not at all, and this program runs for every TCP socket of the host
	 * about ten times per connection: look at the argument before touching
	 * the socket. */
	if (newstate != TCP_CLOSE && newstate != TCP_ESTABLISHED && newstate != TCP_LISTEN)
		return 0;
	if (sk->sk_protocol != IPPROTO_TCP)
		return 0;
	switch (newstate) {
	case TCP_CLOSE: {
		/* Every end of a connection passes here, including RST, failed
		 * connects, timeouts and children dropped with their listener.
		 * A socket that holds a permit has a cookie already; reading it
		 * rather than calling the helper spares every other socket of
		 * the host the generation of one. */
		__u64 cookie = sk->__sk_common.skc_cookie.counter;
		if (cookie)
			release_cookie(cookie, CLK_FINE);
		/* Not filtered by port: by now a listener bound to port 0 has
		 * given its port back (skc_num is 0). Listeners close rarely;
		 * on_unlisten finds the address by the socket's cookie. */
		if (oldstate == TCP_LISTEN)
			on_unlisten(sk);
		break;
	}
	case TCP_ESTABLISHED:
		if (oldstate == TCP_SYN_RECV)
			on_established(sk);
		break;
	case TCP_LISTEN:
		on_listen(sk);
		break;
	}
	return 0;
}

/*
 * sk_lookup cannot see TCP flags, so a non-SYN packet that misses the
 * established table (a segment racing the child's creation, a late FIN or
 * ACK) also reserves. A listener answers such a packet with an RST: undo its
 * reservation there instead of waiting for the TTL.
 */
SEC("tp_btf/tcp_send_reset")
int BPF_PROG(fs_send_reset, const struct sock *sk, const struct sk_buff *skb, int reason)
{
	if (!sk || !skb || sk->__sk_common.skc_state != TCP_LISTEN ||
	    !listened(sk->__sk_common.skc_num))
		return 0;
	unsigned char *head = BPF_CORE_READ(skb, head);
	__u16 nh = BPF_CORE_READ(skb, network_header);
	__u16 th_off = BPF_CORE_READ(skb, transport_header);
	struct tcphdr th;
	if (bpf_probe_read_kernel(&th, sizeof(th), head + th_off))
		return 0;
	if (th.syn)
		return 0;
	struct fs_resv_key rk = {};
	__u8 version = 0;
	bpf_probe_read_kernel(&version, 1, head + nh);
	if ((version >> 4) == 4) {
		struct iphdr ip;
		if (bpf_probe_read_kernel(&ip, sizeof(ip), head + nh))
			return 0;
		v4mapped(rk.laddr, ip.daddr);
		v4mapped(rk.raddr, ip.saddr);
	} else {
		struct ipv6hdr ip6;
		if (bpf_probe_read_kernel(&ip6, sizeof(ip6), head + nh))
			return 0;
		__builtin_memcpy(rk.laddr, &ip6.daddr, 16);
		__builtin_memcpy(rk.raddr, &ip6.saddr, 16);
	}
	rk.lport = bpf_ntohs(th.dest);
	rk.rport = bpf_ntohs(th.source);
	__u64 id = 0;
	__u32 kind = 0;
	if (resv_take(&rk, &id, &kind, false, 0)) {
		give_back(id, kind, CLK_FINE);
		COUNT(stray);
	}
	return 0;
}

SEC("sk_lookup")
int fs_sk_lookup(struct bpf_sk_lookup *ctx)
{
	if (ctx->protocol != IPPROTO_TCP)
		return SK_PASS;
	struct fs_port *port = listened(ctx->local_port);
	if (!port)
		return SK_PASS;
	__u32 zero = 0;
	struct fs_settings *cfg = bpf_map_lookup_elem(&fs_config, &zero);
	if (!cfg)
		return SK_PASS;

	struct fs_resv_key rk = {};
	if (ctx->family == AF_INET) {
		v4mapped(rk.laddr, ctx->local_ip4);
		v4mapped(rk.raddr, ctx->remote_ip4);
	} else {
		/* The context allows only aligned 4-byte loads of these. */
		__u32 *la = (__u32 *)rk.laddr, *ra = (__u32 *)rk.raddr;
		la[0] = ctx->local_ip6[0];
		la[1] = ctx->local_ip6[1];
		la[2] = ctx->local_ip6[2];
		la[3] = ctx->local_ip6[3];
		ra[0] = ctx->remote_ip6[0];
		ra[1] = ctx->remote_ip6[1];
		ra[2] = ctx->remote_ip6[2];
		ra[3] = ctx->remote_ip6[3];
	}
	rk.lport = ctx->local_port;
	rk.rport = bpf_ntohs(ctx->remote_port);

	__u64 id = 0, cg = 0;
	int own = port_owner(port, cfg->netns_cookie, rk.laddr, &id, &cg);
	if (own == 0)
		return SK_PASS;
	if (own < 0) {
		struct fs_listen_key lk = {};
		lk.netns = cfg->netns_cookie;
		lk.port = rk.lport;
		__builtin_memcpy(lk.addr, rk.laddr, 16);
		struct fs_listener *l = find_listener(port, &lk);
		if (!l)
			return SK_PASS;
		id = l->project;
		cg = l->cgroup;
	}
	__u32 kind = KIND_IN;
	int a = 1;
	if (exempt_take(false, cg, id))
		kind = KIND_EXEMPT_IN;
	else
		a = admit(project_get(id), 0, CLK_COARSE);
	if (a < 0)
		return SK_PASS;
	if (a == 0) {
		/* A retransmitted SYN keeps the permit the first one reserved.
		 * Looked up only here, on the refusal path: on the common path
		 * the insert below finds it (EEXIST) and the permit just taken
		 * is given back. */
		if (resv_find(&rk))
			return SK_PASS;
		COUNT(refused_in);
		return SK_DROP;
	}
	struct fs_resv r = {.project = id, .since_ns = now_ns(CLK_COARSE), .kind = kind};
	long err = resv_put(&rk, &r);
	if (err) {
		/* A retransmitted SYN or a concurrent SYN of the same tuple
		 * holds the reservation, or the map is full: the child is then
		 * admitted when it is established. */
		if (err != -EEXIST)
			COUNT(map_full);
		if (kind == KIND_EXEMPT_IN)
			exempt_undo();
		else
			release(id, CLK_COARSE);
		return SK_PASS;
	}
	if (kind == KIND_EXEMPT_IN)
		COUNT(exempt_admitted);
	else
		COUNT(admitted_in);
	return SK_PASS;
}

/*
 * fs_dump walks the TCP sockets of the caller's netns. A socket of a project
 * that holds no permit and is past its handshake is adopted (it predates the
 * programs, or was left unaccounted); every project socket is written out for
 * the reconcile report, and so is every listening socket, project or not:
 * a counted listener missing from the dump is gone (OP_UNLISTEN).
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
	__u64 id = cgroup_project(sk->sk_cgrp_data.cgroup);
	if (!id && state != TCP_LISTEN)
		return 0;
	struct fs_sock_record rec = {
		.cookie = bpf_get_socket_cookie(sk),
		.project = id,
		.state = state,
	};
	if (state == TCP_LISTEN) {
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
		struct cgroup *cg = sk->sk_cgrp_data.cgroup;
		bool ex = !held_find(rec.cookie, true) && exempt_take(false, BPF_CORE_READ(cg, kn, id), id);
		struct fs_sock v = {.project = id, .netns = sock_netns(sk),
				    .kind = ex ? KIND_EXEMPT_ADOPTED : KIND_ADOPTED};
		if (hold(rec.cookie, &v) == 0) {
			if (ex)
				COUNT(exempt_admitted);
			else
				force(id, CLK_FINE);
			COUNT(adopted);
			rec.adopted = 1;
		} else if (ex) {
			exempt_undo();
		}
		struct fs_sock *s = held_find(rec.cookie, true);
		if (s) {
			rec.held = 1;
			rec.kind = s->kind;
			rec.project = s->project;
		}
	}
	bpf_seq_write(ctx->meta->seq, &rec, sizeof(rec));
	return 0;
}

SEC("syscall")
int fs_adjust(struct fs_adjust_args *a)
{
	if (a->op == OP_EXPIRE) {
		struct fs_resv_key k = {};
		__builtin_memcpy(&k, &a->key, sizeof(k));
		__u64 id = 0;
		__u32 kind = 0;
		a->result = 0;
		if (resv_take(&k, &id, &kind, true, a->since_ns)) {
			give_back(id, kind, CLK_FINE);
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
		__u64 id = 0;
		__u32 kind = 0;
		a->result = 0;
		if (unhold(a->project, &id, &kind, true)) {
			give_back(id, kind, CLK_FINE);
			a->result = 1;
		}
		return 0;
	}
	if (a->op == OP_ACTIVE || a->op == OP_EXEMPT) {
		__u32 zero = 0;
		struct fs_pool *n = bpf_map_lookup_elem(&fs_node, &zero);
		a->result = 0;
		if (n) {
			__sync_fetch_and_add(a->op == OP_ACTIVE ? &n->active : &n->exempt_in_use, a->delta);
			a->result = 1;
		}
		return 0;
	}
	if (a->op == OP_ADD) {
		/* project 0 adjusts the node only (permits of vanished projects). */
		__u32 zero = 0;
		__u64 id = a->project;
		__s64 delta = a->delta;
		struct fs_pool *n = bpf_map_lookup_elem(&fs_node, &zero);
		if (id) {
			struct fs_project *p = bpf_map_lookup_elem(&fs_projects, &id);
			if (!p) {
				a->result = 0;
				return 0;
			}
			__sync_fetch_and_add(&p->in_use, delta);
		}
		if (n)
			__sync_fetch_and_add(&n->in_use, delta);
		a->result = 1;
	}
	return 0;
}
