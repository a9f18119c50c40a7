// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"context"
	"errors"
	"testing"
	"time"
)

func mustPool(t testing.TB, size, floor int, clk Clock) *Pool {
	t.Helper()
	p, err := New(Config{Name: "test", Size: size, Floor: floor}, clk)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func acquireN(t testing.TB, p *Pool, project string, n int) []Permit {
	t.Helper()
	var out []Permit
	for i := 0; i < n; i++ {
		pm, err := p.TryAcquire(project)
		if err != nil {
			t.Fatalf("%s permit %d: %v", project, i, err)
		}
		out = append(out, pm)
	}
	return out
}

func TestSmoke(t *testing.T) {
	clk := newFakeClock()
	p := mustPool(t, 10, 0, clk)
	pms := acquireN(t, p, "a", 10)
	_, err := p.TryAcquire("a")
	var r *Refusal
	if !errors.As(err, &r) || !errors.Is(err, ErrRefused) {
		t.Fatalf("want refusal, got %v", err)
	}
	if err := p.Release(pms[0]); err != nil {
		t.Fatal(err)
	}
	if err := p.Release(pms[0]); !errors.Is(err, ErrDoubleRelease) {
		t.Fatalf("double release: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	done := make(chan Permit)
	go func() {
		pm, err := p.Acquire(ctx, "b")
		if err != nil {
			t.Error(err)
		}
		done <- pm
	}()
	// b is under share; it gets in once a's permits come back.
	pm, err := p.TryAcquire("a")
	if err != nil {
		t.Fatal(err)
	}
	_ = pm
	time.Sleep(10 * time.Millisecond)
	if err := p.Release(pms[1]); err != nil {
		t.Fatal(err)
	}
	got := <-done
	if got.Project() != "b" {
		t.Fatalf("got %v", got)
	}
}
