// SPDX-License-Identifier: Apache-2.0

package main

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/daemon"
	projectname "github.com/fairshare-dev/fairshare/internal/project"
	"github.com/fairshare-dev/fairshare/loader"
	"github.com/fairshare-dev/fairshare/policy"
	"github.com/urfave/cli/v2"
)

func statusCommand() *cli.Command {
	return &cli.Command{
		Name:  "status",
		Usage: "show each pool (size, floor, in use, active, share) and its projects",
		Description: "Asks the running daemon over its admin socket. With no daemon answering, it reads the\n" +
			"connections pool from the BPF maps the daemon left pinned (read-only; root), which the\n" +
			"kernel keeps enforcing, and says so; it exits 1 only when neither answers. Names that\n" +
			"are not plain project names (a cgroup may be named anything) are printed quoted.\n\n" +
			examples("fairshare status", "fairshare status --watch", "fairshare status --json"),
		// No --state-dir: the store holds policies, not the node's state.
		Flags: append([]cli.Flag{configFlag(), adminSocketFlag(), pinDirFlag()},
			&cli.BoolFlag{Name: "json", Usage: "print the daemon's status as JSON (the admin API's /v1/status)"},
			&cli.BoolFlag{Name: "watch", Aliases: []string{"w"}, Usage: "redraw every second until interrupted"},
		),
		Action: func(c *cli.Context) error {
			cfg, err := loadConfig(c)
			if err != nil {
				return err
			}
			cl := admin.NewClient(cfg.AdminSocket)
			show := func() error {
				st, err := cl.Status(c.Context)
				if errors.Is(err, admin.ErrNoDaemon) {
					st, err = pinnedStatus(cfg)
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

// wouldText is a WOULD_REFUSE cell: the count, marked while in dry-run.
func wouldText(n uint64, dryRun bool) string {
	if dryRun {
		return strconv.FormatUint(n, 10) + " (dry-run)"
	}
	return strconv.FormatUint(n, 10)
}

// lapseText is the status line of a pool's lapse (connections.lapse_after).
func lapseText(pool string, lp admin.Lapse) string {
	age := (time.Duration(lp.HeartbeatAge * float64(time.Second))).Round(time.Second)
	after := time.Duration(lp.After * float64(time.Second))
	if lp.FleetSafe && !lp.Lapsed {
		lapses := "never lapses (lapse_after 0)"
		if lp.After != 0 {
			lapses = fmt.Sprintf("lapses after %s without one", after)
		}
		return fmt.Sprintf("%s: enforced, FLEET POOLS AT THEIR SAFE SLICES: their lease ended unrenewed (the daemon gone, or cut "+
			"off from etcd), and the other nodes may have taken this node's part; last daemon heartbeat %s ago; %s",
			pool, age, lapses)
	}
	switch {
	case lp.Lapsed:
		return fmt.Sprintf("%s: ENFORCEMENT LAPSED: no daemon heartbeat for %s (lapse_after %s); the kernel counts and refuses nothing "+
			"until a daemon starts (%d asks admitted while lapsed)", pool, age, after, lp.Admitted)
	case lp.After == 0:
		return fmt.Sprintf("%s: enforced; last daemon heartbeat %s ago; never lapses (lapse_after 0)", pool, age)
	default:
		return fmt.Sprintf("%s: enforced; last daemon heartbeat %s ago; lapses after %s without one (%d asks admitted while lapsed, ever)",
			pool, age, after, lp.Admitted)
	}
}

// pinnedStatus is the status while no daemon answers: the connections pool
// from the maps pinned in cfg.PinDir, read-only.
func pinnedStatus(cfg config.Config) (admin.Status, error) {
	noDaemon := fmt.Sprintf("no daemon answers on %s", cfg.AdminSocket)
	if !cfg.BPF {
		return admin.Status{}, fmt.Errorf("%s, and bpf is off in the configuration, so nothing is pinned to read; is 'fairshare run' running?", noDaemon)
	}
	ro, err := loader.OpenReadOnly(cfg.PinDir)
	if errors.Is(err, loader.ErrNotPinned) {
		return admin.Status{}, fmt.Errorf("%s, and nothing is pinned in %s: connections are not enforced; is 'fairshare run' running?", noDaemon, cfg.PinDir)
	}
	if err != nil {
		return admin.Status{}, fmt.Errorf("%s; reading the pinned maps: %v", noDaemon, err)
	}
	defer ro.Close()
	s, err := ro.Snapshot()
	if err != nil {
		return admin.Status{}, fmt.Errorf("%s; reading the pinned maps: %v", noDaemon, err)
	}
	active, err := ro.KernelActive()
	if err != nil {
		return admin.Status{}, fmt.Errorf("%s; reading the pinned maps: %v", noDaemon, err)
	}
	return admin.Status{Version: version, Time: time.Now(), Kernel: true, Source: "pins",
		Pools: append([]admin.Pool{daemon.KernelPool(s, active, admin.Forgotten{})}, daemon.DestPools(s)...)}, nil
}

func printStatus(w io.Writer, st admin.Status) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	if st.Source == "pins" {
		fmt.Fprintf(tw, "fairshare: no daemon is running. The connections pool below is read from the maps it left pinned\n"+
			"(read-only, at %s); the kernel keeps counting and refusing with them. Requests, residents,\n"+
			"flights and policies are not served until 'fairshare run' starts again; until then the kernel's\n"+
			"active count only grows, so the share only shrinks.\n\n", st.Time.Format(time.RFC3339))
	} else {
		fmt.Fprintf(tw, "fairshare %s at %s; connections enforced in the kernel: %v\n\n", st.Version, st.Time.Format(time.RFC3339), st.Kernel)
	}
	// RATE_LIMITED: asks refused by their project's own rate (not in
	// REFUSED). WOULD_REFUSE: asks dry-run admitted that the rule refused
	// (in ADMITTED too); "(dry-run)" marks a pool or project in dry-run.
	fmt.Fprintln(tw, "POOL\tENFORCER\tSIZE\tFLOOR\tIN_USE\tACTIVE\tSHARE\tADMITTED\tREFUSED\tRATE_LIMITED\tWOULD_REFUSE")
	for _, p := range st.Pools {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%s\n", projectname.Display(p.Name), p.Enforcer, p.Size, p.Floor, p.InUse,
			p.Active, p.Share, p.Admitted, p.Refused, p.RateLimited, wouldText(p.WouldRefuse, p.DryRun))
	}
	// Destination pools: what they count (docs/destination-pools.md).
	for _, p := range st.Pools {
		if len(p.Destinations) > 0 || p.Removed {
			what := "destinations " + strings.Join(p.Destinations, " ")
			if p.Removed {
				what = "removed; its connections give back what they hold as they close"
			}
			fmt.Fprintf(tw, "%s: %s\n", projectname.Display(p.Name), what)
		}
	}
	fmt.Fprintln(tw)
	fmt.Fprintln(tw, "POOL\tPROJECT\tHELD\tADMITTED\tREFUSED\tRATE_LIMITED\tACTIVE\tSLEEPING\tWOULD_REFUSE")
	for _, p := range st.Pools {
		for _, pr := range p.Projects {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%v\t%d\t%s\n", projectname.Display(p.Name), projectname.Display(pr.Project), pr.Held,
				pr.Admitted, pr.Refused, pr.RateLimited, pr.Active, pr.Sleeping, wouldText(pr.WouldRefuse, pr.DryRun))
		}
		// What forgotten projects had been counted, so the rows add up to
		// the pool's totals.
		if f := p.Forgotten; f.Admitted > 0 || f.Refused > 0 || f.RateLimited > 0 || f.WouldRefuse > 0 {
			fmt.Fprintf(tw, "%s\t(forgotten: %d)\t0\t%d\t%d\t%d\tfalse\t0\t%d\n", projectname.Display(p.Name), f.Projects, f.Admitted, f.Refused,
				f.RateLimited, f.WouldRefuse)
		}
	}
	for _, p := range st.Pools {
		if lp := p.Lapse; lp != nil {
			fmt.Fprintln(tw)
			fmt.Fprintln(tw, lapseText(p.Name, *lp))
		}
		if e := p.KernelEvents; e != nil {
			if p.Lapse == nil {
				fmt.Fprintln(tw)
			}
			fmt.Fprintf(tw, "%s: kernel events, ever on these pins: adopted %d, late %d, unaccounted %d, expired %d, map_full %d\n",
				p.Name, e.Adopted, e.Late, e.Unaccounted, e.Expired, e.MapFull)
			if e.MapFull > 0 {
				fmt.Fprintf(tw, "%s: a kernel table had no room: connections or project listeners went uncounted (map_full %d); "+
					"see map_full in docs/troubleshooting.md\n", p.Name, e.MapFull)
			}
		}
		if e := p.Exempt; e != nil && len(e.Missing) > 0 {
			fmt.Fprintln(tw)
			fmt.Fprintf(tw, "%s: exempt cgroups not made yet (exempt once they are): %s\n", p.Name, strings.Join(e.Missing, ", "))
		}
	}
	printProjects(tw, st)
	printFleet(tw, st)
	if s := st.Scheduler; s != nil {
		fmt.Fprintln(tw)
		fmt.Fprintf(tw, "scheduler: in flight %d, dispatched P1 %d, P2 %d, P3 %d, waits %d (mean %s)\n", s.InFlight,
			s.Dispatched["P1"], s.Dispatched["P2"], s.Dispatched["P3"], s.Wait.Count, meanText(s.Wait))
	}
	if r := st.Reconcile; r != nil {
		fmt.Fprintln(tw)
		if r.Error != "" {
			fmt.Fprintf(tw, "reconcile: the last pass, at %s, failed: %s (%d passes, %d failed)\n",
				r.Time.Format(time.RFC3339), r.Error, r.Passes, r.Failures)
		} else {
			fmt.Fprintf(tw, "reconcile: last pass at %s (%s ago): %d project sockets in the kernel's table, %d permits held, %d repairs"+
				" (adopted %d, orphans %d, stale listeners %d); %d passes, %d repairs in all\n",
				r.Time.Format(time.RFC3339), time.Since(r.Time).Round(time.Second), r.Sockets, r.Held, r.Repairs,
				r.Adopted, r.Orphans, r.StaleListeners, r.Passes, r.RepairsTotal)
			if r.Unadopted > 0 {
				fmt.Fprintf(tw, "reconcile: %d project sockets hold no permit and could not be adopted: the held-permit table has no room; they count nowhere until a pass finds room\n",
					r.Unadopted)
			}
		}
	}
	if f := st.PoliciesFile; f != nil {
		fmt.Fprintln(tw)
		if f.LoadedAt.IsZero() {
			fmt.Fprintf(tw, "policies file %s: not read yet", f.Path)
		} else {
			fmt.Fprintf(tw, "policies file %s: %d projects, read at %s", f.Path, f.Projects, f.LoadedAt.Format(time.RFC3339))
		}
		if f.Error != "" {
			fmt.Fprintf(tw, "; its current content is REFUSED since %s (%s), the policies read before stay in force",
				f.RefusedAt.Format(time.RFC3339), f.Error)
		}
		if f.Pending {
			fmt.Fprintf(tw, "; a change is read, in force at the next poll if the file still reads the same")
		}
		if f.Refusals > 0 {
			fmt.Fprintf(tw, "; %d contents refused since the daemon started", f.Refusals)
		}
		fmt.Fprintln(tw)
	}
	if len(st.Listeners) > 0 {
		fmt.Fprintln(tw)
		fmt.Fprintln(tw, "LISTENER\tOPEN\tPEERS\tMAX\tMAX_PER_PEER\tACCEPTED\tREFUSED\tACCEPT_ERRORS")
		for _, l := range st.Listeners {
			var refused uint64
			for _, n := range l.Refused {
				refused += n
			}
			fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\n", l.Name, l.Open, l.Peers, l.MaxConns, l.MaxPerPeer, l.Accepted, refused, l.AcceptErrors)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if m := st.Membership; m != nil {
		fmt.Fprintln(w)
		return printMembership(w, m, st.Kernel)
	}
	return nil
}

// printMembership prints the sources, the members by project and source
// (a row each, its cgroups counted: 'fairshare project list' lists them
// all), the refused ones with why, and the members' network namespaces.
func printMembership(w io.Writer, m *admin.Membership, enforced bool) error {
	var parts []string
	for _, s := range m.Sources {
		p := fmt.Sprintf("%s %d", s.Name, s.Members)
		if s.Refused > 0 {
			p += fmt.Sprintf(" (%d refused)", s.Refused)
		}
		if s.Error != "" {
			p += " (last read failed: " + s.Error + ")"
		}
		parts = append(parts, p)
	}
	fmt.Fprintf(w, "members by source: %s\n", strings.Join(parts, ", "))
	switch {
	case m.Kernel:
		fmt.Fprintln(w, "the kernel limits connections by these members")
	case enforced:
		fmt.Fprintln(w, "the kernel takes no members")
	default:
		fmt.Fprintln(w, "connections are not limited in the kernel (bpf off)")
	}
	if err := printMembers(w, *m, false, true); err != nil {
		return err
	}
	if m.Netns != nil {
		fmt.Fprintln(w)
		return printNetns(w, m.Netns, m.Kernel)
	}
	return nil
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
	fmt.Fprintln(tw, "PROJECT\tPOLICY\tTIER\tSHARES\tREQUESTS/S\tWORK/S\tCONNECTIONS/S\tACCEPTS/S\tREQ_TOKENS\tWORK_TOKENS\tLIMITED\tQUEUE\tP1\tP2\tCLASS")
	for _, n := range sortedKeys(names) {
		pol, source := st.DefaultPolicy, "default"
		if e, ok := stored[n]; ok {
			pol, source = e.Policy, "stored"
			if e.Source == policy.SourceFile {
				source = "file" // as policy list says: set in the policies file, not with the CLI
			}
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
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\n", projectname.Display(n), source, pol.Tier, pol.Shares,
			rateText(pol.RequestsPerSec), rateText(pol.WorkPerSec), rateText(pol.ConnectionsPerSec), rateText(pol.AcceptsPerSec), reqTok, workTok, r.Limited, queue, p1, p2, class)
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

// printFleet prints each fleet pool: the fleet's size, this node's
// allotment and link to etcd, and each project's fleet share and holdings.
func printFleet(tw io.Writer, st admin.Status) {
	for _, p := range st.Pools {
		f := p.Fleet
		if f == nil {
			continue
		}
		fmt.Fprintln(tw)
		fmt.Fprintf(tw, "fleet pool %s: size %d across %d nodes, %d projects active, fleet share %d; node %s: allotment %d (spare %d, safe slice %d); %s since %s\n",
			projectname.Display(p.Name), f.Size, f.Nodes, f.Active, f.Share, f.Node, f.Allotment, f.Spare, f.Safe, f.State,
			f.Since.Format(time.RFC3339))
		fmt.Fprintln(tw, "FLEET POOL\tPROJECT\tFLEET_SHARE\tFLEET_HELD\tNODES\tCAP_HERE\tHELD_HERE")
		for _, pr := range f.Projects {
			c := strconv.Itoa(pr.Cap)
			if pr.Cap < 0 {
				c = "-"
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%s\t%d\n", projectname.Display(p.Name), projectname.Display(pr.Project), pr.Alloc,
				pr.FleetHeld, pr.Nodes, c, pr.Held)
		}
	}
}
