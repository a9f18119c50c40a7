// SPDX-License-Identifier: Apache-2.0

package client_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/client"
	"github.com/fairshare-dev/fairshare/permitd"
	"github.com/fairshare-dev/fairshare/pools"
)

// The daemon's bounds reach the caller as errors it can branch on: an
// invalid project name is ErrBadRequest, a wait past the session's bound of
// waiting operations is ErrTooManyWaiting.
func TestBoundsAsErrors(t *testing.T) {
	sock, stop := serve()
	defer stop()
	ctx := context.Background()
	c, err := client.Dial(ctx, client.Options{Socket: sock})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Acquire(ctx, "flights", "bad name\n"); !errors.Is(err, client.ErrBadRequest) {
		t.Fatalf("invalid project: %v", err)
	}
	for range 2 {
		if _, err := c.Acquire(ctx, "flights", "shop"); err != nil {
			t.Fatal(err)
		}
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	for range permitd.DefaultMaxWaitingPerSession {
		wg.Add(1)
		go func() { defer wg.Done(); c.AcquireWait(wctx, "flights", "shop", time.Minute) }()
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := c.AcquireWait(ctx, "flights", "shop", 20*time.Millisecond)
		if errors.Is(err, client.ErrTooManyWaiting) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no TOO_MANY_WAITING with %d waiting: %v", permitd.DefaultMaxWaitingPerSession, err)
		}
	}
	cancel()
	c.Close()
	wg.Wait()
}

// TestCloseDuringReconnectLeavesNoSession: a Close that comes while a
// reconnect has dialed and not yet attached the new connection closes that
// one too. Before, Close closed the dead connection, and the new one stayed
// open, its objects spawned again, for the life of the process.
func TestCloseDuringReconnectLeavesNoSession(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "permits.sock")
	start := func() (*permitd.Server, *pools.Residents, func()) {
		flights, _ := pools.New(pools.Config{Name: "flights", Size: 2}, nil)
		residents, _ := pools.NewResidents(pools.Config{Name: "residents", Size: 2}, nil)
		srv, stop := servePermits(t, sock, map[string]*pools.Pool{"flights": flights}, residents)
		return srv, residents, stop
	}
	_, _, stop := start()
	ctx := context.Background()
	c, err := client.Dial(ctx, client.Options{Socket: sock, Reconnect: true,
		OnReconnect: func(err error) { t.Errorf("re-registered on a closed client: %v", err) }})
	if err != nil {
		t.Fatal(err)
	}
	closed := make(chan struct{})
	client.SetAfterDial(c, func() { c.Close(); close(closed) })
	if _, err := c.Spawn(ctx, "alpha", "o"); err != nil {
		t.Fatal(err)
	}
	stop()
	srv, residents, stop2 := start()
	defer stop2()
	<-closed
	deadline := time.Now().Add(10 * time.Second)
	for len(srv.Snapshot().Sessions) > 0 || residents.Snapshot().InUse > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("after Close: %d sessions open on the new daemon, %d residents", len(srv.Snapshot().Sessions), residents.Snapshot().InUse)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestStaleEvictionIgnored: an evict event of a residence that has ended
// (the runtime put the object to sleep, and spawned it again, since) is not
// handed to OnEvict, where a runtime that obeyed would unload the live
// residence; one of the live residence is. A daemon of the test's writes
// the lines in that order: the first residence's event after its sleep's
// answer, and again after the second's spawn answer.
func TestStaleEvictionIgnored(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "permits.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	released := make(chan uint64, 4)
	go func() {
		conn, err := ln.Accept()
		if err != nil {
			return
		}
		defer conn.Close()
		r := bufio.NewReader(conn)
		lease := uint64(10)
		for {
			line, err := r.ReadBytes('\n')
			if err != nil {
				return
			}
			var rq struct {
				ID    uint64 `json:"id"`
				Op    string `json:"op"`
				Lease uint64 `json:"lease"`
			}
			if json.Unmarshal(line, &rq) != nil {
				return
			}
			switch rq.Op {
			case "spawn":
				lease++
				fmt.Fprintf(conn, `{"id":%d,"ok":true,"lease":%d}`+"\n", rq.ID, lease)
				if lease == 12 {
					// The second residence: an event of the first
					// (stale), then one of this one.
					fmt.Fprintf(conn, `{"event":"evict","project":"p","object":"x","reason":"own-idlest","lease":11}`+"\n")
					fmt.Fprintf(conn, `{"event":"evict","project":"p","object":"x","reason":"own-idlest","lease":12}`+"\n")
				}
			case "release":
				released <- rq.Lease
				fmt.Fprintf(conn, `{"id":%d,"ok":true,"released":true}`+"\n", rq.ID)
			case "sleep":
				// The first residence's eviction, after its sleep.
				fmt.Fprintf(conn, `{"id":%d,"ok":true}`+"\n", rq.ID)
				fmt.Fprintf(conn, `{"event":"evict","project":"p","object":"x","reason":"own-idlest","lease":11}`+"\n")
			default:
				fmt.Fprintf(conn, `{"id":%d,"ok":true}`+"\n", rq.ID)
			}
		}
	}()
	evicted := make(chan uint64, 4)
	c, err := client.Dial(context.Background(), client.Options{Socket: sock,
		OnEvict: func(ev client.Eviction) error { evicted <- ev.Lease; return nil }})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	if _, err := c.Spawn(ctx, "p", "x"); err != nil {
		t.Fatal(err)
	}
	if err := c.Sleep(ctx, "x"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Spawn(ctx, "p", "x"); err != nil {
		t.Fatal(err)
	}
	if l := leaseFrom(t, evicted, "OnEvict"); l != 12 {
		t.Fatalf("OnEvict called for residence %d, which had ended", l)
	}
	if l := leaseFrom(t, released, "the confirmation"); l != 12 {
		t.Fatalf("confirmed residence %d, want 12", l)
	}
	select {
	case l := <-evicted:
		t.Fatalf("OnEvict called again, for residence %d", l)
	case <-time.After(100 * time.Millisecond):
	}
}

// leaseFrom is the next lease on ch, what names it (failing after 10 s).
func leaseFrom(t *testing.T, ch <-chan uint64, what string) uint64 {
	t.Helper()
	select {
	case l := <-ch:
		return l
	case <-time.After(10 * time.Second):
		t.Fatalf("%s never came for the live residence", what)
		return 0
	}
}

// servePermits serves the pools and residents on a permit socket at sock
// until the returned stop, which waits for the server to end.
func servePermits(t *testing.T, sock string, ps map[string]*pools.Pool, residents *pools.Residents) (*permitd.Server, func()) {
	t.Helper()
	srv, err := permitd.New(permitd.Config{Socket: sock}, ps, residents, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { srv.Serve(ctx); close(done) }()
	return srv, func() { cancel(); <-done }
}
