// SPDX-License-Identifier: Apache-2.0

//go:build !amd64

package scheduler

import "unsafe"

// prefetch is a no-op where no assembly version exists: a hint, never
// needed for correctness.
func prefetch(unsafe.Pointer) {}
