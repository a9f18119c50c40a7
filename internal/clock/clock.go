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

// Nanos reads a Clock as nanoseconds for a ledger that stores int64
// times: the Unix time of the first reading plus the time elapsed since,
// measured with the readings' monotonic clock where they carry one (the
// system clock's do, see the time package). A step of the wall clock (NTP
// at boot, an operator's date -s, a VM resumed) then moves no interval:
// read as UnixNano, a step back of an hour stalled every refill and kept
// every project active for that hour. A clock without monotonic readings
// (a test's) reads as UnixNano.
type Nanos struct {
	c    Clock
	base time.Time
	off  int64
}

// NewNanos starts reading c (nil: the system clock) from now.
func NewNanos(c Clock) Nanos {
	c = Or(c)
	base := c.Now()
	return Nanos{c: c, base: base, off: base.UnixNano()}
}

// Now reads the clock.
func (n Nanos) Now() int64 { return n.Of(n.c.Now()) }

// Of converts t, a reading of the same clock.
func (n Nanos) Of(t time.Time) int64 { return n.off + int64(t.Sub(n.base)) }
