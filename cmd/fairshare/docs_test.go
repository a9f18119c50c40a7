// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/fairshare-dev/fairshare/config"
	"github.com/urfave/cli/v2"
)

// The configuration reference is generated from the code; the committed
// page must be what the generator writes now.
func TestConfigReference(t *testing.T) {
	want, err := configReference()
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(filepath.Join("..", "..", "docs", "configuration.md"))
	if err != nil {
		t.Fatalf("%v (run 'make docs')", err)
	}
	if string(got) != want {
		t.Fatalf("docs/configuration.md and the code disagree: run 'make docs' and commit the page")
	}
	// Every key of the configuration has a row, with its flag if it has one.
	def := config.Default()
	for _, k := range goKeys(reflect.ValueOf(def), "") {
		if !strings.Contains(want, "| `"+k+"` |") {
			t.Errorf("key %s has no row", k)
		}
	}
	for _, kf := range keyFlags {
		if !strings.Contains(want, "`--"+kf.flag+"`") {
			t.Errorf("flag --%s is not in the reference", kf.flag)
		}
	}
}

// Each key flag sets the key it names and nothing else: the table that
// drives both loadConfig and the reference is true.
func TestKeyFlagsSetTheirKeys(t *testing.T) {
	samples := map[string]string{
		flagAdminSocket: "/tmp/fs-key/admin.sock", flagStateDir: "/tmp/fs-key/state", flagPinDir: "/sys/fs/bpf/fs-key",
		flagProjectsRoot: "/sys/fs/cgroup/fs-key", flagMetrics: "127.0.0.1:1", flagFrontListen: "127.0.0.1:2",
		flagFrontUp: "http://127.0.0.1:3", flagPermits: "/tmp/fs-key/permits.sock", flagPermitsGroup: "0",
		flagFrontSocket: "/tmp/fs-key/front.sock", flagNoBPF: "true", flagMaxInFlight: "7", flagMaxConns: "9",
		flagReconcile: "7s", flagSources: "systemd",
	}
	for _, kf := range keyFlags {
		val, ok := samples[kf.flag]
		if !ok {
			t.Errorf("no sample value for --%s", kf.flag)
			continue
		}
		var got config.Config
		app := &cli.App{Name: "fairshare", Writer: &bytes.Buffer{}, ErrWriter: &bytes.Buffer{},
			Commands: []*cli.Command{{Name: "run", Flags: runCommand().Flags, Action: func(c *cli.Context) error {
				var err error
				got, err = loadConfig(c)
				return err
			}}}}
		args := []string{"fairshare", "run", "--" + kf.flag + "=" + val}
		if kf.flag == flagFrontListen || kf.flag == flagFrontSocket {
			args = append(args, "--"+flagFrontUp+"=http://127.0.0.1:3")
		}
		if err := app.Run(args); err != nil {
			t.Errorf("--%s=%s: %v", kf.flag, val, err)
			continue
		}
		v, _, err := configField(&got, kf.key)
		if err != nil {
			t.Fatal(err)
		}
		if s := valueCell(v); !strings.Contains(strings.Trim(s, "`[]"), strings.TrimSuffix(val, "s")) && !(kf.invert && s == "`false`") {
			t.Errorf("--%s=%s left %s at %s", kf.flag, val, kf.key, s)
		}
	}
}

// A flag whose help names its default from the configuration names the
// default the configuration has.
func TestFlagHelpDefaults(t *testing.T) {
	def := config.Default()
	flags := runCommand().Flags
	for _, kf := range keyFlags {
		for _, f := range flags {
			if f.Names()[0] != kf.flag {
				continue
			}
			u := usage(f)
			_, rest, ok := strings.Cut(u, "[default from config: ")
			if !ok {
				continue
			}
			said, _, _ := strings.Cut(rest, "]")
			v, _, err := configField(&def, kf.key)
			if err != nil {
				t.Fatal(err)
			}
			is := strings.Trim(valueCell(v), "`[]")
			is = strings.ReplaceAll(is, ", ", ",")
			if is == `""` && (said == "none" || said == "disabled") {
				continue
			}
			if said != is {
				t.Errorf("--%s says its default is %q; the configuration's is %q", kf.flag, said, is)
			}
		}
	}
}

// checkFish checks the fish script: it completes, no line is there twice
// (urfave/cli wrote the app's --help and --version twice), and no help
// command is offered (there is none; urfave/cli offered 'help h', two
// words, after 'completion').
func checkFish(t *testing.T, s string) {
	t.Helper()
	if !strings.Contains(s, "complete -c fairshare") {
		t.Errorf("the fish script completes nothing: %s", s)
	}
	seen := map[string]bool{}
	for _, line := range strings.Split(s, "\n") {
		if !strings.HasPrefix(line, "complete ") {
			continue
		}
		if seen[line] {
			t.Errorf("the fish script has this line twice: %s", line)
		}
		seen[line] = true
		// There is no help command ("fairshare help" is an unknown
		// command, exit 2): --help is the way to help.
		if strings.Contains(line, "-a 'help") || strings.Contains(line, "from help") {
			t.Errorf("the fish script offers a help command: %s", line)
		}
	}
}

// Every shell's completion script is written, parses in that shell where the
// shell is installed, and the words it asks the binary for are the commands.
func TestCompletion(t *testing.T) {
	for _, sh := range completionShells {
		var out, errOut bytes.Buffer
		if err := run([]string{"fairshare", "completion", sh}, &out, &errOut); err != nil {
			t.Fatalf("completion %s: %v %s", sh, err, errOut.String())
		}
		s := out.String()
		if !strings.Contains(s, "fairshare") || len(s) < 200 {
			t.Fatalf("completion %s wrote %q", sh, s)
		}
		if sh == "fish" {
			checkFish(t, s)
		}
		if path, err := exec.LookPath(sh); err == nil {
			f := filepath.Join(t.TempDir(), "completion."+sh)
			if err := os.WriteFile(f, out.Bytes(), 0o644); err != nil {
				t.Fatal(err)
			}
			if msg, err := exec.Command(path, "-n", f).CombinedOutput(); err != nil {
				t.Errorf("%s -n on the %s script: %v\n%s", sh, sh, err, msg)
			}
		} else {
			t.Logf("%s is not installed: its script is not parsed", sh)
		}
	}
	var out bytes.Buffer
	if err := run([]string{"fairshare", "completion", "tcsh"}, &out, &out); err == nil {
		t.Errorf("completion for an unknown shell succeeded")
	}
	// What bash offers, through the script and the binary as a user's
	// shell would run them (urfave/cli reads the words from os.Args, so
	// this cannot run in the test's own process).
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("bash is not installed: the completion words are not checked")
	}
	script := filepath.Join(t.TempDir(), "fairshare.bash")
	out.Reset()
	if err := run([]string{"fairshare", "completion", "bash"}, &out, &out); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(script, out.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	for words, want := range map[string][]string{
		"":                {"run", "policy", "project", "status", "events", "cleanup", "drill", "completion"},
		"pol":             {"policy"},
		"policy ":         {"set", "get", "list", "delete"},
		"status --js":     {"--json"},
		"project add --c": {"--cgroup"},
		// After the arguments, as every example writes it: the partial
		// flag moved before them was refused as undefined.
		"project add web --c":   {"--cgroup"},
		"policy set alpha --ti": {"--tier"},
	} {
		w := append([]string{"fairshare"}, strings.Fields(words)...)
		if strings.HasSuffix(words, " ") || words == "" {
			w = append(w, "")
		}
		quoted := make([]string, len(w))
		for i, x := range w {
			quoted[i] = "'" + x + "'"
		}
		cmd := exec.Command(bash, "-c", "source "+script+"; COMP_WORDS=("+strings.Join(quoted, " ")+
			"); COMP_CWORD="+strconv.Itoa(len(w)-1)+"; _fairshare_complete; printf '%s\\n' \"${COMPREPLY[@]}\"")
		cmd.Env = append(cleanEnv(), "PATH="+filepath.Dir(binary)+":"+os.Getenv("PATH"))
		got, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("completing %q: %v\n%s", words, err, got)
		}
		offered := strings.Fields(string(got))
		for _, x := range want {
			if !slices.Contains(offered, x) {
				t.Errorf("completing %q offers %q, not %s", words, offered, x)
			}
		}
		if slices.Contains(offered, "gendocs") {
			t.Errorf("completing %q offers the hidden gendocs", words)
		}
	}
}

// Every visible command ends its description with examples, each a command
// line of that command (or one below it) whose flags exist.
func TestHelpExamples(t *testing.T) {
	app := newApp()
	var walk func(path []string, cmds []*cli.Command)
	walk = func(path []string, cmds []*cli.Command) {
		for _, c := range cmds {
			if c.Hidden {
				continue
			}
			p := append(append([]string{}, path...), c.Name)
			name := strings.Join(p, " ")
			_, ex, ok := strings.Cut(c.Description, "Examples:\n")
			if !ok {
				t.Errorf("%s has no examples in its help", name)
			} else {
				for _, line := range strings.Split(strings.TrimSpace(ex), "\n") {
					checkExample(t, app, name, strings.TrimSpace(line))
				}
			}
			walk(p, c.Subcommands)
		}
	}
	walk([]string{"fairshare"}, app.Commands)
	if !strings.Contains(app.Description, "Examples:") {
		t.Errorf("fairshare --help has no examples")
	}
	var out bytes.Buffer
	if err := run([]string{"fairshare", "policy", "set", "--help"}, &out, &out); err != nil || !strings.Contains(out.String(), "Examples:") {
		t.Errorf("policy set --help shows no examples: %v\n%s", err, out.String())
	}
}

func checkExample(t *testing.T, app *cli.App, name, line string) {
	t.Helper()
	if !strings.HasPrefix(line, name+" ") && line != name {
		t.Errorf("%s: the example %q is not of this command", name, line)
		return
	}
	words := strings.Fields(line)[1:]
	flags, cmds := app.Flags, app.Commands
	for _, w := range words {
		if w == ">" {
			break
		}
		if strings.HasPrefix(w, "-") {
			if !knownFlag(flags, w) {
				t.Errorf("%s: the example %q uses %s, which the command does not have", name, line, w)
			}
			continue
		}
		if sub := findCommand(cmds, w); sub != nil {
			flags, cmds = sub.Flags, sub.Subcommands
		}
	}
}

// The man page builds from the commands, with every visible one in it.
func TestManPage(t *testing.T) {
	s, err := manPage()
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{".TH fairshare 8", "completion", "policy", "Examples:"} {
		if !strings.Contains(s, w) {
			t.Errorf("the man page lacks %q", w)
		}
	}
	if strings.Contains(s, "gendocs") {
		t.Errorf("the man page shows the hidden gendocs")
	}
	if path, err := exec.LookPath("groff"); err == nil {
		cmd := exec.Command(path, "-man", "-Tutf8", "-ww", "-z")
		cmd.Stdin = strings.NewReader(s)
		if msg, err := cmd.CombinedOutput(); err != nil || len(msg) > 0 {
			t.Errorf("groff -man: %v\n%s", err, msg)
		}
	}
}
