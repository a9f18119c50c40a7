// SPDX-License-Identifier: Apache-2.0

package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"github.com/urfave/cli/v2"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	if err := run(os.Args, os.Stdout, os.Stderr); err != nil {
		code := 1
		var ec cli.ExitCoder
		if errors.As(err, &ec) {
			code = ec.ExitCode()
		}
		if msg := err.Error(); msg != "" {
			fmt.Fprintln(os.Stderr, "fairshare:", msg)
		}
		os.Exit(code)
	}
}

// run is the whole program minus the process exit, so tests can call it.
func run(args []string, stdout, stderr io.Writer) error {
	app := newApp()
	app.Writer, app.ErrWriter = stdout, stderr
	return app.Run(args)
}

func newApp() *cli.App {
	app := &cli.App{
		Name:    "fairshare",
		Usage:   "divide a node's connections, requests and other pools fairly among its projects",
		Version: version,
		Description: "fairshare is a host daemon and its CLI. 'fairshare run' enforces the fair-share rule;\n" +
			"the other commands talk to it over its admin socket (root only).\n\n" +
			"Flags that name files and addresses can also be set with FAIRSHARE_* environment\n" +
			"variables (shown with each flag) or in the YAML file given with --config; a flag\n" +
			"beats the environment, which beats the file, which beats the built-in defaults.",
		// Commands return cli.Exit; main decides how to leave, not the library.
		ExitErrHandler:  func(*cli.Context, error) {},
		HideHelpCommand: true,
		Commands: []*cli.Command{
			runCommand(),
			policyCommand(),
			projectCommand(),
			statusCommand(),
			eventsCommand(),
			cleanupCommand(),
			drillCommand(),
			{
				Name:  "version",
				Usage: "print the version",
				Action: func(c *cli.Context) error {
					fmt.Fprintln(c.App.Writer, version)
					return nil
				},
			},
		},
	}
	// A flag or FAIRSHARE_* value that does not parse is a usage error,
	// which urfave returns as a plain error (exit 1: systemd would restart
	// the daemon in a loop); it is exit 2, like every unusable setting.
	app.OnUsageError = usageError
	var walk func([]*cli.Command)
	walk = func(cs []*cli.Command) {
		for _, c := range cs {
			c.OnUsageError = usageError
			walk(c.Subcommands)
		}
	}
	walk(app.Commands)
	return app
}

// exitUsage is the exit status of a flag or variable that does not parse.
const exitUsage = 2

func usageError(c *cli.Context, err error, _ bool) error {
	var words []string
	if c != nil {
		for _, cc := range c.Lineage() {
			if cc.Command != nil && cc.Command.Name != "" && cc.Command.Name != c.App.Name {
				words = append([]string{cc.Command.Name}, words...)
			}
		}
	}
	what := strings.Join(append([]string{"fairshare"}, slices.Compact(words)...), " ")
	return cli.Exit(fmt.Sprintf("%v (see '%s --help')", err, what), exitUsage)
}
