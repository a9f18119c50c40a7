// SPDX-License-Identifier: Apache-2.0

package main

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/loader"
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

// TestCleanupForceStopsDaemon: the daemon's pin directory removed under it
// by 'cleanup --force', or hidden by a file system mounted over it, while it
// runs with
// --detach-on-exit (whose exit cleans the pin directory): it stops with
// exit status 1 saying why when it notices, or as it was told when a
// SIGTERM comes first, and either way cleans nothing at the path (a
// directory made there meanwhile, another daemon's, as the marker stands
// for, stays), unpins what is left of its own pins where they went, and
// its programs detach as it exits; the next start enforces alone. The
// daemon is stopped (SIGSTOP) while its directory changes, so that the
// marker is there before it can look.
func TestCleanupForceStopsDaemon(t *testing.T) {
	n := newNode(t, "tick: 100ms\npools: {connections: {size: 2}}\n")
	addr := sink(t)
	for _, how := range []string{"cleanup", "cleanup, then SIGTERM", "mounted over"} {
		n.args = []string{"--detach-on-exit"}
		n.start()
		if a := n.connectFrom("alpha", addr, 3); a.connected != 2 || a.refused != 1 {
			t.Fatalf("%s: alpha connected %d, refused %d; want 2 and 1 with a pool of 2", how, a.connected, a.refused)
		} else {
			a.close()
		}
		n.cmd.Process.Signal(syscall.SIGSTOP)
		if how == "mounted over" {
			if err := unix.Mount("tmpfs", n.pin, "tmpfs", 0, "size=1m"); err != nil {
				n.cmd.Process.Signal(syscall.SIGCONT)
				t.Fatal(err)
			}
			t.Cleanup(func() { unix.Unmount(n.pin, unix.MNT_DETACH) })
		} else if out, errOut, code := n.cli("cleanup", "--force"); code != 0 || !strings.Contains(errOut, "it stops within a tick") {
			n.cmd.Process.Signal(syscall.SIGCONT)
			t.Fatalf("%s: cleanup --force: exit %d\n%s%s", how, code, out, errOut)
		}
		marker := filepath.Join(n.pin, "marker")
		if err := os.MkdirAll(marker, 0o700); err != nil {
			t.Fatal(err)
		}
		want := 1
		if how == "cleanup, then SIGTERM" {
			n.cmd.Process.Signal(syscall.SIGTERM)
			want = -1 // 0 if the signal is handled first, 1 if the watcher's tick is
		}
		n.cmd.Process.Signal(syscall.SIGCONT)
		code := n.waitExit()
		if want >= 0 && code != want || code != 0 && code != 1 ||
			code == 1 && !strings.Contains(n.log.String(), "the pin directory was removed or replaced under the daemon") {
			t.Fatalf("%s: daemon exit %d; want %d and the reason logged:\n%s", how, code, want, n.log)
		}
		if _, err := os.Stat(marker); err != nil {
			t.Fatalf("%s: the exiting daemon cleaned the directory made in its pins' place: %v", how, err)
		}
		if how == "mounted over" {
			if err := unix.Unmount(n.pin, 0); err != nil {
				t.Fatal(err)
			}
			if ents, err := os.ReadDir(n.pin); err != nil || len(ents) != 0 {
				t.Fatalf("%s: left in its own directory under the mount: %v, %v", how, ents, err)
			}
		}
		if a := n.connectFrom("alpha", addr, 3); a.connected != 3 {
			t.Fatalf("%s: alpha connected %d of 3 after the daemon stopped: its programs stayed attached", how, a.connected)
		} else {
			a.close()
		}
		// The marker is no pin of fairshare's: cleanup would refuse the
		// directory with it.
		if err := os.RemoveAll(marker); err != nil {
			t.Fatal(err)
		}
		if err := loader.Cleanup(n.pin); err != nil {
			t.Fatal(err)
		}
	}
	n.args = nil
	n.start()
	if a := n.connectFrom("alpha", addr, 3); a.connected != 2 || a.refused != 1 {
		t.Fatalf("after a new start alpha connected %d, refused %d; want 2 and 1 (one set of programs)", a.connected, a.refused)
	} else {
		a.close()
	}
}
