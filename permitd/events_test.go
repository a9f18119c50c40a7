// SPDX-License-Identifier: Apache-2.0

package permitd_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/fairshare-dev/fairshare/client"
	"github.com/fairshare-dev/fairshare/events"
	"github.com/fairshare-dev/fairshare/permitd"
	"github.com/fairshare-dev/fairshare/pools"
)

// TestPermitEvents: a refused acquire and an eviction are published with
// what an operator needs: the refusal's numbers and the peer; the victim,
// its project, its owner's session and the spawner's project.
func TestPermitEvents(t *testing.T) {
	var mu sync.Mutex
	var got []events.Event
	fp, err := pools.New(pools.Config{Name: "flights", Size: 2, Floor: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	rp, err := pools.NewResidents(pools.Config{Name: "residents", Size: 2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "permitd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	cfg := permitd.Config{Socket: filepath.Join(dir, "permits.sock"), Events: func(e events.Event) {
		mu.Lock()
		got = append(got, e)
		mu.Unlock()
	}}
	srv, err := permitd.New(cfg, map[string]*pools.Pool{"flights": fp}, rp, nil)
	if err != nil {
		t.Fatal(err)
	}
	f := serveFixture(t, srv, fp, rp)
	ctx := context.Background()
	c := dial(t, f, client.Options{})
	for range 2 {
		if _, err := c.Acquire(ctx, "flights", "alpha"); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.Acquire(ctx, "flights", "alpha"); !errors.Is(err, client.ErrRefused) {
		t.Fatalf("third flight: %v, want refused", err)
	}
	big := newRuntime(t, f, false)
	spawnAll(t, big.Client, "big", "a1", "a2")
	if _, err := c.Spawn(ctx, "small", "b1"); err != nil {
		t.Fatalf("small's spawn: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(got) != 2 {
		t.Fatalf("events %+v, want a refusal and an eviction", got)
	}
	if e := got[0]; e.Source != events.SourcePermits || e.Kind != events.KindRefused || e.Pool != "flights" || e.Project != "alpha" ||
		e.Reason != events.ReasonShare || e.Held != 2 || e.InUse != 2 || e.Share != 2 || e.PoolSize != 2 || !strings.HasPrefix(e.Remote, "uid ") {
		t.Errorf("refusal: %+v", e)
	}
	if e := got[1]; e.Kind != events.KindEvicted || e.Pool != permitd.ResidentsPool || e.Project != "big" || e.Victim != "a1" ||
		e.Spawner != "small" || !strings.HasPrefix(e.Owner, "uid ") || e.Reason != pools.EvictFurthestOverShare {
		t.Errorf("eviction: %+v", e)
	}
}
