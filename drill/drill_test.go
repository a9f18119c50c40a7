// SPDX-License-Identifier: Apache-2.0

package drill

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/xml"
	"fmt"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/pools"
)

// TestDrill runs the HTTP drill end to end with short phases and checks the
// specification's verdicts. Phases stay longer than three seconds: small
// leaves the active set at most one window plus two recompute periods (1 s
// each) after its last request ends (pools never drops a project early, so a
// recompute that comes a hair under a window after the last one keeps it once
// more), and only then may big take the whole pool (Config.Check).
func TestDrill(t *testing.T) {
	if testing.Short() {
		t.Skip("runs for about 11 seconds")
	}
	// Refused writers pause 50ms (not 10ms as in the CLI): under -race, every
	// refusal costs the shared cores several times what it costs in the
	// binary, and that cost, not the rule, would set small's p99.
	cfg := Config{Phase: 3500 * time.Millisecond, Warmup: 300 * time.Millisecond, RetryPause: 50 * time.Millisecond}
	if err := cfg.Check(false); err != nil {
		t.Fatal(err)
	}
	rep, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	assertReport(t, rep)
	for _, ph := range rep.Phases {
		for _, p := range ph.Projects {
			if p.OK == 0 || p.Errors > 0 {
				t.Errorf("phase %s project %s: ok %d errors %d", ph.Name, p.Project, p.OK, p.Errors)
			}
		}
	}
	if small := rep.Result(PhaseSolo, Small); small.Refused != 0 || small.MaxHeld > 2 {
		t.Errorf("small alone: refused %d held %d; a node with room refuses nothing", small.Refused, small.MaxHeld)
	}
	checkOutputs(t, rep)
}

// TestDrillWithoutTheRule runs the drill with the rule off, so that its
// verdicts are shown to fail where the rule is missing: first come, first
// served (big may take the whole pool), and a static cap per project at
// POOL - FLOOR. In both, small is refused far more often than the rule
// allows (TestDrill has the rule pass the same verdict), and the run fails.
// The latency verdicts fail too, but they are timing targets: asserted only
// with FAIRSHARE_DRILL_STRICT=1, as in assertVerdicts.
func TestDrillWithoutTheRule(t *testing.T) {
	if testing.Short() {
		t.Skip("runs for about 10 seconds")
	}
	// Both let big be admitted past its share at in_use >= POOL - FLOOR,
	// which the samples taken right after show (VerdictBigBeside). The
	// static cap, at POOL - FLOOR, keeps big's own holding there: "big
	// refused at the floor" passes, that verdict does not. (Its "big alone
	// holds the pool" fails by the cap, and by these short phases too.)
	for _, tc := range []struct {
		name string
		adm  admission
		also []string // verdicts about big that fail too
	}{
		{"first come first served", admitFIFO, []string{VerdictBigAtFloor, VerdictBigBeside}},
		{"static cap", admitStaticCap, []string{VerdictBigBeside, VerdictBigAlone}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep, err := Run(context.Background(), Config{Phase: 1500 * time.Millisecond, Slices: 3,
				Warmup: 300 * time.Millisecond, admission: tc.adm})
			if err != nil {
				t.Fatal(err)
			}
			var table bytes.Buffer
			if err := rep.WriteTable(&table); err != nil {
				t.Fatal(err)
			}
			t.Logf("\n%s", table.String())
			if rep.Pass {
				t.Error("the run passed without the rule")
			}
			names := append([]string{VerdictSmallRarely}, tc.also...)
			if os.Getenv(strictEnv) == "1" {
				names = append(names, VerdictSeedRatio)
			}
			for _, name := range names {
				if v := rep.Verdict(name); v == nil || v.Pass {
					t.Errorf("verdict %q passed without the rule: %+v", name, v)
				}
			}
			// Small's latency runs from its first ask: a request refused
			// k times waited k pauses at least.
			both := rep.Result(PhaseBoth, Small)
			if both.MaxRefusals < 1 || both.MaxMs < float64(both.MaxRefusals)*rep.RetryPauseMs {
				t.Errorf("small's longest request took %.1fms after at most %d refusals of %.0fms pauses each",
					both.MaxMs, both.MaxRefusals, rep.RetryPauseMs)
			}
		})
	}
}

// strictEnv makes the tests assert the latency verdicts too.
const strictEnv = "FAIRSHARE_DRILL_STRICT"

// assertReport logs the report's table and fails where a phase had more in
// use than the pool and on the verdicts (assertVerdicts).
func assertReport(t *testing.T, rep *Report) {
	t.Helper()
	var table bytes.Buffer
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	t.Logf("\n%s", table.String())
	assertVerdicts(t, rep)
	for _, ph := range rep.Phases {
		if ph.MaxInUse > rep.PoolSize {
			t.Errorf("phase %s: in use %d > pool %d", ph.Name, ph.MaxInUse, rep.PoolSize)
		}
	}
}

// assertVerdicts fails on the verdicts about what the rule admits, which hold
// on any machine (small refused rarely among them: it counts refusals, and
// TestDrillWithoutTheRule shows it fails where the rule is off). The latency verdicts (small's p99 against its solo p99) are
// timing targets: on a shared, busy machine they measure the neighbours, so
// they are logged, and asserted only with FAIRSHARE_DRILL_STRICT=1 (the
// `fairshare drill` command always exits non-zero when one fails, and
// BenchmarkDrill reports the ratio).
func assertVerdicts(t *testing.T, rep *Report) {
	t.Helper()
	for _, name := range []string{VerdictBigAtFloor, VerdictBigBeside, VerdictBigAlone, VerdictSmallRarely, VerdictInUse, VerdictNoErrors,
		VerdictSeedRatio, VerdictTargetRatio} {
		v := rep.Verdict(name)
		switch {
		case v == nil:
			t.Errorf("no verdict %q", name)
		case v.Pass:
		case (name == VerdictSeedRatio || name == VerdictTargetRatio) && os.Getenv(strictEnv) != "1":
			t.Logf("latency verdict %q failed (asserted only with %s=1): %s", name, strictEnv, v.Detail)
		default:
			t.Errorf("verdict %q failed: %s", name, v.Detail)
		}
	}
	// Whatever the machine, small was served while big pressed.
	if both := rep.Result(PhaseBoth, Small); both == nil || both.OK == 0 {
		t.Errorf("small got nothing done next to big: %+v", both)
	}
}

func checkOutputs(t *testing.T, rep *Report) {
	t.Helper()
	var js bytes.Buffer
	if err := rep.WriteJSON(&js); err != nil {
		t.Fatal(err)
	}
	var back Report
	if err := json.Unmarshal(js.Bytes(), &back); err != nil {
		t.Fatal(err)
	}
	if len(back.Phases) != 3 || len(back.Verdicts) != len(rep.Verdicts) || back.Pass != rep.Pass {
		t.Errorf("JSON round trip lost data: %+v", back)
	}
	var svg bytes.Buffer
	if err := rep.WriteSVG(&svg); err != nil {
		t.Fatal(err)
	}
	text := svg.String()
	dec := xml.NewDecoder(&svg)
	circles := 0
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("SVG is not well-formed XML: %v", err)
		}
		if se, ok := tok.(xml.StartElement); ok && se.Name.Local == "circle" {
			circles++
		}
	}
	if circles < 10 {
		t.Errorf("SVG has %d circles", circles)
	}
	if want := fmt.Sprintf("POOL - FLOOR = %d", rep.PoolSize-rep.Floor); !strings.Contains(text, want) {
		t.Errorf("SVG has no %q line", want)
	}
	checkHeld(t, rep)
}

// checkHeld checks the held series the SVG plots against the rule: big
// never above POOL - FLOOR while small is there, all of POOL once alone. A
// slice's bins count from its CountS, as its numbers do: a solo slice that
// follows a both slice is small's alone only once big's last request of
// that slice ended (on a loaded machine, bins later than its start).
func checkHeld(t *testing.T, rep *Report) {
	t.Helper()
	phaseAt := func(s float64) string {
		for _, sp := range rep.Spans {
			if s >= sp.CountS && s+heldBin.Seconds() <= sp.EndS {
				return sp.Phase
			}
		}
		return "" // a bin across a boundary
	}
	most := map[string]map[string]int{}
	for _, b := range rep.Held {
		ph := phaseAt(b.StartS)
		if most[ph] == nil {
			most[ph] = map[string]int{}
		}
		most[ph][b.Project] = max(most[ph][b.Project], b.Held)
	}
	if n := most[PhaseBoth][Big]; n == 0 || n > rep.PoolSize-rep.Floor {
		t.Errorf("held series: big held up to %d in %s, want 1..%d", n, PhaseBoth, rep.PoolSize-rep.Floor)
	}
	if n := most[PhaseBigAlone][Big]; n != rep.PoolSize {
		t.Errorf("held series: big held up to %d alone, want %d", n, rep.PoolSize)
	}
	if most[PhaseSolo][Small] == 0 || most[PhaseSolo][Big] != 0 {
		t.Errorf("held series in %s: %v", PhaseSolo, most[PhaseSolo])
	}
}

// TestChain: a writer's admitted request carries its chain, from its first
// ask to the end of its response, refusals and pauses included; an error
// starts the next chain afresh.
func TestChain(t *testing.T) {
	t0 := time.Unix(100, 0)
	ms := time.Millisecond
	var c chain
	for i, tc := range []struct {
		at, lat  time.Duration // the ask
		st       status
		sent     time.Duration // the result
		latency  time.Duration
		refusals int
	}{
		{0, 1 * ms, statusRefused, 0, 1 * ms, 0},
		{11 * ms, 1 * ms, statusRefused, 11 * ms, 1 * ms, 0},
		{22 * ms, 20 * ms, statusOK, 0, 42 * ms, 2},
		{50 * ms, 20 * ms, statusOK, 50 * ms, 20 * ms, 0},
		{80 * ms, 1 * ms, statusRefused, 80 * ms, 1 * ms, 0},
		{90 * ms, 2 * ms, statusError, 90 * ms, 2 * ms, 0},
		{100 * ms, 20 * ms, statusOK, 100 * ms, 20 * ms, 0},
	} {
		got := c.record(t0.Add(tc.at), tc.lat, tc.st)
		if got.sent.Sub(t0) != tc.sent || got.latency != tc.latency || got.status != tc.st || got.refusals != tc.refusals {
			t.Errorf("ask %d at +%v: got sent +%v latency %v status %d refusals %d, want +%v %v %d %d",
				i, tc.at, got.sent.Sub(t0), got.latency, got.status, got.refusals, tc.sent, tc.latency, tc.st, tc.refusals)
		}
	}
}

// TestCutCountsInP99: a request still refused when its writer's phase ends
// (a scheme that keeps small refused to the end) counts in small's
// latencies from its first ask to that end, and in the phase's cut count;
// before, it had no latency and the phase's p99 held only the admitted.
func TestCutCountsInP99(t *testing.T) {
	t0 := time.Unix(100, 0)
	ms := time.Millisecond
	var c chain
	if _, ok := c.cut(t0); ok {
		t.Fatal("an empty chain was cut")
	}
	c.record(t0.Add(1100*ms), ms, statusRefused)
	c.record(t0.Add(1150*ms), ms, statusRefused)
	cut, ok := c.cut(t0.Add(1900 * ms))
	if !ok || cut.status != statusCut || cut.sent != t0.Add(1100*ms) || cut.latency != 800*ms || cut.refusals != 2 {
		t.Fatalf("cut %+v %v, want sent +1.1s, 800ms, 2 refusals", cut, ok)
	}
	if _, ok := c.cut(t0.Add(2 * time.Second)); ok {
		t.Fatal("a chain cut twice")
	}
	// Solo [1s,3s): 98 requests of 10ms, the 2 refusals and the cut one.
	tl := newTimeline(t0, time.Second, 2*time.Second, 1)
	var res []result
	for i := range 98 {
		res = append(res, result{sent: t0.Add(time.Second + time.Duration(i)*10*ms), latency: 10 * ms, status: statusOK})
	}
	res = append(res, result{sent: t0.Add(1100 * ms), latency: ms, status: statusRefused},
		result{sent: t0.Add(1150 * ms), latency: ms, status: statusRefused}, cut)
	rep := buildReport("requests", Config{PoolSize: 8}, tl, newHoldings(), map[string][]result{Small: res})
	pr := rep.Result(PhaseSolo, Small)
	if pr.Cut != 1 || pr.OK != 98 || pr.Refused != 2 || pr.P99Ms != 800 || pr.MaxRefusals != 2 {
		t.Errorf("solo: %+v; want 1 cut, 98 ok, 2 refused, p99 800ms", pr)
	}
}

// TestLogTicks: the latency panel's scale is marked at 1, 2 and 5 times
// each power of ten between its ends, which are such values themselves.
func TestLogTicks(t *testing.T) {
	for _, tc := range []struct {
		lo, hi float64
		want   string
	}{
		{10, 1000, "[10 20 50 100 200 500 1000]"},
		{0.2, 5, "[0.2 0.5 1 2 5]"},
		{20, 200, "[20 50 100 200]"},
	} {
		if got := fmt.Sprint(logTicks(tc.lo, tc.hi)); got != tc.want {
			t.Errorf("logTicks(%g, %g) = %s, want %s", tc.lo, tc.hi, got, tc.want)
		}
	}
	for v, want := range map[float64]float64{19.9: 10, 20: 20, 49: 20, 51: 50, 0.7: 0.5, 1000: 1000} {
		if got := niceFloor(v); got != want {
			t.Errorf("niceFloor(%g) = %g, want %g", v, got, want)
		}
	}
}

func TestPercentile(t *testing.T) {
	var d []time.Duration
	for i := 1; i <= 100; i++ {
		d = append(d, time.Duration(i))
	}
	for _, tc := range []struct {
		p    float64
		want time.Duration
	}{{.5, 50}, {.99, 99}, {1, 100}, {.001, 1}} {
		if got := percentile(d, tc.p); got != tc.want {
			t.Errorf("p%v = %v, want %v", tc.p, got, tc.want)
		}
	}
	if percentile(nil, .5) != 0 || percentile(d[:1], .99) != 1 {
		t.Error("edge cases")
	}
}

func TestTimeline(t *testing.T) {
	t0 := time.Unix(100, 0)
	s := time.Second
	// One slice: the phases one after the other.
	tl := newTimeline(t0, s, 2*s, 1)
	for _, tc := range []struct {
		at   time.Duration
		want int
	}{{0, -1}, {999 * time.Millisecond, -1}, {s, 0}, {3 * s, 1}, {5 * s, 2}, {7 * s, -1}} {
		if got := tl.phaseAt(t0.Add(tc.at)); got != tc.want {
			t.Errorf("one slice: phaseAt(+%v) = %d, want %d", tc.at, got, tc.want)
		}
	}
	// Two slices of 1s: solo [1,2) both [2,3) solo [3,4) both [4,5)
	// big-alone [5,7). Big's last request of the first both slice ends at
	// 3.1, so the second solo slice counts from then: small was not alone
	// before.
	tl = newTimeline(t0, s, 2*s, 2)
	tl.settleGaps([]result{
		{sent: t0.Add(2500 * time.Millisecond), latency: 600 * time.Millisecond},
		{sent: t0.Add(2900 * time.Millisecond), latency: 50 * time.Millisecond},
		{sent: t0.Add(4900 * time.Millisecond), latency: time.Second}, // into big-alone: no gap there
	})
	for _, tc := range []struct {
		at   time.Duration
		want int
	}{{1500 * time.Millisecond, 0}, {2 * s, 1}, {3 * s, -1}, {3099 * time.Millisecond, -1}, {3100 * time.Millisecond, 0},
		{4 * s, 1}, {4999 * time.Millisecond, 1}, {5 * s, 2}, {7 * s, -1}} {
		if got := tl.phaseAt(t0.Add(tc.at)); got != tc.want {
			t.Errorf("two slices: phaseAt(+%v) = %d, want %d", tc.at, got, tc.want)
		}
	}
	if got := tl.counted(0); got != 1900*time.Millisecond {
		t.Errorf("solo counted %v, want 1.9s", got)
	}
	if got := tl.counted(1); got != 2*s {
		t.Errorf("both counted %v, want 2s", got)
	}
	want := map[string][]interval{
		Small: {{t0, t0.Add(5 * s)}},
		Big:   {{t0.Add(2 * s), t0.Add(3 * s)}, {t0.Add(4 * s), t0.Add(7 * s)}},
	}
	for p, w := range want {
		got := tl.sends(p)
		if len(got) != len(w) {
			t.Fatalf("%s sends %v, want %v", p, got, w)
		}
		for i := range w {
			if !got[i].from.Equal(w[i].from) || !got[i].to.Equal(w[i].to) {
				t.Errorf("%s sends %v, want %v", p, got, w)
			}
		}
	}
	// Slices add up to the phase exactly even when it does not divide.
	tl = newTimeline(t0, 0, 1000*time.Nanosecond, 3)
	if tl.bigAloneAt != t0.Add(2000*time.Nanosecond) || tl.counted(0)+tl.counted(1) != 2000*time.Nanosecond {
		t.Errorf("uneven slices: big alone at %v, counted %v + %v", tl.bigAloneAt.Sub(t0), tl.counted(0), tl.counted(1))
	}
}

// TestHeldSamplesAcrossSlices: a read of the pool that begins in one slice
// and ends in the next counts in neither, in the phases' most held and in
// the held series, whichever end of the read its state came from: a solo
// slice's last read returning big's permits of the both slice begun
// meanwhile (the drill's rare "held series in solo" failure on a loaded
// machine), or a both slice's last read ending in the solo slice.
func TestHeldSamplesAcrossSlices(t *testing.T) {
	t0 := time.Unix(100, 0)
	ms := time.Millisecond
	// solo [0,250ms), both [250,500), solo [500,750), both [750,1000),
	// big-alone [1000,1500), counted from t0.
	tl := newTimeline(t0, 0, 500*ms, 2)
	h := newHoldings()
	read := func(from, to time.Duration, held map[string]int) {
		h.observe(t0.Add(from), t0.Add(to), held[Small]+held[Big], held, nil)
	}
	read(100*ms, 101*ms, map[string]int{Small: 2})
	read(240*ms, 260*ms, map[string]int{Small: 2, Big: 5}) // solo into both
	read(300*ms, 301*ms, map[string]int{Small: 1, Big: 6})
	read(499*ms, 505*ms, map[string]int{Small: 1, Big: 7}) // both into solo
	read(600*ms, 600*ms, map[string]int{Small: 2})
	read(1100*ms, 1102*ms, map[string]int{Big: 8})
	read(1499*ms, 1600*ms, map[string]int{Big: 3}) // past the end
	b := h.byPhase(tl)
	if b.maxHeld[0][Big] != 0 || b.maxHeld[0][Small] != 2 || b.maxHeld[1][Big] != 6 || b.maxHeld[2][Big] != 8 {
		t.Errorf("most held by phase %v", b.maxHeld)
	}
	if b.maxInUse[0] != 2 || b.maxInUse[1] != 7 {
		t.Errorf("most in use by phase %v", b.maxInUse)
	}
	for _, bin := range h.bins(tl, 50*ms, []string{Small, Big}) {
		if bin.Project == Big && bin.Held != 0 && (bin.StartS < 0.25 || bin.StartS >= 0.5 && bin.StartS < 0.75) {
			t.Errorf("held series: big holds %d in a solo bin at %.2fs", bin.Held, bin.StartS)
		}
	}
}

// TestVerdicts feeds the judge made-up numbers: it must fail what breaks the
// rule, not only pass what keeps it.
func TestVerdicts(t *testing.T) {
	smallRefused := 0
	var edit func(*Report) // applied before judging, if set
	mk := func(soloP99, bothP99 float64, bigRefused, bigHeldBoth, bigHeldAlone int) *Report {
		r := &Report{PoolSize: 8, Floor: 1, MaxInUse: 8, Phases: []Phase{
			{Name: PhaseSolo, MaxInUse: 2, Projects: []ProjectResult{{Project: Small, OK: 10, P99Ms: soloP99}}},
			{Name: PhaseBoth, MaxInUse: 8, Projects: []ProjectResult{{Project: Small, OK: 100, Refused: smallRefused, P99Ms: bothP99},
				{Project: Big, OK: 10, Refused: bigRefused, MaxHeld: bigHeldBoth}}},
			{Name: PhaseBigAlone, MaxInUse: 8, Projects: []ProjectResult{{Project: Big, OK: 10, MaxHeld: bigHeldAlone}}},
		}, Beside: Beside{Share: 4, Checked: 100, Together: 7, Big: 6, Small: 1}}
		if edit != nil {
			edit(r)
		}
		r.judge(Config{TargetRatio: 2})
		return r
	}
	if r := mk(20, 30, 5, 7, 8); !r.Pass {
		t.Errorf("good run failed: %+v", r.Verdicts)
	}
	for name, r := range map[string]*Report{
		VerdictSeedRatio:  mk(20, 61, 5, 7, 8),
		VerdictBigAtFloor: mk(20, 30, 5, 8, 8),
		VerdictBigAlone:   mk(20, 30, 5, 7, 7),
	} {
		if r.Pass || r.Verdict(name).Pass {
			t.Errorf("%s: passed a run that breaks it", name)
		}
	}
	// Our own goal, missed: reported, and the run passes.
	if r := mk(20, 41, 5, 7, 8); !r.Pass || r.Verdict(VerdictTargetRatio).Pass || r.Verdict(VerdictTargetRatio).Status != "miss" ||
		r.Verdict(VerdictSeedRatio).Status != "pass" {
		t.Errorf("target missed: run pass %v, goal %+v; want the run to pass, the goal missed", r.Pass, r.Verdict(VerdictTargetRatio))
	} else {
		var buf strings.Builder
		if err := r.WriteTable(&buf); err != nil || !strings.Contains(buf.String(), "MISS  "+VerdictTargetRatio) || strings.Contains(buf.String(), "FAIL") {
			t.Errorf("table of a missed goal: %q", buf.String())
		}
	}
	if r := mk(20, 30, 0, 7, 8); r.Verdict(VerdictBigAtFloor).Pass {
		t.Error("big never refused still passed")
	}
	// Small refused on a quarter of its requests passes; more, with every
	// other verdict passing, fails the run.
	for _, tc := range []struct {
		refused int
		pass    bool
	}{{0, true}, {25, true}, {26, false}, {150, false}} {
		smallRefused = tc.refused
		if r := mk(20, 30, 5, 7, 8); r.Verdict(VerdictSmallRarely).Pass != tc.pass || r.Pass != tc.pass {
			t.Errorf("small refused %d for 100 admitted: pass %v, want %v: %+v", tc.refused, r.Pass, tc.pass, r.Verdicts)
		}
	}
	smallRefused = 0
	var buf strings.Builder
	if err := mk(20, 61, 5, 7, 8).WriteTable(&buf); err != nil || !strings.Contains(buf.String(), "FAIL") {
		t.Errorf("table does not show the failure: %q", buf.String())
	}

	// The verdicts added after a review found runs that broke the rule and
	// passed: each fails its violation, alone among the verdicts, and the
	// run with it. Before, nothing looked at these numbers.
	for _, tc := range []struct {
		name, verdict string
		edit          func(*Report)
	}{
		// Sampled: one more in use than the pool, in a phase or between.
		{"in use past the pool in big-alone", VerdictInUse, func(r *Report) { r.Phases[2].MaxInUse, r.MaxInUse = 9, 9 }},
		{"in use past the pool in a gap", VerdictInUse, func(r *Report) { r.MaxInUse = 9 }},
		// Asks that were neither admitted nor refused: small's refusals
		// and p99 leave them out.
		{"small's asks failing in both", VerdictNoErrors, func(r *Report) { r.Phases[1].Projects[0].Errors, r.Errors = 40, 40 }},
		{"big's ask failing in big-alone", VerdictNoErrors, func(r *Report) { r.Phases[2].Projects[0].Errors, r.Errors = 1, 1 }},
		{"an ask failing in warm-up", VerdictNoErrors, func(r *Report) { r.Errors = 1 }},
		// An admission at in_use == POOL - FLOOR: big at 6 (never past
		// POOL - FLOOR alone), small holding 2 since.
		{"big admitted at POOL - FLOOR", VerdictBigBeside, func(r *Report) { r.Beside.Together, r.Beside.Big, r.Beside.Small = 8, 6, 2 }},
	} {
		edit = tc.edit
		r := mk(20, 30, 5, 7, 8)
		edit = nil
		if r.Pass {
			t.Errorf("%s: the run passed", tc.name)
		}
		for _, v := range r.Verdicts {
			if v.Pass == (v.Name == tc.verdict) {
				t.Errorf("%s: verdict %q pass=%v: %s", tc.name, v.Name, v.Pass, v.Detail)
			}
		}
	}
	// Nothing to judge beside small (big never past its share with small
	// not admitted since): passes, and says so.
	edit = func(r *Report) { r.Beside = Beside{Share: 4} }
	if r := mk(20, 30, 5, 7, 8); !r.Pass || !strings.Contains(r.Verdict(VerdictBigBeside).Detail, "no sample to judge") {
		t.Errorf("nothing to judge beside small: %+v", r.Verdict(VerdictBigBeside))
	}
	edit = nil
}

// beSample is one read of the pool in TestBeside: what big and small held
// and their admitted counts.
type beSample struct {
	big    int
	bigAdm uint64
	small  int
	smAdm  uint64
}

// besideOf feeds holdings the reads seq, 1ms apart from 1.1s into the
// timeline (solo [0,1s), both [1s,2s), big-alone [2s,3s)), each read taken
// each times in a row, and judges them.
func besideOf(seq []beSample, torn bool, slack, each int) Beside {
	t0 := time.Unix(100, 0)
	tl := newTimeline(t0, 0, time.Second, 1)
	h := newHoldings()
	h.floor, h.torn, h.slack = 1, torn, slack
	at := t0.Add(1100 * time.Millisecond)
	for _, s := range seq {
		for range each {
			h.observe(at, at.Add(10*time.Microsecond), s.big+s.small, map[string]int{Big: s.big, Small: s.small},
				map[string]uint64{Big: s.bigAdm, Small: s.smAdm})
			at = at.Add(time.Millisecond)
		}
	}
	return h.beside(tl, pools.Share(8, 1, 2))
}

// TestBeside: pool 8, floor 1, share 4 beside small. The rule admits big
// past its share while in_use < 7; small may then take the pool's last
// permits, so big 6 and small 2 together is the rule's state as long as
// small was admitted after big. An off-by-one admitting big at in_use == 7
// shows big 6 and small 2 with small admitted before: caught, though big
// never held more than POOL - FLOOR.
func TestBeside(t *testing.T) {
	rule := []beSample{
		{5, 100, 2, 50},
		{4, 100, 2, 50}, // big released one: in_use 6
		{5, 101, 2, 50}, // admitted at 6 < 7
		{5, 101, 1, 50}, // small released one
		{6, 102, 1, 50}, // admitted at 6 < 7: 7 together
		{6, 102, 2, 51}, // small admitted at 7 < 8: 8 together, small after big
		{6, 102, 2, 51},
		{5, 102, 2, 51}, // big released: in_use 7 = POOL - FLOOR, big refused
		{5, 102, 2, 51},
	}
	offByOne := append(append([]beSample{}, rule...),
		beSample{6, 103, 2, 51}, // admitted at in_use 7: 8 together, small before
		beSample{6, 103, 2, 51},
		beSample{6, 103, 2, 51},
	)
	// The kernel's read, torn: small's holding took an admission its
	// count shows only in the next read.
	trailing := []beSample{
		{5, 100, 1, 50},
		{6, 101, 1, 50}, // admitted at 6 < 7
		{6, 101, 2, 50}, // small admitted at 7 < 8, its count not yet added
		{6, 101, 2, 51},
		{6, 101, 2, 51},
	}
	for _, tc := range []struct {
		name        string
		seq         []beSample
		torn        bool
		slack, each int
		pass        bool
	}{
		{"rule", rule, false, 0, 1, true},
		{"off by one", offByOne, false, 0, 1, false},
		// Torn reads, each taken twice or once, big judged past its share
		// plus one (two CPUs).
		{"rule, torn", rule, true, 1, 2, true},
		{"off by one, torn", offByOne, true, 1, 2, false},
		{"off by one, torn, read once", offByOne, true, 1, 1, false},
		{"count trailing, torn", trailing, true, 1, 1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bd := besideOf(tc.seq, tc.torn, tc.slack, tc.each)
			r := &Report{PoolSize: 8, Floor: 1, Beside: bd, Phases: []Phase{
				{Name: PhaseSolo, Projects: []ProjectResult{{Project: Small, OK: 10, P99Ms: 20}}},
				{Name: PhaseBoth, Projects: []ProjectResult{{Project: Small, OK: 10, P99Ms: 20}, {Project: Big, OK: 10, Refused: 5, MaxHeld: 6}}},
				{Name: PhaseBigAlone, Projects: []ProjectResult{{Project: Big, OK: 10, MaxHeld: 8}}},
			}}
			r.judge(Config{TargetRatio: 2})
			v := r.Verdict(VerdictBigBeside)
			if bd.Checked == 0 || v.Pass != tc.pass {
				t.Errorf("%+v: pass %v, want %v: %s", bd, v.Pass, tc.pass, v.Detail)
			}
		})
	}
	// Read as one instant, the trailing count would be judged: 8.
	if bd := besideOf(trailing, false, 1, 1); bd.Together != 8 {
		t.Errorf("the trailing count, not torn: %+v, want 8 together judged", bd)
	}
	// The same off-by-one read with small admitted in between the
	// samples: nothing says whether big's admission came first, so it is
	// not judged.
	mixed := append(append([]beSample{}, rule...), beSample{6, 103, 2, 52}, beSample{6, 103, 2, 52})
	if bd := besideOf(mixed, false, 0, 1); bd.Together > 7 {
		t.Errorf("judged a sample where small was admitted beside big: %+v", bd)
	}
	// A count that went down (a project forgotten, its counts begun
	// afresh) is no admission.
	reset := []beSample{{5, 100, 2, 50}, {4, 100, 2, 50}, {6, 3, 2, 50}, {6, 3, 2, 50}}
	if bd := besideOf(reset, false, 0, 1); bd.Checked != 0 {
		t.Errorf("judged after a reset: %+v", bd)
	}
}

// BenchmarkDrill runs the HTTP drill with its default phases and reports
// small's p99 under contention as a multiple of its solo p99 (the seed's
// bound is 3, our goal 2), and how often big was refused.
func BenchmarkDrill(b *testing.B) {
	for range b.N {
		rep, err := Run(context.Background(), Config{})
		if err != nil {
			b.Fatal(err)
		}
		solo, both := rep.Result(PhaseSolo, Small), rep.Result(PhaseBoth, Small)
		b.ReportMetric(both.P99Ms/solo.P99Ms, "small-p99-ratio")
		b.ReportMetric(solo.P99Ms, "small-solo-p99-ms")
		b.ReportMetric(both.P99Ms, "small-both-p99-ms")
		b.ReportMetric(float64(rep.Result(PhaseBoth, Big).MaxHeld), "big-max-held")
		if !rep.Pass {
			var buf strings.Builder
			_ = rep.WriteTable(&buf)
			b.Logf("a verdict failed:\n%s", buf.String())
		}
	}
	b.ReportMetric(0, "ns/op")
}
