// SPDX-License-Identifier: Apache-2.0

package main

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/membership"
	projectname "github.com/fairshare-dev/fairshare/internal/project"
	"github.com/fairshare-dev/fairshare/policy"
	"github.com/urfave/cli/v2"
)

func projectCommand() *cli.Command {
	jsonFlag := &cli.BoolFlag{Name: "json", Usage: "print JSON"}
	cgroupFlag := func(usage string) cli.Flag {
		return &cli.StringSliceFlag{Name: "cgroup", Usage: usage}
	}
	return &cli.Command{
		Name:  "project",
		Usage: "register cgroups to projects, remove them, list every project's cgroups",
		Description: "A project is a name; its members are cgroups, and every process in a member or in a cgroup\n" +
			"below it belongs to the project. Members come from the sources in projects.sources: the\n" +
			"children of projects_root (directory), the fairshare-<name>.slice slices of a systemd slice\n" +
			"(systemd), and the cgroups registered with this command (registered), at any depth: a pod's\n" +
			"cgroup, a service's, a container's.\n\n" +
			"A cgroup belongs to one project: registering a cgroup that is a member already, or one at,\n" +
			"above or below another project's member, is refused and nothing is stored. A PATH is the\n" +
			"cgroup's directory (/sys/fs/cgroup/kubepods/burstable/pod<uid>) or its path as\n" +
			"/proc/<pid>/cgroup shows it (/kubepods/burstable/pod<uid>, /system.slice/web.service).\n\n" +
			"The running daemon stores a registration and answers once it is in force; with no daemon\n" +
			"running, add and remove write the store in --state-dir (checked against the registrations\n" +
			"only; the daemon checks the other sources when it starts) and list shows what is stored\n" +
			"(nothing where nothing ever was: it creates no store).\n\n" +
			examples(
				"fairshare project add web --cgroup /system.slice/web.service",
				"fairshare project list",
			),
		Subcommands: []*cli.Command{
			{
				Name:      "add",
				Usage:     "register cgroups to a project",
				ArgsUsage: "PROJECT --cgroup PATH [--cgroup PATH...]",
				Description: examples(
					"fairshare project add web --cgroup /system.slice/web.service",
					"fairshare project add team-a --cgroup /kubepods/burstable/pod<uid>",
					"fairshare project add reports --cgroup /system.slice/reports.service --cgroup /system.slice/reports-worker.service",
				),
				Flags:  append(policyFlags(), cgroupFlag("cgroup `PATH` to register, repeatable (required)"), jsonFlag),
				Action: projectAdd,
			},
			{
				Name:      "remove",
				Usage:     "remove registrations of a project: the cgroups given, or all of them",
				ArgsUsage: "PROJECT [--cgroup PATH...]",
				Description: "Removing a registration releases nothing the project holds (its permits end with their\n" +
					"sockets); new connections from the cgroup stop counting for it.\n\n" +
					examples(
						"fairshare project remove web --cgroup /system.slice/web.service",
						"fairshare project remove team-a",
					),
				Flags:  append(policyFlags(), cgroupFlag("registered cgroup `PATH` to remove, repeatable; none removes every one of PROJECT's"), jsonFlag),
				Action: projectRemove,
			},
			{
				Name:        "list",
				Usage:       "list the members of every project (or of PROJECT), by source, whether the kernel limits each, and the refused ones with why",
				ArgsUsage:   "[PROJECT]",
				Description: examples("fairshare project list", "fairshare project list web --json"),
				Flags:       append(policyFlags(), jsonFlag),
				Action:      projectList,
			},
		},
	}
}

// projectsBackend is where registrations live for this invocation: the
// daemon if one answers, else the store file.
type projectsBackend interface {
	register(project string, cgroups []string) (admin.Registration, error)
	unregister(project string, cgroups []string) (admin.Registration, error)
	list() (admin.Membership, error)
	close() error
}

type projectsViaDaemon struct{ viaDaemon }

func (v projectsViaDaemon) register(p string, cgs []string) (admin.Registration, error) {
	return v.c.Register(v.ctx, p, cgs)
}
func (v projectsViaDaemon) unregister(p string, cgs []string) (admin.Registration, error) {
	return v.c.Unregister(v.ctx, p, cgs)
}
func (v projectsViaDaemon) list() (admin.Membership, error) { return v.c.Projects(v.ctx) }

// projectsViaStore writes the store itself. It checks what it can without
// the other sources: the paths, and conflicts among the registrations.
type projectsViaStore struct {
	s     *policy.Store
	mount cgroup.Mount
}

func (v projectsViaStore) register(project string, cgs []string) (admin.Registration, error) {
	paths, err := resolveCgroups(v.mount, cgs, true)
	if err != nil {
		return admin.Registration{}, err
	}
	var ms []membership.Member
	for _, cg := range paths {
		ms = append(ms, membership.Member{Project: project, Cgroup: cg})
	}
	_, err = v.s.AddMembers(ms, func(stored []membership.Member) error {
		var es []membership.Entry
		for _, m := range stored {
			es = append(es, membership.Entry{Member: m, Source: membership.SourceRegistered})
		}
		tree := membership.NewTree(es)
		for _, m := range ms {
			why := tree.Check(membership.Entry{Member: m, Source: membership.SourceRegistered})
			if why != "" && !strings.HasPrefix(why, "also registered for project "+project+" ") {
				return fmt.Errorf("%w: %s: %s", membership.ErrRefused, m.Cgroup, why)
			}
		}
		return nil
	})
	if err != nil {
		return admin.Registration{}, err
	}
	return v.registration(project, ms, nil)
}

func (v projectsViaStore) unregister(project string, cgs []string) (admin.Registration, error) {
	paths, err := resolveCgroups(v.mount, cgs, false)
	if err != nil {
		return admin.Registration{}, err
	}
	var removed []membership.Member
	if v.s != nil {
		if removed, err = v.s.RemoveMembers(project, paths); err != nil {
			return admin.Registration{}, err
		}
	} else if len(paths) > 0 {
		// No store: what an empty one answers.
		return admin.Registration{}, fmt.Errorf("%w: %s is not registered for project %s", policy.ErrNotRegistered, paths[0], project)
	}
	if len(cgs) == 0 && len(removed) == 0 {
		return admin.Registration{}, fmt.Errorf("%w: project %s has no registered cgroups", policy.ErrNotRegistered, project)
	}
	return v.registration(project, nil, removed)
}

// resolveCgroups turns the cgroups as the operator wrote them into member
// paths below mount, refusing (exit 2) what the daemon refuses: the root of
// the hierarchy, a path that is no clean cgroup path, and with exist one
// that is not a cgroup directory now (a file in one, such as cgroup.procs,
// or a typo).
func resolveCgroups(mount cgroup.Mount, cgs []string, exist bool) ([]string, error) {
	var paths []string
	for _, raw := range cgs {
		if strings.TrimSpace(raw) == "" || strings.ContainsRune(raw, 0) {
			return nil, cli.Exit("an empty cgroup path", 2)
		}
		cg := mount.Path(raw)
		if cg == filepath.Clean(mount.Point) {
			return nil, cli.Exit(fmt.Sprintf("%q is the root of the cgroup2 hierarchy, which holds every process of the node", raw), 2)
		}
		if err := membership.ValidCgroup(cg); err != nil {
			return nil, cli.Exit(err.Error(), 2)
		}
		if exist {
			if err := cgroup.OnCgroup2(cg); err != nil {
				return nil, cli.Exit(fmt.Sprintf("%q is not a cgroup: %s is not a directory on the cgroup2 mount %s", raw, cg, mount.Point), 2)
			}
		}
		paths = append(paths, cg)
	}
	return paths, nil
}

func (v projectsViaStore) registration(project string, added, removed []membership.Member) (admin.Registration, error) {
	stored, err := v.s.Members()
	if err != nil {
		return admin.Registration{}, err
	}
	reg := admin.Registration{Project: project, Cgroups: []string{}, Pending: true}
	for _, m := range stored {
		if m.Project == project {
			reg.Cgroups = append(reg.Cgroups, m.Cgroup)
		}
	}
	for _, m := range added {
		reg.Added = append(reg.Added, m.Cgroup)
	}
	for _, m := range removed {
		reg.Removed = append(reg.Removed, m.Cgroup)
	}
	return reg, nil
}

func (v projectsViaStore) list() (admin.Membership, error) {
	var stored []membership.Member
	if v.s != nil {
		var err error
		if stored, err = v.s.Members(); err != nil {
			return admin.Membership{}, err
		}
	}
	m := admin.Membership{Members: []admin.Member{}, Refused: []admin.Refused{},
		Sources: []admin.MemberSource{{Name: membership.SourceRegistered, Members: len(stored)}}}
	for _, mb := range stored {
		m.Members = append(m.Members, admin.Member{Member: mb, Source: membership.SourceRegistered})
	}
	return m, nil
}

func (v projectsViaStore) close() error {
	if v.s == nil {
		return nil
	}
	return v.s.Close()
}

// openProjects finds the daemon, or opens the store in mode when none
// answers. Without a daemon, the cgroups given are checked against the
// cgroup2 mount (with exist, each must be a cgroup now) before the store is
// opened: a command refused for its input writes nothing.
func openProjects(c *cli.Context, mode storeMode, cgs []string, exist bool) (projectsBackend, bool, error) {
	var mount cgroup.Mount
	pb, err := openPolicies(c, mode, func(config.Config) error {
		var err error
		mount, err = cgroup.FindMount()
		if err != nil && mode != storeRead {
			return cli.Exit(fmt.Sprintf("no daemon answers, and registering needs the cgroup2 mount: %v", err), 1)
		}
		_, err = resolveCgroups(mount, cgs, exist)
		return err
	})
	if err != nil {
		return nil, false, err
	}
	switch b := pb.(type) {
	case viaDaemon:
		return projectsViaDaemon{b}, true, nil
	case viaStore:
		return projectsViaStore{s: b.s, mount: mount}, false, nil
	case noStore:
		return projectsViaStore{mount: mount}, false, nil
	}
	pb.close()
	return nil, false, fmt.Errorf("unexpected backend %T", pb)
}

// projectArgs returns the PROJECT argument, validated (optional allows
// none), and the --cgroup and --json flags, given before or after it (run
// moves them first). "project add web --cgroup /a /b" is what an operator
// types too: with --cgroup given, the arguments with a "/" (which a project
// name never has) are more cgroups.
func projectArgs(c *cli.Context, optional bool) (project string, cgroups []string, asJSON bool, err error) {
	cgroups, asJSON = c.StringSlice("cgroup"), c.Bool("json")
	rest := c.Args().Slice()
	if len(cgroups) > 0 {
		names := rest[:0:0]
		for _, a := range rest {
			if strings.Contains(a, "/") {
				cgroups = append(cgroups, a)
			} else {
				names = append(names, a)
			}
		}
		rest = names
	}
	if len(rest) > 1 || len(rest) == 0 && !optional {
		return "", nil, false, cli.Exit(fmt.Sprintf("%s needs exactly one PROJECT argument, got %d", c.Command.HelpName, len(rest)), 2)
	}
	if len(rest) == 0 {
		return "", cgroups, asJSON, nil
	}
	if err := projectname.Validate(rest[0]); err != nil {
		return "", nil, false, cli.Exit(err.Error(), 2)
	}
	return rest[0], cgroups, asJSON, nil
}

// projectErr maps an error of the backend to the command's exit: bad input
// 2, anything else (a refusal, a missing registration) 1.
func projectErr(err error) error {
	var ec cli.ExitCoder
	if errors.As(err, &ec) {
		return err
	}
	var apiErr *admin.APIError
	if errors.Is(err, policy.ErrInvalid) || errors.Is(err, policy.ErrBadProject) || errors.Is(err, admin.ErrInvalid) ||
		(errors.As(err, &apiErr) && apiErr.Code == 400) {
		return cli.Exit(err.Error(), 2)
	}
	return cli.Exit(err.Error(), 1)
}

func projectAdd(c *cli.Context) error {
	project, cgs, asJSON, err := projectArgs(c, false)
	if err != nil {
		return err
	}
	if len(cgs) == 0 {
		return cli.Exit("project add needs at least one --cgroup PATH", 2)
	}
	b, daemon, err := openProjects(c, storeWrite, cgs, true)
	if err != nil {
		return err
	}
	defer b.close()
	reg, err := b.register(project, cgs)
	if err != nil {
		return projectErr(err)
	}
	return printRegistration(c.App.Writer, reg, asJSON, daemon)
}

func projectRemove(c *cli.Context) error {
	project, cgs, asJSON, err := projectArgs(c, false)
	if err != nil {
		return err
	}
	b, daemon, err := openProjects(c, storeExisting, cgs, false)
	if err != nil {
		return err
	}
	defer b.close()
	reg, err := b.unregister(project, cgs)
	if err != nil {
		return projectErr(err)
	}
	return printRegistration(c.App.Writer, reg, asJSON, daemon)
}

func printRegistration(w io.Writer, reg admin.Registration, asJSON, daemon bool) error {
	if asJSON {
		return writeJSON(w, reg)
	}
	for _, cg := range reg.Added {
		fmt.Fprintf(w, "registered %s for %s\n", cg, reg.Project)
	}
	for _, cg := range reg.Removed {
		fmt.Fprintf(w, "removed %s from %s\n", cg, reg.Project)
	}
	if len(reg.Added)+len(reg.Removed) == 0 {
		fmt.Fprintf(w, "nothing changed: the cgroups are registered for %s already\n", reg.Project)
	}
	state := "in force"
	switch {
	case reg.Pending && daemon:
		state = "stored; the daemon puts them in force within a tick"
	case reg.Pending:
		state = "stored; the daemon puts them in force when it starts"
	}
	n := fmt.Sprintf("%d registered cgroups", len(reg.Cgroups))
	if len(reg.Cgroups) == 1 {
		n = "1 registered cgroup"
	}
	fmt.Fprintf(w, "%s: %s, %s\n", reg.Project, n, state)
	for _, r := range reg.Refused {
		fmt.Fprintf(w, "refused %s: %s\n", r.Cgroup, r.Reason)
	}
	return nil
}

func projectList(c *cli.Context) error {
	project, _, asJSON, err := projectArgs(c, true)
	if err != nil {
		return err
	}
	b, daemon, err := openProjects(c, storeRead, nil, false)
	if err != nil {
		return err
	}
	defer b.close()
	m, err := b.list()
	if err != nil {
		return projectErr(err)
	}
	if project != "" {
		m.Members = slices.DeleteFunc(m.Members, func(e admin.Member) bool { return e.Project != project })
		m.Refused = slices.DeleteFunc(m.Refused, func(r admin.Refused) bool { return r.Project != project })
		m.Missing = slices.DeleteFunc(m.Missing, func(e admin.Member) bool { return e.Project != project })
	}
	if asJSON {
		return writeJSON(c.App.Writer, m)
	}
	if !daemon {
		fmt.Fprintln(c.App.Writer, "no daemon answers: these are the registrations stored in --state-dir; the daemon reads the other sources")
	}
	return printMembers(c.App.Writer, m, true, daemon)
}

// printMembers prints the members by project, then the refused ones. With
// each, every cgroup has a row, and with kernel (a daemon said what its
// kernel side takes) whether the kernel limits it; without each, a project
// has one row per source (its cgroups counted, the first one shown).
func printMembers(w io.Writer, m admin.Membership, each, kernel bool) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	ms := slices.Clone(m.Members)
	slices.SortStableFunc(ms, func(a, b admin.Member) int {
		return cmp.Or(cmp.Compare(a.Project, b.Project), cmp.Compare(a.Source, b.Source), cmp.Compare(a.Cgroup, b.Cgroup))
	})
	if each {
		// KERNEL says whether the kernel limits the member's connections
		// (admin.Membership.Kernel: all of them, or none without BPF).
		head, col := "PROJECT\tSOURCE\tCGROUP", func(admin.Member) string { return "" }
		if kernel {
			head = "PROJECT\tSOURCE\tKERNEL\tCGROUP"
			col = func(e admin.Member) string {
				if m.Kernel {
					return "yes\t"
				}
				return "no\t"
			}
		}
		fmt.Fprintln(tw, head)
		for _, e := range ms {
			fmt.Fprintf(tw, "%s\t%s\t%s%s\n", projectname.Display(e.Project), e.Source, col(e), projectname.Display(e.Cgroup))
		}
	} else {
		fmt.Fprintln(tw, "PROJECT\tSOURCE\tCGROUPS\tFIRST")
		for i := 0; i < len(ms); {
			j := i
			for j < len(ms) && ms[j].Project == ms[i].Project && ms[j].Source == ms[i].Source {
				j++
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\n", projectname.Display(ms[i].Project), ms[i].Source, j-i, projectname.Display(ms[i].Cgroup))
			i = j
		}
	}
	if len(m.Missing) > 0 {
		fmt.Fprintf(tw, "\nMISSING\tSOURCE\tCGROUP (registered, but no such cgroup now)\n")
		for _, e := range m.Missing {
			fmt.Fprintf(tw, "%s\t%s\t%s\n", projectname.Display(e.Project), e.Source, projectname.Display(e.Cgroup))
		}
	}
	if len(m.Refused) > 0 {
		fmt.Fprintf(tw, "\nREFUSED\tSOURCE\tBY\tCGROUP\tWHY\n")
		for _, r := range m.Refused {
			name := r.Project
			if name == "" {
				name = "-"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", projectname.Display(name), r.Source, r.By, projectname.Display(r.Cgroup),
				strings.ReplaceAll(r.Reason, "\n", " "))
		}
	}
	return tw.Flush()
}

// printNetns prints the network namespaces of the members' processes.
func printNetns(w io.Writer, n *admin.Netns, kernel bool) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	s := n.Scan
	fmt.Fprintf(tw, "network namespaces of the members' processes: %d (a sweep of %d members takes %d steps, %s)\n",
		len(n.Namespaces), s.Members, s.SweepSteps, s.SweepTime.Round(time.Millisecond))
	if !kernel {
		fmt.Fprintln(tw, "(inbound admission runs in the host's namespace only until the kernel side attaches in these)")
	}
	if len(n.Namespaces) == 0 {
		return tw.Flush()
	}
	fmt.Fprintln(tw, "INODE\tPROJECTS\tPID\tATTACHED\tSINCE")
	for _, ns := range n.Namespaces {
		att := "no"
		switch {
		case ns.Attached:
			att = fmt.Sprintf("yes (cookie %d)", ns.Cookie)
		case ns.Error != "":
			att = "failed: " + ns.Error
		}
		fmt.Fprintf(tw, "%d\t%s\t%d\t%s\t%s\n", ns.Inode, strings.Join(ns.Projects, ","), ns.PID, att, ns.Since.Format(time.RFC3339))
	}
	return tw.Flush()
}
