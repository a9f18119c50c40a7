// SPDX-License-Identifier: Apache-2.0

package fleet

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/fairshare-dev/fairshare/internal/etcdtest"
	"github.com/fairshare-dev/fairshare/pools"
)

// depNode starts a Member of pool db (size) under prefix on pool p: a
// kernel pool's stand-in (saferTarget: its permits outlive the Member) if
// safer, a user-space pool otherwise; cli is its etcd client (nil: its
// own).
func depNode(t *testing.T, e *etcdtest.Etcd, cli *clientv3.Client, prefix, name string, p *pools.Pool, size int,
	safer bool, departedTTL time.Duration) *node {
	t.Helper()
	if cli == nil {
		cli = e.Client(t)
	}
	var tgt interface {
		Target
		Source
	} = PoolTarget{p}
	if safer {
		tgt = &saferTarget{PoolTarget: PoolTarget{p}}
	}
	n := &node{name: name, pool: p, done: make(chan struct{}), states: make(chan Status, 16)}
	var err error
	n.member, err = New(Config{Client: cli, Prefix: prefix, Pool: "db", Node: name, Size: size,
		LeaseTTL: 2 * time.Second, Target: tgt, Source: tgt, DepartedTTL: departedTTL})
	if err != nil {
		t.Fatal(err)
	}
	n.run(t)
	return n
}

func newPool(t *testing.T, size int) *pools.Pool {
	t.Helper()
	p, err := pools.New(pools.Config{Name: "db", Size: size}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// hold takes n permits of project in p and keeps them (the long-lived
// connections a kernel pool holds whatever becomes of the daemon).
func hold(t *testing.T, p *pools.Pool, project string, n int) {
	t.Helper()
	eventually(t, 15*time.Second, fmt.Sprintf("%s holds %d", project, n), func() (bool, string) {
		if held(p, project) < n {
			_, _ = p.TryAcquire(project)
		}
		return held(p, project) == n, fmt.Sprintf("holds %d, pool %+v", held(p, project), p.Snapshot().Size)
	})
}

// connected waits for nodes to be connected, each seeing them all.
func connected(t *testing.T, nodes ...*node) {
	t.Helper()
	eventually(t, 15*time.Second, "nodes connected", func() (bool, string) {
		ok, s := true, ""
		for _, n := range nodes {
			st := n.member.Status()
			ok = ok && st.State == StateConnected && st.Nodes == len(nodes)
			s += fmt.Sprintf("%s: %s, %d nodes; ", n.name, st.State, st.Nodes)
		}
		return ok, s
	})
}

// sees waits for n to see project's fleet holding at want.
func sees(t *testing.T, n *node, project string, want int) {
	t.Helper()
	eventually(t, 15*time.Second, fmt.Sprintf("%s sees %s holding %d", n.name, project, want), func() (bool, string) {
		ps := n.member.Status().Projects[project]
		return ps.FleetHeld == want, fmt.Sprintf("%+v", ps)
	})
}

// record reads node name's departed record: its value and key (nil: none).
func record(t *testing.T, cli *clientv3.Client, prefix, name string) (departedRecord, *clientv3.GetResponse) {
	t.Helper()
	resp, err := cli.Get(context.Background(), prefix+"/db/departed/"+name)
	if err != nil {
		t.Fatal(err)
	}
	var r departedRecord
	if len(resp.Kvs) == 1 {
		if err := json.Unmarshal(resp.Kvs[0].Value, &r); err != nil {
			t.Fatal(err)
		}
		return r, resp
	}
	return r, nil
}

// bounded watches b's project until done says stop, failing when it holds
// more than limit; it returns what it held at most.
func bounded(t *testing.T, p *pools.Pool, project string, limit int, max time.Duration, done func() bool) int {
	t.Helper()
	top := 0
	for end := time.Now().Add(max); time.Now().Before(end) && !done(); time.Sleep(10 * time.Millisecond) {
		h := held(p, project)
		top = maxInt(top, h)
		if h > limit {
			t.Fatalf("%s holds %d past %d while the departed node's holdings count", project, h, limit)
		}
	}
	return top
}

func maxInt(a, b int) int {
	if a > b {
		return a
	}
	return b
}

// TestDepartedHoldingsStayCounted: a node whose kernel pool holds 5 of a
// fleet of 10 stops cleanly; its pool keeps them (the kernel enforces on,
// the connections stay open). It records them before it revokes its
// lease, and the other node, a greedy client on it, holds no more than 5
// while the record lives; after its TTL, 10. (b is a user-space pool:
// it writes no record of its own accord, so the stop's is the one.)
func TestDepartedHoldingsStayCounted(t *testing.T) {
	e := etcdtest.Start(t)
	const size, prefix, ttl = 10, "/dep-clean", 4 * time.Second
	cli := e.Client(t)
	pa, pb := newPool(t, size), newPool(t, size)
	a := depNode(t, e, nil, prefix, "a", pa, size, true, ttl)
	b := depNode(t, e, nil, prefix, "b", pb, size, false, ttl)
	connected(t, a, b)
	hold(t, pa, "alpha", 5)
	sees(t, b, "alpha", 5)
	w := greedy(pb, "beta", 100*time.Millisecond)
	defer w.end()
	eventually(t, 15*time.Second, "beta at its share", func() (bool, string) {
		return held(pb, "beta") == 5, fmt.Sprintf("beta holds %d", held(pb, "beta"))
	})

	stopped := make(chan struct{})
	go func() { a.stop(); close(stopped) }()
	bounded(t, pb, "beta", 5, 15*time.Second, func() bool {
		select {
		case <-stopped:
			return true
		default:
			return false
		}
	})
	r, resp := record(t, cli, prefix, "a")
	if resp == nil || r.Held != 5 || r.By != "a" {
		t.Fatalf("a's record after its stop: %+v (%v)", r, resp)
	}
	lease, err := cli.TimeToLive(context.Background(), clientv3.LeaseID(resp.Kvs[0].Lease))
	if err != nil || lease.TTL <= 0 || lease.GrantedTTL != int64(ttl/time.Second) {
		t.Fatalf("a's record's lease: %+v, %v; want a TTL of %v", lease, err, ttl)
	}
	eventually(t, 15*time.Second, "b counts a's record", func() (bool, string) {
		st := b.member.Status()
		return st.Departed == 5 && st.Nodes == 1, fmt.Sprintf("%+v", st)
	})
	top := bounded(t, pb, "beta", 5, 30*time.Second, func() bool {
		_, resp := record(t, cli, prefix, "a")
		return resp == nil
	})
	t.Logf("beta held at most %d while a's record lived", top)
	eventually(t, 20*time.Second, "beta takes the whole fleet once a's record expired", func() (bool, string) {
		return held(pb, "beta") == size, fmt.Sprintf("beta holds %d, b %+v", held(pb, "beta"), b.member.Status())
	})
}

// TestDepartedKilledMember: a node killed (its client closed: no clean
// stop, its lease expires) while its kernel pool holds 5. Both survivors
// (kernel pools: they write records) count its last publication from the
// moment its key is gone, and one of them records it, once; a greedy
// client on b holds no more than 5 meanwhile, and 10 after the record's
// TTL.
func TestDepartedKilledMember(t *testing.T) {
	e := etcdtest.Start(t)
	const size, prefix, ttl = 10, "/dep-killed", 5 * time.Second
	cli := e.Client(t)
	pa, pb, pc := newPool(t, size), newPool(t, size), newPool(t, size)
	acli := e.Client(t)
	a := depNode(t, e, acli, prefix, "a", pa, size, true, ttl)
	b := depNode(t, e, nil, prefix, "b", pb, size, true, ttl)
	c := depNode(t, e, nil, prefix, "c", pc, size, true, ttl)
	connected(t, a, b, c)
	hold(t, pa, "alpha", 5)
	sees(t, b, "alpha", 5)
	sees(t, c, "alpha", 5)
	w := greedy(pb, "beta", 100*time.Millisecond)
	defer w.end()
	eventually(t, 15*time.Second, "beta at its share", func() (bool, string) {
		return held(pb, "beta") == 5, fmt.Sprintf("beta holds %d", held(pb, "beta"))
	})

	// The kill: a's Member runs on, cut off, its lease unrenewed.
	_ = acli.Close()
	bounded(t, pb, "beta", 5, 30*time.Second, func() bool {
		_, resp := record(t, cli, prefix, "a")
		return resp != nil
	})
	r, resp := record(t, cli, prefix, "a")
	if r.Held != 5 || (r.By != "b" && r.By != "c") {
		t.Fatalf("a's record: %+v", r)
	}
	for _, n := range []*node{b, c} {
		eventually(t, 15*time.Second, n.name+" counts a's record", func() (bool, string) {
			st := n.member.Status()
			return st.Departed == 5 && st.Nodes == 2, fmt.Sprintf("%+v", st)
		})
	}
	top := bounded(t, pb, "beta", 5, 30*time.Second, func() bool {
		_, resp := record(t, cli, prefix, "a")
		return resp == nil
	})
	if _, now := record(t, cli, prefix, "a"); now != nil && now.Kvs[0].Version != 1 {
		t.Errorf("a's record written %d times", now.Kvs[0].Version)
	}
	_ = resp
	t.Logf("beta held at most %d while a's record lived", top)
	eventually(t, 20*time.Second, "beta takes the whole fleet once a's record expired", func() (bool, string) {
		return held(pb, "beta") == size, fmt.Sprintf("beta holds %d, b %+v", held(pb, "beta"), b.member.Status())
	})

	// Racing writers: one record, once; none for a node whose key is
	// there.
	var wg sync.WaitGroup
	for _, n := range []*node{b, c, b, c} {
		wg.Add(1)
		go func() { defer wg.Done(); _ = n.member.writeRecordFor(context.Background(), "z", 3) }()
	}
	wg.Wait()
	if r, resp := record(t, cli, prefix, "z"); resp == nil || resp.Kvs[0].Version != 1 || r.Held != 3 {
		t.Fatalf("four racing writers of z's record: %+v %v; want one write", r, resp)
	}
	if err := b.member.writeRecordFor(context.Background(), "c", 3); err != nil {
		t.Fatal(err)
	}
	if _, resp := record(t, cli, prefix, "c"); resp != nil {
		t.Fatalf("a record of c written while c's key is there: %v", resp)
	}
}

// TestDepartedNodeComesBack: a node that stopped cleanly holding 5 starts
// again on the same pool (the kernel's pins): it publishes its holdings and
// deletes its record; the other counts it by its publication, not twice,
// and it is connected (its record is no foreign key of its name).
func TestDepartedNodeComesBack(t *testing.T) {
	e := etcdtest.Start(t)
	const size, prefix, ttl = 10, "/dep-back", time.Minute
	cli := e.Client(t)
	pa, pb := newPool(t, size), newPool(t, size)
	a := depNode(t, e, nil, prefix, "a", pa, size, true, ttl)
	b := depNode(t, e, nil, prefix, "b", pb, size, false, ttl)
	connected(t, a, b)
	hold(t, pa, "alpha", 5)
	sees(t, b, "alpha", 5)
	a.stop()
	eventually(t, 15*time.Second, "b counts a's record", func() (bool, string) {
		st := b.member.Status()
		return st.Departed == 5 && st.Nodes == 1, fmt.Sprintf("%+v", st)
	})
	a2 := depNode(t, e, nil, prefix, "a", pa, size, true, ttl)
	connected(t, a2, b)
	eventually(t, 15*time.Second, "a's record deleted, a counted by its publication", func() (bool, string) {
		_, resp := record(t, cli, prefix, "a")
		st := b.member.Status()
		return resp == nil && st.Departed == 0 && st.Projects["alpha"].FleetHeld == 5 && a2.member.Status().State == StateConnected,
			fmt.Sprintf("record %v, b %+v, a %s", resp != nil, st, a2.member.Status().State)
	})
	w := greedy(pb, "beta", 100*time.Millisecond)
	defer w.end()
	eventually(t, 15*time.Second, "beta at its share", func() (bool, string) {
		return held(pb, "beta") == 5, fmt.Sprintf("beta holds %d", held(pb, "beta"))
	})
	if sa, sb := a2.member.Status(), b.member.Status(); sa.Allotment+sb.Allotment != size {
		t.Errorf("allotments %d + %d, want %d", sa.Allotment, sb.Allotment, size)
	}
}

// TestComputeDeparted: the live nodes divide the size less the departed
// holdings, clamped to [0, size], every node alike.
func TestComputeDeparted(t *testing.T) {
	nodes := []Node{{Name: "a", Projects: map[string]Demand{"p": {Held: 9}}}, {Name: "b", Projects: map[string]Demand{"q": {Held: 2, Refused: 9}}}}
	for _, tc := range []struct{ departed, want int }{{0, 100}, {30, 70}, {-5, 100}, {100, 0}, {250, 0}} {
		plan := ComputeDeparted(100, 0, tc.departed, nodes, "", true)
		got := 0
		for _, a := range plan.Nodes {
			got += a.Size
		}
		if got != tc.want || plan.Size != 100 {
			t.Errorf("departed %d: allotments sum to %d (size %d), want %d", tc.departed, got, plan.Size, tc.want)
		}
		for _, n := range nodes {
			if one := ComputeDeparted(100, 0, tc.departed, nodes, n.Name, false); one.Nodes[n.Name].Size != plan.Nodes[n.Name].Size {
				t.Errorf("departed %d: %s's allotment %d alone, %d among all", tc.departed, n.Name, one.Nodes[n.Name].Size, plan.Nodes[n.Name].Size)
			}
		}
	}
}

// TestGoneCountsItsAllotment: a node whose key expired (a killed daemon)
// left its kernel pool at its allotment until its lease ended, and may
// have taken more than it last published: it is counted as holding its
// allotment less its safe slice when that is more (x: 12 of 12, safe
// slice 6 of 2 nodes, published holding 1: counted 6); a node seen gone
// by a user-space pool's Member is not counted at all (it wrote its
// permits off with its daemon).
func TestGoneCountsItsAllotment(t *testing.T) {
	clk := &fixedClock{time.Unix(1e9, 0)}
	view := map[string]Node{"a": {Name: "a", Size: 12}, "x": {Name: "x", Size: 12,
		Projects: map[string]Demand{"p": {Held: 1, Refused: 20}}}}
	for _, safer := range []bool{true, false} {
		p, err := pools.New(pools.Config{Name: "db", Size: 12}, clk)
		if err != nil {
			t.Fatal(err)
		}
		var tgt interface {
			Target
			Source
		} = PoolTarget{p}
		if safer {
			tgt = &saferTarget{PoolTarget: PoolTarget{p}}
		}
		m, err := New(Config{Client: &clientv3.Client{}, Prefix: "/t", Pool: "db", Node: "a", Size: 12,
			Target: tgt, Source: tgt, Clock: clk})
		if err != nil {
			t.Fatal(err)
		}
		m.setView(view)
		m.setView(map[string]Node{"a": view["a"]})
		want := 0
		if safer {
			want = 6
		}
		if st := m.Status(); st.Departed != want {
			t.Errorf("safer %v: x counted as holding %d, want %d", safer, st.Departed, want)
		}
	}
}
