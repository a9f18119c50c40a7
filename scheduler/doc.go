// SPDX-License-Identifier: Apache-2.0

// Package scheduler implements the request-class scheduler: one queue per
// participant, P1/P2/P3 credit buckets and a round-robin cursor.
package scheduler
