// SPDX-License-Identifier: Apache-2.0

package compare

import (
	"fmt"
	"io"
	"slices"
	"strings"
)

// Share is what one group of projects (a name less its trailing digits:
// heavy, light, mouse) got in one run, per project of the group: its share
// of the seat-seconds all projects held, of the seat-seconds max-min
// fairness gives them, and of the requests all projects completed.
type Share struct {
	Group    string
	Projects int
	SeatTime float64 // seat-seconds held / all projects' seat-seconds held
	Fair     float64 // seat-seconds max-min gives / all projects' seat-seconds max-min gives
	Requests float64 // requests completed / all projects' requests
}

// groupOf is a project's group: its name less its trailing digits.
func groupOf(project string) string { return strings.TrimRight(project, "0123456789") }

// Shares is each group's share in res, per project of the group, groups in
// the order of their names.
func (res Result) Shares() []Share {
	var held, fair float64
	reqs := 0
	for _, p := range res.Projects {
		held += p.HeldSec
		fair += p.FairSec
		reqs += p.Requests
	}
	var out []Share
	for _, p := range res.Projects {
		g := groupOf(p.Name)
		i := slices.IndexFunc(out, func(s Share) bool { return s.Group == g })
		if i < 0 {
			out = append(out, Share{Group: g})
			i = len(out) - 1
		}
		s := &out[i]
		s.Projects++
		if held > 0 {
			s.SeatTime += p.HeldSec / held
		}
		if fair > 0 {
			s.Fair += p.FairSec / fair
		}
		if reqs > 0 {
			s.Requests += float64(p.Requests) / float64(reqs)
		}
	}
	for i := range out {
		n := float64(out[i].Projects)
		out[i].SeatTime /= n
		out[i].Fair /= n
		out[i].Requests /= n
	}
	slices.SortFunc(out, func(a, b Share) int { return strings.Compare(a.Group, b.Group) })
	return out
}

// MedianShares is each group's Shares over a row's runs, the median of
// each number over the seeds, groups in the order of their names.
func (row Row) MedianShares() []Share {
	var runs [][]Share
	for _, res := range row.Runs {
		runs = append(runs, res.Shares())
	}
	if len(runs) == 0 {
		return nil
	}
	out := slices.Clone(runs[0])
	for i := range out {
		pick := func(f func(Share) float64) float64 {
			var v []float64
			for _, r := range runs {
				if j := slices.IndexFunc(r, func(s Share) bool { return s.Group == out[i].Group }); j >= 0 {
					v = append(v, f(r[j]))
				}
			}
			return median(v)
		}
		out[i].SeatTime = pick(func(s Share) float64 { return s.SeatTime })
		out[i].Fair = pick(func(s Share) float64 { return s.Fair })
		out[i].Requests = pick(func(s Share) float64 { return s.Requests })
	}
	return out
}

// median of v (the mean of the middle two for an even count); 0 for none.
func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// writeShares prints, for workload, each system's share of the seat-time
// and of the requests per project of each group, the median over the
// seeds: fairness by seat-time is what max-min (and APF) aims at.
func (r *Report) writeShares(w io.Writer, workload string) {
	var rows []Row
	for _, row := range r.Rows {
		if row.Workload == workload && len(row.Runs) > 0 {
			rows = append(rows, row)
		}
	}
	if len(rows) == 0 {
		return
	}
	groups := rows[0].MedianShares()
	fmt.Fprintf(w, "%s: each project's share of the seat-time held and of the requests completed (median over the seeds); max-min seat-time share", workload)
	for _, g := range groups {
		fmt.Fprintf(w, " %s %.1f%%", g.Group, 100*g.Fair)
	}
	fmt.Fprint(w, "\n\n| system |")
	for _, g := range groups {
		fmt.Fprintf(w, " %s seat-time | %s requests |", g.Group, g.Group)
	}
	fmt.Fprint(w, "\n|---|")
	for range groups {
		fmt.Fprint(w, "---:|---:|")
	}
	fmt.Fprintln(w)
	for _, row := range rows {
		fmt.Fprintf(w, "| %s |", row.System)
		ms := row.MedianShares()
		for _, g := range groups {
			if j := slices.IndexFunc(ms, func(s Share) bool { return s.Group == g.Group }); j >= 0 {
				fmt.Fprintf(w, " %.1f%% | %.1f%% |", 100*ms[j].SeatTime, 100*ms[j].Requests)
			} else {
				fmt.Fprint(w, " - | - |")
			}
		}
		fmt.Fprintln(w)
	}
}
