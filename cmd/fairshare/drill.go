// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"math"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"
	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/drill"
)

// drillFlags are shared by both drill scenarios.
func drillFlags() []cli.Flag {
	return []cli.Flag{
		&cli.DurationFlag{Name: "phase", Value: 5 * time.Second, Usage: "length of each of the three phases; longer than 3s (connections: 2s) plus --service and --retry-pause, so that big alone outlasts small's stay in the active set"},
		&cli.IntFlag{Name: "slices", Value: 10, Usage: "turns solo and both take, alternating, so other load on the host weighs on both alike (1: one after the other; at most 1000, each slice 10 service times or longer)"},
		&cli.IntFlag{Name: "pool", Value: 8, Usage: "pool size the drill cuts the pool to (2 or more, and at most --big)"},
		&cli.IntFlag{Name: "big", Value: 16, Usage: "writers of the big project (at least --pool: alone, it must be able to hold the pool)"},
		&cli.IntFlag{Name: "small", Value: 2, Usage: "writers of the small project (at most its share beside big, max(FLOOR, POOL/2))"},
		&cli.DurationFlag{Name: "service", Value: 20 * time.Millisecond, Usage: "fixed service time per request (hold time per connection)"},
		&cli.DurationFlag{Name: "retry-pause", Value: 10 * time.Millisecond, Usage: "pause of a refused writer before it tries again (Retry-After is not obeyed, on purpose)"},
		&cli.Float64Flag{Name: "target-ratio", Value: 2, Usage: "our goal for small's p99 under contention, as a multiple of its solo p99: reported met or missed, it fails nothing (the specification's bound, 3x, is always checked)"},
		&cli.StringFlag{Name: "json", Usage: "also write the report as JSON to `FILE`"},
		&cli.StringFlag{Name: "svg", Usage: "draw latency and permits held over time per project (held against lines at POOL and POOL - FLOOR) as SVG to `FILE`"},
	}
}

// Exit statuses of the drill, besides exitUsage for a command line it
// cannot run with (a bad flag value, an output file it could not write).
const (
	// exitDrillError: the drill could not run (or was interrupted), or its
	// report could not be written.
	exitDrillError = 1
	// exitVerdict: the drill ran to the end and a verdict failed; the
	// report is printed and written as asked.
	exitVerdict = 3
)

// drillExitHelp says what the drill's exit statuses mean, for --help.
const drillExitHelp = "Exit status: 0 when every verdict passed; 3 when the drill ran and a verdict failed (the\n" +
	"report is printed, and written to --json and --svg); 1 when the drill could not run, was\n" +
	"interrupted or could not write its report; 2 for a command line it cannot run with, such as\n" +
	"a flag value out of range, flags with which a verdict could not pass (phases too short for big\n" +
	"to be alone, a pool larger than big's writers) or a --json or --svg file whose directory is\n" +
	"missing or not writable, or both naming one file.\n\n"

// drillFlagsFrom returns, for each drill flag, the context its value is read
// from. The flags of 'drill' may be given before a subcommand's name: 'drill
// --pool 4 connections' runs connections with a pool of 4, as 'drill
// connections --pool 4' does. A flag given on both sides is refused, exit 2,
// and so is any for a subcommand without these flags (the hidden
// connect-loop): urfave/cli would otherwise read the subcommand's default
// and drop the value given.
func drillFlagsFrom(c *cli.Context) (func(name string) *cli.Context, error) {
	own := func(string) *cli.Context { return c }
	lineage := c.Lineage()
	if len(lineage) < 2 || lineage[1].Command == nil || lineage[1].Command.Name != "drill" {
		return own, nil // c is the drill command itself
	}
	parent := lineage[1]
	from := map[string]*cli.Context{}
	for _, f := range drillFlags() {
		name := f.Names()[0]
		if !parent.IsSet(name) {
			continue
		}
		switch {
		case !hasFlag(c.Command.Flags, name):
			return nil, cli.Exit(fmt.Sprintf("--%s is a flag of 'fairshare drill', which 'drill %s' does not take", name, c.Command.Name), exitUsage)
		case c.IsSet(name):
			return nil, cli.Exit(fmt.Sprintf("--%s is given both before and after '%s'; give it once", name, c.Command.Name), exitUsage)
		}
		from[name] = parent
	}
	return func(name string) *cli.Context {
		if p, ok := from[name]; ok {
			return p
		}
		return c
	}, nil
}

// hasFlag says whether flags has one named name.
func hasFlag(flags []cli.Flag, name string) bool {
	for _, f := range flags {
		if f.Names()[0] == name {
			return true
		}
	}
	return false
}

// drillConfig is the drill's configuration from the flags (drillFlagsFrom
// says where each is read), for the connections drill when connections is
// set (--to read). A value given that the drill cannot run with is refused,
// exit 2, naming the flag: the drill's own defaults (drill.Config) stand
// only for a flag not given, not for one given as 0 or less. So is a --json
// or --svg file that cannot be written (checkOutput), --json and --svg
// naming one file (the second report would replace the first), and values
// with which a verdict could not pass (drill.Config.Check: phases too short
// for small to leave the active set before big-alone ends, a pool larger
// than big's writers, and so on): before the drill runs, not after.
func drillConfig(c *cli.Context, connections bool) (drill.Config, error) {
	from, err := drillFlagsFrom(c)
	if err != nil {
		return drill.Config{}, err
	}
	for _, name := range []string{"pool", "big", "small", "slices"} {
		if n := from(name).Int(name); n < 1 {
			return drill.Config{}, cli.Exit(fmt.Sprintf("--%s must be a whole number >= 1, got %d", name, n), exitUsage)
		}
	}
	for _, name := range []string{"phase", "service", "retry-pause"} {
		if d := from(name).Duration(name); d <= 0 {
			return drill.Config{}, cli.Exit(fmt.Sprintf("--%s must be a duration > 0, got %s", name, d), exitUsage)
		}
	}
	if r := from("target-ratio").Float64("target-ratio"); !(r > 0) || math.IsInf(r, 0) {
		return drill.Config{}, cli.Exit(fmt.Sprintf("--target-ratio must be a number > 0, got %g", r), exitUsage)
	}
	for _, name := range []string{"json", "svg"} {
		if err := checkOutput(from(name).String(name)); err != nil {
			return drill.Config{}, cli.Exit(fmt.Sprintf("--%s: %v", name, err), exitUsage)
		}
	}
	if js, svg := from("json").String("json"), from("svg").String("svg"); sameFile(js, svg) {
		return drill.Config{}, cli.Exit(fmt.Sprintf("--json %s and --svg %s name the same file: the SVG would replace the JSON report; give two files", js, svg), exitUsage)
	}
	errw := c.App.ErrWriter
	if errw == nil {
		errw = os.Stderr
	}
	cfg := drill.Config{
		// Warnings only: what a killed drill left behind and was removed.
		Log:           slog.New(slog.NewTextHandler(errw, &slog.HandlerOptions{Level: slog.LevelWarn})),
		PoolSize:      from("pool").Int("pool"),
		BigWriters:    from("big").Int("big"),
		SmallWriters:  from("small").Int("small"),
		Phase:         from("phase").Duration("phase"),
		Slices:        from("slices").Int("slices"),
		ServiceTime:   from("service").Duration("service"),
		RetryPause:    from("retry-pause").Duration("retry-pause"),
		TargetRatio:   from("target-ratio").Float64("target-ratio"),
		ToDestination: connections && c.Bool("to"),
	}
	if err := cfg.Check(connections); err != nil {
		return drill.Config{}, cli.Exit(err.Error(), exitUsage)
	}
	return cfg, nil
}

// sameFile says whether the report paths a and b name one file: the same
// name, links to one file, or the names of one existing file (/dev/stdout
// and /proc/self/fd/1).
func sameFile(a, b string) bool {
	if a == "" || b == "" {
		return false
	}
	if resolved(a) == resolved(b) {
		return true
	}
	fa, errA := os.Stat(a)
	fb, errB := os.Stat(b)
	return errA == nil && errB == nil && os.SameFile(fa, fb)
}

// resolved is path as written to (target), absolute, its directory's links
// resolved: two names of a file not yet created resolve alike.
func resolved(path string) string {
	path = target(path)
	if abs, err := filepath.Abs(path); err == nil {
		path = abs
	}
	if dir, err := filepath.EvalSymlinks(filepath.Dir(path)); err == nil {
		path = filepath.Join(dir, filepath.Base(path))
	}
	return path
}

// checkOutput makes sure the report can be written to path ("" is none)
// once the drill is done: path is not a directory, and its directory exists
// and takes a new file (one is created there and removed, which is what
// writeAtomic does at the end).
func checkOutput(path string) error {
	if path == "" {
		return nil
	}
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		return fmt.Errorf("%s is a directory", path)
	}
	if direct(path) {
		// Written in place (writeAtomic): it must be writable. Not
		// opened: an open and close of a pipe (>(jq .)) would end its
		// reader's input before the report.
		if err := unix.Access(path, unix.W_OK); err != nil {
			return fmt.Errorf("cannot write %s: %w", path, err)
		}
		return nil
	}
	path = target(path)
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".*")
	if err != nil {
		var pe *fs.PathError
		if errors.As(err, &pe) {
			err = pe.Err
		}
		return fmt.Errorf("cannot write %s: creating a file in %s: %w", path, dir, err)
	}
	name := f.Name()
	f.Close()
	if err := os.Remove(name); err != nil {
		return fmt.Errorf("cannot write %s: %w", path, err)
	}
	return nil
}

// ownOutputs are the files the drill prints to: a report to one of them by
// another name (drill --json out.txt > out.txt) follows the table rather
// than replacing it. A variable for the tests.
var ownOutputs = func() []*os.File { return []*os.File{os.Stdout, os.Stderr} }

// direct says whether path is written in place, appended to, rather than
// renamed over: anything but a regular file (a pipe, a terminal), a link
// into /dev or /proc (/dev/stdout, /proc/self/fd/1), which may lead to the
// drill's own output (a rename would put a file where /dev/stdout was, as
// root for every process; a truncation would cut the table printed
// before), and the file the drill's output goes to, by whatever name.
// Another link is resolved, and its target written whole (target).
func direct(path string) bool {
	fi, err := os.Lstat(path)
	if err == nil {
		if st, err := os.Stat(path); err == nil {
			for _, f := range ownOutputs() {
				if own, err := f.Stat(); err == nil && os.SameFile(st, own) {
					return true
				}
			}
		}
	}
	switch {
	case err != nil:
		return false
	case fi.Mode()&os.ModeSymlink != 0:
		// Each step of the chain: /proc/self/fd/1 reads as the file's
		// own path, past which the link's nature is lost.
		for p, i := path, 0; i < 40; i++ {
			next, err := os.Readlink(p)
			if err != nil {
				break
			}
			if !filepath.IsAbs(next) {
				next = filepath.Join(filepath.Dir(p), next)
			}
			if strings.HasPrefix(next, "/dev/") || strings.HasPrefix(next, "/proc/") {
				return true
			}
			p = next
		}
		fi, err = os.Stat(path)
		return err == nil && !fi.Mode().IsRegular()
	}
	return !fi.Mode().IsRegular()
}

// target is where writeAtomic renames a report to: path, or the file a
// link at path leads to (the link kept).
func target(path string) string {
	if fi, err := os.Lstat(path); err == nil && fi.Mode()&os.ModeSymlink != 0 {
		if real, err := filepath.EvalSymlinks(path); err == nil {
			return real
		}
	}
	return path
}

// writeAtomic writes path with fn through a temporary file in its directory,
// renamed over path once complete: a write that fails leaves path as it was
// (absent, or the previous report), never half a report. A path that is a
// link or not a regular file is written in place (direct).
func writeAtomic(path string, fn func(io.Writer) error) (err error) {
	if direct(path) {
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
		if err != nil {
			return err
		}
		bw := bufio.NewWriter(f)
		if err := fn(bw); err != nil {
			f.Close()
			return err
		}
		if err := bw.Flush(); err != nil {
			f.Close()
			return err
		}
		return f.Close()
	}
	path = target(path)
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	bw := bufio.NewWriter(f)
	if err := fn(bw); err != nil {
		return err
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	// CreateTemp makes the file 0600; a report is for anyone to read.
	if err := f.Chmod(0o644); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}

// drillCommand is `fairshare drill`: the specification's experiment, run on
// this host with nothing to set up.
func drillCommand() *cli.Command {
	return &cli.Command{
		Name:  "drill",
		Usage: "run the fair-share drill on this host (two projects, a small pool) and print what it measured",
		Description: "Starts an upstream, a requests pool of 8, the scheduler and the front on loopback, then a\n" +
			"small project (2 writers) alone and together with a big one (16 writers), taking turns in\n" +
			"slices, and the big one alone. Prints latency (from a request's first ask to its answer,\n" +
			"refusals and retries included), refusals and permits held per phase and project, and the\n" +
			"verdicts. 'fairshare drill connections' does the same through the BPF connection pool\n" +
			"(root); the flags of 'drill' may also be given before 'connections'.\n\n" +
			drillExitHelp +
			examples(
				"fairshare drill",
				"fairshare drill --phase 4s --svg drill.svg",
				"fairshare drill connections",
			),
		Flags: drillFlags(),
		Action: func(c *cli.Context) error {
			cfg, err := drillConfig(c, false)
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
			defer stop()
			rep, err := drill.Run(ctx, cfg)
			if err != nil {
				return cli.Exit(fmt.Sprintf("drill: %v", err), exitDrillError)
			}
			return finishDrill(c, rep)
		},
		Subcommands: []*cli.Command{
			{
				Name:  "connections",
				Usage: "the same drill for TCP connections, enforced in the kernel (needs root)",
				Description: "Two project cgroups open and hold connections in loops against a small connection pool,\n" +
					"counted and refused by the BPF programs. --to: the pool is a destination pool whose\n" +
					"destination is the drill's server (docs/destination-pools.md).\n\n" +
					drillExitHelp +
					examples("fairshare drill connections", "fairshare drill connections --json drill.json", "fairshare drill connections --to"),
				Flags: append(drillFlags(), &cli.BoolFlag{Name: "to",
					Usage: "connect to a destination pool's destination: --pool sizes a destination pool whose destination is the drill's server, in a node pool 16 times larger (docs/destination-pools.md)"}),
				Action: func(c *cli.Context) error {
					cfg, err := drillConfig(c, true)
					if err != nil {
						return err
					}
					ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
					defer stop()
					self, err := os.Executable()
					if err != nil {
						return cli.Exit(fmt.Sprintf("drill: finding own executable: %v", err), exitDrillError)
					}
					rep, err := drill.RunConnections(ctx, cfg, []string{self, "drill", drillLoopCommand})
					if err != nil {
						return cli.Exit(fmt.Sprintf("drill connections: %v", err), exitDrillError)
					}
					return finishDrill(c, rep)
				},
			},
			{
				Name:   drillLoopCommand,
				Hidden: true,
				Usage:  "load generator of the connections drill (started by it inside a project's cgroup)",
				Action: func(c *cli.Context) error {
					if _, err := drillFlagsFrom(c); err != nil {
						return err
					}
					ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
					defer stop()
					return drill.ConnectLoop(ctx, os.Stdin, c.App.Writer)
				},
			},
		},
	}
}

// drillLoopCommand is the hidden subcommand the connections drill re-executes.
const drillLoopCommand = "connect-loop"

// finishDrill prints the report, writes it where --json and --svg say
// (read as drillConfig reads them) and turns a failed verdict into its exit
// status.
func finishDrill(c *cli.Context, rep *drill.Report) error {
	if err := rep.WriteTable(c.App.Writer); err != nil {
		return cli.Exit(fmt.Sprintf("drill: printing the report: %v", err), exitDrillError)
	}
	from, err := drillFlagsFrom(c)
	if err != nil {
		return err
	}
	for _, out := range []struct {
		flag  string
		write func(io.Writer) error
	}{{"json", rep.WriteJSON}, {"svg", rep.WriteSVG}} {
		path := from(out.flag).String(out.flag)
		if path == "" {
			continue
		}
		if err := writeAtomic(path, out.write); err != nil {
			return cli.Exit(fmt.Sprintf("drill: writing %s: %v", path, err), exitDrillError)
		}
	}
	if !rep.Pass {
		return cli.Exit(fmt.Sprintf("drill: %v", drill.ErrVerdict), exitVerdict)
	}
	return nil
}
