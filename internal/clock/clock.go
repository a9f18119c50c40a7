// SPDX-License-Identifier: Apache-2.0

package clock

import "time"

// Clock is a source of time.
type Clock interface{ Now() time.Time }

// System is the system clock.
type System struct{}

// Now returns time.Now().
func (System) Now() time.Time { return time.Now() }

// Or returns c, or the system clock when c is nil. Constructors call it on
// the clock they are given.
func Or(c Clock) Clock {
	if c == nil {
		return System{}
	}
	return c
}
