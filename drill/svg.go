// SPDX-License-Identifier: Apache-2.0

package drill

import (
	"bufio"
	"fmt"
	"io"
	"math"
)

// svg geometry, in user units.
const (
	svgW                = 960
	padL, padR          = 64, 150
	padT, padB          = 36, 48
	plotW, plotH        = svgW - padL - padR, 336
	svgPointsPerProject = 4000
	// The second panel, permits held, sits below the first.
	heldT, heldH = padT + plotH + padB + 28, 220
	svgH         = heldT + heldH + padB
)

var svgColors = map[string]string{Small: "#1f77b4", Big: "#d62728"}

// WriteSVG draws two panels over the same time axis. The first has the
// latency of every admitted request, from its first ask (refusals and
// retries included), per project, on a log scale: the small project's tens
// of milliseconds and the big one's waits of up to seconds both show. A line
// follows each project's p99 per quarter second, and the phase boundaries
// are marked. The second has
// the permits each project held, with lines at POOL and POOL - FLOOR: the
// rule's claim made visible, the big project stopping one floor short of
// the pool while the small one is active and taking all of it once alone.
// Hand-written SVG: no dependencies.
func (r *Report) WriteSVG(w io.Writer) error {
	bw := bufio.NewWriter(w)
	total := 3 * r.PhaseSeconds
	minMs, maxMs := math.Inf(1), 1.0
	for _, p := range r.points {
		minMs = math.Min(minMs, ms(p.latency))
		maxMs = math.Max(maxMs, ms(p.latency))
	}
	if len(r.points) == 0 {
		minMs = 1
	}
	maxMs = niceCeil(maxMs)
	// The scale starts at a 1, 2 or 5 at or below the fastest, at least a
	// decade below the top.
	lo := math.Min(niceFloor(math.Max(minMs, 0.1)), maxMs/10)
	unit := "requests"
	if r.Scenario == "connections" {
		unit = "connections"
	}
	x := func(s float64) float64 { return padL + s/total*plotW }
	y := func(v float64) float64 {
		f := math.Log(math.Max(v, lo)/lo) / math.Log(maxMs/lo)
		return padT + plotH - f*plotH
	}

	fmt.Fprintf(bw, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n", svgW, svgH, svgW, svgH)
	fmt.Fprintf(bw, `<rect width="%d" height="%d" fill="white"/>`+"\n", svgW, svgH)
	fmt.Fprintf(bw, `<text x="%d" y="20" font-size="14">fair-share drill (%s): latency from the first ask, retries included, pool %d</text>`+"\n", padL, r.Scenario, r.PoolSize)
	// Axes and grid: 1, 2 and 5 times each power of ten.
	for _, v := range logTicks(lo, maxMs) {
		fmt.Fprintf(bw, `<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", padL, padL+plotW, y(v), y(v))
		fmt.Fprintf(bw, `<text x="%d" y="%.1f" text-anchor="end">%g</text>`+"\n", padL-6, y(v)+4, v)
	}
	fmt.Fprintf(bw, `<text x="16" y="%d" transform="rotate(-90 16 %d)" text-anchor="middle">latency (ms, log scale)</text>`+"\n", padT+plotH/2, padT+plotH/2)
	// Phases: "both" slices shaded, a dashed line where each phase (or run
	// of slices) begins, the phase named over it when there is room.
	for _, sp := range r.Spans {
		if sp.Phase == PhaseBoth {
			fmt.Fprintf(bw, `<rect x="%.1f" y="%d" width="%.1f" height="%d" fill="#f3e3e3"/>`+"\n", x(sp.StartS), padT, x(sp.EndS)-x(sp.StartS), plotH)
		}
	}
	labels := []struct {
		at, width float64
		name      string
	}{{0, 2 * r.PhaseSeconds, PhaseSolo + " / " + PhaseBoth + " (shaded), taking turns"}, {2 * r.PhaseSeconds, r.PhaseSeconds, PhaseBigAlone}}
	if r.Slices <= 1 {
		labels = []struct {
			at, width float64
			name      string
		}{{0, r.PhaseSeconds, PhaseSolo}, {r.PhaseSeconds, r.PhaseSeconds, PhaseBoth}, {2 * r.PhaseSeconds, r.PhaseSeconds, PhaseBigAlone}}
	}
	for _, l := range labels {
		fmt.Fprintf(bw, `<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" stroke="#888" stroke-dasharray="4 3"/>`+"\n", x(l.at), x(l.at), padT, padT+plotH)
		fmt.Fprintf(bw, `<text x="%.1f" y="%d" text-anchor="middle" fill="#444">%s</text>`+"\n", x(l.at+l.width/2), padT+12, l.name)
	}
	for s := 0.0; s <= total+1e-9; s += math.Max(1, math.Round(total/10)) {
		fmt.Fprintf(bw, `<text x="%.1f" y="%d" text-anchor="middle">%gs</text>`+"\n", x(s), padT+plotH+18, s)
	}
	fmt.Fprintf(bw, `<text x="%d" y="%d" text-anchor="middle">time since the solo phase began</text>`+"\n", padL+plotW/2, svgH-8)
	fmt.Fprintf(bw, `<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#444"/>`+"\n", padL, padT, plotW, plotH)
	// Dots, thinned evenly when there are very many.
	for _, project := range []string{Big, Small} {
		var pts []point
		for _, p := range r.points {
			if p.project == project {
				pts = append(pts, p)
			}
		}
		step := max(1, len(pts)/svgPointsPerProject)
		fmt.Fprintf(bw, `<g fill="%s" fill-opacity="0.35">`+"\n", svgColors[project])
		for i := 0; i < len(pts); i += step {
			p := pts[i]
			fmt.Fprintf(bw, `<circle cx="%.1f" cy="%.1f" r="1.6"/>`+"\n", x(p.at.Seconds()), y(ms(p.latency)))
		}
		fmt.Fprintln(bw, `</g>`)
	}
	// p99 lines.
	for i, project := range []string{Small, Big} {
		fmt.Fprintf(bw, `<polyline fill="none" stroke="%s" stroke-width="2" points="`, svgColors[project])
		for _, b := range r.Timeline {
			if b.Project == project {
				fmt.Fprintf(bw, "%.1f,%.1f ", x(b.StartS+0.125), y(b.P99Ms))
			}
		}
		fmt.Fprintln(bw, `"/>`)
		ly := padT + 20 + i*36
		fmt.Fprintf(bw, `<circle cx="%d" cy="%d" r="4" fill="%s"/>`+"\n", padL+plotW+16, ly, svgColors[project])
		fmt.Fprintf(bw, `<text x="%d" y="%d">%s: %s</text>`+"\n", padL+plotW+26, ly+4, project, unit)
		fmt.Fprintf(bw, `<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="%s" stroke-width="2"/>`+"\n", padL+plotW+10, padL+plotW+22, ly+16, ly+16, svgColors[project])
		fmt.Fprintf(bw, `<text x="%d" y="%d">%s: p99 / 250ms</text>`+"\n", padL+plotW+26, ly+20, project)
	}
	r.writeHeldPanel(bw, x)
	fmt.Fprintln(bw, `</svg>`)
	return bw.Flush()
}

// writeHeldPanel draws permits held per project over time (x maps seconds
// to the shared time axis).
func (r *Report) writeHeldPanel(bw *bufio.Writer, x func(float64) float64) {
	top := float64(r.PoolSize) + math.Max(1, float64(r.PoolSize)/8)
	y := func(v float64) float64 { return heldT + heldH - v/top*heldH }
	fmt.Fprintf(bw, `<text x="%d" y="%d" font-size="14">permits held per project (sampled every few ms, most in each %s)</text>`+"\n",
		padL, heldT-10, heldBin)
	for _, sp := range r.Spans {
		if sp.Phase == PhaseBoth {
			fmt.Fprintf(bw, `<rect x="%.1f" y="%d" width="%.1f" height="%d" fill="#f3e3e3"/>`+"\n", x(sp.StartS), heldT, x(sp.EndS)-x(sp.StartS), heldH)
		}
	}
	step := math.Max(1, niceCeil(float64(r.PoolSize)/5))
	for v := 0.0; v <= top; v += step {
		fmt.Fprintf(bw, `<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#eee"/>`+"\n", padL, padL+plotW, y(v), y(v))
		fmt.Fprintf(bw, `<text x="%d" y="%.1f" text-anchor="end">%g</text>`+"\n", padL-6, y(v)+4, v)
	}
	fmt.Fprintf(bw, `<text x="16" y="%d" transform="rotate(-90 16 %d)" text-anchor="middle">permits held</text>`+"\n", heldT+heldH/2, heldT+heldH/2)
	for _, l := range []struct {
		v    int
		name string
		dash string
	}{{r.PoolSize, "POOL", ""}, {r.PoolSize - r.Floor, "POOL - FLOOR", ` stroke-dasharray="6 4"`}} {
		fmt.Fprintf(bw, `<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#333"%s/>`+"\n", padL, padL+plotW, y(float64(l.v)), y(float64(l.v)), l.dash)
		fmt.Fprintf(bw, `<text x="%d" y="%.1f" fill="#333">%s = %d</text>`+"\n", padL+plotW+10, y(float64(l.v))+4, l.name, l.v)
	}
	w := heldBin.Seconds()
	for i, project := range []string{Small, Big} {
		fmt.Fprintf(bw, `<polyline fill="none" stroke="%s" stroke-width="1.6" points="`, svgColors[project])
		for _, b := range r.Held {
			if b.Project == project {
				fmt.Fprintf(bw, "%.1f,%.1f %.1f,%.1f ", x(b.StartS), y(float64(b.Held)), x(b.StartS+w), y(float64(b.Held)))
			}
		}
		fmt.Fprintln(bw, `"/>`)
		ly := heldT + heldH - 40 + i*18
		fmt.Fprintf(bw, `<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="%s" stroke-width="2"/>`+"\n", padL+plotW+10, padL+plotW+22, ly, ly, svgColors[project])
		fmt.Fprintf(bw, `<text x="%d" y="%d">%s: held</text>`+"\n", padL+plotW+26, ly+4, project)
	}
	total := 3 * r.PhaseSeconds
	for s := 0.0; s <= total+1e-9; s += math.Max(1, math.Round(total/10)) {
		fmt.Fprintf(bw, `<text x="%.1f" y="%d" text-anchor="middle">%gs</text>`+"\n", x(s), heldT+heldH+18, s)
	}
	fmt.Fprintf(bw, `<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#444"/>`+"\n", padL, heldT, plotW, heldH)
}

// niceFloor rounds v (> 0) down to 1, 2 or 5 times a power of ten.
func niceFloor(v float64) float64 {
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{5, 2, 1} {
		if v >= m*p {
			return m * p
		}
	}
	return p
}

// logTicks are the values 1, 2 and 5 times a power of ten from lo to hi.
func logTicks(lo, hi float64) []float64 {
	var out []float64
	for e := math.Floor(math.Log10(lo)); math.Pow(10, e) <= hi*(1+1e-9); e++ {
		p := math.Pow(10, e)
		for _, m := range []float64{1, 2, 5} {
			if v := m * p; v >= lo*(1-1e-9) && v <= hi*(1+1e-9) {
				out = append(out, v)
			}
		}
	}
	return out
}

// niceCeil rounds v up to 1, 2 or 5 times a power of ten.
func niceCeil(v float64) float64 {
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
}
