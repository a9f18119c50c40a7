// SPDX-License-Identifier: Apache-2.0

package client_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/client"
	"github.com/fairshare-dev/fairshare/permitd"
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
