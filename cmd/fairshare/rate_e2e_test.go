// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/policy"
)

// With rateEnv set to ADDR, the test binary connects to ADDR and resets the
// connection in a tight loop until its stdin closes, printing every 10 ms
// "UNIXNANO OK REFUSED": what the last 10 ms admitted and refused.
const rateEnv = "FAIRSHARE_E2E_RATE"

func rateHelper(addr string) {
	var ok, refused atomic.Int64
	ctx, cancel := context.WithCancel(context.Background())
	go func() { io.Copy(io.Discard, os.Stdin); cancel() }()
	go func() {
		d := net.Dialer{Timeout: time.Second}
		for ctx.Err() == nil {
			c, err := d.Dial("tcp4", addr)
			switch {
			case err == nil:
				ok.Add(1)
				c.(*net.TCPConn).SetLinger(0)
				c.Close()
			case errors.Is(err, syscall.ECONNREFUSED):
				refused.Add(1)
			}
		}
	}()
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	w := bufio.NewWriter(os.Stdout)
	for {
		select {
		case <-ctx.Done():
			os.Exit(0)
		case now := <-t.C:
			fmt.Fprintf(w, "%d %d %d\n", now.UnixNano(), ok.Swap(0), refused.Swap(0))
			w.Flush()
		}
	}
}

// rateLoop is a rateHelper running in a project; windows carries its lines.
type rateLoop struct {
	windows chan rateWindow
	stop    func()
}

type rateWindow struct {
	at          time.Time
	ok, refused int
}

func (n *node) rateLoop(project, addr string) *rateLoop {
	t := n.t
	t.Helper()
	cg := testutil.MkCgroup(t, n.root, project)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self, "-test.run=^$")
	cmd.Env = append(cleanEnv(), rateEnv+"="+addr)
	stdin, out := testutil.Pipes(t, cmd)
	testutil.StartInCgroup(t, cmd, cg)
	r := &rateLoop{windows: make(chan rateWindow, 4096)}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			var ns int64
			var w rateWindow
			if _, err := fmt.Sscanf(sc.Text(), "%d %d %d", &ns, &w.ok, &w.refused); err == nil {
				w.at = time.Unix(0, ns)
				select {
				case r.windows <- w:
				default:
				}
			}
		}
	}()
	r.stop = func() { stdin.Close(); cmd.Wait() }
	t.Cleanup(r.stop)
	return r
}

// until drains the loop's windows from since on and returns the first one
// that cond accepts; it fails the test after 10 s.
func (r *rateLoop) until(t *testing.T, since time.Time, what string, cond func(rateWindow) bool) rateWindow {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case w := <-r.windows:
			if w.at.After(since) && cond(w) {
				return w
			}
		case <-deadline:
			t.Fatalf("%s: not seen within 10 s", what)
		}
	}
}

// A live policy change through the daemon: 'policy set --connections-per-sec'
// puts a project's rate in force in the kernel well within a tick (the
// daemon writes it before the command returns), shown in status and
// metrics as rate limited; 'policy delete' stops the limiting at once.
func TestConnectionRateThroughDaemon(t *testing.T) {
	n := newNode(t, "pools: {connections: {size: 4096}}\n")
	n.start()
	addr := sink(t)
	loop := n.rateLoop("alpha", addr)
	loop.until(t, time.Now(), "alpha connecting, unlimited", func(w rateWindow) bool { return w.ok > 0 && w.refused == 0 })

	before := time.Now()
	if out, errOut, code := n.cli("policy", "set", "--connections-per-sec", "20", "alpha"); code != 0 {
		t.Fatalf("policy set: %d %s %s", code, out, errOut)
	}
	set := time.Now()
	w := loop.until(t, before, "the first refusal after policy set", func(w rateWindow) bool { return w.refused > 0 })
	t.Logf("policy set --connections-per-sec 20: the command took %v, the first refusal came %v after it returned",
		set.Sub(before).Round(time.Millisecond), w.at.Sub(set).Round(time.Millisecond))
	if lag := w.at.Sub(set); lag > time.Second {
		t.Errorf("the rate took effect %v after policy set returned; want within a tick (1s)", lag)
	}
	// Limited: over the next second, 20 admitted (the burst was spent
	// at once) and the rest refused.
	from := w.at.Add(100 * time.Millisecond)
	var got rateWindow
	loop.until(t, from, "a second of limited windows", func(w rateWindow) bool {
		got.ok += w.ok
		got.refused += w.refused
		return w.at.Sub(from) >= time.Second
	})
	if got.ok < 15 || got.ok > 25 || got.refused == 0 {
		t.Errorf("a second at 20/s: %d admitted, %d refused; want 20 ± 5 admitted, the rest refused", got.ok, got.refused)
	}

	eventually(t, func() error {
		p := project(pool(n.status(), "connections"), "alpha")
		if p.RateLimited == 0 || p.Refused != 0 || p.ConnectionsPerSec != 20 {
			return fmt.Errorf("status of alpha: %+v; want rate limited counted, nothing refused, 20/s", p)
		}
		return nil
	})
	m := n.metrics()
	for _, want := range []string{
		`fairshare_project_permits_rate_limited_total{pool="connections",project="alpha"} `,
		`fairshare_pool_rate_limited_total{pool="connections"} `,
	} {
		if !strings.Contains(m, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	if !strings.Contains(n.cliOK(t, "status"), "RATE_LIMITED") {
		t.Error("status has no RATE_LIMITED column")
	}

	before = time.Now()
	if out, errOut, code := n.cli("policy", "delete", "alpha"); code != 0 {
		t.Fatalf("policy delete: %d %s %s", code, out, errOut)
	}
	del := time.Now()
	// The windows after the command returned refuse nothing.
	w = loop.until(t, del.Add(20*time.Millisecond), "a window after policy delete", func(rateWindow) bool { return true })
	var after rateWindow
	loop.until(t, w.at, "half a second after policy delete", func(w rateWindow) bool {
		after.ok += w.ok
		after.refused += w.refused
		return w.at.Sub(del) >= 500*time.Millisecond
	})
	t.Logf("policy delete took %v; in the half second after it returned: %d admitted, %d refused",
		del.Sub(before).Round(time.Millisecond), after.ok, after.refused)
	if after.refused != 0 || after.ok < 50 {
		t.Errorf("after policy delete: %d admitted, %d refused; want the limit gone at once", after.ok, after.refused)
	}
}

func (n *node) cliOK(t *testing.T, args ...string) string {
	t.Helper()
	out, errOut, code := n.cli(args...)
	if code != 0 {
		t.Fatalf("%v: exit %d: %s", args, code, errOut)
	}
	return out
}

// The same through the policies file (a ConfigMap): a rate the file gives
// is in force within a tick of the swap, and a rate the file takes away is
// gone within a tick.
func TestConnectionRateFromPoliciesFile(t *testing.T) {
	cm := testutil.NewConfigMapDir(t)
	write := func(s string) { cm.Write(map[string]string{"policies.yaml": s}) }
	write("{}\n")
	n := newNode(t, "pools: {connections: {size: 4096}}\npolicies_file: "+cm.Path("policies.yaml")+"\n")
	n.start()
	addr := sink(t)
	loop := n.rateLoop("alpha", addr)
	loop.until(t, time.Now(), "alpha connecting, unlimited", func(w rateWindow) bool { return w.ok > 0 && w.refused == 0 })

	swapped := time.Now()
	write("alpha: {connections_per_sec: 20}\n")
	w := loop.until(t, swapped, "the first refusal after the file gave a rate", func(w rateWindow) bool { return w.refused > 0 })
	t.Logf("the file's rate took effect %v after the swap", w.at.Sub(swapped).Round(time.Millisecond))
	if lag := w.at.Sub(swapped); lag > 3*time.Second {
		t.Errorf("the file's rate took effect %v after the swap; want within the file's two reads, a tick apart (2s), and a margin", lag)
	}

	swapped = time.Now()
	write("{}\n")
	w = loop.until(t, swapped, "a window without refusals after the file dropped the rate", func(w rateWindow) bool { return w.refused == 0 && w.ok > 0 })
	t.Logf("the rate the file dropped was gone %v after the swap", w.at.Sub(swapped).Round(time.Millisecond))
	if lag := w.at.Sub(swapped); lag > 3*time.Second {
		t.Errorf("the rate the file dropped was gone %v after the swap; want within two reads (2s) and a margin", lag)
	}
}

// 'policy set --accepts-per-sec' stores the inbound rate apart from
// --connections-per-sec, and the daemon puts both in force in the kernel,
// each in its own bucket, as status shows; the tables show ACCEPTS/S; a
// rate out of bounds is refused with exit 2.
func TestAcceptsPerSecThroughDaemon(t *testing.T) {
	n := newNode(t, "pools: {connections: {size: 64}}\n")
	n.start()
	addr := sink(t)
	n.cliOK(t, "policy", "set", "--connections-per-sec", "5", "--accepts-per-sec", "7", "alpha")
	var e policy.Entry
	if err := json.Unmarshal([]byte(n.cliOK(t, "policy", "get", "--json", "alpha")), &e); err != nil ||
		e.ConnectionsPerSec != 5 || e.AcceptsPerSec != 7 {
		t.Fatalf("policy get: %+v (%v)", e, err)
	}
	if out := n.cliOK(t, "policy", "list"); !strings.Contains(out, "ACCEPTS/S") {
		t.Errorf("policy list has no ACCEPTS/S column:\n%s", out)
	}
	a := n.connectFrom("alpha", addr, 1)
	defer a.close()
	eventually(t, func() error {
		p := project(pool(n.status(), "connections"), "alpha")
		// The kernel keeps a rate as its interval: 1 s / 7 is rounded to a ns.
		if math.Abs(p.ConnectionsPerSec-5) > 1e-6 || math.Abs(p.AcceptsPerSec-7) > 1e-6 {
			return fmt.Errorf("status of alpha: %+v; want 5/s out and 7/s in, in force in the kernel", p)
		}
		return nil
	})
	if _, errOut, code := n.cli("policy", "set", "--accepts-per-sec", "-1", "alpha"); code != 2 {
		t.Errorf("--accepts-per-sec -1: exit %d, want 2: %s", code, errOut)
	}
}
