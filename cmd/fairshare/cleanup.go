// SPDX-License-Identifier: Apache-2.0

package main

import (
	"errors"
	"fmt"
	"path/filepath"

	"github.com/fairshare-dev/fairshare/daemon"
	"github.com/fairshare-dev/fairshare/loader"
	"github.com/urfave/cli/v2"
	"golang.org/x/sys/unix"
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
			"nothing behind; a supervisor that restarts it starts afresh on empty pins.\n" +
			"It removes only what fairshare pins (fs_*, link_*, netns/, migrating/, migrated/)\n" +
			"and refuses (exit 1, removing nothing) a directory that is not on bpffs, is\n" +
			"bpffs's root (/sys/fs/bpf) or holds anything else. A pin directory that does\n" +
			"not exist has nothing pinned: it says so and exits 0, so that an uninstall or\n" +
			"ExecStopPost may run it again; read the message: a mistyped --pin-dir is one.\n\n" +
			examples("fairshare cleanup", "fairshare cleanup --config /etc/fairshare/config.yaml",
				"fairshare cleanup --pin-dir /sys/fs/bpf/fairshare-test"),
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
			rep, err := loader.CleanupPinDir(cfg.PinDir)
			switch {
			case errors.Is(err, loader.ErrNotPinDir):
				return cli.Exit(fmt.Sprintf("cleanup refused: %v", err), 1)
			case err != nil:
				return cli.Exit(fmt.Sprintf("cleanup of %s failed: %v", cfg.PinDir, err), 1)
			case rep.Missing:
				fmt.Fprintf(c.App.Writer, "nothing is pinned in %s: it does not exist\n", cfg.PinDir)
				noteElsewhere(c, cfg.PinDir)
			case rep.Pins == 0:
				fmt.Fprintf(c.App.Writer, "nothing was pinned in %s; removed the empty directory\n", cfg.PinDir)
			default:
				fmt.Fprintf(c.App.Writer, "detached and unpinned everything under %s (%d pins), and removed it\n", cfg.PinDir, rep.Pins)
			}
			return nil
		},
	}
}

// noteElsewhere tells, on stderr, where pins are when the pin directory
// named does not exist: a mistyped --pin-dir (or a --config naming
// another pin_dir) leaves enforcement in place, and the exit status 0 an
// idempotent uninstall needs does not say so.
func noteElsewhere(c *cli.Context, pinDir string) {
	parent := filepath.Dir(pinDir)
	var sfs unix.Statfs_t
	if err := unix.Statfs(parent, &sfs); err != nil || sfs.Type != unix.BPF_FS_MAGIC {
		fmt.Fprintf(c.App.ErrWriter, "note: %s is not a bpf file system, where fairshare pins: is --pin-dir (or pin_dir) right?\n", parent)
		return
	}
	for _, d := range loader.PinDirsIn(parent) {
		fmt.Fprintf(c.App.ErrWriter, "note: fairshare's pins are in %s: fairshare cleanup --pin-dir %s removes them\n", d, d)
	}
}
