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
	args, err := flagsFirst(app, args)
	if err != nil {
		return cli.Exit(err.Error(), exitUsage)
	}
	return app.Run(args)
}

// flagsFirst moves the flags written after a command's first positional
// argument to before it, so that every flag of every command may follow its
// arguments ("project add NAME --cgroup P --admin-socket S"): urfave/cli v2
// stops reading flags at the first argument that is not one. A flag's value
// moves with it (the flags of the command named decide which take one); "--"
// ends the flags as usual, and what follows it stays an argument. A help
// flag among them shows the command's help. A flag that takes a value and
// has none after the arguments (it is last, or another of the command's
// flags follows) is an error: moved before the arguments it would take the
// first of them as its value.
//
// A completion request (urfave/cli's --generate-bash-completion, last) is
// left as written: urfave/cli finds it only last, completes from the word
// before it, and a partial flag after the arguments ("policy set alpha
// --ti") moved before them was refused as a flag not defined.
func flagsFirst(app *cli.App, args []string) ([]string, error) {
	if len(args) < 2 || args[len(args)-1] == "--generate-bash-completion" {
		return args, nil
	}
	out := []string{args[0]}
	words := []string{"fairshare"} // the command's, for messages
	flags, cmds := app.Flags, app.Commands
	rest := args[1:]
	// The command chain: flags, then a subcommand's name, down to the
	// command whose arguments follow.
	for len(rest) > 0 {
		a := rest[0]
		if a == "--" {
			return append(out, rest...), nil
		}
		if isFlag(a) {
			n := 1
			if takesValue(flags, a) && len(rest) > 1 {
				n = 2
			}
			out, rest = append(out, rest[:n]...), rest[n:]
			continue
		}
		sub := findCommand(cmds, a)
		if sub == nil {
			break
		}
		out, rest = append(out, a), rest[1:]
		words = append(words, sub.Name)
		flags, cmds = sub.Flags, sub.Subcommands
	}
	var moved, positional []string
	for i := 0; i < len(rest); i++ {
		a := rest[i]
		switch {
		case a == "--":
			positional = append(append(positional, "--"), rest[i+1:]...)
			i = len(rest)
		case isFlag(a):
			moved = append(moved, a)
			if takesValue(flags, a) {
				if i+1 == len(rest) || isFlag(rest[i+1]) && knownFlag(flags, rest[i+1]) {
					return nil, fmt.Errorf("flag %s needs a value (see '%s --help')", a, strings.Join(words, " "))
				}
				i++
				moved = append(moved, rest[i])
			}
		default:
			positional = append(positional, a)
		}
	}
	for _, f := range moved {
		if f == "-h" || f == "--help" || f == "-help" {
			// "policy get alpha --help" asks for the command's help, which
			// urfave/cli shows only without arguments (it takes one for a
			// help topic).
			return append(out, moved...), nil
		}
	}
	return append(append(out, moved...), positional...), nil
}

// knownFlag says whether a (-name, --name, --name=value) names one of flags
// or a help flag.
func knownFlag(flags []cli.Flag, a string) bool {
	name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
	if name == "h" || name == "help" {
		return true
	}
	for _, f := range flags {
		if slices.Contains(f.Names(), name) {
			return true
		}
	}
	return false
}

// isFlag says whether a is written as a flag ("-" alone is an argument).
func isFlag(a string) bool { return len(a) > 1 && a[0] == '-' && a != "--" }

// takesValue says whether the flag a (-name, --name; not --name=value) is
// one of flags that takes a value in the next argument.
func takesValue(flags []cli.Flag, a string) bool {
	name := strings.TrimLeft(a, "-")
	if strings.Contains(name, "=") {
		return false
	}
	for _, f := range flags {
		if slices.Contains(f.Names(), name) {
			v, ok := f.(cli.DocGenerationFlag)
			return ok && v.TakesValue()
		}
	}
	return false
}

// findCommand is the command of cmds named (or aliased) name.
func findCommand(cmds []*cli.Command, name string) *cli.Command {
	for _, c := range cmds {
		if c.HasName(name) {
			return c
		}
	}
	return nil
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
			"beats the environment, which beats the file, which beats the built-in defaults.\n" +
			"A command's flags may come before or after its arguments. A command line that cannot\n" +
			"run (no command, an unknown one, an argument a command does not take, a flag that\n" +
			"does not parse) exits 2.\n\n" +
			examples(
				"fairshare run --check",
				"fairshare status",
				"fairshare policy set alpha --tier pro",
				"fairshare completion bash > /etc/bash_completion.d/fairshare",
			),
		// Commands return cli.Exit; main decides how to leave, not the library.
		ExitErrHandler:  func(*cli.Context, error) {},
		HideHelpCommand: true,
		// The completion scripts ask for the next words with
		// --generate-bash-completion.
		EnableBashCompletion: true,
		Commands: []*cli.Command{
			runCommand(),
			policyCommand(),
			projectCommand(),
			statusCommand(),
			eventsCommand(),
			cleanupCommand(),
			drillCommand(),
			completionCommand(),
			genDocsCommand(),
			{
				Name:        "version",
				Usage:       "print the version",
				Description: examples("fairshare version"),
				Action: func(c *cli.Context) error {
					fmt.Fprintln(c.App.Writer, version)
					return nil
				},
			},
		},
	}
	// A flag or FAIRSHARE_* value that does not parse is a usage error,
	// which urfave returns as a plain error (exit 1); it is exit 2, like
	// every command line that cannot run. A value that parses and that run
	// refuses is the configuration's error, exit 78 (exitConfig).
	app.OnUsageError = usageError
	// So is a command that is not one. urfave's own answer to it, "No help
	// topic", exits 3, which is run's status for pins that changed.
	app.Action = needCommand
	var walk func([]*cli.Command)
	walk = func(cs []*cli.Command) {
		for _, c := range cs {
			c.OnUsageError = usageError
			// No command has a help command: --help is the one way to
			// help, and "policy get help" is the policy of project help.
			c.HideHelpCommand = true
			switch {
			case c.Action == nil:
				// A group of commands (policy, project): it runs one of
				// them.
				c.Action = needCommand
			case c.ArgsUsage == "":
				// A command whose usage shows no arguments takes none.
				c.Action = noArguments(c.Action)
			}
			walk(c.Subcommands)
		}
	}
	walk(app.Commands)
	return app
}

// exitUsage is the exit status of a flag or variable that does not parse,
// of a command that does not exist and of arguments a command does not take.
const exitUsage = 2

func usageError(c *cli.Context, err error, _ bool) error {
	return cli.Exit(fmt.Sprintf("%v (see '%s --help')", err, commandName(c)), exitUsage)
}

// commandWords are the names of the command c runs, below the program's
// ("policy", "list").
func commandWords(c *cli.Context) []string {
	var words []string
	if c != nil {
		for _, cc := range c.Lineage() {
			if cc.Command != nil && cc.Command.Name != "" && cc.Command.Name != c.App.Name {
				words = append([]string{cc.Command.Name}, words...)
			}
		}
	}
	return slices.Compact(words)
}

// commandName is the command c runs as typed, "fairshare policy list".
func commandName(c *cli.Context) string {
	return strings.Join(append([]string{"fairshare"}, commandWords(c)...), " ")
}

// needCommand is the action of the program and of each group of commands
// (policy, project): the first argument must name one of its commands. With
// none, the help is shown on stderr and the exit is 2, as for any other
// incomplete command line.
func needCommand(c *cli.Context) error {
	name := commandName(c)
	if c.NArg() > 0 {
		return unknownCommand(c)
	}
	var names []string
	if len(commandWords(c)) == 0 {
		cli.HelpPrinter(c.App.ErrWriter, cli.AppHelpTemplate, c.App)
		for _, sub := range c.App.VisibleCommands() {
			names = append(names, sub.Name)
		}
	} else {
		cli.HelpPrinter(c.App.ErrWriter, cli.SubcommandHelpTemplate, c.Command)
		for _, sub := range c.Command.VisibleCommands() {
			names = append(names, sub.Name)
		}
	}
	return cli.Exit(fmt.Sprintf("%s needs a command: %s", name, strings.Join(names, ", ")), exitUsage)
}

// unknownCommand is the error for a first argument that names none of the
// commands of c.
func unknownCommand(c *cli.Context) error {
	return cli.Exit(fmt.Sprintf("unknown command %q; see '%s --help'", c.Args().First(), commandName(c)), exitUsage)
}

// noArguments wraps the action of a command that takes no arguments: an
// argument is refused, exit 2, before the command does anything. Where the
// command has commands of its own (drill), the argument is taken as a
// mistyped one of them.
func noArguments(action cli.ActionFunc) cli.ActionFunc {
	return func(c *cli.Context) error {
		if c.NArg() > 0 {
			if len(c.Command.Subcommands) > 0 {
				return unknownCommand(c)
			}
			return cli.Exit(fmt.Sprintf("%s takes no arguments, got %q", strings.Join(commandWords(c), " "), c.Args().First()), exitUsage)
		}
		return action(c)
	}
}
