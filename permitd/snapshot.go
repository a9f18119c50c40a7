// SPDX-License-Identifier: Apache-2.0

package permitd

import (
	"sort"
	"time"

	"github.com/fairshare-dev/fairshare/pools"
)

// Snapshot is the permit API's state for `fairshare status` and /metrics.
type Snapshot struct {
	Socket    string
	Sessions  []SessionStat  // open sessions, by id
	Pools     []PoolStat     // served pools (flights and others), by name
	Residents *ResidentsStat // nil when no residents pool is served
	Counters  Counters
}

// SessionStat describes one open connection.
type SessionStat struct {
	ID       uint64
	Peer     Cred
	Opened   time.Time
	Requests uint64
	Leases   int // leases held, resident leases included
	Objects  int // objects owned, resident or sleeping
}

// PoolStat is one served pool: the leases held through this API per project,
// beside the pool's own view (which also counts permits taken in-process).
type PoolStat struct {
	Name   string
	Leases map[string]int // project -> leases held
	Pool   pools.Snapshot
}

// ResidentsStat is the residents pool as seen through this API.
type ResidentsStat struct {
	Resident  map[string]int // project -> resident objects owned by sessions
	Sleeping  map[string]int // project -> sleeping objects owned by sessions
	Spawning  int            // spawns in progress (waiting for room or a confirmation)
	Evicting  int            // objects asked to sleep, not yet confirmed by their owner
	EvictSent map[string]uint64
	// Dropped counts, per project, the objects put to sleep without
	// their owner, which left MaxUnconfirmed evictions in a row
	// unconfirmed.
	Dropped map[string]uint64
	Pool    pools.ResidentsSnapshot // the pool's own counts, evictions by reason
}

// Counters are totals since the server started.
type Counters struct {
	Sessions uint64            // sessions opened
	Errors   map[string]uint64 // answers by error code (REFUSED, BAD_REQUEST, ...)
}

// Flights returns the stat of the pool named "flights", if served.
func (s Snapshot) Flights() *PoolStat { return s.Pool("flights") }

// Pool returns the stat of the named pool, or nil.
func (s Snapshot) Pool(name string) *PoolStat {
	for i := range s.Pools {
		if s.Pools[i].Name == name {
			return &s.Pools[i]
		}
	}
	return nil
}

// Snapshot reports sessions, leases per pool and project, residents and
// counters. It is consistent per session, not across the whole server.
func (s *Server) Snapshot() Snapshot {
	s.mu.Lock()
	snap := Snapshot{Socket: s.cfg.Socket, Counters: Counters{Sessions: s.counters.Sessions, Errors: map[string]uint64{}}}
	for k, v := range s.byCode {
		snap.Counters.Errors[k] = v
	}
	sessions := make([]*session, 0, len(s.sessions))
	for _, ss := range s.sessions {
		sessions = append(sessions, ss)
	}
	objs := map[*session]int{}
	var rs *ResidentsStat
	if s.residents != nil {
		rs = &ResidentsStat{Resident: map[string]int{}, Sleeping: map[string]int{}, EvictSent: map[string]uint64{},
			Dropped: map[string]uint64{}}
		for _, o := range s.objects {
			objs[o.owner]++
			switch {
			case o.spawning:
				rs.Spawning++
			case o.evicting:
				rs.Evicting++
			case o.resident:
				rs.Resident[o.project]++
			default:
				rs.Sleeping[o.project]++
			}
		}
		for k, v := range s.evictions {
			rs.EvictSent[k] = v
		}
		for k, v := range s.dropped {
			rs.Dropped[k] = v
		}
	}
	s.mu.Unlock()

	sort.Slice(sessions, func(i, j int) bool { return sessions[i].id < sessions[j].id })
	byPool := map[*pools.Pool]map[string]int{}
	for _, ss := range sessions {
		ss.mu.Lock()
		st := SessionStat{ID: ss.id, Peer: ss.cred, Opened: ss.opened, Requests: ss.requests.Load(), Leases: len(ss.leases), Objects: objs[ss]}
		for _, l := range ss.leases {
			if l.pool == nil {
				continue
			}
			m := byPool[l.pool]
			if m == nil {
				m = map[string]int{}
				byPool[l.pool] = m
			}
			m[l.project]++
		}
		ss.mu.Unlock()
		snap.Sessions = append(snap.Sessions, st)
	}
	for _, name := range sortedKeys(s.pools) {
		p := s.pools[name]
		leases := byPool[p]
		if leases == nil {
			leases = map[string]int{}
		}
		snap.Pools = append(snap.Pools, PoolStat{Name: name, Leases: leases, Pool: p.Snapshot()})
	}
	if rs != nil {
		rs.Pool = s.residents.Snapshot()
		snap.Residents = rs
	}
	return snap
}
