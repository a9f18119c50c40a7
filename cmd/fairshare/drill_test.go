// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/fairshare-dev/fairshare/drill"
	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// drillJSON reads the report the drill wrote to path: its pool, phase and
// verdict.
func drillJSON(t *testing.T, path string) (pool int, phaseS float64, pass bool) {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("the drill wrote no report: %v", err)
	}
	var rep struct {
		PoolSize     int     `json:"pool_size"`
		PhaseSeconds float64 `json:"phase_seconds"`
		Pass         bool    `json:"pass"`
	}
	if err := json.Unmarshal(raw, &rep); err != nil {
		t.Fatalf("report %s: %v", path, err)
	}
	return rep.PoolSize, rep.PhaseSeconds, rep.Pass
}

// The flags of 'drill' given before a subcommand's name count for it, or are
// refused: urfave/cli read the subcommand's own default instead, so 'drill
// --pool 4 connections' ran with a pool of 8 and 'drill --json F connections'
// wrote nothing, exit 0.
func TestDrillFlagsBeforeSubcommand(t *testing.T) {
	// The phases are short where the drill would run should the flags
	// before the subcommand be dropped.
	short := []string{"--phase", "50ms", "--slices", "1"}
	for _, c := range []struct {
		args []string
		want string
	}{
		// The value given before is read, and checked.
		{append([]string{"drill", "--pool", "0", "connections"}, short...), "--pool must be a whole number >= 1, got 0"},
		{append([]string{"drill", "--retry-pause", "0s", "connections"}, short...), "--retry-pause must be"},
		{append([]string{"drill", "--json", filepath.Join(t.TempDir(), "no", "such", "r.json"), "connections"}, short...), "--json: cannot write"},
		// Given on both sides: which one was meant is not guessed.
		{append([]string{"drill", "--pool", "4", "connections", "--pool", "6"}, short...), "--pool is given both before and after 'connections'"},
		// The load generator takes none of them.
		{[]string{"drill", "--pool", "4", "connect-loop"}, "--pool is a flag of 'fairshare drill', which 'drill connect-loop' does not take"},
	} {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			out, errOut, code := runCLI(t, c.args...)
			if code != exitUsage || !strings.Contains(errOut, c.want) || out != "" {
				t.Errorf("exit %d, stdout %q, stderr %q; want %d and %q", code, out, errOut, exitUsage, c.want)
			}
		})
	}
	if os.Geteuid() != 0 {
		t.Log("not root: the connections drill is not run")
		return
	}
	// As root the drill runs with them: a pool of 4 and 2.1 s phases (the
	// shortest the connections drill takes are past 2.03 s: the active
	// window, a recompute period, a service time and a retry pause), its
	// report written where --json said.
	js := filepath.Join(t.TempDir(), "r.json")
	out, errOut, code := runCLI(t, "drill", "--pool", "4", "--phase", "2.1s", "--json", js, "connections", "--slices", "1")
	if code != 0 && code != exitVerdict {
		t.Fatalf("exit %d: %s%s", code, out, errOut)
	}
	if pool, phase, _ := drillJSON(t, js); pool != 4 || phase != 2.1 {
		t.Errorf("the drill ran with pool %d and %gs phases, want 4 and 2.1s:\n%s", pool, phase, out)
	}
	if !strings.Contains(out, "pool 4,") {
		t.Errorf("the table does not show pool 4:\n%s", out)
	}
}

// The --json and --svg files are checked before the drill runs: a directory
// that does not exist, or a path that is one, is refused at once, exit 2,
// with nothing run (the drill ran for its whole length and only then failed,
// exit 1).
func TestDrillChecksOutputsFirst(t *testing.T) {
	dir := t.TempDir()
	short := []string{"--phase", "50ms", "--slices", "1"}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--json", filepath.Join(dir, "missing", "r.json")}, "--json: cannot write " + filepath.Join(dir, "missing", "r.json")},
		{[]string{"--svg", filepath.Join(dir, "missing", "r.svg")}, "--svg: cannot write"},
		{[]string{"--svg", dir}, "--svg: " + dir + " is a directory"},
	} {
		args := append(append([]string{"drill"}, c.args...), short...)
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			out, errOut, code := runCLI(t, args...)
			if code != exitUsage || !strings.Contains(errOut, c.want) || out != "" {
				t.Errorf("exit %d, stdout %q, stderr %q; want %d, %q and no report", code, out, errOut, exitUsage, c.want)
			}
		})
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Errorf("the checks left files behind: %v", ents)
	}
}

// writeAtomic leaves the file as it was when the write fails half-way, and
// no temporary file; a write that succeeds replaces it whole, readable by all.
func TestWriteAtomic(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "drill.json")
	boom := errors.New("boom")
	half := func(w io.Writer) error {
		_, _ = io.WriteString(w, `{"half":`)
		return boom
	}
	// No file before: still none.
	if err := writeAtomic(path, half); !errors.Is(err, boom) {
		t.Fatalf("err = %v, want boom", err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("a failed write left %s: %v", path, err)
	}
	// A report before: kept whole.
	if err := os.WriteFile(path, []byte("previous report\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := writeAtomic(path, half); !errors.Is(err, boom) {
		t.Fatalf("err = %v, want boom", err)
	}
	if b, _ := os.ReadFile(path); string(b) != "previous report\n" {
		t.Errorf("a failed write changed the file to %q", b)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("a failed write left a temporary file: %v", ents)
	}
	if err := writeAtomic(path, func(w io.Writer) error { _, err := io.WriteString(w, "new report\n"); return err }); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(path)
	fi, err := os.Stat(path)
	if err != nil || string(b) != "new report\n" || fi.Mode().Perm() != 0o644 {
		t.Errorf("after a write: %q, %v, %v; want the new report, 0644", b, fi.Mode(), err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("a write left a temporary file: %v", ents)
	}
	// A link (as /dev/stdout is) is written through, not replaced, and a
	// FIFO (a shell's >(jq .)) is written in place.
	target := filepath.Join(dir, "target.json")
	link := filepath.Join(dir, "link.json")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(target, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := checkOutput(link); err != nil {
		t.Fatalf("checkOutput of a link: %v", err)
	}
	if err := writeAtomic(link, func(w io.Writer) error { _, err := io.WriteString(w, "through\n"); return err }); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Lstat(link); err != nil || fi.Mode()&os.ModeSymlink == 0 {
		t.Errorf("the link was replaced: %v %v", fi.Mode(), err)
	}
	if b, _ := os.ReadFile(target); string(b) != "through\n" {
		t.Errorf("the link's target holds %q", b)
	}
	// A link into /proc (as /dev/stdout is, to /proc/self/fd/1) whose file
	// holds the drill's table: the report follows it, nothing cut.
	out, err := os.OpenFile(filepath.Join(dir, "out.txt"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	if _, err := io.WriteString(out, "table\n"); err != nil {
		t.Fatal(err)
	}
	stdout := filepath.Join(dir, "stdout")
	if err := os.Symlink(fmt.Sprintf("/proc/self/fd/%d", out.Fd()), stdout); err != nil {
		t.Fatal(err)
	}
	if err := checkOutput(stdout); err != nil {
		t.Fatalf("checkOutput of a link to an open file: %v", err)
	}
	if err := writeAtomic(stdout, func(w io.Writer) error { _, err := io.WriteString(w, "report\n"); return err }); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "out.txt")); string(b) != "table\nreport\n" {
		t.Errorf("the output behind a /proc link holds %q, want the table then the report", b)
	}
	if fi, err := os.Lstat(stdout); err != nil || fi.Mode()&os.ModeSymlink == 0 {
		t.Errorf("the /proc link was replaced: %v %v", fi.Mode(), err)
	}
	// The drill's own output by its name (drill --json out.txt > out.txt):
	// the report follows the table there too.
	own := filepath.Join(dir, "own.txt")
	ownOut, err := os.OpenFile(own, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer ownOut.Close()
	if _, err := io.WriteString(ownOut, "table\n"); err != nil {
		t.Fatal(err)
	}
	saved := ownOutputs
	ownOutputs = func() []*os.File { return []*os.File{ownOut} }
	err = writeAtomic(own, func(w io.Writer) error { _, err := io.WriteString(w, "report\n"); return err })
	ownOutputs = saved
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(own); string(b) != "table\nreport\n" {
		t.Errorf("the drill's own output, named, holds %q, want the table then the report", b)
	}
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	got := make(chan string)
	go func() {
		b, _ := os.ReadFile(fifo)
		got <- string(b)
	}()
	if err := checkOutput(fifo); err != nil {
		t.Fatalf("checkOutput of a FIFO: %v", err)
	}
	if err := writeAtomic(fifo, func(w io.Writer) error { _, err := io.WriteString(w, "piped\n"); return err }); err != nil {
		t.Fatal(err)
	}
	select {
	case b := <-got:
		if !strings.Contains(b, "piped\n") {
			t.Errorf("the FIFO's reader got %q", b)
		}
	case <-time.After(10 * time.Second):
		// Replaced by a file, the FIFO's reader waits for ever.
		t.Errorf("nothing reached the FIFO's reader")
	}
}

// A drill that ran and failed a verdict exits 3, its report printed and
// written; a drill that could not run to the end (interrupted here) exits 1
// and writes nothing. Both exited 1.
func TestDrillExitStatus(t *testing.T) {
	// A report that failed a verdict, as finishDrill gets it from a drill
	// run to the end. (No flags make a run fail for sure any more: those
	// are refused, exit 2, TestDrillRefusesUnpassable.)
	rep := &drill.Report{Scenario: "requests", PoolSize: 8, Floor: 1, ServiceMs: 20, PhaseSeconds: 5, RetryPauseMs: 10, Slices: 1,
		Verdicts: []drill.Verdict{
			{Name: drill.VerdictSmallRarely, Pass: true, Status: "pass", Detail: "0 refused asks"},
			{Name: drill.VerdictBigAlone, Status: "fail", Detail: "big held at most 7 of 8"},
		}}
	js := filepath.Join(t.TempDir(), "r.json")
	var out, errOut bytes.Buffer
	app := &cli.App{Name: "fairshare", Writer: &out, ErrWriter: &errOut, ExitErrHandler: func(*cli.Context, error) {},
		Commands: []*cli.Command{{Name: "drill", Flags: drillFlags(), Action: func(c *cli.Context) error { return finishDrill(c, rep) }}}}
	err := app.Run([]string{"fairshare", "drill", "--json", js})
	var ec cli.ExitCoder
	if !errors.As(err, &ec) || ec.ExitCode() != exitVerdict || !strings.Contains(err.Error(), "drill verdict failed") ||
		!strings.Contains(out.String(), "FAIL  big alone holds the pool") {
		t.Errorf("a failed verdict: %v, stdout %q; want exit %d and the report", err, out.String(), exitVerdict)
	}
	if _, _, pass := drillJSON(t, js); pass {
		t.Error("the report written says pass")
	}

	js = filepath.Join(t.TempDir(), "r.json")
	cmd := exec.Command(binary, "drill", "--json", js)
	cmd.Env = cleanEnv()
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// Interrupt once the drill runs: it has opened its listeners, after
	// it started catching the signal.
	deadline := time.Now().Add(20 * time.Second)
	for !hasSocket(cmd.Process.Pid) {
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			t.Fatal("the drill opened no socket within 20s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	err = cmd.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 || stdout.Len() != 0 || !strings.Contains(stderr.String(), "drill interrupted") {
		t.Errorf("an interrupted drill: %v, stdout %q, stderr %q; want exit %d and no report", err, stdout.String(), stderr.String(), exitDrillError)
	}
	if _, err := os.Stat(js); !os.IsNotExist(err) {
		t.Errorf("an interrupted drill wrote %s: %v", js, err)
	}
}

// hasSocket says whether process pid has a socket open.
func hasSocket(pid int) bool {
	fds, _ := filepath.Glob(filepath.Join("/proc", strconv.Itoa(pid), "fd", "*"))
	for _, fd := range fds {
		if l, err := os.Readlink(fd); err == nil && strings.HasPrefix(l, "socket:") {
			return true
		}
	}
	return false
}

// Flags with which a verdict cannot pass, whatever the host, are refused
// before the drill runs, exit 2, naming the flag and the bound. Before, only
// values below 1 were: --phase 2s (the example of --help) failed "big alone
// holds the pool" or passed by luck, --pool 17 and --pool 1 always failed a
// verdict about big, --pool 2 "small refused rarely", after the whole run.
// --json and --svg naming one file wrote the SVG over the JSON.
func TestDrillRefusesUnpassable(t *testing.T) {
	dir := t.TempDir()
	if err := os.Symlink(dir, filepath.Join(dir, "same")); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"drill", "--phase", "2s"}, "--phase 2s: small stays in the active set up to 3s after its last request ends"},
		{[]string{"drill", "--phase", "2.5s"}, "give --phase longer than 3.03s"},
		{[]string{"drill", "--phase", "3s", "--service", "5ms", "--retry-pause", "5ms"}, "give --phase longer than 3.01s"},
		{[]string{"drill", "connections", "--phase", "2s"}, "give --phase longer than 2.03s"},
		{[]string{"drill", "--phase", "2s", "connections"}, "give --phase longer than 2.03s"},
		{[]string{"drill", "--pool", "17"}, "--pool 17 with --big 16: a writer holds one permit at a time"},
		{[]string{"drill", "connections", "--pool", "19"}, "'big alone holds the pool' cannot pass"},
		{[]string{"drill", "--pool", "4", "--big", "3"}, "give --big 4 or more, or --pool 3 or less"},
		{[]string{"drill", "--pool", "1"}, "--pool 1: the floor is 1"},
		{[]string{"drill", "--pool", "2"}, "--small 2 with --pool 2: beside big, small's share is 1"},
		{[]string{"drill", "--small", "5"}, "small's share is 4"},
		{[]string{"drill", "--slices", "1001"}, "--slices 1001: at most 1000"},
		{[]string{"drill", "--slices", "26"}, "shorter than 10 service times (200ms)"},
		{[]string{"drill", "connections", "--pool", "300000", "--big", "300000"}, "--pool 300000: the kernel's connection pool holds at most 262144"},
		// 268435456 * 16 is 2^32, a node pool of 0 as a uint32.
		{[]string{"drill", "connections", "--to", "--pool", "268435456", "--big", "268435456"}, "give --pool 16384 or less"},
		{[]string{"drill", "--json", filepath.Join(dir, "r"), "--svg", filepath.Join(dir, "r")}, "name the same file"},
		{[]string{"drill", "--json", filepath.Join(dir, "r"), "--svg", filepath.Join(dir, "same", "r")}, "name the same file"},
		{[]string{"drill", "--json", filepath.Join(dir, "r"), "connections", "--svg", filepath.Join(dir, ".", "r")}, "name the same file"},
	} {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			out, errOut, code := runCLI(t, c.args...)
			if code != exitUsage || !strings.Contains(errOut, c.want) || out != "" {
				t.Errorf("exit %d, stdout %q, stderr %q; want %d and %q", code, out, errOut, exitUsage, c.want)
			}
		})
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("the checks left files behind: %v", ents)
	}
	// --help's example is one the drill takes.
	out, _, code := runCLI(t, "drill", "--help")
	if code != 0 || !strings.Contains(out, "fairshare drill --phase 4s --svg drill.svg") {
		t.Errorf("drill --help: exit %d:\n%s", code, out)
	}
}

// An interrupted connections drill says so, exit 1, writes nothing and
// leaves nothing behind. It said "small load generator: context canceled":
// the load generators it killed on the signal were reported as failing.
func TestDrillConnectionsInterrupted(t *testing.T) {
	needRoot(t)
	mount := testutil.Cgroup2Mount(t)
	js := filepath.Join(t.TempDir(), "r.json")
	cmd := exec.Command(binary, "drill", "connections", "--json", js)
	cmd.Env = cleanEnv()
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(mount, fmt.Sprintf("fairshare-drill-%d", cmd.Process.Pid))
	// Interrupt once both load generators run in their cgroups.
	deadline := time.Now().Add(20 * time.Second)
	for {
		small, _ := os.ReadFile(filepath.Join(root, "small", "cgroup.procs"))
		big, _ := os.ReadFile(filepath.Join(root, "big", "cgroup.procs"))
		if len(bytes.TrimSpace(small)) > 0 && len(bytes.TrimSpace(big)) > 0 {
			break
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			t.Fatalf("no load generators in %s within 20s", root)
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond)
	if err := cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	err := cmd.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != exitDrillError || stdout.Len() != 0 ||
		!strings.Contains(stderr.String(), "drill interrupted") || strings.Contains(stderr.String(), "load generator") {
		t.Errorf("an interrupted connections drill: %v, stdout %q, stderr %q; want exit %d, \"drill interrupted\" and no report",
			err, stdout.String(), stderr.String(), exitDrillError)
	}
	if _, err := os.Stat(js); !os.IsNotExist(err) {
		t.Errorf("an interrupted drill wrote %s: %v", js, err)
	}
	if _, err := os.Stat(root); !os.IsNotExist(err) {
		t.Errorf("an interrupted drill left %s: %v", root, err)
	}
}
