// SPDX-License-Identifier: Apache-2.0

package pools

import "github.com/fairshare-dev/fairshare/internal/testutil"

// fakeClock is a settable clock for timelines.
type fakeClock = testutil.FakeClock

func newFakeClock() *fakeClock { return testutil.NewFakeClock() }
