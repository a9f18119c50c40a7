// SPDX-License-Identifier: Apache-2.0

package compare

import (
	"bufio"
	"fmt"
	"io"
	"slices"

	"github.com/fairshare-dev/fairshare/pools"
)

// WriteSVG draws, one panel above the other, the seats each project held
// over the first seed's run of workload for each of systems, with the
// seats in use and a dashed line at POOL - FLOOR. Hand-written SVG, as the
// drill's: no dependencies.
func (r *Report) WriteSVG(w io.Writer, workload string, systems []string) error {
	const (
		W, padL, padR, padT, padB = 960, 56, 150, 36, 40
		panelH                    = 220
		plotW                     = W - padL - padR
	)
	var runs []Result
	for _, s := range systems {
		row, ok := r.Row(s, workload)
		if !ok || len(row.Runs) == 0 {
			return fmt.Errorf("no %s run of %s to plot", s, workload)
		}
		runs = append(runs, row.Runs[0])
	}
	H := padT + len(runs)*(panelH+padB+24)
	bw := bufio.NewWriter(w)
	total := r.Duration.Seconds()
	x := func(s float64) float64 { return padL + s/total*plotW }
	fmt.Fprintf(bw, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n", W, H, W, H)
	fmt.Fprintf(bw, `<rect width="%d" height="%d" fill="white"/>`+"\n", W, H)
	// One colour per project, in first-seen order of the first run.
	palette := []string{"#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"}
	var names []string
	for _, res := range runs {
		for _, p := range res.Projects {
			if !slices.Contains(names, p.Name) {
				names = append(names, p.Name)
			}
		}
	}
	color := func(name string) string { return palette[slices.Index(names, name)%len(palette)] }
	maxY := float64(r.Pool)
	for i, res := range runs {
		top := padT + i*(panelH+padB+24)
		y := func(v float64) float64 { return float64(top) + panelH - v/maxY*panelH }
		fmt.Fprintf(bw, `<text x="%d" y="%d" font-size="14">%s, %s workload (seed %d): seats held per project, pool %d</text>`+"\n", padL, top-10, res.System, res.Workload, res.Seed, r.Pool)
		for k := 0; k <= 4; k++ {
			v := maxY * float64(k) / 4
			fmt.Fprintf(bw, `<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", padL, padL+plotW, y(v), y(v))
			fmt.Fprintf(bw, `<text x="%d" y="%.1f" text-anchor="end">%g</text>`+"\n", padL-6, y(v)+4, v)
		}
		for s := 0.0; s <= total; s++ {
			fmt.Fprintf(bw, `<text x="%.1f" y="%d" text-anchor="middle">%gs</text>`+"\n", x(s), top+panelH+16, s)
		}
		for _, name := range names {
			fmt.Fprintf(bw, `<polyline fill="none" stroke="%s" stroke-width="1.2" points="`, color(name))
			// A point where the count changes (and the one before it),
			// so that flat stretches cost two points.
			for k, s := range res.Samples {
				v := s.Held[name]
				last := k == len(res.Samples)-1
				if k > 0 && !last && v == res.Samples[k-1].Held[name] && v == res.Samples[k+1].Held[name] {
					continue
				}
				fmt.Fprintf(bw, "%.1f,%.1f ", x(s.At.Seconds()), y(float64(v)))
			}
			fmt.Fprintln(bw, `"/>`)
		}
		// The seats in use, all projects together, and POOL - FLOOR, where
		// fairshare stops a project at or over its share.
		fmt.Fprint(bw, `<polyline fill="none" stroke="black" stroke-width="1" points="`)
		for _, s := range res.Samples {
			tot := 0
			for _, v := range s.Held {
				tot += v
			}
			fmt.Fprintf(bw, "%.1f,%.1f ", x(s.At.Seconds()), y(float64(tot)))
		}
		fmt.Fprintln(bw, `"/>`)
		pf := float64(r.Pool - pools.DefaultFloor(r.Pool))
		fmt.Fprintf(bw, `<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#888" stroke-dasharray="4 3"/>`+"\n", padL, padL+plotW, y(pf), y(pf))
		fmt.Fprintf(bw, `<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="black" stroke-width="2"/><text x="%d" y="%d">in use (all)</text>`+"\n",
			padL+plotW+10, padL+plotW+30, top+panelH-4, top+panelH-4, padL+plotW+36, top+panelH)
		fmt.Fprintf(bw, `<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="#888" stroke-dasharray="4 3"/><text x="%d" y="%d">POOL - FLOOR</text>`+"\n",
			padL+plotW+10, padL+plotW+30, top+panelH-19, top+panelH-19, padL+plotW+36, top+panelH-15)
		for k, name := range names {
			ly := top + 14 + k*15
			fmt.Fprintf(bw, `<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="%s" stroke-width="2"/><text x="%d" y="%d">%s</text>`+"\n",
				padL+plotW+10, padL+plotW+30, ly-4, ly-4, color(name), padL+plotW+36, ly, name)
		}
	}
	fmt.Fprintln(bw, `</svg>`)
	return bw.Flush()
}
