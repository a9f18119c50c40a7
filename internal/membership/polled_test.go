// SPDX-License-Identifier: Apache-2.0

package membership

import (
	"context"
	"errors"
	"regexp"
	"sync/atomic"
	"testing"
	"time"
)

// cutShape is the error of a fetch cut at its bound.
var cutShape = regexp.MustCompile(`^no answer within ([0-9.]+[a-zµ]+): context deadline exceeded$`)

// TestPolled: a polled source (the shape of the Kubernetes source) answers
// Scan without waiting on its fetch, says "not read yet" before the first,
// reports a change only when the members differ, returns a failed fetch's
// error (the caller keeps the last members), cuts a fetch that does not
// answer within its interval, and Close stops it mid-fetch.
func TestPolled(t *testing.T) {
	type step struct {
		found Found
		err   error
		hang  bool // wait for the fetch's deadline
	}
	steps := make(chan step)
	began := make(chan struct{}, 16)
	fetch := func(ctx context.Context) (Found, error) {
		began <- struct{}{}
		s := <-steps
		if s.hang {
			<-ctx.Done()
			return Found{}, ctx.Err()
		}
		return s.found, s.err
	}
	p := NewPolled("kubernetes", 100*time.Millisecond, fetch)
	<-began
	if _, err := p.Scan(context.Background()); !errors.Is(err, ErrNotRead) {
		t.Fatalf("Scan before the first fetch: %v, want ErrNotRead", err)
	}
	a := Found{Members: []Member{{Project: "team-a", Cgroup: "/sys/fs/cgroup/kubepods/pod1"}}}
	changed := func() bool {
		select {
		case <-p.Changed():
			return true
		case <-time.After(10 * time.Second):
			return false
		}
	}
	steps <- step{found: a}
	if !changed() {
		t.Fatal("no change after the first fetch")
	}
	if f, err := p.Scan(context.Background()); err != nil || len(f.Members) != 1 || f.Members[0] != a.Members[0] {
		t.Fatalf("Scan = %+v, %v", f, err)
	}
	<-began
	steps <- step{found: a} // the same members
	<-began                 // the fetch before ended: any change was sent
	select {
	case <-p.Changed():
		t.Error("a change reported for the same members")
	default:
	}
	// The fetch's own error (wrapped as not answered when the test was
	// slower than the fetch's bound to give it).
	refused := errors.New("connection refused")
	steps <- step{err: refused}
	<-began
	if _, err := p.Scan(context.Background()); !errors.Is(err, refused) {
		t.Errorf("Scan after a failed fetch: %v", err)
	}
	steps <- step{hang: true}
	<-began
	// Cut at its bound: the interval, or more when the test took longer
	// than half of it to answer an earlier fetch (the bound is twice what
	// the last one took).
	if _, err := p.Scan(context.Background()); !errors.Is(err, context.DeadlineExceeded) || !cutShape.MatchString(err.Error()) {
		t.Errorf("Scan after a fetch that did not answer: %v", err)
	} else if d, _ := time.ParseDuration(cutShape.FindStringSubmatch(err.Error())[1]); d < 100*time.Millisecond {
		t.Errorf("a fetch cut %v after it began, before the interval (100ms): %v", d, err)
	}
	steps <- step{found: a}
	if !changed() {
		t.Error("no change when the source is read again after errors")
	}
	<-began
	closed := make(chan error)
	go func() { closed <- p.Close() }()
	steps <- step{hang: true} // Close cancels it
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return")
	}
	select {
	case <-began:
		t.Error("a fetch after Close")
	case <-time.After(250 * time.Millisecond):
	}
}

// TestPolledPoke: a poke fetches at once rather than at the next period,
// and pokes during a fetch coalesce into one more.
func TestPolledPoke(t *testing.T) {
	var fetches atomic.Int64
	release := make(chan struct{})
	began := make(chan struct{}, 16)
	p := NewPolled("kubernetes", time.Hour, func(ctx context.Context) (Found, error) {
		fetches.Add(1)
		began <- struct{}{}
		<-release
		return Found{}, nil
	})
	defer p.Close()
	<-began // the first fetch, at start
	for range 100 {
		p.Poke() // during the fetch: one more, not a hundred
	}
	release <- struct{}{}
	select {
	case <-began:
	case <-time.After(10 * time.Second):
		t.Fatal("no fetch after a poke (the period is an hour)")
	}
	release <- struct{}{}
	select {
	case <-began:
		t.Fatal("a third fetch: pokes during a fetch did not coalesce")
	case <-time.After(200 * time.Millisecond):
	}
	p.Poke()
	select {
	case <-began:
	case <-time.After(10 * time.Second):
		t.Fatal("no fetch after a poke while idle")
	}
	release <- struct{}{}
	if n := fetches.Load(); n != 3 {
		t.Errorf("%d fetches, want 3", n)
	}
}

// TestPolledSlowSource: a source that always answers, but slower than the
// interval (a busy node's container runtime), is read: each fetch that runs
// out of its bound lets the next take twice as long. Before, every fetch
// was cut at the interval and the source was never read.
func TestPolledSlowSource(t *testing.T) {
	const every = 20 * time.Millisecond
	p := NewPolled("kubernetes", every, func(ctx context.Context) (Found, error) {
		select {
		case <-time.After(5 * every):
			return Found{Members: []Member{{Project: "a", Cgroup: "/sys/fs/cgroup/a"}}}, nil
		case <-ctx.Done():
			return Found{}, ctx.Err()
		}
	})
	defer p.Close()
	deadline := time.Now().Add(20 * time.Second)
	for {
		f, err := p.Scan(context.Background())
		if err == nil && len(f.Members) == 1 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("a source answering in 100ms with a 20ms interval was never read: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestPolledStartOnceCloseBeforeStart: a second Start starts nothing more,
// and a Polled closed before it started closes (and starts no more).
func TestPolledStartOnceCloseBeforeStart(t *testing.T) {
	var fetches atomic.Int32
	fetch := func(context.Context) (Found, error) { fetches.Add(1); return Found{}, nil }
	p := PreparePolled("kubernetes", time.Hour, fetch)
	p.Start()
	p.Start()
	p.Close()
	if n := fetches.Load(); n != 1 {
		t.Errorf("%d fetches from two Starts, want 1", n)
	}
	q := PreparePolled("kubernetes", time.Hour, fetch)
	q.Close()
	q.Start()
	q.Close()
	if n := fetches.Load(); n != 1 {
		t.Errorf("a Polled closed before it started fetched")
	}
}
