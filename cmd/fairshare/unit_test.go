// SPDX-License-Identifier: Apache-2.0

package main

import (
	"errors"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// With panicEnv set, the test binary panics, as a daemon with a bug would.
const panicEnv = "FAIRSHARE_E2E_PANIC"

// dist/fairshare.service restarts a daemon that crashed and does not
// restart one whose configuration it cannot use. The unit said
// RestartPreventExitStatus=2 3 when run exited 2 for an unusable
// configuration; but Go exits 2 on a panic and on a fatal runtime error
// too, so a daemon that crashed stayed down and the kernel stopped
// enforcing once connections.lapse_after passed. run (and --check and
// --print-config) now exit 78 for the configuration, a status Go never
// exits with.
func TestUnitRestartsACrash(t *testing.T) {
	// What Go exits with on a panic.
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(cleanEnv(), panicEnv+"=1")
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || !strings.Contains(string(out), "panic: ") {
		t.Fatalf("the panicking helper: %v\n%s", err, out)
	}
	crash := ee.ExitCode()

	// What run exits with for a configuration it cannot use, the same
	// with --check and --print-config.
	config := -1
	for _, mode := range [][]string{nil, {"--check"}, {"--print-config"}} {
		args := append(append([]string{"run"}, mode...), "--no-bpf", "--pool", "requests=0")
		_, errOut, code := runCLI(t, args...)
		if !strings.Contains(errOut, "pools.requests.size") {
			t.Fatalf("%v: exit %d, %q; want the key named", args, code, errOut)
		}
		if code != 78 {
			t.Errorf("%v: exit %d, want 78 (EX_CONFIG) for an unusable configuration", args, code)
		}
		if config == -1 {
			config = code
		} else if code != config {
			t.Errorf("%v: exit %d, run's status for the same configuration is %d", args, code, config)
		}
	}
	if config == crash {
		t.Errorf("run exits %d for an unusable configuration, the status of a panic", config)
	}

	prevent, restart := unitRestart(t)
	if restart != "on-failure" && restart != "always" {
		t.Errorf("the unit's Restart=%s does not restart a daemon that crashed", restart)
	}
	if slices.Contains(prevent, crash) {
		t.Errorf("the unit's RestartPreventExitStatus %v holds %d, the status of a panic: a daemon that crashes is not restarted", prevent, crash)
	}
	for _, code := range []int{config, exitStalePins} {
		if !slices.Contains(prevent, code) {
			t.Errorf("the unit's RestartPreventExitStatus %v lacks %d, which a restart cannot fix", prevent, code)
		}
	}
	if slices.Contains(prevent, 1) {
		t.Errorf("the unit's RestartPreventExitStatus %v holds 1, run's status for a failure a restart may fix", prevent)
	}
}

// unitRestart reads the exit statuses of RestartPreventExitStatus (an empty
// assignment clears the list, as systemd reads it) and Restart from
// dist/fairshare.service.
func unitRestart(t *testing.T) (prevent []int, restart string) {
	t.Helper()
	b, err := os.ReadFile("../../dist/fairshare.service")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		k, v, ok := strings.Cut(strings.TrimSpace(line), "=")
		if !ok {
			continue
		}
		switch k {
		case "RestartPreventExitStatus":
			if strings.TrimSpace(v) == "" {
				prevent = nil
			}
			for _, f := range strings.Fields(v) {
				if n, err := strconv.Atoi(f); err == nil {
					prevent = append(prevent, n)
				}
			}
		case "Restart":
			restart = strings.TrimSpace(v)
		}
	}
	if len(prevent) == 0 {
		t.Fatal("dist/fairshare.service sets no RestartPreventExitStatus")
	}
	return prevent, restart
}
