// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/policy"
	"github.com/urfave/cli/v2"
)

func policyCommand() *cli.Command {
	jsonFlag := &cli.BoolFlag{Name: "json", Usage: "print JSON"}
	return &cli.Command{
		Name:  "policy",
		Usage: "set, show or delete a project's policy (tier, shares, rates)",
		// As at the top level: --help is the one way to get help.
		Description: "A policy says what a project bought: its tier (pro, lite or none) and shares decide its\n" +
			"request-class buckets, requests/s and work units/s bound what it may spend in the HTTP\n" +
			"front, and connections/s the new TCP connections it may open or accept, refused in the\n" +
			"kernel with ECONNREFUSED beyond a burst of one second's worth (0 = unbounded). What a\n" +
			"project may hold is never configured: that is the fair share.\n" +
			"The running daemon stores and applies a change before this command returns; with no\n" +
			"daemon running, set and delete write the store in --state-dir themselves, and get and\n" +
			"list read it (a store not written yet is empty: they do not create it). The projects the\n" +
			"policies file names (config policies_file) take its policies, and set and delete refuse\n" +
			"them, with or without the daemon: change them in the file.\n\n" +
			examples(
				"fairshare policy set alpha --tier pro --shares 2 --requests-per-sec 100",
				"fairshare policy list",
			),
		Subcommands: []*cli.Command{
			{
				Name:      "set",
				Usage:     "set some fields of a project's policy; fields not given are kept (or defaulted)",
				ArgsUsage: "PROJECT",
				Description: examples(
					"fairshare policy set alpha --tier pro --shares 2",
					"fairshare policy set alpha --requests-per-sec 100 --work-per-sec 50",
					"fairshare policy set alpha --connections-per-sec 200",
					"fairshare policy set alpha --enforce=false",
				),
				Flags: append(policyFlags(),
					&cli.StringFlag{Name: "tier", Usage: "`TIER`: pro (P1 and P2 buckets), lite (P2) or none"},
					&cli.StringFlag{Name: "shares", Usage: "`N` shares, a whole number >= 1: bigger, faster-refilling buckets"},
					&cli.StringFlag{Name: "requests-per-sec", Usage: "requests per second `R`: 0 = unbounded, else 0.001 to 1e9"},
					&cli.StringFlag{Name: "work-per-sec", Usage: "work units per second `W`: 0 = unbounded, else 0.001 to 1e9"},
					&cli.StringFlag{Name: "enforce", Usage: "`BOOL`: false puts the project in dry-run (what would be refused is admitted " +
						"and counted as would_refuse, see 'fairshare events'), true enforces again"},
					&cli.StringFlag{Name: "connections-per-sec", Usage: "new TCP connections per second `C` the project opens (connect), enforced in the kernel: 0 = unbounded, else 0.001 to 1e9"},
					&cli.StringFlag{Name: "accepts-per-sec", Usage: "new TCP connections per second `A` the project's listeners accept (at the SYN), enforced in the kernel from a bucket apart from --connections-per-sec: 0 = unbounded, else 0.001 to 1e9"},
					jsonFlag),
				Action: policySet,
			},
			{
				Name: "get", Usage: "show a project's policy", ArgsUsage: "PROJECT",
				Description: examples("fairshare policy get alpha", "fairshare policy get alpha --json"),
				Flags:       append(policyFlags(), jsonFlag), Action: policyGet,
			},
			{
				Name: "list", Usage: "list the policies in force: the stored ones and the policies file's",
				Description: examples("fairshare policy list", "fairshare policy list --json"),
				Flags:       append(policyFlags(), jsonFlag), Action: policyList,
			},
			{
				Name: "delete", Usage: "delete a project's policy: it falls back to the default", ArgsUsage: "PROJECT",
				Description: examples("fairshare policy delete alpha"),
				Flags:       policyFlags(), Action: policyDelete,
			},
		},
	}
}

// oneProject returns the single PROJECT argument, validated.
func oneProject(c *cli.Context) (string, error) {
	if c.NArg() != 1 {
		return "", cli.Exit(fmt.Sprintf("%s needs exactly one PROJECT argument, got %d", c.Command.HelpName, c.NArg()), 2)
	}
	p := c.Args().First()
	if err := policy.ValidateProject(p); err != nil {
		return "", cli.Exit(err.Error(), 2)
	}
	return p, nil
}

// parsePatch turns the flags into a patch, refusing anything malformed with
// one sentence naming the flag.
func parsePatch(c *cli.Context) (policy.Patch, error) {
	var pt policy.Patch
	if c.IsSet("tier") {
		t := c.String("tier")
		switch t {
		case policy.TierPro, policy.TierLite, policy.TierNone:
		default:
			return pt, cli.Exit(fmt.Sprintf("--tier must be pro, lite or none, got %q", t), 2)
		}
		pt.Tier = &t
	}
	if c.IsSet("shares") {
		raw := c.String("shares")
		n, err := strconv.Atoi(strings.TrimSpace(raw))
		if err != nil || n < 1 || n > policy.MaxShares {
			return pt, cli.Exit(fmt.Sprintf("--shares must be a whole number from 1 to %d, got %q", policy.MaxShares, raw), 2)
		}
		pt.Shares = &n
	}
	rate := func(name string) (*float64, error) {
		if !c.IsSet(name) {
			return nil, nil
		}
		raw := c.String(name)
		v, err := strconv.ParseFloat(strings.TrimSpace(raw), 64)
		if err != nil || math.IsNaN(v) || math.IsInf(v, 0) || v < 0 || v > policy.MaxRate || (v > 0 && v < policy.MinRate) {
			return nil, cli.Exit(fmt.Sprintf("--%s must be 0 (unbounded) or a number from %g to %g, got %q",
				name, float64(policy.MinRate), float64(policy.MaxRate), raw), 2)
		}
		return &v, nil
	}
	var err error
	if pt.RequestsPerSec, err = rate("requests-per-sec"); err != nil {
		return pt, err
	}
	if pt.WorkPerSec, err = rate("work-per-sec"); err != nil {
		return pt, err
	}
	if c.IsSet("enforce") {
		raw := c.String("enforce")
		v, err := strconv.ParseBool(strings.TrimSpace(raw))
		if err != nil {
			return pt, cli.Exit(fmt.Sprintf("--enforce must be true or false, got %q", raw), 2)
		}
		pt.Enforce = &v
	}
	if pt.ConnectionsPerSec, err = rate("connections-per-sec"); err != nil {
		return pt, err
	}
	if pt.AcceptsPerSec, err = rate("accepts-per-sec"); err != nil {
		return pt, err
	}
	if pt.Empty() {
		return pt, cli.Exit("policy set changes nothing: give at least one of --tier, --shares, --requests-per-sec, --work-per-sec, --connections-per-sec, --accepts-per-sec, --enforce", 2)
	}
	return pt, nil
}

// policyBackend is where policies live for this invocation: the daemon if one
// answers, else the store file.
type policyBackend interface {
	get(project string) (policy.Entry, bool, error)
	list() ([]policy.Entry, error)
	patch(project string, pt policy.Patch) (policy.Policy, error)
	delete(project string) (bool, error)
	close() error
}

type viaDaemon struct {
	ctx context.Context
	c   *admin.Client
}

func (v viaDaemon) get(p string) (policy.Entry, bool, error) {
	e, err := v.c.Policy(v.ctx, p)
	if errors.Is(err, admin.ErrNotFound) {
		return policy.Entry{}, false, nil
	}
	return e, err == nil, err
}
func (v viaDaemon) list() ([]policy.Entry, error) { return v.c.Policies(v.ctx) }
func (v viaDaemon) patch(p string, pt policy.Patch) (policy.Policy, error) {
	return v.c.PatchPolicy(v.ctx, p, pt)
}
func (v viaDaemon) delete(p string) (bool, error) {
	err := v.c.DeletePolicy(v.ctx, p)
	if errors.Is(err, admin.ErrNotFound) {
		return false, nil
	}
	return err == nil, err
}
func (viaDaemon) close() error { return nil }

type viaStore struct {
	s   *policy.Store
	def policy.Policy
	// socket is the admin socket that did not answer.
	socket string
}

// storedOnly is the note for a write that went to the store because no
// daemon answered (b a viaStore, maybe within a fileBackend): it is in
// force only from the daemon's next start, or nowhere if the socket named
// is not the running daemon's. "" for a write the daemon made.
func storedOnly(b policyBackend) string {
	if f, ok := b.(fileBackend); ok {
		b = f.policyBackend
	}
	v, ok := b.(viaStore)
	if !ok {
		return ""
	}
	return fmt.Sprintf("note: no daemon answers at %s: the change is stored in %s, and a daemon puts it in force when it starts "+
		"(a daemon running with another admin socket does not see it until then)\n", v.socket, v.s.Path())
}

func (v viaStore) get(p string) (policy.Entry, bool, error) {
	pol, found, err := v.s.Get(p)
	return policy.Entry{Project: p, Policy: pol}, found, err
}
func (v viaStore) list() ([]policy.Entry, error) { return v.s.List() }
func (v viaStore) patch(p string, pt policy.Patch) (policy.Policy, error) {
	return v.s.Patch(p, pt, v.def)
}
func (v viaStore) delete(p string) (bool, error) { return v.s.Delete(p) }
func (v viaStore) close() error                  { return v.s.Close() }

// noStore is the store of a host where none has been written yet (no
// daemon has run, no command has stored anything), as the commands that
// only read or remove see it: empty. It is not created for them.
type noStore struct{}

func (noStore) get(p string) (policy.Entry, bool, error) { return policy.Entry{Project: p}, false, nil }
func (noStore) list() ([]policy.Entry, error)            { return nil, nil }
func (noStore) patch(string, policy.Patch) (policy.Policy, error) {
	return policy.Policy{}, errors.New("the policy store does not exist, and this command does not create it")
}
func (noStore) delete(string) (bool, error) { return false, nil }
func (noStore) close() error                { return nil }

// storeMode is how a command opens the store when no daemon answers.
type storeMode int

const (
	// storeWrite opens it read-write, creating it if need be (set, add).
	storeWrite storeMode = iota
	// storeRead opens it read-only (get, list); a store that does not
	// exist is empty.
	storeRead
	// storeExisting opens it read-write if it exists (delete, remove); one
	// that does not is empty, and stays uncreated.
	storeExisting
)

// openPolicies finds the daemon, or opens the store in mode when none
// answers. Without a daemon, before (if not nil) runs first, and its error
// is returned before the store is opened: what it refuses writes nothing.
func openPolicies(c *cli.Context, mode storeMode, before func(config.Config) error) (policyBackend, error) {
	cfg, err := loadConfig(c)
	if err != nil {
		return nil, err
	}
	cl := admin.NewClient(cfg.AdminSocket)
	err = cl.Health(c.Context)
	if err == nil {
		return viaDaemon{ctx: c.Context, c: cl}, nil
	}
	if denied(err) {
		// The daemon is there: the socket's mode (connect) or the API
		// (403) turned this user away.
		return nil, cli.Exit(fmt.Sprintf("the daemon at %s refused this user: permission denied (the admin API needs root)", cfg.AdminSocket), 1)
	}
	var apiErr *admin.APIError
	if errors.As(err, &apiErr) {
		return nil, cli.Exit(fmt.Sprintf("the daemon at %s answered its health check with an error: %v", cfg.AdminSocket, err), 1)
	}
	if !errors.Is(err, admin.ErrNoDaemon) {
		return nil, cli.Exit(fmt.Sprintf("the daemon at %s did not answer: %v", cfg.AdminSocket, err), 1)
	}
	if before != nil {
		if err := before(cfg); err != nil {
			return nil, err
		}
	}
	if mode == storeExisting {
		_, err := os.Stat(filepath.Join(cfg.StateDir, policy.FileName))
		if errors.Is(err, fs.ErrNotExist) {
			return noStore{}, nil
		}
	}
	st, err := policy.Open(cfg.StateDir, policy.Options{Timeout: 2 * time.Second, ReadOnly: mode == storeRead})
	if mode == storeRead && errors.Is(err, fs.ErrNotExist) {
		return noStore{}, nil
	}
	if errors.Is(err, policy.ErrLocked) {
		return nil, cli.Exit(fmt.Sprintf("the policy store in %s is held by a running daemon whose admin socket %s does not answer; "+
			"pass that daemon's --admin-socket", cfg.StateDir, cfg.AdminSocket), 1)
	}
	if err != nil {
		return nil, cli.Exit(fmt.Sprintf("no daemon answers and the policy store could not be opened: %v", err), 1)
	}
	return viaStore{s: st, def: defaultPolicy(cfg), socket: cfg.AdminSocket}, nil
}

// denied says whether err is the admin socket refusing this user.
func denied(err error) bool {
	var apiErr *admin.APIError
	return errors.Is(err, fs.ErrPermission) || (errors.As(err, &apiErr) && apiErr.Code == http.StatusForbidden)
}

// openPolicyCommands is openPolicies for the policy commands. Without a
// daemon, the policies file (config policies_file) is read as the daemon
// reads it at start: its projects show with the file's policies, and a set
// or delete of one of them (write; "" for a read) is refused as the daemon
// refuses it, before the store is opened. The daemon would put the file's
// policy in force over a stored one when it starts.
func openPolicyCommands(c *cli.Context, mode storeMode, write string) (policyBackend, error) {
	var owned map[string]policy.Policy
	b, err := openPolicies(c, mode, func(cfg config.Config) error {
		var err error
		if owned, err = policiesFile(c, cfg, write); err != nil {
			return err
		}
		if _, ok := owned[write]; ok && write != "" {
			return policyErr(policy.FromFile(cfg.PoliciesFile, write))
		}
		return nil
	})
	if err != nil || len(owned) == 0 {
		return b, err
	}
	return fileBackend{policyBackend: b, owned: owned}, nil
}

// policiesFile reads the policies file cfg names, if any, for a command
// that writes project's policy (write) or only reads. A missing file owns
// no project. One that does not validate, or cannot be read, is a warning
// for a read, and refuses a write: whether it names the project is not
// known (a daemon starting with a file that does not validate keeps the
// policies it last read from it, kept in the store).
func policiesFile(c *cli.Context, cfg config.Config, write string) (map[string]policy.Policy, error) {
	if cfg.PoliciesFile == "" {
		return nil, nil
	}
	dir := ""
	if f := c.String(flagConfig); f != "" {
		dir = filepath.Dir(f)
	}
	owned, _, err := policy.NewFile(cfg.PoliciesFile, defaultPolicy(cfg), dir).Poll()
	switch {
	case err == nil:
		return owned, nil
	case write != "":
		return nil, cli.Exit(fmt.Sprintf("%v: whether it names %s is not known, so nothing was written", err, write), 1)
	default:
		fmt.Fprintf(c.App.ErrWriter, "warning: %v; its policies are not shown\n", err)
	}
	return nil, nil
}

// fileBackend is the store as the daemon shows it: with the policies
// file's policies in place of the stored ones of the projects it names.
type fileBackend struct {
	policyBackend
	owned map[string]policy.Policy
}

func (f fileBackend) get(p string) (policy.Entry, bool, error) {
	if pol, ok := f.owned[p]; ok {
		return policy.Entry{Project: p, Policy: pol, Source: policy.SourceFile}, true, nil
	}
	return f.policyBackend.get(p)
}

func (f fileBackend) list() ([]policy.Entry, error) {
	stored, err := f.policyBackend.list()
	if err != nil {
		return nil, err
	}
	return policy.Merge(stored, f.owned), nil
}

func defaultPolicy(cfg config.Config) policy.Policy {
	return policy.Policy{Tier: cfg.Scheduler.DefaultTier, Shares: cfg.Scheduler.DefaultShares}
}

func policyErr(err error) error {
	var apiErr *admin.APIError
	if errors.Is(err, policy.ErrInvalid) || errors.Is(err, policy.ErrBadProject) ||
		(errors.As(err, &apiErr) && apiErr.Code == 400) {
		return cli.Exit(err.Error(), 2)
	}
	return cli.Exit(err.Error(), 1)
}

func policySet(c *cli.Context) error {
	project, err := oneProject(c)
	if err != nil {
		return err
	}
	pt, err := parsePatch(c)
	if err != nil {
		return err
	}
	b, err := openPolicyCommands(c, storeWrite, project)
	if err != nil {
		return err
	}
	defer b.close()
	p, err := b.patch(project, pt)
	if err != nil {
		return policyErr(err)
	}
	fmt.Fprint(c.App.ErrWriter, storedOnly(b))
	return printPolicies(c, []policy.Entry{{Project: project, Policy: p}}, false)
}

func policyGet(c *cli.Context) error {
	project, err := oneProject(c)
	if err != nil {
		return err
	}
	b, err := openPolicyCommands(c, storeRead, "")
	if err != nil {
		return err
	}
	defer b.close()
	e, found, err := b.get(project)
	if err != nil {
		return policyErr(err)
	}
	if !found {
		return cli.Exit(fmt.Sprintf("no policy is stored for %s; it runs on the default", project), 1)
	}
	return printPolicies(c, []policy.Entry{e}, false)
}

func policyList(c *cli.Context) error {
	b, err := openPolicyCommands(c, storeRead, "")
	if err != nil {
		return err
	}
	defer b.close()
	list, err := b.list()
	if err != nil {
		return policyErr(err)
	}
	return printPolicies(c, list, true)
}

func policyDelete(c *cli.Context) error {
	project, err := oneProject(c)
	if err != nil {
		return err
	}
	b, err := openPolicyCommands(c, storeExisting, project)
	if err != nil {
		return err
	}
	defer b.close()
	found, err := b.delete(project)
	if err != nil {
		return policyErr(err)
	}
	if !found {
		return cli.Exit(fmt.Sprintf("no policy is stored for %s", project), 1)
	}
	fmt.Fprint(c.App.ErrWriter, storedOnly(b))
	fmt.Fprintf(c.App.Writer, "deleted the policy of %s\n", project)
	return nil
}

func printPolicies(c *cli.Context, list []policy.Entry, asList bool) error {
	w := c.App.Writer
	if c.Bool("json") {
		var v any = list
		if !asList && len(list) == 1 {
			v = list[0]
		}
		if list == nil {
			v = []policy.Entry{}
		}
		return writeJSON(w, v)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PROJECT\tTIER\tSHARES\tREQUESTS/S\tWORK/S\tCONNECTIONS/S\tACCEPTS/S\tENFORCE\tFROM")
	for _, e := range list {
		from := "cli"
		if e.Source == policy.SourceFile {
			from = "file"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\n", e.Project, e.Tier, e.Shares, rateText(e.RequestsPerSec), rateText(e.WorkPerSec),
			rateText(e.ConnectionsPerSec), rateText(e.AcceptsPerSec), enforceText(e.Enforced()), from)
	}
	return tw.Flush()
}

// enforceText is a dry-run switch as the tables show it.
func enforceText(on bool) string {
	if on {
		return "yes"
	}
	return "dry-run"
}

func rateText(v float64) string {
	if v == 0 {
		return "unbounded"
	}
	return strconv.FormatFloat(v, 'g', -1, 64)
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
