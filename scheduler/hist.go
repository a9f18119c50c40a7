// SPDX-License-Identifier: Apache-2.0

package scheduler

import "slices"

// nBounds is the number of finite wait histogram buckets.
const nBounds = 16

// waitBounds returns the wait histogram's upper bounds in seconds: from
// 100µs, below which queueing is noise, to 10s, beyond which a wait is an
// incident. A function, not a var, so no caller can change them.
func waitBounds() [nBounds]float64 {
	return [nBounds]float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}
}

// waitHist records waits in nanoseconds with fixed storage, so observing
// allocates nothing on the dispatch path. The sum is whole seconds and the
// nanoseconds left over: a sum in nanoseconds alone wraps after 292 years of
// summed wait, days for a scheduler with thousands of tasks always queued,
// and the exported sum would go backwards.
type waitHist struct {
	boundsNs [nBounds]int64
	counts   [nBounds + 1]uint64
	count    uint64
	sumSec   uint64
	sumNs    uint64 // below 1e9
}

func newWaitHist() waitHist {
	var h waitHist
	for i, b := range waitBounds() {
		h.boundsNs[i] = int64(b * 1e9)
	}
	return h
}

func (h *waitHist) observe(ns int64) {
	i := 0
	for i < len(h.boundsNs) && ns > h.boundsNs[i] {
		i++
	}
	h.counts[i]++
	h.count++
	n := uint64(max(ns, 0)) + h.sumNs
	h.sumSec += n / 1e9
	h.sumNs = n % 1e9
}

func (h *waitHist) export() Histogram {
	b := waitBounds()
	return Histogram{
		Bounds: b[:],
		Counts: slices.Clone(h.counts[:]),
		Count:  h.count,
		Sum:    float64(h.sumSec) + float64(h.sumNs)/1e9,
	}
}
