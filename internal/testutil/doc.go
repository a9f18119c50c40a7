// SPDX-License-Identifier: Apache-2.0

// Package testutil holds what the tests of several packages need alike: a
// root check, the cgroup2 mount, temporary cgroups that are removed even when
// a test fails, helper processes started inside a cgroup, and a settable clock.
//
// Only _test.go files import it; it imports "testing", which production
// packages should not pull in.
package testutil
