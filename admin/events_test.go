// SPDX-License-Identifier: Apache-2.0

package admin

import (
	"context"
	"errors"
	"net/http"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/events"
)

// eventBackend is a storeBackend that keeps events.
type eventBackend struct {
	*storeBackend
	hub *events.Hub

	mu     sync.Mutex // guards recent
	recent []events.Event
}

func (b *eventBackend) RecentEvents(f events.Filter) []events.Event {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []events.Event
	for _, e := range b.recent {
		if f.Match(e) {
			out = append(out, e)
		}
	}
	return out
}

func (b *eventBackend) SubscribeEvents(f events.Filter, buf int) *events.Sub {
	return b.hub.Subscribe(f, buf)
}

func (b *eventBackend) publish(e events.Event) {
	b.mu.Lock()
	e.Seq = uint64(len(b.recent) + 1)
	b.recent = append(b.recent, e)
	b.mu.Unlock()
	b.hub.Publish(e)
}

// startEventServer serves an eventBackend (over startServer's store) on a
// socket of its own until cancel; done then gets Serve's error.
func startEventServer(t *testing.T) (sock string, b *eventBackend, cancel func(), done chan error) {
	t.Helper()
	sock, sb := startServer(t)
	b = &eventBackend{storeBackend: sb, hub: events.NewHub(nil)}
	sock = filepath.Join(filepath.Dir(sock), "events.sock")
	ln, err := Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done = make(chan error, 1)
	go func() { done <- NewServer(b, nil).Serve(ctx, ln) }()
	return sock, b, cancel, done
}

// TestEventsStream: GET /v1/events filters the kept events, streams new
// ones with follow, bounds the streams open at once (so followers leave the
// admin socket to the CLI) and refuses a bad filter naming it.
func TestEventsStream(t *testing.T) {
	sock, b, cancel, done := startEventServer(t)
	defer func() { cancel(); <-done }()
	b.publish(events.Event{Kind: events.KindRefused, Project: "alpha", Pool: "requests"})
	b.publish(events.Event{Kind: events.KindRefused, Project: "beta", Pool: "requests"})
	b.publish(events.Event{Kind: events.KindRefused, Project: "alpha", Pool: "connections"})
	c := NewClient(sock)
	collect := func(f events.Filter) (out []events.Event) {
		t.Helper()
		err := c.Events(context.Background(), f, false, func(e events.Event) error { out = append(out, e); return nil })
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	if got := collect(events.Filter{Project: "alpha"}); len(got) != 2 {
		t.Fatalf("alpha: %+v", got)
	}
	if got := collect(events.Filter{Project: "alpha", Pool: "connections"}); len(got) != 1 || got[0].Seq != 3 {
		t.Fatalf("alpha in connections: %+v", got)
	}
	var apiErr *APIError
	err := c.Events(context.Background(), events.Filter{Project: "../x"}, false, func(events.Event) error { return nil })
	if !errors.As(err, &apiErr) || apiErr.Code != http.StatusBadRequest {
		t.Fatalf("bad project: %v", err)
	}

	// MaxStreams followers; each sees the kept events once, then a new one.
	fctx, fcancel := context.WithCancel(context.Background())
	defer fcancel()
	got := make(chan events.Event, 100)
	var wg sync.WaitGroup
	for range MaxStreams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.Events(fctx, events.Filter{Pool: "requests"}, true, func(e events.Event) error { got <- e; return nil })
		}()
	}
	deadline := time.Now().Add(5 * time.Second)
	for b.hub.Stats().Subscribers < MaxStreams {
		if time.Now().After(deadline) {
			t.Fatal("followers did not subscribe")
		}
		time.Sleep(10 * time.Millisecond)
	}
	err = c.Events(context.Background(), events.Filter{}, true, func(events.Event) error { return nil })
	if !errors.As(err, &apiErr) || apiErr.Code != http.StatusServiceUnavailable {
		t.Fatalf("stream past the bound: %v", err)
	}
	// The CLI still gets in.
	if _, err := c.Policies(context.Background()); err != nil {
		t.Fatal(err)
	}
	b.publish(events.Event{Kind: events.KindRefused, Project: "gamma", Pool: "requests"})
	seen := map[uint64]int{}
	for range MaxStreams * 3 {
		select {
		case e := <-got:
			seen[e.Seq]++
		case <-time.After(5 * time.Second):
			t.Fatalf("followers saw %v", seen)
		}
	}
	if seen[1] != MaxStreams || seen[2] != MaxStreams || seen[4] != MaxStreams {
		t.Fatalf("followers saw %v", seen)
	}
	fcancel()
	wg.Wait()
}

// A follower's stream ends when the server shuts down: it held the
// shutdown for its grace, and the daemon stopped with an error (exit 1)
// whenever `fairshare events -f` was open.
func TestShutdownEndsFollowers(t *testing.T) {
	sock, b, cancel, done := startEventServer(t)
	defer cancel()
	c := NewClient(sock)
	followed := make(chan error, 1)
	go func() {
		followed <- c.Events(context.Background(), events.Filter{}, true, func(events.Event) error { return nil })
	}()
	for b.hub.Stats().Subscribers == 0 {
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("shutdown with a follower: %v, want nil", err)
	}
	if err := <-followed; !errors.Is(err, ErrStreamEnded) {
		t.Fatalf("the follower: %v, want ErrStreamEnded (a forwarder must hear the daemon stopped)", err)
	}
}
