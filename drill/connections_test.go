// SPDX-License-Identifier: Apache-2.0

package drill

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/loader"
)

// TestMain lets the test binary serve as the connections drill's load
// generator: RunConnections re-executes it with LoopEnv set.
func TestMain(m *testing.M) {
	if os.Getenv(LoopEnv) == "1" {
		if err := ConnectLoop(context.Background(), os.Stdin, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestConnectionsDrill runs the drill through the BPF programs, with real
// processes in real cgroups, and checks its verdicts and that nothing is left
// behind.
func TestConnectionsDrill(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: loads BPF programs and creates cgroups")
	}
	if testing.Short() {
		t.Skip("runs for about 8 seconds")
	}
	rep, err := RunConnections(context.Background(), Config{Phase: 2500 * time.Millisecond, Warmup: 300 * time.Millisecond},
		[]string{os.Args[0], "-test.run=^$"})
	if err != nil {
		t.Fatal(err)
	}
	assertReport(t, rep)
	// Nothing left: no pin directory, no cgroup of this process's drill.
	tag := fmt.Sprintf("fairshare-drill-%d", os.Getpid())
	if _, err := os.Stat(filepath.Join("/sys/fs/bpf", tag)); !os.IsNotExist(err) {
		t.Errorf("pin directory left behind: %v", err)
	}
	ents, _ := os.ReadDir(testutil.Cgroup2Mount(t))
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), tag) {
			t.Errorf("cgroup left behind: %s", e.Name())
		}
	}
	checkOutputs(t, rep)
}

func TestConnectionsDrillNeedsRoot(t *testing.T) {
	if os.Geteuid() == 0 {
		t.Skip("only meaningful without root")
	}
	if _, err := RunConnections(context.Background(), Config{}, []string{"true"}); err != ErrNotRoot {
		t.Errorf("err = %v, want ErrNotRoot", err)
	}
}

// TestRemoveStale leaves a drill killed outright would: a pin directory with a
// pinned map and a project cgroup under the drill's cgroup, named after a pid
// that has exited. The next drill removes them, and leaves alone those of a
// drill still running.
func TestRemoveStale(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: pins a map and creates cgroups")
	}
	mount := testutil.Cgroup2Mount(t)
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	mk := func(pid int) (pinDir, cg string) {
		tag := fmt.Sprintf("%s%d", stalePrefix, pid)
		pinDir, cg = filepath.Join(bpffsDir, tag), filepath.Join(mount, tag)
		t.Cleanup(func() {
			if err := loader.Cleanup(pinDir); err != nil {
				t.Error(err)
			}
			testutil.RemoveCgroup(t, cg)
		})
		if err := os.MkdirAll(pinDir, 0o700); err != nil {
			t.Fatal(err)
		}
		m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		if err := m.Pin(filepath.Join(pinDir, "fs_some_map")); err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Join(cg, Small), 0o755); err != nil {
			t.Fatal(err)
		}
		return pinDir, cg
	}
	stalePin, staleCg := mk(dead.Process.Pid)
	livePin, liveCg := mk(os.Getpid())
	removed, err := RemoveStale(bpffsDir, mount)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{stalePin, staleCg} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("stale %s still there: %v", p, err)
		}
		if !slices.Contains(removed, p) {
			t.Errorf("removed %v does not name %s", removed, p)
		}
	}
	for _, p := range []string{livePin, liveCg} {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("a running drill's %s was removed: %v", p, err)
		}
	}
}

// TestConnectLoopChains: the connections drill's load generator reports a
// connection refused before it got in as the drill's writers report a
// request: latency from the first attempt, refusals counted. Nothing
// listens on the port for the first 200 ms, then a server that answers at
// once does.
func TestConnectLoopChains(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	start := time.Now()
	pause := 10 * time.Millisecond
	spec, _ := json.Marshal(loopSpec{Addr: addr, Writers: 1, RetryPause: pause,
		Sends: [][2]int64{{start.UnixNano(), start.Add(time.Second).UnixNano()}}})
	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel() // before wg.Wait: the server stops with ctx
	wg.Add(1)
	go func() {
		defer wg.Done()
		time.Sleep(200 * time.Millisecond)
		l, err := net.Listen("tcp", addr)
		if err != nil {
			t.Errorf("listening again on %s: %v", addr, err)
			cancel()
			return
		}
		go func() { <-ctx.Done(); l.Close() }()
		serveHold(ctx, l, time.Millisecond, &wg)
	}()
	var out bytes.Buffer
	if err := ConnectLoop(ctx, bytes.NewReader(spec), &out); err != nil {
		t.Fatal(err)
	}
	cancel()
	var res []loopResult
	if err := json.Unmarshal(out.Bytes(), &res); err != nil {
		t.Fatal(err)
	}
	if len(res) == 0 || res[0].Status != statusRefused {
		t.Skipf("the load generator's first connection was not refused (it started after the server, on a loaded machine): %+v", res)
	}
	refused := 0
	for _, r := range res {
		switch r.Status {
		case statusRefused:
			refused++
		case statusOK:
			lat := time.Duration(r.Latency)
			if r.Refusals != refused || lat < time.Duration(refused)*pause || r.Sent != res[0].Sent {
				t.Errorf("first connection in: refusals %d (seen %d), latency %v, sent +%v (first attempt +%v); want the chain from the first attempt",
					r.Refusals, refused, lat, time.Unix(0, r.Sent).Sub(start), time.Unix(0, res[0].Sent).Sub(start))
			}
			return
		default:
			t.Fatalf("connection failed: %+v", r)
		}
	}
	t.Fatalf("no connection got in: %+v", res)
}
