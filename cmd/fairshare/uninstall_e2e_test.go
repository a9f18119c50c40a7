// SPDX-License-Identifier: Apache-2.0

package main

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestDetachOnExitLeavesNoPins is the chart's uninstall (detachOnExit: the
// daemon runs with --detach-on-exit, and the pod's stop is a SIGTERM): while
// the daemon runs, a project past the pool is refused; after a plain
// SIGTERM the pins stay and it still is (enforcement outlives the daemon);
// after a SIGTERM with --detach-on-exit the pin directory is gone and the
// same project connects freely.
func TestDetachOnExitLeavesNoPins(t *testing.T) {
	n := newNode(t, "pools: {connections: {size: 2}}\n")
	addr := sink(t)
	n.start()
	if a := n.connectFrom("alpha", addr, 4); a.connected != 2 || a.refused != 2 {
		t.Fatalf("alpha connected %d, refused %d; want 2 and 2 with a pool of 2", a.connected, a.refused)
	} else {
		a.close()
	}
	if err := n.stop(syscall.SIGTERM); err != nil {
		t.Fatalf("daemon exit: %v\n%s", err, n.log)
	}
	if _, err := os.Stat(n.pin); err != nil {
		t.Fatalf("the pins went with a plain SIGTERM: %v", err)
	}
	if a := n.connectFrom("alpha", addr, 4); a.refused == 0 {
		t.Fatal("nothing refused with the pins left: enforcement did not outlive the daemon")
	} else {
		a.close()
	}

	n.args = []string{"--detach-on-exit"}
	n.start()
	if err := n.stop(syscall.SIGTERM); err != nil {
		t.Fatalf("daemon exit: %v\n%s", err, n.log)
	}
	if _, err := os.Stat(n.pin); !os.IsNotExist(err) {
		t.Fatalf("pin directory %s after a SIGTERM with --detach-on-exit: %v", n.pin, err)
	}
	if a := n.connectFrom("alpha", addr, 4); a.connected != 4 {
		t.Errorf("alpha connected %d of 4 after the daemon detached: programs left attached", a.connected)
	} else {
		a.close()
	}
}

// TestCleanupForceStopsDaemon: 'cleanup --force' under a running daemon
// (here with --detach-on-exit, whose exit would otherwise clean the pin
// directory) unpins everything; the daemon notices within a tick and stops
// with exit status 1, saying why, unpinning nothing of the directory made
// in the old one's place meanwhile (another daemon's, as the marker stands
// for); its programs detach as it exits, and the next start enforces alone.
func TestCleanupForceStopsDaemon(t *testing.T) {
	n := newNode(t, "tick: 100ms\npools: {connections: {size: 2}}\n")
	addr := sink(t)
	n.args = []string{"--detach-on-exit"}
	n.start()
	if a := n.connectFrom("alpha", addr, 3); a.connected != 2 || a.refused != 1 {
		t.Fatalf("alpha connected %d, refused %d; want 2 and 1 with a pool of 2", a.connected, a.refused)
	} else {
		a.close()
	}
	out, errOut, code := n.cli("cleanup", "--force")
	if code != 0 || !strings.Contains(errOut, "it stops within a tick") {
		t.Fatalf("cleanup --force: exit %d\n%s%s", code, out, errOut)
	}
	marker := filepath.Join(n.pin, "marker")
	if err := os.MkdirAll(marker, 0o700); err != nil {
		t.Fatal(err)
	}
	var err error
	select {
	case err = <-n.done:
		n.cmd = nil
	case <-time.After(20 * time.Second):
		t.Fatalf("the daemon still runs 20s after its pins were removed:\n%s", n.log)
	}
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 || !strings.Contains(n.log.String(), "the pin directory was removed or replaced under the daemon") {
		t.Fatalf("daemon exit %v; want status 1 and the reason logged:\n%s", err, n.log)
	}
	if _, err := os.Stat(marker); err != nil {
		t.Fatalf("the exiting daemon cleaned the directory made in its pins' place: %v", err)
	}
	if a := n.connectFrom("alpha", addr, 3); a.connected != 3 {
		t.Fatalf("alpha connected %d of 3 after the daemon stopped: its programs stayed attached", a.connected)
	} else {
		a.close()
	}
	n.args = nil
	n.start()
	if a := n.connectFrom("alpha", addr, 3); a.connected != 2 || a.refused != 1 {
		t.Fatalf("after a new start alpha connected %d, refused %d; want 2 and 1 (one set of programs)", a.connected, a.refused)
	} else {
		a.close()
	}
}
