// SPDX-License-Identifier: Apache-2.0

// Package clock is the one time source interface of the tree. The pure
// packages (pools, scheduler) and the parts that stamp what they report
// (front, loader) take a Clock instead of reading the time themselves, so a
// test can hold time still and move it on (internal/testutil.FakeClock);
// a nil Clock means the system clock, through Or.
package clock
