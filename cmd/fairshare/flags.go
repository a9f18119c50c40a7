// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/fairshare-dev/fairshare/config"
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
	set := func(name string, dst *string) {
		if c.IsSet(name) {
			*dst = c.String(name)
		}
	}
	set(flagAdminSocket, &cfg.AdminSocket)
	set(flagStateDir, &cfg.StateDir)
	set(flagPinDir, &cfg.PinDir)
	set(flagProjectsRoot, &cfg.ProjectsRoot)
	set(flagMetrics, &cfg.Metrics.Listen)
	set(flagFrontListen, &cfg.Front.Listen)
	set(flagFrontUp, &cfg.Front.Upstream)
	set(flagPermits, &cfg.Permits.Socket)
	if c.IsSet(flagNoBPF) {
		cfg.BPF = !c.Bool(flagNoBPF)
	}
	if err := cfg.Validate(); err != nil {
		return config.Config{}, cli.Exit(fmt.Sprintf("the configuration is not usable: %v", err), 2)
	}
	return cfg, nil
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
