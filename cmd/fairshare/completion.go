// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"strings"

	"github.com/urfave/cli/v2"
)

// The bash and zsh scripts ask the binary itself for the words that may
// come next (urfave/cli's --generate-bash-completion), so they never go
// stale; fish gets a static script written from the commands and flags.
const bashCompletion = `# bash completion for fairshare: source it, or put it in
# /etc/bash_completion.d/fairshare (fairshare completion bash > ...).
_fairshare_complete() {
  local cur words
  COMPREPLY=()
  cur="${COMP_WORDS[COMP_CWORD]}"
  words=("${COMP_WORDS[@]:0:$COMP_CWORD}")
  local opts
  if [[ "$cur" == -* ]]; then
    opts=$("${words[@]}" "$cur" --generate-bash-completion 2>/dev/null)
  else
    opts=$("${words[@]}" --generate-bash-completion 2>/dev/null)
  fi
  COMPREPLY=($(compgen -W "${opts}" -- "${cur}"))
  return 0
}
complete -o bashdefault -o default -F _fairshare_complete fairshare
`

const zshCompletion = `#compdef fairshare
# zsh completion for fairshare: put it in a directory of $fpath as _fairshare
# (fairshare completion zsh > "${fpath[1]}/_fairshare"), or source it.
_fairshare() {
  local -a opts
  local cur
  cur=${words[-1]}
  if [[ "$cur" == "-"* ]]; then
    opts=("${(@f)$(${words[@]:0:#words[@]-1} ${cur} --generate-bash-completion 2>/dev/null)}")
  else
    opts=("${(@f)$(${words[@]:0:#words[@]-1} --generate-bash-completion 2>/dev/null)}")
  fi
  if [[ "${opts[1]}" != "" ]]; then
    _describe 'values' opts
  else
    _files
  fi
}
if [[ "$funcstack[1]" == "_fairshare" ]]; then
  _fairshare "$@"
else
  compdef _fairshare fairshare
fi
`

// completionShells are the shells 'fairshare completion' writes for.
var completionShells = []string{"bash", "zsh", "fish"}

func completionCommand() *cli.Command {
	return &cli.Command{
		Name:      "completion",
		Usage:     "print a shell completion script for bash, zsh or fish",
		ArgsUsage: "bash|zsh|fish",
		Description: "The script completes commands, subcommands and flags.\n\n" +
			examples(
				"fairshare completion bash > /etc/bash_completion.d/fairshare",
				`fairshare completion zsh > "${fpath[1]}/_fairshare"`,
				"fairshare completion fish > ~/.config/fish/completions/fairshare.fish",
			),
		Action: func(c *cli.Context) error {
			if c.NArg() != 1 {
				return cli.Exit(fmt.Sprintf("completion takes one shell: %s", strings.Join(completionShells, ", ")), 2)
			}
			s, err := completionScript(c.App, c.Args().First())
			if err != nil {
				return cli.Exit(err.Error(), 2)
			}
			_, err = fmt.Fprint(c.App.Writer, s)
			return err
		},
	}
}

// completionScript is the completion script of app for shell.
func completionScript(app *cli.App, shell string) (string, error) {
	switch shell {
	case "bash":
		return bashCompletion, nil
	case "zsh":
		return zshCompletion, nil
	case "fish":
		s, err := app.ToFishCompletion()
		if err != nil {
			return "", fmt.Errorf("writing the fish script: %w", err)
		}
		return mendFish(s), nil
	}
	return "", fmt.Errorf("no completion for shell %q; the shells are %s", shell, strings.Join(completionShells, ", "))
}

// mendFish fixes what urfave/cli's fish generator gets wrong: it writes
// the app's --help and --version lines twice. A repeated complete line is
// dropped. (No command has a help command, newApp hides them all, so none
// is offered: --help is the way to help.)
func mendFish(s string) string {
	seen := map[string]bool{}
	var out []string
	for _, line := range strings.Split(s, "\n") {
		if strings.HasPrefix(line, "complete ") {
			if seen[line] {
				continue
			}
			seen[line] = true
		}
		out = append(out, line)
	}
	return strings.Join(out, "\n")
}

// examples formats the Examples paragraph that ends a command's
// description (and so its --help and the man page); TestHelpExamples
// checks that every command has one and that its flags exist.
func examples(lines ...string) string {
	return "Examples:\n   " + strings.Join(lines, "\n   ")
}
