// SPDX-License-Identifier: Apache-2.0

package main

import (
	"errors"
	"fmt"

	"github.com/fairshare-dev/fairshare/daemon"
	"github.com/fairshare-dev/fairshare/loader"
	"github.com/urfave/cli/v2"
)

func cleanupCommand() *cli.Command {
	return &cli.Command{
		Name:  "cleanup",
		Usage: "detach and unpin the BPF programs and maps: connections stop being enforced",
		Description: "For an uninstall, or systemd's ExecStopPost when enforcement should not outlive\n" +
			"the daemon. A plain restart does not need it: the daemon reuses what is pinned.\n" +
			"A running daemon holds a lock on its pin directory: cleanup refuses it (exit 1)\n" +
			"unless --force, which unpins everything under the running daemon: it notices\n" +
			"within a tick and stops (exit 1), and its programs detach as it exits, leaving\n" +
			"nothing behind; a supervisor that restarts it starts afresh on empty pins.\n\n" +
			examples("fairshare cleanup", "fairshare cleanup --pin-dir /sys/fs/bpf/fairshare-test"),
		Flags: []cli.Flag{configFlag(), pinDirFlag(), &cli.BoolFlag{
			Name:  "force",
			Usage: "unpin even while a daemon runs on the pin directory (it stops within a tick, and enforcement ends as it exits)",
		}},
		Action: func(c *cli.Context) error {
			cfg, err := loadConfig(c)
			if err != nil {
				return err
			}
			// The daemon's lock, held while cleaning: a daemon that starts
			// meanwhile is refused rather than pinning into a directory
			// being removed.
			lock, err := daemon.LockPins(cfg.PinDir)
			switch {
			case errors.Is(err, daemon.ErrPinsInUse) && !c.Bool("force"):
				return cli.Exit(fmt.Sprintf("cleanup refused: %v; stop the daemon first (systemctl stop fairshare), "+
					"or --force to detach its programs while it runs", err), 1)
			case errors.Is(err, daemon.ErrPinsInUse):
				fmt.Fprintf(c.App.ErrWriter, "warning: %v; --force: unpinning under it: it stops within a tick, and its programs detach as it exits\n", err)
			case err != nil:
				return cli.Exit(fmt.Sprintf("cleanup of %s failed: %v", cfg.PinDir, err), 1)
			}
			if lock != nil {
				defer lock.Close()
			}
			if err := loader.Cleanup(cfg.PinDir); err != nil {
				return cli.Exit(fmt.Sprintf("cleanup of %s failed: %v", cfg.PinDir, err), 1)
			}
			fmt.Fprintf(c.App.Writer, "detached and unpinned everything under %s\n", cfg.PinDir)
			return nil
		},
	}
}
