// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"strings"
	"syscall"
	"testing"
)

// TestReloadKindChangeKeepsPools: a SIGHUP whose file changes a pool's
// kind (a destination pool without its destinations, a user-space pool
// given some) needs a restart, and says so: the destination pool goes on
// limiting its destination (dropped from the kernel's pools, its limit was
// gone while the log said nothing was applied), and the user-space pool is
// not made a second pool of its name (status listed it twice, and every
// scrape of /metrics failed on the repeated series).
func TestReloadKindChangeKeepsPools(t *testing.T) {
	db, other := netip.MustParseAddrPort(sink(t)), netip.MustParseAddrPort(sink(t))
	n := newNode(t, fmt.Sprintf("pools:\n  connections: {size: 100}\n  db: {size: 3, floor: 1, destinations: [\"127.0.0.1/32:%d\"]}\n  jobs: {size: 8}\n",
		db.Port()))
	n.start()
	a := n.connectFrom("alpha", db.String(), 3)
	defer a.close()
	if a.connected != 3 {
		t.Fatalf("alpha to db: %+v", a)
	}
	n.rewrite(fmt.Sprintf("pools:\n  connections: {size: 100}\n  db: {size: 3, floor: 1}\n  jobs: {size: 8, destinations: [\"127.0.0.1/32:%d\"]}\n",
		other.Port()))
	if err := n.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() error {
		l := n.log.String()
		if !strings.Contains(l, "making a destination pool a pool of another kind needs a restart") ||
			!strings.Contains(l, "making a pool a destination pool needs a restart") {
			return fmt.Errorf("no warnings of the kind changes in the log:\n%s", l)
		}
		return nil
	})
	st := n.status()
	jobs := 0
	for _, p := range st.Pools {
		if p.Name == "jobs" {
			jobs++
		}
	}
	if dbp := pool(st, "db"); jobs != 1 || dbp.Enforcer != "kernel" || len(dbp.Destinations) != 1 || dbp.InUse != 3 {
		t.Fatalf("after the reload: %d pools named jobs, db %+v; want one, and db limiting its destination", jobs, dbp)
	}
	if a2 := n.connectFrom("beta", db.String(), 1); a2.refused != 1 {
		a2.close()
		t.Fatalf("beta to db, full: %+v, want refused", a2)
	} else {
		a2.close()
	}
	resp, err := http.Get("http://" + n.r.Metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/metrics after the reload: %d %s", resp.StatusCode, body)
	}
}
