// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/events"
	"github.com/fairshare-dev/fairshare/policy"
	"github.com/urfave/cli/v2"
)

func eventsCommand() *cli.Command {
	return &cli.Command{
		Name:  "events",
		Usage: "show what was refused (or would have been, in dry-run), evicted or repaired, and why",
		Description: "Asks the running daemon over its admin socket for its recent events (kernel refusals of\n" +
			"connect and SYN, the front's and the permit API's refusals, evictions, reconcile's\n" +
			"repairs), then exits; with --follow it keeps printing new ones until interrupted, or\n" +
			"until the daemon stops (exit 1, so that a forwarder under a supervisor reconnects).\n" +
			"Each project's events are bounded per second (events.per_sec), in the kernel too:\n" +
			"what is over the bound is dropped and a 'dropped' event says how many. A stream that\n" +
			"cannot keep up is told the same way. Counters in /metrics are exact; events are for\n" +
			"diagnosis.\n\n" +
			examples(
				"fairshare events",
				"fairshare events --follow --project alpha",
				"fairshare events --json --pool connections",
			),
		Flags: []cli.Flag{configFlag(), adminSocketFlag(),
			&cli.StringFlag{Name: "project", Usage: "only the events of project `P`"},
			// No environment variable: FAIRSHARE_POOL is run's --pool.
			&cli.StringFlag{Name: "pool", Usage: "only the events of pool `NAME` (connections, requests, flights, residents, ...)"},
			&cli.BoolFlag{Name: "json", Usage: "print one JSON object per event and line"},
			&cli.BoolFlag{Name: "follow", Aliases: []string{"f"}, Usage: "keep printing new events until interrupted (exit 0) or the daemon stops (exit 1)"},
		},
		Action: eventsAction,
	}
}

func eventsAction(c *cli.Context) error {
	// Not loadConfig: its --pool is run's (NAME=SIZE).
	cfg, err := config.Load(c.String(flagConfig))
	if err != nil {
		return cli.Exit(fmt.Sprintf("the configuration is not usable: %v", err), 2)
	}
	if c.IsSet(flagAdminSocket) {
		cfg.AdminSocket = c.String(flagAdminSocket)
	}
	f := events.Filter{Project: c.String("project"), Pool: c.String("pool")}
	if f.Project != "" {
		if err := policy.ValidateProject(f.Project); err != nil {
			return cli.Exit(fmt.Sprintf("--project: %v", err), 2)
		}
	}
	// A pool is not checked against the configuration here: the daemon
	// may run pools its --pool flags added. It checks the name.
	ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
	defer stop()
	w := c.App.Writer
	enc := json.NewEncoder(w)
	asJSON := c.Bool("json")
	err = admin.NewClient(cfg.AdminSocket).Events(ctx, f, c.Bool("follow"), func(e events.Event) error {
		if asJSON {
			return enc.Encode(e)
		}
		_, err := fmt.Fprintln(w, e.Text())
		return err
	})
	switch {
	case err == nil, errors.Is(err, context.Canceled):
		return nil
	case errors.Is(err, admin.ErrNoDaemon):
		return cli.Exit(fmt.Sprintf("%v: events are kept by the running daemon only", err), 1)
	default:
		return cli.Exit(fmt.Sprintf("reading events: %v", err), 1)
	}
}
