// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"

	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/pools"
	"github.com/urfave/cli/v2"
)

// Flag names shared by several commands.
const (
	flagConfig       = "config"
	flagAdminSocket  = "admin-socket"
	flagStateDir     = "state-dir"
	flagPinDir       = "pin-dir"
	flagProjectsRoot = "projects-root"
	flagMetrics      = "metrics-listen"
	flagFrontListen  = "front-listen"
	flagFrontUp      = "front-upstream"
	flagPermits      = "permits-socket"
	flagNoBPF        = "no-bpf"
	flagLogLevel     = "log-level"
	flagLogFormat    = "log-format"
	flagPool         = "pool"
	flagPermitsGroup = "permits-group"
	flagFrontSocket  = "front-socket"
	flagMaxInFlight  = "front-max-in-flight"
	flagReconcile    = "reconcile"
	flagMaxConns     = "max-conns"
	flagSources      = "project-sources"
)

func env(name string) []string {
	return []string{"FAIRSHARE_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))}
}

func configFlag() cli.Flag {
	return &cli.StringFlag{Name: flagConfig, Usage: "YAML configuration `FILE` (defaults are built in; see 'run --print-config')", EnvVars: env(flagConfig)}
}

func adminSocketFlag() cli.Flag {
	return &cli.StringFlag{Name: flagAdminSocket, Usage: "admin API unix socket `PATH` [default from config: /run/fairshare/admin.sock]", EnvVars: env(flagAdminSocket)}
}

// stateDirFlag is --state-dir; what the directory is for differs between
// the daemon (holds the store) and the policy commands (write it when no
// daemon answers), and the help says which.
func stateDirFlag(what string) cli.Flag {
	return &cli.StringFlag{Name: flagStateDir, Usage: "`DIR` of the policy store, " + what + " [default from config: /var/lib/fairshare]", EnvVars: env(flagStateDir)}
}

func pinDirFlag() cli.Flag {
	return &cli.StringFlag{Name: flagPinDir, Usage: "bpffs `DIR` of the pinned maps and links [default from config: /sys/fs/bpf/fairshare]", EnvVars: env(flagPinDir)}
}

// policyFlags are what the policy commands need to find the daemon, or the
// store when no daemon answers.
func policyFlags() []cli.Flag {
	return []cli.Flag{configFlag(), adminSocketFlag(), stateDirFlag("used directly when no daemon answers")}
}

// loadConfig reads --config and lays every set flag over it; a flag is set
// when given on the command line or through its FAIRSHARE_* variable.
func loadConfig(c *cli.Context) (config.Config, error) {
	cfg, err := config.Load(c.String(flagConfig))
	if err != nil {
		return config.Config{}, cli.Exit(fmt.Sprintf("the configuration is not usable: %v", err), 2)
	}
	for _, kf := range keyFlags {
		if !c.IsSet(kf.flag) {
			continue
		}
		if err := setFromFlag(c, &cfg, kf); err != nil {
			return config.Config{}, cli.Exit(fmt.Sprintf("the configuration is not usable: %v", err), 2)
		}
	}
	if c.IsSet(flagPool) {
		for _, v := range c.StringSlice(flagPool) {
			if err := setPool(&cfg, v); err != nil {
				return config.Config{}, cli.Exit(fmt.Sprintf("the configuration is not usable: --%s %s: %v", flagPool, v, err), 2)
			}
		}
	}
	if err := cfg.Validate(); err != nil {
		return config.Config{}, cli.Exit(fmt.Sprintf("the configuration is not usable: %v", err), 2)
	}
	return cfg, nil
}

// setPool applies one --pool value: NAME=SIZE or NAME=SIZE/FLOOR. A name
// not configured adds a pool, as a file would.
func setPool(cfg *config.Config, v string) error {
	name, spec, ok := strings.Cut(strings.TrimSpace(v), "=")
	if !ok || name == "" {
		return fmt.Errorf("want NAME=SIZE or NAME=SIZE/FLOOR")
	}
	sizeStr, floorStr, hasFloor := strings.Cut(spec, "/")
	size, err := strconv.Atoi(sizeStr)
	if err != nil {
		return fmt.Errorf("SIZE %q is not a whole number", sizeStr)
	}
	p := cfg.Pools[name]
	p.Size = size
	if hasFloor {
		if p.Floor, err = strconv.Atoi(floorStr); err != nil {
			return fmt.Errorf("FLOOR %q is not a whole number", floorStr)
		}
	}
	if p.Window == 0 {
		p.Window = pools.DefaultWindow
	}
	cfg.Pools[name] = p
	return nil
}

// runFlags are the daemon's settings beyond what every command shares.
func runFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringSliceFlag{Name: flagPool, Usage: "resize or add a pool: `NAME=SIZE[/FLOOR]`, repeatable (FAIRSHARE_POOL takes a comma-separated list)", EnvVars: env(flagPool)},
		&cli.StringFlag{Name: flagPermitsGroup, Usage: "`GROUP` (name or gid) that may use the permit socket besides root [default from config: none]", EnvVars: env(flagPermitsGroup)},
		&cli.StringFlag{Name: flagFrontSocket, Usage: "unix socket `PATH` the HTTP front also listens on [default from config: none]", EnvVars: env(flagFrontSocket)},
		&cli.IntFlag{Name: flagMaxInFlight, Usage: maxInFlightUsage, DefaultText: fromConfig(maxInFlightUsage), EnvVars: env(flagMaxInFlight)},
		&cli.DurationFlag{Name: flagReconcile, Usage: reconcileUsage, DefaultText: fromConfig(reconcileUsage), EnvVars: env(flagReconcile)},
		&cli.StringSliceFlag{Name: flagSources, Usage: "sources of project membership, earlier first in a conflict: `SOURCE` is directory, systemd, registered or kubernetes; repeatable or comma-separated [default from config: directory,registered]", EnvVars: env(flagSources)},
		&cli.IntFlag{Name: flagMaxConns, Usage: maxConnsUsage, DefaultText: fromConfig(maxConnsUsage), EnvVars: env(flagMaxConns)},
	}
}

// The usages of run's number and duration flags whose default comes from
// the configuration. urfave/cli prints such a flag's own default after the
// usage, "(default: 0)" for a flag whose Go default is zero, which is not
// what the daemon runs with: fromConfig gives it the usage's instead.
const (
	maxInFlightUsage = "`N` requests at most in flight to the upstream [default from config: 64]"
	reconcileUsage   = "period `D` of the reconcile pass, 0 for only the one at start [default from config: 1m]"
	maxConnsUsage    = "connections `N` at most per listener (0: from the open-files limit) [default from config: 0]"
)

// fromConfig is the default a usage names in "[default from config: X]".
func fromConfig(usage string) string {
	_, rest, _ := strings.Cut(usage, "[default from config: ")
	def, _, _ := strings.Cut(rest, "]")
	return def
}

func newLogger(c *cli.Context) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(c.String(flagLogLevel))); err != nil {
		return nil, cli.Exit(fmt.Sprintf("--log-level must be debug, info, warn or error, got %q", c.String(flagLogLevel)), 2)
	}
	opts := &slog.HandlerOptions{Level: level}
	switch c.String(flagLogFormat) {
	case "text":
		return slog.New(slog.NewTextHandler(os.Stderr, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(os.Stderr, opts)), nil
	default:
		return nil, cli.Exit(fmt.Sprintf("--log-format must be text or json, got %q", c.String(flagLogFormat)), 2)
	}
}
