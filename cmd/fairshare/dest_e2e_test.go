// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/fairshare-dev/fairshare/events"
	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// TestDestinationPoolThroughDaemon: a destination pool of the configuration
// is enforced by the daemon's kernel side (refusal with ECONNREFUSED, an
// event naming the pool, status and metrics), and SIGHUP with an edited file
// resizes it, adds one and removes one without losing counts; an
// overlapping file is refused at start with status 78 and on SIGHUP with the
// pools in force kept.
func TestDestinationPoolThroughDaemon(t *testing.T) {
	db, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	testutil.Sink(t, db)
	other, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	testutil.Sink(t, other)
	port := db.Addr().(*net.TCPAddr).Port
	pools := func(dbSize int, extra string) string {
		return fmt.Sprintf("pools:\n  connections: {size: 100}\n  db: {size: %d, floor: 1, destinations: [\"127.0.0.1/32:%d\"]}\n%s", dbSize, port, extra)
	}
	n := newNode(t, pools(3, ""))
	n.start()

	a := n.connectFrom("alpha", db.Addr().String(), 5)
	defer a.close()
	if a.connected != 3 || a.refused != 2 {
		t.Fatalf("alpha to db: %d connected, %d refused; want 3 and 2", a.connected, a.refused)
	}
	b := n.connectFrom("beta", other.Addr().String(), 4)
	defer b.close()
	if b.connected != 4 {
		t.Fatalf("beta to another port: %+v", b)
	}
	st := n.status()
	dbp := pool(st, "db")
	if dbp.Enforcer != "kernel" || dbp.Size != 3 || dbp.InUse != 3 || project(dbp, "alpha").Held != 3 ||
		len(dbp.Destinations) != 1 || pool(st, "connections").InUse != 7 {
		t.Fatalf("status: db %+v, connections %+v", dbp, pool(st, "connections"))
	}
	if err := dbp.Consistent(); err != nil {
		t.Fatal(err)
	}
	if m := n.metrics(); !strings.Contains(m, `fairshare_pool_in_use{pool="db"} 3`) {
		t.Errorf("metrics have no db pool in use 3:\n%s", grepLines(m, "pool=\"db\""))
	}
	eventually(t, func() error {
		for _, e := range n.events("--pool", "db") {
			if e.Source == events.SourceKernel && e.Kind == events.KindRefused && e.Project == "alpha" && e.PoolSize == 3 &&
				e.Remote == db.Addr().String() {
				return nil
			}
		}
		return fmt.Errorf("no refusal event of pool db: %+v", n.events())
	})

	// SIGHUP: db resized to 5 (its 3 kept), cache added on the other port.
	cache := fmt.Sprintf("  cache: {size: 4, destinations: [\"127.0.0.1/32:%d\"]}\n", other.Addr().(*net.TCPAddr).Port)
	n.rewrite(pools(5, cache))
	if err := n.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() error {
		st := n.status()
		for _, p := range st.Pools {
			if p.Name == "cache" && pool(st, "db").Size == 5 && pool(st, "db").InUse == 3 {
				return nil
			}
		}
		return fmt.Errorf("after SIGHUP: %+v", st.Pools)
	})
	a2 := n.connectFrom("alpha", db.Addr().String(), 3)
	defer a2.close()
	if a2.connected != 2 || a2.refused != 1 {
		t.Fatalf("alpha after the resize: %+v", a2)
	}
	// An overlapping file is refused; the pools in force stay.
	n.rewrite(pools(5, fmt.Sprintf("  dup: {size: 4, destinations: [\"[::ffff:127.0.0.1]/128:%d\"]}\n", port)))
	if _, stderr, code := n.cli("run", "--print-config"); code != 78 || !strings.Contains(stderr, "pools.db and pools.dup overlap") {
		t.Errorf("print-config of an overlapping file: status %d, %s", code, stderr)
	}
	n.cmd.Process.Signal(syscall.SIGHUP)
	eventually(t, func() error {
		if !strings.Contains(n.log.String(), "pools.db and pools.dup overlap") {
			return fmt.Errorf("no refusal of the overlapping file in the log:\n%s", n.log)
		}
		return nil
	})
	// db removed while alpha holds 5 of it: it stays, removed, until they close.
	n.rewrite("pools:\n  connections: {size: 100}\n" + cache)
	n.cmd.Process.Signal(syscall.SIGHUP)
	eventually(t, func() error {
		if p := pool(n.status(), "db"); !p.Removed || p.InUse != 5 {
			return fmt.Errorf("db after removal: %+v", p)
		}
		return nil
	})
	a.close()
	a2.close()
	eventually(t, func() error {
		for _, p := range n.status().Pools {
			if p.Name == "db" {
				return fmt.Errorf("db still listed: %+v", p)
			}
		}
		return nil
	})
}

// rewrite replaces the pools part of the node's configuration file.
func (n *node) rewrite(poolYAML string) {
	n.t.Helper()
	raw, err := os.ReadFile(n.cfg)
	if err != nil {
		n.t.Fatal(err)
	}
	s := string(raw)
	if i := strings.Index(s, "pools:"); i >= 0 {
		s = s[:i]
	}
	if err := os.WriteFile(n.cfg, []byte(s+poolYAML), 0o600); err != nil {
		n.t.Fatal(err)
	}
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// A daemon started without destination pools makes their kernel tables for
// none: a pool added by SIGHUP is refused with the reason in the log and
// nothing changes; a restart with it grows the tables on the same pins,
// keeping the node's counts, and enforces the pool.
func TestDestinationPoolAddedToNodeStartedWithout(t *testing.T) {
	db, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	testutil.Sink(t, db)
	withDB := fmt.Sprintf("pools:\n  connections: {size: 100}\n  db: {size: 2, floor: 1, destinations: [\"127.0.0.1/32:%d\"]}\n",
		db.Addr().(*net.TCPAddr).Port)
	n := newNode(t, "pools:\n  connections: {size: 100}\n")
	n.start()
	a := n.connectFrom("alpha", db.Addr().String(), 3)
	defer a.close()
	if a.connected != 3 {
		t.Fatalf("alpha without a destination pool: %+v", a)
	}
	n.rewrite(withDB)
	n.cmd.Process.Signal(syscall.SIGHUP)
	eventually(t, func() error {
		if !strings.Contains(n.log.String(), "restart with the pool in the configuration") {
			return fmt.Errorf("no refusal of the added pool in the log:\n%s", n.log)
		}
		return nil
	})
	for _, p := range n.status().Pools {
		if p.Name == "db" {
			t.Fatalf("a refused pool is listed: %+v", p)
		}
	}
	if err := n.stop(syscall.SIGTERM); err != nil {
		t.Fatalf("SIGTERM: %v\n%s", err, n.log)
	}
	n.start()
	if c := pool(n.status(), "connections"); c.InUse != 3 {
		t.Fatalf("the node's count after the restart: %+v", c)
	}
	b := n.connectFrom("alpha", db.Addr().String(), 3)
	defer b.close()
	if b.connected != 2 || b.refused != 1 {
		t.Fatalf("alpha to db after the restart: %+v", b)
	}
	if p := pool(n.status(), "db"); p.InUse != 2 {
		t.Fatalf("db after the restart: %+v", p)
	}
}
