// SPDX-License-Identifier: Apache-2.0

package main

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/policy"
	"github.com/urfave/cli/v2"
)

// Every invalid value of every policy flag is refused with one clear sentence
// and a non-zero exit, and the store is left as it was. No daemon runs here,
// so the CLI opens the store itself: the path that writes directly.
func TestPolicyBadInput(t *testing.T) {
	dir := t.TempDir()
	flags := []string{"--state-dir", filepath.Join(dir, "state"), "--admin-socket", filepath.Join(dir, "none.sock")}
	set := func(args ...string) (string, string, int) {
		return runCLI(t, append(append([]string{"policy", "set"}, flags...), args...)...)
	}
	if _, errOut, code := set("--tier", "lite", "--shares", "2", "alpha"); code != 0 {
		t.Fatalf("a good set failed: %s", errOut)
	} else if !strings.Contains(errOut, "no daemon answers at "+flags[3]) || !strings.Contains(errOut, "when it starts") {
		// Stored, not in force: a mistyped --admin-socket or a daemon
		// that is down must not look like a change in force.
		t.Errorf("a set with no daemon said %q, want a note that it is only stored", errOut)
	}
	list := func() string {
		out, errOut, code := runCLI(t, append([]string{"policy", "list", "--json"}, flags...)...)
		if code != 0 {
			t.Fatalf("list: %s", errOut)
		}
		return out
	}
	before := list()
	if !strings.Contains(before, `"shares": 2`) {
		t.Fatalf("the good set did not land: %s", before)
	}
	tests := []struct {
		args []string
		want string // in the message
	}{
		{[]string{"--tier", "gold", "alpha"}, "--tier must be pro, lite or none"},
		{[]string{"--tier", "", "alpha"}, "--tier must be"},
		{[]string{"--tier", "PRO", "alpha"}, "--tier must be"},
		{[]string{"--shares", "0", "alpha"}, "--shares must be a whole number"},
		{[]string{"--shares", "-1", "alpha"}, "--shares must be"},
		{[]string{"--shares", "1.5", "alpha"}, "--shares must be"},
		{[]string{"--shares", "many", "alpha"}, "--shares must be"},
		{[]string{"--shares", "1000001", "alpha"}, "--shares must be"},
		{[]string{"--requests-per-sec", "-1", "alpha"}, "--requests-per-sec must be 0 (unbounded) or a number"},
		{[]string{"--requests-per-sec", "NaN", "alpha"}, "--requests-per-sec must be"},
		{[]string{"--requests-per-sec", "Inf", "alpha"}, "--requests-per-sec must be"},
		{[]string{"--requests-per-sec", "fast", "alpha"}, "--requests-per-sec must be"},
		{[]string{"--work-per-sec", "-0.5", "alpha"}, "--work-per-sec must be 0 (unbounded) or a number"},
		{[]string{"--work-per-sec", "1e10", "alpha"}, "--work-per-sec must be"},
		{[]string{"--work-per-sec", "1e-12", "alpha"}, "from 0.001 to 1e+09"},
		{[]string{"--requests-per-sec", "1e-9", "alpha"}, "--requests-per-sec must be 0 (unbounded) or a number from 0.001"},
		{[]string{"--work-per-sec", "", "alpha"}, "--work-per-sec must be"},
		{[]string{"--enforce", "maybe", "alpha"}, "--enforce must be true or false"},
		{[]string{"--enforce", "", "alpha"}, "--enforce must be"},
		{[]string{"--connections-per-sec", "-1", "alpha"}, "--connections-per-sec must be 0 (unbounded) or a number from 0.001 to 1e+09"},
		{[]string{"--connections-per-sec", "1e-4", "alpha"}, "--connections-per-sec must be"},
		{[]string{"--connections-per-sec", "2e9", "alpha"}, "--connections-per-sec must be"},
		{[]string{"--connections-per-sec", "many", "alpha"}, "--connections-per-sec must be"},
		{[]string{"alpha"}, "changes nothing"},
		{[]string{"--tier", "pro"}, "exactly one PROJECT"},
		{[]string{"--tier", "pro", "alpha", "beta"}, "exactly one PROJECT"},
		{[]string{"alpha", "--tier", "gold"}, "--tier must be pro, lite or none"},
		{[]string{"alpha", "--shares", "0"}, "--shares must be"},
		{[]string{"alpha", "--tier", "pro", "beta"}, "exactly one PROJECT"},
		{[]string{"alpha", "--bogus", "1"}, "flag provided but not defined"},
		{[]string{"--tier", "pro", "--", "--shares"}, "may use only"},
		{[]string{"--tier", "pro", ""}, "project name is empty"},
		{[]string{"--tier", "pro", "../etc"}, "may use only"},
		{[]string{"--tier", "pro", ".hidden"}, "may use only"},
		{[]string{"--tier", "pro", "a b"}, "may use only"},
		{[]string{"--tier", "pro", "cgroup.procs"}, "collide"},
		{[]string{"--tier", "pro", strings.Repeat("x", 65)}, "longer than 64"},
		{[]string{"--bogus", "1", "alpha"}, "flag provided but not defined"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			out, errOut, code := set(tt.args...)
			if code == 0 {
				t.Fatalf("accepted: %s", out)
			}
			if !strings.Contains(errOut, tt.want) {
				t.Errorf("stderr %q lacks %q", errOut, tt.want)
			}
			if got := list(); got != before {
				t.Errorf("a refused set changed the store:\n%s", got)
			}
		})
	}
	for _, args := range [][]string{{"get"}, {"delete"}, {"get", "a/b"}, {"delete", ".x"}, {"list", "extra"}} {
		cmd := append([]string{"policy", args[0]}, flags...)
		if _, errOut, code := runCLI(t, append(cmd, args[1:]...)...); code == 0 || errOut == "" {
			t.Errorf("policy %v: exit %d, stderr %q", args, code, errOut)
		}
	}
	if _, errOut, code := runCLI(t, append([]string{"policy", "get"}, append(flags, "nobody")...)...); code != 1 || !strings.Contains(errOut, "no policy is stored") {
		t.Errorf("get of a project without a policy: %d %q", code, errOut)
	}
	if got := list(); got != before {
		t.Errorf("reads changed the store:\n%s", got)
	}
}

// TestFlagsAfterArguments: every flag of every command may follow the
// command's arguments, with its value, as it may precede them: what runs is
// the same, and "--" still ends the flags.
func TestFlagsAfterArguments(t *testing.T) {
	app := newApp()
	for _, c := range []struct{ in, want string }{
		{"fairshare project add web --cgroup /a --admin-socket /s", "fairshare project add --cgroup /a --admin-socket /s web"},
		{"fairshare project add --cgroup /a web --json", "fairshare project add --cgroup /a --json web"},
		{"fairshare policy set alpha --tier pro --shares=2 --json", "fairshare policy set --tier pro --shares=2 --json alpha"},
		{"fairshare policy set alpha -- --tier", "fairshare policy set alpha -- --tier"},
		{"fairshare policy set --tier pro alpha", "fairshare policy set --tier pro alpha"},
		{"fairshare events --json --project web", "fairshare events --json --project web"},
		{"fairshare status extra --json", "fairshare status --json extra"},
		{"fairshare run --no-bpf --pool connections=5", "fairshare run --no-bpf --pool connections=5"},
		{"fairshare policy get alpha --help", "fairshare policy get --help"},
		{"fairshare", "fairshare"},
	} {
		args, err := flagsFirst(app, strings.Fields(c.in))
		if got := strings.Join(args, " "); err != nil || got != c.want {
			t.Errorf("%s\n got  %s (%v)\n want %s", c.in, got, err, c.want)
		}
	}
	// A flag that takes a value and has none after the arguments would take
	// the first argument as its value once moved before them: refused,
	// naming the flag, before anything runs.
	for _, in := range []string{
		"fairshare policy get alpha --state-dir",
		"fairshare project list alpha --admin-socket",
		"fairshare project remove alpha --cgroup --state-dir /s",
		"fairshare project remove alpha --cgroup --help",
	} {
		args, err := flagsFirst(app, strings.Fields(in))
		if err == nil || !strings.Contains(err.Error(), "needs a value") {
			t.Errorf("%s: %v, %v; want an error naming the flag", in, args, err)
		}
	}
	if _, errOut, code := runCLI(t, "project", "remove", "alpha", "--cgroup", "--state-dir", t.TempDir()); code != 2 || !strings.Contains(errOut, "flag --cgroup needs a value (see 'fairshare project remove --help')") {
		t.Errorf("project remove alpha --cgroup --state-dir D: exit %d, %q", code, errOut)
	}

	dir := t.TempDir()
	state, sock := filepath.Join(dir, "state"), filepath.Join(dir, "none.sock")
	if _, errOut, code := runCLI(t, "policy", "set", "alpha", "--tier", "lite", "--state-dir", state, "--admin-socket", sock, "--shares", "3"); code != 0 {
		t.Fatalf("policy set with flags after PROJECT: exit %d: %s", code, errOut)
	}
	out, errOut, code := runCLI(t, "policy", "get", "alpha", "--json", "--state-dir", state, "--admin-socket", sock)
	if code != 0 || !strings.Contains(out, `"tier": "lite"`) || !strings.Contains(out, `"shares": 3`) {
		t.Fatalf("policy get alpha --json: exit %d: %s %s", code, out, errOut)
	}
	if out, _, code := runCLI(t, "policy", "get", "alpha", "--help"); code != 0 || !strings.Contains(out, "fairshare policy get [command options] PROJECT") {
		t.Errorf("policy get alpha --help: exit %d:\n%s", code, out)
	}
	if os.Geteuid() != 0 {
		return
	}
	top := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-cli-")
	a, b := testutil.MkCgroup(t, top, "a"), testutil.MkCgroup(t, top, "b")
	out, errOut, code = runCLI(t, "project", "add", "web", "--cgroup", a, "--admin-socket", sock, "--state-dir", state, "--json")
	if code != 0 || !strings.Contains(out, a) {
		t.Fatalf("project add NAME --cgroup P --admin-socket S: exit %d: %s %s", code, out, errOut)
	}
	// --cgroup PATH PATH: a second path after the first flag's value.
	out, errOut, code = runCLI(t, "project", "add", "db", "--state-dir", state, "--cgroup", b, top+"/nope", "--admin-socket", sock)
	if code != 2 || !strings.Contains(errOut, "nope") {
		t.Errorf("project add db --cgroup B NOPE: exit %d: %s %s", code, out, errOut)
	}
	out, errOut, code = runCLI(t, "project", "list", "web", "--state-dir", state, "--admin-socket", sock, "--json")
	if code != 0 || !strings.Contains(out, a) || strings.Contains(out, b) {
		t.Errorf("project list web --json: exit %d: %s %s", code, out, errOut)
	}
	if _, errOut, code := runCLI(t, "project", "remove", "web", "--cgroup", a, "--state-dir", state, "--admin-socket", sock); code != 0 {
		t.Errorf("project remove NAME --cgroup P: exit %d: %s", code, errOut)
	}
}

func TestConfigErrors(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	if err := os.WriteFile(bad, []byte("pools: {requests: {size: 0}}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// run's status for a configuration it cannot use is 78; the other
	// commands' is 2.
	for _, tt := range []struct {
		args []string
		code int
	}{
		{[]string{"run", "--config", bad, "--print-config"}, 78},
		{[]string{"run", "--config", filepath.Join(dir, "missing.yaml"), "--print-config"}, 78},
		{[]string{"run", "--metrics-listen", "nohostport", "--print-config"}, 78},
		{[]string{"run", "--pin-dir", "relative", "--print-config"}, 78},
		{[]string{"status", "--admin-socket", "relative.sock"}, 2},
		{[]string{"cleanup", "--pin-dir", "relative"}, 2},
		{[]string{"run", "--log-level", "loud", "--no-bpf", "--state-dir", dir}, 78},
		{[]string{"run", "--print-config", "--check", "--no-bpf"}, 2}, // --check was skipped silently
	} {
		_, errOut, code := runCLI(t, tt.args...)
		if code != tt.code || strings.Count(strings.TrimSpace(errOut), "\n") > 1 {
			t.Errorf("%v: exit %d, stderr %q; want exit %d and a short message", tt.args, code, errOut, tt.code)
		}
	}
	out, errOut, code := runCLI(t, "run", "--print-config", "--metrics-listen", "127.0.0.1:9999", "--no-bpf")
	if code != 0 || !strings.Contains(out, "listen: 127.0.0.1:9999") || !strings.Contains(out, "bpf: false") {
		t.Errorf("print-config: %d %s %s", code, out, errOut)
	}
	if out, _, code := runCLI(t, "status", "--admin-socket", filepath.Join(dir, "none.sock")); code != 1 || out != "" {
		t.Errorf("status with no daemon: exit %d", code)
	}
}

// What each command's --help promises is what it does: status has no
// --state-dir (it never reads the store), run's --state-dir does not claim
// the no-daemon fallback, the policy commands' does, and no command lists a
// help subcommand the top level hides.
func TestHelpMatchesBehaviour(t *testing.T) {
	help := func(args ...string) string {
		t.Helper()
		out, errOut, code := runCLI(t, append(args, "--help")...)
		if code != 0 {
			t.Fatalf("%v --help: exit %d: %s", args, code, errOut)
		}
		return out
	}
	if h := help("status"); strings.Contains(h, "--state-dir") || !strings.Contains(h, "exits 1") {
		t.Errorf("status --help:\n%s", h)
	}
	if h := help("run"); strings.Contains(h, "when no daemon answers") || !strings.Contains(h, "3 when the objects pinned") {
		t.Errorf("run --help:\n%s", h)
	}
	for _, sub := range []string{"set", "get", "list", "delete"} {
		if h := help("policy", sub); !strings.Contains(h, "used directly when no daemon answers") {
			t.Errorf("policy %s --help lacks the store fallback:\n%s", sub, h)
		}
	}
	for _, args := range [][]string{{}, {"policy"}, {"drill"}} {
		if h := help(args...); strings.Contains(h, "help, h") {
			t.Errorf("%v --help lists a help subcommand:\n%s", args, h)
		}
	}
	// The --state-dir status used to advertise is now refused, not ignored.
	if _, errOut, code := runCLI(t, "status", "--state-dir", t.TempDir()); code == 0 || !strings.Contains(errOut, "state-dir") {
		t.Errorf("status --state-dir: exit %d, %q", code, errOut)
	}
}

// H4: the project table takes tier and shares from the stored policy (or the
// default), not from the scheduler's live participants, which forget idle
// projects; live columns say "-" for a project that is not live.
func TestStatusProjectTableJoinsPolicies(t *testing.T) {
	st := admin.Status{
		Policies: []admin.Entry{{Project: "quiet", Policy: policy.Policy{Tier: "pro", Shares: 4, RequestsPerSec: 5, ConnectionsPerSec: 40}},
			{Project: "filed", Policy: policy.Policy{Tier: "lite", Shares: 2}, Source: policy.SourceFile}},
		DefaultPolicy: policy.Policy{Tier: "none", Shares: 1},
		Rates:         []admin.Rate{{Project: "quiet", RequestsPerSec: 5, RequestTokens: 5, Limited: 7}},
		Scheduler: &admin.Scheduler{Dispatched: map[string]uint64{}, Participants: []admin.Participant{
			{Participant: "busy", Tier: "none", Shares: 1, Queue: 2, LastClass: "P3"}}},
	}
	var buf strings.Builder
	if err := printStatus(&buf, st); err != nil {
		t.Fatal(err)
	}
	rows := map[string][]string{}
	for _, line := range strings.Split(buf.String(), "\n") {
		if f := strings.Fields(line); len(f) == 15 {
			rows[f[0]] = f
		}
	}
	want := map[string]string{
		"PROJECT": "PROJECT POLICY TIER SHARES REQUESTS/S WORK/S CONNECTIONS/S ACCEPTS/S REQ_TOKENS WORK_TOKENS LIMITED QUEUE P1 P2 CLASS",
		"quiet":   "quiet stored pro 4 5 unbounded 40 unbounded 5.0 0.0 7 - - - -",
		"busy":    "busy default none 1 unbounded unbounded unbounded unbounded - - 0 2 0.0 0.0 P3",
		// As policy list says: the policies file's, which policy set refuses.
		"filed": "filed file lite 2 unbounded unbounded unbounded unbounded - - 0 - - - -",
	}
	for k, w := range want {
		if got := strings.Join(rows[k], " "); got != w {
			t.Errorf("row %s:\n got %q\nwant %q\n%s", k, got, w, buf.String())
		}
	}
}

// TestStatusUnadopted: status says when the last reconcile pass left
// sockets it could not adopt, and says nothing of it when there were none.
func TestStatusUnadopted(t *testing.T) {
	for _, n := range []int{0, 955} {
		var buf strings.Builder
		if err := printStatus(&buf, admin.Status{Reconcile: &admin.Reconcile{Time: time.Now(), Unadopted: n}}); err != nil {
			t.Fatal(err)
		}
		said := strings.Contains(buf.String(), fmt.Sprintf("reconcile: %d project sockets hold no permit and could not be adopted", n))
		if said != (n > 0) || (n == 0 && strings.Contains(buf.String(), "could not be adopted")) {
			t.Errorf("%d unadopted:\n%s", n, buf.String())
		}
	}
}

// TestStatusKernelEvents: status shows the kernel's event counters under
// the kernel's pool, and warns when a full kernel table left connections or
// listeners uncounted.
func TestStatusKernelEvents(t *testing.T) {
	for _, full := range []uint64{0, 12} {
		st := admin.Status{Kernel: true, Pools: []admin.Pool{{Name: "connections", Enforcer: "kernel", Projects: []admin.Project{},
			KernelEvents: &admin.KernelEvents{Adopted: 3, Late: 2, Unaccounted: 1, Expired: 4, MapFull: full}}}}
		var buf strings.Builder
		if err := printStatus(&buf, st); err != nil {
			t.Fatal(err)
		}
		out := buf.String()
		if want := fmt.Sprintf("connections: kernel events, ever on these pins: adopted 3, late 2, unaccounted 1, expired 4, map_full %d\n", full); !strings.Contains(out, want) {
			t.Errorf("map_full %d: no line %q in\n%s", full, want, out)
		}
		if warned := strings.Contains(out, "a kernel table had no room"); warned != (full > 0) {
			t.Errorf("map_full %d: warned %v:\n%s", full, warned, out)
		}
	}
}

// TestPolicyEnforce: 'policy set --enforce=false' stores a dry-run that
// 'policy list' shows, and --enforce=true takes it back (through the store,
// with no daemon).
func TestPolicyEnforce(t *testing.T) {
	dir := t.TempDir()
	flags := []string{"--state-dir", filepath.Join(dir, "state"), "--admin-socket", filepath.Join(dir, "none.sock")}
	run := func(args ...string) string {
		t.Helper()
		out, errOut, code := runCLI(t, append(append(args[:2:2], flags...), args[2:]...)...)
		if code != 0 {
			t.Fatalf("%v: %d %s", args, code, errOut)
		}
		return out
	}
	if out := run("policy", "set", "--enforce=false", "alpha"); !strings.Contains(out, "dry-run") {
		t.Fatalf("set --enforce=false printed %q", out)
	}
	if out := run("policy", "list", "--json"); !strings.Contains(out, `"enforce": false`) {
		t.Fatalf("stored: %s", out)
	}
	run("policy", "set", "--enforce=true", "alpha")
	if out := run("policy", "list"); !strings.Contains(out, "ENFORCE") || strings.Contains(out, "dry-run") {
		t.Fatalf("after --enforce=true: %s", out)
	}
}

// --connections-per-sec is set, kept by a patch of another field, listed in
// its own column, and set back to unbounded with 0; the other rates are
// untouched by it.
func TestPolicyConnectionsPerSec(t *testing.T) {
	dir := t.TempDir()
	flags := []string{"--state-dir", filepath.Join(dir, "state"), "--admin-socket", filepath.Join(dir, "none.sock")}
	run := func(args ...string) string {
		t.Helper()
		out, errOut, code := runCLI(t, append(append([]string{"policy", args[0]}, flags...), args[1:]...)...)
		if code != 0 {
			t.Fatalf("policy %v: exit %d: %s", args, code, errOut)
		}
		return out
	}
	run("set", "--requests-per-sec", "7", "--connections-per-sec", "50", "alpha")
	run("set", "--shares", "3", "alpha")
	var got []policy.Entry
	if err := json.Unmarshal([]byte(run("list", "--json")), &got); err != nil {
		t.Fatal(err)
	}
	if want := (policy.Policy{Tier: "none", Shares: 3, RequestsPerSec: 7, ConnectionsPerSec: 50}); len(got) != 1 || got[0].Policy != want {
		t.Fatalf("list = %+v, want alpha %+v", got, want)
	}
	table := run("list")
	if !strings.Contains(table, "CONNECTIONS/S") || !strings.Contains(strings.Join(strings.Fields(table), " "), "alpha none 3 7 unbounded 50 unbounded yes cli") {
		t.Errorf("list table:\n%s", table)
	}
	run("set", "--connections-per-sec", "0", "alpha")
	if out := run("get", "--json", "alpha"); !strings.Contains(out, `"connections_per_sec": 0`) || !strings.Contains(out, `"requests_per_sec": 7`) {
		t.Errorf("after --connections-per-sec 0: %s", out)
	}
}

// With no daemon and no store yet (a fresh host), the commands that only
// read answer as from an empty store, and neither they, nor a delete or
// remove that finds nothing, nor an add refused for its input, create the
// state directory or the store in it.
func TestNoStoreWritesNothing(t *testing.T) {
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	flags := []string{"--state-dir", state, "--admin-socket", filepath.Join(dir, "none.sock")}
	do := func(args ...string) (string, string, int) {
		t.Helper()
		return runCLI(t, append(args, flags...)...)
	}
	untouched := func(what string) {
		t.Helper()
		if _, err := os.Stat(state); !os.IsNotExist(err) {
			t.Errorf("%s made the state directory %s (%v)", what, state, err)
			os.RemoveAll(state) // for the next check
		}
	}
	if out, errOut, code := do("policy", "list"); code != 0 || !strings.HasPrefix(out, "PROJECT") || strings.Count(out, "\n") != 1 {
		t.Errorf("policy list: exit %d, %q, %q; want an empty table", code, out, errOut)
	}
	untouched("policy list")
	if out, errOut, code := do("policy", "list", "--json"); code != 0 || strings.TrimSpace(out) != "[]" {
		t.Errorf("policy list --json: exit %d, %q, %q; want []", code, out, errOut)
	}
	if _, errOut, code := do("policy", "get", "alpha"); code != 1 || !strings.Contains(errOut, "no policy is stored for alpha") {
		t.Errorf("policy get alpha: exit %d, %q", code, errOut)
	}
	untouched("policy get")
	if _, errOut, code := do("policy", "delete", "alpha"); code != 1 || !strings.Contains(errOut, "no policy is stored for alpha") {
		t.Errorf("policy delete alpha: exit %d, %q", code, errOut)
	}
	untouched("policy delete")
	if out, errOut, code := do("project", "list"); code != 0 || !strings.Contains(out, "PROJECT") {
		t.Errorf("project list: exit %d, %q, %q; want an empty table", code, out, errOut)
	}
	if out, errOut, code := do("project", "list", "web", "--json"); code != 0 || !strings.Contains(out, `"members": []`) {
		t.Errorf("project list web --json: exit %d, %q, %q", code, out, errOut)
	}
	untouched("project list")
	if _, errOut, code := do("project", "remove", "web"); code != 1 || !strings.Contains(errOut, "no registered cgroups") {
		t.Errorf("project remove web: exit %d, %q", code, errOut)
	}
	untouched("project remove")
	mnt := testutil.Cgroup2Mount(t)
	for _, cg := range []string{filepath.Join(mnt, "cgroup.procs"), filepath.Join(mnt, "fairshare-no-such-cgroup"), mnt} {
		if _, errOut, code := do("project", "add", "web", "--cgroup", cg); code != 2 {
			t.Errorf("project add web --cgroup %s: exit %d, %q; want 2", cg, code, errOut)
		}
		untouched("project add --cgroup " + cg)
	}
	// A write that goes through makes the store, which the reads then
	// open read-only.
	if _, errOut, code := do("policy", "set", "alpha", "--shares", "2"); code != 0 {
		t.Fatalf("policy set: exit %d, %q", code, errOut)
	}
	if out, errOut, code := do("policy", "get", "alpha", "--json"); code != 0 || !strings.Contains(out, `"shares": 2`) {
		t.Errorf("policy get alpha after set: exit %d, %q, %q", code, out, errOut)
	}
}

// With no daemon answering, the policy commands read the policies file
// (config policies_file) as the daemon does: set and delete refuse a project
// it names, with the daemon's sentence and exit status, and write nothing;
// get and list show the file's policy. The offline set went through before,
// and the daemon then put the file's policy over it at start.
func TestPolicyFileOwnsWithoutDaemon(t *testing.T) {
	dir := t.TempDir()
	state, file, conf := filepath.Join(dir, "state"), filepath.Join(dir, "policies.yaml"), filepath.Join(dir, "fairshare.yaml")
	for path, text := range map[string]string{file: "alpha: {tier: pro, shares: 2}\n", conf: "policies_file: " + file + "\n"} {
		if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	do := func(args ...string) (string, string, int) {
		t.Helper()
		return runCLI(t, append(args, "--config", conf, "--state-dir", state, "--admin-socket", filepath.Join(dir, "none.sock"))...)
	}
	refused := policy.FromFile(file, "alpha").Error()
	for _, args := range [][]string{{"policy", "set", "--shares", "5", "alpha"}, {"policy", "delete", "alpha"}} {
		if out, errOut, code := do(args...); code != 1 || !strings.Contains(errOut, refused) {
			t.Errorf("%v: exit %d, %q, %q; want 1 and %q", args, code, out, errOut, refused)
		}
		if _, err := os.Stat(state); !os.IsNotExist(err) {
			t.Fatalf("%v made the state directory (%v)", args, err)
		}
	}
	if _, errOut, code := do("policy", "set", "--shares", "3", "beta"); code != 0 {
		t.Fatalf("policy set beta: exit %d, %q", code, errOut)
	}
	if _, errOut, code := do("policy", "set", "--shares", "5", "alpha"); code != 1 || !strings.Contains(errOut, refused) {
		t.Errorf("policy set alpha with a store: exit %d, %q", code, errOut)
	}
	out, errOut, code := do("policy", "list", "--json")
	var list []policy.Entry
	if code != 0 || json.Unmarshal([]byte(out), &list) != nil || len(list) != 2 ||
		list[0] != (policy.Entry{Project: "alpha", Policy: policy.Policy{Tier: "pro", Shares: 2}, Source: policy.SourceFile}) ||
		list[1] != (policy.Entry{Project: "beta", Policy: policy.Policy{Tier: "none", Shares: 3}}) {
		t.Errorf("policy list --json: exit %d, %s %s", code, out, errOut)
	}
	if out, errOut, code := do("policy", "get", "--json", "alpha"); code != 0 || !strings.Contains(out, `"source": "file"`) {
		t.Errorf("policy get alpha: exit %d, %s %s", code, out, errOut)
	}
	// A file that does not validate may still name the project (a daemon
	// that starts with it keeps the policies it read from it last): a
	// write is refused, a read warns.
	if err := os.WriteFile(file, []byte("alpha: {shares: -1}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, errOut, code := do("policy", "set", "--shares", "5", "alpha"); code != 1 || !strings.Contains(errOut, "whether it names alpha is not known, so nothing was written") {
		t.Errorf("policy set alpha with a refused file: exit %d, %q", code, errOut)
	}
	if _, errOut, code := do("policy", "list"); code != 0 || !strings.Contains(errOut, "warning: policies file "+file+" refused") {
		t.Errorf("policy list with a refused file: exit %d, %q", code, errOut)
	}
}

// An admin socket that turns the user away says so, not that the daemon
// did not answer: 403 from the API, EACCES from the socket's mode.
func TestPolicyAdminSocketDenied(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "admin.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusForbidden)
		fmt.Fprint(w, `{"error": "the admin api accepts only root"}`)
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	for _, args := range [][]string{{"policy", "list"}, {"policy", "set", "--shares", "2", "alpha"}} {
		_, errOut, code := runCLI(t, append(args, "--admin-socket", sock, "--state-dir", filepath.Join(dir, "state"))...)
		if code != 1 || !strings.Contains(errOut, "permission denied (the admin API needs root)") || strings.Contains(errOut, "did not answer") {
			t.Errorf("%v: exit %d, %q; want 1 and permission denied", args, code, errOut)
		}
	}
	if !denied(&net.OpError{Op: "dial", Net: "unix", Err: os.NewSyscallError("connect", syscall.EACCES)}) {
		t.Error("EACCES from connect is not taken as permission denied")
	}
}

// What run refuses, run --print-config and run --check refuse too, with
// the same status (78) and the flag or key named: the logger's flags, and the
// front's keys with the front off (the scheduler takes max_in_flight
// whether or not the front runs).
func TestPrintConfigRefusesWhatRunRefuses(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--log-level", "loud"}, "--log-level"},
		{[]string{"--log-format", "xml"}, "--log-format"},
		{[]string{"--front-max-in-flight", "-3"}, "front.max_in_flight"},
		{[]string{"--front-max-in-flight", "0"}, "front.max_in_flight"},
	} {
		for _, mode := range []string{"--print-config", "--check"} {
			args := append([]string{"run", mode, "--no-bpf"}, c.args...)
			out, errOut, code := runCLI(t, args...)
			if code != 78 || !strings.Contains(errOut, c.want) || strings.Contains(out, "validated") {
				t.Errorf("%v: exit %d, stdout %q, stderr %q; want exit 78 naming %s", args, code, out, errOut, c.want)
			}
		}
	}
}

// A command that does not exist is a usage error, exit 2, at every level,
// and so is no command at all (the help goes to stderr): not urfave's "No
// help topic" and its exit 3, which is run's status for pins that changed.
func TestUnknownCommand(t *testing.T) {
	for _, args := range [][]string{{"bogus"}, {"help"}, {"policy", "bogus"}, {"policy", "help"}, {"project", "bogus"},
		{"drill", "bogus"}, {"gendocs", "bogus"}} {
		_, errOut, code := runCLI(t, args...)
		want := fmt.Sprintf("unknown command %q; see '%s --help'", args[len(args)-1], strings.Join(append([]string{"fairshare"}, args[:len(args)-1]...), " "))
		if code != 2 || !strings.Contains(errOut, want) {
			t.Errorf("%v: exit %d, stderr %q; want 2 and %q", args, code, errOut, want)
		}
	}
	for _, args := range [][]string{{}, {"policy"}, {"project"}} {
		out, errOut, code := runCLI(t, args...)
		if code != 2 || out != "" || !strings.Contains(errOut, "USAGE:") || !strings.Contains(errOut, "needs a command: ") {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want 2 and the help on stderr", args, code, out, errOut)
		}
	}
	// With no help command, "help" is a project name like another.
	dir := t.TempDir()
	_, errOut, code := runCLI(t, "policy", "get", "help", "--state-dir", dir, "--admin-socket", filepath.Join(dir, "none.sock"))
	if code != 1 || !strings.Contains(errOut, "no policy is stored for help") {
		t.Errorf("policy get help: exit %d, %q", code, errOut)
	}
}

// Every command whose usage shows no arguments refuses one, exit 2, before
// it does anything.
func TestStrayArguments(t *testing.T) {
	var walk func(path []string, cs []*cli.Command)
	walk = func(path []string, cs []*cli.Command) {
		for _, c := range cs {
			p := append(path[:len(path):len(path)], c.Name)
			walk(p, c.Subcommands)
			if c.ArgsUsage != "" || c.Action == nil || len(c.Subcommands) > 0 {
				continue
			}
			t.Run(strings.Join(p, " "), func(t *testing.T) {
				_, errOut, code := runCLI(t, append(p, "extra")...)
				want := fmt.Sprintf("%s takes no arguments, got \"extra\"", strings.Join(p, " "))
				if code != 2 || !strings.Contains(errOut, want) {
					t.Errorf("exit %d, stderr %q; want 2 and %q", code, errOut, want)
				}
			})
		}
	}
	walk(nil, newApp().Commands)
}

// Drill flags given a value the drill cannot run with are refused, exit 2,
// naming the flag, instead of running with the default in their place.
func TestDrillRefusesBadFlags(t *testing.T) {
	// A short drill, should a bad value be taken after all.
	short := []string{"--phase", "50ms", "--slices", "1"}
	for _, c := range []struct {
		args []string
		flag string
	}{
		{append([]string{"--pool", "0"}, short...), "--pool"},
		{append([]string{"--pool", "-5"}, short...), "--pool"},
		{append([]string{"--big", "0"}, short...), "--big"},
		{append([]string{"--small", "-1"}, short...), "--small"},
		{[]string{"--phase", "50ms", "--slices", "0"}, "--slices"},
		{append([]string{"--service", "0s"}, short...), "--service"},
		{append([]string{"--retry-pause", "-1ms"}, short...), "--retry-pause"},
		{append([]string{"--target-ratio", "0"}, short...), "--target-ratio"},
		{append([]string{"--target-ratio", "NaN"}, short...), "--target-ratio"},
		{[]string{"--phase", "0s", "--slices", "1"}, "--phase"},
		{[]string{"--phase", "-1s", "--slices", "1"}, "--phase"},
	} {
		for _, cmd := range [][]string{{"drill"}, {"drill", "connections"}} {
			args := append(append([]string{}, cmd...), c.args...)
			t.Run(strings.Join(args, " "), func(t *testing.T) {
				out, errOut, code := runCLI(t, args...)
				if code != 2 || !strings.Contains(errOut, c.flag+" must be") || out != "" {
					t.Errorf("exit %d, stdout %q, stderr %q; want 2 naming %s", code, out, errOut, c.flag)
				}
			})
		}
	}
}
