// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"fmt"
	"maps"
	"slices"

	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/front"
	"github.com/fairshare-dev/fairshare/internal/peercred"
	"github.com/fairshare-dev/fairshare/permitd"
	"github.com/fairshare-dev/fairshare/pools"
	"github.com/fairshare-dev/fairshare/scheduler"
)

// Effective returns cfg (already validated) with every default resolved as
// the daemon resolves it: the projects root, each pool's floor and window,
// both exempt budgets, the permit API's bounds and the scheduler's poll.
// The daemon runs on what it returns; 'run --print-config' prints it. notes
// say what could not be resolved here (no cgroup2 mount, say) and what
// stays as configured: the listeners' caps, which the daemon derives from
// its own open-files limit when it starts (the unit's LimitNOFILE, not the
// limit of the shell running --print-config), are left at 0 with a note of
// what this process's limit would give.
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
	cfg.Front.ExemptMax = front.ExemptMaxFor(cfg.Front.MaxInFlight, cfg.Front.ExemptMax)
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
	if cfg.Listeners.SubUID == "" {
		cfg.Listeners.SubUID = peercred.DefaultSubUIDFile
	}
	if cfg.Listeners.MaxConns == 0 || cfg.Listeners.MaxConnsPerPeer == 0 {
		if nofile, err := hardFileLimit(); err == nil {
			caps := BudgetCaps(cfg, nofile)
			notes = append(notes, fmt.Sprintf("listeners: 0 is derived when the daemon starts, from its open-files limit "+
				"(the unit's LimitNOFILE) and a budget of %d connections a listener; with this process's hard limit (%d) "+
				"it would be max_conns %d, max_conns_per_peer %d", connMemory/connCost, nofile, caps.PerListener, caps.PerPeer))
		} else {
			notes = append(notes, "listeners: "+err.Error())
		}
	}
	return cfg, notes
}

// CheckHost checks what the configuration names on this host, as the
// daemon does when it builds its parts: the permit group exists, the
// projects root suits its source, and the front's cgroups are below the
// cgroup2 mount. An error wraps
// config.ErrInvalid and names the key.
func CheckHost(cfg config.Config) error {
	if cfg.Permits.Socket != "" && cfg.Permits.Group != "" {
		if _, err := permitd.LookupGroup(cfg.Permits.Group); err != nil {
			return fmt.Errorf("%w: permits.group: %w", config.ErrInvalid, err)
		}
	}
	if err := checkProjects(cfg); err != nil {
		return err
	}
	if cfg.Front.Enabled() {
		root, _ := ProjectsRoot(cfg)
		fc := front.Config{ProjectsRoot: root, TrustedPeers: cfg.Front.TrustedPeers,
			Exempt: front.Exempt{Cgroups: cfg.Front.Exempt.Cgroups}}
		if err := front.CheckIdentity(fc); err != nil {
			return fmt.Errorf("%w: front: %w", config.ErrInvalid, err)
		}
	}
	return nil
}
