// SPDX-License-Identifier: Apache-2.0

package main

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/urfave/cli/v2"
)

func statusCommand() *cli.Command {
	return &cli.Command{
		Name:  "status",
		Usage: "show each pool (size, floor, in use, active, share) and its projects",
		Description: "Asks the running daemon over its admin socket. With no daemon answering it says so\n" +
			"and exits 1: the counts live in the daemon and the kernel, not in a file.",
		// No --state-dir: the store holds policies, not the node's state.
		Flags: append([]cli.Flag{configFlag(), adminSocketFlag()},
			&cli.BoolFlag{Name: "json", Usage: "print the daemon's status as JSON (the admin API's /v1/status)"},
			&cli.BoolFlag{Name: "watch", Aliases: []string{"w"}, Usage: "redraw every second until interrupted"},
		),
		Action: func(c *cli.Context) error {
			if c.NArg() > 0 {
				return cli.Exit(fmt.Sprintf("status takes no arguments, got %q", c.Args().First()), 2)
			}
			cfg, err := loadConfig(c)
			if err != nil {
				return err
			}
			cl := admin.NewClient(cfg.AdminSocket)
			show := func() error {
				st, err := cl.Status(c.Context)
				if errors.Is(err, admin.ErrNoDaemon) {
					return cli.Exit(fmt.Sprintf("no daemon answers on %s; is 'fairshare run' running?", cfg.AdminSocket), 1)
				}
				if err != nil {
					return cli.Exit(fmt.Sprintf("reading the status failed: %v", err), 1)
				}
				if c.Bool("json") {
					return writeJSON(c.App.Writer, st)
				}
				return printStatus(c.App.Writer, st)
			}
			if !c.Bool("watch") {
				return show()
			}
			t := time.NewTicker(time.Second)
			defer t.Stop()
			for {
				if !c.Bool("json") {
					fmt.Fprint(c.App.Writer, "\033[H\033[2J") // home and clear
				}
				if err := show(); err != nil {
					return err
				}
				select {
				case <-c.Context.Done():
					return nil
				case <-t.C:
				}
			}
		},
	}
}

func printStatus(w io.Writer, st admin.Status) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "fairshare %s at %s; connections enforced in the kernel: %v\n\n", st.Version, st.Time.Format(time.RFC3339), st.Kernel)
	fmt.Fprintln(tw, "POOL\tENFORCER\tSIZE\tFLOOR\tIN_USE\tACTIVE\tSHARE\tADMITTED\tREFUSED")
	for _, p := range st.Pools {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\n", p.Name, p.Enforcer, p.Size, p.Floor, p.InUse, p.Active, p.Share, p.Admitted, p.Refused)
	}
	fmt.Fprintln(tw)
	fmt.Fprintln(tw, "POOL\tPROJECT\tHELD\tADMITTED\tREFUSED\tACTIVE\tSLEEPING")
	for _, p := range st.Pools {
		for _, pr := range p.Projects {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%v\t%d\n", p.Name, pr.Project, pr.Held, pr.Admitted, pr.Refused, pr.Active, pr.Sleeping)
		}
	}
	printProjects(tw, st)
	if s := st.Scheduler; s != nil {
		fmt.Fprintln(tw)
		fmt.Fprintf(tw, "scheduler: in flight %d, dispatched P1 %d, P2 %d, P3 %d, waits %d (mean %s)\n", s.InFlight,
			s.Dispatched["P1"], s.Dispatched["P2"], s.Dispatched["P3"], s.Wait.Count, meanText(s.Wait))
	}
	return tw.Flush()
}

// printProjects joins, per project, its policy (stored, else the default:
// the scheduler forgets idle participants, so their live state cannot say
// what a project bought), its rate buckets and its live scheduler state.
// Projects with none of these are not listed. "-" marks what is not live.
func printProjects(tw io.Writer, st admin.Status) {
	stored := map[string]admin.Entry{}
	rates := map[string]admin.Rate{}
	parts := map[string]admin.Participant{}
	names := map[string]bool{}
	for _, e := range st.Policies {
		stored[e.Project] = e
		names[e.Project] = true
	}
	for _, r := range st.Rates {
		rates[r.Project] = r
		names[r.Project] = true
	}
	if st.Scheduler != nil {
		for _, p := range st.Scheduler.Participants {
			parts[p.Participant] = p
			names[p.Participant] = true
		}
	}
	if len(names) == 0 {
		return
	}
	fmt.Fprintln(tw)
	fmt.Fprintln(tw, "PROJECT\tPOLICY\tTIER\tSHARES\tREQUESTS/S\tWORK/S\tREQ_TOKENS\tWORK_TOKENS\tLIMITED\tQUEUE\tP1\tP2\tCLASS")
	for _, n := range sortedKeys(names) {
		pol, source := st.DefaultPolicy, "default"
		if e, ok := stored[n]; ok {
			pol, source = e.Policy, "stored"
		}
		r, hasRate := rates[n]
		reqTok, workTok := "-", "-"
		if hasRate && (r.RequestsPerSec > 0 || r.WorkPerSec > 0) {
			reqTok, workTok = strconv.FormatFloat(r.RequestTokens, 'f', 1, 64), strconv.FormatFloat(r.WorkTokens, 'f', 1, 64)
		}
		queue, p1, p2, class := "-", "-", "-", "-"
		if p, ok := parts[n]; ok {
			queue = strconv.Itoa(p.Queue)
			p1, p2 = strconv.FormatFloat(p.P1, 'f', 1, 64), strconv.FormatFloat(p.P2, 'f', 1, 64)
			if p.LastClass != "" {
				class = p.LastClass
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\n", n, source, pol.Tier, pol.Shares,
			rateText(pol.RequestsPerSec), rateText(pol.WorkPerSec), reqTok, workTok, r.Limited, queue, p1, p2, class)
	}
}

func meanText(h admin.Histogram) string {
	if h.Count == 0 {
		return "-"
	}
	return strconv.FormatFloat(h.Sum/float64(h.Count)*1000, 'f', 2, 64) + "ms"
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	for i := 1; i < len(out); i++ {
		for j := i; j > 0 && out[j] < out[j-1]; j-- {
			out[j], out[j-1] = out[j-1], out[j]
		}
	}
	return out
}
