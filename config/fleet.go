// SPDX-License-Identifier: Apache-2.0

package config

import (
	"fmt"
	"net/url"
	"os"
	"strings"
	"time"
)

// Fleet configures fleet pools (package fleet): pools whose size is shared
// by every node of one prefix, divided through etcd.
type Fleet struct {
	// Etcd lists the etcd client URLs (http:// or https://).
	Etcd []string `yaml:"etcd"`
	// Node names this node in the fleet; "" is the host name.
	Node string `yaml:"node"`
	// Prefix is the etcd key prefix: one fleet per prefix.
	Prefix string `yaml:"prefix"`
	// SafeFraction is the part of a fleet pool's size a node cut off from
	// etcd decays to; 0 is one over the number of nodes it last saw.
	SafeFraction float64 `yaml:"safe_fraction"`
	// LeaseTTL is how long a silent node stays in the others' computation,
	// how long a node without an answer from etcd waits before it counts
	// itself cut off, and how long after its last renewal a lease ends,
	// when the kernel's fleet pools fall to their safe slices unless it
	// was renewed; 0 is 5s. Set, 4s (four of the shortest period: see
	// Period) to 1h.
	LeaseTTL time.Duration `yaml:"lease_ttl"`
	// Period is how often a node publishes what its projects hold and
	// recomputes its allotment; 0 is 1s. Set, at least 1s (a project's
	// refusals count in its want for one period: a shorter one would
	// keep a project that retries less often from ever growing) and at
	// most a quarter of lease_ttl (the lease is renewed on the first tick
	// past a third of it, and a failed renewal is tried again at the next
	// tick, before it expires).
	Period time.Duration `yaml:"period"`
	// TLS configures the etcd client's TLS, as etcdctl's --cacert, --cert
	// and --key.
	TLS FleetTLS `yaml:"tls"`
}

// FleetTLS is the etcd client's TLS: CA bundle, client certificate and key
// (PEM files).
type FleetTLS struct {
	CA   string `yaml:"ca"`
	Cert string `yaml:"cert"`
	Key  string `yaml:"key"`
}

// Bounds of fleet.lease_ttl and fleet.period, and their values for 0. The
// shortest lease holds four of the shortest period, which is the default
// one: a period of 0 fits every lease_ttl allowed.
const (
	MinFleetLeaseTTL     = 4 * MinFleetPeriod
	MaxFleetLeaseTTL     = time.Hour
	DefaultFleetLeaseTTL = 5 * time.Second
	MinFleetPeriod       = time.Second
	DefaultFleetPeriod   = time.Second
)

// FleetPools lists the pools marked fleet: true, in PoolNames' order.
func (c *Config) FleetPools() []string {
	var out []string
	for _, n := range c.PoolNames() {
		if c.Pools[n].Fleet {
			out = append(out, n)
		}
	}
	return out
}

// LapsingFleetPools are the fleet pools the kernel enforces (connections,
// destination pools) when enforcement lapses without a daemon
// (connections.lapse_after not 0): past it the node admits everything in
// them, whatever the fleet's size. The daemon warns of them at start.
func (c *Config) LapsingFleetPools() []string {
	if !c.BPF || c.Connections.LapseAfter == 0 {
		return nil
	}
	var out []string
	for _, n := range c.FleetPools() {
		if n == PoolConnections || c.Pools[n].IsDestination() {
			out = append(out, n)
		}
	}
	return out
}

// checkFleet checks the fleet keys and the pools marked fleet, each error
// naming its key.
func (c *Config) checkFleet() error {
	f := c.Fleet
	pools := c.FleetPools()
	// The pools first, so that one that cannot be a fleet pool says so
	// whether fleet.etcd is set or not.
	for _, n := range pools {
		switch n {
		case PoolResidents:
			return fmt.Errorf("pools.residents.fleet: true is not supported: a full residents pool evicts rather than refuses, which a fleet allotment cannot move")
		case PoolConnections:
			if !c.BPF {
				return fmt.Errorf("pools.connections.fleet: true needs bpf: true (without the kernel side the pool is not enforced)")
			}
		default:
			// A destination pool is the kernel's too: its allotment is
			// the loader's size of it (daemon/fleet.go).
			if c.Pools[n].IsDestination() && !c.BPF {
				return fmt.Errorf("pools.%s.fleet: true needs bpf: true (a destination pool is enforced by the kernel side only)", n)
			}
		}
	}
	if len(pools) > 0 && len(f.Etcd) == 0 {
		return fmt.Errorf("pools.%s.fleet is true but fleet.etcd lists no endpoint", pools[0])
	}
	for i, e := range f.Etcd {
		u, err := url.Parse(e)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || (u.Path != "" && u.Path != "/") {
			return fmt.Errorf("fleet.etcd[%d]: want an http:// or https:// URL of an etcd client endpoint (https://etcd-0:2379), got %q", i, e)
		}
	}
	if strings.Contains(f.Node, "/") || strings.TrimSpace(f.Node) != f.Node {
		return fmt.Errorf("fleet.node must not contain '/' or spaces at its ends, got %q", f.Node)
	}
	if !strings.HasPrefix(f.Prefix, "/") || strings.HasSuffix(f.Prefix, "/") && f.Prefix != "/" {
		return fmt.Errorf("fleet.prefix must start with '/' and not end with one (/fairshare), got %q", f.Prefix)
	}
	if !(f.SafeFraction >= 0 && f.SafeFraction <= 1) {
		return fmt.Errorf("fleet.safe_fraction must be in [0, 1] (0: one over the nodes last seen), got %v", f.SafeFraction)
	}
	if t := f.LeaseTTL; t != 0 && (t < MinFleetLeaseTTL || t > MaxFleetLeaseTTL) {
		return fmt.Errorf("fleet.lease_ttl must be 0 (5s) or between %v (four periods of %v) and %v, got %v",
			MinFleetLeaseTTL, MinFleetPeriod, MaxFleetLeaseTTL, t)
	}
	ttl := f.LeaseTTL
	if ttl == 0 {
		ttl = DefaultFleetLeaseTTL
	}
	if p := f.Period; p != 0 && (p < MinFleetPeriod || p > ttl/4) {
		return fmt.Errorf("fleet.period must be 0 (1s) or between %v and a quarter of fleet.lease_ttl (%v at lease_ttl %v), got %v",
			MinFleetPeriod, ttl/4, ttl, p)
	}
	if (f.TLS.Cert == "") != (f.TLS.Key == "") {
		return fmt.Errorf("fleet.tls.cert and fleet.tls.key go together, got cert %q key %q", f.TLS.Cert, f.TLS.Key)
	}
	for key, p := range map[string]string{"ca": f.TLS.CA, "cert": f.TLS.Cert, "key": f.TLS.Key} {
		if p == "" {
			continue
		}
		if _, err := os.Stat(p); err != nil {
			return fmt.Errorf("fleet.tls.%s: %w", key, err)
		}
	}
	return nil
}
