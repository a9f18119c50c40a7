/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * What every part of the limiter uses: the kernel's types and the libbpf
 * helpers, the constants the kernel's own headers would give (vmlinux.h has
 * no #defines), the read-only cast of a kernel pointer, the clock, and the
 * store that publishes a slot of the slot tables (held.h, resv.h).
 */
#pragma once

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_tracing.h>

#define ECONNREFUSED 111
#define EEXIST 17
#define AF_INET 2
#define AF_INET6 10
#define SOCK_STREAM 1

/*
 * A kernel pointer read as a number (a port's owner, see listen.h) made into
 * a typed, read-only pointer: loads through it are checked by the kernel and
 * read 0 from an address that is not mapped, and the kfunc costs nothing (the
 * verifier replaces the call by a move).
 */
extern void *bpf_rdonly_cast(const void *obj, __u32 btf_id) __ksym;
#define CAST(type, p) ((type *)bpf_rdonly_cast((const void *)(p), bpf_core_type_id_kernel(type)))

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

/*
 * publish stores a slot's tag after its fields. On x86 a store is never
 * made visible before an earlier one, so a plain store (the compiler kept
 * from moving the field stores after it) publishes them where an atomic
 * exchange cost a locked instruction (see "Memory order" in limiter.c).
 */
static __always_inline void publish(__u64 *tag, __u64 v)
{
	asm volatile("" ::: "memory");
	*(volatile __u64 *)tag = v;
}
