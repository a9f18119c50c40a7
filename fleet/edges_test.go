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

// offline is a Member of a fleet pool of size 12 (safe slice 4 among the 3
// nodes it saw) on a user-space pool, driven by hand on a fixed clock: no
// etcd is called.
func offline(t *testing.T, clk *fixedClock) (*Member, *pools.Pool) {
	t.Helper()
	p, err := pools.New(pools.Config{Name: "db", Size: 12}, clk)
	if err != nil {
		t.Fatal(err)
	}
	m, err := New(Config{Client: &clientv3.Client{}, Prefix: "/t", Pool: "db", Node: "a", Size: 12,
		Target: PoolTarget{p}, Source: PoolTarget{p}, Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	return m, p
}

// granted records a lease granted to a, as keepLease does.
func (m *Member) granted(lease clientv3.LeaseID) {
	m.lease = lease
	if !m.oursLocked(int64(lease)) {
		m.ours = append(m.ours, lease)
	}
}

// publishedAt records a's publication under lease at etcd revision rev, at
// the clock's time, as tick does after a put.
func (m *Member) publishedAt(lease clientv3.LeaseID, rev int64) {
	m.granted(lease)
	m.published = []byte("{}")
	m.putDoneLocked(lease, rev)
}

// publishedNode is offline's Member, published under lease at revision
// rev and renewed at the clock's time.
func publishedNode(t *testing.T, clk *fixedClock, lease clientv3.LeaseID, rev int64) (*Member, *pools.Pool) {
	t.Helper()
	m, p := offline(t, clk)
	m.mu.Lock()
	m.publishedAt(lease, rev)
	m.lastRenew = clk.t
	m.mu.Unlock()
	return m, p
}

// view3 is a view of nodes a (its key under lease, written at revision
// rev), b and c, and a plan giving a 10 of the 12.
func view3(lease, rev int64) (map[string]Node, Plan) {
	v := map[string]Node{"a": {Name: "a", Size: 12, lease: lease, rev: rev}, "b": {Name: "b", Size: 12, lease: 99, rev: 1},
		"c": {Name: "c", Size: 12, lease: 98, rev: 2}}
	return v, Plan{Size: 12, Floor: 1, Nodes: map[string]Allotment{"a": {Size: 10}, "b": {Size: 1}, "c": {Size: 1}}}
}

// The others share a node's part out once its lease ends, a lease_ttl
// after its last renewal was sent, however recently etcd answered it
// otherwise (a watch's events, a put): by then the node is at its safe
// slice, falling to it over the lease's last quarter, and connected as it
// may still be. (It used to decay from a lease_ttl after the last answer
// of any kind, a lease later: the fleet held its allotment twice.)
func TestLeaseEndBoundsTheAllotment(t *testing.T) {
	t0 := time.Unix(1e9, 0)
	clk := &fixedClock{t0}
	m, p := publishedNode(t, clk, 7, 10)
	ttl := m.cfg.LeaseTTL
	v, plan := view3(7, 10)
	prev := 11
	for _, at := range []time.Duration{0, ttl / 2, ttl * 2 / 3, ttl * 3 / 4, ttl * 5 / 6, ttl * 11 / 12, ttl, ttl + time.Millisecond, 3 * ttl} {
		clk.t = t0.Add(at)
		m.applyView(v, plan, 0) // an answer of etcd now: lastOK is fresh
		size := p.Snapshot().Size
		st := m.Status()
		switch {
		case st.State != StateConnected:
			t.Fatalf("at %v: state %q, want connected (etcd answers)", at, st.State)
		case at < ttl*2/3 && size != 10:
			t.Fatalf("at %v: size %d, want the plan's 10 with the lease fresh", at, size)
		case at >= ttl && size > 4:
			t.Fatalf("at %v, the lease ended: size %d, want at most the safe slice 4", at, size)
		case size > prev:
			t.Fatalf("at %v: size %d rose from %d without a renewal", at, size, prev)
		}
		prev = size
	}
	// A renewal lifts the bound.
	m.mu.Lock()
	m.lastRenew = clk.t
	m.mu.Unlock()
	m.applyView(v, plan, 0)
	if size := p.Snapshot().Size; size != 10 {
		t.Fatalf("after a renewal: size %d, want 10", size)
	}
}

// A node whose lease etcd dropped (a partition longer than the lease)
// is granted a new one and publishes under it; until the view holds that
// publication it holds at most its safe slice, not the part of the stale
// view's plan the others have shared out since.
func TestNewLeaseWaitsForItsPublication(t *testing.T) {
	t0 := time.Unix(1e9, 0)
	clk := &fixedClock{t0}
	m, p := publishedNode(t, clk, 7, 10)
	v, plan := view3(7, 10)
	m.applyView(v, plan, 0)
	if size := p.Snapshot().Size; size != 10 {
		t.Fatalf("connected: size %d, want 10", size)
	}
	// Cut off past the lease: at the safe slice.
	clk.t = t0.Add(3 * m.cfg.LeaseTTL)
	m.mu.Lock()
	m.stepLocked()
	m.mu.Unlock()
	if st := m.Status(); st.State != StateCutOff || p.Snapshot().Size > 4 {
		t.Fatalf("cut off: %q size %d", st.State, p.Snapshot().Size)
	}
	// Back: a new lease, a publication under it; the view still the
	// old one (its watch not caught up).
	m.mu.Lock()
	m.lastRenew, m.lastOK = clk.t, clk.t
	m.publishedAt(8, 20)
	m.stepLocked()
	m.mu.Unlock()
	if size := p.Snapshot().Size; size > 4 {
		t.Fatalf("a new lease, the view stale: size %d, want at most 4", size)
	}
	v, plan = view3(8, 20)
	m.applyView(v, plan, 0)
	if st := m.Status(); st.State != StateConnected || p.Snapshot().Size != 10 {
		t.Fatalf("the view holds the new publication: %q size %d, want connected at 10", st.State, p.Snapshot().Size)
	}
}

// A key of this node's name under a lease it never held is another
// daemon's: the node holds its safe slice among one node more, publishes
// nothing over it, and follows the fleet again once that key is gone and
// its own publication is back.
func TestSameNodeNameTwice(t *testing.T) {
	t0 := time.Unix(1e9, 0)
	clk := &fixedClock{t0}
	m, p := publishedNode(t, clk, 7, 10)
	v, plan := view3(7, 10)
	m.applyView(v, plan, 0)
	v, plan = view3(50, 11) // the other daemon's put
	m.applyView(v, plan, 0)
	if st := m.Status(); st.State != StateConflict || p.Snapshot().Size > 3 {
		t.Fatalf("another daemon's key: %q size %d, want %q at most 12/4", st.State, p.Snapshot().Size, StateConflict)
	}
	// Its key gone: waiting for this node's own publication.
	delete(v, "a")
	m.applyView(v, plan, 0)
	if st := m.Status(); st.State != StateWaiting || p.Snapshot().Size > 3 {
		t.Fatalf("the other's key gone: %q size %d", st.State, p.Snapshot().Size)
	}
	m.mu.Lock()
	m.publishedAt(9, 12)
	m.mu.Unlock()
	v, plan = view3(9, 12)
	m.applyView(v, plan, 0)
	if st := m.Status(); st.State != StateConnected || p.Snapshot().Size != 10 {
		t.Fatalf("own key back: %q size %d", st.State, p.Snapshot().Size)
	}
}

// view is a view3 with no computation time, as applyView takes it.
func view(v map[string]Node, p Plan) (map[string]Node, Plan, time.Duration) { return v, p, 0 }

// Keys that are this node's own though not its last publication are not
// another daemon's: a put under its new lease whose answer was lost (it
// follows the fleet once the view shows it), a key a previous run left (a
// view behind this run's first put holds it), a key written by hand under
// no lease. And after a new lease whose put failed, a view that still
// holds the old lease's key gives no plan: the node holds its safe slice.
func TestOwnKeysNotAnotherDaemons(t *testing.T) {
	t0 := time.Unix(1e9, 0)
	check := func(t *testing.T, m *Member, p *pools.Pool, state string, maxSize int) {
		t.Helper()
		if st := m.Status(); st.State != state || p.Snapshot().Size > maxSize {
			t.Fatalf("%q size %d, want %q at most %d", st.State, p.Snapshot().Size, state, maxSize)
		}
	}
	connected := func(t *testing.T) (*Member, *pools.Pool, *fixedClock) {
		clk := &fixedClock{t0}
		m, p := publishedNode(t, clk, 7, 10)
		m.applyView(view(view3(7, 10)))
		check(t, m, p, StateConnected, 10)
		// Cut off past the lease, then back with a new lease.
		clk.t = t0.Add(3 * m.cfg.LeaseTTL)
		m.mu.Lock()
		m.stepLocked()
		m.granted(8)
		m.lastRenew, m.lastOK = clk.t, clk.t
		m.mu.Unlock()
		return m, p, clk
	}
	t.Run("lost answer", func(t *testing.T) {
		m, p, _ := connected(t)
		m.applyView(view(view3(8, 30))) // the put under 8 committed
		check(t, m, p, StateConnected, 10)
		if p.Snapshot().Size != 10 {
			t.Fatalf("size %d, want the plan's 10", p.Snapshot().Size)
		}
	})
	t.Run("failed put, stale view", func(t *testing.T) {
		m, p, _ := connected(t)
		m.applyView(view(view3(7, 10))) // the watch not caught up: the old lease's key
		check(t, m, p, StateCutOff, 4)
	})
	// A first publication under 8, at revision 30.
	first := func(t *testing.T) (*Member, *pools.Pool) { return publishedNode(t, &fixedClock{t0}, 8, 30) }
	t.Run("a previous run's key", func(t *testing.T) {
		m, p := first(t)
		m.applyView(view(view3(5, 20)))
		check(t, m, p, StateWaiting, 4)
		m.applyView(view(view3(8, 30)))
		check(t, m, p, StateConnected, 10)
	})
	t.Run("written by hand", func(t *testing.T) {
		m, p := first(t)
		m.applyView(view(view3(0, 40)))
		check(t, m, p, StateWaiting, 4)
	})
}

// Nodes that publish different sizes (a rolling resize, a mistyped size)
// all divide the smallest, so the allotments never add up past it.
func TestSizesDisagree(t *testing.T) {
	clk := &fixedClock{time.Unix(1e9, 0)}
	m, _ := offline(t, clk)
	view := map[string]Node{"a": {Name: "a", Size: 12, Floor: 1}, "b": {Name: "b", Size: 6, Floor: 2},
		"c": {Name: "c"}} // c: an older release, nothing published
	if size, floor := m.divided(view); size != 6 || floor != 2 {
		t.Fatalf("divided: %d/%d, want 6/2", size, floor)
	}
	m.setView(view)
	if st := m.Status(); st.Size != 6 || st.Floor != 2 {
		t.Fatalf("status: size %d floor %d, want 6 and 2", st.Size, st.Floor)
	}
}

// countingSource reports usage whose refusal count starts high, as a
// kernel pool's does after a restart (its counters are pinned).
type countingSource struct {
	mu      sync.Mutex
	refused uint64
}

func (s *countingSource) Usage() (map[string]Usage, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return map[string]Usage{"old": {Refused: s.refused}}, nil
}

// A restarted daemon's first publication counts no refusal from before
// it: the kernel's running count is the base, and only refusals since are
// demand (an idle project refused a week ago wanted the whole size at
// every restart).
func TestRefusalsCountFromTheStart(t *testing.T) {
	e := etcdtest.Start(t)
	p, err := pools.New(pools.Config{Name: "db", Size: 12}, nil)
	if err != nil {
		t.Fatal(err)
	}
	src := &countingSource{refused: 1_000_000}
	m, err := New(Config{Client: e.Client(t), Prefix: "/base", Pool: "db", Node: "a", Size: 12,
		Target: PoolTarget{p}, Source: src, Period: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = m.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	c := e.Client(t)
	var first Node
	var rev int64
	eventually(t, 10*time.Second, "a first publication", func() (bool, string) {
		g, err := c.Get(context.Background(), "/base/db/nodes/a")
		if err != nil || len(g.Kvs) != 1 {
			return false, fmt.Sprint(err)
		}
		rev = g.Kvs[0].ModRevision
		return json.Unmarshal(g.Kvs[0].Value, &first) == nil, string(g.Kvs[0].Value)
	})
	if first.Projects["old"].Refused != 0 || first.Size != 12 {
		t.Fatalf("first publication %+v: want no refusal of before the start, and size 12", first)
	}
	// The lease it was granted is its own (a put under it whose answer is
	// lost is not taken for another daemon's).
	m.mu.Lock()
	mine := m.lease != 0 && m.oursLocked(int64(m.lease))
	m.mu.Unlock()
	if !mine {
		t.Fatal("the lease the node was granted is not among its own")
	}
	// Every publication after it, until one counts the refusals since.
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	wch := c.Watch(wctx, "/base/db/nodes/a", clientv3.WithRev(rev+1))
	src.mu.Lock()
	src.refused += 3
	src.mu.Unlock()
	for wr := range wch {
		for _, ev := range wr.Events {
			var n Node
			if err := json.Unmarshal(ev.Kv.Value, &n); err != nil {
				continue
			}
			switch r := n.Projects["old"].Refused; {
			case r == 3:
				return
			case r != 0:
				t.Fatalf("publication %+v: want the 3 refusals since", n)
			}
		}
	}
	t.Fatal("no publication counted the 3 refusals since the start")
}

// Two daemons given the same node name (a templated config, a cloned VM)
// against a real etcd, both with a greedy project: one follows the fleet,
// the other holds the safe slice among one node more, and neither takes
// the key from the other, so the fleet holds at most its size and the
// loser's slice, where both following the same allotment held it twice.
func TestSameNodeNameRealEtcd(t *testing.T) {
	e := etcdtest.Start(t)
	const size, ttl = 12, 4 * time.Second
	a1 := startNode(t, e, "a", size, ttl)
	w1 := greedy(a1.pool, "x", time.Hour)
	defer w1.end()
	b := startNode(t, e, "b", size, ttl)
	eventually(t, 15*time.Second, "a and b connected", func() (bool, string) {
		sa, sb := a1.member.Status(), b.member.Status()
		return sa.State == StateConnected && sb.State == StateConnected && sa.Allotment > size/2, fmt.Sprintf("a %+v b %+v", sa, sb)
	})
	a2 := startNode(t, e, "a", size, ttl)
	w2 := greedy(a2.pool, "x", time.Hour)
	defer w2.end()
	// Each may see the other's key first (a put of each in flight), but
	// the last put stands and its writer follows the fleet: one conflict
	// kept for two periods.
	var loser *node
	var since time.Time
	eventually(t, 15*time.Second, "one of the two a's in conflict", func() (bool, string) {
		s1, s2 := a1.member.Status(), a2.member.Status()
		var l *node
		switch {
		case s1.State == StateConflict && s2.State == StateConnected:
			l = a1
		case s2.State == StateConflict && s1.State == StateConnected:
			l = a2
		}
		if l == nil || l != loser {
			loser, since = l, time.Now()
		}
		return loser != nil && time.Since(since) > 2*DefaultPeriod, fmt.Sprintf("a1 %q a2 %q", s1.State, s2.State)
	})
	sizes := func() int { return a1.pool.Snapshot().Size + a2.pool.Snapshot().Size + b.pool.Snapshot().Size }
	// The nodes' views converge within a publication and a computation
	// (b's may lag a2's); then the bound holds.
	eventually(t, 15*time.Second, "the fleet within its size and the loser's slice", func() (bool, string) {
		return sizes() <= size+size/3, fmt.Sprintf("sizes %d", sizes())
	})
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if st := loser.member.Status(); st.State != StateConflict {
			t.Fatalf("the loser left the conflict with the other daemon still there: %+v", st)
		}
		if sizes := sizes(); sizes > size+size/3 {
			t.Fatalf("the three pools' sizes add up to %d, want at most %d (the size and the loser's slice): a1 %+v a2 %+v b %+v", sizes, size+size/3, a1.member.Status(), a2.member.Status(), b.member.Status())
		}
	}
	// The winner gone (its lease revoked), the loser publishes and follows.
	winner := a1
	if loser == a1 {
		winner = a2
	}
	winner.stop()
	eventually(t, 15*time.Second, "the loser connected", func() (bool, string) {
		st := loser.member.Status()
		return st.State == StateConnected && st.Allotment > size/2, fmt.Sprintf("%+v", st)
	})
}
