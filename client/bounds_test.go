// SPDX-License-Identifier: Apache-2.0

package client_test

import (
	"context"
	"errors"
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
		srv, err := permitd.New(permitd.Config{Socket: sock}, map[string]*pools.Pool{"flights": flights}, residents, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := srv.Listen(); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { srv.Serve(ctx); close(done) }()
		return srv, residents, func() { cancel(); <-done }
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
