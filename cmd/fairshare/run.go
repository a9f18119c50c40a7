// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/daemon"
	"github.com/fairshare-dev/fairshare/internal/membership"
	"github.com/fairshare-dev/fairshare/loader"
	"github.com/urfave/cli/v2"
)

// exitConfig is run's exit status for a configuration it cannot use (a
// value of the file, of a FAIRSHARE_* variable or of a flag that it
// refuses), from --check and --print-config too: EX_CONFIG of sysexits.h.
// Not 2: the Go runtime exits 2 on a panic or a fatal error (concurrent map
// writes, out of memory), as does every command given a command line it
// cannot parse. dist/fairshare.service does not restart on exitConfig, and
// must restart a daemon that crashed.
const exitConfig = 78

// exitStalePins is run's exit status when the pins changed layout while
// the daemon loaded (daemon.ErrStalePins: another process at work on the
// pin directory; pins of another layout found at the start are migrated);
// dist/fairshare.service does not restart on it. Go never exits 3.
const exitStalePins = 3

// notUsable is run's error for a configuration it cannot use.
func notUsable(err error) error {
	return cli.Exit(fmt.Sprintf("the configuration is not usable: %v", err), exitConfig)
}

// configStatus gives an error of loadConfig or newLogger, which exit 2 for
// a configuration the other commands cannot use, run's status for it. Any
// other status is left as it is.
func configStatus(err error) error {
	var ec cli.ExitCoder
	if errors.As(err, &ec) && ec.ExitCode() == 2 {
		return cli.Exit(err.Error(), exitConfig)
	}
	return err
}

func runCommand() *cli.Command {
	return &cli.Command{
		Name:  "run",
		Usage: "run the daemon: attach the BPF programs, serve the admin API, /metrics and the HTTP front",
		Description: "Needs root with the capabilities docs/install.md lists (Requirements; the unit in\n" +
			"dist/fairshare.service keeps the same). SIGINT or SIGTERM stops it;\n" +
			"SIGHUP reads the configuration again and applies its destination pools (the rest needs a restart);\n" +
			"the BPF programs stay pinned and keep enforcing unless --detach-on-exit is given,\n" +
			"so a restart loses neither counts nor enforcement.\n\n" +
			"Pins of another layout (a new version's maps, a larger pool) are migrated at start,\n" +
			"with no moment unenforced (docs/install.md, Upgrade).\n\n" +
			"Exit status: 78 for an unusable configuration (a value of the file, a FAIRSHARE_*\n" +
			"variable or a flag that run refuses), 3 when the objects pinned in --pin-dir changed layout\n" +
			"while the starting daemon loaded against them (another process at work there: start\n" +
			"again once it is done; the start then reuses or migrates what is pinned), 1 for any\n" +
			"other failure.\n" +
			"2 is a command line (or a FAIRSHARE_* value) that does not parse, or a crash: Go exits 2\n" +
			"on a panic or a fatal runtime error.\n" +
			"--check exits with the same statuses, 0 when all is well; --print-config exits 0,\n" +
			"or 78 for a value run would refuse (the sockets and directories run makes are checked\n" +
			"only as it starts).\n\n" +
			examples(
				"fairshare run --check",
				"fairshare run --print-config --config /etc/fairshare/config.yaml",
				"fairshare run --config /etc/fairshare/config.yaml",
				"fairshare run --front-listen 127.0.0.1:8080 --front-upstream http://127.0.0.1:9000 --pool requests=200",
			),
		Flags: append([]cli.Flag{
			configFlag(), adminSocketFlag(), stateDirFlag("held open by the daemon (policy commands go through it)"), pinDirFlag(),
			&cli.StringFlag{Name: flagProjectsRoot, Usage: "cgroup2 `DIR` whose children are the projects (sources directory and systemd) [default: <cgroup2 mount>/fairshare, or fairshare.slice with systemd]", EnvVars: env(flagProjectsRoot)},
			&cli.StringFlag{Name: flagMetrics, Usage: "`HOST:PORT` of /metrics, empty to disable [default from config: 127.0.0.1:9464]", EnvVars: env(flagMetrics)},
			&cli.StringFlag{Name: flagFrontListen, Usage: "`HOST:PORT` of the HTTP front, empty to disable [default from config: disabled]", EnvVars: env(flagFrontListen)},
			&cli.StringFlag{Name: flagFrontUp, Usage: "upstream base `URL` of the HTTP front (used only with --front-listen or --front-socket)", EnvVars: env(flagFrontUp)},
			&cli.StringFlag{Name: flagPermits, Usage: "permit API unix socket `PATH` for runtimes, empty to disable [default from config: /run/fairshare/permits.sock]", EnvVars: env(flagPermits)},
			&cli.BoolFlag{Name: flagNoBPF, Usage: "do not load BPF: connections are NOT enforced (for hosts without BPF)", EnvVars: env(flagNoBPF)},
			&cli.BoolFlag{Name: "detach-on-exit", Usage: "detach and unpin the BPF programs on shutdown instead of leaving them enforcing", EnvVars: env("detach-on-exit")},
			&cli.BoolFlag{Name: "check", Usage: "load, attach and verify the BPF programs (and ask the container runtime for its pods, with the kubernetes source), then exit 0 (ok), 78 (a configuration or flag value run would refuse), 3 (pins changed while loaded against them) or 1 (any other failure)"},
			&cli.BoolFlag{Name: "print-config", Usage: "check the configuration and print it as the daemon would run it (defaults resolved) as YAML, then exit"},
			&cli.StringFlag{Name: flagLogLevel, Value: "info", Usage: "`LEVEL`: debug, info, warn or error", EnvVars: env(flagLogLevel)},
			&cli.StringFlag{Name: flagLogFormat, Value: "text", Usage: "`FORMAT`: text or json", EnvVars: env(flagLogFormat)},
			&cli.StringFlag{Name: "ready-file", Hidden: true, Usage: "write a JSON file with the bound addresses once serving (tests)"},
		}, runFlags()...),
		Action: func(c *cli.Context) error {
			cfg, err := loadConfig(c)
			if err != nil {
				return configStatus(err)
			}
			// The logger's flags are settings like the others: --check and
			// --print-config refuse what run refuses.
			log, err := newLogger(c)
			if err != nil {
				return configStatus(err)
			}
			if c.Bool("print-config") && c.Bool("check") {
				return cli.Exit("--print-config and --check are two runs: give one of them", 2)
			}
			if c.Bool("print-config") {
				// What run would refuse when it builds its parts is refused
				// here too, with the same status.
				if err := daemon.CheckHost(cfg); err != nil {
					return notUsable(err)
				}
				eff, notes := daemon.Effective(cfg)
				out, err := eff.Marshal()
				if err != nil {
					return cli.Exit(err.Error(), 1)
				}
				w := c.App.Writer
				fmt.Fprintln(w, "# fairshare: the effective configuration (file, FAIRSHARE_* and flags, validated, defaults resolved)")
				for _, n := range notes {
					fmt.Fprintf(w, "# not resolved: %s\n", strings.ReplaceAll(n, "\n", " "))
				}
				_, err = w.Write(out)
				return err
			}
			if c.Bool("check") {
				return check(c, cfg)
			}
			configDir := ""
			if f := c.String(flagConfig); f != "" {
				configDir = filepath.Dir(f)
			}
			// The signals are caught before the daemon is built: a SIGHUP
			// (systemctl reload right after start) or a SIGTERM that comes
			// while New runs waits for it, instead of killing the process
			// halfway through making its pins. A SIGTERM then stops the
			// daemon as soon as it runs.
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
			defer stop()
			// SIGHUP reads the configuration again (file, environment and
			// flags) and applies its destination pools (daemon.Reload).
			hup := make(chan os.Signal, 1)
			signal.Notify(hup, syscall.SIGHUP)
			defer signal.Stop(hup)
			d, err := daemon.New(daemon.Options{Config: cfg, Version: version, Log: log, ConfigDir: configDir,
				ReadyFile: c.String("ready-file"), DetachOnExit: c.Bool("detach-on-exit")})
			if errors.Is(err, config.ErrInvalid) {
				// Found only when the parts were built (a group that does not
				// exist, a cgroup outside the mount): still the configuration.
				return notUsable(err)
			}
			if errors.Is(err, daemon.ErrStalePins) {
				// A restart cannot fix it (systemd's unit stops retrying on
				// this status), and the sentence names the remedy.
				return cli.Exit(fmt.Sprintf("the daemon could not start: %v", err), exitStalePins)
			}
			if err != nil {
				return cli.Exit(fmt.Sprintf("the daemon could not start: %v", err), 1)
			}
			go func() {
				for {
					select {
					case <-ctx.Done():
						return
					case <-hup:
						next, err := loadConfig(c)
						if err == nil {
							err = d.Reload(next)
						}
						if err != nil {
							log.Error("SIGHUP: the configuration was not applied; the one in force stays", "err", err)
						}
					}
				}
			}()
			if err := d.Run(ctx); err != nil {
				if errors.Is(err, config.ErrInvalid) {
					return notUsable(err)
				}
				return cli.Exit(fmt.Sprintf("the daemon stopped with an error: %v", err), 1)
			}
			return nil
		},
	}
}

// check runs loader.Check: the programs pass the verifier and every hook
// attaches (on a temporary cgroup, with unpinned maps), and pins in the pin
// directory, a running daemon's included, are verified without writing to
// them: its counts, exempt set and programs are left as they are.
func check(c *cli.Context, cfg config.Config) error {
	// What run would refuse before it loads anything (a projects root
	// outside the cgroup2 mount, a permits.group that does not exist) is
	// refused here too, with run's status: a check that passes must not
	// be followed by a start that stops with exit status 78.
	if err := daemon.CheckHost(cfg); err != nil {
		return notUsable(err)
	}
	if cfg.Projects.Has(membership.SourceKubernetes) {
		// Not a failure: the daemon runs without the runtime, and reads the
		// pods once it answers.
		ctx, cancel := context.WithTimeout(c.Context, 5*time.Second)
		line, err := daemon.CheckKubernetes(ctx, cfg)
		cancel()
		if err != nil {
			line = fmt.Sprintf("note: kubernetes: %v; the daemon starts anyway and reads the pods once it answers", err)
		} else {
			line = "ok: " + line
		}
		fmt.Fprintln(c.App.Writer, line)
	}
	if !cfg.BPF {
		fmt.Fprintln(c.App.Writer, "configuration ok; bpf is disabled, so there is nothing to attach")
		return nil
	}
	root, err := daemon.ProjectsRoot(cfg)
	if err != nil {
		return cli.Exit(fmt.Sprintf("check failed: %v", err), 1)
	}
	conn := cfg.Pools[config.PoolConnections]
	rep, err := loader.Check(loader.Options{PinDir: cfg.PinDir,
		PoolSize: uint32(conn.Size), Floor: uint32(conn.Floor), Window: conn.Window,
		AbortMovedPast: cfg.Connections.AbortMovedPast})
	if errors.Is(err, loader.ErrPinnedMismatch) {
		// Pins of another layout are no failure (rep.Migrate, below): this
		// is pins that changed while the check loaded against them.
		return cli.Exit(fmt.Sprintf("check failed: the maps pinned in %s changed layout while the check loaded the programs against them "+
			"(another process at work on the pin directory, such as a daemon migrating them as it starts); run the check again once "+
			"it is done: pins of another layout are migrated when the daemon starts, not refused (%v)", cfg.PinDir, err), exitStalePins)
	}
	if err != nil {
		return cli.Exit(fmt.Sprintf("check failed: %+v", err), 1)
	}
	w := c.App.Writer
	fmt.Fprintf(w, "ok: the programs load and all %d hooks attach (tested on a temporary cgroup)\n", len(rep.Attached))
	if !rep.Pinned {
		fmt.Fprintf(w, "nothing pinned in %s: the daemon will load the programs and attach them to the cgroup2 root (projects from %s)\n", cfg.PinDir, root)
		return nil
	}
	if rep.Migrate != "" {
		fmt.Fprintf(w, "note: pinned in %s: %s; the daemon migrates them when it starts, with no moment unenforced: "+
			"fresh maps count the live connections before the old programs are detached (rate tokens, unread events "+
			"and per-project admitted/refused counters are lost; docs/install.md#upgrade)\n", cfg.PinDir, rep.Migrate)
		return nil
	}
	fmt.Fprintf(w, "ok: pinned in %s, left untouched: connections pool %d (floor %d), %d in use by %d projects, %d exempt cgroups\n",
		cfg.PinDir, rep.Pool, rep.Floor, rep.InUse, rep.Projects, rep.Exempt)
	if rep.Pool != conn.Size {
		fmt.Fprintf(w, "note: the configuration's pool is %d; the daemon applies it when it starts (the pinned tables hold up to %d)\n",
			conn.Size, rep.Capacity)
	}
	if !rep.Current {
		fmt.Fprintln(w, "note: the attached programs are not this binary's; restarting the daemon moves the links to them")
	}
	return nil
}
