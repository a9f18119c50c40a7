// SPDX-License-Identifier: Apache-2.0

package fleet

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/fairshare-dev/fairshare/internal/etcdtest"
	"github.com/fairshare-dev/fairshare/pools"
)

// A node whose view stopped following the fleet (its watch stalled or
// ended and its reads fail, or etcd was restored from a snapshot and stays
// silent) while etcd takes its puts and renewals was connected to that
// view for good: it applied the old plan while the others divided the
// fleet by its publications since (gave it 2 where it still applied 10:
// the fleet past its size). Now, once a put of its own is two periods old
// and the view does not show it, it holds at most its safe slice, says so,
// and asks for a read of the view; a view that shows its last put gives it
// the plan back.
func TestStaleViewHoldsSafeSlice(t *testing.T) {
	t0 := time.Unix(1e9, 0)
	check := func(t *testing.T, m *Member, p *pools.Pool, state string, minSize, maxSize int) {
		t.Helper()
		st, size := m.Status(), p.Snapshot().Size
		if st.State != state || size < minSize || size > maxSize || st.Allotment != size {
			t.Fatalf("%q size %d (allotment %d), want %q with a size in [%d, %d]", st.State, size, st.Allotment, state, minSize, maxSize)
		}
	}
	// answered: a tick at the clock's time whose renewal (and put, if
	// any) etcd answered.
	answered := func(m *Member, clk *fixedClock, at time.Duration, put int64) {
		clk.t = t0.Add(at)
		m.mu.Lock()
		defer m.mu.Unlock()
		if put > 0 {
			m.publishedAt(7, put)
		}
		m.lastRenew, m.lastOK = clk.t, clk.t
		m.stepLocked()
	}
	asked := func(m *Member) bool {
		select {
		case <-m.reget:
			return true
		default:
			return false
		}
	}
	// viewCaps is view3 with a cap for project x on a.
	viewCaps := func(lease, rev int64) (map[string]Node, Plan, time.Duration) {
		v, plan := view3(lease, rev)
		plan.Nodes["a"] = Allotment{Size: 10, Caps: map[string]int{"x": 8}, Spare: 2}
		return v, plan, 0
	}
	connected := func(t *testing.T) (*Member, *pools.Pool, *fixedClock) {
		clk := &fixedClock{t0}
		m, p := publishedNode(t, clk, 7, 10)
		m.applyView(viewCaps(7, 10))
		check(t, m, p, StateConnected, 10, 10)
		return m, p, clk
	}
	caps := func(m *Member) map[string]int {
		m.mu.Lock()
		defer m.mu.Unlock()
		return m.applied.Caps
	}

	t.Run("watch stalled", func(t *testing.T) {
		m, p, clk := connected(t)
		period := m.cfg.Period
		// A new publication; the view does not show it yet, as for the
		// moment a watch event takes.
		answered(m, clk, period, 11)
		check(t, m, p, StateConnected, 10, 10)
		if asked(m) {
			t.Fatal("a read of the view asked for a put a period old")
		}
		// Periods go by, etcd answering, the view never updated.
		for i := 2; i <= 5; i++ {
			answered(m, clk, time.Duration(i)*period, 0)
		}
		check(t, m, p, StateStale, 0, 4)
		if !asked(m) {
			t.Fatal("the view is stale, and no read of it was asked for")
		}
		if c := caps(m); len(c) != 0 {
			t.Fatalf("stale: caps %v, want none", c)
		}
		// Another node's publication comes, not this one's: still stale.
		v, plan, _ := viewCaps(7, 10)
		v["b"] = Node{Name: "b", Size: 12, lease: 99, rev: 12}
		m.applyView(v, plan, 0)
		check(t, m, p, StateStale, 0, 4)
		if !asked(m) {
			t.Fatal("the view still stale, and no read of it was asked for")
		}
		// The view shows the node's last put: the plan again.
		m.applyView(viewCaps(7, 11))
		check(t, m, p, StateConnected, 10, 10)
		if c := caps(m); c["x"] != 8 {
			t.Fatalf("back: caps %v, want the plan's", c)
		}
		answered(m, clk, 6*period, 0)
		check(t, m, p, StateConnected, 10, 10)
		if asked(m) {
			t.Fatal("a read of the view asked for with the view current")
		}
	})

	// etcd restored from a snapshot without --bump-revision: its
	// revisions start again below the last put's, and the old view,
	// whose key for this node has a higher revision than the puts since,
	// seemed to show them.
	t.Run("revisions went back", func(t *testing.T) {
		m, p, clk := connected(t)
		period := m.cfg.Period
		m.mu.Lock()
		before := m.history
		m.mu.Unlock()
		answered(m, clk, period, 6)
		// The watch of before brings a view read before the restore.
		m.applyViewOf(maps.Clone(m.view), m.plan, 0, before)
		for i := 2; i <= 4; i++ {
			answered(m, clk, time.Duration(i)*period, 0)
		}
		check(t, m, p, StateStale, 0, 4)
		// A read since shows the put of the new history.
		m.applyView(viewCaps(7, 6))
		check(t, m, p, StateConnected, 10, 10)
	})
}

// stallingClient is a real etcd client whose watches can be made to stall
// (they stay open, and bring nothing more) and whose reads can be made to
// fail, its puts and lease calls going through: a view that stopped while
// etcd answers.
type stallingClient struct {
	clientv3.KV
	clientv3.Watcher
	mu       sync.Mutex
	gen      int // watches made before stalledBelow stall
	stallGen int
	failGets bool
}

func stalling(c *clientv3.Client) *stallingClient {
	s := &stallingClient{KV: c.KV, Watcher: c.Watcher}
	c.KV, c.Watcher = s, s
	return s
}

// stall stalls the watches open now, and fails the reads until read.
func (s *stallingClient) stall() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stallGen, s.failGets = s.gen+1, true
}

// read lets reads through again; the stalled watches stay stalled.
func (s *stallingClient) read() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failGets = false
}

func (s *stallingClient) Get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	s.mu.Lock()
	fail := s.failGets
	s.mu.Unlock()
	if fail {
		return nil, errors.New("test: reads fail")
	}
	return s.KV.Get(ctx, key, opts...)
}

func (s *stallingClient) Watch(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	s.mu.Lock()
	s.gen++
	gen := s.gen
	s.mu.Unlock()
	in := s.Watcher.Watch(ctx, key, opts...)
	out := make(chan clientv3.WatchResponse)
	go func() {
		defer close(out)
		for wr := range in {
			s.mu.Lock()
			stalled := gen < s.stallGen
			s.mu.Unlock()
			if stalled {
				continue
			}
			select {
			case out <- wr:
			case <-ctx.Done():
				return
			}
		}
	}()
	return out
}

// TestStaleViewRealEtcd: three nodes of a fleet of 12 against a real etcd,
// alpha greedy on a. a's watch stalls and its reads fail, its puts and
// renewals going through; beta, greedy on b, takes its share there. The
// others give a less, and a, which applied its old plan for good, now
// holds its safe slice (4), so the pools add up to no more than 12. Once
// reads go through again (its old watch still stalled) a reads the view
// again and follows the fleet.
func TestStaleViewRealEtcd(t *testing.T) {
	e := etcdtest.Start(t)
	const size, ttl = 12, 4 * time.Second
	p, err := pools.New(pools.Config{Name: "db", Size: size}, nil)
	if err != nil {
		t.Fatal(err)
	}
	cli := e.Client(t)
	sc := stalling(cli)
	am, err := New(Config{Client: cli, Prefix: "/stale", Pool: "db", Node: "a", Size: size, LeaseTTL: ttl,
		Target: PoolTarget{p}, Source: PoolTarget{p}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = am.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	b := startNodeAt(t, e, "/stale", "b", size, ttl)
	c := startNodeAt(t, e, "/stale", "c", size, ttl)
	sizes := func() (int, string) {
		sa, sb, sc := p.Snapshot().Size, b.pool.Snapshot().Size, c.pool.Snapshot().Size
		return sa + sb + sc, fmt.Sprintf("a %q %d, b %d, c %d", am.Status().State, sa, sb, sc)
	}
	wa := greedy(p, "alpha", 200*time.Millisecond)
	defer wa.end()
	eventually(t, 20*time.Second, "alpha takes most of the fleet on a", func() (bool, string) {
		sum, s := sizes()
		return am.Status().State == StateConnected && p.Snapshot().Size > 6 && sum == size, s
	})
	sc.stall()
	wb := greedy(b.pool, "beta", 200*time.Millisecond)
	defer wb.end()
	eventually(t, 20*time.Second, "b gives beta its share, a holds its safe slice", func() (bool, string) {
		sum, s := sizes()
		return b.pool.Snapshot().Size >= 6 && am.Status().State == StateStale && p.Snapshot().Size <= 4 && sum <= size, s
	})
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if sum, s := sizes(); sum > size {
			t.Fatalf("the view stale: the pools add up to %d, past the fleet's %d: %s", sum, size, s)
		}
	}
	sc.read()
	eventually(t, 20*time.Second, "a follows the fleet again", func() (bool, string) {
		sum, s := sizes()
		return am.Status().State == StateConnected && sum == size && p.Snapshot().Size > 4, s
	})
}
