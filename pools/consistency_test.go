// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

// checkSnapshot is what status and /metrics rely on, at every instant: the
// pool's totals are the sums over its projects plus the forgotten ones',
// in_use is the sum of held, and active and share agree with each other and
// with the projects' flags.
func checkSnapshot(s Snapshot) error {
	var adm, ref uint64
	held, active := 0, 0
	for _, p := range s.Projects {
		adm += p.Admitted
		ref += p.Refused
		held += p.Held
		if p.Active {
			active++
		}
	}
	switch {
	case adm+s.Forgotten.Admitted != s.Admitted:
		return fmt.Errorf("admitted %d != projects %d + forgotten %d", s.Admitted, adm, s.Forgotten.Admitted)
	case ref+s.Forgotten.Refused != s.Refused:
		return fmt.Errorf("refused %d != projects %d + forgotten %d", s.Refused, ref, s.Forgotten.Refused)
	case held != s.InUse:
		return fmt.Errorf("in_use %d != held %d", s.InUse, held)
	case active != s.Active:
		return fmt.Errorf("active %d != projects marked active %d", s.Active, active)
	case s.Share != Share(s.Size, s.Floor, s.Active):
		return fmt.Errorf("share %d != Share(%d, %d, %d)", s.Share, s.Size, s.Floor, s.Active)
	}
	return nil
}

// Churn: projects come, ask, hold, go idle, are forgotten and come back,
// for several simulated minutes; every snapshot on the way is consistent.
func TestTotalsAreSumsUnderChurn(t *testing.T) {
	for seed := range uint64(5) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 7))
			clk := newFakeClock()
			p, err := New(Config{Name: "p", Size: 20, Window: time.Second, Forget: 5 * time.Second}, clk)
			if err != nil {
				t.Fatal(err)
			}
			var held []Permit
			forgotten := false
			for step := range 20000 {
				switch r := rng.IntN(100); {
				case r < 45:
					name := fmt.Sprintf("p%d", rng.IntN(40))
					if pm, err := p.TryAcquire(name); err == nil {
						held = append(held, pm)
					}
				case r < 85 && len(held) > 0:
					i := rng.IntN(len(held))
					if err := p.Release(held[i]); err != nil {
						t.Fatal(err)
					}
					held[i] = held[len(held)-1]
					held = held[:len(held)-1]
				case r < 95:
					clk.Advance(time.Duration(rng.IntN(400)) * time.Millisecond)
					p.Recompute()
				default:
					// A quiet spell: holders let go, and idle projects are
					// forgotten.
					for _, pm := range held {
						p.Release(pm)
					}
					held = held[:0]
					clk.Advance(7 * time.Second)
					p.Recompute()
				}
				s := p.Snapshot()
				if err := checkSnapshot(s); err != nil {
					t.Fatalf("step %d: %v", step, err)
				}
				forgotten = forgotten || s.Forgotten.Projects > 0
			}
			if !forgotten {
				t.Fatal("no project was forgotten: the test does not test forgetting")
			}
		})
	}
}

func TestResidentsTotalsAreSumsUnderChurn(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 9))
	clk := newFakeClock()
	r, err := NewResidents(Config{Name: "residents", Size: 12, Window: time.Second, Forget: 5 * time.Second,
		EvictWait: time.Millisecond}, clk)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	awake := map[string]bool{}
	forgotten := false
	for step := range 10000 {
		obj := fmt.Sprintf("o%d", rng.IntN(60))
		switch x := rng.IntN(100); {
		case x < 45:
			ev, err := r.Spawn(ctx, fmt.Sprintf("p%d", rng.IntN(8)), obj)
			if err == nil {
				awake[obj] = true
				if ev.Object != "" {
					delete(awake, ev.Object) // counted asleep by the pool
				}
			}
		case x < 70:
			if awake[obj] {
				r.Sleep(obj)
				delete(awake, obj)
			}
		case x < 85:
			r.Remove(obj)
			delete(awake, obj)
		case x < 97:
			clk.Advance(time.Duration(rng.IntN(500)) * time.Millisecond)
			r.Recompute()
		default:
			for o := range awake {
				r.Remove(o)
			}
			clear(awake)
			clk.Advance(7 * time.Second)
			r.Recompute()
		}
		s := r.Snapshot()
		if err := checkSnapshot(s.Snapshot); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		forgotten = forgotten || s.Forgotten.Projects > 0
	}
	if !forgotten {
		t.Fatal("no project was forgotten")
	}
}
