// SPDX-License-Identifier: Apache-2.0

package permitd_test

import (
	"context"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"path/filepath"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/client"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/permitd"
	"github.com/fairshare-dev/fairshare/pools"
)

// await receives from ch; like eventually, its deadline only bounds a
// failure.
func await[T any](t *testing.T, what string, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
	var zero T
	return zero
}

// TestStrikesOnlyWhenAskedInTime: an owner that leaves an eviction
// unconfirmed is struck only when it was asked within the first half of the
// spawn's second (permitd.EvictionWait); asked later, it had no fair time
// to answer. Each trial brings an owner that never confirms to two strikes
// (evictions named at once), then plays rounds in which a spawn waits for a
// victim because every resident is still being spawned, the server's
// clock advances by d, and then an object of the owner becomes evictable
// and is named: its owner is asked d after the spawn began. Every d past the
// half (any number of them in a row) leaves the owner's objects alone and
// its count at two; the first d at or below the half is its third
// unconfirmed eviction in a row, and the victim is dropped. The d are drawn
// around the half: by a nanosecond, by up to a millisecond, or by up to the
// half.
func TestStrikesOnlyWhenAskedInTime(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := mrand.New(mrand.NewPCG(seed, 7))
	half := permitd.EvictionWait / 2
	// off is how far from the half a round's d is: a nanosecond (or, when
	// zero, possibly nothing), up to a millisecond, or up to the half.
	off := func(zero bool) time.Duration {
		switch rng.IntN(3) {
		case 0:
			if zero && rng.IntN(2) == 0 {
				return 0
			}
			return time.Nanosecond
		case 1:
			return time.Duration(1 + rng.Int64N(int64(time.Millisecond)))
		}
		return time.Duration(1 + rng.Int64N(int64(half)))
	}
	for trial := range 8 {
		// Rounds asked late, 0 to 5 of them (5 in trial 0), then one
		// asked in time.
		var ds []time.Duration
		for range []int{5, 0, 1, 2, 3, 4, 1 + rng.IntN(5), 1 + rng.IntN(5)}[trial] {
			ds = append(ds, half+off(false))
		}
		ds = append(ds, half-off(true))
		t.Run(fmt.Sprint(trial), func(t *testing.T) { strikesOnlyInTime(t, ds) })
	}
}

// strikesOnlyInTime is a trial of TestStrikesOnlyWhenAskedInTime, with a
// round for each d; the last d must be at or below the half, the others
// past it.
//
// The residents pool holds 3 objects of one project, so a spawn on a full
// pool names the project's idlest object not being spawned. Its runtimes are
// owner (which never confirms an eviction), helper (which confirms when the
// test says), spawner and parker. In a round, owner's spawn of a new object
// names helper's h, and waits, pending, for helper to confirm; spawner's
// spawn then finds no object to name (the others are parker's spawns,
// pending too, of owner's two objects left unconfirmed) and waits in the
// pool. The test advances the clock by d and lets helper confirm: owner's
// spawn is admitted, its object settles, and spawner's spawn names it at
// once.
func strikesOnlyInTime(t *testing.T, ds []time.Duration) {
	half := permitd.EvictionWait / 2
	clk := testutil.NewFakeClock()
	timers, log := &spawnTimers{}, &eventLog{}
	f := startWith(t, filepath.Join(t.TempDir(), "permits.sock"), pools.Config{Name: "flights", Size: 4},
		pools.Config{Name: "residents", Size: 3, EvictWait: time.Hour},
		func(s *permitd.Server) {
			permitd.SetSpawnTimer(s, timers.after)
			permitd.SetClock(s, clk.Now)
			permitd.SetEvents(s, log.add)
		})
	ctx := context.Background()
	owner := newRuntime(t, f, true)
	spawner := dial(t, f, client.Options{})
	parker := dial(t, f, client.Options{})
	asked, release, over := make(chan client.Eviction, 8), make(chan struct{}), make(chan struct{})
	helper := dial(t, f, client.Options{OnEvict: func(ev client.Eviction) error {
		asked <- ev
		select {
		case <-release:
			return nil
		case <-over:
			return errors.New("test over")
		}
	}})
	t.Cleanup(func() { close(over) }) // runs before the clients close

	// Two evictions of owner's objects, named at once (so asked in
	// time) and left unconfirmed: two strikes, nothing dropped.
	spawnAll(t, owner.Client, "p", "x1", "x2", "x3")
	for i, want := range []string{"x1", "x2"} {
		n := len(owner.evictions())
		answered := make(chan error, 1)
		go func() {
			_, err := spawner.Spawn(ctx, "p", fmt.Sprintf("first%d", i))
			answered <- err
		}()
		eventually(t, "the eviction of "+want, func() bool { return len(owner.evictions()) == n+1 })
		if got := owner.evictions()[n].Object; got != want {
			t.Fatalf("unconfirmed eviction %d named %s, want %s (one left unconfirmed before goes back as the most recent)", i+1, got, want)
		}
		timers.expireLast(t)
		if err := await(t, "the spawn", answered); !errors.Is(err, client.ErrTooManyResidents) {
			t.Fatalf("spawn with its victim unconfirmed: %v, want TOO_MANY_RESIDENTS", err)
		}
		if s := f.srv.Snapshot().Residents; len(s.Dropped) != 0 || len(log.drops()) != 0 {
			t.Fatalf("after %d unconfirmed evictions: dropped %v, published %v", i+1, s.Dropped, log.drops())
		}
	}
	// owner puts x3 to sleep unasked (no confirmation: its count stays),
	// helper takes the room, and parker's spawns name x1 and x2, which
	// owner leaves unconfirmed too. Their deadlines never pass: those
	// spawns keep x1 and x2 from being named again, and end with the
	// trial, at no strike (the spawner left).
	if err := owner.Sleep(ctx, "x3"); err != nil {
		t.Fatal(err)
	}
	spawnAll(t, helper, "p", "h")
	parked := make(chan error, 2)
	for i, want := range []string{"x1", "x2"} {
		n := len(owner.evictions())
		go func() {
			_, err := parker.Spawn(ctx, "p", fmt.Sprintf("q%d", i))
			parked <- err
		}()
		eventually(t, "the eviction of "+want, func() bool { return len(owner.evictions()) == n+1 })
		if got := owner.evictions()[n].Object; got != want {
			t.Fatalf("parker's spawn named %s, want %s", got, want)
		}
	}

	for k, d := range ds {
		x, sp := fmt.Sprintf("x%d", k+4), fmt.Sprintf("s%d", k)
		n := timers.count()
		spawned := make(chan error, 1)
		go func() {
			_, err := owner.Spawn(ctx, "p", x)
			spawned <- err
		}()
		if ev := await(t, "helper's eviction", asked); ev.Object != "h" {
			t.Fatalf("round %d: owner's spawn named %s, want h", k, ev.Object)
		}
		eventually(t, "owner's spawn to start", func() bool { return timers.count() == n+1 })
		answered := make(chan error, 1)
		go func() {
			_, err := spawner.Spawn(ctx, "p", sp)
			answered <- err
		}()
		// The spawn has read the clock (it starts its deadline after)
		// and found no victim: owner's object is pending until helper
		// confirms.
		eventually(t, "spawner's spawn to start", func() bool { return timers.count() == n+2 })
		clk.Advance(d)
		before := len(owner.evictions())
		release <- struct{}{}
		if err := await(t, "owner's spawn", spawned); err != nil {
			t.Fatalf("round %d: owner's spawn of %s: %v", k, x, err)
		}
		eventually(t, "the late eviction", func() bool { return len(owner.evictions()) == before+1 })
		if ev := owner.evictions()[before]; ev.Object != x {
			t.Fatalf("round %d: spawner's spawn named %s, want %s", k, ev.Object, x)
		}
		timers.expireLast(t)
		err := await(t, "spawner's spawn", answered)
		s := f.srv.Snapshot().Residents
		if d > half {
			// Not struck: refused, the victim resident again for its
			// owner and the pool, nothing dropped or published.
			if !errors.Is(err, client.ErrTooManyResidents) || len(s.Dropped) != 0 || len(log.drops()) != 0 {
				t.Fatalf("round %d: owner asked %v after the spawn began (past %v) was struck: spawn %v, dropped %v, published %v",
					k, d, half, err, s.Dropped, log.drops())
			}
			if err := owner.Touch(ctx, x); err != nil {
				t.Fatalf("round %d: a call on %s, not dropped: %v", k, x, err)
			}
			// Unasked, so no confirmation; room for helper.
			if err := owner.Sleep(ctx, x); err != nil {
				t.Fatal(err)
			}
			spawnAll(t, helper, "p", "h")
			continue
		}
		// The third unconfirmed eviction in a row: the victim is dropped,
		// its permit is the spawn's, and owner is told.
		if err != nil || s.Dropped["p"] != 1 || s.Pool.Evictions["p"][pools.EvictUnconfirmed] != 1 ||
			fmt.Sprint(log.drops()) != fmt.Sprint([]string{x}) {
			t.Fatalf("round %d: owner asked %v after the spawn began (at most %v) was not dropped: spawn %v, dropped %v, evictions %v, published %v",
				k, d, half, err, s.Dropped, s.Pool.Evictions, log.drops())
		}
		if k != len(ds)-1 {
			t.Fatalf("round %d of %d asked in time", k, len(ds))
		}
		eventually(t, "the dropped event", func() bool {
			evs := owner.evictions()
			return evs[len(evs)-1].Reason == client.ReasonDropped
		})
		var dropped []string
		for _, ev := range owner.evictions() {
			if ev.Reason == client.ReasonDropped {
				dropped = append(dropped, ev.Object)
			}
		}
		if fmt.Sprint(dropped) != fmt.Sprint([]string{x}) {
			t.Fatalf("owner was told of drops %v, want only %s", dropped, x)
		}
		t.Logf("%d rounds asked late (%v), then one at %v: dropped %s", k, ds[:k], d, x)
		return
	}
	t.Fatal("no round asked in time")
}
