// SPDX-License-Identifier: Apache-2.0

package compare

import (
	"fmt"
	"math/rand/v2"
	"time"
)

// Episode is one stretch of a project's life: Writers closed-loop writers
// from Start to End (offsets from the run's start), each request holding
// its seat for Service (0: the run's Options.Service).
type Episode struct {
	Project    string
	Writers    int
	Start, End time.Duration
	Service    time.Duration
}

// Workload is what the writers do in one run.
type Workload struct {
	Name string
	// Planned is the number of projects a static scheme is sized for
	// (cap = pool/Planned): the number an operator would plan for.
	Planned  int
	Episodes []Episode
}

// MouseWriters is the size of a small project: its p99 is the one compared
// with its p99 alone.
const MouseWriters = 2

// Workloads are the names Build accepts, in table order.
var Workloads = []string{"elephant", "newcomer", "churn", "onoff", "heavy"}

// HeavyService is what a request of the heavy workload's heavy project
// holds its seat for: ten times the default service.
const HeavyService = 200 * time.Millisecond

// Build returns workload name for a run of duration d with seed.
//
//   - elephant: one project of 64 writers beside nine of 2, all run long.
//   - newcomer: three busy projects of 16 writers; a fourth of 2 arrives
//     at d/2 (and a second newcomer of 16 at 3d/4, the large case).
//   - churn: projects arrive as a Poisson process (2/s) and live an
//     exponential time (mean 2s), each with 2, 4, 8, 16 or 32 writers;
//     four are there at the start. Planned = 4, the mean number present.
//   - onoff: the elephant of 64 writers on for 1s, off for 1s, beside
//     nine mice of 2 that run throughout.
//   - heavy: mixed service times. One project of 16 writers whose
//     requests hold a seat HeavyService (200ms) beside three of 16 and two
//     mice of 2 whose requests hold it the run's service (20ms), all run
//     long. Max-min gives the mice 2 seats each and the four others 7
//     each, whatever their requests' length: a project that holds each
//     seat ten times longer gets as many seats, so a tenth of the
//     requests.
func Build(name string, d time.Duration, seed uint64) (Workload, error) {
	rng := rand.New(rand.NewPCG(seed, 0x5eed))
	switch name {
	case "elephant":
		w := Workload{Name: name, Planned: 10}
		w.Episodes = append(w.Episodes, Episode{Project: "elephant", Writers: 64, End: d})
		for i := range 9 {
			w.Episodes = append(w.Episodes, Episode{Project: fmt.Sprintf("mouse%d", i+1), Writers: MouseWriters, End: d})
		}
		return w, nil
	case "newcomer":
		w := Workload{Name: name, Planned: 5}
		for i := range 3 {
			w.Episodes = append(w.Episodes, Episode{Project: fmt.Sprintf("busy%d", i+1), Writers: 16, End: d})
		}
		w.Episodes = append(w.Episodes,
			Episode{Project: "newmouse", Writers: MouseWriters, Start: d / 2, End: d},
			Episode{Project: "newbig", Writers: 16, Start: 3 * d / 4, End: d})
		return w, nil
	case "churn":
		const rate, life = 2.0, 2 * time.Second
		sizes := []int{2, 4, 8, 16, 32}
		w := Workload{Name: name, Planned: 4}
		n := 0
		add := func(start time.Duration) {
			n++
			l := time.Duration(rng.ExpFloat64() * float64(life))
			end := min(start+l, d)
			w.Episodes = append(w.Episodes, Episode{Project: fmt.Sprintf("p%d", n), Writers: sizes[rng.IntN(len(sizes))], Start: start, End: end})
		}
		for range 4 {
			add(0)
		}
		for t := time.Duration(rng.ExpFloat64() / rate * float64(time.Second)); t < d; t += time.Duration(rng.ExpFloat64() / rate * float64(time.Second)) {
			add(t)
		}
		return w, nil
	case "onoff":
		w := Workload{Name: name, Planned: 10}
		for t := time.Duration(0); t < d; t += 2 * time.Second {
			w.Episodes = append(w.Episodes, Episode{Project: "elephant", Writers: 64, Start: t, End: min(t+time.Second, d)})
		}
		for i := range 9 {
			w.Episodes = append(w.Episodes, Episode{Project: fmt.Sprintf("mouse%d", i+1), Writers: MouseWriters, End: d})
		}
		return w, nil
	case "heavy":
		w := Workload{Name: name, Planned: 6}
		w.Episodes = append(w.Episodes, Episode{Project: "heavy", Writers: 16, End: d, Service: HeavyService})
		for i := range 3 {
			w.Episodes = append(w.Episodes, Episode{Project: fmt.Sprintf("light%d", i+1), Writers: 16, End: d})
		}
		for i := range 2 {
			w.Episodes = append(w.Episodes, Episode{Project: fmt.Sprintf("mouse%d", i+1), Writers: MouseWriters, End: d})
		}
		return w, nil
	}
	return Workload{}, fmt.Errorf("unknown workload %q (have %v)", name, Workloads)
}

// Solo is one mouse alone, for its p99 alone.
func Solo(d time.Duration) Workload {
	return Workload{Name: "solo", Planned: 1, Episodes: []Episode{{Project: "mouse1", Writers: MouseWriters, End: d}}}
}
