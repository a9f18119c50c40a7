// SPDX-License-Identifier: Apache-2.0

package front

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/pools"
	"github.com/fairshare-dev/fairshare/scheduler"
)

// drainRig is a front served by Front.Serve itself (its event loops when
// Config.FastPath), whose stop drains it as the daemon's shutdown does.
type drainRig struct {
	addr  string
	pool  *pools.Pool
	front *Front
	// stop tells Serve to stop and returns once it has returned.
	stop func()
}

// serveDrain serves a front with a requests pool of 4 before the upstream
// at upAddr, with sched (nil: none) and a drain of drainFor.
func serveDrain(t *testing.T, upAddr string, cfg Config, sched *scheduler.Scheduler, drainFor time.Duration) *drainRig {
	t.Helper()
	pool, err := pools.New(pools.Config{Name: "requests", Size: 4}, nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Upstream = "http://" + upAddr
	if cfg.TrustedPeers == nil {
		cfg.TrustedPeers = []string{"127.0.0.0/8"}
	}
	f, err := New(cfg, Deps{Requests: pool, Sched: sched})
	if err != nil {
		t.Fatal(err)
	}
	f.drainFor = drainFor
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan struct{})
	go func() { defer close(served); _ = f.Serve(ctx, l) }()
	stop := func() { cancel(); <-served }
	t.Cleanup(stop)
	deadline := time.Now().Add(5 * time.Second)
	for f.cfg.FastPath && f.fast.Load() == nil {
		if time.Now().After(deadline) {
			t.Fatal("the fast path did not start")
		}
		time.Sleep(time.Millisecond)
	}
	return &drainRig{addr: l.Addr().String(), pool: pool, front: f, stop: stop}
}

// silentUpstream is an upstream that reads a request and never answers
// (until the front closes the connection).
func silentUpstream(t *testing.T) string {
	t.Helper()
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-time.After(limitsDeadline):
		}
	}))
	t.Cleanup(up.Close)
	return strings.TrimPrefix(up.URL, "http://")
}

// sendGet opens a connection to addr and sends a GET of project alpha on
// it.
func sendGet(t *testing.T, addr, path string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := c.Write([]byte("GET " + path + " HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	return c
}

// TestFastPathDrainWaiterReleased: a request still waiting for the
// scheduler when the drain's time is up gives its permit back before
// Serve returns (its waiter posted to a loop that had returned, and the
// permit was held for good: in use 1 after Serve returned).
func TestFastPathDrainWaiterReleased(t *testing.T) {
	sched, err := scheduler.New(scheduler.Config{MaxInFlight: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	sctx, scancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() { defer close(ran); _ = sched.Run(sctx) }()
	defer func() { scancel(); <-ran }()
	r := serveDrain(t, silentUpstream(t), Config{MaxInFlight: 1, FastPath: true}, sched, 300*time.Millisecond)
	sendGet(t, r.addr, "/held")    // dispatched: the upstream holds it
	sendGet(t, r.addr, "/waiting") // waits for the scheduler
	waitInUse(t, r.pool, 2)
	r.stop()
	if n := r.pool.Snapshot().InUse; n != 0 {
		t.Errorf("in use %d after Serve returned, want 0", n)
	}
}

// TestFastPathPostAfterEnd: work posted to a loop that has ended runs (on
// the ended loop) and writes nothing to the descriptor number its eventfd
// had: here a file opened after the loop ended took that number, and the
// post wrote 8 bytes into it.
func TestFastPathPostAfterEnd(t *testing.T) {
	r := serveDrain(t, silentUpstream(t), Config{FastPath: true}, nil, 300*time.Millisecond)
	lp := r.front.fast.Load().loops[0]
	r.stop()
	// Open files until one takes the eventfd's number (the lowest free
	// number goes first).
	var file *os.File
	dir := t.TempDir()
	for i := 0; i < 256 && file == nil; i++ {
		f, err := os.OpenFile(filepath.Join(dir, "f"), os.O_RDWR|os.O_CREATE, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if int(f.Fd()) == lp.efd {
			file = f
		}
	}
	ran := false
	lp.post(func() { ran = true })
	if !ran {
		t.Error("a function posted to the ended loop did not run")
	}
	if file == nil {
		t.Skipf("no file took the eventfd's number %d", lp.efd)
	}
	if st, err := file.Stat(); err != nil || st.Size() != 0 {
		t.Errorf("a file that took the eventfd's number holds %d bytes after a post (%v), want 0", st.Size(), err)
	}
}
