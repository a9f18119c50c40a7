// SPDX-License-Identifier: Apache-2.0

package main

import (
	"errors"
	"fmt"
	"io"
	"os"

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
	return &cli.App{
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
			statusCommand(),
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
}
