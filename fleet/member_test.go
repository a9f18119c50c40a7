// SPDX-License-Identifier: Apache-2.0

package fleet

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/etcdtest"
	"github.com/fairshare-dev/fairshare/pools"
)

// worker is a greedy client of one project on one node: it asks every few
// milliseconds and holds each permit for hold, so a project over its cap
// comes under it by its own releases (nothing is taken back).
type worker struct {
	stop func()
	done chan struct{}
}

func greedy(p *pools.Pool, project string, hold time.Duration) *worker {
	ctx, cancel := context.WithCancel(context.Background())
	w := &worker{stop: cancel, done: make(chan struct{})}
	go func() {
		defer close(w.done)
		var wg sync.WaitGroup
		defer wg.Wait()
		for ctx.Err() == nil {
			pm, err := p.TryAcquire(project)
			if err != nil {
				time.Sleep(5 * time.Millisecond)
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				select {
				case <-time.After(hold):
				case <-ctx.Done():
				}
				_ = p.Release(pm)
			}()
		}
	}()
	return w
}

func (w *worker) end() { w.stop(); <-w.done }

type node struct {
	name   string
	pool   *pools.Pool
	member *Member
	cancel context.CancelFunc
	done   chan struct{}
	states chan Status
}

// run runs n's Member until n.stop, which the test's end calls.
func (n *node) run(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	n.cancel = cancel
	go func() { defer close(n.done); _ = n.member.Run(ctx) }()
	t.Cleanup(n.stop)
}

func startNode(t *testing.T, e *etcdtest.Etcd, name string, size int, ttl time.Duration) *node {
	t.Helper()
	return startNodeAt(t, e, "/test", name, size, ttl)
}

// startNodeAt is startNode under prefix (one fleet per prefix).
func startNodeAt(t *testing.T, e *etcdtest.Etcd, prefix, name string, size int, ttl time.Duration) *node {
	t.Helper()
	p, err := pools.New(pools.Config{Name: "db", Size: size}, nil)
	if err != nil {
		t.Fatal(err)
	}
	n := &node{name: name, pool: p, done: make(chan struct{}), states: make(chan Status, 16)}
	n.member, err = New(Config{Client: e.Client(t), Prefix: prefix, Pool: "db", Node: name, Size: size,
		LeaseTTL: ttl, Target: PoolTarget{p}, Source: PoolTarget{p},
		OnState: func(s Status) {
			select {
			case n.states <- s:
			default:
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	n.run(t)
	return n
}

func (n *node) stop() {
	if n.cancel != nil {
		n.cancel()
		<-n.done
		n.cancel = nil
	}
}

func held(p *pools.Pool, project string) int {
	for _, ps := range p.Snapshot().Projects {
		if ps.Project == project {
			return ps.Held
		}
	}
	return 0
}

// eventually polls cond for up to d (generous: this machine is loaded) and
// returns how long it took.
func eventually(t *testing.T, d time.Duration, what string, cond func() (bool, string)) time.Duration {
	t.Helper()
	start := time.Now()
	var last string
	for time.Since(start) < d {
		ok, s := cond()
		if ok {
			return time.Since(start)
		}
		last = s
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("%s: not within %v: %s", what, d, last)
	return 0
}

// TestMembersRealEtcd runs three members of a fleet pool of 12 against a
// real etcd, with real pools and greedy clients: the story, in
// process (the daemon test does it with three daemons).
func TestMembersRealEtcd(t *testing.T) {
	e := etcdtest.Start(t)
	const size, ttl = 12, 2 * time.Second
	a := startNode(t, e, "a", size, ttl)
	b := startNode(t, e, "b", size, ttl)
	c := startNode(t, e, "c", size, ttl)
	nodes := []*node{a, b, c}
	total := func() (int, string) {
		sum, s := 0, ""
		for _, n := range nodes {
			st := n.member.Status()
			sum += st.Allotment
			s += fmt.Sprintf("%s: %s allot %d in use %d; ", n.name, st.State, st.Allotment, n.pool.Snapshot().InUse)
		}
		return sum, s
	}
	eventually(t, 15*time.Second, "three connected nodes", func() (bool, string) {
		sum, s := total()
		ok := sum == size
		for _, n := range nodes {
			ok = ok && n.member.Status().State == StateConnected && n.member.Status().Nodes == 3
		}
		return ok, s
	})

	// Alpha alone on a takes all 12.
	wa := greedy(a.pool, "alpha", 300*time.Millisecond)
	defer wa.end()
	took := eventually(t, 15*time.Second, "alpha alone takes 12", func() (bool, string) {
		_, s := total()
		return held(a.pool, "alpha") == size, s
	})
	t.Logf("alpha alone took 12 in %v", took)

	// Beta on b gets its share (6); alpha comes down to its share.
	wb := greedy(b.pool, "beta", 300*time.Millisecond)
	defer wb.end()
	took = eventually(t, 15*time.Second, "beta gets its share", func() (bool, string) {
		_, s := total()
		return held(b.pool, "beta") == 6, s
	})
	t.Logf("beta held its share in %v", took)
	eventually(t, 15*time.Second, "alpha refused past its share", func() (bool, string) {
		h := held(a.pool, "alpha")
		return h <= 6, fmt.Sprintf("alpha holds %d", h)
	})

	// Alpha on a and b together: never more than one share, once settled.
	wab := greedy(b.pool, "alpha", 300*time.Millisecond)
	defer wab.end()
	eventually(t, 15*time.Second, "alpha on two nodes settles at one share", func() (bool, string) {
		ha, hb := held(a.pool, "alpha"), held(b.pool, "alpha")
		return hb > 0 && ha+hb <= 6, fmt.Sprintf("alpha holds %d on a, %d on b", ha, hb)
	})
	// Settled: at most one share, but for the moments when the split of
	// its share between a and b moves (its want on each varies) and the
	// node whose cap fell still holds the permits it granted before, until
	// their holders release them (the documented edge: nothing is taken
	// back). Those moments stay rare and small.
	hist := map[int]int{}
	const samples = 150
	for i := 0; i < samples; i++ {
		time.Sleep(20 * time.Millisecond)
		hist[held(a.pool, "alpha")+held(b.pool, "alpha")]++
	}
	t.Logf("alpha's fleet holding, %d samples: %v", samples, hist)
	over := 0
	for h, n := range hist {
		if h > 6 {
			over += n
		}
		if h > 6+2 {
			t.Errorf("alpha held %d on the fleet (%d samples), share 6", h, n)
		}
	}
	if over > samples/10 {
		t.Errorf("alpha over its share in %d of %d samples", over, samples)
	}
	sum, s := total()
	if sum != size {
		t.Errorf("allotments sum to %d: %s", sum, s)
	}

	// Stop etcd: every node stays within its safe slice (12/3 = 4) once
	// the decay ran, and keeps enforcing.
	e.Stop()
	eventually(t, 20*time.Second, "cut off, at the safe slice", func() (bool, string) {
		ok := true
		_, s := total()
		for _, n := range nodes {
			st := n.member.Status()
			ok = ok && st.State == StateCutOff && st.Allotment <= 4 && st.Safe == 4
		}
		return ok, s
	})
	time.Sleep(time.Second) // greedy clients turn over their permits
	for _, n := range nodes {
		snap := n.pool.Snapshot()
		if snap.Size > 4 {
			t.Errorf("%s: pool %d past the safe slice", n.name, snap.Size)
		}
	}
	// Restart etcd: the fleet converges again.
	e.Restart()
	eventually(t, 30*time.Second, "converged after etcd came back", func() (bool, string) {
		sum, s := total()
		ok := sum == size
		for _, n := range nodes {
			ok = ok && n.member.Status().State == StateConnected
		}
		return ok, s
	})
	// A node that leaves (revoking its lease) hands its part back.
	c.stop()
	eventually(t, 15*time.Second, "c's part handed back", func() (bool, string) {
		sa, sb := a.member.Status(), b.member.Status()
		return sa.Allotment+sb.Allotment == size && sa.Nodes == 2, fmt.Sprintf("a %d b %d nodes %d", sa.Allotment, sb.Allotment, sa.Nodes)
	})
}

// TestCallTimeout: an etcd call may take the period, at least a second and
// at most a third of the lease.
func TestCallTimeout(t *testing.T) {
	for _, tt := range []struct{ period, ttl, want time.Duration }{
		{time.Second, 5 * time.Second, time.Second},
		{100 * time.Millisecond, 5 * time.Second, time.Second},
		{time.Second, 2 * time.Second, 2 * time.Second / 3},
		{15 * time.Minute, time.Hour, 15 * time.Minute},
		{30 * time.Minute, time.Hour, 20 * time.Minute},
	} {
		m := &Member{cfg: Config{Period: tt.period, LeaseTTL: tt.ttl}}
		if got := m.callTimeout(); got != tt.want {
			t.Errorf("period %v lease %v: %v, want %v", tt.period, tt.ttl, got, tt.want)
		}
	}
}

// TestOwnKeyDeleted: a connected node whose key leaves the view (deleted by
// hand, or gone with a lease etcd dropped before the renewal noticed) had
// no entry in the plan and applied its zero value: allotment 0, every
// permit of the pool refused, and, its publication unchanged, it never put
// the key back. Now it keeps its allotment meanwhile and publishes again
// within a period or two. Deleted at random moments, five times.
func TestOwnKeyDeleted(t *testing.T) {
	e := etcdtest.Start(t)
	const size, ttl = 12, 2 * time.Second
	a := startNode(t, e, "a", size, ttl)
	b := startNode(t, e, "b", size, ttl)
	eventually(t, 15*time.Second, "two connected nodes", func() (bool, string) {
		sa, sb := a.member.Status(), b.member.Status()
		return sa.State == StateConnected && sb.State == StateConnected && sa.Nodes == 2 && sa.Allotment+sb.Allotment == size,
			fmt.Sprintf("a %+v b %+v", sa, sb)
	})
	c := e.Client(t)
	r := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 5))
	for round := range 5 {
		time.Sleep(time.Duration(r.IntN(1000)) * time.Millisecond)
		if _, err := c.Delete(context.Background(), "/test/db/nodes/a"); err != nil {
			t.Fatal(err)
		}
		low, back := size, false
		for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
			low = min(low, a.member.Status().Allotment, a.pool.Snapshot().Size)
			if g, err := c.Get(context.Background(), "/test/db/nodes/a"); err == nil && len(g.Kvs) == 1 && !back {
				back = true
				end = time.Now().Add(500 * time.Millisecond) // watch the allotment a moment more
			}
		}
		if low == 0 || !back {
			t.Fatalf("round %d: a's allotment fell to %d while its key was away; key back: %v", round, low, back)
		}
	}
}
