// SPDX-License-Identifier: Apache-2.0

package scheduler

import "unsafe"

// prefetch asks the CPU to start loading the cache line at addr and returns
// at once; it never faults, whatever addr is. Go has no portable way to say
// this, so it is one instruction of assembly (prefetch_amd64.s).
//
//go:noescape
func prefetch(addr unsafe.Pointer)
