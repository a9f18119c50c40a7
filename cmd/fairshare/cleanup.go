// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"

	"github.com/fairshare-dev/fairshare/loader"
	"github.com/urfave/cli/v2"
)

func cleanupCommand() *cli.Command {
	return &cli.Command{
		Name:  "cleanup",
		Usage: "detach and unpin the BPF programs and maps: connections stop being enforced",
		Description: "For an uninstall, or systemd's ExecStopPost when enforcement should not outlive\n" +
			"the daemon. A plain restart does not need it: the daemon reuses what is pinned.\n\n" +
			examples("fairshare cleanup", "fairshare cleanup --pin-dir /sys/fs/bpf/fairshare-test"),
		Flags: []cli.Flag{configFlag(), pinDirFlag()},
		Action: func(c *cli.Context) error {
			if c.NArg() > 0 {
				return cli.Exit(fmt.Sprintf("cleanup takes no arguments, got %q", c.Args().First()), 2)
			}
			cfg, err := loadConfig(c)
			if err != nil {
				return err
			}
			if err := loader.Cleanup(cfg.PinDir); err != nil {
				return cli.Exit(fmt.Sprintf("cleanup of %s failed: %v", cfg.PinDir, err), 1)
			}
			fmt.Fprintf(c.App.Writer, "detached and unpinned everything under %s\n", cfg.PinDir)
			return nil
		},
	}
}
