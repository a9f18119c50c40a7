// SPDX-License-Identifier: Apache-2.0

package metrics

import (
	"strings"
	"testing"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// A fleet pool's view is exported beside the pool's own numbers (pool_size
// is the node's allotment, fleet_size the fleet's), its projects under the
// pool's labels, and lints clean.
func TestFleetMetrics(t *testing.T) {
	pool := admin.Pool{Name: "db", Enforcer: "daemon", Size: 6, InUse: 2, Projects: []admin.Project{{Project: "alpha", Held: 2, Active: true}},
		Fleet: &admin.Fleet{Node: "a", State: "connected", Size: 12, Active: 2, Share: 6, Allotment: 6, Safe: 4, Nodes: 3, Writes: 7,
			Projects: []admin.FleetProject{{Project: "alpha", Alloc: 6, FleetHeld: 5, Nodes: 2, Cap: 3, Held: 2}, {Project: "beta", Alloc: 6, FleetHeld: 6, Nodes: 1, Cap: -1}}}}
	c := New(fixed(admin.Status{Pools: []admin.Pool{pool}}), 2, nil)
	want := `
# HELP fairshare_fleet_allotment This node's allotment of the fleet pool (its local POOL; decaying to the safe slice when cut off).
# TYPE fairshare_fleet_allotment gauge
fairshare_fleet_allotment{pool="db"} 6
# HELP fairshare_fleet_connected 1 while the node's allotment follows the fleet through etcd, 0 while waiting for etcd or cut off from it.
# TYPE fairshare_fleet_connected gauge
fairshare_fleet_connected{pool="db"} 1
# HELP fairshare_fleet_project_allocation The project's allocation of the fleet pool: what it may hold fleet-wide.
# TYPE fairshare_fleet_project_allocation gauge
fairshare_fleet_project_allocation{pool="db",project="alpha"} 6
fairshare_fleet_project_allocation{pool="db",project="(other)"} 6
# HELP fairshare_fleet_project_held What the project holds on the whole fleet, as the nodes published it.
# TYPE fairshare_fleet_project_held gauge
fairshare_fleet_project_held{pool="db",project="alpha"} 5
fairshare_fleet_project_held{pool="db",project="(other)"} 6
# HELP fairshare_fleet_size A fleet pool's size: the fleet's total, which pool_size's allotment is this node's part of.
# TYPE fairshare_fleet_size gauge
fairshare_fleet_size{pool="db"} 12
# HELP fairshare_fleet_writes_total This node's publications of the pool's demand to etcd.
# TYPE fairshare_fleet_writes_total counter
fairshare_fleet_writes_total{pool="db"} 7
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), "fairshare_fleet_allotment", "fairshare_fleet_connected",
		"fairshare_fleet_project_allocation", "fairshare_fleet_project_held", "fairshare_fleet_size", "fairshare_fleet_writes_total"); err != nil {
		t.Error(err)
	}
	lint(t, c)
}
