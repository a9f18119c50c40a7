// SPDX-License-Identifier: Apache-2.0

package main

import (
	"os"
	"syscall"
	"testing"
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
