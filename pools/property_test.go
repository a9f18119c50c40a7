// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

// oracle is a naive model of the rule: maps and full scans, no cleverness.
// Asks are stamped with the time of the recompute that follows them (the
// earliest moment the pool can vouch for), as the pool does, so a project
// leaves the active set only when its last ask is surely a window old.
type oracle struct {
	size, floor int
	window      time.Duration
	held        map[string]int
	stamp       map[string]time.Time
	active      map[string]bool
	fresh       map[string]bool // asked or released since the last recompute
}

func (o *oracle) inUse() int {
	n := 0
	for _, h := range o.held {
		n += h
	}
	return n
}

func (o *oracle) share() int { return Share(o.size, o.floor, len(o.active)) }

func (o *oracle) ask(p string) bool {
	o.fresh[p] = true
	o.active[p] = true
	if !Admits(o.inUse(), o.held[p], o.size, o.floor, o.share()) {
		return false
	}
	o.held[p]++
	return true
}

func (o *oracle) release(p string) {
	o.held[p]--
	o.fresh[p] = true
}

func (o *oracle) recompute(now time.Time) {
	for p := range o.fresh {
		o.stamp[p] = now
	}
	clear(o.fresh)
	for p := range o.active {
		if o.held[p] == 0 && !o.stamp[p].After(now.Add(-o.window)) {
			delete(o.active, p)
		}
	}
}

// runOps drives a Pool and the oracle with the operations encoded in ops and
// checks that they agree at every step and that the invariants hold: in_use
// never exceeds POOL; a project at or over its share never pushes in_use past
// POOL-FLOOR; a newcomer gets its floor whenever in_use <= POOL-FLOOR; and
// everything returns to zero at the end.
func runOps(t *testing.T, ops []byte) {
	if len(ops) < 2 {
		return
	}
	size := 1 + int(ops[0])%40
	floor := int(ops[1]) % (size + 1) // 0 = default
	ops = ops[2:]
	clk := newFakeClock()
	p, err := New(Config{Name: "prop", Size: size, Floor: floor}, clk)
	if err != nil {
		t.Fatal(err)
	}
	if floor == 0 {
		floor = DefaultFloor(size)
	}
	o := &oracle{size: size, floor: floor, window: time.Second, held: map[string]int{},
		stamp: map[string]time.Time{}, active: map[string]bool{}, fresh: map[string]bool{}}
	permits := map[string][]Permit{}
	const nProjects = 6
	newcomers := 0
	next := func() byte {
		if len(ops) == 0 {
			return 0
		}
		b := ops[0]
		ops = ops[1:]
		return b
	}
	for len(ops) > 0 {
		op := next()
		switch op % 5 {
		case 0, 1: // ask
			pr := fmt.Sprint("p", next()%nProjects)
			overShare := o.held[pr] >= Share(size, floor, len(o.active)+b2i(!o.active[pr]))
			want := o.ask(pr)
			pm, err := p.TryAcquire(pr)
			if (err == nil) != want {
				t.Fatalf("%s: pool admitted=%v, oracle %v (in_use %d held %d share %d)", pr, err == nil, want, o.inUse(), o.held[pr], o.share())
			}
			if err != nil {
				var r *Refusal
				if !errors.As(err, &r) || r.Held != o.held[pr] || r.InUse != o.inUse() || r.Share != o.share() {
					t.Fatalf("refusal %+v, oracle held %d in_use %d share %d", r, o.held[pr], o.inUse(), o.share())
				}
				if r.RetryAfter < minRetry || r.RetryAfter > maxRetry {
					t.Fatalf("retry %v", r.RetryAfter)
				}
				continue
			}
			permits[pr] = append(permits[pr], pm)
			if overShare && o.inUse() > size-floor {
				t.Fatalf("%s at/over share pushed in_use to %d > %d", pr, o.inUse(), size-floor)
			}
		case 2: // release
			pr := fmt.Sprint("p", next()%nProjects)
			if len(permits[pr]) == 0 {
				continue
			}
			i := int(next()) % len(permits[pr])
			if err := p.Release(permits[pr][i]); err != nil {
				t.Fatal(err)
			}
			permits[pr] = append(permits[pr][:i], permits[pr][i+1:]...)
			o.release(pr)
		case 3: // time passes, recompute
			clk.Advance(time.Duration(next()) * 10 * time.Millisecond)
			p.Recompute()
			o.recompute(clk.Now())
		case 4: // a newcomer probes for its floor, then leaves
			if o.inUse() > size-floor {
				continue
			}
			pr := fmt.Sprint("new", newcomers)
			newcomers++
			for i := 0; i < floor; i++ {
				if !o.ask(pr) {
					t.Fatalf("oracle refused newcomer permit %d", i)
				}
				pm, err := p.TryAcquire(pr)
				if err != nil {
					t.Fatalf("newcomer %s refused permit %d of its floor %d: %v", pr, i, floor, err)
				}
				permits[pr] = append(permits[pr], pm)
			}
		}
		s := p.Snapshot()
		if s.InUse > size || s.InUse != o.inUse() || s.Active != len(o.active) || s.Share != o.share() {
			t.Fatalf("snapshot %+v; oracle in_use %d active %d share %d", s, o.inUse(), len(o.active), o.share())
		}
	}
	for pr, pms := range permits {
		for _, pm := range pms {
			if err := p.Release(pm); err != nil {
				t.Fatal(err)
			}
			if err := p.Release(pm); !errors.Is(err, ErrDoubleRelease) {
				t.Fatalf("%s: second release: %v", pr, err)
			}
		}
	}
	s := p.Snapshot()
	if s.InUse != 0 {
		t.Fatalf("in_use %d after releasing everything", s.InUse)
	}
	for _, ps := range s.Projects {
		if ps.Held != 0 {
			t.Fatalf("%s holds %d after releasing everything", ps.Project, ps.Held)
		}
	}
	// Long idle: every project is forgotten.
	for i := 0; i < 70; i++ {
		clk.Advance(time.Second)
		p.Recompute()
	}
	if s := p.Snapshot(); len(s.Projects) != 0 || s.Active != 0 || s.Share != size {
		t.Fatalf("after idling: %+v", s)
	}
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestPropertyAgainstOracle runs thousands of seeded random sequences.
func TestPropertyAgainstOracle(t *testing.T) {
	n := 3000
	if testing.Short() {
		n = 300
	}
	for seed := uint64(0); seed < uint64(n); seed++ {
		rng := rand.New(rand.NewPCG(seed, 0x5eed))
		ops := make([]byte, 2+rng.IntN(400))
		for i := range ops {
			ops[i] = byte(rng.Uint32())
		}
		t.Run("", func(t *testing.T) {
			defer func() {
				if t.Failed() {
					t.Logf("seed %d", seed)
				}
			}()
			runOps(t, ops)
		})
		if t.Failed() {
			return
		}
	}
}

// FuzzPool drives the pool with arbitrary operation sequences; its seed
// corpus runs as part of the normal tests.
func FuzzPool(f *testing.F) {
	f.Add([]byte{9, 0, 0, 1, 0, 1, 0, 2, 2, 1, 0, 3, 100, 4})
	f.Add([]byte{19, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 4, 3, 200, 3, 200, 3, 200, 4})
	f.Add([]byte{0, 0, 0, 0, 0, 1, 4, 2, 0, 0, 4})
	f.Add([]byte{39, 7, 1, 2, 1, 3, 1, 4, 1, 5, 2, 3, 0, 3, 255, 3, 255, 4, 0, 1})
	f.Fuzz(func(t *testing.T, ops []byte) {
		if len(ops) > 4096 {
			ops = ops[:4096]
		}
		runOps(t, ops)
	})
}
