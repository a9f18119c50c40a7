// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"
)

func mustResidents(t testing.TB, cfg Config) *Residents {
	t.Helper()
	r, err := NewResidents(cfg, newFakeClock())
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func spawnN(t testing.TB, r *Residents, project string, n int) []string {
	t.Helper()
	var names []string
	for i := 0; i < n; i++ {
		name := fmt.Sprintf("%s/%d", project, i)
		ev, err := r.Spawn(context.Background(), project, name)
		if err != nil {
			t.Fatalf("spawn %s: %v", name, err)
		}
		if ev != (Eviction{}) {
			t.Fatalf("spawn %s evicted %+v on a node with room", name, ev)
		}
		names = append(names, name)
	}
	return names
}

func checkCounts(t testing.TB, r *Residents, inUse int, held map[string]int, sleeping map[string]int) {
	t.Helper()
	s := r.Snapshot()
	if s.InUse != inUse {
		t.Fatalf("in_use %d, want %d", s.InUse, inUse)
	}
	for _, ps := range s.Projects {
		if ps.Held != held[ps.Project] {
			t.Fatalf("%s holds %d, want %d", ps.Project, ps.Held, held[ps.Project])
		}
	}
	for p, n := range sleeping {
		if s.Sleeping[p] != n {
			t.Fatalf("%s has %d sleeping, want %d (%v)", p, s.Sleeping[p], n, s.Sleeping)
		}
	}
}

func TestResidentsNothingEvictedWithRoom(t *testing.T) {
	r := mustResidents(t, Config{Name: "residents", Size: 20})
	spawnN(t, r, "a", 10)
	spawnN(t, r, "b", 9)
	spawnN(t, r, "a", 0)
	checkCounts(t, r, 19, map[string]int{"a": 10, "b": 9}, nil)
	if s := r.Snapshot(); len(s.Evictions) != 0 {
		t.Fatalf("evictions %v", s.Evictions)
	}
}

func TestResidentsOverShareEvictsOwnIdlest(t *testing.T) {
	r := mustResidents(t, Config{Name: "residents", Size: 10}) // floor 1
	spawnN(t, r, "b", 1)
	a := spawnN(t, r, "a", 8) // a: 8 > share 5; in_use 9 = POOL-FLOOR
	// Calls make a/0 the most recent and a/1 the idlest.
	for _, o := range []string{a[2], a[3], a[4], a[5], a[6], a[7], a[0]} {
		if err := r.Touch(o); err != nil {
			t.Fatal(err)
		}
	}
	ev, err := r.Spawn(context.Background(), "a", "a/new")
	if err != nil {
		t.Fatal(err)
	}
	if want := (Eviction{Project: "a", Object: a[1], Reason: EvictOwnIdlest}); ev != want {
		t.Fatalf("eviction %+v, want %+v", ev, want)
	}
	checkCounts(t, r, 9, map[string]int{"a": 8, "b": 1}, map[string]int{"a": 1})
	if err := r.Touch(a[1]); !errors.Is(err, ErrNotResident) {
		t.Fatalf("touching the victim: %v", err)
	}
	if got := r.Snapshot().Evictions["a"][EvictOwnIdlest]; got != 1 {
		t.Fatalf("eviction count %d", got)
	}
}

func TestResidentsUnderShareEvictsFurthestOver(t *testing.T) {
	r := mustResidents(t, Config{Name: "residents", Size: 12}) // floor 1
	big := spawnN(t, r, "big", 7)
	spawnN(t, r, "mid", 4)
	spawnN(t, r, "small", 1) // full: 12/12, share 4
	// small is under share: the victim is big's idlest (big/0 after touches
	// of the others), not mid's (mid is at its share but holds less).
	for _, o := range big[1:] {
		if err := r.Touch(o); err != nil {
			t.Fatal(err)
		}
	}
	ev, err := r.Spawn(context.Background(), "small", "small/new")
	if err != nil {
		t.Fatal(err)
	}
	if want := (Eviction{Project: "big", Object: big[0], Reason: EvictFurthestOverShare}); ev != want {
		t.Fatalf("eviction %+v, want %+v", ev, want)
	}
	checkCounts(t, r, 12, map[string]int{"big": 6, "mid": 4, "small": 2}, map[string]int{"big": 1})
	if got := r.Snapshot().Evictions["big"][EvictFurthestOverShare]; got != 1 {
		t.Fatalf("eviction count %d", got)
	}
	// Waking the victim: big is over share and evicts its own idlest.
	ev, err = r.Spawn(context.Background(), "big", big[0])
	if err != nil {
		t.Fatal(err)
	}
	if ev.Project != "big" || ev.Reason != EvictOwnIdlest || ev.Object != big[1] {
		t.Fatalf("wake eviction %+v", ev)
	}
	checkCounts(t, r, 12, map[string]int{"big": 6, "mid": 4, "small": 2}, map[string]int{"big": 1})
}

func TestResidentsRefusesWhenNothingEvictable(t *testing.T) {
	// POOL 4, FLOOR 2: four projects with one object each are all under
	// their share (2), so nobody is an eligible victim.
	r := mustResidents(t, Config{Name: "residents", Size: 4, Floor: 2})
	for _, p := range []string{"a", "b", "c", "d"} {
		spawnN(t, r, p, 1)
	}
	start := time.Now()
	_, err := r.Spawn(context.Background(), "e", "e/0")
	waited := time.Since(start)
	var rf *Refusal
	if !errors.Is(err, ErrTooManyResidents) || !errors.Is(err, ErrRefused) || !errors.As(err, &rf) {
		t.Fatalf("want TOO_MANY_RESIDENTS, got %v", err)
	}
	if waited < DefaultEvictWait {
		t.Fatalf("refused after %v, before the eviction wait", waited)
	}
	if rf.RetryAfter <= 0 || rf.Project != "e" {
		t.Fatalf("refusal %+v", rf)
	}
	// ctx ending first: the error carries ctx.Err() too.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	if _, err := r.Spawn(ctx, "e", "e/0"); !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, ErrTooManyResidents) {
		t.Fatalf("ctx: %v", err)
	}
	checkCounts(t, r, 4, map[string]int{"a": 1, "b": 1, "c": 1, "d": 1}, nil)
}

func TestResidentsWaitingSpawnGetsRoom(t *testing.T) {
	r := mustResidents(t, Config{Name: "residents", Size: 4, Floor: 2})
	for _, p := range []string{"a", "b", "c", "d"} {
		spawnN(t, r, p, 1)
	}
	done := make(chan error, 1)
	go func() {
		ev, err := r.Spawn(context.Background(), "e", "e/0")
		if err == nil && ev != (Eviction{}) {
			err = fmt.Errorf("unexpected eviction %+v", ev)
		}
		done <- err
	}()
	waitFor(t, func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		idx, ok := r.l.index["e"]
		return ok && int(idx) < len(r.rp) && r.rp[idx].waiting == 1
	})
	if err := r.Sleep("a/0"); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	checkCounts(t, r, 4, map[string]int{"a": 0, "b": 1, "c": 1, "d": 1, "e": 1}, map[string]int{"a": 1})
}

func TestResidentsLifecycleCounts(t *testing.T) {
	r := mustResidents(t, Config{Name: "residents", Size: 10})
	objs := spawnN(t, r, "a", 3)
	ctx := context.Background()
	if err := r.Sleep(objs[0]); err != nil {
		t.Fatal(err)
	}
	if err := r.Sleep(objs[0]); !errors.Is(err, ErrNotResident) {
		t.Fatalf("sleeping twice: %v", err)
	}
	checkCounts(t, r, 2, map[string]int{"a": 2}, map[string]int{"a": 1})
	if _, err := r.Spawn(ctx, "a", objs[0]); err != nil { // wake
		t.Fatal(err)
	}
	if _, err := r.Spawn(ctx, "a", objs[0]); err != nil { // already awake: a call
		t.Fatal(err)
	}
	checkCounts(t, r, 3, map[string]int{"a": 3}, map[string]int{"a": 0})
	if _, err := r.Spawn(ctx, "b", objs[0]); !errors.Is(err, ErrObjectProject) {
		t.Fatalf("spawn under another project: %v", err)
	}
	if err := r.Sleep(objs[1]); err != nil {
		t.Fatal(err)
	}
	if err := r.Remove(objs[1]); err != nil { // sleeping, removed
		t.Fatal(err)
	}
	if err := r.Remove(objs[2]); err != nil { // awake, removed
		t.Fatal(err)
	}
	for _, fn := range []func(string) error{r.Touch, r.Sleep, r.Remove} {
		if err := fn(objs[1]); !errors.Is(err, ErrUnknownObject) {
			t.Fatalf("removed object: %v", err)
		}
	}
	checkCounts(t, r, 1, map[string]int{"a": 1}, map[string]int{"a": 0})
	if err := r.Remove(objs[0]); err != nil {
		t.Fatal(err)
	}
	checkCounts(t, r, 0, map[string]int{}, nil)
}

// TestResidentsVictimInvariant checks on random sequences that a victim
// always comes from the spawner itself (at/over share) or from a project
// holding the most among those at or over their share, and is that
// project's least recently called object; and that in_use never exceeds POOL.
func TestResidentsVictimInvariant(t *testing.T) {
	for seed := 0; seed < 200; seed++ {
		r := mustResidents(t, Config{Name: "residents", Size: 8 + seed%17, EvictWait: time.Millisecond})
		lru := map[string][]string{} // project -> awake objects, idlest first
		owner := map[string]string{}
		x := uint64(seed)*0x9e3779b97f4a7c15 + 1
		rnd := func(n int) int { x ^= x << 13; x ^= x >> 7; x ^= x << 17; return int(x % uint64(n)) }
		for step := 0; step < 400; step++ {
			pr := fmt.Sprint("p", rnd(5))
			switch rnd(3) {
			case 0, 1:
				name := fmt.Sprintf("%s/%d", pr, rnd(12))
				if o, ok := owner[name]; ok && o != pr {
					continue
				}
				before := r.Snapshot()
				ev, err := r.Spawn(context.Background(), pr, name)
				if errors.Is(err, ErrTooManyResidents) {
					continue
				}
				if err != nil {
					t.Fatal(err)
				}
				if ev != (Eviction{}) {
					held := map[string]int{}
					for _, ps := range before.Projects {
						held[ps.Project] = ps.Held
					}
					if ev.Reason == EvictOwnIdlest && (ev.Project != pr || held[pr] < before.Share) {
						t.Fatalf("seed %d: own-idlest for %s with held %d share %d", seed, pr, held[pr], before.Share)
					}
					if ev.Reason == EvictFurthestOverShare {
						for p, h := range held {
							if h > held[ev.Project] {
								t.Fatalf("seed %d: victim %s holds %d, %s holds %d", seed, ev.Project, held[ev.Project], p, h)
							}
						}
						if held[ev.Project] < before.Share || held[pr] >= before.Share {
							t.Fatalf("seed %d: bad furthest-over-share %+v", seed, ev)
						}
					}
					if l := lru[ev.Project]; len(l) == 0 || l[0] != ev.Object {
						t.Fatalf("seed %d: victim %s is not the idlest of %v", seed, ev.Object, l)
					}
					lru[ev.Project] = lru[ev.Project][1:]
				}
				owner[name] = pr
				lru[pr] = append(remove(lru[pr], name), name)
			case 2:
				l := lru[pr]
				if len(l) == 0 {
					continue
				}
				name := l[rnd(len(l))]
				switch rnd(3) {
				case 0:
					if err := r.Touch(name); err != nil {
						t.Fatal(err)
					}
					lru[pr] = append(remove(l, name), name)
				case 1:
					if err := r.Sleep(name); err != nil {
						t.Fatal(err)
					}
					lru[pr] = remove(l, name)
				case 2:
					if err := r.Remove(name); err != nil {
						t.Fatal(err)
					}
					lru[pr] = remove(l, name)
					delete(owner, name)
				}
			}
			s := r.Snapshot()
			total := 0
			for _, l := range lru {
				total += len(l)
			}
			if s.InUse > s.Size || s.InUse != total {
				t.Fatalf("seed %d: in_use %d (model %d, size %d)", seed, s.InUse, total, s.Size)
			}
		}
	}
}

func remove(l []string, name string) []string {
	out := l[:0:0]
	for _, s := range l {
		if s != name {
			out = append(out, s)
		}
	}
	return out
}
