// SPDX-License-Identifier: Apache-2.0

package fleet

import (
	"context"
	"encoding/json"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// A departed node is one whose key is gone (revoked at a clean stop, or
// expired: a killed daemon, a partition) while its pool may go on holding
// what it held: the kernel's pools stay pinned and enforcing, and their
// connections open, without a daemon. Its last holdings stay counted for
// Config.DepartedTTL through a record in etcd, Prefix/Pool/departed/Node,
// under a lease of that TTL, whose value is a departedRecord:
//
//   - at a clean stop, a Member whose pool enforces without the daemon
//     (a Safer) writes its own record, with what its pool holds then,
//     before it revokes its lease;
//   - when a node's key leaves the view with no record (its lease
//     expired), every Member whose pool is a Safer counts it at once as
//     holding its last published holdings or, if more, its allotment less
//     its safe slice (goneHoldsLocked; goneNode: a local count until the
//     record is in the view) and writes the record on its behalf, in a
//     transaction that creates it only if neither the record nor the
//     node's key exists: of the nodes racing, one writes it;
//   - a node that publishes again deletes its own record (in a transaction
//     that checks its key is under its current lease): its publication
//     carries its holdings. A record of a node whose key is in the view is
//     not counted.
//
// Every Member counts the records it reads: the live nodes divide the size
// less the records' holdings, each clamped to [0, size] (ComputeDeparted).

// departedRecord is the value of a departed node's record.
type departedRecord struct {
	// Held is what the node is counted as holding.
	Held int `json:"h"`
	// At is when the record was written (Unix seconds), By by which node:
	// for people reading etcd.
	At int64  `json:"t,omitempty"`
	By string `json:"by,omitempty"`
}

// goneNode is a departure this Member saw (a node's key left its view,
// with holdings, and no record of it is in the view): its last published
// holdings count in this Member's computations until the record is in the
// view, the node is back, or DepartedTTL has passed.
type goneNode struct {
	held int
	at   time.Time // when it was seen gone
	// tried is when the record was last tried; done once etcd answered
	// the transaction (written, or found written or the node back).
	tried time.Time
	done  bool
}

// departs says whether this Member's pool goes on enforcing without the
// daemon (a Safer: the kernel's pools), so that its nodes' holdings
// outlive their keys. A user-space pool stops with its daemon and holds
// nothing after: it writes no record.
func (m *Member) departs() bool {
	_, ok := m.cfg.Target.(Safer)
	return ok
}

// heldTotal is what a publication holds, all projects together.
func (n Node) heldTotal() int {
	h := 0
	for _, d := range n.Projects {
		h += max(d.Held, 0)
	}
	return h
}

// take puts one key read or watched under the pool's prefix (del: its
// deletion) in view (a node's key) or departed (a departed node's record);
// other keys are not the Member's.
func (m *Member) take(view map[string]Node, departed map[string]int, kv *mvccpb.KeyValue, del bool) {
	key := string(kv.Key)
	switch {
	case strings.HasPrefix(key, m.dir):
		if del {
			delete(view, strings.TrimPrefix(key, m.dir))
		} else if n, ok := m.decode(kv); ok {
			view[n.Name] = n
		}
	case strings.HasPrefix(key, m.ddir):
		name := strings.TrimPrefix(key, m.ddir)
		if del {
			delete(departed, name)
			return
		}
		var r departedRecord
		if name == "" || strings.Contains(name, "/") || json.Unmarshal(kv.Value, &r) != nil {
			m.cfg.Log.Warn("fleet: ignoring a malformed departed node's record", "key", key)
			return
		}
		departed[name] = r.Held
	}
}

// departuresLocked installs the records of a new view, notes the
// departures it shows (nodes of the previous view gone from it with
// holdings and no record), and returns what the departed nodes are
// counted as holding, at most size: each record of a node not in the
// view, and each departure not recorded yet, clamped to [0, size].
func (m *Member) departuresLocked(view map[string]Node, departed map[string]int, size int) int {
	now := m.cfg.Clock.Now()
	if m.departs() {
		for name, n := range m.view {
			_, live := view[name]
			_, rec := departed[name]
			_, seen := m.gone[name]
			if name == m.cfg.Node || live || rec || seen {
				continue
			}
			if h := m.goneHoldsLocked(n, size); h > 0 {
				m.gone[name] = &goneNode{held: h, at: now}
				m.cfg.Log.Info("fleet: a node left the fleet holding permits; they stay counted, and its departure is recorded",
					"pool", m.cfg.Pool, "node", name, "held", h, "for", m.cfg.DepartedTTL)
			}
		}
	}
	for name, g := range m.gone {
		_, live := view[name]
		_, rec := departed[name]
		if live || rec || now.Sub(g.at) >= m.cfg.DepartedTTL {
			delete(m.gone, name)
		}
	}
	m.departed = departed
	total := 0
	for name, h := range departed {
		if _, live := view[name]; !live {
			total += min(max(h, 0), size)
		}
	}
	for _, g := range m.gone {
		total += min(g.held, size)
	}
	return min(total, size)
}

// goneHoldsLocked is what node n, gone from the view with no record (its
// lease expired: a kill, a partition), is counted as holding: what it last
// published it holds, or, if more, its allotment in the previous view less
// its safe slice there. A killed daemon leaves its kernel pool at its
// allotment until the lease ends (then at its safe slice), and it may
// have taken more since its last publication: counted so, it holds at most
// its safe slice past what is counted, the margin of a node cut off.
func (m *Member) goneHoldsLocked(n Node, size int) int {
	h := n.heldTotal()
	nodes := make([]Node, 0, len(m.view))
	for _, o := range m.view {
		nodes = append(nodes, o)
	}
	plan := ComputeDeparted(size, m.floor, m.plan.Departed, nodes, n.Name, false)
	return max(h, plan.Nodes[n.Name].Size-m.safeAmong(len(m.view)))
}

// ttlSeconds is DepartedTTL in whole seconds, rounded up: etcd's leases
// count seconds.
func (m *Member) ttlSeconds() int64 {
	return int64((m.cfg.DepartedTTL + time.Second - 1) / time.Second)
}

// record is the value of a record of held permits written now.
func (m *Member) record(held int) string {
	b, _ := json.Marshal(departedRecord{Held: held, At: m.cfg.Clock.Now().Unix(), By: m.cfg.Node})
	return string(b)
}

// tickDepartures, once a period with etcd answering: deletes this node's
// own record once it published under its lease, and writes the records of
// the departures it saw.
func (m *Member) tickDepartures(ctx context.Context) {
	now := m.cfg.Clock.Now()
	m.mu.Lock()
	lease := m.lease
	_, ownRec := m.departed[m.cfg.Node]
	clear := lease != 0 && m.published != nil && m.pubLease == lease && (m.departs() && m.cleared != lease || ownRec)
	type todo struct {
		name string
		held int
		g    *goneNode
	}
	var write []todo
	for name, g := range m.gone {
		if !g.done && now.Sub(g.tried) >= m.cfg.Period {
			g.tried = now
			write = append(write, todo{name, g.held, g})
		}
	}
	m.mu.Unlock()

	if clear {
		cctx, cancel := context.WithTimeout(ctx, m.callTimeout())
		_, err := m.cfg.Client.Txn(cctx).
			If(clientv3.Compare(clientv3.LeaseValue(m.key), "=", lease)).
			Then(clientv3.OpDelete(m.dkey)).Commit()
		cancel()
		if err == nil {
			m.mu.Lock()
			m.cleared = lease
			m.mu.Unlock()
		}
	}
	for _, w := range write {
		err := m.writeRecordFor(ctx, w.name, w.held)
		if err != nil {
			m.cfg.Log.Warn("fleet: writing a departed node's record failed; trying again every period", "pool", m.cfg.Pool,
				"node", w.name, "err", err)
			continue
		}
		m.mu.Lock()
		w.g.done = true
		m.mu.Unlock()
	}
}

// writeRecordFor writes the record of node name, gone holding held, under
// a lease of its own, unless it has one already or its key is back: of the
// nodes that saw it gone, one writes it.
func (m *Member) writeRecordFor(ctx context.Context, name string, held int) error {
	cctx, cancel := context.WithTimeout(ctx, m.callTimeout())
	defer cancel()
	g, err := m.cfg.Client.Grant(cctx, m.ttlSeconds())
	if err != nil {
		return err
	}
	dkey := m.ddir + name
	r, err := m.cfg.Client.Txn(cctx).
		If(clientv3.Compare(clientv3.CreateRevision(dkey), "=", 0), clientv3.Compare(clientv3.CreateRevision(m.dir+name), "=", 0)).
		Then(clientv3.OpPut(dkey, m.record(held), clientv3.WithLease(g.ID))).Commit()
	if err != nil || !r.Succeeded {
		_, _ = m.cfg.Client.Revoke(cctx, g.ID)
		return err
	}
	m.cfg.Log.Info("fleet: recorded a departed node's holdings", "pool", m.cfg.Pool, "node", name, "held", held,
		"for", m.cfg.DepartedTTL)
	return nil
}

// writeOwnRecord, at a clean stop, records what this node's pool holds
// (as read now, else as last read) under a lease of its own, for the
// others to count once its key is gone. A failure leaves it to them (they
// record its last publication when they see its key gone).
func (m *Member) writeOwnRecord() {
	usage, err := m.cfg.Source.Usage()
	m.mu.Lock()
	if err != nil {
		usage = m.usage
	}
	held := 0
	for _, u := range usage {
		held += max(u.Held, 0)
	}
	m.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	g, err := m.cfg.Client.Grant(ctx, m.ttlSeconds())
	if err == nil {
		_, err = m.cfg.Client.Put(ctx, m.dkey, m.record(held), clientv3.WithLease(g.ID))
	}
	if err != nil {
		m.cfg.Log.Warn("fleet: recording this node's holdings at the stop failed; the others record its last publication",
			"pool", m.cfg.Pool, "held", held, "err", err)
		return
	}
	m.cfg.Log.Info("fleet: recorded this node's holdings for the others to count while it is away", "pool", m.cfg.Pool,
		"held", held, "for", m.cfg.DepartedTTL)
}
