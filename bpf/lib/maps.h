/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Every map of the limiter. All are pinned by name in the loader's pin
 * directory, so that a restart keeps counting: their sizes and value types
 * (types.h) are the pinned format. The maps sized by the loader say so;
 * their max_entries here is a placeholder.
 */
#pragma once

#include "types.h"

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

/*
 * Projects by compact id (project.h): 1..max_entries-1, 0 is "none". An
 * array, so a project's entry is one inlined load, no hashing; the loader
 * hands ids out and frees them (loader/members.go).
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 16384); /* set at load: Options.MaxProjects */
	__type(key, __u32);
	__type(value, struct fs_project);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_projects SEC(".maps");

/* Membership (project.h): registered cgroup id -> its project. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536); /* set at load: Options.MaxMembers */
	__type(key, __u64);
	__type(value, struct fs_member);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} fs_members SEC(".maps");

/*
 * Project names by id, written by the loader before the id is used: no
 * program reads it. It is pinned with the rest so that a restarted daemon
 * and a read-only status name the projects the maps count.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 16384); /* set at load: as fs_projects */
	__type(key, __u32);
	__type(value, struct fs_name);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_names SEC(".maps");

/*
 * The exempt set (rule.h): cgroup ids whose own sockets, and project ids
 * (EXEMPT_PROJECT | id) whose sockets, take exempt permits instead of pool
 * permits. An operator's
 * short list, not a tenant mechanism.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1); /* set at load: limits.ExemptCap (package loader/limits) */
	__type(key, __u64);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_exempt SEC(".maps");

/* Held permits by socket cookie (held.h): the slots, then the spill table. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1024); /* set at load: 2 x POOL rounded up to a power of two (loader.heldCapacity) */
	__type(key, __u32);
	__type(value, struct fs_slot);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_slots SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024); /* set at load: as fs_slots */
	__type(key, __u64);
	__type(value, struct fs_sock);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_held SEC(".maps");

/* Reservations by request socket cookie (resv.h): the slots, then the spill table. */
#define RESV_SLOTS 256 /* a power of two: the low bits of the cookie pick the slot */

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, RESV_SLOTS);
	__type(key, __u32);
	__type(value, struct fs_resv_slot);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_resv_slots SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024); /* set at load like fs_held: reservations hold permits, so at most POOL plus races */
	__type(key, struct fs_resv_key);
	__type(value, struct fs_resv);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_reservations SEC(".maps");

/* Listening addresses of the projects (listen.h). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384); /* listening addresses of all projects (loader.MaxListeners) */
	__type(key, struct fs_listen_key);
	__type(value, struct fs_listener);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_listeners SEC(".maps");

/*
 * Listening sockets counted in the refs of fs_listeners, by cookie (the value
 * is the address they are counted under).
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384); /* as fs_listeners */
	__type(key, __u64);
	__type(value, struct fs_listen_key);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_listen_socks SEC(".maps");

/* Project listening addresses per local port, and the port's owner. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536); /* one slot per TCP port */
	__type(key, __u32);
	__type(value, struct fs_port);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} fs_ports SEC(".maps");

static __always_inline struct fs_settings *settings(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&fs_config, &zero);
}

static __always_inline struct fs_pool *node(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&fs_node, &zero);
}

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
