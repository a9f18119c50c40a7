// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"sync"
	"time"
)

// fakeClock is a settable clock for timelines.
type fakeClock struct {
	mu sync.Mutex // guards the fields below
	t  time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{t: time.Unix(1_000_000, 0)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}
