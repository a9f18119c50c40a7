// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"maps"
	"slices"

	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/front"
	"github.com/fairshare-dev/fairshare/permitd"
	"github.com/fairshare-dev/fairshare/pools"
	"github.com/fairshare-dev/fairshare/scheduler"
)

// Effective returns cfg (already validated) with every default resolved as
// the daemon resolves it: the projects root, each pool's floor and window,
// both exempt budgets, the listeners' caps from the open-files limit, the
// permit API's bounds and the scheduler's poll. The daemon runs on what it
// returns; 'run --print-config' prints it. notes say what could not be
// resolved here (no cgroup2 mount, say) and what stays as configured.
func Effective(cfg config.Config) (_ config.Config, notes []string) {
	cfg.Pools = maps.Clone(cfg.Pools)
	cfg.Front.TrustedPeers = slices.Clone(cfg.Front.TrustedPeers)
	if root, err := ProjectsRoot(cfg); err == nil {
		cfg.ProjectsRoot = root
	} else {
		notes = append(notes, "projects_root: "+err.Error())
	}
	for name, p := range cfg.Pools {
		p.Floor = pools.EffectiveFloor(p.Size, p.Floor)
		if p.Window == 0 {
			p.Window = pools.DefaultWindow
		}
		cfg.Pools[name] = p
	}
	if cfg.Connections.ExemptMax == 0 {
		cfg.Connections.ExemptMax = cfg.Pools[config.PoolConnections].Floor
	}
	if cfg.Front.ExemptMax == 0 {
		cfg.Front.ExemptMax = front.DefaultExemptMax
	}
	if cfg.Scheduler.Poll == 0 {
		cfg.Scheduler.Poll = scheduler.DefaultPoll
	}
	if cfg.Permits.MaxWaiting == 0 {
		cfg.Permits.MaxWaiting = permitd.DefaultMaxWaiting
	}
	if cfg.Permits.MaxWaitingPerSession == 0 {
		cfg.Permits.MaxWaitingPerSession = permitd.DefaultMaxWaitingPerSession
	}
	if cfg.Permits.MaxWaitingPerUID == 0 {
		cfg.Permits.MaxWaitingPerUID = permitd.DefaultMaxWaitingPerUID
	}
	if nofile, err := hardFileLimit(); err == nil {
		caps := BudgetCaps(cfg, nofile)
		cfg.Listeners.MaxConns, cfg.Listeners.MaxConnsPerPeer = caps.PerListener, caps.PerPeer
	} else {
		notes = append(notes, "listeners: "+err.Error())
	}
	return cfg, notes
}
