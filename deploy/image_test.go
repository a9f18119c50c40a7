// SPDX-License-Identifier: Apache-2.0

package deploy

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/fairshare-dev/fairshare/internal/crtest"
)

// The image as deploy/Dockerfile makes it, made without Docker (CI has no
// Docker daemon): its build stage's own `go build` line run here, and its
// final stage (FROM scratch, the binary, ENTRYPOINT and CMD) written as an
// OCI image archive by crtest.WriteImage. The Dockerfile is parsed, not
// copied: a final stage this code cannot make (another instruction, a shell
// form, a second file) fails the test instead of drifting from the image
// the test runs.

const dockerfile = "Dockerfile"

// instruction is one Dockerfile instruction: its keyword (upper case) and
// the rest of its line, continuation lines joined.
type instruction struct {
	cmd, args string
}

// stage is one FROM and the instructions after it.
type stage struct {
	from, name string
	instrs     []instruction
}

// parseDockerfile splits a Dockerfile into its stages.
func parseDockerfile(src string) ([]stage, error) {
	var stages []stage
	var line string
	for raw := range strings.Lines(src) {
		raw = strings.TrimRight(raw, "\r\n")
		if t := strings.TrimSpace(raw); line == "" && (t == "" || strings.HasPrefix(t, "#")) {
			continue
		}
		if c, ok := strings.CutSuffix(raw, `\`); ok {
			line += c + " "
			continue
		}
		line += raw
		cmd, args, _ := strings.Cut(strings.TrimSpace(line), " ")
		line = ""
		in := instruction{cmd: strings.ToUpper(cmd), args: strings.TrimSpace(args)}
		if in.cmd == "FROM" {
			f := strings.Fields(in.args)
			s := stage{from: f[0]}
			if len(f) == 3 && strings.EqualFold(f[1], "AS") {
				s.name = f[2]
			} else if len(f) != 1 {
				return nil, fmt.Errorf("FROM %s: not an image and an optional AS name", in.args)
			}
			stages = append(stages, s)
			continue
		}
		if len(stages) == 0 {
			if in.cmd == "ARG" {
				continue // an ARG before the first FROM
			}
			return nil, fmt.Errorf("%s before the first FROM", in.cmd)
		}
		stages[len(stages)-1].instrs = append(stages[len(stages)-1].instrs, in)
	}
	if line != "" {
		return nil, fmt.Errorf("the last line continues: %q", line)
	}
	return stages, nil
}

// shellWords splits a RUN line's command as sh would for the simple forms
// the Dockerfile uses (words, single and double quotes, $VAR and ${VAR}
// from vars), and refuses what it does not know (operators, substitutions)
// rather than guess.
func shellWords(s string, vars map[string]string) ([]string, error) {
	var words []string
	var w strings.Builder
	inWord := false
	expand := func(i int) (int, error) { // s[i] == '$'
		if m := regexp.MustCompile(`^\$(\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))`).FindStringSubmatch(s[i:]); m != nil {
			name := m[2] + m[3]
			v, ok := vars[name]
			if !ok {
				return 0, fmt.Errorf("$%s is no ARG of the stage", name)
			}
			w.WriteString(v)
			return i + len(m[0]), nil
		}
		return 0, fmt.Errorf("a $ form the test does not know at %q", s[i:])
	}
	for i := 0; i < len(s); {
		c := s[i]
		switch {
		case c == ' ' || c == '\t':
			if inWord {
				words = append(words, w.String())
				w.Reset()
				inWord = false
			}
			i++
		case c == '\'':
			j := strings.IndexByte(s[i+1:], '\'')
			if j < 0 {
				return nil, fmt.Errorf("unclosed ' in %q", s)
			}
			w.WriteString(s[i+1 : i+1+j])
			inWord, i = true, i+j+2
		case c == '"':
			inWord = true
			i++
			for ; i < len(s) && s[i] != '"'; i++ {
				if s[i] == '$' {
					n, err := expand(i)
					if err != nil {
						return nil, err
					}
					i = n - 1
					continue
				}
				if s[i] == '\\' || s[i] == '`' {
					return nil, fmt.Errorf("an escape or substitution the test does not know in %q", s)
				}
				w.WriteByte(s[i])
			}
			if i == len(s) {
				return nil, fmt.Errorf(`unclosed " in %q`, s)
			}
			i++
		case c == '$':
			n, err := expand(i)
			if err != nil {
				return nil, err
			}
			inWord, i = true, n
		case strings.IndexByte("|&;<>()`\\*?[]{}~", c) >= 0:
			return nil, fmt.Errorf("%q: shell syntax the test does not run (%c)", s, c)
		default:
			w.WriteByte(c)
			inWord, i = true, i+1
		}
	}
	if inWord {
		words = append(words, w.String())
	}
	return words, nil
}

// imageRecipe is what the Dockerfile makes: the go build command of its
// build stage (environment and arguments, the output flag's value the
// path it writes) and the final stage's image.
type imageRecipe struct {
	buildEnv  []string // NAME=VALUE set on the command line
	buildArgs []string // after "go"
	output    string   // the -o path in the build stage
	dir       string   // the build stage's WORKDIR, holding the repository
	file      string   // where the final stage puts the binary
	config    crtest.ImageConfig
}

// readRecipe parses the Dockerfile into the recipe, with the build
// argument VERSION set to version (docker build --build-arg VERSION=...),
// and checks that it has the shape this test can reproduce: a build stage
// that copies the repository into its WORKDIR and runs one `go build`, and
// a final stage FROM scratch with exactly that binary, an exec-form
// ENTRYPOINT and CMD.
func readRecipe(src, version string) (imageRecipe, error) {
	var r imageRecipe
	stages, err := parseDockerfile(src)
	if err != nil {
		return r, err
	}
	if len(stages) != 2 {
		return r, fmt.Errorf("%d stages, want a build stage and the image", len(stages))
	}
	build, final := stages[0], stages[1]
	vars := map[string]string{}
	copied := false
	for _, in := range build.instrs {
		switch in.cmd {
		case "WORKDIR":
			r.dir = in.args
		case "ARG":
			name, def, _ := strings.Cut(in.args, "=")
			vars[name] = def
			if name == "VERSION" {
				vars[name] = version
			}
		case "COPY":
			copied = copied || in.args == ". ."
		case "RUN":
			words, err := shellWords(in.args, vars)
			if err != nil {
				return r, fmt.Errorf("RUN %s: %w", in.args, err)
			}
			var env []string
			for len(words) > 0 && regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*=`).MatchString(words[0]) {
				env, words = append(env, words[0]), words[1:]
			}
			if len(words) < 2 || words[0] != "go" || words[1] != "build" {
				continue // go mod download
			}
			if r.buildArgs != nil {
				return r, fmt.Errorf("two go build lines in the build stage")
			}
			r.buildEnv, r.buildArgs = env, words[1:]
			for i, a := range r.buildArgs {
				if a == "-o" && i+1 < len(r.buildArgs) {
					r.output = r.buildArgs[i+1]
				}
			}
		default:
			return r, fmt.Errorf("build stage: %s %s: an instruction the test does not reproduce", in.cmd, in.args)
		}
	}
	if r.buildArgs == nil || r.output == "" || !copied || r.dir == "" {
		return r, fmt.Errorf("the build stage does not COPY . . into a WORKDIR and go build -o a binary")
	}
	if final.from != "scratch" {
		return r, fmt.Errorf("the image is FROM %s, not scratch: the test's image would not be it", final.from)
	}
	for _, in := range final.instrs {
		switch in.cmd {
		case "COPY":
			f := strings.Fields(in.args)
			if len(f) != 3 || f[0] != "--from="+build.name || f[1] != r.output || r.file != "" {
				return r, fmt.Errorf("COPY %s: the image holds the build stage's %s and nothing else", in.args, r.output)
			}
			r.file = f[2]
		case "ENTRYPOINT", "CMD":
			var argv []string
			if err := json.Unmarshal([]byte(in.args), &argv); err != nil {
				return r, fmt.Errorf("%s %s: not the exec (JSON) form: %w", in.cmd, in.args, err)
			}
			if in.cmd == "ENTRYPOINT" {
				r.config.Entrypoint = argv
			} else {
				r.config.Cmd = argv
			}
		default:
			return r, fmt.Errorf("final stage: %s %s: an instruction the test's hand-made image does not reproduce", in.cmd, in.args)
		}
	}
	if r.file == "" || len(r.config.Entrypoint) == 0 || r.config.Entrypoint[0] != r.file {
		return r, fmt.Errorf("the image's ENTRYPOINT %v is not its binary %s", r.config.Entrypoint, r.file)
	}
	return r, nil
}

// TestDockerfileShape: the Dockerfile is what the chart's pod test builds
// by hand (a static binary built with the flags below, alone in a FROM
// scratch image that runs `/fairshare run`).
func TestDockerfileShape(t *testing.T) {
	src, err := os.ReadFile(dockerfile)
	if err != nil {
		t.Fatal(err)
	}
	r, err := readRecipe(string(src), "v9")
	if err != nil {
		t.Fatal(err)
	}
	wantEnv := []string{"CGO_ENABLED=0"} // static: nothing else is in the image
	wantArgs := []string{"build", "-trimpath", "-ldflags", "-s -w -X main.version=v9", "-o", "/fairshare", "./cmd/fairshare"}
	if !slices.Equal(r.buildEnv, wantEnv) || !slices.Equal(r.buildArgs, wantArgs) {
		t.Errorf("the build: %v go %q\nwant %v go %q", r.buildEnv, r.buildArgs, wantEnv, wantArgs)
	}
	if r.file != "/fairshare" || !slices.Equal(r.config.Entrypoint, []string{"/fairshare"}) || !slices.Equal(r.config.Cmd, []string{"run"}) {
		t.Errorf("the image: %s, ENTRYPOINT %q CMD %q", r.file, r.config.Entrypoint, r.config.Cmd)
	}
	for _, bad := range []string{
		"FROM golang AS build\nWORKDIR /src\nCOPY . .\nRUN go build -o /f .\nFROM debian\nCOPY --from=build /f /f\nENTRYPOINT [\"/f\"]\n",
		"FROM golang AS build\nWORKDIR /src\nCOPY . .\nRUN go build -o /f .\nFROM scratch\nCOPY --from=build /f /f\nUSER 1000\nENTRYPOINT [\"/f\"]\n",
		"FROM golang AS build\nWORKDIR /src\nCOPY . .\nRUN go build -o /f .\nFROM scratch\nCOPY --from=build /f /f\nENTRYPOINT /f\n",
		"FROM golang AS build\nWORKDIR /src\nCOPY . .\nRUN go build -o /f . && strip /f\nFROM scratch\nCOPY --from=build /f /f\nENTRYPOINT [\"/f\"]\n",
	} {
		if _, err := readRecipe(bad, "v9"); err == nil {
			t.Errorf("a Dockerfile the test cannot reproduce was taken:\n%s", bad)
		}
	}
}

// buildImage builds the binary as the Dockerfile's build stage does (its
// go build line run in the repository, which is its WORKDIR) and writes
// the final stage's image, named name, to an archive in dir; it returns
// the archive and the binary.
func buildImage(t *testing.T, dir, name, version string) (archive, binary string) {
	t.Helper()
	src, err := os.ReadFile(dockerfile)
	if err != nil {
		t.Fatal(err)
	}
	r, err := readRecipe(string(src), version)
	if err != nil {
		t.Fatalf("%s: %v", dockerfile, err)
	}
	binary = filepath.Join(dir, "fairshare")
	args := slices.Clone(r.buildArgs)
	args[slices.Index(args, "-o")+1] = binary
	cmd := exec.Command("go", args...)
	cmd.Dir = ".." // the repository, COPY . . into the WORKDIR
	cmd.Env = append(os.Environ(), r.buildEnv...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	bin, err := os.ReadFile(binary)
	if err != nil {
		t.Fatal(err)
	}
	archive = filepath.Join(dir, "image.tar")
	f, err := os.Create(archive)
	if err != nil {
		t.Fatal(err)
	}
	err = crtest.WriteImage(f, name, []crtest.LayerFile{{Name: strings.TrimPrefix(r.file, "/"), Mode: 0o755, Data: bin}}, r.config)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatalf("writing the image: %v", err)
	}
	return archive, binary
}
