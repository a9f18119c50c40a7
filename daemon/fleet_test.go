// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/internal/etcdtest"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/loader"
)

// TestFleetConnectionsOpenAtSafeSlice: a fleet connections pool is in the
// kernel from the moment its programs are attached, before its Member has
// run, let alone computed: it must open at its safe slice there, as a fleet
// destination pool does, not at the fleet's size (every node starting at
// the fleet's size would let the fleet hold nodes × size). Its permit
// tables are still sized for the fleet's size, which its allotment may
// reach.
func TestFleetConnectionsOpenAtSafeSlice(t *testing.T) {
	testutil.RequireRoot(t)
	e := etcdtest.Start(t)
	root := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-fc-")
	pin := filepath.Join("/sys/fs/bpf", filepath.Base(root))
	t.Cleanup(func() { loader.Cleanup(pin) })
	dir := t.TempDir()
	cfg := config.Default()
	cfg.StateDir, cfg.AdminSocket = filepath.Join(dir, "state"), filepath.Join(dir, "admin.sock")
	cfg.Permits.Socket, cfg.Metrics.Listen = "", ""
	cfg.ProjectsRoot, cfg.PinDir = root, pin
	cfg.Pools[config.PoolConnections] = config.Pool{Size: 400, Window: time.Second, Fleet: true}
	cfg.Fleet = config.Fleet{Etcd: e.Endpoints(), Node: "a", Prefix: "/safe", SafeFraction: 0.25}
	d, err := New(Options{Config: cfg, Version: "test"})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	// New opened the kernel side; nothing has run the Member yet.
	ro, err := loader.OpenReadOnly(pin)
	if err != nil {
		t.Fatal(err)
	}
	s, err := ro.Snapshot()
	ro.Close()
	if err != nil {
		t.Fatal(err)
	}
	if s.Size != 100 {
		t.Errorf("the kernel's POOL is %d before the first computation, want the safe slice 100 (400 × 0.25)", s.Size)
	}
	// The allotment can still reach the fleet's size.
	if err := d.kernel.lim.SetPool(400, 0); err != nil {
		t.Errorf("raising the pool to the fleet's size: %v", err)
	}
}
