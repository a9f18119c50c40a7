// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// With churnEnv set to "ADDR WRITERS", the test binary connects to ADDR and
// closes again in WRITERS loops until its stdin closes.
const churnEnv = "FAIRSHARE_E2E_CHURN"

func churnHelper(spec string) {
	addr, wStr, _ := strings.Cut(spec, " ")
	w, _ := strconv.Atoi(wStr)
	ctx, cancel := context.WithCancel(context.Background())
	go func() { io.Copy(io.Discard, os.Stdin); cancel() }()
	var wg sync.WaitGroup
	for range w {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d := net.Dialer{Timeout: time.Second}
			for ctx.Err() == nil {
				if c, err := d.DialContext(ctx, "tcp4", addr); err == nil {
					time.Sleep(time.Millisecond)
					c.Close()
				}
			}
		}()
	}
	wg.Wait()
	os.Exit(0)
}

// sink accepts and drains connections on loopback.
func sink(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return testutil.Sink(t, ln).Addr().String()
}

// Under churn (three projects opening and closing connections as fast as
// they can on a pool of 12), every status is one consistent snapshot per
// pool: before, the kernel pool's in_use came from the node counter read
// apart from the projects' (held 182 against in_use 181), and its active
// count from another source than its share (ACTIVE 0 with SHARE 32). Status
// also shows the reconcile passes.
func TestStatusConsistentUnderChurn(t *testing.T) {
	n := newNode(t, "pools: {connections: {size: 12}}\nreconcile: 1s\n")
	n.start()
	addr := sink(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"alpha", "beta", "gamma"} {
		cg := filepath.Join(n.root, p)
		if err := os.MkdirAll(cg, 0o755); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(self, "-test.run=^$")
		cmd.Env = append(cleanEnv(), churnEnv+"="+addr+" 4", "GORACE=atexit_sleep_ms=0")
		in, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		testutil.StartInCgroup(t, cmd, cg)
		t.Cleanup(func() { in.Close(); cmd.Wait() })
	}
	cl := admin.NewClient(n.sock)
	busy := 0
	for i := range 60 {
		st, err := cl.Status(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range st.Pools {
			if err := p.Consistent(); err != nil {
				t.Fatalf("status %d: %v", i, err)
			}
		}
		if c := pool(st, "connections"); c.InUse > 0 {
			busy++
		}
		time.Sleep(20 * time.Millisecond)
	}
	if busy == 0 {
		t.Fatal("no status saw a connection held: the churn did not run")
	}
	var st admin.Status
	eventually(t, func() error {
		var err error
		if st, err = cl.Status(context.Background()); err != nil {
			return err
		}
		if st.Reconcile == nil || st.Reconcile.Passes < 2 {
			return fmt.Errorf("reconcile in status: %+v", st.Reconcile)
		}
		return nil
	})
	if m := n.metrics(); !strings.Contains(m, "fairshare_reconcile_passes_total") || !strings.Contains(m, "fairshare_reconcile_last_pass_timestamp_seconds") {
		t.Errorf("/metrics lacks the reconcile passes")
	}
	out, _, code := n.cli("status")
	if code != 0 || !strings.Contains(out, "reconcile: last pass at") || !strings.Contains(out, "project sockets in the kernel's table") {
		t.Errorf("status text lacks the last reconcile:\n%s", out)
	}
}

// With the daemon killed, `fairshare status` reads the pinned maps, says so,
// and exits 0 (it exited 1 before, although the kernel kept counting). A
// cgroup named to forge a row (cgroupfs refuses a newline, but not a
// carriage return, an escape sequence that clears the line, or tabs) is no
// project (the name rule refuses it), is not counted, and is printed quoted
// where the live status lists it as refused; the pinned status, which names
// projects from the pins, never shows it.
func TestStatusWithoutDaemonReadsPins(t *testing.T) {
	n := newNode(t, "pools: {connections: {size: 8}}\n")
	n.start()
	addr := sink(t)
	a := n.connectFrom("alpha", addr, 2)
	defer a.close()
	evil := "evil\r\x1b[2Kconnections\tkernel\t8\t1\t999"
	if err := os.Mkdir(filepath.Join(n.root, evil), 0o755); err != nil {
		t.Fatal(err)
	}
	var live string
	eventually(t, func() error {
		if c := pool(n.status(), "connections"); c.InUse != 2 {
			return fmt.Errorf("in use %d", c.InUse)
		}
		if live, _, _ = n.cli("status"); !strings.Contains(live, `evil\r\x1b[2Kconnections\tkernel\t8\t1\t999`) {
			return fmt.Errorf("live status does not list the refused cgroup:\n%s", live)
		}
		return nil
	})
	n.stop(syscall.SIGKILL)

	out, errOut, code := n.cli("status")
	if code != 0 {
		t.Fatalf("status without a daemon: exit %d: %s", code, errOut)
	}
	for _, want := range []string{"no daemon is running", "read from the maps it left pinned", "connections  kernel    8     1      2"} {
		if !strings.Contains(out, want) {
			t.Errorf("status lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "evil") {
		t.Errorf("pinned status shows a cgroup that is no project:\n%s", out)
	}
	for name, text := range map[string]string{"live": live, "pinned": out} {
		if strings.ContainsAny(text, "\r\x1b\t") {
			t.Errorf("%s status prints a raw control character: %q", name, text)
		}
	}
	js, _, code := n.cli("status", "--json")
	var st admin.Status
	if code != 0 || json.Unmarshal([]byte(js), &st) != nil || st.Source != "pins" {
		t.Fatalf("status --json without a daemon: %d %s", code, js)
	}
	if err := pool(st, "connections").Consistent(); err != nil {
		t.Error(err)
	}
	// Nothing pinned and no daemon: exit 1, saying both.
	_, errOut, code = runCLI(t, "status", "--admin-socket", filepath.Join(n.dir, "none.sock"), "--pin-dir", filepath.Join(n.dir, "nopins"))
	if code != 1 || !strings.Contains(errOut, "nothing is pinned") {
		t.Errorf("no daemon, no pins: exit %d %q", code, errOut)
	}
}
