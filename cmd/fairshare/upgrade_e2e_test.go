// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/events"
)

// TestUpgradeMigratesPins: a daemon started on pins of another layout (here
// fs_dpool_state as the version before it pinned it, not mmapable) migrates
// them by itself under its own lock on the pin directory: 'run --check'
// says it will, the start succeeds (no exit 3, no cleanup), logs the
// migration at warn with the connections it counted, the held connections
// fill the pool, their release gives the permits back, and the next start
// reuses the new pins.
func TestUpgradeMigratesPins(t *testing.T) {
	n := newNode(t, "pools: {connections: {size: 2}}\n")
	n.start()
	addr := sink(t)
	a := n.connectFrom("alpha", addr, 3)
	t.Cleanup(a.close)
	if a.connected != 2 || a.refused != 1 {
		t.Fatalf("alpha connected %d, refused %d; want 2 and 1 with a pool of 2", a.connected, a.refused)
	}
	n.stop(syscall.SIGKILL)
	oldLayoutPin(t, filepath.Join(n.pin, "fs_dpool_state"))

	out, errOut, code := runCLI(t, "run", "--config", n.cfg, "--check")
	if code != 0 || !strings.Contains(out, "fs_dpool_state") || !strings.Contains(out, "migrates them when it starts") {
		t.Fatalf("run --check on pins of another layout: %d\n%s%s", code, out, errOut)
	}

	n.start()
	log := n.log.String()
	if !strings.Contains(log, `"level":"WARN","msg":"migrated from pins of another layout`) || !strings.Contains(log, `"adopted":2`) {
		t.Fatalf("no warning of the migration counting the 2 connections:\n%s", log)
	}
	// The migration's own count is a reconcile pass as the daemon's are:
	// its adoption is an event (once the first tick records it), said to
	// be the migration's.
	eventually(t, func() error {
		adopted := 0
		for _, e := range n.events() {
			if e.Source == events.SourceReconcile && e.Kind == events.KindAdopted && strings.Contains(e.Detail, "migration") {
				adopted += int(e.Count)
			}
		}
		if adopted != 2 {
			return fmt.Errorf("after the migration: %d adopted in reconcile events; want the 2 connections", adopted)
		}
		return nil
	})
	b := n.connectFrom("alpha", addr, 1)
	b.close()
	if b.connected != 0 || b.refused != 1 {
		t.Fatalf("after the migration alpha connected %d, refused %d; want the 2 held connections to fill the pool", b.connected, b.refused)
	}
	a.close()
	eventually(t, func() error {
		if c := pool(n.status(), "connections"); c.InUse != 0 {
			return fmt.Errorf("after the releases: pool %+v, want in_use 0", c)
		}
		return nil
	})
	for _, d := range []string{"migrating", "migrated"} {
		if _, err := os.Stat(filepath.Join(n.pin, d)); err == nil {
			t.Errorf("%s left in %s", d, n.pin)
		}
	}

	if err := n.stop(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	n.start()
	if strings.Contains(n.log.String(), "migrated from pins") {
		t.Fatalf("the start after the migration migrated again:\n%s", n.log)
	}
}

// oldLayoutPin replaces the map pinned at path with an empty one of the
// same shape without BPF_F_MMAPABLE, as the version before made it.
func oldLayoutPin(t *testing.T, path string) {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	info, err := m.Info()
	m.Close()
	if err != nil {
		t.Fatal(err)
	}
	if info.Flags&unix.BPF_F_MMAPABLE == 0 {
		t.Fatalf("%s is not mmapable: the test no longer makes another layout", path)
	}
	old, err := ebpf.NewMap(&ebpf.MapSpec{Type: info.Type, KeySize: info.KeySize, ValueSize: info.ValueSize,
		MaxEntries: info.MaxEntries, Flags: info.Flags &^ unix.BPF_F_MMAPABLE})
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	tmp := path + "_old"
	if err := old.Pin(tmp); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		t.Fatal(err)
	}
}
