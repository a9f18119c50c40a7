// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/fleet"
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

// TestFleetKernelPoolsStartAtPinnedSafe: the kernel's fleet pools keep, in
// the pins, the safe slice the last daemon gave them (the size over the
// nodes it last saw). A daemon restarted while etcd is down started them
// at the floor, 5% of the size, having no view yet: a pool held to
// size/200 by 200 nodes went to size/20 on each, and a rolling restart
// took the fleet from its size to ten times it. Now each starts at no
// more than its pinned slice (5 of 1,000 here), in the kernel before its
// Member runs and after, and keeps it as the slice it falls to.
func TestFleetKernelPoolsStartAtPinnedSafe(t *testing.T) {
	testutil.RequireRoot(t)
	root := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-fp-")
	pin := filepath.Join("/sys/fs/bpf", filepath.Base(root))
	t.Cleanup(func() { loader.Cleanup(pin) })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	etcd := "http://" + ln.Addr().String()
	ln.Close()
	dir := t.TempDir()
	cfg := config.Default()
	cfg.StateDir, cfg.AdminSocket = filepath.Join(dir, "state"), filepath.Join(dir, "admin.sock")
	cfg.Permits.Socket, cfg.Metrics.Listen = "", ""
	cfg.ProjectsRoot, cfg.PinDir = root, pin
	cfg.Pools[config.PoolConnections] = config.Pool{Size: 1000, Window: time.Second, Fleet: true}
	cfg.Pools["pg"] = config.Pool{Size: 1000, Window: time.Second, Destinations: []string{"10.0.0.5/32:5432"}, Fleet: true}
	cfg.Fleet = config.Fleet{Etcd: []string{etcd}, Node: "a", Prefix: "/pinned"}
	// sizes reads the two pools' sizes in the kernel.
	sizes := func() (conn, pg int) {
		t.Helper()
		ro, err := loader.OpenReadOnly(pin)
		if err != nil {
			t.Fatal(err)
		}
		defer ro.Close()
		s, err := ro.Snapshot()
		if err != nil {
			t.Fatal(err)
		}
		pg = -1
		for _, dp := range s.Dests {
			if dp.Name == "pg" {
				pg = dp.Size
			}
		}
		return s.Size, pg
	}

	// A first run, which gave the pools the safe slices of 200 nodes.
	d, err := New(Options{Config: cfg, Version: "test"})
	if err != nil {
		t.Fatal(err)
	}
	for _, pool := range []string{"", "pg"} {
		if err := d.kernel.lim.SetFleetSafe(pool, 5, time.Time{}, fleet.DefaultLeaseTTL); err != nil {
			t.Fatal(err)
		}
	}
	d.Close()
	pinned := func() map[string]int {
		t.Helper()
		got, err := loader.PinnedFleetSafes(pin)
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	if got := pinned(); got[""] != 5 || got["pg"] != 5 {
		t.Fatalf("the pins keep the safe slices %v, want 5 for both", got)
	}

	// Restarted with etcd down: no view yet.
	d, err = New(Options{Config: cfg, Version: "test"})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if conn, pg := sizes(); conn > 5 || pg > 5 {
		t.Fatalf("before the Members ran: the kernel's pools at %d and %d, want at most the pinned 5, not the floor 50", conn, pg)
	}
	// The kernel side's Open kept them: a daemon that stops before its
	// Members set them again leaves them to the next start.
	if got := pinned(); got[""] != 5 || got["pg"] != 5 {
		t.Fatalf("after the kernel side opened, the pins keep the safe slices %v, want 5 for both", got)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = d.fleet.run(ctx) }()
	defer func() { cancel(); <-done }()
	eventually(t, func() error {
		got := pinned()
		for _, name := range []string{config.PoolConnections, "pg"} {
			if st := d.fleet.members[name].Status(); st.Safe != 5 || st.Allotment > 5 || st.State != fleet.StateWaiting {
				return fmt.Errorf("pool %s: %q allotment %d safe %d, want waiting at no more than the pinned 5", name, st.State, st.Allotment, st.Safe)
			}
		}
		if got[""] != 5 || got["pg"] != 5 {
			return fmt.Errorf("the pins keep the safe slices %v, want 5 for both", got)
		}
		return nil
	})
	if conn, pg := sizes(); conn > 5 || pg > 5 {
		t.Fatalf("the Members running, etcd down: the kernel's pools at %d and %d, want at most the pinned 5, not the floor 50", conn, pg)
	}
}

// TestFleetUserPoolsStartAtSafeSlice: a user-space fleet pool (requests,
// flights, a permit pool) is served from the moment Run starts the front
// and the permit API, before its Member has run, let alone reached etcd: it
// must be at its safe slice by then, as the kernel's fleet pools are, not
// at the fleet's size. Here etcd is never reached (nothing listens at its
// endpoint): with safe_fraction the slice is size × safe_fraction, without
// it the pool's floor.
func TestFleetUserPoolsStartAtSafeSlice(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	etcd := "http://" + ln.Addr().String()
	ln.Close()
	for _, tc := range []struct {
		fraction float64
		want     map[string]int // by pool
	}{
		{0.25, map[string]int{config.PoolRequests: 10, config.PoolFlights: 5, "db": 3}},
		{0, map[string]int{config.PoolRequests: 2, config.PoolFlights: 4, "db": 1}},
	} {
		d, _, _ := newTestDaemon(t, func(c *config.Config) {
			c.Pools[config.PoolRequests] = config.Pool{Size: 40, Window: time.Second, Fleet: true}
			c.Pools[config.PoolFlights] = config.Pool{Size: 20, Floor: 4, Window: time.Second, Fleet: true}
			c.Pools["db"] = config.Pool{Size: 12, Window: time.Second, Fleet: true}
			c.Fleet.Etcd, c.Fleet.Node, c.Fleet.SafeFraction = []string{etcd}, "a", tc.fraction
		})
		st := status(t, d)
		for name, want := range tc.want {
			p := poolOf(t, st, name)
			if p.Size != want || p.Fleet == nil || p.Fleet.Safe != want {
				t.Errorf("safe_fraction %v: pool %s is %d before its Member ran (fleet view %+v), want its safe slice %d, not the fleet's size",
					tc.fraction, name, p.Size, p.Fleet, want)
			}
		}
		// What the front would admit of a backlog: no more than the slice.
		n := 0
		for range 40 {
			if _, err := d.requests.TryAcquire("p"); err == nil {
				n++
			}
		}
		if want := tc.want[config.PoolRequests]; n != want {
			t.Errorf("safe_fraction %v: one project got %d of the requests pool before its Member ran, want the safe slice %d",
				tc.fraction, n, want)
		}
	}
}

// TestFleetMemberConfig: every fleet key reaches the pool's Member (the
// period and lease as written: 0 is the Member's default), and the
// configuration's defaults for 0 are the Member's.
func TestFleetMemberConfig(t *testing.T) {
	c := config.Default()
	if err := config.Parse(strings.NewReader("fleet: {etcd: [http://127.0.0.1:2379], prefix: /fs, safe_fraction: 0.25, lease_ttl: 8s, period: 2s}\n"+
		"pools: {db: {size: 12, floor: 2, fleet: true}}\n"), &c); err != nil {
		t.Fatal(err)
	}
	got := memberConfig(c.Fleet, "db", c.Pools["db"], "n1", 7*time.Minute)
	if got.Prefix != "/fs" || got.Pool != "db" || got.Node != "n1" || got.Size != 12 || got.Floor != 2 ||
		got.SafeFraction != 0.25 || got.LeaseTTL != 8*time.Second || got.Period != 2*time.Second || got.DepartedTTL != 0 {
		t.Fatalf("member config %+v", got)
	}
	// A kernel pool's departed holdings count for connections.lapse_after
	// (its kernel enforces that long without a daemon); 0 is the fleet's
	// bounded default.
	if got := memberConfig(c.Fleet, config.PoolConnections, c.Pools["db"], "n1", 7*time.Minute); got.DepartedTTL != 7*time.Minute {
		t.Errorf("connections pool: departed TTL %v, want lapse_after's 7m", got.DepartedTTL)
	}
	if got := memberConfig(c.Fleet, config.PoolConnections, c.Pools["db"], "n1", 0); got.DepartedTTL != 0 || fleet.DefaultDepartedTTL != time.Hour {
		t.Errorf("lapse_after 0: departed TTL %v (the fleet's default %v), want 0 (an hour)", got.DepartedTTL, fleet.DefaultDepartedTTL)
	}
	if config.DefaultFleetPeriod != fleet.DefaultPeriod || config.DefaultFleetLeaseTTL != fleet.DefaultLeaseTTL {
		t.Errorf("defaults for 0: configuration period %v lease %v, the fleet's %v and %v",
			config.DefaultFleetPeriod, config.DefaultFleetLeaseTTL, fleet.DefaultPeriod, fleet.DefaultLeaseTTL)
	}
}
