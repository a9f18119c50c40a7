// SPDX-License-Identifier: Apache-2.0

package drill

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/fairshare-dev/fairshare/pools"
)

// Report is what a drill measured, and its verdicts.
type Report struct {
	Scenario string `json:"scenario"` // "requests" or "connections"
	// Destination is set when the connections drill ran against a
	// destination pool (Config.ToDestination): its name and destination.
	Destination  string  `json:"destination_pool,omitempty"`
	PoolSize     int     `json:"pool_size"`
	Floor        int     `json:"floor"`
	ServiceMs    float64 `json:"service_ms"`
	PhaseSeconds float64 `json:"phase_seconds"`
	RetryPauseMs float64 `json:"retry_pause_ms"`
	// Slices is how many turns "solo" and "both" took, alternating; Spans
	// places every slice and big-alone in time.
	Slices   int       `json:"slices"`
	Spans    []Span    `json:"spans"`
	Phases   []Phase   `json:"phases"`
	Verdicts []Verdict `json:"verdicts"`
	Pass     bool      `json:"pass"`
	Timeline []Bin     `json:"timeline"`
	// Held is the permits each project held over the run, the most seen
	// in each heldBin, in time order.
	Held []HeldBin `json:"held"`
	// MaxInUse is the most permits in use in any sample of the run,
	// warm-up and gaps between slices included (VerdictInUse).
	MaxInUse int `json:"max_in_use"`
	// Errors counts the asks of the whole run, both projects, warm-up and
	// gaps included, that ended in an error: neither admitted nor refused
	// (a 503, a reset, a connect failing otherwise than ECONNREFUSED). The
	// phases' errors columns count those of their own time.
	Errors int `json:"errors"`
	// Beside is the sampler's check of big admitted past its share beside
	// small (VerdictBigBeside).
	Beside Beside `json:"beside"`

	points []point // every admitted request, for the SVG
}

// HeldBin is the most permits one project held during one slice of the run
// (the sampler's snapshots in it), and the most in use node-wide.
type HeldBin struct {
	Project string  `json:"project"`
	StartS  float64 `json:"start_s"`
	Held    int     `json:"held"`
}

// heldBin is the width of a HeldBin: fine enough to show the big project
// stopping at POOL - FLOOR and taking the pool once alone.
const heldBin = 50 * time.Millisecond

// Span is one slice of a phase, in seconds since the first solo slice began.
// The slice counts from CountS on: in a solo slice that follows a both slice,
// from when big's last request of that slice ended.
type Span struct {
	Phase  string  `json:"phase"`
	StartS float64 `json:"start_s"`
	CountS float64 `json:"count_s"`
	EndS   float64 `json:"end_s"`
}

// Phase is one phase's numbers.
type Phase struct {
	Name     string          `json:"name"`
	MaxInUse int             `json:"max_in_use"` // sampled
	Projects []ProjectResult `json:"projects"`
}

// ProjectResult is one project's numbers in one phase.
type ProjectResult struct {
	Project   string  `json:"project"`
	Writers   int     `json:"writers"`
	OK        int     `json:"ok"`
	Refused   int     `json:"refused"`
	Errors    int     `json:"errors"`
	PerSecond float64 `json:"ok_per_second"`
	// Retried is how many admitted requests were refused at least once
	// first; MaxRefusals the most refusals one admitted request had.
	Retried     int `json:"retried"`
	MaxRefusals int `json:"max_refusals"`
	// Cut counts requests still refused when their writer's phase ended:
	// never admitted, they are in the latencies from their first ask to
	// that end (a lower bound of what they would have waited).
	Cut int `json:"cut"`
	// The latencies run from a request's first ask to the end of its
	// response: refusals and the pauses after them included.
	P50Ms   float64 `json:"p50_ms"`
	P99Ms   float64 `json:"p99_ms"`
	MaxMs   float64 `json:"max_ms"`
	MaxHeld int     `json:"max_held"` // sampled from pool snapshots
}

// Beside is what the samples of "both" say of big's admissions past its
// share (holdings.beside): in the samples taken after such an admission and
// before small was admitted again, big and small held POOL - FLOOR together
// at most, if the rule held.
type Beside struct {
	Share int `json:"share"` // big's share beside small: max(FLOOR, POOL/2)
	// Slack is how far past its share big may be admitted while the pool
	// has room (the kernel: CPUs - 1); only holdings above Share + Slack
	// are judged.
	Slack   int `json:"slack"`
	Checked int `json:"checked"` // samples judged
	// Together is the most big and small held together in a judged sample
	// (Big and Small each), AtS when, in seconds since the first solo
	// slice began.
	Together int     `json:"together"`
	Big      int     `json:"big"`
	Small    int     `json:"small"`
	AtS      float64 `json:"at_s"`
}

// Verdict is one pass/fail check.
type Verdict struct {
	Name   string `json:"name"`
	Pass   bool   `json:"pass"`
	Detail string `json:"detail"`
	// Goal marks our own target, beyond the specification's: reported
	// (met or missed), it does not fail the run. Measured from a request's
	// first ask, small's p99 beside big is 1.0x to 1.9x its solo p99 on an
	// idle 2-CPU machine: a host's load alone can take it past 2x.
	Goal bool `json:"goal,omitempty"`
	// Status is the verdict in one word, as the table prints it: pass or
	// fail, or for a goal met or miss (which fails nothing). A tool
	// reading the JSON should read this, or skip goals: a missed goal's
	// pass is false while the run passes.
	Status string `json:"status"`
}

// Bin is one project's latency over one slice of the run.
type Bin struct {
	Project string  `json:"project"`
	StartS  float64 `json:"start_s"`
	N       int     `json:"n"`
	P50Ms   float64 `json:"p50_ms"`
	P99Ms   float64 `json:"p99_ms"`
}

type point struct {
	project string
	at      time.Duration // since the solo phase began
	latency time.Duration
}

// Result returns the numbers of project in phase, or nil.
func (r *Report) Result(phase, project string) *ProjectResult {
	for i := range r.Phases {
		if r.Phases[i].Name != phase {
			continue
		}
		for j := range r.Phases[i].Projects {
			if r.Phases[i].Projects[j].Project == project {
				return &r.Phases[i].Projects[j]
			}
		}
	}
	return nil
}

// Verdict returns the verdict named name, or nil.
func (r *Report) Verdict(name string) *Verdict {
	for i := range r.Verdicts {
		if r.Verdicts[i].Name == name {
			return &r.Verdicts[i]
		}
	}
	return nil
}

// Verdict names.
const (
	VerdictSeedRatio   = "small p99 within 3x solo"
	VerdictTargetRatio = "small p99 within target of solo"
	VerdictBigAtFloor  = "big refused at the floor"
	VerdictBigAlone    = "big alone holds the pool"
	VerdictSmallRarely = "small refused rarely"
	// VerdictBigBeside: big, admitted past its share beside small, was
	// admitted only while in_use < POOL - FLOOR (Report.Beside).
	VerdictBigBeside = "big past its share admitted below POOL - FLOOR"
	// VerdictInUse: no sample saw more permits in use than the pool has.
	VerdictInUse = "in use within the pool"
	// VerdictNoErrors: every ask was admitted or refused, none failed
	// otherwise; an error is in no latency and no refusal count.
	VerdictNoErrors = "no errors"
)

// SmallRefusalLimit is the most refused asks per admitted request small may
// have in "both". Under the rule small, below its share, is refused only
// when the pool is full, and the next permit released goes to it, not to
// big: a refused writer mostly gets in at its next try. Where big may take
// every permit released (first come, first served, or a static cap per
// project), a refused small writer competes with big's for each one and is
// refused again and again. On a 2-core machine the rule gave 0 to 0.12 (the
// most with both cores busy elsewhere and the race detector on), those two
// schemes 0.57 and more.
const SmallRefusalLimit = 0.25

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// percentile is the nearest-rank percentile of sorted values.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted))*p+0.999999) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func buildReport(scenario string, cfg Config, tl timeline, hold *holdings, res map[string][]result) *Report {
	tl.settleGaps(res[Big])
	hb := hold.byPhase(tl)
	rep := &Report{
		Scenario: scenario, PoolSize: cfg.PoolSize, Floor: hold.floor,
		ServiceMs: ms(cfg.ServiceTime), PhaseSeconds: cfg.Phase.Seconds(), RetryPauseMs: ms(cfg.RetryPause),
		Slices: max(cfg.Slices, 1),
	}
	names := []string{PhaseSolo, PhaseBoth, PhaseBigAlone}
	for _, sp := range tl.spans {
		rep.Spans = append(rep.Spans, Span{Phase: names[sp.phase], StartS: sp.from.Sub(tl.soloAt).Seconds(),
			CountS: sp.count.Sub(tl.soloAt).Seconds(), EndS: sp.to.Sub(tl.soloAt).Seconds()})
	}
	writers := map[string]int{Small: cfg.SmallWriters, Big: cfg.BigWriters}
	present := [3][]string{{Small}, {Small, Big}, {Big}}
	for i, name := range names {
		ph := Phase{Name: name, MaxInUse: hb.maxInUse[i]}
		for _, project := range present[i] {
			pr := ProjectResult{Project: project, Writers: writers[project], MaxHeld: hb.maxHeld[i][project]}
			var lats []time.Duration
			for _, r := range res[project] {
				if tl.phaseAt(r.sent) != i {
					continue
				}
				switch r.status {
				case statusOK:
					pr.OK++
					lats = append(lats, r.latency)
					if r.refusals > 0 {
						pr.Retried++
					}
					pr.MaxRefusals = max(pr.MaxRefusals, r.refusals)
				case statusCut:
					pr.Cut++
					lats = append(lats, r.latency)
					pr.MaxRefusals = max(pr.MaxRefusals, r.refusals)
				case statusRefused:
					pr.Refused++
				default:
					pr.Errors++
				}
			}
			slices.Sort(lats)
			pr.P50Ms, pr.P99Ms = ms(percentile(lats, .50)), ms(percentile(lats, .99))
			if len(lats) > 0 {
				pr.MaxMs = ms(lats[len(lats)-1])
			}
			pr.PerSecond = float64(pr.OK) / tl.counted(i).Seconds()
			ph.Projects = append(ph.Projects, pr)
		}
		rep.Phases = append(rep.Phases, ph)
	}
	for _, project := range []string{Small, Big} {
		for _, r := range res[project] {
			if r.status == statusOK && tl.phaseAt(r.sent) >= 0 {
				rep.points = append(rep.points, point{project: project, at: r.sent.Sub(tl.soloAt), latency: r.latency})
			}
		}
	}
	for _, project := range []string{Small, Big} {
		for _, r := range res[project] {
			if r.status == statusError {
				rep.Errors++
			}
		}
	}
	rep.MaxInUse = hold.mostInUse()
	rep.Beside = hold.beside(tl, pools.Share(cfg.PoolSize, hold.floor, 2))
	rep.Timeline = bins(rep.points, 250*time.Millisecond)
	rep.Held = hold.bins(tl, heldBin, []string{Small, Big})
	rep.judge(cfg)
	return rep
}

// bins groups points per project into slices of width w.
func bins(points []point, w time.Duration) []Bin {
	type key struct {
		project string
		i       int
	}
	groups := map[key][]time.Duration{}
	for _, p := range points {
		k := key{p.project, int(p.at / w)}
		groups[k] = append(groups[k], p.latency)
	}
	var out []Bin
	for k, lats := range groups {
		slices.Sort(lats)
		out = append(out, Bin{Project: k.project, StartS: (time.Duration(k.i) * w).Seconds(), N: len(lats),
			P50Ms: ms(percentile(lats, .5)), P99Ms: ms(percentile(lats, .99))})
	}
	slices.SortFunc(out, func(a, b Bin) int {
		if c := strings.Compare(a.Project, b.Project); c != 0 {
			return c
		}
		if a.StartS < b.StartS {
			return -1
		}
		return 1
	})
	return out
}

func (r *Report) judge(cfg Config) {
	solo, both := r.Result(PhaseSolo, Small), r.Result(PhaseBoth, Small)
	bigBoth, bigAlone := r.Result(PhaseBoth, Big), r.Result(PhaseBigAlone, Big)
	ratio := func(limit float64, name string) Verdict {
		v := Verdict{Name: name}
		if solo.OK == 0 || both.OK == 0 {
			v.Detail = fmt.Sprintf("no admitted small requests (solo %d, both %d)", solo.OK, both.OK)
			return v
		}
		q := both.P99Ms / solo.P99Ms
		v.Pass = q <= limit
		v.Detail = fmt.Sprintf("p99 %.1fms vs solo %.1fms = %.2fx (limit %.1fx)", both.P99Ms, solo.P99Ms, q, limit)
		return v
	}
	atFloor := Verdict{Name: VerdictBigAtFloor}
	limit := r.PoolSize - r.Floor
	atFloor.Pass = bigBoth.Refused > 0 && bigBoth.MaxHeld <= limit
	atFloor.Detail = fmt.Sprintf("big refused %d, held at most %d (POOL - FLOOR = %d)", bigBoth.Refused, bigBoth.MaxHeld, limit)
	alone := Verdict{Name: VerdictBigAlone}
	alone.Pass = bigAlone.MaxHeld == r.PoolSize
	alone.Detail = fmt.Sprintf("big held at most %d of %d", bigAlone.MaxHeld, r.PoolSize)
	rarely := Verdict{Name: VerdictSmallRarely}
	if both.OK == 0 {
		rarely.Detail = fmt.Sprintf("no admitted small requests (refused %d)", both.Refused)
	} else {
		q := float64(both.Refused) / float64(both.OK)
		rarely.Pass = q <= SmallRefusalLimit
		rarely.Detail = fmt.Sprintf("%d refused asks for %d admitted requests = %.2f per request (limit %.2f), at most %d before one got in",
			both.Refused, both.OK, q, SmallRefusalLimit, both.MaxRefusals)
	}
	beside := Verdict{Name: VerdictBigBeside}
	past := fmt.Sprintf("its share (%d)", r.Beside.Share)
	if r.Beside.Slack > 0 {
		past = fmt.Sprintf("its share (%d) plus the kernel's slack (%d)", r.Beside.Share, r.Beside.Slack)
	}
	if r.Beside.Checked == 0 {
		beside.Pass = true
		beside.Detail = fmt.Sprintf("no sample to judge: big never seen past %s after an admission of its own with none of small's since", past)
	} else {
		beside.Pass = r.Beside.Together <= limit
		beside.Detail = fmt.Sprintf("in %d samples after big was admitted past %s and before small was again, big and small held at most %d together (big %d, small %d; POOL - FLOOR = %d)",
			r.Beside.Checked, past, r.Beside.Together, r.Beside.Big, r.Beside.Small, limit)
	}
	inUse := Verdict{Name: VerdictInUse}
	most := r.MaxInUse
	for _, ph := range r.Phases {
		most = max(most, ph.MaxInUse)
	}
	inUse.Pass = most <= r.PoolSize
	inUse.Detail = fmt.Sprintf("at most %d in use of %d (sampled)", most, r.PoolSize)
	noErrors := Verdict{Name: VerdictNoErrors}
	errs := 0
	for _, ph := range r.Phases {
		for _, p := range ph.Projects {
			errs += p.Errors
		}
	}
	errs = max(errs, r.Errors)
	noErrors.Pass = errs == 0
	noErrors.Detail = "every ask was admitted or refused"
	if errs > 0 {
		noErrors.Detail = fmt.Sprintf("%d asks ended in an error, neither admitted nor refused: they are in no latency and no refusal count", errs)
	}
	target := ratio(cfg.TargetRatio, VerdictTargetRatio)
	target.Goal = true
	r.Verdicts = []Verdict{ratio(SeedRatio, VerdictSeedRatio), target, rarely, atFloor, beside, alone, inUse, noErrors}
	r.Pass = true
	for i := range r.Verdicts {
		v := &r.Verdicts[i]
		r.Pass = r.Pass && (v.Pass || v.Goal)
		switch {
		case v.Goal && v.Pass:
			v.Status = "met"
		case v.Goal:
			v.Status = "miss"
		case v.Pass:
			v.Status = "pass"
		default:
			v.Status = "fail"
		}
	}
}

// WriteTable prints the report as a table followed by the verdicts.
func (r *Report) WriteTable(w io.Writer) error {
	unit := "requests"
	if r.Scenario == "connections" {
		unit = "connections"
	}
	if r.Destination != "" {
		unit = "connections to the destination pool " + r.Destination
	}
	fmt.Fprintf(w, "fair-share drill (%s): pool %d, floor %d, service %.0fms, phases %.1fs, refused writers retry after %.0fms\n",
		unit, r.PoolSize, r.Floor, r.ServiceMs, r.PhaseSeconds, r.RetryPauseMs)
	if r.Slices > 1 {
		fmt.Fprintf(w, "solo and both take turns in %d slices of %.2fs each, so the machine's other load weighs on both alike\n",
			r.Slices, r.PhaseSeconds/float64(r.Slices))
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "phase\tproject\twriters\tok\tok/s\trefused\tretried\terrors\tp50 ms\tp99 ms\tmax ms\tmax held\tmax in use\t")
	for _, ph := range r.Phases {
		for _, p := range ph.Projects {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%.0f\t%d\t%d\t%d\t%.1f\t%.1f\t%.1f\t%d\t%d\t\n", ph.Name, p.Project, p.Writers,
				p.OK, p.PerSecond, p.Refused, p.Retried, p.Errors, p.P50Ms, p.P99Ms, p.MaxMs, p.MaxHeld, ph.MaxInUse)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	for _, v := range r.Verdicts {
		mark := strings.ToUpper(v.Status)
		if mark == "MET" {
			mark = "MET "
		}
		fmt.Fprintf(w, "%s  %s: %s\n", mark, v.Name, v.Detail)
	}
	_, err := fmt.Fprintln(w)
	return err
}

// WriteJSON writes the report as indented JSON.
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}
