// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
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

// admittedOf is project's admitted count in s, 0 without state.
func admittedOf(s Snapshot, project string) uint64 {
	for _, ps := range s.Projects {
		if ps.Project == project {
			return ps.Admitted
		}
	}
	return 0
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

// manualTimer replaces a Residents' eviction wait: each Spawn that waits
// asks it for a timer, and the test decides when the wait is over.
type manualTimer struct {
	mu      sync.Mutex // guards the fields below
	asked   []time.Duration
	fire    []chan time.Time
	stopped int
}

func installManualTimer(r *Residents) *manualTimer {
	m := &manualTimer{}
	r.after = func(d time.Duration) (<-chan time.Time, func() bool) {
		m.mu.Lock()
		defer m.mu.Unlock()
		ch := make(chan time.Time, 1)
		m.asked = append(m.asked, d)
		m.fire = append(m.fire, ch)
		return ch, func() bool {
			m.mu.Lock()
			defer m.mu.Unlock()
			m.stopped++
			return true
		}
	}
	return m
}

// expire ends the i-th wait asked for.
func (m *manualTimer) expire(i int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.fire[i] <- time.Time{}
}

func (m *manualTimer) state() (asked []time.Duration, stopped int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]time.Duration(nil), m.asked...), m.stopped
}

func waitingSpawns(r *Residents, project string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	idx, ok := r.l.index[project]
	if !ok || int(idx) >= len(r.rp) {
		return 0
	}
	return r.rp[idx].waiting
}

func TestResidentsRefusesWhenNothingEvictable(t *testing.T) {
	// POOL 4, FLOOR 2: four projects with one object each are all under
	// their share (2), so nobody is an eligible victim.
	r := mustResidents(t, Config{Name: "residents", Size: 4, Floor: 2, EvictWait: 750 * time.Millisecond})
	tm := installManualTimer(r)
	for _, p := range []string{"a", "b", "c", "d"} {
		spawnN(t, r, p, 1)
	}
	done := make(chan error, 1)
	go func() {
		_, err := r.Spawn(context.Background(), "e", "e/0")
		done <- err
	}()
	waitFor(t, func() bool { return waitingSpawns(r, "e") == 1 })
	select {
	case err := <-done:
		t.Fatalf("spawn answered before its eviction wait ended: %v", err)
	default:
	}
	tm.expire(0)
	err := <-done
	var rf *Refusal
	if !errors.Is(err, ErrTooManyResidents) || !errors.Is(err, ErrRefused) || !errors.As(err, &rf) || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("want TOO_MANY_RESIDENTS, got %v", err)
	}
	if asked, stopped := tm.state(); len(asked) != 1 || asked[0] != 750*time.Millisecond || stopped != 1 {
		t.Fatalf("eviction waits asked %v (want one of the configured 750ms), stopped %d", asked, stopped)
	}
	if rf.RetryAfter <= 0 || rf.Project != "e" {
		t.Fatalf("refusal %+v", rf)
	}
	if n := waitingSpawns(r, "e"); n != 0 {
		t.Fatalf("%d spawns still counted waiting", n)
	}
	// ctx ending first: the error carries ctx.Err() too.
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		_, err := r.Spawn(ctx, "e", "e/0")
		done <- err
	}()
	waitFor(t, func() bool { return waitingSpawns(r, "e") == 1 })
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) || !errors.Is(err, ErrTooManyResidents) {
		t.Fatalf("ctx: %v", err)
	}
	checkCounts(t, r, 4, map[string]int{"a": 1, "b": 1, "c": 1, "d": 1}, nil)
}

// An eviction whose victim stayed awake is undone in one step: the spawner
// leaves and the victim is counted resident again, so in_use never exceeds
// the size and never undercounts the awake objects.
func TestResidentsUnevict(t *testing.T) {
	r := mustResidents(t, Config{Name: "residents", Size: 4, Floor: 1})
	big := spawnN(t, r, "big", 4)
	if err := r.Touch(big[0]); err != nil { // big/1 is now the idlest
		t.Fatal(err)
	}
	ev, err := r.Spawn(context.Background(), "small", "small/0")
	if err != nil {
		t.Fatal(err)
	}
	if ev.Object != big[1] {
		t.Fatalf("eviction %+v, want %s", ev, big[1])
	}
	checkCounts(t, r, 4, map[string]int{"big": 3, "small": 1}, map[string]int{"big": 1})
	if err := r.Unevict(ev, "small/0", true); err != nil {
		t.Fatal(err)
	}
	checkCounts(t, r, 4, map[string]int{"big": 4, "small": 0}, map[string]int{"big": 0})
	if err := r.Touch(big[1]); err != nil {
		t.Fatalf("victim is not resident again: %v", err)
	}
	if err := r.Touch("small/0"); !errors.Is(err, ErrUnknownObject) {
		t.Fatalf("forgotten spawner: %v", err)
	}
	if n := r.Snapshot().Evictions["big"][ev.Reason]; n != 0 {
		t.Fatalf("undone eviction still counted: %d", n)
	}
	// The undone spawn is one admission (small's), not two: the victim's
	// permit is held again, not admitted again.
	if s := r.Snapshot(); s.Admitted != 5 || admittedOf(s.Snapshot, "big") != 4 || admittedOf(s.Snapshot, "small") != 1 {
		t.Fatalf("admitted %d (big %d, small %d) after 4 spawns of big and one undone of small; want 5 (4, 1)",
			s.Admitted, admittedOf(s.Snapshot, "big"), admittedOf(s.Snapshot, "small"))
	}
	// The victim went back as its project's idlest: the next spawn names it
	// again (it was touched above, so big/2 is idlest now).
	ev, err = r.Spawn(context.Background(), "small", "small/0")
	if err != nil || ev.Object != big[2] {
		t.Fatalf("next eviction %+v, %v; want %s", ev, err, big[2])
	}
	// Keeping the spawner asleep instead of forgetting it.
	if err := r.Unevict(ev, "small/0", false); err != nil {
		t.Fatal(err)
	}
	checkCounts(t, r, 4, map[string]int{"big": 4, "small": 0}, map[string]int{"big": 0, "small": 1})
	ev, err = r.Spawn(context.Background(), "small", "small/0")
	if err != nil || ev.Object != big[2] {
		t.Fatalf("wake eviction %+v, %v; want %s again (unevicted as the idlest)", ev, err, big[2])
	}
	// A victim that its owner confirmed meanwhile (removed) is not woken:
	// only the spawner's residence is undone.
	if err := r.Remove(ev.Object); err != nil {
		t.Fatal(err)
	}
	if err := r.Unevict(ev, "small/0", false); !errors.Is(err, ErrUnknownObject) {
		t.Fatalf("unevicting a removed victim: %v", err)
	}
	checkCounts(t, r, 3, map[string]int{"big": 3, "small": 0}, map[string]int{"big": 0, "small": 1})
	if err := r.Unevict(ev, "small/0", false); !errors.Is(err, ErrNotResident) {
		t.Fatalf("unevicting for a sleeping spawner: %v", err)
	}
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
	waitFor(t, func() bool { return waitingSpawns(r, "e") == 1 })
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

// A pending object (woken by SpawnPending, not settled) is never a victim:
// its caller has not loaded it, so there is nothing to put to sleep. The
// spawn that would have named it names the project's next idlest, or waits,
// and a Settle lets it go on.
func TestResidentsPendingNeverAVictim(t *testing.T) {
	// An eviction wait of an hour: the blocked spawn below waits for the
	// Settle however slow the machine.
	r := mustResidents(t, Config{Name: "residents", Size: 2, Floor: 1, EvictWait: time.Hour})
	ctx := context.Background()
	// alpha's two objects: a0 pending, a1 settled, a0 the idlest.
	for _, o := range []string{"a0", "a1"} {
		if _, err := r.SpawnPending(ctx, "alpha", o); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.Settle("a1"); err != nil {
		t.Fatal(err)
	}
	// alpha is over its share alone: its idlest settled object goes.
	ev, err := r.Spawn(ctx, "alpha", "a2")
	if err != nil || ev.Object != "a1" {
		t.Fatalf("spawn of a2 evicted %+v (%v), want a1, passing over the pending a0", ev, err)
	}
	// a2, woken by Spawn, is no pending object: a3 takes its place.
	if ev, err := r.SpawnPending(ctx, "alpha", "a3"); err != nil || ev.Object != "a2" {
		t.Fatalf("spawn of a3 evicted %+v (%v), want a2", ev, err)
	}
	// Both of alpha's residents are pending now (a0, a3): a spawn of
	// alpha's waits, and a Settle of a0 lets it in.
	ev, done, err := r.TrySpawnPending("alpha", "a4")
	if done || err != nil {
		t.Fatalf("with only pending residents, a4 = %+v, done %v, %v; want to wait", ev, done, err)
	}
	got := make(chan Eviction, 1)
	go func() {
		ev, err := r.Spawn(ctx, "alpha", "a4")
		if err != nil {
			t.Error(err)
		}
		got <- ev
	}()
	waitBlocked(t, r)
	if err := r.Settle("a0"); err != nil {
		t.Fatal(err)
	}
	if ev := <-got; ev.Object != "a0" {
		t.Fatalf("after a0 settled, a4 evicted %+v, want a0", ev)
	}
	if err := r.Settle("a0"); !errors.Is(err, ErrNotResident) {
		t.Fatalf("settling an evicted object: %v, want ErrNotResident", err)
	}
	if err := r.Settle("nope"); !errors.Is(err, ErrUnknownObject) {
		t.Fatalf("settling an unknown object: %v, want ErrUnknownObject", err)
	}
}

// waitBlocked waits until a spawn blocks in r.
func waitBlocked(t *testing.T, r *Residents) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		r.mu.Lock()
		n := r.blocked
		r.mu.Unlock()
		if n > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("no spawn blocked")
		}
		time.Sleep(time.Millisecond)
	}
}

// When every resident of the project furthest over its share is pending,
// a spawn under its share evicts from the next project over its share
// rather than waiting.
func TestResidentsVictimPastPendingProject(t *testing.T) {
	r := mustResidents(t, Config{Name: "residents", Size: 6, Floor: 1, EvictWait: time.Hour})
	ctx := context.Background()
	// big: 3, all pending; mid: 2, settled; small arrives (share 2).
	for i := range 3 {
		if _, err := r.SpawnPending(ctx, "big", fmt.Sprintf("b%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	spawnN(t, r, "mid", 2)
	spawnN(t, r, "small", 1)
	ev, done, err := r.TrySpawnPending("small", "s1")
	if !done || err != nil || ev.Project != "mid" {
		t.Fatalf("small's spawn with big all pending: %+v done %v %v; want mid's idlest evicted", ev, done, err)
	}
}

// A victim whose owner did not confirm goes back as its project's most
// recently called object: the next spawns name the project's other objects
// first, and it again only once every other one has been named. Before, it
// went back as the idlest and was named by every spawn, so an owner that
// never confirmed kept its project over its share for good.
func TestResidentsUnconfirmedNamedLast(t *testing.T) {
	for seed := range 50 {
		rng := rand.New(rand.NewPCG(uint64(seed), 7))
		size := 4 + rng.IntN(12)
		r := mustResidents(t, Config{Name: "residents", Size: size, Floor: 1})
		big := spawnN(t, r, "big", size)
		// Random calls give big a random idleness order.
		for range 3 * size {
			if err := r.Touch(big[rng.IntN(size)]); err != nil {
				t.Fatal(err)
			}
		}
		named := map[string]int{}
		for round := range 3 * size {
			ev, err := r.Spawn(context.Background(), "small", "small/0")
			if err != nil {
				t.Fatalf("seed %d round %d: %v", seed, round, err)
			}
			if ev.Project != "big" {
				t.Fatalf("seed %d round %d: eviction %+v", seed, round, ev)
			}
			// Every object is named once before any is named twice.
			if named[ev.Object] != round/size {
				t.Fatalf("seed %d round %d: %s named %d times before, while others were named %d times",
					seed, round, ev.Object, named[ev.Object], round/size)
			}
			named[ev.Object]++
			if err := r.Unconfirmed(ev, "small/0", rng.IntN(2) == 0); err != nil {
				t.Fatal(err)
			}
			if s := r.Snapshot(); s.InUse != size || s.Evictions["big"] != nil {
				t.Fatalf("seed %d round %d: in use %d evictions %v after the undo", seed, round, s.InUse, s.Evictions)
			}
			// Settle reads residence without calling the object.
			if err := r.Settle(ev.Object); err != nil {
				t.Fatalf("seed %d: the unconfirmed victim is not resident again: %v", seed, err)
			}
		}
	}
}

// Drop puts an unconfirmed object to sleep without its owner and Dropped
// keeps a named victim asleep; both count under EvictUnconfirmed, and the
// permits they free go to the next spawn.
func TestResidentsDrop(t *testing.T) {
	r := mustResidents(t, Config{Name: "residents", Size: 3, Floor: 1})
	big := spawnN(t, r, "big", 3)
	ev, err := r.Spawn(context.Background(), "small", "s0")
	if err != nil || ev.Object != big[0] || ev.Reason != EvictFurthestOverShare {
		t.Fatalf("eviction %+v, %v", ev, err)
	}
	if err := r.Dropped(ev); err != nil {
		t.Fatal(err)
	}
	if err := r.Drop(big[1]); err != nil {
		t.Fatal(err)
	}
	checkCounts(t, r, 2, map[string]int{"big": 1, "small": 1}, map[string]int{"big": 2})
	if got := r.Snapshot().Evictions["big"]; got[EvictUnconfirmed] != 2 || got[EvictFurthestOverShare] != 0 {
		t.Fatalf("evictions of big %v, want 2 unconfirmed", got)
	}
	// The dropped permit is room: a newcomer spawns without evicting.
	if ev, err := r.Spawn(context.Background(), "new", "n0"); err != nil || ev != (Eviction{}) {
		t.Fatalf("spawn after the drops: %+v, %v", ev, err)
	}
	if err := r.Drop(big[1]); !errors.Is(err, ErrNotResident) {
		t.Fatalf("dropping an asleep object: %v", err)
	}
	if err := r.Drop("nope"); !errors.Is(err, ErrUnknownObject) {
		t.Fatalf("dropping an unknown object: %v", err)
	}
	if err := r.Dropped(Eviction{Project: "big", Object: big[2], Reason: EvictOwnIdlest}); !errors.Is(err, ErrNotResident) {
		t.Fatalf("Dropped of an awake object: %v", err)
	}
}
