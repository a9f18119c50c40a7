// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/loader"
)

// get answers GET url: the status code and the body.
func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestHealthz runs the daemon (its listeners, its control loop) and asks its
// /healthz while the loop ticks (200), while the loop is stalled on the lock
// of the policies in force, as a hung store write would stall it (503 with
// the reason, and /metrics still answers: the listener is not what failed),
// and once the loop goes on (200 again).
func TestHealthz(t *testing.T) {
	cm := testutil.NewConfigMapDir(t)
	cm.Write(map[string]string{"policies.yaml": "alpha: {shares: 2}\n"})
	const tick = 100 * time.Millisecond
	dir := t.TempDir()
	ready := filepath.Join(dir, "ready.json")
	d, _, _ := newTestDaemon(t, func(c *config.Config) {
		c.Metrics.Listen = "127.0.0.1:0"
		c.Tick = tick
		c.PoliciesFile = cm.Path("policies.yaml")
	})
	d.opts.ReadyFile = ready
	done := make(chan error, 1)
	ctx, cancel := context.WithCancel(context.Background())
	go func() { done <- d.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	var r Ready
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		raw, err := os.ReadFile(ready)
		if err == nil && json.Unmarshal(raw, &r) == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the daemon was not ready within 10s")
		}
	}
	url := "http://" + r.Metrics
	if code, body := get(t, url+"/healthz"); code != http.StatusOK || body != "ok\n" {
		t.Fatalf("/healthz of a running daemon: %d %q", code, body)
	}

	// The loop's next tick waits for the lock (followPolicies).
	d.polMu.Lock()
	locked := true
	defer func() {
		if locked {
			d.polMu.Unlock()
		}
	}()
	stalled := time.Now()
	var code int
	var body string
	for {
		if code, body = get(t, url+"/healthz"); code == http.StatusServiceUnavailable {
			break
		}
		if time.Since(stalled) > staleAfter(tick)+10*time.Second {
			t.Fatalf("/healthz still %d %q %s after the loop stalled", code, body, time.Since(stalled))
		}
		time.Sleep(50 * time.Millisecond)
	}
	// The last tick was at most a tick before the lock.
	if el := time.Since(stalled); el < staleAfter(tick)-tick {
		t.Errorf("/healthz said stalled after %s, before %s", el, staleAfter(tick)-tick)
	}
	if !strings.HasPrefix(body, "control loop stalled: no tick for ") || strings.Count(body, "\n") != 1 {
		t.Errorf("/healthz of a stalled loop: %q, want one line with the reason", body)
	}
	if code, _ := get(t, url+"/metrics"); code != http.StatusOK {
		t.Errorf("/metrics with the loop stalled: %d", code)
	}

	d.polMu.Unlock()
	locked = false
	for start := time.Now(); ; time.Sleep(20 * time.Millisecond) {
		if code, body = get(t, url+"/healthz"); code == http.StatusOK {
			break
		}
		if time.Since(start) > 10*time.Second {
			t.Fatalf("/healthz %d %q 10s after the loop went on", code, body)
		}
	}
}

// TestHeartbeatOutlivesAStalledLoop: the kernel's heartbeat is renewed
// every tick apart from the control loop, so a loop stuck in one tick's work
// (here: an apply waiting on the projects' lock, as a slow source or a long
// reconcile pass would hold it) does not lapse enforcement while the daemon
// runs. Before, only the loop's Tick renewed it, and a loop stalled past
// lapse_after lapsed a running daemon's enforcement.
func TestHeartbeatOutlivesAStalledLoop(t *testing.T) {
	testutil.RequireRoot(t)
	root := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-hb-")
	pin := filepath.Join("/sys/fs/bpf", filepath.Base(root))
	t.Cleanup(func() { loader.Cleanup(pin) })
	const tick = 100 * time.Millisecond
	d, _, _ := newTestDaemon(t, func(c *config.Config) {
		c.BPF, c.PinDir, c.ProjectsRoot, c.Tick = true, pin, root, tick
		c.Projects.Sources = []string{"directory"}
		c.Connections.LapseAfter = 3 * time.Second
	})
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	defer func() {
		cancel()
		<-done
	}()
	eventually(t, func() error {
		if d.health.last.Load() == 0 {
			return errors.New("the control loop has not ticked")
		}
		return nil
	})
	d.projects.applyMu.Lock()
	stalled := time.Now()
	const hold = 2 * time.Second
	worst := time.Duration(0)
	for time.Since(stalled) < hold {
		time.Sleep(tick)
		l, err := d.kernel.lim.Lapse()
		if err != nil {
			d.projects.applyMu.Unlock()
			t.Fatal(err)
		}
		worst = max(worst, l.Age)
	}
	loopAge := time.Since(time.Unix(0, d.health.last.Load()))
	d.projects.applyMu.Unlock()
	if loopAge < hold-tick {
		t.Fatalf("the control loop ticked %s ago: it was not stalled", loopAge)
	}
	// Generous for a loaded machine: a renewal missed by the loop would
	// make it the whole hold.
	if worst > hold/2 {
		t.Errorf("with the control loop stalled for %s the heartbeat grew %s old", hold, worst)
	}
}
