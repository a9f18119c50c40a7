// SPDX-License-Identifier: Apache-2.0

package compare

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/fairshare-dev/fairshare/pools"
)

// Options set the size of a comparison.
type Options struct {
	Pool     int           // seats (permits); 32
	Service  time.Duration // what a request holds its seat for; 20ms
	Duration time.Duration // each run; 10s
	Seeds    []uint64      // one run per seed and workload
	Systems  []string      // names in Schemes or HTTPSchemes; empty: all of Schemes
	// Workloads are names from Workloads; empty: all.
	Workloads []string
	// Warmup is the time from each run's start that no metric counts (0:
	// all of it counts). For diagnosis: a fresh fairshare pool has measured
	// no release rate in its first second.
	Warmup time.Duration
	// Sample is the plot's sampling period; 0: 20ms.
	Sample time.Duration
	// Progress, if set, gets a line per run.
	Progress io.Writer
}

// Defaults are the sizes.
func Defaults() Options {
	return Options{Pool: 32, Service: 20 * time.Millisecond, Duration: 10 * time.Second, Seeds: []uint64{1, 2, 3}}
}

// DefaultRetry is how long a refused client waits when told nothing.
const DefaultRetry = 10 * time.Millisecond

// Run drives workload w through a fresh system of scheme s in real time:
// every writer is a goroutine that asks, holds its seat for o.Service
// (a real sleep) and asks again at once; a refused writer sleeps the wait
// it was told (DefaultRetry when told nothing) and asks again, the time
// since its first ask counting in its latency.
func Run(s Scheme, w Workload, seed uint64, o Options) (Result, error) {
	sys, err := s.New(o, w)
	if err != nil {
		return Result{}, err
	}
	defer sys.Close()
	start := time.Now()
	rec := newRecorder(o.Pool, pools.DefaultFloor(o.Pool), start)
	rec.warmup = o.Warmup
	if b, ok := sys.(binder); ok {
		// Over HTTP the upstream counts the seats, not the writer.
		b.bind(rec.hold)
	}
	ctx, cancel := context.WithDeadline(context.Background(), start.Add(o.Duration))
	defer cancel()

	var wg sync.WaitGroup
	var errMu sync.Mutex
	rng := rand.New(rand.NewPCG(seed, 0x0ff5e7))
	var firstErr error
	// Writers start spread over one service time, as a running system's
	// are, not in lockstep: with a fixed service time lockstep would last
	// forever. The first writer of an episode asks at its start.
	offs := make([][]time.Duration, len(w.Episodes))
	for i, ep := range w.Episodes {
		offs[i] = make([]time.Duration, ep.Writers)
		for j := 1; j < ep.Writers; j++ {
			offs[i][j] = time.Duration(rng.Int64N(int64(cmp.Or(ep.Service, o.Service))))
		}
	}
	for i, ep := range w.Episodes {
		service := cmp.Or(ep.Service, o.Service)
		wg.Go(func() {
			if !sleepUntil(ctx, start.Add(ep.Start)) {
				return
			}
			ectx, ecancel := context.WithDeadline(ctx, start.Add(ep.End))
			defer ecancel()
			var ws sync.WaitGroup
			for _, off := range offs[i] {
				ws.Go(func() {
					if !sleepUntil(ectx, start.Add(ep.Start+off)) {
						return
					}
					// A writer wants a seat from its first ask until it
					// stops, after the request it was in at the end: the
					// seat it still holds then is demand, not excess.
					rec.arrive(ep.Project, 1, ep.Start > 0, ep.Writers)
					defer rec.leave(ep.Project, 1)
					if err := writer(ectx, sys, rec, ep.Project, ep.Writers == MouseWriters, service); err != nil {
						errMu.Lock()
						firstErr = cmp.Or(firstErr, err)
						errMu.Unlock()
					}
				})
			}
			ws.Wait()
		})
	}
	period := o.Sample
	if period <= 0 {
		period = 20 * time.Millisecond
	}
	wg.Go(func() {
		t := time.NewTicker(period)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				rec.sample()
			}
		}
	})
	<-ctx.Done()
	rec.freeze()
	wg.Wait()
	res := rec.result()
	res.System, res.Workload = s.Name, w.Name
	return res, firstErr
}

// serviceKey is the context key of a request's service time (see
// ServiceOf).
type serviceKey struct{}

// ServiceOf is the service time the writer that made ctx asks for: what
// its request holds its seat for. A system whose seats are held elsewhere
// (the HTTP upstream) passes it on; the others run the work they are given.
func ServiceOf(ctx context.Context) (time.Duration, bool) {
	d, ok := ctx.Value(serviceKey{}).(time.Duration)
	return d, ok
}

// writer is one closed-loop client. It returns when ctx ends; an error
// means the system failed a request for another reason.
func writer(ctx context.Context, sys System, rec *recorder, project string, mouse bool, service time.Duration) error {
	ctx = context.WithValue(ctx, serviceKey{}, service)
	work := func() {
		rec.hold(project, 1)
		time.Sleep(service)
		rec.hold(project, -1)
	}
	for ctx.Err() == nil {
		t0 := time.Now()
		for {
			ok, retry, err := sys.Do(ctx, project, work)
			if err != nil {
				if ctx.Err() != nil {
					return nil
				}
				return fmt.Errorf("%s: %w", project, err)
			}
			if ok {
				break
			}
			rec.refused()
			if retry <= 0 {
				retry = DefaultRetry
			}
			if !sleepUntil(ctx, time.Now().Add(retry)) {
				return nil
			}
		}
		rec.done(project, mouse, time.Since(t0))
	}
	return nil
}

// sleepUntil sleeps until t; false if ctx ended first.
func sleepUntil(ctx context.Context, t time.Time) bool {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err() == nil
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-tm.C:
		return true
	}
}

// Row is one system on one workload, over the seeds.
type Row struct {
	System   string `json:"system"`
	Workload string `json:"workload"`
	// The worst seed of each column (min Jain and utilization, max p99
	// ratio, share wait and floor wait), and the mean refusals per
	// admitted request. Utilization, ShareWait and FloorWait are -1 where
	// no run had overload or newcomers (into a full pool, for ShareWait).
	Jain          float64       `json:"jain_min"`
	MouseP99      time.Duration `json:"mouse_p99_max_ns"`
	SoloP99       time.Duration `json:"solo_p99_ns"`
	MouseRatio    float64       `json:"mouse_p99_over_solo_max"`
	Utilization   float64       `json:"utilization_min"`
	ShareWait     time.Duration `json:"share_wait_max_ns"`
	FloorWait     time.Duration `json:"floor_wait_max_ns"`
	RefusalsPerOK float64       `json:"refusals_per_admit"`
	Runs          []Result      `json:"runs"`
}

// Report is a whole comparison.
type Report struct {
	Pool     int           `json:"pool"`
	Service  time.Duration `json:"service_ns"`
	Duration time.Duration `json:"duration_ns"`
	Seeds    []uint64      `json:"seeds"`
	Solo     []Result      `json:"solo"`
	Rows     []Row         `json:"rows"`
}

// Compare runs every selected system on every selected workload and seed,
// one run at a time (runs side by side would share the CPU and the timer
// wheel and blur each other's latencies), and the solo mouse once per
// system.
func Compare(o Options) (*Report, error) {
	systems := o.Systems
	if len(systems) == 0 {
		for _, s := range Schemes {
			systems = append(systems, s.Name)
		}
	}
	loads := o.Workloads
	if len(loads) == 0 {
		loads = Workloads
	}
	rep := &Report{Pool: o.Pool, Service: o.Service, Duration: o.Duration, Seeds: o.Seeds}
	progress := func(format string, a ...any) {
		if o.Progress != nil {
			fmt.Fprintf(o.Progress, format+"\n", a...)
		}
	}
	for _, name := range systems {
		s, err := SchemeByName(name)
		if err != nil {
			return nil, err
		}
		solo, err := Run(s, Solo(o.Duration), 0, o)
		if err != nil {
			return nil, fmt.Errorf("%s solo: %w", name, err)
		}
		solo.Samples = nil
		rep.Solo = append(rep.Solo, solo)
		progress("%-20s %-9s p99 %v", name, "solo", solo.MouseP99.Round(time.Microsecond))
		for _, wl := range loads {
			row := Row{System: name, Workload: wl, SoloP99: solo.MouseP99, Jain: math.Inf(1), Utilization: -1, ShareWait: -1, FloorWait: -1}
			var refusals, admits int
			for _, seed := range o.Seeds {
				w, err := Build(wl, o.Duration, seed)
				if err != nil {
					return nil, err
				}
				res, err := Run(s, w, seed, o)
				if err != nil {
					return nil, fmt.Errorf("%s %s seed %d: %w", name, wl, seed, err)
				}
				res.Seed = seed
				progress("%-20s %-9s seed %d: jain %.3f mouse p99 %v util %.3f share wait %s floor wait %s refusals/admit %.2f max in use %d",
					name, wl, seed, res.Jain, res.MouseP99.Round(time.Microsecond), res.Utilization, waitText(res.MaxShareWait()),
					waitText(res.MaxFloorWait()), res.RefusalsPerAdmit(), res.MaxInUse)
				row.Jain = math.Min(row.Jain, res.Jain)
				row.MouseP99 = max(row.MouseP99, res.MouseP99)
				if res.Utilization >= 0 && (row.Utilization < 0 || res.Utilization < row.Utilization) {
					row.Utilization = res.Utilization
				}
				row.ShareWait = max(row.ShareWait, res.MaxShareWait())
				row.FloorWait = max(row.FloorWait, res.MaxFloorWait())
				refusals += res.Refusals
				admits += res.Admits
				row.Runs = append(row.Runs, res)
			}
			if row.MouseP99 > 0 && row.SoloP99 > 0 {
				row.MouseRatio = float64(row.MouseP99) / float64(row.SoloP99)
			}
			if admits > 0 {
				row.RefusalsPerOK = float64(refusals) / float64(admits)
			}
			rep.Rows = append(rep.Rows, row)
		}
	}
	return rep, nil
}

// Row finds the row of system on workload.
func (r *Report) Row(system, workload string) (Row, bool) {
	for _, row := range r.Rows {
		if row.System == system && row.Workload == workload {
			return row, true
		}
	}
	return Row{}, false
}

// errNoRuns is returned by WriteTable for an empty report.
var errNoRuns = errors.New("no runs")

// WriteTable prints the comparison as a Markdown table, workloads in
// turn, the worst seed in each column.
func (r *Report) WriteTable(w io.Writer) error {
	if len(r.Rows) == 0 {
		return errNoRuns
	}
	fmt.Fprintf(w, "pool %d, service %v, %v per run, seeds %v; each cell the worst seed (mean for refusals)\n\n",
		r.Pool, r.Service, r.Duration, r.Seeds)
	fmt.Fprintln(w, "| workload | system | Jain | mice p99 (x solo) | utilization | newcomer share wait | refusals/admit |")
	fmt.Fprintln(w, "|---|---|---:|---:|---:|---:|---:|")
	var loads []string
	for _, row := range r.Rows {
		if !slices.Contains(loads, row.Workload) {
			loads = append(loads, row.Workload)
		}
	}
	for _, wl := range loads {
		for _, row := range r.Rows {
			if row.Workload != wl {
				continue
			}
			p99 := "-"
			if row.MouseP99 > 0 {
				p99 = fmt.Sprintf("%.1fms (%.2fx)", ms(row.MouseP99), row.MouseRatio)
			}
			util := "-"
			if row.Utilization >= 0 {
				util = fmt.Sprintf("%.3f", row.Utilization)
			}
			fw := "-"
			if row.ShareWait >= 0 {
				fw = fmt.Sprintf("%.1fms", ms(row.ShareWait))
			}
			fmt.Fprintf(w, "| %s | %s | %.3f | %s | %s | %s | %.2f |\n", wl, row.System, row.Jain, p99, util, fw, row.RefusalsPerOK)
		}
	}
	fmt.Fprintln(w)
	for _, s := range r.Solo {
		fmt.Fprintf(w, "solo p99 %s: %.1fms\n", s.System, ms(s.MouseP99))
	}
	fmt.Fprintln(w)
	for _, s := range r.Solo {
		if sc, err := SchemeByName(s.System); err == nil && sc.Retry != "" {
			fmt.Fprintf(w, "retry %s: %s\n", s.System, sc.Retry)
		}
	}
	if slices.Contains(loads, "heavy") {
		fmt.Fprintln(w)
		r.writeShares(w, "heavy")
	}
	return nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// waitText is a wait for the progress lines: "-" for none measured (-1).
func waitText(d time.Duration) string {
	if d < 0 {
		return "-"
	}
	return d.Round(time.Microsecond).String()
}
