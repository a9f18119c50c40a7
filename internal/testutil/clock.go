// SPDX-License-Identifier: Apache-2.0

package testutil

import (
	"sync"
	"time"
)

// FakeClock is a settable clock: it stands still until the test moves it,
// so timelines are exact. Safe for concurrent use.
type FakeClock struct {
	mu sync.Mutex // guards the fields below
	t  time.Time
}

// NewFakeClock returns a clock reading an arbitrary fixed instant (Unix
// second 1,000,000), far from the zero time that some code treats as unset.
func NewFakeClock() *FakeClock { return &FakeClock{t: time.Unix(1_000_000, 0)} }

// Now reads the clock.
func (c *FakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

// Set moves the clock to t.
func (c *FakeClock) Set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = t
}

// Advance moves the clock on by d.
func (c *FakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}
