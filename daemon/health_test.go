// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/internal/testutil"
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
