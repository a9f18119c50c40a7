// SPDX-License-Identifier: Apache-2.0

package config

import (
	"errors"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestFleetKeys(t *testing.T) {
	c := Default()
	good := "fleet: {etcd: [http://127.0.0.1:2379, https://etcd-1:2379], node: n1, prefix: /fs, safe_fraction: 0.25, lease_ttl: 4s}\n" +
		"pools: {db: {size: 12, fleet: true}, requests: {size: 10, fleet: true}}\n"
	if err := Parse(strings.NewReader(good), &c); err != nil {
		t.Fatal(err)
	}
	if got := c.FleetPools(); strings.Join(got, ",") != "requests,db" && strings.Join(got, ",") != "db,requests" {
		t.Fatalf("fleet pools %v", got)
	}
	if c.Fleet.Prefix != "/fs" || c.Fleet.SafeFraction != 0.25 || c.Fleet.Period != 0 {
		t.Fatalf("fleet %+v", c.Fleet)
	}
	// A destination pool may be a fleet pool (issue 35's headline case).
	dc := Default()
	if err := Parse(strings.NewReader("fleet: {etcd: [http://127.0.0.1:2379]}\npools: {db: {size: 1000, destinations: [10.0.0.5/32:5432], fleet: true}}\n"), &dc); err != nil {
		t.Fatalf("a fleet destination pool: %v", err)
	}
	if got := dc.FleetPools(); len(got) != 1 || got[0] != "db" || !dc.Pools["db"].IsDestination() {
		t.Fatalf("fleet pools %v", got)
	}
	for _, ok := range []string{"fleet: {period: 1s}", "fleet: {lease_ttl: 4s}", "fleet: {lease_ttl: 4s, period: 1s}", "fleet: {lease_ttl: 8s, period: 2s}", "fleet: {lease_ttl: 1h, period: 15m}"} {
		c := Default()
		if err := Parse(strings.NewReader(ok), &c); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
	if d := Default(); d.Fleet.Prefix != "/fairshare" || len(d.FleetPools()) != 0 {
		t.Fatalf("defaults: %+v", d.Fleet)
	}
	missing := filepath.Join(t.TempDir(), "nope.pem")
	for _, tt := range []struct{ in, want string }{
		{"pools: {db: {size: 12, fleet: true}}", "fleet.etcd lists no endpoint"},
		{"fleet: {etcd: [http://e:2379]}\npools: {residents: {size: 12, fleet: true}}", "pools.residents.fleet"},
		// Not supported says so before the missing etcd does.
		{"pools: {residents: {size: 12, fleet: true}}", "pools.residents.fleet: true is not supported"},
		{"bpf: false\nfleet: {etcd: [http://e:2379]}\npools: {connections: {size: 12, fleet: true}}", "needs bpf: true"},
		{"bpf: false\nfleet: {etcd: [http://e:2379]}\npools: {db: {size: 12, destinations: [10.0.0.5/32:5432], fleet: true}}", "pools.db.fleet: true needs bpf: true"},
		{"fleet: {etcd: [etcd-0:2379]}", "fleet.etcd[0]"},
		{"fleet: {etcd: [ftp://e:2379]}", "fleet.etcd[0]"},
		{"fleet: {node: a/b}", "fleet.node"},
		{"fleet: {prefix: fs}", "fleet.prefix"},
		{"fleet: {prefix: /fs/}", "fleet.prefix"},
		{"fleet: {safe_fraction: 1.5}", "fleet.safe_fraction"},
		{"fleet: {safe_fraction: -0.1}", "fleet.safe_fraction"},
		{"fleet: {lease_ttl: 1s}", "fleet.lease_ttl"},
		// Under four periods of 1s, the default period among them, no
		// period fits the lease.
		{"fleet: {lease_ttl: 2s}", "fleet.lease_ttl must be 0 (5s) or between 4s (four periods of 1s) and 1h0m0s, got 2s"},
		{"fleet: {lease_ttl: 3999ms}", "fleet.lease_ttl"},
		{"fleet: {period: 500ms}", "fleet.period"},
		{"fleet: {period: 2s}", "a quarter of fleet.lease_ttl (1.25s at lease_ttl 5s)"},
		{"fleet: {lease_ttl: 7s, period: 2s}", "a quarter of fleet.lease_ttl (1.75s at lease_ttl 7s)"},
		{"fleet: {tls: {cert: /x}}", "fleet.tls.cert and fleet.tls.key"},
		{"fleet: {tls: {ca: " + missing + "}}", "fleet.tls.ca"},
		{"fleet: {etcdd: []}", "etcdd"},
	} {
		c := Default()
		err := Parse(strings.NewReader(tt.in), &c)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%q: %v, want ErrInvalid naming %q", tt.in, err, tt.want)
		}
	}
}

// TestLapsingFleetPools: the fleet pools the kernel enforces lapse with the
// rest when connections.lapse_after is not 0 (the daemon warns of them);
// with lapse_after 0, without bpf or for a pool of user space, none do.
func TestLapsingFleetPools(t *testing.T) {
	const fleet = "fleet: {etcd: [http://127.0.0.1:2379]}\n"
	const all = "pools: {db: {size: 1000, destinations: [10.0.0.5/32:5432], fleet: true}, requests: {size: 10, fleet: true}, connections: {size: 100, fleet: true}}\n"
	for _, tc := range []struct {
		conf, want string
	}{
		{fleet + all, "connections,db"},
		{fleet + all + "connections: {lapse_after: 0s}\n", ""},
		{fleet + "bpf: false\npools: {requests: {size: 10, fleet: true}}\n", ""},
		{fleet + "pools: {requests: {size: 10, fleet: true}}\n", ""},
	} {
		c := Default()
		if err := Parse(strings.NewReader(tc.conf), &c); err != nil {
			t.Fatalf("%q: %v", tc.conf, err)
		}
		got := c.LapsingFleetPools()
		slices.Sort(got)
		if strings.Join(got, ",") != tc.want {
			t.Errorf("%q: lapsing %v, want %q", tc.conf, got, tc.want)
		}
	}
}
