// SPDX-License-Identifier: Apache-2.0

package client_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/client"
	"github.com/fairshare-dev/fairshare/pools"
)

// TestCallsEndWithTheirContextWhenTheDaemonStopsReading: a daemon that
// accepts and never reads fills the socket, and every call still ends with
// its context's error, soon after its deadline: those whose request is
// buffered, those waiting for room in the buffer, and one made once the
// socket is full. Before, the flusher held the write lock while blocked in
// a write without a deadline, and every call waited for that lock (or
// flushed itself), past its deadline and for ever.
func TestCallsEndWithTheirContextWhenTheDaemonStopsReading(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "permits.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var mu sync.Mutex
	var conns []net.Conn
	defer func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	}()
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, conn) // held open, never read
			mu.Unlock()
		}
	}()
	c, err := client.Dial(context.Background(), client.Options{Socket: sock})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// 96 calls of 32 KiB each, 3 MiB in all, many times what the socket
	// and the client's buffer hold, in rounds with random order and
	// deadlines of 100-300 ms.
	const rounds, calls = 3, 32
	name := strings.Repeat("o", 32<<10)
	for round := range rounds {
		errs := make(chan error, calls)
		for i := range calls {
			go func() {
				wait := time.Duration(100+(i*37+round*11)%200) * time.Millisecond
				ctx, cancel := context.WithTimeout(context.Background(), wait)
				defer cancel()
				begin := time.Now()
				err := c.Touch(ctx, fmt.Sprintf("%s-%d-%d", name, round, i))
				if took := time.Since(begin); err == nil || took > wait+5*time.Second {
					err = fmt.Errorf("after %v (deadline %v): %w", took, wait, err)
				}
				errs <- err
			}()
		}
		deadline := time.After(30 * time.Second)
		for range calls {
			select {
			case err := <-errs:
				if !errors.Is(err, context.DeadlineExceeded) {
					t.Fatalf("round %d: a call on a daemon that reads nothing: %v, want its context's deadline", round, err)
				}
			case <-deadline:
				t.Fatalf("round %d: calls still blocked 30 s after their 300 ms deadlines", round)
			}
		}
	}
	// The socket is full now: a new call still ends at its deadline.
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	begin := time.Now()
	done := make(chan error, 1)
	go func() { done <- c.Ping(ctx) }()
	select {
	case err := <-done:
		if !errors.Is(err, context.DeadlineExceeded) || time.Since(begin) > 5*time.Second {
			t.Fatalf("ping on a full socket: %v after %v", err, time.Since(begin))
		}
	case <-time.After(30 * time.Second):
		t.Fatal("ping on a full socket still blocked after 30 s")
	}
}

// TestReconnectReportsLostLeases: the acquire leases callers held when the
// daemon restarted ended with it; OnReconnect says which (not those
// released before, nor those of an
// earlier connection already reported). Before, they were dropped without
// a word, and the runtime went on as if it held them.
func TestReconnectReportsLostLeases(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "permits.sock")
	start := func() func() {
		flights, _ := pools.New(pools.Config{Name: "flights", Size: 8}, nil)
		uploads, _ := pools.New(pools.Config{Name: "uploads", Size: 8}, nil)
		residents, _ := pools.NewResidents(pools.Config{Name: "residents", Size: 2}, nil)
		_, stop := servePermits(t, sock, map[string]*pools.Pool{"flights": flights, "uploads": uploads}, residents)
		return stop
	}
	stop := start()
	reconnected := make(chan error, 1)
	ctx := context.Background()
	c, err := client.Dial(ctx, client.Options{Socket: sock, Reconnect: true, OnReconnect: func(err error) { reconnected <- err }})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var held []client.Lease
	for i, pool := range []string{"flights", "uploads", "flights"} {
		l, err := c.Acquire(ctx, pool, fmt.Sprintf("p%d", i))
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, l)
	}
	if _, err := c.Release(ctx, held[1]); err != nil {
		t.Fatal(err)
	}
	want := []client.Lease{held[0], held[2]}
	if _, err := c.Spawn(ctx, "p0", "resident"); err != nil {
		t.Fatal(err)
	}
	for restart := range 2 {
		stop()
		stop = start()
		var err error
		select {
		case err = <-reconnected:
		case <-time.After(30 * time.Second):
			t.Fatalf("restart %d: no reconnect", restart)
		}
		var lost *client.LostLeasesError
		if !errors.Is(err, client.ErrLeasesLost) || !errors.As(err, &lost) {
			t.Fatalf("restart %d: OnReconnect(%v), want the lost leases", restart, err)
		}
		if fmt.Sprint(lost.Leases) != fmt.Sprint(want) {
			t.Fatalf("restart %d: lost %+v, want %+v", restart, lost.Leases, want)
		}
		// The resident went back: the error is the leases' only.
		if msg := err.Error(); strings.Contains(msg, "re-registering") {
			t.Fatalf("restart %d: %v", restart, err)
		}
		// A lease on the new connection, lost at the next restart.
		l, err := c.Acquire(ctx, "uploads", "p9")
		if err != nil {
			t.Fatal(err)
		}
		want = []client.Lease{l}
	}
	stop()
}

// TestReleaseWithEndedContextStillReleases: a Release whose context has
// ended, or ends while it is sent or answered (a handler's request context,
// cancelled as its client went away), returns that context's error and
// still gives the lease back, for a pool's lease and a resident's. Before,
// the client forgot the lease and sent nothing: the permit stayed held by
// the session until it ended, its project refused past its share the while.
// Deadlines random from 0 to 200 µs, over 300 rounds.
func TestReleaseWithEndedContextStillReleases(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "permits.sock")
	flights, _ := pools.New(pools.Config{Name: "flights", Size: 8}, nil)
	residents, _ := pools.NewResidents(pools.Config{Name: "residents", Size: 8}, nil)
	_, stop := servePermits(t, sock, map[string]*pools.Pool{"flights": flights}, residents)
	defer stop()
	ctx := context.Background()
	c, err := client.Dial(ctx, client.Options{Socket: sock})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	inUse := func() (int, int) { return flights.Snapshot().InUse, residents.Snapshot().InUse }
	ended := 0
	for round := range 300 {
		l, err := c.Acquire(ctx, "flights", "p0")
		if err != nil {
			t.Fatal(err)
		}
		r, err := c.Spawn(ctx, "p0", fmt.Sprintf("obj%d", round%4))
		if err != nil {
			t.Fatal(err)
		}
		for _, lease := range []client.Lease{l, r} {
			rctx, cancel := context.WithTimeout(ctx, time.Duration(rand.IntN(200))*time.Microsecond)
			if round%3 == 0 {
				cancel() // ended before the call
			}
			if _, err := c.Release(rctx, lease); err != nil {
				if !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
					t.Fatalf("round %d: Release: %v", round, err)
				}
				ended++
			}
			cancel()
		}
		deadline := time.Now().Add(10 * time.Second)
		for f, res := inUse(); f != 0 || res != 0; f, res = inUse() {
			if time.Now().After(deadline) {
				t.Fatalf("round %d: %d flights and %d residents still held after the releases", round, f, res)
			}
			time.Sleep(time.Millisecond)
		}
	}
	if ended < 200 {
		t.Errorf("only %d of 600 releases ended with their context: the test did not test", ended)
	}
}
