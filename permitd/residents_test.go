// SPDX-License-Identifier: Apache-2.0

package permitd_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/fairshare-dev/fairshare/client"
	"github.com/fairshare-dev/fairshare/pools"
)

// runtime is a client whose evictions are recorded and, unless refuse is
// set, obeyed.
type runtime struct {
	*client.Client
	mu      sync.Mutex
	evicted []client.Eviction
	refuse  bool
}

func newRuntime(t *testing.T, f *fixture, refuse bool) *runtime {
	rt := &runtime{refuse: refuse}
	rt.Client = dial(t, f, client.Options{OnEvict: func(ev client.Eviction) error {
		rt.mu.Lock()
		defer rt.mu.Unlock()
		rt.evicted = append(rt.evicted, ev)
		if rt.refuse {
			return errors.New("busy")
		}
		return nil
	}})
	return rt
}

func (rt *runtime) evictions() []client.Eviction {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	return append([]client.Eviction(nil), rt.evicted...)
}

func spawnAll(t *testing.T, c *client.Client, project string, objects ...string) {
	t.Helper()
	for _, o := range objects {
		if _, err := c.Spawn(context.Background(), project, o); err != nil {
			t.Fatalf("spawn %s/%s: %v", project, o, err)
		}
	}
}

// Two runtimes compete for a residents pool of 4. The big project fills it
// alone; the small one arrives under its share and evicts the big one's
// idlest object; the big one, over its share, then evicts its own idlest.
func TestEvictionBetweenTwoRuntimes(t *testing.T) {
	f := start(t, 4, 4)
	big := newRuntime(t, f, false)
	small := newRuntime(t, f, false)
	ctx := context.Background()

	spawnAll(t, big.Client, "big", "a1", "a2", "a3", "a4")
	// A call on a1 makes a2 the idlest.
	if err := big.Touch(ctx, "a1"); err != nil {
		t.Fatal(err)
	}
	if _, err := small.Spawn(ctx, "small", "b1"); err != nil {
		t.Fatalf("small spawn on a full pool: %v", err)
	}
	want := client.Eviction{Project: "big", Object: "a2", Reason: pools.EvictFurthestOverShare}
	if got := big.evictions(); len(got) != 1 || got[0] != want {
		t.Fatalf("big was asked to evict %+v, want [%+v]", got, want)
	}
	if got := small.evictions(); len(got) != 0 {
		t.Fatalf("small was asked to evict %+v", got)
	}
	// Touching the sleeping object is an error; spawning it is the wake.
	if err := big.Touch(ctx, "a2"); err == nil {
		t.Fatal("touch of a sleeping object succeeded")
	}

	// big holds 3 >= share 2: its own idlest (a3) makes room for a5.
	if _, err := big.Spawn(ctx, "big", "a5"); err != nil {
		t.Fatalf("big spawn over share: %v", err)
	}
	want = client.Eviction{Project: "big", Object: "a3", Reason: pools.EvictOwnIdlest}
	if got := big.evictions(); len(got) != 2 || got[1] != want {
		t.Fatalf("big's evictions %+v, want second %+v", got, want)
	}

	s := f.srv.Snapshot()
	r := s.Residents
	if r.Resident["big"] != 3 || r.Resident["small"] != 1 || r.Sleeping["big"] != 2 || r.Evicting != 0 {
		t.Fatalf("residents resident=%v sleeping=%v evicting=%d", r.Resident, r.Sleeping, r.Evicting)
	}
	if r.Pool.InUse != 4 || r.Pool.Evictions["big"][pools.EvictOwnIdlest] != 1 || r.Pool.Evictions["big"][pools.EvictFurthestOverShare] != 1 {
		t.Fatalf("pool view: in use %d evictions %v", r.Pool.InUse, r.Pool.Evictions)
	}
	if r.EvictSent[pools.EvictOwnIdlest] != 1 || r.EvictSent[pools.EvictFurthestOverShare] != 1 {
		t.Fatalf("evict events sent %v", r.EvictSent)
	}

	// Waking a2 is a spawn; big is over its share, so its idlest goes (a4).
	if _, err := big.Spawn(ctx, "big", "a2"); err != nil {
		t.Fatalf("wake a2: %v", err)
	}
	if got := big.evictions(); len(got) != 3 || got[2].Object != "a4" {
		t.Fatalf("wake evicted %+v, want a4", got)
	}
}

// When the runtime owning the victim does not put it to sleep within a
// second, the spawn is refused with TOO_MANY_RESIDENTS and its permit is
// given back.
func TestEvictionNotConfirmedRefuses(t *testing.T) {
	f := start(t, 4, 4)
	big := newRuntime(t, f, true)
	small := newRuntime(t, f, false)
	ctx := context.Background()
	spawnAll(t, big.Client, "big", "a1", "a2", "a3", "a4")
	_, err := small.Spawn(ctx, "small", "b1")
	var pe *client.Error
	if !errors.Is(err, client.ErrTooManyResidents) || !errors.As(err, &pe) || pe.RetryAfter <= 0 {
		t.Fatalf("spawn with an uncooperative owner = %v, want TOO_MANY_RESIDENTS with retry", err)
	}
	if got := big.evictions(); len(got) != 1 || got[0].Object != "a1" {
		t.Fatalf("evictions %+v, want a1", got)
	}
	s := f.srv.Snapshot().Residents
	if s.Resident["small"] != 0 || s.Evicting != 1 || s.Spawning != 0 {
		t.Fatalf("after refusal: resident %v evicting %d spawning %d", s.Resident, s.Evicting, s.Spawning)
	}
	// The late confirmation is accepted and settles the books.
	if err := big.Sleep(ctx, "a1"); err != nil {
		t.Fatalf("late sleep: %v", err)
	}
	s = f.srv.Snapshot().Residents
	if s.Evicting != 0 || s.Sleeping["big"] != 1 || s.Pool.InUse != 3 {
		t.Fatalf("after late sleep: evicting %d sleeping %v in use %d", s.Evicting, s.Sleeping, s.Pool.InUse)
	}
}

func TestSpawnConflicts(t *testing.T) {
	f := start(t, 4, 4)
	a := newRuntime(t, f, false)
	b := newRuntime(t, f, false)
	ctx := context.Background()
	spawnAll(t, a.Client, "p", "shared")
	if _, err := b.Spawn(ctx, "p", "shared"); err == nil {
		t.Fatal("second session spawned an object the first owns")
	}
	if _, err := a.Spawn(ctx, "q", "shared"); err == nil {
		t.Fatal("object spawned again under another project")
	}
	if err := b.Sleep(ctx, "shared"); err == nil {
		t.Fatal("a stranger put the object to sleep")
	}
	// Spawning a resident object again is a touch.
	if _, err := a.Spawn(ctx, "p", "shared"); err != nil {
		t.Fatal(err)
	}
	if got := f.residents.Snapshot().InUse; got != 1 {
		t.Fatalf("in use %d, want 1", got)
	}
}

// The daemon keeps no residents on disk; a restarted daemon learns them from
// the runtime's re-registration, in idleness order.
func TestResidentsSurviveDaemonRestart(t *testing.T) {
	f := start(t, 4, 3)
	reconnected := make(chan error, 1)
	var rtMu sync.Mutex
	var evicted []client.Eviction
	rt := dial(t, f, client.Options{
		Reconnect:   true,
		OnReconnect: func(err error) { reconnected <- err },
		OnEvict: func(ev client.Eviction) error {
			rtMu.Lock()
			evicted = append(evicted, ev)
			rtMu.Unlock()
			return nil
		},
	})
	ctx := context.Background()
	spawnAll(t, rt, "p", "o1", "o2", "o3")
	if err := rt.Touch(ctx, "o1"); err != nil { // idleness order now o2, o3, o1
		t.Fatal(err)
	}
	flight, err := rt.Acquire(ctx, "flights", "p")
	if err != nil {
		t.Fatal(err)
	}

	sock := f.sock
	f.stop()
	f2 := startAt(t, sock, 4, 3)
	if err := <-reconnected; err != nil {
		t.Fatalf("re-registration: %v", err)
	}
	s := f2.srv.Snapshot()
	if s.Residents.Resident["p"] != 3 || s.Residents.Pool.InUse != 3 {
		t.Fatalf("after restart: resident %v in use %d, want p:3", s.Residents.Resident, s.Residents.Pool.InUse)
	}
	// The flight lease ended with the old daemon; releasing it is a no-op.
	if ok, err := rt.Release(ctx, flight); err != nil || ok {
		t.Fatalf("release of a pre-restart lease = %v, %v", ok, err)
	}
	// A newcomer under its share evicts p's idlest, which must still be o2.
	other := dial(t, f2, client.Options{})
	if _, err := other.Spawn(ctx, "q", "x1"); err != nil {
		t.Fatal(err)
	}
	rtMu.Lock()
	defer rtMu.Unlock()
	if len(evicted) != 1 || evicted[0].Object != "o2" {
		t.Fatalf("evicted %v after restart, want o2 (idlest kept across restart)", fmt.Sprint(evicted))
	}
}
