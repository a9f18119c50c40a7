/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The types the loader shares: the values of the pinned maps (maps.h) and
 * the contexts of the syscall programs. bpf2go generates their Go twins
 * (gen.go lists them with -type), loader.TestGoCLayoutsAgree compares the
 * two byte for byte, and a pinned map whose value changed layout is refused
 * on reuse (loader.ErrPinnedMismatch): a change here is a change of the
 * pinned format.
 */
#pragma once

#include "common.h"

/* Run-time values, written by the loader (Open, Tick, SetExempt). */
#define DEST_LENS 4 /* prefix lengths in fs_dnets per kind and family: loader.destLens */

struct fs_settings {
	__u32 pool;          /* POOL */
	__u32 floor;         /* FLOOR */
	__u32 exempt_max;    /* exempt budget; 0 while the exempt set is empty */
	__u32 dest_kinds;    /* DEST_PORTS.. of the destination pools (dest.h; none: no lookup) in DEST_KINDS, the generation of their lookup above */
	__u64 window_ns;     /* the active window; 0 leaves active to the control loop */
	/* The destination filter's quick words (dest.h), on this line so
	 * that a connect reads no other before its probe: [0] the ports of
	 * the pools naming one, in four 16-bit lanes; [1] where the pools of
	 * every port are: the /16s of their IPv4 addresses (first two
	 * octets) in three 16-bit lanes, the low six bytes, and the first
	 * bytes of their IPv6 addresses in two 8-bit lanes, the high two. A
	 * word or part with a byte of 0xff (all ones: more values than
	 * lanes) sends the connect to fs_dfilter. */
	__u64 dest_quick[2];
	__u32 caps;          /* CAPS_ON while some pool has fleet caps, CAPS_FLEET while the connections pool is a fleet pool (cap.h); 0: no lookup */
	__u32 layout;        /* what the pinned maps' bytes mean: loader.pinLayout of the daemon that wrote them */
	/* The prefix lengths (bits of the 128-bit address) fs_dnets holds,
	 * plus one, longest first, 0 past the last (dest.h): of the pools
	 * naming a port ([0]) and of every port ([1]), each for an IPv4
	 * (v4-mapped) address ([0]: the lengths of prefixes that can hold
	 * one) and another IPv6 address ([1]). Here, on the line a connect
	 * loads for dest_kinds already. */
	__u8 dest_lens[2][2][DEST_LENS];
};

/* Node-wide permits held. One slot; atomics only. */
struct fs_pool {
	__s64 in_use;
	__s64 exempt_in_use; /* exempt permits held, at most exempt_max (see exempt_take) */
	__s64 spilled;       /* entries of the spill tables fs_held and fs_reservations */
	__s64 active;        /* projects in the active window (bumped here, lowered by Tick) */
};

/*
 * Per project. The event counters are atomics here rather than per-CPU
 * values: the admission already owns this cache line for the in_use
 * compare-and-swap, so a second atomic on it is nearly free, while a per-CPU
 * hash would cost another lookup on every connect.
 */
struct fs_project {
	__s64 in_use;        /* permits held, reservations included */
	__u64 last_seen_ns;  /* CLOCK_MONOTONIC of the last ask */
	__u64 admitted;
	__u64 refused;
};

/* A registered cgroup's entry in fs_members. */
struct fs_member {
	__u32 project; /* compact project id, 1.. */
	__u32 flags;   /* MEMBER_EXEMPT, MEMBER_WEAK (project.h); project 0: no project */
};

/* A project's name in fs_names (internal/project.MaxLen bytes, NUL-padded). */
struct fs_name {
	char name[64];
};

/* Node-wide event counters, per CPU; summed at read time. */
struct fs_counters {
	__u64 admitted_out;
	__u64 admitted_in;
	__u64 refused_out;
	__u64 refused_in;
	__u64 released;
	__u64 adopted;        /* pre-existing sockets counted by iter/tcp */
	__u64 expired;        /* reservations given back past the TTL: their request socket was gone */
	__u64 unaccounted;    /* children admitted late and refused: not held */
	__u64 map_full;       /* a table full: a permit not held (project, held or reservation
			       * table) or a listener not counted (fs_listen_socks, fs_listeners) */
	__u64 exempt_admitted; /* exempt permits taken (either direction) */
	__u64 exempt_over;     /* exempt sockets over the budget: put under the rule */
	__u64 exempt_released;
	__u64 late;           /* children established without a reservation (a SYN cookie's, or one given back) */
};

/* Where a held permit or a reservation came from (loader.isExemptKind). */
enum sock_kind {
	KIND_OUT = 1,
	KIND_IN = 2,
	KIND_ADOPTED = 3,
	/* Exempt permits come from the exempt budget, not from the pool or
	 * the project: releasing one gives it back there. */
	KIND_EXEMPT_OUT = 4,
	KIND_EXEMPT_IN = 5,
	KIND_EXEMPT_ADOPTED = 6,
	/* An outbound permit taken past the rule while it was not enforced
	 * for its project (dry-run, or a lapse: the daemon away): a KIND_OUT
	 * in all but one thing, that a move past the rule never aborts it
	 * (fs_dump), since nothing refused it when it was made. */
	KIND_OUT_LAX = 7,
	/* An outbound permit of an unclassified pod of the host's network
	 * namespace (project.h, WEAK_HOST): taken past the rule if need be,
	 * never refused; a KIND_OUT otherwise (a move past the rule aborts
	 * it). */
	KIND_OUT_HOST = 8,
};

#define KIND_IS_EXEMPT(k) ((k) >= KIND_EXEMPT_OUT && (k) <= KIND_EXEMPT_ADOPTED)

/*
 * A permit held by a socket, keyed by its cookie (held.h). The entry exists
 * exactly while the permit is held: whoever ends it (the first of the
 * release paths) gives the permit back, so it is released exactly once.
 */
struct fs_sock {
	__u64 project;
	__u64 netns;  /* netns cookie: reconcile can only verify its own netns */
	__u32 kind;
	__u32 dest;   /* the destination pool whose permit was taken with this one (dest.h), 0 none */
};

/*
 * A held permit in its slot of fs_slots (index: cookie & slot_mask). cookie
 * 0 is a free slot; SLOT_BUSY | cookie is a slot being filled. The tags of
 * fs_resv_slots use SLOT_BUSY alike (loader.slotBusy).
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
 * for a specific address it is the address's own family. Only listen.h
 * fills one: listen_key_of for a listening socket, syn_key for a SYN.
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
 * Project listening addresses on one local port, and the port's owner: its
 * listening socket while it has one address (listen.h says how the owner is
 * written and checked).
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

/*
 * A handshake in flight: a permit taken when the kernel made its request
 * socket (resv.h), keyed by that socket's cookie, which its child inherits.
 * Cookies are unique on the host and never reused, so the key names one
 * handshake in one network namespace, whatever its 4-tuple.
 */
struct fs_resv_key {
	__u64 cookie;
};

struct fs_resv {
	__u64 project;
	__u64 since_ns;
	__u64 netns; /* netns cookie of the request socket: expiry can check only its own */
	__u32 kind;  /* KIND_IN or KIND_EXEMPT_IN: which budget the permit came from */
	__u32 _pad;
};

/*
 * A reservation in its slot of fs_resv_slots (index: cookie & RESV_SLOTS-1):
 * tag is the request socket's cookie, 0 for a free slot (resv.h).
 */
struct fs_resv_slot {
	__u64 tag;
	struct fs_resv resv;
};

/* Context of fs_adjust, run from user space with BPF_PROG_RUN. */
enum adjust_op {
	OP_EXPIRE = 1, /* end the reservation of key (a request socket's cookie) if it still has since_ns; if we ended it, release */
	OP_ADD = 2,    /* add delta to project and node in_use (drift repair) */
	OP_DROP = 3,   /* release the permit held for socket cookie `project`: the socket is gone */
	OP_ACTIVE = 4, /* add delta to the node's active count (Tick's recount) */
	OP_EXEMPT = 5, /* add delta to the node's exempt_in_use (drift repair) */
	OP_UNLISTEN = 6, /* uncount the listener counted under socket cookie `project`: it is gone */
	OP_MEMBER_GEN = 7, /* add one to fs_member_gen (fs_members changed); result: the new generation */
	OP_DEST_ACTIVE = 8, /* add delta to destination pool since_ns's active count (Tick's recount) */
	OP_DEST_ADD = 9,    /* add delta to destination pool since_ns's and its project's in_use (drift repair) */
	OP_DEST_CONF = 10,  /* copy destination pool since_ns's settings from fs_dpool_conf to its fs_dest_state */
};

struct fs_adjust_args {
	__u32 op;
	__u32 _pad;
	__u64 project;
	__s64 delta;
	__s64 result;
	/*
	 * OP_EXPIRE: the reservation's since_ns as the caller read it; a
	 * reservation of key (a cookie, never reused) stamped otherwise is
	 * left alone.
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
	__u32 adopted; /* 1 if this dump adopted it, ADOPTED_PAST if past the rule;
			* MOVED or MOVED_PAST if it moved its permit;
			* NOT_ADOPTED if the tables had no room for it */
	__u32 dest;    /* the destination pool of its permit (held, adopted or moved here), 0 none */
	__u32 past;    /* with ADOPTED_PAST or MOVED_PAST: whose rule, PAST_NODE | PAST_DEST */
};

/* fs_sock_record.adopted: adopted while the rule would have refused it. */
#define ADOPTED_PAST 2
/* fs_sock_record.adopted: its permit, held under a weak member's project
 * (unclassified), moved to its cgroup's project now; MOVED_PAST when the
 * rule would have refused that project a permit (the move counts it all
 * the same). */
#define MOVED 3
#define MOVED_PAST 4
/* fs_sock_record.adopted: it holds no permit and could not be adopted, the
 * held-permit table having no room for it (its slot taken by another
 * socket's permit, the spill table full); it counts nowhere until a pass
 * finds room. */
#define NOT_ADOPTED 5
/* fs_sock_record.adopted: MOVED_PAST, and the socket aborted for it
 * (abort_moved_past, limiter.c): it held its permit only for having
 * connected before its pod was classified. */
#define MOVED_ABORTED 6
/* fs_sock_record.past: the pools whose rule it was adopted or moved past:
 * the node's connections pool, the destination pool it holds (dest). */
#define PAST_NODE 1
#define PAST_DEST 2

/* Emits the record's BTF for bpf2go -type; lives in .rodata with the tunables. */
volatile const struct fs_sock_record fs_record_layout;

/* Context of fs_selftest: one step of a protocol, run on its own. */
enum selftest_op {
	ST_PORT_CHANGE = 2, /* port_change(lkey, delta) */
	ST_TAKE = 3,        /* take_permit at delta (AT_SYN: a reservation, AT_CHILD: a held permit, for cookie) of project resv.project, cgroup cg */
};

struct fs_selftest_args {
	__u32 op;
	__s32 delta;
	__s64 result;
	struct fs_resv resv;
	struct fs_listen_key lkey;
	__u64 cookie;
	__u64 cg;
};

/*
 * A destination of a destination pool (dest.h): the key of fs_dests, an LPM
 * trie. The port comes first so that a pool of one port matches on it before
 * the address; a pool of every port is kept under port 0. prefixlen counts
 * the port's 16 bits and the address's (IPv4 as v4-mapped IPv6).
 */
struct fs_dest_key {
	__u32 prefixlen;
	__u8 port[2]; /* network order; 0 0: every port */
	__u8 addr[16];
	__u8 _pad[2];
};

/*
 * A destination held in fs_dnets, an open-addressing table the loader fills
 * (dest.h, dest_net): a prefix of plen bits of the 128-bit address (IPv4
 * v4-mapped), the address masked to them, with one port or every port
 * (port 0 0). pool 0 is a free slot.
 */
struct fs_dest_net {
	__u8 addr[16]; /* masked to plen bits */
	__u8 port[2];  /* network order; 0 0: every port */
	__u8 plen;     /* 0..128 */
	__u8 _pad;
	__u32 pool;
	__u64 _pad2; /* 32 bytes: a slot never straddles two lines (fs_dnets is page-aligned) */
};


/*
 * A destination pool's settings and name, written by the loader alone
 * (SetDestPools), which a restart reads back; the programs read the copy in
 * fs_dest_state.
 */
struct fs_dest_conf {
	__u32 size;  /* its POOL */
	__u32 floor; /* its FLOOR */
	__u64 window_ns;
	__u32 flags;      /* DEST_LIVE, DEST_DRYRUN */
	__u32 fleet_safe; /* a fleet pool's safe slice plus one, 0 for another pool (cap.h) */
	char name[32];
};

/*
 * A destination pool's counts, and the settings the rule reads beside them:
 * one cache line, the only one of the pool a connect loads (fs_dpool_state
 * is mmapable so that its values are page-aligned, and a value never
 * straddles two lines). The counts are changed by atomics only, never by
 * user space; the settings are fs_dpool_conf's, copied here by fs_adjust
 * (OP_DEST_CONF) after the loader writes them there.
 */
struct fs_dest_state {
	__s64 in_use;
	__s64 active;    /* projects in its active window (bumped here, lowered by Tick) */
	__u32 size;      /* fs_dest_conf's */
	__u32 floor;     /* fs_dest_conf's */
	__u64 window_ns; /* fs_dest_conf's */
	__u32 flags;      /* fs_dest_conf's */
	__u32 fleet_safe; /* fs_dest_conf's */
	__u64 refused; /* (admissions are counted per project: fs_dest_projects) */
	__u64 would;   /* refusals dry-run admitted */
	__u64 _pad2;   /* a cache line per pool */
};

/*
 * What the destinations of the pools can match, exactly (dest.h): the ports
 * of the pools that name one (a bit per port, host order), and where the
 * addresses of the pools of every port are: the /16 of a v4-mapped address
 * (a bit per first two octets, the first one high), the first byte of
 * another IPv6 address. Read only where fs_settings.dest_quick, its short
 * form, holds a byte of 0xff (more values than its lanes): a connect whose
 * bits are clear looks nothing up.
 */
struct fs_dest_filter {
	__u64 ports[1024];
	__u64 v4[1024];
	__u64 v6[4];
};
