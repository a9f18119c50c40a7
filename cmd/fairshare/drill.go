// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"log/slog"
	"math"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/fairshare-dev/fairshare/drill"
)

// drillFlags are shared by both drill scenarios.
func drillFlags() []cli.Flag {
	return []cli.Flag{
		&cli.DurationFlag{Name: "phase", Value: 5 * time.Second, Usage: "length of each of the three phases"},
		&cli.IntFlag{Name: "slices", Value: 10, Usage: "turns solo and both take, alternating, so other load on the host weighs on both alike (1: one after the other)"},
		&cli.IntFlag{Name: "pool", Value: 8, Usage: "pool size the drill cuts the pool to"},
		&cli.IntFlag{Name: "big", Value: 16, Usage: "writers of the big project"},
		&cli.IntFlag{Name: "small", Value: 2, Usage: "writers of the small project"},
		&cli.DurationFlag{Name: "service", Value: 20 * time.Millisecond, Usage: "fixed service time per request (hold time per connection)"},
		&cli.DurationFlag{Name: "retry-pause", Value: 10 * time.Millisecond, Usage: "pause of a refused writer before it tries again (Retry-After is not obeyed, on purpose)"},
		&cli.Float64Flag{Name: "target-ratio", Value: 2, Usage: "our goal for small's p99 under contention, as a multiple of its solo p99 (the specification's bound, 3x, is always checked)"},
		&cli.StringFlag{Name: "json", Usage: "also write the report as JSON to `FILE`"},
		&cli.StringFlag{Name: "svg", Usage: "draw latency and permits held over time per project (held against lines at POOL and POOL - FLOOR) as SVG to `FILE`"},
	}
}

// drillConfig is the drill's configuration from the flags. A value given
// that the drill cannot run with is refused, exit 2, naming the flag: the
// drill's own defaults (drill.Config) stand only for a flag not given, not
// for one given as 0 or less.
func drillConfig(c *cli.Context) (drill.Config, error) {
	for _, name := range []string{"pool", "big", "small", "slices"} {
		if n := c.Int(name); n < 1 {
			return drill.Config{}, cli.Exit(fmt.Sprintf("--%s must be a whole number >= 1, got %d", name, n), exitUsage)
		}
	}
	for _, name := range []string{"phase", "service", "retry-pause"} {
		if d := c.Duration(name); d <= 0 {
			return drill.Config{}, cli.Exit(fmt.Sprintf("--%s must be a duration > 0, got %s", name, d), exitUsage)
		}
	}
	if r := c.Float64("target-ratio"); !(r > 0) || math.IsInf(r, 0) {
		return drill.Config{}, cli.Exit(fmt.Sprintf("--target-ratio must be a number > 0, got %g", r), exitUsage)
	}
	errw := c.App.ErrWriter
	if errw == nil {
		errw = os.Stderr
	}
	return drill.Config{
		// Warnings only: what a killed drill left behind and was removed.
		Log:          slog.New(slog.NewTextHandler(errw, &slog.HandlerOptions{Level: slog.LevelWarn})),
		PoolSize:     c.Int("pool"),
		BigWriters:   c.Int("big"),
		SmallWriters: c.Int("small"),
		Phase:        c.Duration("phase"),
		Slices:       c.Int("slices"),
		ServiceTime:  c.Duration("service"),
		RetryPause:   c.Duration("retry-pause"),
		TargetRatio:  c.Float64("target-ratio"),
	}, nil
}

// drillCommand is `fairshare drill`: the specification's experiment, run on
// this host with nothing to set up.
func drillCommand() *cli.Command {
	return &cli.Command{
		Name:  "drill",
		Usage: "run the fair-share drill on this host (two projects, a small pool) and print what it measured",
		Description: "Starts an upstream, a requests pool of 8, the scheduler and the front on loopback, then a\n" +
			"small project (2 writers) alone and together with a big one (16 writers), taking turns in\n" +
			"slices, and the big one alone. Prints latency, refusals and permits held per phase and\n" +
			"project, and the verdicts; exits non-zero when a verdict fails. 'fairshare drill connections'\n" +
			"does the same through the BPF connection pool (root).\n\n" +
			examples(
				"fairshare drill",
				"fairshare drill --phase 2s --svg drill.svg",
				"fairshare drill connections",
			),
		Flags: drillFlags(),
		Action: func(c *cli.Context) error {
			cfg, err := drillConfig(c)
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
			defer stop()
			rep, err := drill.Run(ctx, cfg)
			if err != nil {
				return cli.Exit(fmt.Sprintf("drill: %v", err), 1)
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
					examples("fairshare drill connections", "fairshare drill connections --json drill.json", "fairshare drill connections --to"),
				Flags: append(drillFlags(), &cli.BoolFlag{Name: "to",
					Usage: "connect to a destination pool's destination: --pool sizes a destination pool whose destination is the drill's server, in a node pool 16 times larger (docs/destination-pools.md)"}),
				Action: func(c *cli.Context) error {
					cfg, err := drillConfig(c)
					if err != nil {
						return err
					}
					ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
					defer stop()
					self, err := os.Executable()
					if err != nil {
						return cli.Exit(fmt.Sprintf("drill: finding own executable: %v", err), 1)
					}
					cfg.ToDestination = c.Bool("to")
					rep, err := drill.RunConnections(ctx, cfg, []string{self, "drill", drillLoopCommand})
					if err != nil {
						return cli.Exit(fmt.Sprintf("drill connections: %v", err), 1)
					}
					return finishDrill(c, rep)
				},
			},
			{
				Name:   drillLoopCommand,
				Hidden: true,
				Usage:  "load generator of the connections drill (started by it inside a project's cgroup)",
				Action: func(c *cli.Context) error {
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

func finishDrill(c *cli.Context, rep *drill.Report) error {
	if err := rep.WriteTable(c.App.Writer); err != nil {
		return err
	}
	write := func(path string, fn func(*os.File) error) error {
		if path == "" {
			return nil
		}
		f, err := os.Create(path)
		if err != nil {
			return cli.Exit(fmt.Sprintf("drill: %v", err), 1)
		}
		if err := fn(f); err != nil {
			f.Close()
			return cli.Exit(fmt.Sprintf("drill: writing %s: %v", path, err), 1)
		}
		if err := f.Close(); err != nil {
			return cli.Exit(fmt.Sprintf("drill: writing %s: %v", path, err), 1)
		}
		return nil
	}
	if err := write(c.String("json"), func(f *os.File) error { return rep.WriteJSON(f) }); err != nil {
		return err
	}
	if err := write(c.String("svg"), func(f *os.File) error { return rep.WriteSVG(f) }); err != nil {
		return err
	}
	if !rep.Pass {
		return cli.Exit(fmt.Sprintf("drill: %v", drill.ErrVerdict), 1)
	}
	return nil
}
