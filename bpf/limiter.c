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
 *   tp_btf/tcp_send_reset              undoes the reservation of a packet the
 *                                      kernel answers with an RST: a non-SYN
 *                                      segment (sk_lookup cannot see flags),
 *                                      a SYN no listener took, a bad SYN that
 *                                      kills its request socket
 *   tp_btf/kfree_skb                   undoes the reservation of a request
 *                                      socket the client reset (runs for
 *                                      every dropped packet; looks at RSTs
 *                                      dropped by a project's listener only)
 *   cgroup/sock_release                release when the fd is closed before
 *                                      the socket reaches TCP_CLOSE
 *   iter/tcp                           adoption of sockets that predate the
 *                                      programs, and the reconcile dump
 *   syscall                            atomic adjustments from user space
 *                                      (expired reservations, drift repair),
 *                                      and single steps of the slot and port
 *                                      protocols for the tests (fs_selftest)
 *
 * A held permit is an entry keyed by the socket cookie (a slot of fs_slots,
 * or fs_held when the slot is taken). Every release path clears the entry
 * and only the caller whose compare-and-swap or delete succeeded gives the
 * permit back, so a socket releases exactly once however many of
 * the paths fire (an orderly close runs sock_release and then TCP_CLOSE).
 *
 * A permit taken at a SYN is a reservation until the child socket exists. It
 * exists only while the handshake can still become an accepted connection,
 * that is while the kernel keeps a request socket for it: sk_lookup looks at
 * the listener's queues (through the socket itself, see fs_port) and takes
 * none for a SYN the kernel will drop (the accept queue is full) or answer
 * with a SYN cookie (no request socket; the cookie's ACK is admitted by the
 * rule without a reservation and the child takes its permit when it is
 * established). A reservation is kept keyed by its 4-tuple (a slot of
 * fs_resv_slots, or fs_reservations) and ended exactly once by the
 * conversion at ESTABLISHED, the undo when the kernel resets the handshake
 * (tcp_send_reset, kfree_skb) or the expiry after the reservation TTL (a
 * client that vanished without a word, a request socket the kernel timed
 * out, or a SYN dropped by a race with the queue check).
 *
 * Memory order: fs_port's owner needs none: its words carry a check word
 * and name a socket that is checked in turn (see fs_port), so it is read
 * right on any architecture. The slot protocols (fs_slots, fs_resv_slots)
 * do rely on x86: a slot's fields are published by a plain store of its tag
 * after them and read with plain loads after it, which x86 keeps in order
 * (stores after stores, loads after loads). The object is built for x86
 * alone (gen.go), which loader.TestObjectIsX86Only checks: another target
 * needs release stores and acquire loads there first.
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

/*
 * A kernel pointer read as a number (fs_port's owner) made into a typed,
 * read-only pointer: loads through it are checked by the kernel and read 0
 * from an address that is not mapped, and the kfunc costs nothing (the
 * verifier replaces the call by a move).
 */
extern void *bpf_rdonly_cast(const void *obj, __u32 btf_id) __ksym;
#define CAST(type, p) ((type *)bpf_rdonly_cast((const void *)(p), bpf_core_type_id_kernel(type)))

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
	__u64 overflow;       /* SYNs (and cookie ACKs) to a full accept queue: passed unreserved, the kernel drops them */
	__u64 cookie;         /* SYNs and cookie ACKs admitted without a reservation (SYN cookies) */
	__u64 dropped;        /* reservations undone because the kernel reset the handshake */
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

/* Which SYNs a listening address takes: IPv4, IPv6 or both. */
#define SCOPE_V4 1
#define SCOPE_V6 2

/*
 * A listening address. addr is IPv6 or v4-mapped, all zero for a wildcard.
 * scope keeps apart the wildcards that take different families: 0.0.0.0
 * (SCOPE_V4), [::] with IPV6_V6ONLY (SCOPE_V6) and a dual-stack [::] (both);
 * for a specific address it is the address's own family.
 */
struct fs_listen_key {
	__u64 netns;
	__u32 port;  /* host order */
	__u32 scope; /* SCOPE_V4 | SCOPE_V6 */
	__u8 addr[16];
};

/*
 * Several sockets may listen on one address (SO_REUSEPORT): refs counts them,
 * and the entry goes when the last one closes. project, cgroup, sk and cookie
 * are the latest listener's.
 */
struct fs_listener {
	__u64 project;
	__u64 cgroup; /* the listener's own cgroup (exemption of nested cgroups) */
	__u64 sk;     /* the listener's struct sock (a kernel address, see fs_port) */
	__u64 cookie; /* its socket cookie, which authenticates sk */
	__u32 refs;   /* listening sockets on this address counted here */
	__u32 _pad;
};

/*
 * A handshake in flight, admitted at the SYN, keyed by its 4-tuple (36
 * bytes: kept in a 64-byte slot with its reservation).
 */
struct fs_resv_key {
	__u8 laddr[16];
	__u8 raddr[16];
	__u16 lport; /* host order */
	__u16 rport; /* host order */
};

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
 * verifier; the hash lookups behind it are not.
 *
 * A port with one listening address (the usual case) also names its
 * listening socket, the owner, so that sk_lookup finds it without the
 * fs_listeners lookup and reads the listener's queues, address and
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
struct fs_port {
	/* specific, wildcard and version are one 64-bit word (port_state),
	 * changed with one fetch-add: whoever changes the port's addresses
	 * learns their counts and the version the change made, atomically.
	 * The counts are one number in effect: a decrement that comes before
	 * its increment borrows from the next field and the increment gives
	 * it back, so a count never gets stuck (it only looks odd, and the
	 * port not owned, in between). */
	__u16 specific; /* addresses of the port's listeners that are one address */
	__u16 wildcard; /* addresses that are 0.0.0.0 or :: */
	__u32 version;  /* bumped by every change of the addresses or of their owner */
	__u64 sk;       /* the owner: struct sock of the port's only listening address, or 0 */
	__u64 cookie;   /* the owner's socket cookie */
	__u64 project;  /* its project */
	__u64 cgroup;   /* its own cgroup */
	__u64 check;    /* owner_check of the four above */
	__u64 _pad;     /* a cache line per port */
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536); /* one slot per TCP port */
	__type(key, __u32);
	__type(value, struct fs_port);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_ports SEC(".maps");

/*
 * Reservations, by 4-tuple, in two tables as held permits are. fs_resv_slots
 * is a small array indexed by a hash of the tuple; a slot is claimed and
 * freed with a compare-and-swap of its tag (the hash, never 0; SLOT_BUSY
 * while it is being filled). fs_reservations is the spill table for a tuple
 * whose slot another handshake holds, looked at only while node spilled says
 * it has entries. Handshakes in flight are few (a reservation lives one round
 * trip), so 256 slots of 64 bytes, 16 KiB in all, stay in the cache and in a
 * page the TLB keeps: measured here (bpf_stats, loopback connect loop), a
 * slot in a table sized from POOL, a cold line per SYN, cost sk_lookup ~190
 * of its ~260 ns above the empty program's. A SYN flood spills into the hash
 * table and pays a cold line there.
 */
#define RESV_SLOTS 256 /* 2^8: the top 8 bits of resv_hash pick the slot */

struct fs_resv_slot {
	__u64 tag;
	struct fs_resv_key key;
	__u32 kind;
	__u64 project;
	__u64 since_ns;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, RESV_SLOTS);
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

static __always_inline struct fs_settings *settings(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&fs_config, &zero);
}

/*
 * publish stores a slot's tag after its fields. On x86 a store is never
 * made visible before an earlier one, so a plain store (the compiler kept
 * from moving the field stores after it) publishes them where an atomic
 * exchange cost a locked instruction (see "Memory order" at the top).
 */
static __always_inline void publish(__u64 *tag, __u64 v)
{
	asm volatile("" ::: "memory");
	*(volatile __u64 *)tag = v;
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
		publish(&s->cookie, cookie);
		return 0;
	}
	if ((s->cookie & ~SLOT_BUSY) == cookie)
		return -EEXIST;
	struct fs_pool *n = node();
	if (!n)
		return -1;
	/* Counted before the insert, so that a reader who finds the count at
	 * zero cannot miss an entry already in. Two holds of one cookie never
	 * race (the socket's lock serialises connect(), the child is
	 * established once), so the slot and the spill table cannot both take
	 * it as fs_resv_slots could (see resv_put). */
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
 * resv_hash places a tuple: its words folded with exclusive-or, the ports
 * shifted where they do not meet the addresses' v4-mapped prefix, times an
 * odd constant; the slot is taken from the top bits, which every bit of the
 * fold reaches. The table is small and every slot of it warm, so spreading
 * matters more than mixing: one multiplication, where a chain of five took
 * ~15 ns of sk_lookup and as much of the conversion at ESTABLISHED. Tuples
 * that fold alike share a slot and the later ones spill; the full key is
 * compared either way.
 */
static __always_inline __u64 resv_hash(const struct fs_resv_key *k)
{
	const __u64 *w = (const __u64 *)k;
	__u64 f = w[0] ^ w[1] ^ w[2] ^ w[3] ^ ((__u64)k->lport << 16 | (__u64)k->rport << 40);
	return f * 0x9e3779b97f4a7c15ULL;
}

/* resv_tagof is a slot's tag for hash h: nonzero, without SLOT_BUSY. */
static __always_inline __u64 resv_tagof(__u64 h)
{
	return (h | 1) & ~SLOT_BUSY;
}

static __always_inline struct fs_resv_slot *resv_slot(__u64 h)
{
	__u32 i = h >> 56; /* the top 8 bits: RESV_SLOTS */
	return bpf_map_lookup_elem(&fs_resv_slots, &i);
}

static __always_inline bool resv_key_eq(const struct fs_resv_key *a, const struct fs_resv_key *b)
{
	const __u64 *x = (const __u64 *)a, *y = (const __u64 *)b;
	const __u32 *xp = (const __u32 *)&a->lport, *yp = (const __u32 *)&b->lport;
	return x[0] == y[0] && x[1] == y[1] && x[2] == y[2] && x[3] == y[3] && *xp == *yp;
}

static __always_inline void resv_key_copy(struct fs_resv_key *dst, const struct fs_resv_key *src)
{
	__u64 *d = (__u64 *)dst;
	const __u64 *s = (const __u64 *)src;
	d[0] = s[0];
	d[1] = s[1];
	d[2] = s[2];
	d[3] = s[3];
	*(__u32 *)&dst->lport = *(const __u32 *)&src->lport;
}

/* resv_find returns whether k holds a reservation. */
static __always_inline bool resv_find(struct fs_resv_key *k)
{
	__u64 h = resv_hash(k);
	struct fs_resv_slot *s = resv_slot(h);
	if (s && s->tag == resv_tagof(h) && resv_key_eq(&s->key, k))
		return true;
	if (spill_empty())
		return false;
	return bpf_map_lookup_elem(&fs_reservations, k) != NULL;
}

/*
 * resv_slot_put is the first half of resv_put: claim k's slot if it is free.
 * 0 done, -EEXIST k has a reservation (in the slot, or in the spill table
 * from before the slot was freed), 1 the slot holds another tuple: spill.
 */
static __always_inline long resv_slot_put(struct fs_resv_slot *s, __u64 tag, struct fs_resv_key *k, struct fs_resv *r)
{
	if (__sync_val_compare_and_swap(&s->tag, 0, tag | SLOT_BUSY) == 0) {
		/* After the claim (a full barrier): a spill insert of k that
		 * this lookup misses sees the claim in resv_spill_put and backs
		 * off. */
		if (!spill_empty() && bpf_map_lookup_elem(&fs_reservations, k)) {
			__sync_lock_test_and_set(&s->tag, 0);
			return -EEXIST;
		}
		resv_key_copy(&s->key, k);
		s->kind = r->kind;
		s->project = r->project;
		s->since_ns = r->since_ns;
		publish(&s->tag, tag);
		return 0;
	}
	__u64 cur = s->tag;
	if (cur == (tag | SLOT_BUSY) || (cur == tag && resv_key_eq(&s->key, k)))
		return -EEXIST;
	return 1;
}

/*
 * resv_spill_put is the second half of resv_put: k's slot held another tuple
 * when resv_slot_put looked, so k goes to the spill table. The slot may have
 * been freed since and claimed for k by another CPU (a retransmitted or
 * duplicated SYN) whose look into the spill table came before this insert:
 * k would then be reserved twice, two permits for one handshake. So the slot
 * is read again after the insert, with a compare-and-swap that changes
 * nothing but orders the read after it, and if it is being filled with k's
 * tag or holds k, this insert backs off. (Both may back off; k then goes
 * unreserved and its child is admitted when it is established.)
 */
static __always_inline long resv_spill_put(struct fs_resv_slot *s, __u64 tag, struct fs_resv_key *k, struct fs_resv *r)
{
	struct fs_pool *n = node();
	if (!n)
		return -1;
	/* Counted before the insert, so that a reader who finds the count at
	 * zero cannot miss an entry already in. */
	__sync_fetch_and_add(&n->spilled, 1);
	long err = bpf_map_update_elem(&fs_reservations, k, r, BPF_NOEXIST);
	if (err) {
		__sync_fetch_and_add(&n->spilled, -1);
		return err;
	}
	__u64 cur = __sync_val_compare_and_swap(&s->tag, 0, 0);
	if (cur != (tag | SLOT_BUSY) && !(cur == tag && resv_key_eq(&s->key, k)))
		return 0;
	if (bpf_map_delete_elem(&fs_reservations, k))
		return 0; /* already ended (converted, undone or expired): it was used */
	__sync_fetch_and_add(&n->spilled, -1);
	return -EEXIST;
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
	long err = resv_slot_put(s, tag, k, r);
	if (err <= 0)
		return err;
	return resv_spill_put(s, tag, k, r);
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
		if (since && s->since_ns != since)
			return false;
		*id = s->project;
		*kind = s->kind;
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
 * it to the node's active count. It stamps only asks made while holding
 * nothing. The stamp is swapped in with a
 * compare-and-swap, so of several CPUs asking for the same newcomer at once
 * only one counts it. A project Tick already counted and that ages out
 * before the next Tick is counted twice until then: the error only shrinks
 * the share, the safe direction. A stamp ahead of now (the coarse clock lags
 * the precise one by up to a tick) is recent, not a window old.
 */
static __always_inline void seen(struct fs_settings *cfg, struct fs_pool *n, struct fs_project *p, bool fine)
{
	/* A project that holds permits is active whatever its stamp, and the
	 * release of its last one stamps it (release): no clock read, no
	 * store, on the common path. */
	if (*(volatile __s64 *)&p->in_use > 0)
		return;
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

/*
 * under_share says whether a project holding held permits holds less than
 * its share, max(FLOOR, POOL / active) (POOL while at most one project is
 * active). held < POOL / active (integer division) is (held + 1) * active <=
 * POOL: a multiplication where the division took some 40 cycles.
 */
static __always_inline bool under_share(struct fs_settings *cfg, struct fs_pool *n, __s64 held)
{
	__s64 active = n->active;
	__s64 pool = cfg->pool;
	if (held < (__s64)cfg->floor)
		return true;
	if (active <= 1)
		return held < pool;
	return (held + 1) * active <= pool;
}

#define ADMIT_HELD 2 /* refused, but the socket already holds a permit */
#define ADMIT_TRIES 8 /* compare-and-swap attempts on the node counter */

/* limit_for is the in_use the rule lets project p take a permit under. */
static __always_inline __s64 limit_for(struct fs_settings *cfg, struct fs_pool *n, struct fs_project *p)
{
	if (under_share(cfg, n, *(volatile __s64 *)&p->in_use))
		return cfg->pool;
	return cfg->floor < cfg->pool ? cfg->pool - cfg->floor : 0;
}

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
	struct fs_settings *cfg = settings();
	struct fs_pool *n = node();
	if (!cfg || !n)
		return -1;
	if (!p) {
		COUNT(map_full);
		return -1;
	}
	seen(cfg, n, p, fine);

	__s64 lim = limit_for(cfg, n, p);
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

/*
 * would_admit applies the rule without taking a permit: for a SYN the kernel
 * will answer with a SYN cookie (no request socket, nothing to reserve for)
 * and a cookie's ACK, whose child takes its permit when it is established.
 */
static __always_inline int would_admit(struct fs_project *p, bool fine)
{
	struct fs_settings *cfg = settings();
	struct fs_pool *n = node();
	if (!cfg || !n || !p)
		return -1;
	seen(cfg, n, p, fine);
	if (*(volatile __s64 *)&n->in_use < limit_for(cfg, n, p))
		return 1;
	__sync_fetch_and_add(&p->refused, 1);
	return 0;
}

static __always_inline void release(__u64 id, bool fine)
{
	struct fs_pool *n = node();
	struct fs_project *p = bpf_map_lookup_elem(&fs_projects, &id);
	if (n)
		__sync_fetch_and_add(&n->in_use, -1);
	/* Holding counts as asking: the project stays active a window after
	 * it lets go of its last permit. */
	if (p && __sync_fetch_and_add(&p->in_use, -1) <= 1)
		p->last_seen_ns = now_ns(fine);
	COUNT(released);
}

/* force takes a permit without the rule: the connection already exists. */
static __always_inline void force(__u64 id, bool fine)
{
	struct fs_settings *cfg = settings();
	struct fs_pool *n = node();
	struct fs_project *p = project_get(id);
	if (!n)
		return;
	if (p && cfg)
		seen(cfg, n, p, fine);
	__sync_fetch_and_add(&n->in_use, 1);
	if (p)
		__sync_fetch_and_add(&p->in_use, 1);
}

/* exempt_listed says whether cgroup cg or project id is in the exempt set. */
static __always_inline bool exempt_listed(__u64 cg, __u64 id)
{
	return bpf_map_lookup_elem(&fs_exempt, &id) || (cg != id && bpf_map_lookup_elem(&fs_exempt, &cg));
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
	struct fs_settings *cfg = settings();
	struct fs_pool *n = node();
	/* exempt_max is 0 while the set is empty: no lookup on the common path. */
	if (!cfg || !n || !cfg->exempt_max)
		return false;
	if (task)
		cg = bpf_get_current_cgroup_id();
	if (!exempt_listed(cg, id))
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
	struct fs_pool *n = node();
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

/*
 * cgroup_ancestor is cg->ancestors[level] (level <= cg's own). The verifier
 * does not walk a flexible array of pointers, so the entry is read as the
 * first member (->cgroup) of a struct cgroup_subsys_state placed at its
 * address: a plain load the kernel checks, where bpf_probe_read_kernel
 * would be a helper call.
 */
static __always_inline struct cgroup *cgroup_ancestor(struct cgroup *cg, __u32 level)
{
	__u64 at = (__u64)cg + bpf_core_field_offset(struct cgroup, ancestors) + 8 * (level & 0xff);
	return CAST(struct cgroup_subsys_state, at)->cgroup;
}

/*
 * cgroup_project is the project of a cgroup, 0 if it is not below the root.
 * The loads go straight through the kernel's pointers (a tracing program's
 * or one made by CAST), no helper calls.
 */
static __always_inline __u64 cgroup_project(struct cgroup *cg)
{
	if (!cg)
		return 0;
	int level = cg->level;
	if (level <= (int)root_level || level > 255)
		return 0;
	struct cgroup *anc = cgroup_ancestor(cg, root_level);
	if (!anc || anc->kn->id != root_cgroup_id)
		return 0;
	anc = cgroup_ancestor(cg, root_level + 1);
	return anc ? anc->kn->id : 0;
}

/* cgroup_id is the id of cgroup cg (a kernel pointer), 0 for none. */
static __always_inline __u64 cgroup_id(struct cgroup *cg)
{
	return cg ? cg->kn->id : 0;
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
	/* The netns cookie read from the socket: two loads where the helper
	 * is a call. */
	struct bpf_sock *bs = ctx->sk;
	__u64 netns = bs ? CAST(struct sock, bs)->__sk_common.skc_net.net->net_cookie : 0;
	struct fs_sock v = {.project = id, .netns = netns, .kind = kind};
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
	/* A socket that holds a permit has a cookie already: read it rather
	 * than have the helper generate one for every other socket. */
	__u64 cookie = CAST(struct sock, ctx)->__sk_common.skc_cookie.counter;
	if (cookie)
		release_cookie(cookie, CLK_COARSE);
	return 1;
}

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

/* sock_local fills the local address in normalised form (v4-mapped). */
static __always_inline void sock_local(struct sock *sk, __u8 *addr)
{
	if (sk->__sk_common.skc_family == AF_INET)
		v4mapped(addr, sk->__sk_common.skc_rcv_saddr);
	else
		in6_load(addr, &sk->__sk_common.skc_v6_rcv_saddr);
}

static __always_inline void sock_remote(struct sock *sk, __u8 *addr)
{
	if (sk->__sk_common.skc_family == AF_INET)
		v4mapped(addr, sk->__sk_common.skc_daddr);
	else
		in6_load(addr, &sk->__sk_common.skc_v6_daddr);
}

static __always_inline __u64 sock_netns(struct sock *sk)
{
	return sk->__sk_common.skc_net.net->net_cookie;
}

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
 * (see unlisten), it is put back.
 */
static __noinline void on_listen(struct sock *sk)
{
	struct cgroup *cg = sk->sk_cgrp_data.cgroup;
	__u64 id = cgroup_project(cg);
	if (!id)
		return;
	struct fs_listen_key k = {};
	k.netns = sock_netns(sk);
	k.port = sk->__sk_common.skc_num;
	k.scope = listen_addr(sk, k.addr);
	__u64 cookie = bpf_get_socket_cookie(sk);
	struct fs_listener nl = {.project = id, .cgroup = cgroup_id(cg), .sk = (__u64)sk, .cookie = cookie, .refs = 1};
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
 * socket (NULL when it cannot be checked: its queues are then unknown).
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
	__u8 addr[16] __attribute__((aligned(8)));
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
 * on_established converts the reservation made at the SYN into the child's
 * permit. Without a reservation (a SYN cookie's child, one whose reservation
 * expired, a SYN before the programs, another netns) the rule is applied now
 * to the project of the child's cgroup (the listener's); a refusal here
 * cannot stop the connection, so it is left unheld and counted as
 * unaccounted.
 */
static __noinline void on_established(struct sock *sk)
{
	if (!listened(sk->__sk_common.skc_num))
		return;
	struct fs_resv_key rk __attribute__((aligned(8))) = {};
	sock_local(sk, rk.laddr);
	sock_remote(sk, rk.raddr);
	rk.lport = sk->__sk_common.skc_num;
	rk.rport = bpf_ntohs(sk->__sk_common.skc_dport);

	__u64 id = 0;
	__u32 kind = KIND_IN;
	if (!resv_take(&rk, &id, &kind, false, 0)) {
		struct cgroup *cg = sk->sk_cgrp_data.cgroup;
		id = cgroup_project(cg);
		if (!id)
			return;
		if (exempt_take(false, cgroup_id(cg), id)) {
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

/*
 * on_close releases the permit a closing socket holds, if any, and uncounts
 * it if it was a listener. Not filtered by port: by now a listener bound to
 * port 0 has given its port back (skc_num is 0). Listeners close rarely;
 * unlisten finds the address by the socket's cookie.
 */
static __noinline void on_close(__u64 cookie, bool listener)
{
	release_cookie(cookie, CLK_FINE);
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

#define TH_RST 0x04
#define TH_SYN 0x02

/* undo gives back the reservation of k, if it has one. */
static __always_inline bool undo(struct fs_resv_key *k)
{
	__u64 id = 0;
	__u32 kind = 0;
	if (!resv_take(k, &id, &kind, false, 0))
		return false;
	give_back(id, kind, CLK_FINE);
	return true;
}

/*
 * The kernel answers with an RST a segment it will not take: a non-SYN
 * segment that reached a listener (sk_lookup cannot see TCP flags, so one
 * racing the child's creation, or a late FIN or ACK, reserves too), a SYN no
 * listener took (sk is NULL: the port's owner outlived its listener, which
 * was unhashed before its close reached us), and a SYN of the tuple of a
 * request socket that it resets and drops. Whatever the packet reserved is
 * given back here rather than after the TTL.
 */
SEC("tp_btf/tcp_send_reset")
int BPF_PROG(fs_send_reset, const struct sock *sk, const struct sk_buff *skb, int reason)
{
	if (!skb || (sk && sk->__sk_common.skc_state != TCP_LISTEN))
		return 0;
	struct fs_resv_key rk __attribute__((aligned(8))) = {};
	__u8 flags = 0;
	if (skb_tuple(skb, &rk, &flags) || !listened(rk.lport) || !undo(&rk))
		return 0;
	if (flags & TH_SYN)
		COUNT(dropped);
	else
		COUNT(stray);
	return 0;
}

/*
 * A client that gives up on its handshake (its connect() timed out, it was
 * killed) answers the SYN-ACK with an RST, and the kernel drops the request
 * socket with that RST, which is then freed as a drop (reason
 * NOT_SPECIFIED, the listener as rx_sk). An RST that reaches a listener
 * without a request socket is dropped with TCP_RESET. Either way the
 * handshake is over: its reservation goes back now. This program runs for
 * every dropped packet of the host, so its first tests are on the
 * arguments, then on the socket the packet reached.
 */
SEC("tp_btf/kfree_skb")
int BPF_PROG(fs_drop, struct sk_buff *skb, void *location, enum skb_drop_reason reason, struct sock *rx_sk)
{
	if (!rx_sk || (reason != bpf_core_enum_value(enum skb_drop_reason, SKB_DROP_REASON_NOT_SPECIFIED) &&
		       reason != bpf_core_enum_value(enum skb_drop_reason, SKB_DROP_REASON_TCP_RESET)))
		return 0;
	if (rx_sk->__sk_common.skc_state != TCP_LISTEN || rx_sk->sk_protocol != IPPROTO_TCP ||
	    !listened(rx_sk->__sk_common.skc_num))
		return 0;
	struct fs_resv_key rk __attribute__((aligned(8))) = {};
	__u8 flags = 0;
	if (skb_tuple(skb, &rk, &flags) || !(flags & TH_RST))
		return 0;
	if (undo(&rk))
		COUNT(dropped);
	return 0;
}

/*
 * accept_state says what the kernel will do with a SYN that reaches
 * listener sk, as tcp_conn_request decides: drop it (the accept queue is
 * full, or the SYN queue is and cookies are off), answer it with a SYN
 * cookie and keep no request socket (the SYN queue is full, or cookies are
 * always on), or queue a request socket. A race with another CPU filling or
 * draining a queue between here and there is possible: a SYN reserved for
 * and then dropped keeps its reservation until the TTL, one admitted here
 * without a reservation is admitted again when its child is established.
 */
#define SYN_QUEUED 0
#define SYN_DROPPED 1
#define SYN_COOKIE 2

static __always_inline int accept_state(struct sock *sk)
{
	__u32 max = sk->sk_max_ack_backlog;
	if (sk->sk_ack_backlog > max)
		return SYN_DROPPED;
	struct inet_connection_sock *icsk = CAST(struct inet_connection_sock, sk);
	__u32 qlen = icsk->icsk_accept_queue.qlen.counter;
	__u8 cookies = sk->__sk_common.skc_net.net->ipv4.sysctl_tcp_syncookies;
	if (cookies == 2)
		return SYN_COOKIE;
	if (qlen > max)
		return cookies ? SYN_COOKIE : SYN_DROPPED;
	if (!cookies) {
		/* Without cookies the kernel also drops SYNs of unproven peers
		 * once the queue is three quarters of tcp_max_syn_backlog. */
		__s32 msb = sk->__sk_common.skc_net.net->ipv4.sysctl_max_syn_backlog;
		if (msb - (__s32)qlen < (msb >> 2))
			return SYN_DROPPED;
	}
	return SYN_QUEUED;
}

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

	struct fs_resv_key rk __attribute__((aligned(8))) = {};
	/* The verifier takes only loads at a constant offset from the
	 * context itself: keep the compiler from computing a field's address
	 * ahead (barrier_var), as it otherwise may. */
	barrier_var(ctx);
	__u16 fam = ctx->family;
	barrier_var(ctx);
	rk.rport = bpf_ntohs(ctx->remote_port);
	if (fam == AF_INET) {
		barrier_var(ctx);
		v4mapped(rk.laddr, ctx->local_ip4);
		barrier_var(ctx);
		v4mapped(rk.raddr, ctx->remote_ip4);
	} else {
		/* The context allows only aligned 4-byte loads of these. */
		__u32 *la = (__u32 *)rk.laddr, *ra = (__u32 *)rk.raddr;
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
	rk.lport = lport;

	struct lview v = {};
	int own = port_owner(port, w, cfg->netns_cookie, fam, rk.laddr, &v);
	if (own == OWNER_OTHER)
		return SK_PASS;
	if (own == OWNER_UNKNOWN) {
		struct fs_listen_key lk = {};
		lk.netns = cfg->netns_cookie;
		lk.port = lport;
		lk.scope = fam == AF_INET ? SCOPE_V4 : SCOPE_V6;
		__builtin_memcpy(lk.addr, rk.laddr, 16);
		struct fs_listener *l = find_listener(port, &lk);
		if (!l)
			return SK_PASS;
		v.project = l->project;
		v.cgroup = l->cgroup;
		v.sk = listening_sock(l->sk, l->cookie);
		/* The address's only listener no longer listens (its close is on
		 * its way, or was missed): nobody will take the SYN. With
		 * SO_REUSEPORT the entry names the latest listener only, and the
		 * others may still listen. */
		if (!v.sk && l->refs <= 1)
			return SK_PASS;
	}

	int syn = v.sk ? accept_state(v.sk) : SYN_QUEUED;
	if (syn == SYN_DROPPED) {
		/* Nothing will become of it: no permit, no refusal. */
		COUNT(overflow);
		return SK_PASS;
	}
	__u32 kind = KIND_IN;
	int a = 1;
	if (syn == SYN_COOKIE) {
		/* No request socket to hold a reservation: check the rule, and
		 * let the child take its permit when it is established. */
		if (!(cfg->exempt_max && exempt_listed(v.cgroup, v.project)))
			a = would_admit(project_get(v.project), CLK_COARSE);
		if (a < 0)
			return SK_PASS;
		if (a == 0) {
			COUNT(refused_in);
			return SK_DROP;
		}
		COUNT(cookie);
		return SK_PASS;
	}
	if (exempt_take(false, v.cgroup, v.project))
		kind = KIND_EXEMPT_IN;
	else
		a = admit(project_get(v.project), 0, CLK_COARSE);
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
	struct fs_resv r = {.project = v.project, .since_ns = now_ns(CLK_COARSE), .kind = kind};
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
			release(v.project, CLK_COARSE);
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
	struct cgroup *cg = sk->sk_cgrp_data.cgroup;
	__u64 id = cgroup_project(cg);
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
		bool ex = !held_find(rec.cookie, true) && exempt_take(false, cgroup_id(cg), id);
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
		struct fs_resv_key k __attribute__((aligned(8))) = {};
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
		struct fs_pool *n = node();
		a->result = 0;
		if (n) {
			__sync_fetch_and_add(a->op == OP_ACTIVE ? &n->active : &n->exempt_in_use, a->delta);
			a->result = 1;
		}
		return 0;
	}
	if (a->op == OP_ADD) {
		/* project 0 adjusts the node only (permits of vanished projects). */
		__u64 id = a->project;
		__s64 delta = a->delta;
		struct fs_pool *n = node();
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

/*
 * fs_selftest runs one step of a protocol on its own, so that a test can
 * interleave steps as two CPUs could and check the outcome. Never attached;
 * only the loader's tests run it.
 */
enum selftest_op {
	ST_RESV_SPILL = 1, /* resv_spill_put of key with resv (as if its slot had been held by another tuple) */
	ST_PORT_CHANGE = 2, /* port_change(lkey, delta) */
};

struct fs_selftest_args {
	__u32 op;
	__s32 delta;
	__s64 result;
	struct fs_resv resv;
	struct fs_resv_key key;
	struct fs_listen_key lkey;
};

SEC("syscall")
int fs_selftest(struct fs_selftest_args *a)
{
	if (a->op == ST_RESV_SPILL) {
		struct fs_resv_key k __attribute__((aligned(8))) = {};
		__builtin_memcpy(&k, &a->key, sizeof(k));
		struct fs_resv r = a->resv;
		__u64 h = resv_hash(&k);
		struct fs_resv_slot *s = resv_slot(h);
		a->result = s ? resv_spill_put(s, resv_tagof(h), &k, &r) : -1;
		return 0;
	}
	if (a->op == ST_PORT_CHANGE) {
		struct fs_listen_key k = {};
		__builtin_memcpy(&k, &a->lkey, sizeof(k));
		port_change(&k, a->delta);
		a->result = 0;
	}
	return 0;
}
