// SPDX-License-Identifier: Apache-2.0

package fleet

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/fairshare-dev/fairshare/internal/etcdtest"
	"github.com/fairshare-dev/fairshare/pools"
)

// saferTarget is a kernel pool as the Member sees it: a user-space pool
// (PoolTarget) that also takes the safe slice (Safer), recording what it
// was given; failStop makes SetSize fail once stopping is set.
type saferTarget struct {
	PoolTarget
	mu       sync.Mutex
	safes    []int
	ends     []time.Time
	sizes    []int
	caps     map[string]int
	stopping bool
	failStop bool
}

func (t *saferTarget) SetSize(size int) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stopping && t.failStop {
		return errors.New("the kernel side is gone")
	}
	t.sizes = append(t.sizes, size)
	return t.PoolTarget.SetSize(size)
}

func (t *saferTarget) SetCaps(caps map[string]int, others int) error {
	t.mu.Lock()
	t.caps = caps
	t.mu.Unlock()
	return t.PoolTarget.SetCaps(caps, others)
}

func (t *saferTarget) SetSafe(safe int, leaseEnd time.Time) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.safes = append(t.safes, safe)
	t.ends = append(t.ends, leaseEnd)
	return nil
}

func (t *saferTarget) last() (size, safe int, caps map[string]int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.sizes) > 0 {
		size = t.sizes[len(t.sizes)-1]
	}
	safe = -1
	if len(t.safes) > 0 {
		safe = t.safes[len(t.safes)-1]
	}
	return size, safe, t.caps
}

// TestStopHoldsSafeSlice: a pool that enforces without the daemon (Safer)
// gets the safe slice of each view (12 over 2 nodes: 6), and when its node
// stops, is held to that slice without caps before the lease is revoked,
// so the other node, which takes the fleet from then on but for what this
// one recorded it holds at the stop, and this one's pool add up to no more
// than the fleet's size plus a partition's margin (the safe slice). A stop
// whose hold fails leaves the lease to expire: the key stays until then.
func TestStopHoldsSafeSlice(t *testing.T) {
	e := etcdtest.Start(t)
	const size, ttl = 12, 2 * time.Second
	for _, failStop := range []bool{false, true} {
		t.Run(fmt.Sprintf("hold-fails-%v", failStop), func(t *testing.T) {
			prefix := fmt.Sprintf("/safe-%v", failStop)
			p, err := pools.New(pools.Config{Name: "db", Size: size}, nil)
			if err != nil {
				t.Fatal(err)
			}
			tgt := &saferTarget{PoolTarget: PoolTarget{p}, failStop: failStop}
			cli := e.Client(t)
			a, err := New(Config{Client: cli, Prefix: prefix, Pool: "db", Node: "a", Size: size, LeaseTTL: ttl,
				Target: tgt, Source: tgt})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { defer close(done); _ = a.Run(ctx) }()
			t.Cleanup(func() { cancel(); <-done })
			b := startNodeAt(t, e, prefix, "b", size, ttl)

			// Alpha busy on a: a's allotment past the safe slice of 6.
			w := greedy(p, "alpha", 200*time.Millisecond)
			defer w.end()
			eventually(t, 15*time.Second, "a past its safe slice, with the safe slice of two nodes", func() (bool, string) {
				st := a.Status()
				sz, safe, _ := tgt.last()
				return st.State == StateConnected && st.Nodes == 2 && sz > 6 && safe == 6,
					fmt.Sprintf("%s, %d nodes, size %d, safe %d", st.State, st.Nodes, sz, safe)
			})
			// Each renewal of the lease gave the pool the lease's new
			// end, a lease_ttl from when the renewal was sent.
			eventually(t, 10*time.Second, "the lease's end moves on with its renewals", func() (bool, string) {
				tgt.mu.Lock()
				defer tgt.mu.Unlock()
				n := 0
				for i := 1; i < len(tgt.ends); i++ {
					if tgt.ends[i].After(tgt.ends[i-1]) && !tgt.ends[i-1].IsZero() {
						n++
					}
				}
				last := tgt.ends[len(tgt.ends)-1]
				return n >= 2 && last.After(time.Now()) && !last.After(time.Now().Add(ttl)), fmt.Sprintf("ends %v", tgt.ends)
			})
			tgt.mu.Lock()
			tgt.stopping = true
			tgt.mu.Unlock()
			cancel()
			<-done
			sz, _, caps := tgt.last()
			resp, err := cli.Get(context.Background(), prefix+"/db/nodes/a")
			if err != nil {
				t.Fatal(err)
			}
			if failStop {
				if len(resp.Kvs) != 1 || sz <= 6 {
					t.Fatalf("a stop whose hold failed: key %d, size %d; want the key kept (the lease left to expire)", len(resp.Kvs), sz)
				}
				return
			}
			if sz > 6 || caps != nil || len(resp.Kvs) != 0 {
				t.Fatalf("after the stop: size %d, caps %v, key %d; want at most 6, no caps, the lease revoked", sz, caps, len(resp.Kvs))
			}
			// b takes the fleet but for what a holds, as a recorded at
			// its stop (the kernel's permits outlive the daemon: see
			// departed.go).
			r, rec := record(t, cli, prefix, "a")
			if rec == nil || r.Held <= 0 {
				t.Fatalf("a's record of its holdings at the stop: %+v %v", r, rec)
			}
			eventually(t, 10*time.Second, "b takes the fleet but for a's record", func() (bool, string) {
				st := b.member.Status()
				return st.Allotment == size-r.Held && st.Departed == r.Held,
					fmt.Sprintf("b: %d nodes, allotment %d, departed %d; a's record %d", st.Nodes, st.Allotment, st.Departed, r.Held)
			})
		})
	}
}

// A kernel pool's pins keep the safe slice the node's last run gave it (the
// size over the nodes it last saw). A node restarted while etcd is down
// started at the floor instead, 5% of the size, having no view: a pool held
// to size/200 by 200 nodes went to size/20 on each, the fleet from its size
// to ten times it over a rolling restart. Now, with no safe_fraction, the
// Member starts at no more than the last run's slice (Config.LastSafe),
// applies nothing above it and gives the pool that slice to hold without
// the daemon, until its first view.
func TestStartHoldsLastSafe(t *testing.T) {
	const size = 1000
	for _, tc := range []struct {
		name     string
		cfg      Config
		wantSafe int
	}{
		{"no pinned slice: the floor", Config{}, 50},
		{"a pinned slice under the floor", Config{LastSafe: 5, HasLastSafe: true}, 5},
		{"a pinned slice of 0", Config{LastSafe: 0, HasLastSafe: true}, 0},
		{"a pinned slice above the floor", Config{LastSafe: 80, HasLastSafe: true}, 50},
		{"safe_fraction rules", Config{LastSafe: 5, HasLastSafe: true, SafeFraction: 0.1}, 100},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := tc.cfg
			c.Client, c.Prefix, c.Pool, c.Node, c.Size = &clientv3.Client{}, "/t", "db", "a", size
			p, err := pools.New(pools.Config{Name: "db", Size: size}, nil)
			if err != nil {
				t.Fatal(err)
			}
			c.Target, c.Source = PoolTarget{p}, PoolTarget{p}
			m, err := New(c)
			if err != nil {
				t.Fatal(err)
			}
			if st := m.Status(); st.Safe != tc.wantSafe {
				t.Fatalf("safe slice before the first view %d, want %d", st.Safe, tc.wantSafe)
			}
		})
	}

	// Run with no etcd to reach: what the kernel pool is given.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{"http://" + addr}, DialTimeout: time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	p, err := pools.New(pools.Config{Name: "db", Size: size}, nil)
	if err != nil {
		t.Fatal(err)
	}
	tgt := &saferTarget{PoolTarget: PoolTarget{p}}
	m, err := New(Config{Client: cli, Prefix: "/t", Pool: "db", Node: "a", Size: size, Period: 100 * time.Millisecond,
		Target: tgt, Source: tgt, LastSafe: 5, HasLastSafe: true})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = m.Run(ctx) }()
	defer func() { cancel(); <-done }()
	// A tick ran, its lease call failed.
	eventually(t, 15*time.Second, "a failed lease call", func() (bool, string) {
		m.mu.Lock()
		defer m.mu.Unlock()
		return m.leaseErr != "" && len(tgt.safes) > 0, fmt.Sprintf("lease error %q, safes %v", m.leaseErr, tgt.safes)
	})
	if st := m.Status(); st.State != StateWaiting || st.Allotment > 5 || st.Safe != 5 {
		t.Fatalf("etcd unreachable: %q allotment %d safe %d, want waiting at no more than the pinned 5", st.State, st.Allotment, st.Safe)
	}
	tgt.mu.Lock()
	defer tgt.mu.Unlock()
	for _, s := range tgt.sizes {
		if s > 5 {
			t.Fatalf("the pool was given sizes %v, want none past the pinned slice 5", tgt.sizes)
		}
	}
	for _, s := range tgt.safes {
		if s != 5 {
			t.Fatalf("the pool was given safe slices %v, want the pinned 5", tgt.safes)
		}
	}
}
